"""GET /metrics on the ingress: what one ingress replica knows, in Prometheus' exposition format.

    IngressMetrics.registry ─────────── this replica's requests (TTFT, TPOT, ITL, E2E, status,
    │                                   tokens) and the pool gauges PoolView keeps
    ├─ RoutersCollector, at each scrape, for every request router in this process (one per pool):
    │     its decision counts       ─▶ kvrelay_routing_decisions_total{pool, policy, reason}
    │     each replica's newest RoutingStats.metrics (WorkerRecorder.snapshot, sent every
    │     routing.stats_period_s)  ─▶ that worker's histograms, counters and gauges, as reported
    └─ PoolView, a background task: the Serve controller's replicas per pool by state and the
          pool's target count, every `period_s`

With one ingress replica (`make serve`, the tests) /metrics is the whole app. With several,
each replica's /metrics shows the workers in full but only its own requests and routing; a
cluster's Prometheus scrapes Ray's export instead (serving/observability/metrics.py), which has every replica.
A router exists once its handle has been used, so the workers appear after the first request.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Protocol

from prometheus_client.core import Metric

from serving.observability.ingress_metrics import IngressMetrics
from serving.observability.metrics import BY_NAME, POOL_OF_DEPLOYMENT, live_routers
from serving.observability.periodic import PeriodicTask

__all__ = ["RoutersCollector", "PoolView", "serve_pool_status", "export_serve_pools"]

logger = logging.getLogger(__name__)

PoolStatus = dict[str, tuple[dict[str, int], int | None]]  # deployment → (replicas by state, target)


class RouterView(Protocol):
    """What the collector reads of a request router (router/request_router.py)."""

    deployment_name: str
    policy_name: str

    def decision_counts(self) -> dict[str, int]: ...

    def replica_metrics(self) -> Iterable[tuple[Hashable, Iterable[tuple[str, str, str, list]]]]: ...


class RoutersCollector:
    """A prometheus_client collector over the request routers of this process
    (router/request_router.py registers them with serving.observability.metrics.register_router)."""

    def __init__(self, routers: Callable[[], list[RouterView]] | None = None):
        self._routers = routers

    def collect(self):
        spec = BY_NAME["kvrelay_routing_decisions_total"]
        decisions: Counter[tuple[str, str, str]] = Counter()
        families: dict[str, Metric] = {}
        seen: set = set()
        for router in (self._routers or live_routers)():
            pool = POOL_OF_DEPLOYMENT.get(router.deployment_name, router.deployment_name)
            for reason, count in router.decision_counts().items():
                decisions[(pool, router.policy_name, reason)] += count
            for replica_id, metric_families in router.replica_metrics():
                if replica_id in seen:  # two handles to one pool see the same replicas
                    continue
                seen.add(replica_id)
                for name, kind, doc, samples in metric_families:
                    family = families.get(name)
                    if family is None:
                        family = families[name] = Metric(name, doc, kind)
                    for sample_name, labels, value in samples:
                        family.add_sample(sample_name, labels, value)
        family = Metric(spec.name, spec.description, "counter")
        for (pool, policy, reason), count in sorted(decisions.items()):
            family.add_sample(spec.name, {"pool": pool, "policy": policy, "reason": reason}, count)
        yield family
        yield from families.values()


def serve_pool_status(app_name: str) -> PoolStatus:
    """The controller's view of an app's deployments (blocking: call it in a thread)."""
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()
    deployments = details.get("applications", {}).get(app_name, {}).get("deployments", {})
    status: PoolStatus = {}
    for name, deployment in deployments.items():
        states = Counter(str(getattr(r["state"], "value", r["state"])) for r in deployment.get("replicas", ()))
        status[name] = (dict(states), deployment.get("target_num_replicas"))
    return status


class PoolView:
    """Keeps IngressMetrics' pool gauges (replicas by state, desired replicas) from the controller.

    `deployments` maps pool → deployment name. Started from the ingress's constructor (which Serve
    runs on the replica's loop); `stop()` cancels it.
    """

    def __init__(
        self, metrics: IngressMetrics, app_name: str, deployments: Mapping[str, str], *,
        fetch: Callable[[str], PoolStatus] = serve_pool_status, period_s: float = 5.0,
    ):
        self.metrics = metrics
        self.app_name = app_name
        self.deployments = dict(deployments)
        self.period_s = period_s
        self._fetch = fetch
        self._loop = PeriodicTask(self.refresh, period_s, what="reading the pools' replica counts")

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()

    async def refresh(self) -> None:
        status = await asyncio.to_thread(self._fetch, self.app_name)
        for pool, name in self.deployments.items():
            if name in status:
                states, target = status[name]
                self.metrics.set_pool(pool, states, target)

def export_serve_pools(metrics: IngressMetrics, app_name: str, handles) -> PoolView | None:
    """At a Serve ingress: GET /metrics gets the routers' view, and a PoolView (returned, to be
    stopped) keeps the pool gauges; `handles` are the pools' deployment handles (None skipped)."""
    metrics.registry.register(RoutersCollector())
    deployments = {POOL_OF_DEPLOYMENT[h.deployment_name]: h.deployment_name for h in handles if h is not None}
    view = PoolView(metrics, app_name, deployments)
    try:
        view.start()
    except RuntimeError:  # no running loop: Serve runs constructors on the replica's loop
        logger.warning("no event loop in the ingress constructor: the pool gauges stay empty")
        return None
    return view
