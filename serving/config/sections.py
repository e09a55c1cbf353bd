"""The sections of the app's config: the engine settings (derived from EngineConfig, with the
serving defaults in one place), the pools, the ingress, HTTP, Ray, routing, the KV hand-off and
graceful degradation; what one API request may ask for is api_limits.py. ServeConfig
(serve_config.py) puts them together."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import annotated_types
from pydantic import Field, create_model, model_serializer, model_validator

from router.policy_params import DecodeParams, LeastKVParams, PrefillParams, PrefixCostParams, parse_params
from serving.engine.config import EngineConfig
from serving.engine.strict import StrictModel

__all__ = [
    "SERVING_ENGINE_DEFAULTS", "SERVING_ENGINE_LIMITS", "POOLS", "MOVED_KEYS", "EngineSettings", "EngineOverrides", "PoolConfig", "IngressConfig",
    "HTTPConfig", "RayConfig", "RoutingConfig", "KVTransferConfig", "FallbackConfig", "DegradationConfig",
]

# The engine defaults of a served app, where they differ from EngineConfig's (an engine alone,
# e.g. in `kvrelay bench engine`, owns the machine; a replica shares it with the others).
SERVING_ENGINE_DEFAULTS: dict[str, Any] = {
    "kv_cache_memory_fraction": 0.05,  # several replicas per machine
    "long_prefill_token_threshold": 256,  # a long prompt must not stall the other requests' TTFT
    "num_threads": 1,  # torch threads per replica: Ray's logical CPUs are not cores
    "max_queue_wait_s": 60.0,  # an overloaded pool answers 503 + Retry-After, not after minutes
    "priority_aging_s": 10.0,  # a tier's priority orders the queue; waiting 10 s is worth one level
}

# Tighter bounds than EngineConfig's where a served app needs them: a replica's context window
# holds at least a chat template's worth of tokens, and its torch threads are set, never torch's
# default of every core (several replicas share a machine).
SERVING_ENGINE_LIMITS: dict[str, tuple[Any, ...]] = {
    "max_model_len": (annotated_types.Ge(16),),
    "num_threads": (annotated_types.Ge(1), annotated_types.Le(512)),
}
SERVING_ENGINE_TYPES: dict[str, Any] = {"num_threads": int}
SERVING_ENGINE_DESCRIPTIONS = {
    "num_threads": "torch intra-op threads per replica; keep the sum over a node's replicas at or below "
    "its cores (oversubscribed OpenMP threads spin against each other).",
}

POOLS = ("prefill", "decode", "worker")
# Keys that moved (old path -> new path): an old config names them, the error says where to.
MOVED_KEYS = {
    **{name: f"engine.{name}" for name in EngineConfig.model_fields if name != "model"},
    **{f"{pool}.num_threads": f"{pool}.engine.num_threads" for pool in POOLS},
}


class _Overrides(StrictModel):
    """Keys left at None are not overridden, and not written when the config is dumped."""

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


def _engine_fields_model(name: str, doc: str, *, defaults: dict[str, Any] | None) -> type[StrictModel]:
    """A model of EngineConfig's fields but `model` (the app's), built from EngineConfig so no
    field is declared twice. `defaults` over EngineConfig's; None: every field optional (None),
    so only the keys given count."""
    fields: dict[str, Any] = {}
    for field_name, field in EngineConfig.model_fields.items():
        if field_name == "model":
            continue
        description = SERVING_ENGINE_DESCRIPTIONS.get(field_name, field.description)
        annotation = SERVING_ENGINE_TYPES.get(field_name, field.annotation)
        # ge, le, ...: checked here too, so errors name the key; the serving limits after them.
        for constraint in (*field.metadata, *SERVING_ENGINE_LIMITS.get(field_name, ())):
            annotation = Annotated[annotation, constraint]
        if defaults is None:
            fields[field_name] = (annotation | None, Field(None, description=description))
        else:
            fields[field_name] = (annotation, Field(defaults.get(field_name, field.default), description=description))
    return create_model(name, __base__=StrictModel if defaults is not None else _Overrides, __doc__=doc, **fields)


EngineSettings = _engine_fields_model(
    "EngineSettings", "Every worker's engine settings (EngineConfig's, with the serving defaults).",
    defaults=SERVING_ENGINE_DEFAULTS,
)
EngineOverrides = _engine_fields_model(
    "EngineOverrides", "A pool's own engine settings; a key left null takes the app's `engine` value.", defaults=None,
)


class PoolConfig(StrictModel):
    """One worker pool (a Serve deployment wrapping engines)."""

    num_replicas: int = Field(
        1, ge=1, le=256,
        description="Replicas in this pool; unused when the autoscaling policy has a section for "
        "the pool (its min_replicas/max_replicas apply instead).",
    )
    num_cpus: float = Field(
        0.5, gt=0, le=256,
        description="Ray logical CPUs reserved per replica (fractional values let several "
        "replicas share a small machine).",
    )
    num_gpus: float = Field(0, ge=0, le=16, description="GPUs per replica (CUDA engines).")
    engine: EngineOverrides = Field(
        default_factory=EngineOverrides,
        description="This pool's engine settings where they differ from the app's `engine`, e.g. "
        "{num_threads: 2} (torch threads per replica: keep the sum over replicas at or below the "
        "machine's cores, oversubscribed OpenMP threads spin against each other).",
    )
    max_ongoing_requests: int = Field(
        128, ge=1, description="Requests a replica works on at once (Serve's max_ongoing_requests)."
    )
    max_queued_requests: int = Field(
        256, ge=-1,
        description="Requests waiting for a replica beyond max_ongoing_requests before the API "
        "answers 429 (-1: unbounded).",
    )
    resources: dict[str, float] = Field(
        default_factory=dict, description="Extra Ray resources per replica (node roles)."
    )
    cpu_affinity: list[list[int]] = Field(
        default_factory=list,
        description="Cores to pin each replica's process to, by the replica's rank on its node: "
        "replica r runs on cpu_affinity[r % len] (Linux sched_setaffinity). Empty: no pinning. "
        "Example [[0], [1]] puts two replicas on a core each.",
    )
    omp_wait_policy: Literal["auto", "active", "passive"] = Field(
        "auto",
        description="What the engine's idle OpenMP threads do: spin (active) or sleep (passive). "
        "auto: passive when the engine's threads fill the cores a replica may use (its cpu_affinity, "
        "else the machine's), where spinning keeps the serving processes off the cores (measured "
        "+12% served tok/s on 2 cores); else OpenMP's default. On vLLM's engine (backend: vllm) auto is "
        "always OpenMP's default, as vLLM's own server runs (serving/config/layout.py).",
    )

    @model_validator(mode="after")
    def _check_cpu_affinity(self) -> PoolConfig:
        for i, cores in enumerate(self.cpu_affinity):
            if not cores or min(cores) < 0:
                raise ValueError(
                    f"cpu_affinity[{i}] = {cores}: each entry is a non-empty list of core numbers >= 0, "
                    "e.g. [[0], [1]]"
                )
        return self


class IngressConfig(StrictModel):
    num_replicas: int = Field(1, ge=1, le=64, description="OpenAIIngress replicas.")
    num_cpus: float = Field(0.1, gt=0, le=64, description="Ray logical CPUs per ingress replica.")
    max_ongoing_requests: int = Field(1024, ge=1, description="Concurrent requests per ingress replica.")
    max_queued_requests: int = Field(
        256, ge=-1,
        description="Requests the Serve proxy holds for the ingress replicas beyond max_ongoing_requests; "
        "more are refused by the proxy at once with 429 and Retry-After: 1, instead of piling up "
        "(-1: unbounded).",
    )
    limits_sync_interval_s: float = Field(
        1.0, gt=0, le=60,
        description="With several ingress replicas and tiers with limits, how often each replica trades "
        "its keys' admissions with the others (a key's limit may be exceeded by what the others "
        "admitted in the last two intervals: serving/api/admission/rate_limits.py); also how often each copies "
        "the LoRA adapters loaded at run time (an unload reaches the others within it).",
    )
    max_merged_tokens: int = Field(
        16, ge=1, le=1024,
        description="Under load, the tokens of one request that reached the ingress while it was busy go out "
        "in one SSE event, up to this many (1: an event per engine step). A token that finds the ingress "
        "idle goes out at once.",
    )


class HTTPConfig(StrictModel):
    host: str = Field("127.0.0.1", description="Address the Serve HTTP proxy binds.")
    port: int = Field(8000, ge=1, le=65535, description="Port of the OpenAI API.")


class RayConfig(StrictModel):
    address: str | None = Field(
        None, description="Join this Ray cluster ('auto', 'ray://...'); default: start a local one."
    )
    num_cpus: int | None = Field(
        None, ge=1, description="Logical CPUs of a local Ray; default: enough for every replica."
    )
    dashboard_host: str = Field("127.0.0.1", description="Address of the local Ray dashboard.")
    dashboard_port: int = Field(8265, ge=1, le=65535, description="Port of the local Ray dashboard.")
    object_store_bytes: int | None = Field(
        2 * 2**30, ge=2**27,
        description="Shared-memory object store of a local Ray (carries KV between workers); "
        "null: Ray's default (30% of memory).",
    )
    preallocate_object_store: bool = Field(
        True,
        description="Touch the object store's pages at start so KV puts do not page-fault "
        "(measured: ray.put of 22.5 MiB 11.7 -> 7.9 ms, get + copy 11.1 -> 3.7 ms).",
    )
    grpc_transport: bool = Field(
        True,
        description="Stream over Serve's gRPC transport, Serve's proxy -> ingress -> workers, instead of "
        "Ray's object streams (measured: the ingress's CPU per streamed token 0.9-1.0 -> 0.4-0.5 ms, "
        "+17% output tokens/s on 2 cores). The proxy's half is a setting of the Ray cluster: a Ray "
        "kvrelay starts gets RAY_SERVE_PROXY_USE_GRPC=1 (and RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH="
        "2147483647, or the proxy fails responses over 4 MiB); set them in the environment of one it "
        "joins (the Helm chart does).",
    )


class RoutingConfig(StrictModel):
    """Which replica of a pool gets each request (router/policies.py documents the policies)."""

    prefill_policy: Literal["prefix_cost", "pow2", "round_robin", "char_prefix_tree"] = Field(
        "prefix_cost",
        description="Policy of the prefill pool (and the colocated Worker pool); pow2, round_robin "
        "and char_prefix_tree are the baselines of `kvrelay bench routing`.",
    )
    prefill_params: PrefillParams = Field(
        default_factory=PrefixCostParams,
        description="Parameters of the prefill policy, those of its name's model in router/policy_params.py "
        "(router/prefix_cost.py documents them), e.g. {max_load_ratio: 1.25, session_affinity: true}.",
    )
    decode_policy: Literal["least_kv", "pow2", "round_robin"] = Field("least_kv", description="Policy of the decode pool.")
    decode_params: DecodeParams = Field(
        default_factory=LeastKVParams,
        description="Parameters of the decode policy, those of its name's model in router/policy_params.py.",
    )
    stats_period_s: float = Field(
        0.5, gt=0, le=60,
        description="How often replicas report routing stats (cached block hashes, queued prefill "
        "tokens) to the routers. With several ingress replicas each router learns of the others' "
        "placements from these only (simulated with two routers at 0.5 s: hit rates within 2% of "
        "one router's in 62 of 69 cells, worst 0.89; at 0.1 s worst 0.91; docs/benchmarks.md).",
    )

    @model_validator(mode="before")
    @classmethod
    def _typed_params(cls, data: Any) -> Any:
        """Each `*_params` as its policy's model: the policy's name is the union's discriminator,
        which the YAML does not repeat inside the params."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for pool in ("prefill", "decode"):
            policy = data.get(f"{pool}_policy", cls.model_fields[f"{pool}_policy"].default)
            params = data.get(f"{pool}_params", {})
            if isinstance(params, dict) and isinstance(policy, str):
                try:
                    data[f"{pool}_params"] = parse_params(policy, params)
                except ValueError as exc:
                    raise ValueError(f"{pool}_params: {exc}") from None
        return data

    @model_validator(mode="after")
    def _params_match_policy(self) -> RoutingConfig:
        for pool, policy, params in (("prefill", self.prefill_policy, self.prefill_params),
                                     ("decode", self.decode_policy, self.decode_params)):
            if params.policy != policy:
                raise ValueError(f"{pool}_params are {params.policy}'s, but {pool}_policy is {policy}")
        return self


