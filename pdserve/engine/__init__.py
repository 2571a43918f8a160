"""pdserve.engine: the model runtime both worker roles share.

Public API: ``from pdserve.engine import LLM, SamplingParams``.

The names below load their module at first use (PEP 562): a command that only parses a
request or reads a config (``pdserve status``, ``down``, the gateway's CLI) does not pay for
torch's import (about a second), and importing a submodule (``pdserve.engine.cli``) does not
load the rest of the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_WHERE = {
    "ConfigError": "config", "EngineConfig": "config", "ModelConfig": "config",
    "EngineLoad": "engine_types", "EngineStateError": "engine_types", "EngineStats": "engine_types",
    "RequestDelta": "engine_types", "StepError": "engine_types",
    "KVConnector": "kv_connector", "Reservation": "kv_connector",
    "LLMEngine": "llm_engine", "LoRAError": "lora", "LoRARequest": "lora_request", "LLM": "offline",
    "InvalidRequestError": "request", "Request": "request", "RequestLimits": "request", "RequestOutput": "request",
    "RequestStatus": "request", "RequestTimes": "request", "SamplingParams": "request", "check_text": "request",
    "GrammarCompiler": "structured", "GrammarSpec": "structured_spec", "parse_structured_outputs": "structured_spec",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'pdserve.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # (later lookups do not come here)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


if TYPE_CHECKING:
    from .config import ConfigError, EngineConfig, ModelConfig
    from .engine_types import EngineLoad, EngineStateError, EngineStats, RequestDelta, StepError
    from .kv_connector import KVConnector, Reservation
    from .llm_engine import LLMEngine
    from .lora import LoRAError
    from .lora_request import LoRARequest
    from .offline import LLM
    from .request import (InvalidRequestError, Request, RequestLimits, RequestOutput, RequestStatus, RequestTimes,
                          SamplingParams, check_text)
    from .structured import GrammarCompiler
    from .structured_spec import GrammarSpec, parse_structured_outputs
