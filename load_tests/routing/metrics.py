"""What the routing benchmark reports of one policy's run (simulated or real).

    prefix hit rate     cached prompt tokens / prompt tokens, over every request
    TTFT                request arrival -> first token (queue wait + prefill), p50 and p95
    max/mean load       load = prompt tokens a replica computed (not served from its cache);
                        the busiest replica's over the pool's mean, idle replicas included
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["RoutedRequest", "PolicyRun", "percentile"]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class RoutedRequest:
    """Where one request of a routing run went, and what the prefix cache saved it."""

    replica: str
    num_prompt_tokens: int
    num_cached_tokens: int
    ttft_s: float


@dataclass
class PolicyRun:
    policy: str
    replicas: list[str]  # every replica of the pool, including ones that got nothing
    records: list[RoutedRequest]
    decisions: dict[str, int] = field(default_factory=dict)  # by reason

    @property
    def num_prompt_tokens(self) -> int:
        return sum(r.num_prompt_tokens for r in self.records)

    @property
    def num_cached_tokens(self) -> int:
        return sum(r.num_cached_tokens for r in self.records)

    @property
    def hit_rate(self) -> float:
        return self.num_cached_tokens / self.num_prompt_tokens if self.records else 0.0

    def ttft_ms(self, q: float) -> float | None:
        value = percentile([r.ttft_s for r in self.records], q)
        return None if value is None else value * 1e3

    @property
    def computed_tokens_by_replica(self) -> dict[str, int]:
        load = dict.fromkeys(self.replicas, 0)
        for r in self.records:
            load[r.replica] = load.get(r.replica, 0) + r.num_prompt_tokens - r.num_cached_tokens
        return load

    @property
    def requests_by_replica(self) -> dict[str, int]:
        counts = dict.fromkeys(self.replicas, 0)
        for r in self.records:
            counts[r.replica] = counts.get(r.replica, 0) + 1
        return counts

    @property
    def max_over_mean_load(self) -> float | None:
        load = list(self.computed_tokens_by_replica.values())
        mean = sum(load) / len(load) if load else 0
        return max(load) / mean if mean else None

    def to_json(self) -> dict:
        return {
            "policy": self.policy,
            "num_requests": len(self.records),
            "hit_rate": self.hit_rate,
            "ttft_ms_p50": self.ttft_ms(50),
            "ttft_ms_p95": self.ttft_ms(95),
            "max_over_mean_load": self.max_over_mean_load,
            "computed_tokens_by_replica": self.computed_tokens_by_replica,
            "requests_by_replica": self.requests_by_replica,
            "decisions": dict(self.decisions),
        }
