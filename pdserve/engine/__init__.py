"""pdserve.engine: the model runtime both worker roles share.

Public API: ``from pdserve.engine import LLM, SamplingParams``.
"""

from .config import ConfigError, EngineConfig, ModelConfig
from .engine_types import EngineLoad, EngineStateError, EngineStats, RequestDelta, StepError
from .kv_connector import KVConnector, Reservation
from .llm_engine import LLMEngine
from .lora import LoRAError
from .lora_request import LoRARequest
from .offline import LLM
from .request import (
                      InvalidRequestError,
                      Request,
                      RequestLimits,
                      RequestOutput,
                      RequestStatus,
                      RequestTimes,
                      SamplingParams,
                      check_text,
)
from .structured import GrammarCompiler
from .structured_spec import GrammarSpec, parse_structured_outputs

__all__ = [
    "LLM", "LLMEngine", "EngineConfig", "ModelConfig", "SamplingParams", "RequestOutput",
    "Request", "RequestStatus", "RequestDelta", "EngineLoad", "EngineStats", "ConfigError", "InvalidRequestError",
    "RequestLimits", "RequestTimes", "EngineStateError", "StepError", "check_text", "KVConnector", "Reservation",
    "GrammarCompiler", "GrammarSpec", "parse_structured_outputs", "LoRARequest", "LoRAError",
]
