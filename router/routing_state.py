"""What one router knows of a pool, and how it turns that into a decision. No Ray: the Serve
adapter (router/request_router.py) and the routing benchmark's simulator (load_tests/routing_sim.py)
both drive this, so the simulator makes exactly the decisions a deployed router would.

    replica routing stats (newest per replica) ──▶ RouterState.route(request, candidates, now)
        kv_hashes snapshot ──▶ PrefixIndex.update      (older or repeated versions ignored)
        load figures       ──▶ ReplicaLoad             (load_from_stats)
            + prefill tokens this router sent the replica after its stats were taken
        policy.choose(request, loads, index) ──▶ Decision
        then: count the chosen replica's uncached tokens as in flight, note_routed its hashes

A router counts what it sent since a replica's last stats because stats lag (one stats period,
0.5 s by default): without it a burst of requests would all see the same stale queue and pile
onto one replica. Entries older than the stats they are covered by are dropped; entries older
than INFLIGHT_HORIZON_S are dropped even if no stats arrive (a replica whose stats stopped).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable, Iterable, Sequence

from router.index import PrefixIndex
from router.policies import Decision, ReplicaLoad, RouteRequest

__all__ = ["RouterState", "InflightTokens", "load_from_stats", "INFLIGHT_HORIZON_S"]

INFLIGHT_HORIZON_S = 30.0  # forget routed-token accounting older than this even without stats


def load_from_stats(replica_id: Hashable, stats: dict | None) -> ReplicaLoad:
    """A replica's load figures from its routing stats (serving/deployments/engine_worker.py `routing_stats`)."""
    stats = stats or {}
    return ReplicaLoad(
        replica_id=replica_id,
        queued_prefill_tokens=int(stats.get("num_queued_prefill_tokens", 0)),
        prefill_tokens_per_s=float(stats.get("prefill_tokens_per_s", 0.0)),
        num_running=int(stats.get("num_running", 0)),
        num_waiting=int(stats.get("num_waiting", 0)),
        num_free_blocks=int(stats.get("num_free_blocks", 0)),
        num_blocks=int(stats.get("num_blocks", 0)),
        kv_usage=float(stats.get("kv_cache_usage", 0.0)),
    )


class InflightTokens:
    """Prefill tokens sent to each replica, by send time, until its stats cover them."""

    def __init__(self, horizon_s: float = INFLIGHT_HORIZON_S) -> None:
        self.horizon_s = horizon_s
        self._sent: dict[Hashable, deque[tuple[float, int]]] = {}

    def add(self, replica_id: Hashable, now: float, num_tokens: int) -> None:
        self._sent.setdefault(replica_id, deque()).append((now, num_tokens))

    def unreported(self, replica_id: Hashable, stats_time: float, now: float) -> int:
        """Tokens sent after the replica's stats (taken at `stats_time`) and within the horizon."""
        sent = self._sent.get(replica_id)
        if not sent:
            return 0
        cutoff = max(stats_time, now - self.horizon_s)
        while sent and sent[0][0] <= cutoff:
            sent.popleft()
        return sum(num_tokens for _, num_tokens in sent)

    def remove(self, replica_id: Hashable) -> None:
        self._sent.pop(replica_id, None)


class RouterState:
    """One router's policy, prefix index, in-flight accounting and decision counts."""

    def __init__(self, policy) -> None:
        self.policy = policy
        self.index = PrefixIndex()
        self.inflight = InflightTokens()
        self.decisions: Counter[str] = Counter()  # by reason, for metrics

    def route(
        self,
        request: RouteRequest,
        candidates: Sequence[tuple[Hashable, dict | None]],
        now: float,
        *,
        known_replicas: Iterable[Hashable] = (),
    ) -> Decision:
        """Choose among `candidates` (replica id, its newest routing stats or None) at wall time
        `now`. Index entries of replicas neither known nor candidates are dropped."""
        assert candidates, "route() needs at least one candidate"
        self.index.retain({*known_replicas, *(replica_id for replica_id, _ in candidates)})
        loads = [self.load(replica_id, stats, now) for replica_id, stats in candidates]
        decision = self.policy.choose(request, loads, self.index)
        self.decisions[decision.reason] += 1
        self.inflight.add(decision.chosen, now, max(0, request.num_prompt_tokens - decision.num_matched_tokens))
        if request.block_hashes:
            self.index.note_routed(decision.chosen, request.block_hashes)
        return decision

    def load(self, replica_id: Hashable, stats: dict | None, now: float) -> ReplicaLoad:
        """Feed the index from the stats' snapshot; the load figures plus unreported tokens."""
        stats = stats or {}
        if "kv_hashes" in stats:
            self.index.update(
                replica_id, int(stats.get("kv_version", 0)), stats["kv_hashes"], epoch=int(stats.get("epoch", 0)),
            )
        load = load_from_stats(replica_id, stats)
        load.queued_prefill_tokens += self.inflight.unreported(replica_id, float(stats.get("time", 0.0)), now)
        return load

    def remove(self, replica_id: Hashable) -> None:
        """A replica died or left: forget what this router knew of it."""
        self.index.remove(replica_id)
        self.inflight.remove(replica_id)
