"""pdserve.engine: the model runtime both worker roles share.

Public API: ``from pdserve.engine import LLM, SamplingParams``.
"""

from .config import ConfigError, EngineConfig, ModelConfig
from .llm_engine import LLM, EngineStats, LLMEngine, RequestDelta
from .request import InvalidRequestError, Request, RequestOutput, RequestStatus, SamplingParams

__all__ = [
    "LLM", "LLMEngine", "EngineConfig", "ModelConfig", "SamplingParams", "RequestOutput",
    "Request", "RequestStatus", "RequestDelta", "EngineStats", "ConfigError", "InvalidRequestError",
]
