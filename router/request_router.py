"""Ray Serve request routers for the worker pools: the policies of router/policies.py behind
Serve's `RequestRouter` interface (one method, `choose_replicas`).

    PrefixAwareRequestRouter   PrefillWorker (and Worker in colocated mode): PrefixCostPolicy
    KVAwareRequestRouter       DecodeWorker: LeastKVPolicy

A router lives in every process that holds a handle to the pool (the ingress replicas). It reads
each replica's routing stats (`record_routing_stats` on the worker: a versioned snapshot of its
cached block hashes, queued prefill tokens, measured prefill rate, KV usage) as Serve broadcasts
them, keeps the exact PrefixIndex from them, and counts the prefill tokens it has sent each
replica since that replica's last stats so a burst does not pile onto one replica while the
stats catch up. The request's block hashes were computed once, at the ingress. All of that is
Ray-free, in router/routing_state.py (`RouterState`); this module adapts it to Serve.

Each decision's prediction (the chosen replica and the prompt tokens the index says it holds) is
kept for the ingress, which checks it against the hit the engine found when the request's first
output comes back (serving/observability/request_path.py).

Selected per deployment with `request_router_config` (see serving/deployments/app.py); parameters are the
policy's (router/policies.py) and arrive as `request_router_kwargs`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve._private.request_router.request_router import FIFOMixin, RequestRouter

from router.policies import Decision, LeastKVPolicy, PrefixCostPolicy, RouteRequest, build_policy
from router.replica_stats import MetricFamily, RoutingStats
from router.routing_state import RouterState
from serving.observability.metrics import POOL_OF_DEPLOYMENT, record_routing_decision, register_router
from serving.observability.request_path import Prediction, record_prediction

__all__ = [
    "PrefixAwareRequestRouter", "KVAwareRequestRouter", "Routable", "apply_admission", "prediction_of", "route_request_from_args",
]

logger = logging.getLogger(__name__)

FIRST_STATS_WAIT_S = 1.0  # a new router's wait for its first routing stats (_first_stats)


@runtime_checkable
class Routable(Protocol):
    """What the routers read of a worker call's first argument (a WorkerRequest,
    serving/deployments/messages.py): its prompt, computed once at the ingress."""

    request_id: str
    prompt_token_ids: list[int]
    block_hashes: Sequence[int]
    block_size: int
    session: str | None


def route_request_from_args(pending_request: PendingRequest | None) -> RouteRequest | None:
    """The RouteRequest of a worker call (`prefill(request)` / `generate(request, ...)`); None for
    a control call (stats, model_info), which any replica answers."""
    if pending_request is None or not pending_request.args or not isinstance(pending_request.args[0], Routable):
        return None
    request = pending_request.args[0]
    return RouteRequest(
        request_id=request.request_id,
        num_prompt_tokens=len(request.prompt_token_ids),
        block_hashes=request.block_hashes,
        block_size=request.block_size,
        session=request.session,
        token_ids=request.prompt_token_ids,
        lora_name=getattr(request, "lora_name", None),
    )


def apply_admission(pending_request: PendingRequest, decision: Decision) -> None:
    """The admission (Decision.retain, router/prefix_cost.py) travels with the request as its
    `keep_cached`: Serve sends the call's arguments after choose_replicas returns."""
    request = pending_request.args[0]
    if hasattr(request, "keep_cached"):
        request.keep_cached = decision.retain


def prediction_of(policy: str, decision: Decision) -> Prediction:
    """What the ingress checks against the engine's hit (serving/observability/request_path.py):
    the chosen replica, by the id its worker reports (Serve's replica unique id), and the tokens
    the router's index says it holds."""
    chosen = decision.chosen
    return Prediction(policy, getattr(chosen, "unique_id", str(chosen)), decision.num_predicted_tokens)


class _PolicyRouter(FIFOMixin, RequestRouter):
    default_policy = "prefix_cost"

    def initialize_state(self, policy: str | None = None, **params) -> None:
        # The decision itself (index, in-flight accounting, policy) is Ray-free: router/routing_state.py.
        self.state = RouterState(build_policy(policy or self.default_policy, **params))
        self._seen_stats = False  # until the first decision: _first_stats
        self.pool = POOL_OF_DEPLOYMENT.get(self.deployment_name, self.deployment_name)
        # Serve ships this class by value (its module globals are a copy in each process), so
        # the registry the ingress's GET /metrics reads lives in serving.observability.metrics.
        register_router(self)

    @property
    def deployment_name(self) -> str:
        return self._deployment_id.name

    @property
    def app_name(self) -> str:
        return self._deployment_id.app_name

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        request = route_request_from_args(pending_request)
        if request is None:  # a control call (stats, model_info): any replica
            return [candidate_replicas]
        if not self._seen_stats:
            candidate_replicas = await self._first_stats(candidate_replicas)
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        decision = self.state.route(
            request, [(replica.replica_id, RoutingStats.from_wire(replica.routing_stats)) for replica in candidate_replicas],
            time.time(),
            known_replicas=self._all_replica_ids(),
            key=pending_request.metadata.internal_request_id,
        )
        apply_admission(pending_request, decision)
        record_routing_decision(self.pool, self.state.policy.name, decision.reason)
        record_prediction(request.request_id, self.pool, prediction_of(self.state.policy.name, decision))
        return [[by_id[replica_id]] for replica_id in decision.ranked]

    async def _first_stats(self, candidates: list[RunningReplica]) -> list[RunningReplica]:
        """A router making its first decision (a handle created while the caches are warm) waits
        up to FIRST_STATS_WAIT_S, once, until every candidate's routing stats have reached it:
        routing blind would send a prefix's request where it is not cached, a cold prefill, where
        the first snapshots are at most a stats period away."""
        deadline = time.monotonic() + FIRST_STATS_WAIT_S
        while not all(replica.routing_stats for replica in candidates) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            current = self.curr_replicas
            candidates = [current.get(replica.replica_id, replica) for replica in candidates]
        self._seen_stats = True
        return candidates

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        self.state.completed(internal_request_id, time.time())

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.state.remove(replica_id)

    # ---- what GET /metrics reads (serving/observability/export.py RoutersCollector) -----------------
    @property
    def policy_name(self) -> str:
        return self.state.policy.name

    def decision_counts(self) -> dict[str, int]:
        """Routing decisions of this router so far, by reason."""
        return dict(self.state.decisions)

    def replica_stats(self) -> list[RoutingStats]:
        """The newest stats of every replica of the pool that has reported."""
        stats = (RoutingStats.from_wire(replica.routing_stats) for replica in list(self.curr_replicas.values()))
        return [s for s in stats if s is not None]

    def replica_metrics(self) -> Iterator[tuple[object, tuple[MetricFamily, ...]]]:
        """(replica id, its metric families) of each replica in the pool, from its newest stats."""
        for replica_id, replica in list(self.curr_replicas.items()):
            stats = RoutingStats.from_wire(replica.routing_stats)
            if stats is not None:
                yield replica_id, stats.metrics

    def _all_replica_ids(self) -> set:
        return {replica.replica_id for replica in self._replicas_list} if hasattr(self, "_replicas_list") else set()


class PrefixAwareRequestRouter(_PolicyRouter):
    """The prefill pool's router: PrefixCostPolicy unless `policy` names another."""

    default_policy = PrefixCostPolicy.name


class KVAwareRequestRouter(_PolicyRouter):
    """The decode pool's router: LeastKVPolicy unless `policy` names another."""

    default_policy = LeastKVPolicy.name
