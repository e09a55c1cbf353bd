"""Ray Serve request routers for the worker pools: the policies of router/policies.py behind
Serve's `RequestRouter` interface (one method, `choose_replicas`).

    PrefixAwareRequestRouter   PrefillWorker (and Worker in colocated mode): PrefixCostPolicy
    KVAwareRequestRouter       DecodeWorker: LeastKVPolicy

A router lives in every process that holds a handle to the pool (the ingress replicas). It reads
each replica's routing stats (`record_routing_stats` on the worker: a versioned snapshot of its
cached block hashes, queued prefill tokens, measured prefill rate, KV usage) as Serve broadcasts
them, keeps the exact PrefixIndex from them, and counts the prefill tokens it has sent each
replica since that replica's last stats so a burst does not pile onto one replica while the
stats catch up. The request's block hashes were computed once, at the ingress.

Selected per deployment with `request_router_config` (see serving/app.py); parameters are the
policy's (router/policies.py) and arrive as `request_router_kwargs`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque

from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve._private.request_router.request_router import FIFOMixin, RequestRouter

from router.index import PrefixIndex
from router.policies import LeastKVPolicy, PrefixCostPolicy, ReplicaLoad, RouteRequest, build_policy

__all__ = ["PrefixAwareRequestRouter", "KVAwareRequestRouter", "route_request_from_args", "load_from_stats"]

logger = logging.getLogger(__name__)

_INFLIGHT_HORIZON_S = 30.0  # forget routed-token accounting older than this even without stats


def route_request_from_args(pending_request: PendingRequest | None) -> RouteRequest | None:
    """The RouteRequest of a worker call (`prefill(request)` / `generate(request, ...)`)."""
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    token_ids = getattr(request, "prompt_token_ids", None)
    if token_ids is None:
        return None
    return RouteRequest(
        request_id=request.request_id,
        num_prompt_tokens=len(token_ids),
        block_hashes=getattr(request, "block_hashes", None) or (),
        block_size=getattr(request, "block_size", 16),
        session=getattr(request, "session", None),
    )


def load_from_stats(replica_id, stats: dict | None) -> ReplicaLoad:
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


class _PolicyRouter(FIFOMixin, RequestRouter):
    default_policy = "prefix_cost"

    def initialize_state(self, policy: str | None = None, **params) -> None:
        self.policy = build_policy(policy or self.default_policy, **params)
        self.index = PrefixIndex()
        self.decisions: Counter[str] = Counter()  # by reason, for metrics
        # replica -> deque of (routed at wall time, prefill tokens), pruned by its stats' time
        self._inflight: dict[object, deque] = {}

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        request = route_request_from_args(pending_request)
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        if request is None:  # a control call (stats, model_info): any replica
            return [candidate_replicas]
        self.index.retain(self._all_replica_ids() | set(by_id))
        loads = [self._load(replica) for replica in candidate_replicas]
        decision = self.policy.choose(request, loads, self.index)
        self.decisions[decision.reason] += 1
        chosen = decision.chosen
        uncached = max(0, request.num_prompt_tokens - decision.num_matched_tokens)
        self._inflight.setdefault(chosen, deque()).append((time.time(), uncached))
        if request.block_hashes:
            self.index.note_routed(chosen, request.block_hashes)
        return [[by_id[replica_id]] for replica_id in decision.ranked]

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.remove(replica_id)
        self._inflight.pop(replica_id, None)

    def _all_replica_ids(self) -> set:
        return {replica.replica_id for replica in self._replicas_list} if hasattr(self, "_replicas_list") else set()

    def _load(self, replica: RunningReplica) -> ReplicaLoad:
        stats = replica.routing_stats or {}
        if "kv_hashes" in stats:
            self.index.update(
                replica.replica_id, int(stats.get("kv_version", 0)), stats["kv_hashes"],
                epoch=int(stats.get("epoch", 0)),
            )
        load = load_from_stats(replica.replica_id, stats)
        load.queued_prefill_tokens += self._unreported_tokens(replica.replica_id, float(stats.get("time", 0.0)))
        return load

    def _unreported_tokens(self, replica_id, stats_time: float) -> int:
        """Prefill tokens sent to the replica after its last stats were taken."""
        inflight = self._inflight.get(replica_id)
        if not inflight:
            return 0
        horizon = max(stats_time, time.time() - _INFLIGHT_HORIZON_S)
        while inflight and inflight[0][0] <= horizon:
            inflight.popleft()
        return sum(tokens for _, tokens in inflight)


class PrefixAwareRequestRouter(_PolicyRouter):
    """The prefill pool's router: PrefixCostPolicy unless `policy` names another."""

    default_policy = PrefixCostPolicy.name


class KVAwareRequestRouter(_PolicyRouter):
    """The decode pool's router: LeastKVPolicy unless `policy` names another."""

    default_policy = LeastKVPolicy.name
