"""A worker replica's autoscaling signals (the keys of router.autoscaling.decide.SIGNALS).

    EngineWorker.prefill / generate ── every output ──────▶ RequestLatencies (TTFT, TPOT windows)
    AsyncEngine.stats() (after each step) ────────────────▶ queued prefill tokens, seqs, KV use
                                   autoscaling_stats(...) ──▶ {signal: float}
                                   (record_autoscaling_stats → the Serve controller)

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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serving.engine.engine import EngineStats
    from serving.engine.outputs import RequestOutput

__all__ = ["LatencyWindow", "RequestLatencies", "RequestTracker", "autoscaling_stats", "LATENCY_WINDOW_S"]

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


class RequestLatencies:
    """TTFT and TPOT windows of one replica; `track()` follows one request's outputs."""

    def __init__(self, window_s: float = LATENCY_WINDOW_S):
        self.ttft_ms = LatencyWindow(window_s)
        self.tpot_ms = LatencyWindow(window_s)

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
        self.num_tokens += sum(len(c.token_ids) for c in output.outputs if c.index == 0)
        m = output.metrics
        if m is None or m.first_token_time is None:
            return
        if not self._ttft_recorded:
            self._ttft_recorded = True
            self._latencies.ttft_ms.add(1000 * (m.first_token_time - m.arrival_time))
        if not output.finished or m.finished_time is None or any(c.finish_reason == "abort" for c in output.outputs):
            return
        if self._continues and self.num_tokens >= 1:
            self._latencies.tpot_ms.add(1000 * (m.finished_time - m.arrival_time) / self.num_tokens)
        elif not self._continues and self.num_tokens >= 2:
            self._latencies.tpot_ms.add(1000 * (m.finished_time - m.first_token_time) / (self.num_tokens - 1))


def autoscaling_stats(stats: EngineStats, latencies: RequestLatencies) -> dict[str, float]:
    """The values router.autoscaling.decide reads, by signal name."""
    return {
        "queued_prefill_tokens": float(stats.num_queued_prefill_tokens),
        "ttft_p95_ms": latencies.ttft_ms.percentile(95) or 0.0,
        "num_seqs": float(stats.num_running + stats.num_waiting),
        "kv_utilization": float(stats.kv_cache_usage),
        "tpot_p95_ms": latencies.tpot_ms.percentile(95) or 0.0,
    }
