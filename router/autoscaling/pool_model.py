"""A queueing model of the prefill and decode pools, for `kvrelay policy simulate --workload`.

    request ─▶ prefill pool: the accepting replica whose queue empties first (the router's
               "where does it start first"); FCFS; prompt / prefill_tokens_per_s seconds
               ─▶ TTFT = its prefill's end - arrival (the first token comes from prefill)
            ─▶ decode pool: the accepting replica with the fewest sequences; continuous batching
               as processor sharing: with n sequences each advances one token per TPOT(n) =
               tpot_base_ms + n * tpot_ms_per_seq  ─▶ TPOT = decode time / tokens decoded

A replica asked for at t takes `cold_start_s` before it accepts work, and counts from t. A
replica removed stops accepting at once and counts until its work is done (Serve drains it); one
still starting goes first. Each running replica reports its signals (`ReplicaSignals`, the same
fields live replicas report) every metrics_interval_s; a policy sees each signal's mean over
window_s, as Serve's look_back_period_s gives it. `kv_usage` is not modelled (0).

The defaults are this machine's engine, one thread, float32 (`CALIBRATION`): from
docs/benchmarks/scenario-pd-interference-2026-11-24.json, config.calibration.rates:
prefill_tokens_per_s 296.4, decode_step_ms 43.08 at batch 1 and 89.27 at batch 4, so
TPOT(n) = 27.68 + 15.40 n ms (the line through both). The cold start is an assumption (a
SmolLM2-sized replica's start on this machine, model load and warm-up), not a measurement.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from router.autoscaling.decide import COUNTER_SIGNALS, ReplicaSignals

__all__ = ["Capacity", "CALIBRATION", "PrefillReplica", "DecodeReplica", "Pool", "percentile"]

CALIBRATION = ("docs/benchmarks/scenario-pd-interference-2026-11-24.json config.calibration.rates: prefill "
               "296.4 tok/s, decode step 43.08 ms at batch 1 and 89.27 ms at batch 4 (one thread, float32)")


@dataclass(frozen=True)
class Capacity:
    prefill_tokens_per_s: float = 296.4
    tpot_base_ms: float = 27.68
    tpot_ms_per_seq: float = 15.40
    cold_start_s: float = 30.0

    def tpot_s(self, num_seqs: int) -> float:
        return (self.tpot_base_ms + num_seqs * self.tpot_ms_per_seq) / 1000


def percentile(values, q: float) -> float:
    """Nearest rank, as the replicas' latency windows compute it; 0.0 for none."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)] if ordered else 0.0


class _Replica:
    _ids = itertools.count()

    def __init__(self, asked_at: float, ready_at: float):
        self.asked_at, self.ready_at = asked_at, ready_at
        self.replica_id = f"r{next(_Replica._ids)}"
        self.num_arrived = 0  # requests taken since it started (the live worker's requests_total)
        self.removed_at: float | None = None
        self.ended_at: float | None = None  # removed and drained
        self.arrivals: deque[tuple[float, int]] = deque()  # (time, prompt tokens)
        self.latencies: deque[tuple[float, float]] = deque()  # (time, ms): TTFT or TPOT
        self.samples: deque[tuple[float, ReplicaSignals]] = deque()

    def accepting(self, t: float) -> bool:
        return self.removed_at is None and self.ready_at <= t

    def running(self, t: float) -> bool:
        return self.ended_at is None and self.ready_at <= t

    def seconds(self, until: float) -> float:
        end = min(until, self.ended_at if self.ended_at is not None else until)
        return max(0.0, end - self.asked_at)

    def sample(self, t: float, window_s: float) -> None:
        for series in (self.arrivals, self.latencies, self.samples):
            while series and series[0][0] < t - window_s:
                series.popleft()
        self.samples.append((t, self.signals(t, window_s)))

    def signals(self, t: float, window_s: float) -> ReplicaSignals:
        raise NotImplementedError

    def observed(self, t: float) -> ReplicaSignals:
        """Each signal's mean over the samples in the window (Serve's look-back); a counter's
        newest value (decide.observation_from_serve)."""
        if not self.samples:
            return ReplicaSignals(replica=self.replica_id)
        values = {}
        for name in ReplicaSignals.__dataclass_fields__:
            if name in COUNTER_SIGNALS:
                values[name] = getattr(self.samples[-1][1], name)
            elif name not in ("updated_at_s", "replica"):
                values[name] = sum(getattr(s, name) or 0.0 for _, s in self.samples) / len(self.samples)
        return ReplicaSignals(updated_at_s=self.samples[-1][0], replica=self.replica_id, **values)


