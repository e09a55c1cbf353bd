"""kvrelay's inference engine: paged KV cache, continuous batching, prefix caching, sampling.

The names below load on first use (PEP 562), so `import serving.engine.kv.events` or
`serving.engine.strict` (the router, the autoscaling policy, the CLI) does not pull in torch and
the model code."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "EngineConfig": "serving.engine.config",
    "EngineClient": "serving.engine.contract",
    "EngineRequest": "serving.engine.contract",
    "LLMEngine": "serving.engine.engine",
    "ContextLengthError": "serving.engine.errors",
    "EngineDeadError": "serving.engine.errors",
    "EngineError": "serving.engine.errors",
    "InvalidRequestError": "serving.engine.errors",
    "ModelLoadError": "serving.engine.errors",
    "RequestFailedError": "serving.engine.errors",
    "KVLayout": "serving.engine.kv.payload",
    "KVPayload": "serving.engine.kv.payload",
    "CompletionOutput": "serving.engine.outputs",
    "EngineStats": "serving.engine.outputs",
    "RequestOutput": "serving.engine.outputs",
    "TokenLogprob": "serving.engine.outputs",
    "SamplingParams": "serving.engine.params",
}

__all__ = [
    "CompletionOutput", "ContextLengthError", "EngineClient", "EngineConfig", "EngineDeadError", "EngineError",
    "EngineRequest", "EngineStats",
    "InvalidRequestError", "KVLayout", "KVPayload", "LLMEngine", "ModelLoadError", "RequestFailedError",
    "RequestOutput", "SamplingParams", "TokenLogprob",
]

if TYPE_CHECKING:
    from serving.engine.config import EngineConfig
    from serving.engine.contract import EngineClient, EngineRequest
    from serving.engine.engine import LLMEngine
    from serving.engine.errors import (
        ContextLengthError,
        EngineDeadError,
        EngineError,
        InvalidRequestError,
        ModelLoadError,
        RequestFailedError,
    )
    from serving.engine.kv.payload import KVLayout, KVPayload
    from serving.engine.outputs import CompletionOutput, EngineStats, RequestOutput, TokenLogprob
    from serving.engine.params import SamplingParams


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'serving.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
