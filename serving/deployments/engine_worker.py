"""EngineWorker: what a PrefillWorker, DecodeWorker or colocated Worker replica does.

A prefill worker is the same engine asked for one token and a KV export:

    prefill(request)   reserve a range of the node's shared-memory arena (None: no room)
                       generate(max_tokens=1, hold_kv=True, export_into=the range) → first
                       token; the engine gathers the KV blocks into the range as it finishes
                       → PrefillResult(first token output, KVHandle)      (returned now)
                       then, in the background: export_kv → offer_slot(range) to this node's
                       KVTransfer actor; without a range (or refused): ray.put → offer(ref)

    generate(request, kv, prior)
                       claim(kv) from its KVTransfer actor, which waits for the offer (bounded
                       by kv_transfer.timeout_s): a range of this node's arena, read in place
                       → generate(kv_payload=..., prior_output_token_ids=prior) → stream outputs
                       (the engine scatters the range into its blocks when it schedules the
                       request; then the range is done)
                       claim failed or timed out → generate(prior_output_token_ids=prior):
                       the prompt is recomputed here, with the same tokens (counted)

The worker talks to its engine through the engine contract only (serving/engine/contract.py:
kvrelay's AsyncEngine or VLLMEngine), handing it one EngineRequest built from the WorkerRequest
(messages.engine_request); the KV hand-off's steps are worker_kv.py's. Errors travel back as
`WorkerError` values; the ingress maps them to HTTP statuses.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import ray

from router.autoscaling.decide import ReplicaSignals
from router.eviction import REPLICA_REUSE_WINDOW, REUSE_REPORT_MIN, BlockReuse
from router.index import CachedBlockSet
from router.replica_stats import RequestRate, RoutingStats
from serving.config import KVTransferConfig
from serving.deployments import faults
from serving.deployments.caller_watch import CallerWatch
from serving.deployments.kv_handoff import KVHandoff
from serving.deployments.messages import (
    KVHandle,
    KVSlot,
    PrefillResult,
    WorkerError,
    WorkerOutput,
    WorkerRequest,
    WorkerStats,
    engine_request,
)
from serving.deployments.worker_kv import WorkerKV
from serving.engine.async_engine import AsyncEngine
from serving.engine.config import EngineConfig
from serving.engine.contract import EngineClient
from serving.engine.errors import EngineError
from serving.engine.outputs import EngineStats, RequestOutput
from serving.engine.params import SamplingParams
from serving.engine.request import RequestStatus
from serving.engine.validation import ModelInfo
from serving.observability import tracing
from serving.observability.request_path import Admission, clock_offset_s
from serving.observability.worker_metrics import RequestLatencies, RequestTracker, TokensPerStep, WorkerRecorder

__all__ = ["EngineWorker", "replica_signals"]

logger = logging.getLogger(__name__)

# Finish reasons of a request the engine ended without running it to its end: no KV to hand off.
_NOT_RUN = (RequestStatus.FINISHED_ABORTED.value, RequestStatus.FINISHED_QUEUE_TIMEOUT.value)
# The engine's figures the routers read as they are (EngineStats and RoutingStats share the names).
_ROUTED_ENGINE_STATS = (
    "num_queued_prefill_tokens", "prefill_tokens_per_s", "num_running", "num_waiting", "num_free_blocks", "num_blocks",
    "kv_usage", "num_computed_tokens", "lora_resident", "lora_load_s", "lora_slots_free", "spec_method",
    "spec_proposed_tokens", "spec_accepted_tokens", "spec_verify_steps",
)


class EngineWorker:
    def __init__(
        self, role: str, engine_config: EngineConfig, kv_config: KVTransferConfig, app_name: str,
        recorder: WorkerRecorder | None = None, replica: str = "",
    ):
        self.role = role
        self.app_name = app_name
        self.replica = replica  # Serve's replica unique id: the routers' name for this replica
        if engine_config.backend == "vllm":  # vLLM's AsyncLLM behind the same surface
            from serving.engine.vllm.engine import VLLMEngine

            # vLLM's cache is in another process: its KV moves by shared-memory ranges
            self.engine: EngineClient = VLLMEngine(engine_config, kv_handoff=role in ("prefill", "decode"))
        else:
            self.engine = AsyncEngine(engine_config)
        # Metrics, counters and latency windows (serving/observability/worker_metrics.py); the
        # engine is sampled in routing_stats.
        self.recorder = recorder or WorkerRecorder(engine_config.model, role, "")
        self.kv = KVHandoff(app_name, kv_config)
        self.handoff = WorkerKV(self.engine, self.kv, self.recorder, self._this_node)  # its side of the hand-off
        self._offers = self.handoff.offers  # background exports, referenced until done
        # The exact set of block hashes this engine holds, for the routers (router/index.py).
        self._cached_blocks = CachedBlockSet()
        self._cached_blocks_lock = threading.Lock()  # written on the engine thread
        self._epoch = time.time_ns()  # orders this engine's snapshots after a restarted one's
        self._requests = RequestRate()  # requests this replica took lately (RoutingStats.requests_per_s)
        self._num_requests = 0  # requests taken since the engine started (RoutingStats.num_requests)
        self._tokens_per_step = TokensPerStep()  # per routing-stats period (autoscaling keeps its own)
        # How often its requests use each block, for the routers' admission (router/eviction.py):
        # a router alone sees only the requests it sent.
        self._block_reuse = BlockReuse(REPLICA_REUSE_WINDOW)
        self.engine.subscribe_kv_events(self._on_kv_events)
        self._node_id: str | None = None
        self._callers = CallerWatch(self.engine.abort)  # aborts the requests of an ingress that died

    # ---- queries -----------------------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        return self.engine.model_info()

    async def check_adapter(self, name: str, path: str) -> WorkerError | None:
        """Whether the PEFT adapter at `path` loads here (POST /v1/load_lora_adapter)."""
        try:
            await self.engine.check_adapter(name, path)
        except Exception as exc:  # noqa: BLE001 - returned as a value, raised again at the ingress
            return WorkerError.from_exception(exc)
        return None

    def stats(self) -> WorkerStats:
        return WorkerStats(self.role, os.getpid(), self._this_node(), self.engine.stats(),
                           replace(self.recorder.counters, fallback_reasons=dict(self.recorder.counters.fallback_reasons)))

    def routing_stats(self) -> RoutingStats:
        """What the routers need (router/request_router.py): a versioned snapshot of the cached
        block hashes, and the load figures of the cost model."""
        with self._cached_blocks_lock:
            kv_version, kv_hashes = self._cached_blocks.snapshot()
            block_reuse = self._block_reuse.counts(self._cached_blocks.all_hashes(), at_least=REUSE_REPORT_MIN)
        stats = self.engine.stats()
        # Serve calls this every routing.stats_period_s: the engine's metrics are sampled here
        # and travel with the stats to the ingress's GET /metrics (serving/observability/export.py).
        self.recorder.refresh(stats)
        return RoutingStats(
            epoch=self._epoch,
            wall_time_s=time.time(),
            kv_version=kv_version,
            kv_hashes=kv_hashes,
            block_size=self.engine.model_info().block_size,
            **{name: getattr(stats, name) for name in _ROUTED_ENGINE_STATS},
            kv_import_s=self.recorder.kv_import_s,
            requests_per_s=self._requests.per_s(time.monotonic()),
            num_requests=self._num_requests,
            block_reuse=block_reuse,
            block_reuse_weight=self._block_reuse.weight,
            decode_tokens_per_step=self._tokens_per_step.report(stats.num_generated_tokens, stats.spec_accepted_tokens),
            metrics=tuple(self.recorder.snapshot()),
        )

    def _on_kv_events(self, events) -> None:
        with self._cached_blocks_lock:
            self._cached_blocks.apply(events)

    def _took(self, request: WorkerRequest) -> Admission:
        """A request arrived: counted, and its prompt listed in the snapshot (router/index.py).
        Returns what the engine held of its prompt before it came, for the ingress to check its
        router's prediction against (serving/observability/request_path.py)."""
        self._requests.add(time.monotonic())
        self._num_requests += 1
        self.recorder.latencies.workload.arrived(len(request.prompt_token_ids))
        max_blocks = (len(request.prompt_token_ids) - 1) // request.block_size  # as an engine caps a hit
        with self._cached_blocks_lock:
            self._block_reuse.observe(request.block_hashes, 0)
            held, pending = self._cached_blocks.num_leading(request.block_hashes, max_blocks)
            self._cached_blocks.take(request.request_id, request.block_hashes)
        return Admission(self.replica, held * request.block_size, pending * request.block_size, clock_offset_s())

    def _done(self, request: WorkerRequest) -> None:
        """The request's prompt blocks are now the engine's most recently used (freed tail
        first), or, not kept cached, those it computed the first to go: the snapshot's eviction
        order follows (router/index.py)."""
        with self._cached_blocks_lock:
            self._cached_blocks.touch(request.block_hashes, request.request_id, keep=request.keep_cached)

    def autoscaling_signals(self) -> ReplicaSignals:
        """What the pool's autoscaling policy reads (router/autoscaling/decide.py); never blocks."""
        return replica_signals(self.engine.stats(), self.recorder.latencies)

    def check_health(self) -> None:
        if not self.engine.is_alive:
            raise RuntimeError(f"the {self.role} engine's step loop has stopped")

    # ---- prefill side ------------------------------------------------------------------------
    async def prefill(self, request: WorkerRequest) -> PrefillResult | WorkerError:
        trace = self._continue_trace(request)
        run = _Prefill.of(request.params, self.recorder.track())
        admission = self._took(request)
        with self._callers.watch(request.caller, request.request_id):
            try:
                if run.hands_off:  # a decode worker will need the KV: where it goes
                    run.slot, run.export_into = await self.handoff.reserve(request.request_id, len(request.prompt_token_ids))
                async for out in self.engine.generate(engine_request(
                    request, params=run.params, hold_kv=not run.scores_only, expected_cached_tokens=admission.num_pending_tokens,
                    export_into=run.export_into, export_until_mono_s=run.slot.deadline if run.slot is not None else None,
                )):
                    run.tracker.observe(out)
                    run.last = out
                # The prompt is computed and its token not yet returned. A crash here comes well
                # after Serve told the ingress the call was accepted; a crash before that would be
                # retried by Serve on another replica, unseen.
                faults.reached("prefill.before_first_token")
                return self._prefilled(request, run, admission, trace)
            except EngineError as exc:
                return WorkerError.from_exception(exc)
            finally:
                self._prefill_ended(request, run, trace)

    def _prefilled(self, request: WorkerRequest, run: _Prefill, admission: Admission,
                   trace: tracing.CarriedTrace | None) -> PrefillResult:
        """The first token back; with a hand-off, its KVHandle, the export and offer following in
        the background (the decode worker's claim waits for the offer), so TTFT does not pay for them."""
        last = run.last
        completion = last.outputs[0]
        run.ran = completion.finish_reason not in _NOT_RUN
        self.recorder.prefilled(last.metrics)
        # not run (aborted, or timed out in the queue: the ingress answers 503), or nothing to decode
        if not run.ran or completion.finish_reason == "stop" or not run.hands_off:
            return PrefillResult(last, None, admission=admission)
        handle = self.handoff.handle(request.request_id, len(request.prompt_token_ids))
        self.handoff.offer_later(request.request_id, trace, run.slot, run.export_into)
        run.handed_off = True
        completion.finish_reason = None
        completion.stop_reason = None
        last.finished = False
        return PrefillResult(last, handle, admission=admission)

    def _prefill_ended(self, request: WorkerRequest, run: _Prefill, trace: tracing.CarriedTrace | None) -> None:
        self._done(request)
        if trace is not None:
            trace.engine_stages(run.last.metrics if run.last else None, prefill=True, decode=False, aborted=not run.ran)
        if not run.handed_off:
            self.engine.release_kv_soon(request.request_id)  # no-op unless KV is still held
            if run.slot is not None:
                # Finished here (a stop at its first token): the engine's gather is over, the
                # range is free at once; otherwise it may still run: quarantined.
                self.kv.release_slot_soon(self._this_node(), run.slot, written=run.ran)

    def _continue_trace(self, request: WorkerRequest) -> tracing.CarriedTrace | None:
        trace = tracing.continue_trace(request.trace_context, self.role, request.request_id)
        if trace is not None:
            trace.route_done()
        return trace

    def _this_node(self) -> str:
        if self._node_id is None:
            self._node_id = ray.get_runtime_context().get_node_id()
        return self._node_id

    # ---- decode side -------------------------------------------------------------------------
    async def generate(
        self, request: WorkerRequest, kv: KVHandle | None = None, prior_output_token_ids: list[int] | None = None,
    ) -> AsyncIterator[RequestOutput | WorkerError]:
        trace = self._continue_trace(request)
        payload, slot = await self.handoff.claim(kv, trace) if kv is not None else (None, None)
        imported = payload is not None
        tracker = self.recorder.track(continues=bool(prior_output_token_ids))
        last: RequestOutput | None = None
        num_streamed = 0
        admission = replace(self._took(request), imported=imported)
        with self._callers.watch(request.caller, request.request_id):
            try:
                async for out in self.engine.generate(engine_request(
                    request, kv_payload=payload, prior_output_token_ids=list(prior_output_token_ids or ()),
                    expected_cached_tokens=0 if imported else admission.num_pending_tokens,
                )):
                    payload = None  # imported (or never needed); let the shared-memory view go
                    if slot is not None:  # the engine scattered it into its blocks before this output
                        self.kv.done_soon(kv.node_id, slot)
                        slot = None
                    tracker.observe(out)
                    is_first, last = last is None, out
                    if is_first:  # a prompt not imported was computed here: its prefill time
                        self.recorder.first_token(out.metrics, computed_prompt=not imported)
                    # The first carries what this worker saw as the request arrived (the ingress's
                    # prefix check and TTFT split: serving/observability/request_path.py).
                    yield WorkerOutput.first(out, admission) if is_first else out
                    num_streamed += sum(len(c.token_ids) for c in out.outputs)
                    faults.reached(f"{self.role}.after_tokens", num_streamed)
            except EngineError as exc:
                yield WorkerError.from_exception(exc)
            finally:
                self._done(request)
                if slot is not None:  # ended before its first output: the engine may be reading it
                    self.kv.release_soon(kv)  # a read range goes to quarantine, not straight back
                if trace is not None:
                    # A prompt not imported was computed here: prefill, then decode from its first token.
                    trace.engine_stages(last.metrics if last else None, prefill=not imported, decode=True, aborted=last is None or not last.finished)

    # ---- lifecycle ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        self.engine.shutdown()
        tracing.flush()


