"""Errors of the serving layer and their one mapping to OpenAI's HTTP error body.

    APIError                    carries status, type, param, code; rendered as {"error": {...}}
    ├── (from InvalidRequestError)   400 invalid_request_error, `param` names the field
    ├── (from ContextLengthError)    400 context_length_exceeded, both numbers in the message
    ├── ModelNotFoundError           404 model_not_found
    ├── QueueFullError               429 with Retry-After
    ├── QueueTimeoutError            503 with Retry-After: waited past an engine's max_queue_wait_s
    ├── RequestTimeoutError          408 timeout: the request's deadline passed (serving/api/admission/deadlines.py)
    ├── NoWorkerError                503 no replica of a pool is alive
    ├── HealthUnknownError           503 health_unknown: the state /health reports could not be read
    ├── ShedError                    503 with Retry-After: shed by graceful degradation (serving/api/admission/degradation.py)
    ├── (from RequestFailedError)    500 request_failed: this request alone failed in a step
    ├── (from EngineDeadError)       503 engine_dead: the replica's step loop stopped
    └── AuthenticationError          401 invalid_api_key

A 5xx never carries an exception's text (it names our internals: paths, actors, tensors): an
exception the serving layer did not write for clients becomes a generic message here, and the
route adds the request id (`with_request_id`), under which it logs the exception and traceback.
The messages of our own APIErrors (which pool is down, when to retry) are for clients and stay.

Workers never raise across Ray: they return `WorkerError` values (serving/deployments/messages.py),
which the ingress turns back into the engine's exceptions (so a local engine and a remote one fail
the same way), and only the HTTP layer maps exceptions to status codes.
"""

from __future__ import annotations

from serving.engine.errors import ContextLengthError, EngineDeadError, InvalidRequestError, RequestFailedError

__all__ = [
    "APIError",
    "ModelNotFoundError",
    "QueueFullError",
    "QueueTimeoutError",
    "RequestTimeoutError",
    "NoWorkerError",
    "HealthUnknownError",
    "ShedError",
    "AuthenticationError",
    "error_status",
    "to_api_error",
    "with_request_id",
]


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ModelNotFoundError(APIError):
    def __init__(self, model: str, available: list[str]):
        super().__init__(
            404,
            f"The model {model!r} does not exist. Available models: {', '.join(available)}." if available
            else f"The model {model!r} does not exist or you do not have access to it.",
            param="model", code="model_not_found",
        )


class QueueFullError(APIError):
    def __init__(self, pool: str, retry_after_s: int = 1):
        self.pool = pool
        super().__init__(
            429,
            f"The {pool} pool's queues are full; retry after {retry_after_s} s.",
            type="rate_limit_error", code="queue_full",
            headers={"Retry-After": str(retry_after_s)},
        )


class QueueTimeoutError(APIError):
    """An engine finished the request with finish_reason "queue_timeout": it waited longer than
    that pool's `max_queue_wait_s` for its first step, and nothing was generated."""

    def __init__(self, retry_after_s: int = 1):
        super().__init__(
            503,
            f"The request waited longer than the engine's queue limit (max_queue_wait_s) without starting; "
            f"the pool is overloaded. Retry after {retry_after_s} s.",
            type="service_unavailable_error", code="queue_timeout",
            headers={"Retry-After": str(retry_after_s)},
        )


class RequestTimeoutError(APIError):
    """The request's deadline (its `timeout`, or the server's default) passed before it ended. A
    non-streamed request that generated tokens by then carries them in `partial`: the response it
    would have had, with what it got (its choices, its billed usage)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.partial: dict | None = None
        super().__init__(
            408, f"The request did not finish within its timeout of {timeout_s:g} s.", type="timeout", code="timeout",
        )

    def body(self) -> dict:
        body = super().body()
        if self.partial is not None:
            body["partial"] = self.partial
        return body


class NoWorkerError(APIError):
    def __init__(self, pool: str, detail: str = ""):
        self.pool = pool
        message = f"No {pool} replica is alive to serve this request"
        super().__init__(
            503, message + (f": {detail}" if detail else "") + "; retry once the pool has recovered.",
            type="service_unavailable_error", code="no_worker",
        )


class HealthUnknownError(APIError):
    """/health could not read what it reports (the Serve controller's replica states): unhealthy,
    not healthy by default."""

    def __init__(self, detail: str):
        super().__init__(
            503, f"The pools' health is unknown: {detail}.", type="service_unavailable_error", code="health_unknown",
        )


class ShedError(APIError):
    """A request graceful degradation refused because its priority is low while the pools are
    saturated or down; `x-kvrelay-degraded` names which."""

    def __init__(self, reason: str, priority: int, threshold: int, retry_after_s: int):
        super().__init__(
            503,
            f"The pools are {reason}: requests with priority >= {threshold} are shed first (lower "
            f"values are more important; this one has {priority}). Retry after {retry_after_s} s.",
            type="service_unavailable_error", code="request_shed",
            headers={"Retry-After": str(retry_after_s), "x-kvrelay-degraded": reason},
        )


class AuthenticationError(APIError):
    def __init__(self, message: str):
        super().__init__(401, message, type="invalid_request_error", code="invalid_api_key")


def to_api_error(exc: BaseException) -> APIError:
    """The one place an exception becomes an HTTP status."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthError):
        return APIError(400, exc.message, param=exc.param, code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, f"{exc.param}: {exc.message}", param=exc.param, code="invalid_value")
    # Past here the exception's text is for the log, never the client (the module docstring).
    if isinstance(exc, RequestFailedError):
        return APIError(500, "This request failed in the engine; no other request was affected.", type="internal_error", code="request_failed")
    if isinstance(exc, EngineDeadError):
        return APIError(503, "The engine serving this request stopped; retry once it has recovered.", type="service_unavailable_error", code="engine_dead")
    return APIError(500, "The server had an error while processing this request.", type="internal_error")


def with_request_id(error: APIError, request_id: str) -> APIError:
    """`error` as the client gets it: a 5xx names the request id its exception is logged under."""
    if error.status < 500:
        return error
    return APIError(
        error.status, f"{error.message} (request id: {request_id})", type=error.type, param=error.param,
        code=error.code, headers=error.headers,
    )


def error_status(exc: BaseException) -> int:
    """The HTTP status a request failing with `exc` answers."""
    return to_api_error(exc).status
