"""LocalBackend: the Frontend's Backend over an in-process AsyncEngine (no Ray).

For embedding the API in a process of one's own, for unit tests of the HTTP layer, and as the
in-process reference the serving-overhead benchmark compares the Serve path against.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from serving.api.backend import GenerateRequest
from serving.api.errors import NoWorkerError
from serving.deployments.messages import engine_request
from serving.engine.async_engine import AsyncEngine
from serving.engine.outputs import RequestOutput
from serving.engine.validation import ModelInfo
from serving.observability import tracing
from serving.observability.request_path import PATHS

__all__ = ["LocalBackend"]


class LocalBackend:
    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    async def model_info(self) -> ModelInfo:
        return self.engine.model_info()

    async def check_adapter(self, name: str, path: str) -> None:
        await self.engine.check_adapter(name, path)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        if not self.engine.is_alive:
            raise NoWorkerError("engine", "its step loop has stopped")
        trace = tracing.continue_trace(request.trace_context, "local", request.request_id)
        path = PATHS.find(request.request_id)  # its TTFT split (the engine runs on this clock)
        last: RequestOutput | None = None
        try:
            # Closed explicitly, not left to garbage collection: closing it is what aborts the request.
            async with aclosing(self.engine.generate(engine_request(request))) as outputs:
                async for out in outputs:
                    if last is None and path is not None:
                        path.computed("local", out, None, time.monotonic())
                    last = out
                    yield out
        finally:
            if trace is not None:
                trace.engine_stages(last.metrics if last else None, prefill=True, decode=True, aborted=last is None or not last.finished)

    async def health(self) -> dict[str, Any]:
        if not self.engine.is_alive:
            raise NoWorkerError("engine", "its step loop has stopped")
        return {"engine": {"RUNNING": 1}}
