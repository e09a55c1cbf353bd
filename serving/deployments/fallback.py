"""The fallback's transport: a Serve handle to another kvrelay app's ingress, checked for a running
replica before each call (serving/api/admission/forwarding.py has the request and response shapes, and
how each app runs and relays them; serving/api/admission/degradation.py decides when).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from serving.api.admission.forwarding import FallbackUnavailable, ForwardedRequest, ResponseStart
from serving.observability.export import serve_pool_status

__all__ = ["INGRESS_DEPLOYMENT", "FallbackClient"]

logger = logging.getLogger(__name__)

INGRESS_DEPLOYMENT = "OpenAIIngress"


def _ingress_handle(app_name: str):
    """The fallback app's ingress handle (blocking: asks the controller that it exists)."""
    from ray import serve

    return serve.get_deployment_handle(INGRESS_DEPLOYMENT, app_name=app_name)


def _running_ingress_replicas(app_name: str) -> int:
    """RUNNING replicas of the app's ingress, from the Serve controller's details (blocking; read
    as serve_backend._serve_status reads them)."""
    states, _ = serve_pool_status(app_name).get(INGRESS_DEPLOYMENT, ({}, None))
    return states.get("RUNNING", 0)


class FallbackClient:
    """Opens forwarded requests to one app's ingress. A handle call to an app that is gone would
    wait for a replica forever, so each call first checks (the controller's view, refreshed once
    older than `status_ttl_s`) that the app's ingress has a running replica."""

    def __init__(
        self,
        app_name: str,
        *,
        get_handle: Callable[[str], Any] = _ingress_handle,
        running_replicas: Callable[[str], int] = _running_ingress_replicas,
        status_ttl_s: float = 1.0,
    ):
        self.app_name = app_name
        self._get_handle = get_handle
        self._running_replicas = running_replicas
        self._status_ttl_s = status_ttl_s
        self._handle = None
        self._num_running = 0
        self._status_time = float("-inf")

    async def open(self, request: ForwardedRequest) -> tuple[ResponseStart, AsyncIterator[bytes]]:
        """The fallback's status line and headers, and its body to come. A stream answers once
        its first token is out, so a failure before it is still an HTTP status."""
        await self._check_up()
        try:
            if self._handle is None:
                self._handle = await asyncio.to_thread(self._get_handle, self.app_name)
            stream = self._handle.options(stream=True).forward.remote(request)
        except Exception as exc:
            raise FallbackUnavailable(f"no handle to app {self.app_name!r}: {type(exc).__name__}: {exc}") from exc
        try:
            start = await anext(stream)
        except StopAsyncIteration:
            raise FallbackUnavailable(f"app {self.app_name!r} ended its response before its status line") from None
        except asyncio.CancelledError:
            _cancel(stream)
            raise
        except Exception as exc:
            _cancel(stream)
            raise FallbackUnavailable(f"app {self.app_name!r} failed: {type(exc).__name__}: {exc}") from exc
        assert isinstance(start, ResponseStart), f"a forwarded response starts with its status, got {type(start).__name__}"
        return start, _rest(stream)

    async def _check_up(self) -> None:
        if time.monotonic() - self._status_time >= self._status_ttl_s:
            try:
                self._num_running = await asyncio.to_thread(self._running_replicas, self.app_name)
            except Exception as exc:  # noqa: BLE001 - the controller being slow must not hang us
                logger.warning("could not read the Serve status of fallback app %r (%s)", self.app_name, exc)
                self._num_running = 0
            self._status_time = time.monotonic()
        if self._num_running == 0:
            raise FallbackUnavailable(f"app {self.app_name!r} has no running {INGRESS_DEPLOYMENT} replica")


async def _rest(stream) -> AsyncIterator[bytes]:
    is_open = True
    try:
        async for chunk in stream:
            yield chunk
        is_open = False
    finally:
        if is_open:
            _cancel(stream)


def _cancel(stream) -> None:
    try:
        stream.cancel()
    except Exception as exc:  # noqa: BLE001 - it ended on its own; nothing left to cancel
        logger.debug("cancel of %s: %s", stream, exc)
