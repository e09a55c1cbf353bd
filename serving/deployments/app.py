"""`build_app`: the Serve application for a ServeConfig.

    serve run serving.deployments.app:build_app config=deploy/local.yaml [mode=colocated decode.num_replicas=2]
    kvrelay serve --config deploy/local.yaml

`args` (from `serve run` / a Serve config file's `args:`) may name a YAML file under `config`
and override fields with dotted keys; `KVRELAY_*` environment variables apply last.
"""

from __future__ import annotations

import os
from typing import Any

from ray.serve import Application
from ray.serve.config import BackpressureConfig, RequestRouterConfig

from router.autoscaling.decide import serve_autoscaling_config
from router.autoscaling.policy import load_policy
from router.policy_params import PolicyParams
from router.request_router import KVAwareRequestRouter, PrefixAwareRequestRouter
from serving.api.usage import ModelPrice, load_pricing
from serving.config import PoolConfig, RoutingConfig, ServeConfig, load_config
from serving.config.layout import node_cores, omp_wait_policy
from serving.deployments import faults
from serving.deployments.adapter_registry import AdapterRegistryDeployment
from serving.deployments.limits_sync import LimitsExchangeDeployment
from serving.deployments.replicas import DecodeWorker, OpenAIIngress, PrefillWorker, Worker
from serving.observability import tracing

__all__ = ["build_app", "build_prefill_pool", "config_from_args", "REPLICA_ENV", "INGRESS_RETRY_AFTER_S"]

INGRESS_RETRY_AFTER_S = 1  # the proxy's Retry-After when the ingress queue is full (as queue_full's)

# Serve runs a replica's user code on a second event loop in another thread, and a handle's router
# on a third, by default: every request then crosses threads several times (measured: ~1 ms per
# request through the ingress on this 2-core machine, within noise; kept because it removes two
# thread hops per request). Our replicas never block their loop (the
# engine steps in its own thread), so they run user code and routers on the replica's own loop.
REPLICA_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}


def replica_grpc_message_bytes(config: ServeConfig) -> int:
    """The largest call a replica takes over gRPC: 4x the largest request body (what a worker call
    made from one can grow to: its prompt's token ids and block hashes beside the body's fields),
    and never under 64 MiB; within gRPC's limit of 2 GiB."""
    return min(2**31 - 1, max(64 * 2**20, 4 * config.max_request_body_bytes))


def config_from_args(args: dict[str, Any] | None) -> ServeConfig:
    args = dict(args or {})
    path = args.pop("config", None)
    return load_config(path, overrides=args)


def build_app(args: dict[str, Any] | ServeConfig | None = None) -> Application:
    config = args if isinstance(args, ServeConfig) else config_from_args(args)
    data = config.model_dump(mode="json")
    # Read here, so a bad file fails before anything deploys and replicas need not have it.
    price = load_pricing(config.pricing).price_for(config.model_name, config.pricing) if config.pricing else None
    ingress = OpenAIIngress.options(
        num_replicas=config.ingress.num_replicas,
        max_ongoing_requests=config.ingress.max_ongoing_requests,
        # Overload is refused by the proxy at once, as a pool's full queue is (429 queue_full).
        max_queued_requests=config.ingress.max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=INGRESS_RETRY_AFTER_S),
        ray_actor_options={"num_cpus": config.ingress.num_cpus, "runtime_env": {"env_vars": _replica_env(config)}},
    )
    policy = load_policy(config.autoscaling_policy) if config.autoscaling_policy else None
    scaling = {pool: serve_autoscaling_config(pool, policy) if policy else None for pool in ("prefill", "decode", "worker")}
    routing = config.routing
    prefill_router = _prefill_router(routing)
    if config.mode == "colocated":
        worker = _pool(Worker, config, config.worker, prefill_router, scaling["worker"]).bind(data)
        return ingress.bind(data, None, worker, price=_price_data(price), limits=_limits_exchange(config),
                           adapters=_adapter_registry(config))
    prefill = _pool(PrefillWorker, config, config.prefill, prefill_router, scaling["prefill"]).bind(data)
    decode_router = _router(KVAwareRequestRouter, routing.decode_policy, routing.decode_params, routing)
    decode = _pool(DecodeWorker, config, config.decode, decode_router, scaling["decode"]).bind(data)
    return ingress.bind(data, prefill, decode, price=_price_data(price), limits=_limits_exchange(config),
                           adapters=_adapter_registry(config))


