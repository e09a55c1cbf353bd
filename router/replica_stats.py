"""RoutingStats: what a worker replica reports to the routers of its pool, typed at both ends.

    worker (every routing.stats_period_s)                        router (each routing decision)
    EngineWorker.routing_stats() ─▶ RoutingStats(...).to_wire()  RoutingStats.from_wire(replica.routing_stats)
                                      │ Serve's record_routing_stats: through the controller
                                      └───────────────────────────────────▶ RunningReplica.routing_stats

Serve carries routing stats through its controller, which unpickles them without our packages on
its path, so on the wire they are a dict of plain values (Serve's own contract for
`record_routing_stats`). Only this class writes and reads that dict, by its field names: no
string key is spelt anywhere else, and a field added here reaches both ends.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["RoutingStats", "RequestRate"]

# One metric family of a replica, as plain values: (name, type, help, [(sample name, labels, value)]).
MetricFamily = tuple[str, str, str, list[tuple[str, dict[str, str], float]]]


@dataclass(frozen=True)
class RoutingStats:
    epoch: int = 0  # orders an engine's snapshots after those of the engine it replaced
    wall_time_s: float = 0.0  # time.time() when taken: tokens routed after it are not in its queue yet
    # The exact set of block hashes the engine holds (router/index.py CachedBlockSet), versioned.
    kv_version: int = 0
    # Encoded (router/index.py encode_hashes), in eviction order (least recently used first); a
    # sequence where nothing crosses a process (the simulator); None: not reported.
    kv_hashes: bytes | Sequence[int] | None = None
    block_size: int = 16
    # The load figures of the cost model (router/policies.py).
    num_queued_prefill_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    kv_usage: float = 0.0
    # A decode replica's recent KV hand-offs: claim to payload in hand, seconds (an average that
    # weighs recent imports most); 0 before its first (router/disaggregation.py).
    kv_import_s: float = 0.0
    # Requests the replica took lately, per second (RequestRate below); 0 before the first. The
    # prefill policy prices the delay a long prefill causes the requests arriving behind it.
    requests_per_s: float = 0.0
    # Cumulative counters since the engine started: the tokens it ran through the model and the
    # requests it took. Every router turns them into the same recent load per replica
    # (router/pool_load.py), which the prefill policy bounds. -1: not reported; a worker reports
    # 0 before its first request, which is a router's baseline of nothing computed.
    num_computed_tokens: int = -1
    num_requests: int = -1
    # How many of the replica's recent requests used each block of its snapshot (decayed, the
    # frequent ones only: router/eviction.py BlockReuse.counts), and the decayed count of its
    # requests. Every router pools them: its own counts see only the requests it sent. None: not
    # reported.
    block_reuse: Mapping[int, float] | None = None
    block_reuse_weight: float = 0.0
    # Speculative decoding (serving/engine/spec/speculative.py), cumulative since the engine started:
    # the proposer ("": off), proposed tokens a step verified, those kept, and the sequence-steps
    # that verified. And what a decoding sequence gained per step since the previous report
    # (generated / (generated - accepted): 1.0 without speculation; the last figure when idle).
    # LoRA (serving/engine/modeling/lora.py): the adapters in the engine's slots, and what loading one
    # costs there (seconds; 0: none loaded yet). A replica that must load a request's adapter
    # first is that much slower to its first token (router/prefix_cost.py).
    lora_resident: tuple[str, ...] = ()
    lora_load_s: float = 0.0
    lora_slots_free: int = -1  # slots a new adapter may take now (none: it waits for a running request); -1: unknown
    spec_method: str = ""
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verify_steps: int = 0
    decode_tokens_per_step: float = 1.0
    # The replica's metrics (WorkerRecorder.snapshot), which the ingress's GET /metrics re-exports
    # (serving/observability/export.py): they ride along instead of a scrape of every replica.
    metrics: tuple[MetricFamily, ...] = ()

    @property
    def spec_acceptance_rate(self) -> float:
        """Kept / proposed since the engine started; 0.0 before any proposal (or without speculation)."""
        return self.spec_accepted_tokens / self.spec_proposed_tokens if self.spec_proposed_tokens else 0.0

    def to_wire(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any] | None) -> RoutingStats | None:
        """None for a replica that has not reported yet (Serve gives an empty dict). Keys this
        version does not know (a newer worker during a rolling update) are ignored."""
        if not data:
            return None
        names = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in names})


class RequestRate:
    """Requests per second, decayed exponentially with time constant `window_s`: each arrival
    adds 1 to a count that decays as exp(-age / window_s); the rate is that count / window_s,
    which is the arrival rate once `window_s` of steady arrivals have passed (less before)."""

    def __init__(self, window_s: float = 30.0) -> None:
        assert window_s > 0, window_s
        self.window_s = window_s
        self._count = 0.0
        self._at = 0.0

    def add(self, now: float) -> None:
        self._count = self._count * math.exp(-max(0.0, now - self._at) / self.window_s) + 1.0
        self._at = now

    def per_s(self, now: float) -> float:
        return self._count * math.exp(-max(0.0, now - self._at) / self.window_s) / self.window_s
