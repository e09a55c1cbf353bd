"""kvrelay's inference engine: paged KV cache, continuous batching, prefix caching, sampling."""

from serving.engine.config import EngineConfig
from serving.engine.engine import LLMEngine
from serving.engine.errors import (
    ContextLengthError,
    EngineDeadError,
    EngineError,
    InvalidRequestError,
    ModelLoadError,
    RequestFailedError,
)
from serving.engine.kv_payload import KVLayout, KVPayload
from serving.engine.outputs import CompletionOutput, EngineStats, RequestOutput, TokenLogprob
from serving.engine.params import SamplingParams

__all__ = [
    "CompletionOutput",
    "ContextLengthError",
    "EngineConfig",
    "EngineDeadError",
    "EngineError",
    "EngineStats",
    "InvalidRequestError",
    "KVLayout",
    "KVPayload",
    "LLMEngine",
    "ModelLoadError",
    "RequestFailedError",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
]