@dataclass
class _Prefill:
    """One prefill request's state, from its start to its end (EngineWorker.prefill)."""

    params: SamplingParams  # asked of the engine: one token, or none when it only scores its prompt
    tracker: RequestTracker
    scores_only: bool  # max_tokens 0: nothing to decode (its prompt logprobs come with the output)
    hands_off: bool  # a decode worker will continue it: its KV is held and exported
    last: RequestOutput | None = None
    ran: bool = False  # the engine finished the request (its last output is then rewritten)
    handed_off: bool = False
    slot: KVSlot | None = None  # its range of the node's arena, if one was reserved
    export_into: object = None  # what the engine writes the KV into (WorkerKV.reserve)

    @classmethod
    def of(cls, params: SamplingParams, tracker: RequestTracker) -> _Prefill:
        scores_only = params.max_tokens == 0
        one = replace(params, max_tokens=0 if scores_only else 1, min_tokens=min(params.min_tokens, 1), n=1)
        return cls(one, tracker, scores_only, params.max_tokens not in (0, 1))


def replica_signals(stats: EngineStats, latencies: RequestLatencies) -> ReplicaSignals:
    """A replica's autoscaling signals from its engine's figures and its latency and workload
    windows. TTFT and TPOT p95 are 0.0 without a sample in the window: an idle replica puts no
    latency pressure on the pool, and queued work shows in the queue signals. Each call starts the
    next interval of output_tokens_per_s and decode_tokens_per_step (Serve calls it every
    metrics_interval_s)."""
    requests_per_s, prompt_tokens, output_tokens, made_per_s = latencies.workload.report()
    steps, rows, busy = latencies.decode_steps.report(stats.decode_steps, stats.decode_step_rows, stats.decode_step_s)
    return ReplicaSignals(
        num_queued_prefill_tokens=float(stats.num_queued_prefill_tokens),
        ttft_p95_ms=latencies.ttft_ms.percentile(95) or 0.0,
        num_seqs=float(stats.num_running + stats.num_waiting),
        kv_usage=float(stats.kv_usage),
        tpot_p95_ms=latencies.tpot_ms.percentile(95) or 0.0,
        requests_per_s=requests_per_s,
        prompt_tokens_per_request=prompt_tokens,
        output_tokens_per_request=output_tokens,
        output_tokens_per_s=made_per_s,
        prefill_tokens_per_s=float(stats.prefill_tokens_per_s),
        decode_tokens_per_step=latencies.tokens_per_step.report(stats.num_generated_tokens, stats.spec_accepted_tokens),
        requests_total=float(latencies.workload.num_arrived),
        decode_steps_per_s=steps,
        decode_rows_per_s=rows,
        decode_busy_s_per_s=busy,
    )
