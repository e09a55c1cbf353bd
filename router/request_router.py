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

Selected per deployment with `request_router_config` (see serving/deployments/app.py); parameters are the
policy's (router/policies.py) and arrive as `request_router_kwargs`.
"""

from __future__ import annotations

import logging
import time

from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve._private.request_router.request_router import FIFOMixin, RequestRouter

from router.policies import LeastKVPolicy, PrefixCostPolicy, RouteRequest, build_policy
from router.routing_state import RouterState, load_from_stats
from serving.observability.metrics import POOL_OF_DEPLOYMENT, record_routing_decision, register_router

__all__ = ["PrefixAwareRequestRouter", "KVAwareRequestRouter", "route_request_from_args", "load_from_stats"]

logger = logging.getLogger(__name__)


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
        token_ids=token_ids,
    )


class _PolicyRouter(FIFOMixin, RequestRouter):
    default_policy = "prefix_cost"

    def initialize_state(self, policy: str | None = None, **params) -> None:
        # The decision itself (index, in-flight accounting, policy) is Ray-free: router/routing_state.py.
        self.state = RouterState(build_policy(policy or self.default_policy, **params))
        self.pool = POOL_OF_DEPLOYMENT.get(self.deployment_name, self.deployment_name)
        # Serve ships this class by value (its module globals are a copy in each process), so
        # the registry the ingress's GET /metrics reads lives in serving.observability.metrics.
        register_router(self)

    @property
    def deployment_name(self) -> str:
        return self._deployment_id.name

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        request = route_request_from_args(pending_request)
        if request is None:  # a control call (stats, model_info): any replica
            return [candidate_replicas]
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        decision = self.state.route(
            request, [(replica.replica_id, replica.routing_stats) for replica in candidate_replicas], time.time(),
            known_replicas=self._all_replica_ids(),
        )
        record_routing_decision(self.pool, self.state.policy.name, decision.reason)
        return [[by_id[replica_id]] for replica_id in decision.ranked]

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.state.remove(replica_id)

    def _all_replica_ids(self) -> set:
        return {replica.replica_id for replica in self._replicas_list} if hasattr(self, "_replicas_list") else set()


class PrefixAwareRequestRouter(_PolicyRouter):
    """The prefill pool's router: PrefixCostPolicy unless `policy` names another."""

    default_policy = PrefixCostPolicy.name


class KVAwareRequestRouter(_PolicyRouter):
    """The decode pool's router: LeastKVPolicy unless `policy` names another."""

    default_policy = LeastKVPolicy.name