class PrefillReplica(_Replica):
    def __init__(self, asked_at: float, ready_at: float, capacity: Capacity):
        super().__init__(asked_at, ready_at)
        self.tokens_per_s = capacity.prefill_tokens_per_s
        self.free_at = ready_at
        self.done: deque[float] = deque()  # end times of the prefills taken, in order
        self.has_run = False

    def take(self, arrival: float, prompt_tokens: int) -> float:
        """Queue a prompt; returns when its prefill ends."""
        self.free_at = max(arrival, self.free_at) + prompt_tokens / self.tokens_per_s
        self.done.append(self.free_at)
        self.arrivals.append((arrival, prompt_tokens))
        self.num_arrived += 1
        self.latencies.append((self.free_at, 1000 * (self.free_at - arrival)))
        self.has_run = True
        return self.free_at

    def ongoing(self, t: float) -> int:
        while self.done and self.done[0] <= t:
            self.done.popleft()
        return len(self.done)

    def signals(self, t: float, window_s: float) -> ReplicaSignals:
        # TTFTs are known at placement: count only those already over by t.
        ttfts = [ms for end, ms in self.latencies if end <= t]
        return ReplicaSignals(
            num_queued_prefill_tokens=max(0.0, self.free_at - t) * self.tokens_per_s,
            ttft_p95_ms=percentile(ttfts, 95), num_seqs=float(self.ongoing(t)), kv_usage=0.0,
            tpot_p95_ms=0.0, requests_per_s=len(self.arrivals) / window_s,
            prompt_tokens_per_request=_mean(n for _, n in self.arrivals), output_tokens_per_request=0.0,
            output_tokens_per_s=0.0, prefill_tokens_per_s=self.tokens_per_s if self.has_run else 0.0,
            requests_total=float(self.num_arrived),
        )


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


class DecodeReplica(_Replica):
    """Processor sharing in virtual time: every sequence has advanced `progress` tokens since the
    replica started; one that joined at progress p with k tokens ends when progress reaches p + k."""

    def __init__(self, asked_at: float, ready_at: float, capacity: Capacity):
        super().__init__(asked_at, ready_at)
        self.capacity = capacity
        self.clock = ready_at
        self.progress = 0.0
        self.active: list[tuple[float, int, float, int]] = []  # heap of (end progress, id, joined at, tokens)
        self.finished: deque[tuple[float, int]] = deque()  # (time, tokens) of finished sequences
        self.generated = 0.0  # tokens generated since the start
        self.busy_s = 0.0  # seconds with a sequence decoding (the live engine's DecodeSteps seconds)
        # (time, generated, steps, busy seconds) at the previous sample
        self.last_sample = (ready_at, 0.0, 0.0, 0.0)

    def advance(self, t: float, on_finish: Callable[[int, float, float], None]) -> None:
        """Run to time t; on_finish(request id, joined at, finished at) for each sequence that ends."""
        while self.active and self.clock < t:
            step_s = self.capacity.tpot_s(len(self.active))
            end_progress, rid, joined, tokens = self.active[0]
            at = self.clock + (end_progress - self.progress) * step_s
            if at > t:
                break
            self.generated += len(self.active) * (end_progress - self.progress)
            self.busy_s += at - self.clock
            heapq.heappop(self.active)
            self.clock, self.progress = at, end_progress
            self.latencies.append((at, 1000 * (at - joined) / tokens))
            self.finished.append((at, tokens))
            on_finish(rid, joined, at)
        if self.active and self.clock < t:
            step = (t - self.clock) / self.capacity.tpot_s(len(self.active))
            self.progress += step
            self.generated += len(self.active) * step
            self.busy_s += t - self.clock
        self.clock = max(self.clock, t)
        if self.removed_at is not None and not self.active and self.ended_at is None:
            self.ended_at = max(self.removed_at, self.clock)

    def join(self, rid: int, t: float, tokens: int, on_finish) -> None:
        self.advance(t, on_finish)
        heapq.heappush(self.active, (self.progress + tokens, rid, t, tokens))
        self.arrivals.append((t, tokens))
        self.num_arrived += 1

    def signals(self, t: float, window_s: float) -> ReplicaSignals:
        while self.finished and self.finished[0][0] < t - window_s:
            self.finished.popleft()
        # Tokens generated since the previous sample: averaged over the window's samples with
        # num_seqs, both describe the same time (the live worker reports them the same way).
        # So are the decode steps: `progress` counts them (each sequence advances one a step).
        since, generated_then, progress_then, busy_then = self.last_sample
        span = t - since
        tokens_per_s = (self.generated - generated_then) / span if span > 0 else 0.0
        steps_per_s = (self.progress - progress_then) / span if span > 0 else 0.0
        busy = (self.busy_s - busy_then) / span if span > 0 else 0.0
        self.last_sample = (t, self.generated, self.progress, self.busy_s)
        return ReplicaSignals(
            num_queued_prefill_tokens=0.0, ttft_p95_ms=0.0, num_seqs=float(len(self.active)), kv_usage=0.0,
            tpot_p95_ms=percentile((ms for _, ms in self.latencies), 95), requests_per_s=len(self.arrivals) / window_s,
            prompt_tokens_per_request=0.0, output_tokens_per_request=_mean(n for _, n in self.finished),
            output_tokens_per_s=tokens_per_s, prefill_tokens_per_s=0.0, requests_total=float(self.num_arrived),
            decode_steps_per_s=steps_per_s, decode_rows_per_s=tokens_per_s, decode_busy_s_per_s=busy,
        )