class KVTransferConfig(StrictModel):
    lease_s: float = Field(
        30.0, gt=0, le=3600,
        description="Exported KV not claimed by a decode worker within this time is freed.",
    )
    timeout_s: float = Field(
        10.0, gt=0, le=600,
        description="A decode worker waiting longer than this for a KV import recomputes the "
        "prompt instead.",
    )
    arena_mib: int = Field(
        256, ge=0, le=1 << 20,
        description="Each node's shared-memory arena for same-node KV hand-offs, in MiB (at most a "
        "quarter of the memory the node has available; pre-faulted when the node's KVTransfer actor "
        "starts; not in /dev/shm, so a container's small /dev/shm does not bound it). The "
        "prefill engine writes a request's KV straight into it and the decode engine reads it in "
        "place; a hand-off that does not fit, or crosses nodes, goes through Ray's object store. "
        "0: always Ray's object store.",
    )


class FallbackConfig(StrictModel):
    """Another kvrelay Serve application in the same Ray cluster that takes degraded requests."""

    app: str = Field(
        pattern=r"^[A-Za-z0-9_-]+$",
        description="Serve application name of the fallback (its app_name), e.g. a smaller, faster "
        "model deployed beside this one. Its OpenAIIngress is called through a Serve handle with the "
        "client's request, so it tokenizes, validates, bills and meters the request itself.",
    )
    model: str = Field(
        min_length=1,
        description="The model name the fallback app serves (its served_model_name): the forwarded "
        "request's `model`, and what the response's `model` and x-kvrelay-model then say.",
    )


