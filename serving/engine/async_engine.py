"""AsyncEngine: LLMEngine driven by one background thread, for asyncio callers (Serve replicas).

    asyncio callers ──commands (add / abort / export)──▶ inbox ──▶ step thread: LLMEngine.step()
          ▲                                                               │
          └──── per-request asyncio.Queue ◀── loop.call_soon_threadsafe ──┘

Only the step thread touches the LLMEngine, so it needs no locks. Torch releases the GIL inside
its kernels, so the event loop keeps serving while a step runs. A caller that stops iterating
(client disconnect, cancellation) aborts its request, and the blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from serving.engine.config import EngineConfig
from serving.engine.engine import EngineStats, LLMEngine
from serving.engine.errors import EngineDeadError
from serving.engine.kv_events import KVEvent
from serving.engine.kv_transfer import KVPayload
from serving.engine.outputs import RequestOutput

__all__ = ["AsyncEngine"]

logger = logging.getLogger(__name__)

_STOP = object()


class AsyncEngine:
    def __init__(self, engine: LLMEngine | EngineConfig | None = None):
        self.engine = engine if isinstance(engine, LLMEngine) else LLMEngine(engine)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._kv_subscribers: list[Callable[[list[KVEvent]], None]] = []
        self._stats = self.engine.stats()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvrelay-engine", daemon=True)
        self._thread.start()

    # ---- public API --------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def is_alive(self) -> bool:
        return self._error is None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step (never blocks)."""
        return self._stats

    async def generate(self, request_id: str, **kwargs: Any) -> AsyncIterator[RequestOutput]:
        """Add a request (kwargs as LLMEngine.add_request) and yield its outputs as they come.

        Validation errors raise here, before the first output. Leaving the iteration early
        aborts the request.
        """
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, stream)
        try:
            await self._call(lambda engine: engine.add_request(request_id, **kwargs))
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._inbox.put(("abort", request_id))

    async def abort(self, request_id: str) -> bool:
        return await self._call(lambda engine: engine.abort_request(request_id))

    async def export_kv(self, request_id: str, *, release: bool = True) -> KVPayload:
        """The KV of a finished `hold_kv` request. The payload was read out on the step thread
        when the prompt finished, so it is handed over at once, not after the step now running
        (on a prefill worker, a long prompt's chunk: hundreds of ms); releasing the blocks is
        queued like an abort."""
        payload = self.engine.take_ready_export(request_id)
        if payload is None:
            return await self._call(lambda engine: engine.export_kv(request_id, release=release))
        if release:
            self._inbox.put(("release", request_id))
        return payload

    async def release_kv(self, request_id: str) -> bool:
        return await self._call(lambda engine: engine.release_kv(request_id))

    def subscribe_kv_events(self, callback: Callable[[list[KVEvent]], None]) -> None:
        """`callback(events)` runs on the step thread after each step that changed the cache."""
        self._kv_subscribers.append(callback)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._inbox.put(_STOP)
        self._thread.join(timeout_s)

    # ---- internals ---------------------------------------------------------------------------
    async def _call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped: {self._error!r}") from self._error
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", fn, future))
        return await asyncio.wrap_future(future)

    def _handle(self, command) -> bool:
        if command is _STOP:
            return False
        if command[0] == "abort":
            self.engine.abort_request(command[1])
        elif command[0] == "release":
            self.engine.release_kv(command[1])
        else:
            _, fn, future = command
            try:
                future.set_result(fn(self.engine))
            except BaseException as exc:  # handed to the caller, never swallowed
                future.set_exception(exc)
        return True

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                # Block when idle, or stalled (waiting on blocks that only a command can free);
                # otherwise take what has arrived and step.
                if not engine.has_unfinished_requests() or engine.is_stalled:
                    if not self._handle(self._inbox.get()):
                        return
                while True:
                    try:
                        command = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    if not self._handle(command):
                        return
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    self._stats = engine.stats()
                    self._publish(outputs)
                    events = engine.take_kv_events()
                    if events:
                        for callback in self._kv_subscribers:
                            callback(events)
        except BaseException as exc:
            logger.exception("engine step loop died")
            self._error = exc
            dead = EngineDeadError(f"the engine stopped: {exc!r}")
            for loop, stream in list(self._streams.values()):
                loop.call_soon_threadsafe(stream.put_nowait, dead)
            self._fail_pending(dead)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is not None:
                loop, stream = target
                loop.call_soon_threadsafe(stream.put_nowait, out)

    def _fail_pending(self, error: BaseException) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command is not _STOP and command[0] == "call":
                command[2].set_exception(error)
