"""EngineWorker: what a PrefillWorker, DecodeWorker or colocated Worker replica does.

A prefill worker is the same engine asked for one token and a KV export:

    prefill(request)   add_request(max_tokens=1, hold_kv=True) → first token
                       → PrefillResult(first token output, KVHandle)      (returned now)
                       then, in the background: export_kv → ray.put → offer(ref, lease) to this
                       node's KVTransfer actor

    generate(request, kv, prior)
                       claim(kv) from its KVTransfer actor, which waits for the offer (bounded
                       by kv_transfer.timeout_s)
                       → add_request(kv_payload=..., prior_output_token_ids=prior) → stream outputs
                       claim failed or timed out → add_request(prior_output_token_ids=prior):
                       the prompt is recomputed here, with the same tokens (counted)

Errors travel back as `WorkerError` values; the ingress maps them to HTTP statuses.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field, replace

import ray

from serving import faults, kv_transfer_actor, tracing
from serving.caller_watch import Caller, CallerWatch
from serving.config import KVTransferConfig
from serving.engine.async_engine import AsyncEngine
from serving.engine.config import EngineConfig
from serving.engine.errors import EngineError
from serving.engine.kv_transfer import KVPayload
from serving.engine.outputs import RequestOutput
from serving.errors import WorkerError
from serving.frontend import ModelInfo, WorkerRequest
from serving.local_backend import model_info
from serving.metrics import WorkerMetrics
from serving.worker_metrics import RequestLatencies, autoscaling_stats
from router.index import CachedBlockSet
from serving.kv_transfer_actor import KVHandle

__all__ = ["EngineWorker", "PrefillResult", "WorkerCounters"]

logger = logging.getLogger(__name__)


@dataclass
class PrefillResult:
    output: RequestOutput  # the first token; `finished` when the request needs no decode
    kv: KVHandle | None  # None when finished
    replica: str = ""  # which prefill replica computed it (Serve's replica id)


@dataclass
class WorkerCounters:
    num_prefills: int = 0
    num_kv_exports: int = 0
    kv_export_bytes: int = 0
    num_kv_imports: int = 0
    kv_import_bytes: int = 0
    kv_import_seconds: float = 0.0
    num_kv_fallbacks: int = 0  # imports that failed or timed out: the prompt was recomputed
    fallback_reasons: dict[str, int] = field(default_factory=dict)


class EngineWorker:
    def __init__(
        self, role: str, engine_config: EngineConfig, kv_transfer: KVTransferConfig, app_name: str,
        metrics: WorkerMetrics | None = None,
    ):
        self.role = role
        self.app_name = app_name
        self.kv_transfer = kv_transfer
        self.engine = AsyncEngine(engine_config)
        self.counters = WorkerCounters()
        # Prometheus / Ray metrics (serving/metrics.py); the engine is sampled in routing_stats.
        self.metrics = metrics or WorkerMetrics(engine_config.model, role, "")
        self.latencies = RequestLatencies()  # TTFT/TPOT windows, for autoscaling
        self._kv_actors = kv_transfer_actor.ActorCache(app_name)  # per node; looked up again after a failure
        self._offers: set[asyncio.Task] = set()  # background exports, referenced until done
        # The exact set of block hashes this engine holds, for the routers (router/index.py).
        self._cached_blocks = CachedBlockSet()
        self._cached_blocks_lock = threading.Lock()  # written on the engine thread
        self._epoch = time.time_ns()  # orders this engine's snapshots after a restarted one's
        self.engine.subscribe_kv_events(self._on_kv_events)
        self._node_id: str | None = None
        self._callers = CallerWatch(self.engine.abort)  # aborts the requests of an ingress that died

    # ---- queries -----------------------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        return model_info(self.engine)

    def stats(self) -> dict:
        return {
            "role": self.role, "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
            **asdict(self.engine.stats()), **asdict(self.counters),
        }

    def routing_stats(self) -> dict:
        """What the routers need (router/request_router.py): a versioned snapshot of the cached
        block hashes, and the load figures of the cost model."""
        with self._cached_blocks_lock:
            snapshot = self._cached_blocks.snapshot()
        stats = self.engine.stats()
        # Serve calls this every routing.stats_period_s: the engine's metrics are sampled here
        # and travel with the stats to the ingress's GET /metrics (serving/metrics_export.py).
        self.metrics.refresh(stats)
        return {
            **snapshot,
            "epoch": self._epoch,
            "time": time.time(),
            "block_size": self.engine.engine.config.block_size,
            "num_queued_prefill_tokens": stats.num_queued_prefill_tokens,
            "prefill_tokens_per_s": stats.prefill_tokens_per_s,
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "num_free_blocks": stats.num_free_blocks,
            "num_blocks": stats.num_blocks,
            "kv_cache_usage": stats.kv_cache_usage,
            "metrics": self.metrics.snapshot(),
        }

    def _on_kv_events(self, events) -> None:
        with self._cached_blocks_lock:
            self._cached_blocks.apply(events)

    def autoscaling_stats(self) -> dict[str, float]:
        """What the pool's autoscaling policy reads (router/autoscaling.py); never blocks."""
        return autoscaling_stats(self.engine.stats(), self.latencies)

    def check_health(self) -> None:
        if not self.engine.is_alive:
            raise RuntimeError(f"the {self.role} engine's step loop has stopped")

    # ---- prefill side ------------------------------------------------------------------------
    async def prefill(self, request: WorkerRequest) -> PrefillResult | WorkerError:
        trace = tracing.continue_trace(request.trace_context, self.role, request.request_id)
        if trace is not None:
            trace.route_done()
        params = request.params
        one = replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1), n=1)
        last: RequestOutput | None = None
        handed_off = False
        ran = False  # the engine finished the request (its last output is then rewritten)
        tracker = self.latencies.track()
        faults.reached("prefill.before_first_token")
        with self._callers.watch(_caller(request), request.request_id):
            try:
                async for out in self.engine.generate(
                    request.request_id, prompt_token_ids=request.prompt_token_ids, params=one,
                    priority=request.priority, cache_salt=request.cache_salt, hold_kv=True,
                ):
                    tracker.observe(out)
                    last = out
                ran = last is not None and last.outputs[0].finish_reason != "abort"
                self.counters.num_prefills += 1
                self.metrics.first_token(last.metrics, computed_prompt=True)
                completion = last.outputs[0]
                if completion.finish_reason == "abort":
                    return PrefillResult(last, None)
                if completion.finish_reason == "stop" or params.max_tokens == 1:
                    return PrefillResult(last, None)
                node_id = self._this_node()
                num_tokens = len(request.prompt_token_ids)
                handle = KVHandle(
                    request.request_id, kv_transfer_actor.actor_name(self.app_name, node_id),
                    node_id, num_tokens, self._payload_bytes(num_tokens),
                )
                # The first token goes back now; the export and the offer follow in the background
                # (the decode worker's claim waits for the offer), so TTFT does not pay for them.
                task = asyncio.create_task(self._export_and_offer(request.request_id, trace))
                self._offers.add(task)
                task.add_done_callback(self._offers.discard)
                handed_off = True
                completion.finish_reason = None
                completion.stop_reason = None
                last.finished = False
                return PrefillResult(last, handle)
            except EngineError as exc:
                return WorkerError.from_exception(exc)
            finally:
                if trace is not None:
                    trace.engine_stages(last.metrics if last else None, prefill=True, decode=False, aborted=not ran)
                if not handed_off:
                    self.engine.release_kv_soon(request.request_id)  # no-op unless KV is still held

    def _payload_bytes(self, num_tokens: int) -> int:
        layout = self.engine.engine.kv_layout
        num_blocks = -(-num_tokens // layout.block_size)
        element_bytes = self.engine.engine.kv_cache.data.element_size()
        return 2 * layout.num_layers * num_blocks * layout.num_kv_heads * layout.block_size * layout.head_dim * element_bytes

    async def _export_and_offer(self, request_id: str, trace: tracing.CarriedTrace | None = None) -> None:
        start_ns = time.time_ns() if trace is not None else 0
        node_id = self._this_node()
        try:
            payload = await self.engine.export_kv(request_id)
            ref = await asyncio.to_thread(ray.put, payload)
            await self._offer(node_id, request_id, ref, payload.num_bytes)
        except Exception as exc:  # noqa: BLE001 - the decode worker's claim fails and it recomputes
            if isinstance(exc, kv_transfer_actor.ACTOR_ERRORS):
                self._kv_actors.forget(node_id)  # dead or restarting: look it up again next time
                logger.warning("offering the KV of %s failed: the KVTransfer actor is gone (%s)", request_id, type(exc).__name__)
            else:
                logger.exception("exporting the KV of %s failed", request_id)
            if trace is not None:
                trace.record("kv_transfer", start_ns, time.time_ns(), {"kvrelay.kv.side": "export"}, error=f"{type(exc).__name__}: {exc}")
            await self.engine.release_kv(request_id)
            return
        self.counters.num_kv_exports += 1
        self.counters.kv_export_bytes += payload.num_bytes
        self.metrics.kv_exported(payload.num_bytes)
        if trace is not None:
            trace.record("kv_transfer", start_ns, time.time_ns(), {"kvrelay.kv.side": "export", "kvrelay.kv.bytes": payload.num_bytes})

    async def _offer(self, node_id: str, request_id: str, ref: ray.ObjectRef, num_bytes: int) -> None:
        """Offer to the node's actor; if it died (Ray restarts it, empty), offer once more to
        the restarted one, so the decode worker's claim still finds it."""
        for attempt in range(2):
            actor = await self._kv_actors.get(node_id)
            try:
                await actor.offer.remote(request_id, [ref], num_bytes, self.kv_transfer.lease_s)
                return
            except kv_transfer_actor.ACTOR_ERRORS:
                self._kv_actors.forget(node_id)
                if attempt == 1:
                    raise
                logger.warning("the KVTransfer actor died while offering the KV of %s; offering again", request_id)

    def _this_node(self) -> str:
        if self._node_id is None:
            self._node_id = ray.get_runtime_context().get_node_id()
        return self._node_id

    # ---- decode side -------------------------------------------------------------------------
    async def generate(
        self, request: WorkerRequest, kv: KVHandle | None = None, prior_output_token_ids: list[int] | None = None,
    ) -> AsyncIterator[RequestOutput | WorkerError]:
        trace = tracing.continue_trace(request.trace_context, self.role, request.request_id)
        if trace is not None:
            trace.route_done()
        payload = await self._claim(kv, trace) if kv is not None else None
        imported = payload is not None
        tracker = self.latencies.track(continues=bool(prior_output_token_ids))
        last: RequestOutput | None = None
        num_streamed = 0
        with self._callers.watch(_caller(request), request.request_id):
            try:
                async for out in self.engine.generate(
                    request.request_id, prompt_token_ids=request.prompt_token_ids, params=request.params,
                    priority=request.priority, cache_salt=request.cache_salt, kv_payload=payload,
                    prior_output_token_ids=prior_output_token_ids,
                ):
                    payload = None  # imported (or never needed); let the shared-memory view go
                    tracker.observe(out)
                    if last is None:  # a prompt not imported was computed here: its prefill time
                        self.metrics.first_token(out.metrics, computed_prompt=not imported)
                    last = out
                    yield out
                    num_streamed += sum(len(c.token_ids) for c in out.outputs)
                    faults.reached(f"{self.role}.after_tokens", num_streamed)
            except EngineError as exc:
                yield WorkerError.from_exception(exc)
            finally:
                if trace is not None:
                    # A prompt not imported was computed here: prefill, then decode from its first token.
                    trace.engine_stages(last.metrics if last else None, prefill=not imported, decode=True, aborted=last is None or not last.finished)

    async def _claim(self, kv: KVHandle, trace: tracing.CarriedTrace | None = None) -> KVPayload | None:
        if trace is None:
            return await self._claim_kv(kv)
        start_ns = time.time_ns()
        payload = await self._claim_kv(kv)
        attributes = {"kvrelay.kv.side": "import", "kvrelay.kv.imported": payload is not None}
        if payload is not None:
            attributes["kvrelay.kv.bytes"] = payload.num_bytes
        trace.record("kv_transfer", start_ns, time.time_ns(), attributes,
                     error=None if payload is not None else "not imported; the prompt is recomputed")
        return payload

    async def _claim_kv(self, kv: KVHandle) -> KVPayload | None:
        start = time.monotonic()
        timeout_s = self.kv_transfer.timeout_s
        actor = None
        try:
            actor = await self._kv_actors.get(kv.node_id)
            # The actor waits for the offer up to timeout_s; the margin covers the round trip.
            refs = await asyncio.wait_for(actor.claim.remote(kv.request_id, timeout_s), timeout_s + 5.0)
            if isinstance(refs, str):
                if refs == "timeout":
                    actor.release.remote(kv.request_id)  # drop the offer when it comes
                return self._fallback(kv, refs)
            remaining = max(0.0, timeout_s - (time.monotonic() - start))
            payload = await asyncio.wait_for(refs[0], remaining)
        except TimeoutError:
            if actor is not None:
                actor.release.remote(kv.request_id)  # do not leave it held until the lease ends
            return self._fallback(kv, "timeout")
        except ray.exceptions.TaskCancelledError:
            # The request is being cancelled (its client left during the hand-off): not a
            # fallback. Drop the offer, now or when it comes.
            self._release_later(kv)
            raise asyncio.CancelledError() from None
        except (ray.exceptions.RayError, ValueError) as exc:  # actor or object lost
            if isinstance(exc, kv_transfer_actor.ACTOR_ERRORS):
                # Dead or restarting: look it up again next time, and tell the restarted actor to
                # drop this request's offer, which the prefill worker makes again to it.
                self._kv_actors.forget(kv.node_id)
                self._release_later(kv)
            logger.warning("KV import of %s failed (%s)", kv.request_id, exc)
            return self._fallback(kv, "error")
        elapsed_s = time.monotonic() - start
        self.counters.num_kv_imports += 1
        self.counters.kv_import_bytes += payload.num_bytes
        self.counters.kv_import_seconds += elapsed_s
        self.metrics.kv_imported(elapsed_s, payload.num_bytes)
        return payload

    def _release_later(self, kv: KVHandle) -> None:
        """Release `kv` at its node's actor in the background (a tombstone if not offered yet)."""
        task = kv_transfer_actor.detached_task(self._kv_actors.release(kv.node_id, kv.request_id))
        self._offers.add(task)
        task.add_done_callback(self._offers.discard)

    def _fallback(self, kv: KVHandle, reason: str) -> None:
        self.counters.num_kv_fallbacks += 1
        self.counters.fallback_reasons[reason] = self.counters.fallback_reasons.get(reason, 0) + 1
        self.metrics.kv_fallback(reason)
        logger.warning("KV of %s not imported (%s): recomputing its %d tokens", kv.request_id, reason, kv.num_tokens)
        return None

    # ---- lifecycle ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        self.engine.shutdown()
        tracing.flush()


def _caller(request: WorkerRequest) -> Caller | None:
    return Caller(*request.caller) if request.caller else None