class DegradationConfig(StrictModel):
    """What the ingress does when its pools refuse a request before its first token
    (serving/api/admission/degradation.py): route it to a fallback app, or shed it if its priority is low."""

    when: list[Literal["saturated", "down"]] = Field(
        default_factory=lambda: ["saturated", "down"], min_length=1,
        description="The primary's refusals that degrade a request: saturated (a pool's queues are "
        "full, 429 queue_full), down (no running replica, 503 no_worker or engine_dead). (Not "
        "`on:`, which YAML reads as true.)",
    )
    fallback: FallbackConfig | None = Field(
        None, description="Where degraded requests go; null: nowhere (shed, or the primary's error).",
    )
    shed_priority_at_or_above: int | None = Field(
        None,
        description="Degraded requests with `priority` at or above this are shed (503 + "
        "Retry-After) instead of taking the fallback; lower values are more important (vLLM's "
        "convention, default 0). After a saturated refusal they are also shed on arrival for "
        "shed_window_s. null: shed nothing.",
    )
    shed_window_s: float = Field(
        2.0, ge=0, le=3600,
        description="After the primary refuses a request as saturated, requests that would be shed "
        "are refused at once for this long, without taking a queue slot of the saturated pool. "
        "0: shed only requests the primary refused.",
    )
    retry_after_s: int = Field(
        5, ge=1, le=3600, description="The Retry-After header (seconds) of a shed request's 503.",
    )

    @model_validator(mode="before")
    @classmethod
    def _check_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and True in data:
            raise ValueError("YAML reads the key `on:` as true: the field is `when:`, e.g. when: [saturated, down]")
        return data

    @model_validator(mode="after")
    def _check(self) -> DegradationConfig:
        if self.fallback is None and self.shed_priority_at_or_above is None:
            raise ValueError(
                "nothing to do: set fallback (app and model), shed_priority_at_or_above, or both; "
                "or remove the degradation section"
            )
        if len(set(self.when)) != len(self.when):
            raise ValueError(f"when = {self.when}: each of saturated, down at most once")
        return self
