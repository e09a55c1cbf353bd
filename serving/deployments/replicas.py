"""The Serve deployments: OpenAIIngress, PrefillWorker, DecodeWorker and (colocated) Worker.

Each is a thin shell: the ingress wraps OpenAIServer (serving/api/endpoints/routes.py) around a Frontend
and a ServeBackend; the workers wrap EngineWorker (serving/deployments/engine_worker.py). Their options (replicas,
CPUs, queue limits) are set by `serving.deployments.app.build_app` from the ServeConfig.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from ray import serve

from serving.api.admission.forwarding import ForwardedRequest, serve_forwarded
from serving.api.generation.pipeline import Frontend
from serving.config import ServeConfig
from serving.deployments.cpu_pinning import cores_for_rank, pin_process
from serving.deployments.messages import KVHandle, ModelInfo, PrefillResult, WorkerError, WorkerRequest, WorkerStats
from serving.observability import tracing
from serving.observability.worker_metrics import WorkerRecorder

__all__ = ["OpenAIIngress", "PrefillWorker", "DecodeWorker", "Worker"]

logger = logging.getLogger(__name__)


def _transport(handle, config: ServeConfig):
    """A worker pool's handle, on Serve's gRPC transport with `ray.grpc_transport` (the calls'
    arguments and streamed outputs go replica to replica, not through Ray's object streams;
    measured on 2 cores: half the ingress's CPU per streamed token, with the proxy on gRPC too)."""
    if handle is None or not config.ray.grpc_transport:
        return handle
    return handle.options(_by_reference=False)


class _WorkerDeployment:
    role = "worker"

    def __init__(self, config: dict):
        from serving.deployments.engine_worker import EngineWorker

        cfg = ServeConfig.model_validate(config)
        tracing.setup(self.role)
        pool = {"prefill": cfg.prefill, "decode": cfg.decode}.get(self.role, cfg.worker)
        context = serve.get_replica_context()
        local_rank = context.rank.local_rank if context.rank is not None else 0  # rank on this node
        cores = cores_for_rank(pool.cpu_affinity, local_rank)
        if cores is not None:  # before the engine starts its threads: they inherit the mask
            pin_process(cores, what=f"{self.role} replica (local rank {local_rank})")
        recorder = WorkerRecorder(cfg.model_name, self.role, context.replica_id.unique_id)
        self.worker = EngineWorker(self.role, cfg.engine_config(self.role), cfg.kv_transfer, cfg.app_name, recorder,
                                   replica=context.replica_id.unique_id)

    def model_info(self) -> ModelInfo:
        return self.worker.model_info()

    def stats(self) -> WorkerStats:
        return self.worker.stats()

    async def check_adapter(self, name: str, path: str) -> WorkerError | None:
        """Whether a LoRA adapter loads here (POST /v1/load_lora_adapter; EngineWorker.check_adapter)."""
        return await self.worker.check_adapter(name, path)

    def check_health(self) -> None:
        self.worker.check_health()

    def record_routing_stats(self) -> dict:
        """Serve's wire form of RoutingStats (router/replica_stats.py)."""
        return self.worker.routing_stats().to_wire()

    async def generate(
        self, request: WorkerRequest, kv: KVHandle | None = None, prior_output_token_ids: list[int] | None = None
    ) -> AsyncIterator:
        async for out in self.worker.generate(request, kv, prior_output_token_ids):
            yield out

    def __del__(self):
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.shutdown()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve calls this every window_s / 5 and pushes the values to the controller, where the
        pool's autoscaling policy (router/autoscaling/decide.py) reads them as ReplicaSignals."""
        return self.worker.autoscaling_signals().to_wire()


@serve.deployment(name="PrefillWorker")
class PrefillWorker(_WorkerDeployment):
    role = "prefill"

    async def prefill(self, request: WorkerRequest) -> PrefillResult | WorkerError:
        result = await self.worker.prefill(request)
        if isinstance(result, PrefillResult):
            result.replica = serve.get_replica_context().replica_id.unique_id
        return result


@serve.deployment(name="DecodeWorker")
class DecodeWorker(_WorkerDeployment):
    role = "decode"


@serve.deployment(name="Worker")
class Worker(_WorkerDeployment):
    role = "worker"


@serve.deployment(name="OpenAIIngress")
@serve.ingress()
class OpenAIIngress:
    def __init__(self, config: dict, prefill, decode, price: dict | None = None, limits=None, adapters=None):
        from serving.api.endpoints.routes import OpenAIServer
        from serving.api.usage import ModelPrice
        from serving.deployments.fallback import FallbackClient
        from serving.deployments.serve_backend import ServeBackend
        from serving.engine.modeling.loader import load_tokenizer, resolve_model_dir
        from serving.observability.export import export_serve_pools

        cfg = ServeConfig.model_validate(config)
        tracing.setup("ingress")
        tokenizer = load_tokenizer(resolve_model_dir(cfg.model))
        self.backend = ServeBackend(cfg, prefill=_transport(prefill, cfg), decode=_transport(decode, cfg))
        model_price = ModelPrice.model_validate(price) if price is not None else None
        fallback = cfg.degradation.fallback if cfg.degradation is not None else None
        self.server = OpenAIServer(Frontend(tokenizer, self.backend, cfg.model_name, max_merged_tokens=cfg.ingress.max_merged_tokens), cfg, model_price,
                                   FallbackClient(fallback.app) if fallback is not None else None)
        self.backend.on_recovery = self.server.metrics.recovered
        self.pool_view = export_serve_pools(self.server.metrics, cfg.app_name, (prefill, decode))
        self.limits_sync = None
        if limits is not None:
            from serving.deployments.limits_sync import LimitsSync

            self.limits_sync = LimitsSync(
                self.server.limiter, {k.name: k for k in cfg.keys}, limits,
                str(serve.get_replica_context().replica_id), cfg.ingress.limits_sync_interval_s,
            )
            self.limits_sync.start()
        if adapters is not None:  # runtime LoRA adapters shared with the other ingress replicas
            from serving.deployments.adapter_registry import AdapterSync

            self.server.adapter_sync = AdapterSync(adapters, self.server.runtime_adapters, cfg.ingress.limits_sync_interval_s)
            self.server.adapter_sync.start()

    def __serve_build_asgi_app__(self):
        self.asgi_app = self.server.build_app()
        return self.asgi_app

    async def forward(self, request: ForwardedRequest) -> AsyncIterator:
        """A request another kvrelay app degraded to this one (serving/deployments/fallback.py), answered by
        this app's HTTP routes as if it had come over HTTP: a ResponseStart, then body bytes."""
        async for message in serve_forwarded(self.asgi_app, request):
            yield message

    def __del__(self):
        if getattr(self, "pool_view", None) is not None:
            self.pool_view.stop()
        if getattr(self, "limits_sync", None) is not None:
            self.limits_sync.stop()
        if getattr(getattr(self, "server", None), "adapter_sync", None) is not None:
            self.server.adapter_sync.stop()
        tracing.flush()  # the last requests' spans
