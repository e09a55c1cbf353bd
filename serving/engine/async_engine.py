"""AsyncEngine: LLMEngine driven by one background thread, for asyncio callers (Serve replicas);
kvrelay's own engine behind the engine contract (contract.EngineClient).

    asyncio callers ──commands (add / abort / export)──▶ inbox ──▶ step thread: LLMEngine.step()
          ▲                                                               │
          └──── per-request asyncio.Queue ◀── loop.call_soon_threadsafe ──┘

Only the step thread touches the LLMEngine, so it needs no locks. Torch releases the GIL inside
its kernels, so the event loop keeps serving while a step runs. A caller that stops iterating
(client disconnect, cancellation) aborts its request, and the blocks are freed at once.

A step's outputs reach each event loop in one wake-up (one `call_soon_threadsafe` per loop and
step, not per request: with 16 streams, 15 self-pipe writes and loop wake-ups fewer). A caller
slower than the steps does not fall behind a queue of single-token outputs: the outputs waiting
for it are merged into one (deltas concatenated, `merge_outputs`), so it gets everything so far
in one item. Nothing is held back to be merged: a caller gets whatever has arrived when it asks.

Callers come and go at any moment; the step thread never depends on one still being there:
- a command runs whether or not its caller still waits (a cancelled `release_kv` still releases),
  and its result is dropped if the caller has gone;
- a cancelled `generate` queues an abort behind its own add, so the request never runs unread;
- delivering to an event loop that has closed drops the delivery.
A request that fails on its own in a step (LLMEngine.take_failures) gets its RequestFailedError
(or InvalidRequestError: its grammar did not compile, its adapter went bad while it waited);
any other exception ends the loop: every open stream and every queued or later call gets
EngineDeadError, and `is_alive` turns False so the replica's health check fails.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from serving.engine.config import EngineConfig
from serving.engine.contract import EngineRequest, KVExportTarget
from serving.engine.engine import LLMEngine
from serving.engine.errors import EngineDeadError
from serving.engine.kv.events import KVEvent
from serving.engine.kv.payload import KVPayload
from serving.engine.outputs import EngineStats, RequestOutput, merge_outputs
from serving.engine.validation import ModelInfo

__all__ = ["AsyncEngine"]

logger = logging.getLogger(__name__)

_STOP = object()


class AsyncEngine:
    def __init__(self, engine: LLMEngine | EngineConfig | None = None):
        self.engine = engine if isinstance(engine, LLMEngine) else LLMEngine(engine)
        # kvrelay's cache is in this process: an export is read out into a view of the arena
        # range when the cache is in host memory
        self.kv_export_target = KVExportTarget.HOST_TENSOR if self.engine.kv.exports_to_host else KVExportTarget.NONE
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._kv_subscribers: list[Callable[[list[KVEvent]], None]] = []
        self._stats = self.engine.stats()
        self._error: BaseException | None = None
        # A grammar that finished compiling wakes the loop, which may be waiting with nothing else to do.
        self.engine.compiling.on_ready = lambda: self._inbox.put(("wake",))
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
        """The snapshot taken after the latest step or command (never blocks)."""
        return self._stats

    def model_info(self) -> ModelInfo:
        return self.engine.model_info()

    def kv_payload_bytes(self, num_tokens: int) -> int:
        return self.engine.kv_payload_bytes(num_tokens)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Add a request (LLMEngine.add) and yield its outputs as they come. The engine's
        refusals raise here, before the first output. Leaving the iteration early aborts the
        request.
        """
        request_id = request.request_id
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, stream)
        try:
            await self._call(lambda engine: engine.add(request))
        except asyncio.CancelledError:
            # The add is queued and runs anyway: abort it right behind, or nobody reads it.
            self._streams.pop(request_id, None)
            self._inbox.put(("abort", request_id))
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        finished = False
        held: BaseException | None = None  # an error taken off the queue while coalescing
        try:
            while not finished:
                item = held if held is not None else await stream.get()
                if isinstance(item, BaseException):
                    raise item
                item, held = _coalesce(item, stream)
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
        payload = self.engine.held_kv.take_ready(request_id)
        if payload is None:
            return await self._call(lambda engine: engine.export_kv(request_id, release=release))
        if release:
            self._inbox.put(("release", request_id))
        return payload

    async def release_kv(self, request_id: str) -> bool:
        return await self._call(lambda engine: engine.release_kv(request_id))

    def release_kv_soon(self, request_id: str) -> None:
        """Queue a release without waiting for it (safe in a `finally` that may be cancelled)."""
        self._inbox.put(("release", request_id))

    def subscribe_kv_events(self, callback: Callable[[list[KVEvent]], None]) -> None:
        """`callback(events)` runs on the step thread after each step that changed the cache."""
        self._kv_subscribers.append(callback)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._inbox.put(_STOP)
        self._thread.join(timeout_s)

    async def check_adapter(self, name: str, path: str) -> None:
        """LLMEngine.check_adapter, in a thread of its own: reading an adapter (from a network
        volume, say) must not pause the step loop."""
        await asyncio.to_thread(self.engine.check_adapter, name, path)

    # ---- internals ---------------------------------------------------------------------------
    async def _call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped: {self._error!r}") from self._error
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", fn, future))
        if self._error is not None:
            # The loop died between the check and the put, and may have drained the inbox
            # already: drain it again, so this call is answered.
            self._fail_pending(self._dead_error())
        return await asyncio.wrap_future(future)

    def _dead_error(self) -> EngineDeadError:
        return EngineDeadError(f"the engine stopped: {self._error!r}")

    def _handle(self, command) -> bool:
        if command is _STOP:
            return False
        if command[0] == "abort":
            self.engine.abort_request(command[1])
        elif command[0] == "release":
            self.engine.release_kv(command[1])
        elif command[0] == "wake":
            pass  # the step after it queues what a compiled grammar let go
        else:
            _, fn, future = command
            try:
                result = fn(self.engine)
            except Exception as exc:  # handed to the caller, never swallowed
                self._stats = self.engine.stats()
                _deliver(future, error=exc)
            else:
                self._stats = self.engine.stats()  # what the caller sees once it has its result
                _deliver(future, result)
        return True

    def _run(self) -> None:
        engine = self.engine
        decoded: tuple[float, int] | None = None  # (start, sequences) of the last step, if it was a decode step
        try:
            while True:
                # Block when idle, or stalled (waiting on blocks that only a command can free, or
                # until a waiting request's max_queue_wait_s runs out); otherwise take what has
                # arrived and step.
                if not engine.has_unfinished_requests() or engine.is_stalled:
                    decoded = None  # a wait for work is not part of a step's period
                    wait_s = engine.scheduler.seconds_to_queue_timeout() if engine.is_stalled else None
                    try:
                        command = self._inbox.get(timeout=wait_s)
                    except queue.Empty:
                        command = None  # a waiting request timed out: the step finishes it
                    if command is not None and not self._handle(command):
                        return
                while True:
                    try:
                        command = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    if not self._handle(command):
                        return
                if engine.has_unfinished_requests():
                    started = time.perf_counter()
                    if decoded is not None:  # the last decode step's period ends as this step starts
                        engine.decode_steps.add(started - decoded[0], decoded[1])
                    outputs = engine.step()
                    decoded = (started, engine.stepper.last_decode_rows) if engine.stepper.last_decode_rows else None
                    self._stats = engine.stats()  # before the outputs: a caller that sees its end sees it
                    self._publish(outputs)
                    for failure in engine.take_failures():
                        self._send(failure.request_id, failure)
                else:
                    # Commands alone (a release on an idle engine frees blocks too): the snapshot
                    # is current when the loop waits.
                    self._stats = engine.stats()
                events = engine.take_kv_events()
                if events:
                    self._notify(events)
        except BaseException as exc:
            logger.exception("engine step loop died")
            self._error = exc
            dead = self._dead_error()
            for request_id in list(self._streams):
                self._send(request_id, dead)
            self._fail_pending(dead)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs over: one wake-up per event loop (the streams of one replica
        share its loop), not one per request."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is not None:  # else its caller has gone
                by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, deliveries in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, deliveries)
            except RuntimeError:  # its event loop has closed
                for request_id in [rid for rid, (lp, _) in list(self._streams.items()) if lp is loop]:
                    self._streams.pop(request_id, None)

    def _send(self, request_id: str, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return  # its caller has gone
        loop, stream = target
        try:
            loop.call_soon_threadsafe(stream.put_nowait, item)
        except RuntimeError:  # its event loop has closed
            self._streams.pop(request_id, None)

    def _notify(self, events: list[KVEvent]) -> None:
        for callback in self._kv_subscribers:
            try:
                callback(events)
            except Exception:  # noqa: BLE001 - a subscriber's bug must not stop the engine
                logger.exception("a KV event subscriber failed")

    def _fail_pending(self, error: BaseException) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command is not _STOP and command[0] == "call":
                _deliver(command[2], error=error)


def _put_all(deliveries: list[tuple[asyncio.Queue, Any]]) -> None:
    for stream, item in deliveries:
        stream.put_nowait(item)


def _coalesce(item: RequestOutput, stream: asyncio.Queue) -> tuple[RequestOutput, BaseException | None]:
    """`item` with the outputs queued behind it merged in (a reader slower than the steps gets
    everything so far at once), and the error that ended the merge, if one did (raised after
    the merged output is yielded). Nothing follows a finished output."""
    merged: RequestOutput | None = None
    while not item.finished and not stream.empty():
        nxt = stream.get_nowait()
        if isinstance(nxt, BaseException):
            return (merged or item), nxt
        merged = merge_outputs(merged if merged is not None else merge_outputs(None, item), nxt)
        item = merged
    return item, None


def _deliver(future: concurrent.futures.Future, result: Any = None, error: BaseException | None = None) -> None:
    """Complete a caller's future unless the caller has cancelled it (then nobody waits)."""
    if future.cancelled():
        return
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass  # cancelled between the check and the set