class Pool:
    """One pool's replicas: scaled to a target count, sampled, and what they cost."""

    def __init__(self, kind: str, capacity: Capacity, num_replicas: int):
        assert kind in ("prefill", "decode"), kind
        self.kind, self.capacity = kind, capacity
        self.replicas: list[_Replica] = [self._new(0.0, 0.0) for _ in range(num_replicas)]

    def _new(self, asked_at: float, ready_at: float) -> _Replica:
        cls = PrefillReplica if self.kind == "prefill" else DecodeReplica
        return cls(asked_at, ready_at, self.capacity)

    @property
    def target(self) -> int:
        """The count asked for: replicas not removed, starting ones included (Serve's target)."""
        return sum(1 for r in self.replicas if r.removed_at is None)

    def accepting(self, t: float) -> list[_Replica]:
        return [r for r in self.replicas if r.accepting(t)]

    def running(self, t: float) -> list[_Replica]:
        """The replicas that report: started, and not yet drained."""
        return [r for r in self.replicas if r.running(t) and r.removed_at is None]

    def scale_to(self, n: int, t: float) -> None:
        assert n >= 1, n
        for _ in range(n - self.target):
            self.replicas.append(self._new(t, t + self.capacity.cold_start_s))
        excess = self.target - n
        if excess <= 0:
            return
        live = [r for r in self.replicas if r.removed_at is None]
        # Starting replicas first (the latest asked first), then the least loaded.
        live.sort(key=lambda r: (r.ready_at <= t, self._load(r, t), -r.asked_at))
        for r in live[:excess]:
            r.removed_at = t
            if r.ready_at > t or self._load(r, t) == 0:
                r.ended_at = t

    def _load(self, r: _Replica, t: float) -> float:
        if isinstance(r, PrefillReplica):
            return max(0.0, r.free_at - t)
        return float(len(r.active))  # type: ignore[attr-defined]

    def settle(self, t: float) -> None:
        """Removed prefill replicas end when their queue has run out."""
        for r in self.replicas:
            if isinstance(r, PrefillReplica) and r.removed_at is not None and r.ended_at is None and r.free_at <= t:
                r.ended_at = max(r.removed_at, r.free_at)

    def sample(self, t: float, window_s: float) -> None:
        for r in self.running(t):
            r.sample(t, window_s)

    def observed(self, t: float) -> tuple[ReplicaSignals, ...]:
        return tuple(r.observed(t) for r in self.running(t))

    def replica_seconds(self, until: float) -> float:
        return sum(r.seconds(until) for r in self.replicas)
