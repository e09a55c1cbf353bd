"""WorkerRecorder: everything a worker replica records, in one place.

    EngineWorker ── first token, KV export / import / fallback ──▶ WorkerRecorder
                                                                    ├─ Prometheus / Ray metrics
                                                                    │  (the kvrelay_* worker series)
                                                                    ├─ WorkerCounters (its stats())
    each output ── track(...).observe(output) ─────────────────────▶└─ RequestLatencies: TTFT, TPOT
                                                                       windows, for autoscaling
    refresh(EngineStats), once per routing-stats period: engine gauges and counter deltas

Autoscaling reads TTFT and TPOT from the windows (the deployment reports them with the engine's
queue figures as router.autoscaling.decide.ReplicaSignals).

TTFT is arrival at this engine to its first token. TPOT is (finish - first token) / (tokens - 1)
over the tokens generated here; on a decode worker continuing a request whose first token came
from elsewhere (a prefill worker, or a replica that died), every token it generates follows the
first, so TPOT is (finish - arrival at this engine) / tokens, and there is no TTFT to record.
A TTFT is recorded at the first token, a TPOT when the request finishes. p95 is over the last
`window_s` of them (nearest rank); with none, the value is 0.0: an idle replica puts no latency
pressure on the pool, and queued work shows in the queue signals.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from serving.observability.metrics import METRICS, Instruments

if TYPE_CHECKING:
    from serving.engine.outputs import EngineStats, RequestMetrics, RequestOutput

__all__ = ["LATENCY_WINDOW_S", "LatencyWindow", "RequestLatencies", "RequestTracker", "TokensPerStep", "WorkerCounters",
           "WorkerRecorder", "WorkloadWindow"]

LATENCY_WINDOW_S = 30.0  # matches the policies' default window_s
_MAX_SAMPLES = 4096  # bounds memory and the sort at record time under heavy load


class LatencyWindow:
    """Latencies (ms) of the last `window_s` seconds, at most `max_samples` of them."""

    def __init__(self, window_s: float = LATENCY_WINDOW_S, max_samples: int = _MAX_SAMPLES):
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add(self, value_ms: float, now: float | None = None) -> None:
        self._samples.append((time.monotonic() if now is None else now, value_ms))

    def percentile(self, q: float, now: float | None = None) -> float | None:
        """The q-th percentile (0 < q <= 100, nearest rank) of the window; None when empty."""
        now = time.monotonic() if now is None else now
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
        if not self._samples:
            return None
        values = sorted(v for _, v in self._samples)
        return values[max(0, math.ceil(q / 100 * len(values)) - 1)]


class WorkloadWindow:
    """What the planner reads of one replica's workload (router/autoscaling/planner.py): requests
    that arrived and finished in the last `window_s`, with their prompt and output lengths, and the
    tokens generated since the previous report."""

    def __init__(self, window_s: float = LATENCY_WINDOW_S, max_samples: int = _MAX_SAMPLES):
        self.window_s = window_s
        self._arrived: deque[tuple[float, int]] = deque(maxlen=max_samples)  # (time, prompt tokens)
        self._finished: deque[tuple[float, int]] = deque(maxlen=max_samples)  # (time, tokens made here)
        self._generated = 0  # tokens generated here since the start
        self.num_arrived = 0  # requests that arrived here since the start
        self._reported = (None, 0)  # (time, generated) at the previous report

    def arrived(self, prompt_tokens: int, now: float | None = None) -> None:
        self._arrived.append((time.monotonic() if now is None else now, prompt_tokens))
        self.num_arrived += 1

    def generated(self, num_tokens: int) -> None:
        self._generated += num_tokens

    def finished(self, num_tokens: int, now: float | None = None) -> None:
        self._finished.append((time.monotonic() if now is None else now, num_tokens))

    def report(self, now: float | None = None) -> tuple[float, float, float, float]:
        """(requests/s arrived, mean prompt tokens, mean output tokens of those finished, tokens/s
        generated since the previous report); a report starts the next interval."""
        now = time.monotonic() if now is None else now
        for series in (self._arrived, self._finished):
            while series and series[0][0] < now - self.window_s:
                series.popleft()
        since, then = self._reported
        made_per_s = (self._generated - then) / (now - since) if since is not None and now > since else 0.0
        self._reported = (now, self._generated)
        return (
            len(self._arrived) / self.window_s,
            sum(n for _, n in self._arrived) / len(self._arrived) if self._arrived else 0.0,
            sum(n for _, n in self._finished) / len(self._finished) if self._finished else 0.0,
            made_per_s,
        )


class TokensPerStep:
    """Tokens a decoding sequence gained per engine step between two reports, from the engine's
    cumulative counters: every sequence-step emits its accepted proposals + 1 (the model's own
    token), so steps = generated - accepted and the mean is generated / (generated - accepted):
    1.0 without speculation. An interval that generated nothing reports the last interval's mean
    (1.0 before any), so an idle replica keeps the figure its pool's plan needs."""

    def __init__(self) -> None:
        self._counts = (0, 0)  # (generated, accepted) at the previous report
        self._last = 1.0

    def report(self, num_generated_tokens: int, num_accepted_tokens: int) -> float:
        generated = num_generated_tokens - self._counts[0]
        accepted = num_accepted_tokens - self._counts[1]
        self._counts = (num_generated_tokens, num_accepted_tokens)
        if generated > accepted >= 0:
            self._last = generated / (generated - accepted)
        return self._last


