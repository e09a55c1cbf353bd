"""Errors the engine raises.

    EngineError
    ├── InvalidRequestError   a request is malformed; names the field and the limit (HTTP 400)
    │   └── ContextLengthError the prompt (plus max_tokens) does not fit the context window
    ├── ModelLoadError        the model cannot be found, read or is of an unsupported architecture
    ├── RequestFailedError    one request failed inside a step (its sampling, its KV import, ...);
    │                         it alone ends, the batch goes on (HTTP 500)
    └── EngineDeadError       the step loop died; no further requests are accepted (HTTP 503)

Back-pressure (no free KV blocks, queue full) is not an error: the scheduler returns it as a value.
"""

from __future__ import annotations

__all__ = [
    "EngineError",
    "InvalidRequestError",
    "ContextLengthError",
    "ModelLoadError",
    "RequestFailedError",
    "EngineDeadError",
]


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request field is invalid. `param` names the field (OpenAI's error `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


class ContextLengthError(InvalidRequestError):
    """The request needs more tokens than the context window (or the KV cache) holds."""

    def __init__(self, param: str, message: str, *, num_tokens: int, limit: int):
        super().__init__(param, message)
        self.num_tokens = num_tokens
        self.limit = limit


class ModelLoadError(EngineError):
    """The model could not be loaded; the message says what to change."""


class RequestFailedError(EngineError):
    """One request failed inside a step; the engine and every other request go on."""

    def __init__(self, message: str, *, request_id: str = "", stage: str = ""):
        super().__init__(message)
        self.request_id = request_id
        self.stage = stage

    @classmethod
    def caused_by(cls, request_id: str, stage: str, cause: BaseException) -> RequestFailedError:
        return cls(
            f"request {request_id} failed in the engine's {stage}: {type(cause).__name__}: {cause}; "
            "no other request was affected",
            request_id=request_id, stage=stage,
        )


class EngineDeadError(EngineError):
    """The engine's step loop failed; the engine must be restarted."""