def build_prefill_pool(config: ServeConfig) -> Application:
    """The prefill pool alone, routed as in build_app, with no ingress and no decode pool: for a
    benchmark that sends WorkerRequests to it by handle (load_tests/routing/real.py), which then
    starts half the replicas per app."""
    return _pool(PrefillWorker, config, config.prefill, _prefill_router(config.routing)).bind(config.model_dump(mode="json"))


def _adapter_registry(config: ServeConfig):
    """The shared table of LoRA adapters loaded at run time, where several ingress replicas serve
    them (serving/deployments/adapter_registry.py)."""
    lora = config.lora
    if config.ingress.num_replicas < 2 or lora is None or not lora.allow_runtime_updates:
        return None
    return AdapterRegistryDeployment.bind()


def _limits_exchange(config: ServeConfig):
    """The shared per-key counters, where several ingress replicas enforce limits (serving/deployments/limits_sync.py)."""
    limited = any(t.requests_per_minute or t.tokens_per_minute or t.max_concurrent_requests for t in config.tiers.values())
    if config.ingress.num_replicas < 2 or not limited:
        return None
    return LimitsExchangeDeployment.bind(stale_s=10 * config.ingress.limits_sync_interval_s)


def _replica_env(config: ServeConfig) -> dict[str, str]:
    """REPLICA_ENV plus the builder's OTEL_* variables (serving/observability/tracing.py) and KVRELAY_FAULTS
    (serving/deployments/faults.py): replicas on a node started elsewhere would not otherwise see them. They
    show in the Ray dashboard's runtime env: pass exporter credentials (OTEL_EXPORTER_OTLP_HEADERS)
    another way if that matters.

    On the gRPC transport (ray.grpc_transport), a replica takes calls of up to
    replica_grpc_message_bytes (Serve's default is 4 MiB: a request body the ingress accepts, a
    JSON schema or a long prompt, can make a larger worker call)."""
    env = {**REPLICA_ENV, **tracing.otel_env()}
    env["RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"] = str(replica_grpc_message_bytes(config))
    if os.environ.get(faults.ENV):  # fault injection, for tests and chaos runs (serving/deployments/faults.py)
        faults.parse(os.environ[faults.ENV])  # a bad value fails here, not in every replica
        env[faults.ENV] = os.environ[faults.ENV]
    return env


def _price_data(price: ModelPrice | None) -> dict | None:
    return price.model_dump(mode="json") if price is not None else None


def _prefill_router(routing: RoutingConfig) -> RequestRouterConfig:
    """The prefill (or colocated) pool's router: prefix-aware, by routing.prefill_policy."""
    return _router(PrefixAwareRequestRouter, routing.prefill_policy, routing.prefill_params, routing)


def _router(cls, policy: str, params: PolicyParams, routing: RoutingConfig) -> RequestRouterConfig:
    return RequestRouterConfig(
        request_router_class=cls,
        request_router_kwargs={"policy": policy, **params.model_dump()},
        request_routing_stats_period_s=routing.stats_period_s,
        request_routing_stats_timeout_s=max(5.0, 4 * routing.stats_period_s),
    )


def _pool(deployment, config: ServeConfig, pool: PoolConfig, router_config: RequestRouterConfig, autoscaling: dict | None = None):
    env = _replica_env(config)
    # OpenMP reads its wait policy at process start: it travels in the env (serving/config/layout.py).
    # `auto` leaves one set for the whole Ray cluster (OMP_WAIT_POLICY in this environment) alone.
    engine = config.engine_config(pool)
    policy = omp_wait_policy(pool.omp_wait_policy, engine.num_threads, pool.cpu_affinity, node_cores(), engine.backend)
    if policy is not None and not (pool.omp_wait_policy == "auto" and "OMP_WAIT_POLICY" in os.environ):
        env["OMP_WAIT_POLICY"] = policy
    actor_options: dict[str, Any] = {"num_cpus": pool.num_cpus, "runtime_env": {"env_vars": env}}
    if pool.num_gpus:
        actor_options["num_gpus"] = pool.num_gpus
    if pool.resources:
        actor_options["resources"] = dict(pool.resources)
    # With an autoscaling policy, Serve starts min_replicas and the policy moves the count.
    replicas = {"autoscaling_config": autoscaling} if autoscaling else {"num_replicas": pool.num_replicas}
    return deployment.options(
        **replicas,
        max_ongoing_requests=pool.max_ongoing_requests,
        max_queued_requests=pool.max_queued_requests,
        ray_actor_options=actor_options,
        request_router_config=router_config,
    )