class DecodeStepRates:
    """The engine's decode step account (EngineStats.decode_steps, decode_step_rows,
    decode_step_s: cumulative) as rates between two reports: (steps/s, sequences decoded/s,
    step-seconds/s). The planner learns its decode correction from them. All 0 for an interval
    with no counted step."""

    def __init__(self) -> None:
        self._counts: tuple[float | None, int, int, float] = (None, 0, 0, 0.0)  # (time, steps, rows, seconds)

    def report(self, steps: int, rows: int, seconds: float, now: float | None = None) -> tuple[float, float, float]:
        now = time.monotonic() if now is None else now
        since, steps_then, rows_then, seconds_then = self._counts
        self._counts = (now, steps, rows, seconds)
        if since is None or now <= since or steps <= steps_then:
            return 0.0, 0.0, 0.0
        span = now - since
        return (steps - steps_then) / span, (rows - rows_then) / span, (seconds - seconds_then) / span


class RequestLatencies:
    """TTFT and TPOT windows of one replica, its workload window and its decode tokens per step;
    `track()` follows one request's outputs."""

    def __init__(self, window_s: float = LATENCY_WINDOW_S):
        self.ttft_ms = LatencyWindow(window_s)
        self.tpot_ms = LatencyWindow(window_s)
        self.workload = WorkloadWindow(window_s)
        self.tokens_per_step = TokensPerStep()
        self.decode_steps = DecodeStepRates()

    def track(self, *, continues: bool = False) -> RequestTracker:
        """`continues`: the request's first token came from elsewhere (no TTFT here)."""
        return RequestTracker(self, continues)


class RequestTracker:
    def __init__(self, latencies: RequestLatencies, continues: bool):
        self._latencies = latencies
        self._continues = continues
        self._ttft_recorded = continues
        self.num_tokens = 0  # generated here, choice 0

    def observe(self, output: RequestOutput) -> None:
        """Every output of the request, in order. An aborted request gives a TTFT at most."""
        new_tokens = sum(len(c.token_ids) for c in output.outputs if c.index == 0)
        self.num_tokens += new_tokens
        self._latencies.workload.generated(new_tokens)
        if output.finished and not any(c.finish_reason == "abort" for c in output.outputs):
            self._latencies.workload.finished(self.num_tokens)
        m = output.metrics
        if m is None or m.first_token_mono_s is None:
            return
        if not self._ttft_recorded:
            self._ttft_recorded = True
            self._latencies.ttft_ms.add(1000 * (m.first_token_mono_s - m.arrival_mono_s))
        if not output.finished or m.finished_mono_s is None or any(c.finish_reason == "abort" for c in output.outputs):
            return
        if self._continues and self.num_tokens >= 1:
            self._latencies.tpot_ms.add(1000 * (m.finished_mono_s - m.arrival_mono_s) / self.num_tokens)
        elif not self._continues and self.num_tokens >= 2:
            self._latencies.tpot_ms.add(1000 * (m.finished_mono_s - m.first_token_mono_s) / (self.num_tokens - 1))


_WORKER = tuple(spec.name for spec in METRICS if spec.recorded_at == "worker")
# EngineStats cumulative counts, recorded as deltas.
_ENGINE_COUNTERS = {
    "prefix_cache_query_tokens": "kvrelay_prefix_cache_queried_tokens_total",
    "prefix_cache_hit_tokens": "kvrelay_prefix_cache_hit_tokens_total",
    "num_preemptions": "kvrelay_preemptions_total",
    "decode_steps": "kvrelay_decode_steps_total",
    "decode_step_rows": "kvrelay_decode_step_sequences_total",
    "decode_step_s": "kvrelay_decode_step_seconds_total",
}
# Speculative decoding's, labelled with the proposer (recorded only where it is on).
_SPEC_COUNTERS = {
    "spec_proposed_tokens": "kvrelay_spec_decode_proposed_tokens_total",
    "spec_accepted_tokens": "kvrelay_spec_decode_accepted_tokens_total",
    "spec_verify_steps": "kvrelay_spec_decode_verify_steps_total",
}


@dataclass
class WorkerCounters:
    """A worker's KV hand-off counts since it started (its stats())."""

    num_prefills: int = 0
    num_kv_exports: int = 0
    kv_export_bytes: int = 0
    num_kv_imports: int = 0
    kv_import_bytes: int = 0
    kv_import_seconds: float = 0.0
    num_kv_fallbacks: int = 0  # imports that failed or timed out: the prompt was recomputed
    fallback_reasons: dict[str, int] = field(default_factory=dict)


KV_IMPORT_WEIGHT = 0.2  # of each new import in the recent average (an EWMA: ~5 imports' memory)


