"""A call to a worker pool through a Serve deployment handle (serve_backend.py makes them): the
request as it leaves, the wait for its answer or its placement, what its errors mean, and
cancelling it.

    routed(request) ──▶ handle.method.remote(...) ──▶ await_call(response, pool)
                                                        BackPressureError     → QueueFullError (429)
                                                        the replica is lost   → NoWorkerError (503)
                                                        the caller cancelled  → the call cancelled

A replica's own exceptions come back inside the response (WorkerError), never as one of these.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import grpc
import ray
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RequestCancelledError

from serving.api.errors import NoWorkerError, QueueFullError
from serving.deployments.messages import WorkerRequest
from serving.observability.tracing import ROUTE_START_KEY

__all__ = ["await_call", "cancel", "placed", "replica_lost", "routed"]

logger = logging.getLogger(__name__)

_ACTOR_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, DeploymentUnavailableError)
# On Serve's gRPC transport (ray.grpc_transport) Serve maps only UNAVAILABLE to
# ActorUnavailableError; a call the replica's end broke otherwise (its server cancelling on
# shutdown, a reset stream) surfaces as the raw AioRpcError.
_LOST_CALL_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
                              grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED})


def replica_lost(exc: BaseException | None) -> bool:
    """Whether a worker call ended because its replica (or the channel to it) went away."""
    if isinstance(exc, _ACTOR_ERRORS):
        return True
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in _LOST_CALL_CODES


def routed(request: WorkerRequest) -> WorkerRequest:
    """With tracing, a copy stamped with when this handle call starts: the worker ends the
    route span when the call reaches it (serving/observability/tracing.py)."""
    if request.trace_context is None:
        return request
    return replace(request, trace_context={**request.trace_context, ROUTE_START_KEY: str(time.time_ns())})


async def await_call(response, pool: str, on_cancel: Callable[[Any], None] | None = None):
    """The answer of a unary handle call to `pool`; a caller that is cancelled meanwhile cancels
    the call (or hands it to `on_cancel`)."""
    try:
        return await response
    except BackPressureError as exc:
        raise QueueFullError(pool) from exc
    except (asyncio.CancelledError, RequestCancelledError):
        (on_cancel or cancel)(response)
        raise
    except Exception as exc:
        if not replica_lost(exc):
            raise
        raise NoWorkerError(pool, type(exc).__name__) from exc


async def placed(stream) -> None:
    """Wait until Serve has placed a streamed handle call on a replica (a free slot, or a place in
    its queue); raises BackPressureError when the pool's queue is full. A private method of
    DeploymentResponseGenerator: it has no public one that waits for only this (the DeveloperAPI
    `_to_object_ref_gen` needs by-reference calls); tests/serving/deployments/test_serve_backend.py
    checks that the pinned Ray has it."""
    await stream._fetch_future_result_async()


def cancel(response) -> None:
    """Cancel a handle call we are abandoning (the replica aborts it and frees its blocks).
    Best effort: a call that already failed re-raises its error from cancel()."""
    try:
        response.cancel()
    except Exception as exc:  # noqa: BLE001 - it ended on its own; nothing left to cancel
        logger.debug("cancel of %s: %s", response, exc)