class WorkerRecorder:
    """One worker replica's metrics (labelled with its model, pool and replica), counters and
    latency windows; every event is recorded once, here."""

    def __init__(self, model: str, pool: str, replica: str, *, use_ray: bool | None = None):
        self.instruments = Instruments(_WORKER, {"model": model, "pool": pool, "replica": replica}, use_ray=use_ray)
        self.counters = WorkerCounters()
        self.latencies = RequestLatencies()
        self._seen = dict.fromkeys(_ENGINE_COUNTERS, 0)
        # Recent hand-offs' time, weighted to the newest (RoutingStats.kv_import_s): imports, and
        # hand-offs that failed (for the time they cost before the prompt was recomputed).
        self.kv_import_s = 0.0
        self._num_handoffs_timed = 0

    def track(self, *, continues: bool = False) -> RequestTracker:
        """Follow one request's outputs for the latency windows (RequestLatencies.track)."""
        return self.latencies.track(continues=continues)

    def prefilled(self, m: RequestMetrics | None) -> None:
        """A prefill worker computed a request's prompt and first token."""
        self.counters.num_prefills += 1
        self.first_token(m, computed_prompt=True)

    def first_token(self, m: RequestMetrics | None, *, computed_prompt: bool) -> None:
        """A request's first output at this engine (engine monotonic times); nothing without a
        token (aborted first)."""
        if m is None or m.first_scheduled_mono_s is None or m.first_token_mono_s is None:
            return
        self.instruments.observe("kvrelay_queue_time_seconds", [max(0.0, m.first_scheduled_mono_s - m.arrival_mono_s)])
        if computed_prompt:
            self.instruments.observe("kvrelay_prefill_time_seconds", [max(0.0, m.first_token_mono_s - m.first_scheduled_mono_s)])

    def kv_exported(self, num_bytes: int) -> None:
        self.counters.num_kv_exports += 1
        self.counters.kv_export_bytes += num_bytes
        self.instruments.inc("kvrelay_kv_transfer_bytes_total", num_bytes, direction="export")

    def kv_imported(self, seconds: float, num_bytes: int) -> None:
        self.counters.num_kv_imports += 1
        self.counters.kv_import_bytes += num_bytes
        self.counters.kv_import_seconds += seconds
        self._time_handoff(seconds)
        self.instruments.observe("kvrelay_kv_transfer_seconds", [seconds])
        self.instruments.inc("kvrelay_kv_transfer_bytes_total", num_bytes, direction="import")

    def _time_handoff(self, seconds: float) -> None:
        self._num_handoffs_timed += 1
        first = self._num_handoffs_timed == 1
        self.kv_import_s = seconds if first else (1 - KV_IMPORT_WEIGHT) * self.kv_import_s + KV_IMPORT_WEIGHT * seconds

    def kv_fallback(self, reason: str, seconds: float | None = None) -> None:
        """A KV import failed or timed out (`reason`: the value of a ClaimMiss,
        deployments/messages.py): the prompt is recomputed. `seconds`: what the attempt cost,
        when it counts as a hand-off's time (not when the client left)."""
        if seconds is not None:
            self._time_handoff(seconds)
        self.counters.num_kv_fallbacks += 1
        self.counters.fallback_reasons[reason] = self.counters.fallback_reasons.get(reason, 0) + 1
        self.instruments.inc("kvrelay_kv_transfer_fallbacks_total", reason=reason)

    def refresh(self, stats: EngineStats) -> None:
        """Sample the engine: gauges, and what its cumulative counters gained since last time."""
        ins = self.instruments
        ins.set("kvrelay_num_requests_running", float(stats.num_running))
        ins.set("kvrelay_num_requests_waiting", float(stats.num_waiting))
        ins.set("kvrelay_kv_cache_usage_ratio", float(stats.kv_usage))
        ins.set("kvrelay_engine_kernel_info", 1.0, kernel_path=stats.kernel_path, reason=stats.kernel_reason)
        for field_name, metric in _ENGINE_COUNTERS.items():
            value = getattr(stats, field_name)
            ins.inc(metric, value - self._seen[field_name])
            self._seen[field_name] = value
        if stats.spec_method:  # speculative decoding is on
            for field_name, metric in _SPEC_COUNTERS.items():
                value = getattr(stats, field_name)
                ins.inc(metric, value - self._seen.get(field_name, 0), proposer=stats.spec_method)
                self._seen[field_name] = value
            ins.set("kvrelay_spec_decode_acceptance_ratio", stats.spec_acceptance_rate, proposer=stats.spec_method)
            ins.set("kvrelay_spec_decode_tokens_per_step", stats.spec_tokens_per_step, proposer=stats.spec_method)

    def snapshot(self) -> list[tuple[str, str, str, list[tuple[str, dict[str, str], float]]]]:
        """This replica's metrics as plain values (family, type, help, samples), for the
        routing stats: the ingress's GET /metrics re-exports them (serving/observability/export.py)."""
        return [
            (family.name, family.type, family.documentation, [(s.name, dict(s.labels), s.value) for s in family.samples])
            for family in self.instruments.registry.collect()
        ]
