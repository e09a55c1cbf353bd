"""The app's configuration: one pydantic model, loaded from YAML plus `KVRELAY_*` env overrides.

    model, engine (EngineConfig,  ─▶ every worker's EngineConfig (engine_config(pool)): the shared
    serving defaults) + a pool's     `engine`, then the pool's own `engine` keys over it
    own engine keys
    mode, min_remote_prefill_tokens ─▶ how the ingress routes a request
    prefill / decode / worker pools ─▶ Serve deployments (replicas, CPUs, torch threads)
    http, api_keys, kv_transfer ─▶ the proxy, the ingress, the KVTransfer actors
    degradation ─▶ the ingress, when a pool refuses a request (fallback app, shedding)

Env overrides name a field path with `__` between levels, after the `KVRELAY_` prefix:
`KVRELAY_MODE=colocated`, `KVRELAY_HTTP__PORT=8001`, `KVRELAY_DECODE__NUM_REPLICAS=2`,
`KVRELAY_API_KEYS=key1,key2`. Values are parsed as YAML scalars (so `2`, `true`, `[a, b]`).
Unknown keys, in the file or the environment, are errors that name the key and where it came from;
a key that moved (the engine's settings moved under `engine:`) names its new path.

The engine's settings are EngineConfig's (serving/engine/config.py), declared once there. Where
serving wants another default than the engine alone, it is set in SERVING_ENGINE_DEFAULTS below,
the one place.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, create_model, model_serializer, model_validator

from serving.engine.config import EngineConfig, StrictModel

__all__ = [
    "ServeConfig",
    "PoolConfig",
    "IngressConfig",
    "HTTPConfig",
    "KVTransferConfig",
    "RayConfig",
    "RoutingConfig",
    "DegradationConfig",
    "FallbackConfig",
    "ConfigError",
    "EngineOverrides",
    "EngineSettings",
    "SERVING_ENGINE_DEFAULTS",
    "NON_CONFIG_ENV",
    "load_config",
    "parse_set_items",
    "apply_overrides",
    "ENV_PREFIX",
]

ENV_PREFIX = "KVRELAY_"
# KVRELAY_* variables that are not config fields.
NON_CONFIG_ENV = {"KVRELAY_CACHE_DIR", "KVRELAY_DISABLE_NATIVE", "KVRELAY_CONFIG", "KVRELAY_DEV_CLUSTER", "KVRELAY_FAULTS"}


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the source, field, value and fix."""


# The engine defaults of a served app, where they differ from EngineConfig's (an engine alone,
# e.g. in `kvrelay bench engine`, owns the machine; a replica shares it with the others).
SERVING_ENGINE_DEFAULTS: dict[str, Any] = {
    "kv_cache_memory_fraction": 0.05,  # several replicas per machine
    "long_prefill_token_threshold": 256,  # a long prompt must not stall the other requests' TTFT
    "num_threads": 1,  # torch threads per replica: Ray's logical CPUs are not cores
}

_POOLS = ("prefill", "decode", "worker")
# Keys that moved (old path -> new path): an old config names them, the error says where to.
MOVED_KEYS = {
    **{name: f"engine.{name}" for name in EngineConfig.model_fields if name != "model"},
    **{f"{pool}.num_threads": f"{pool}.engine.num_threads" for pool in _POOLS},
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
        annotation = field.annotation
        for constraint in field.metadata:  # ge, le, ...: checked here too, so errors name the key
            annotation = Annotated[annotation, constraint]
        if defaults is None:
            fields[field_name] = (annotation | None, Field(None, description=field.description))
        else:
            fields[field_name] = (annotation, Field(defaults.get(field_name, field.default), description=field.description))
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


class RoutingConfig(StrictModel):
    """Which replica of a pool gets each request (router/policies.py documents the policies)."""

    prefill_policy: Literal["prefix_cost", "pow2", "round_robin", "char_prefix_tree"] = Field(
        "prefix_cost",
        description="Policy of the prefill pool (and the colocated Worker pool); pow2, round_robin "
        "and char_prefix_tree are the baselines of `kvrelay bench routing`.",
    )
    prefill_params: dict[str, Any] = Field(
        default_factory=dict,
        description="Parameters of the prefill policy, e.g. {max_imbalance_tokens: 8192, "
        "session_affinity: true}.",
    )
    decode_policy: Literal["least_kv", "pow2", "round_robin"] = Field("least_kv", description="Policy of the decode pool.")
    decode_params: dict[str, Any] = Field(default_factory=dict, description="Parameters of the decode policy.")
    stats_period_s: float = Field(
        0.5, gt=0, le=60,
        description="How often replicas report routing stats (cached block hashes, queued prefill "
        "tokens) to the routers.",
    )

    @model_validator(mode="after")
    def _check_params(self) -> RoutingConfig:
        from router.policies import build_policy

        for field_name, policy, params in (
            ("prefill_params", self.prefill_policy, self.prefill_params),
            ("decode_params", self.decode_policy, self.decode_params),
        ):
            try:
                build_policy(policy, **params)
            except ValueError as exc:
                raise ValueError(f"{field_name}: {exc}") from None
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
    (serving/api/degradation.py): route it to a fallback app, or shed it if its priority is low."""

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


class ServeConfig(StrictModel):
    # ---- model and engine --------------------------------------------------------------------
    model: str = Field(
        "smollm2-135m-instruct",
        description="Built-in name, a .gguf file, or a local Hugging Face model directory.",
    )
    served_model_name: str | None = Field(
        None, min_length=1, description="The name clients pass as `model`; default: `model`."
    )
    engine: EngineSettings = Field(
        default_factory=EngineSettings,
        description="Every worker's engine settings (serving/engine/config.py EngineConfig, but its "
        "`model`, which is the app's, above); a pool's own `engine` keys go over them.",
    )

    # ---- topology ----------------------------------------------------------------------------
    mode: Literal["disaggregated", "colocated"] = Field(
        "disaggregated",
        description="disaggregated: PrefillWorker + DecodeWorker pools with KV transfer; "
        "colocated: one Worker pool does both.",
    )
    min_remote_prefill_tokens: int = Field(
        0, ge=0,
        description="Prompts with fewer uncached tokens than this are prefilled on the decode "
        "worker itself (disaggregated mode).",
    )
    prefill: PoolConfig = Field(default_factory=PoolConfig, description="PrefillWorker pool.")
    decode: PoolConfig = Field(default_factory=PoolConfig, description="DecodeWorker pool.")
    worker: PoolConfig = Field(default_factory=PoolConfig, description="Worker pool (colocated mode).")
    autoscaling_policy: str | None = Field(
        None, min_length=1,
        description="Autoscaling policy YAML (deploy/autoscaling/*.yaml, router/autoscaling/policy.py), "
        "relative to the config file when given there; the pools it has sections for scale on their "
        "own signals, the others keep num_replicas. null: fixed replicas.",
    )
    ingress: IngressConfig = Field(default_factory=IngressConfig, description="OpenAIIngress.")
    kv_transfer: KVTransferConfig = Field(default_factory=KVTransferConfig, description="KV hand-off.")
    routing: RoutingConfig = Field(default_factory=RoutingConfig, description="Request routing per pool.")

    # ---- serving -----------------------------------------------------------------------------
    app_name: str = Field("kvrelay", pattern=r"^[A-Za-z0-9_-]+$", description="Serve application name.")
    http: HTTPConfig = Field(default_factory=HTTPConfig, description="The API's address.")
    ray: RayConfig = Field(default_factory=RayConfig, description="The Ray cluster `kvrelay serve` uses.")
    api_keys: list[str] = Field(
        default_factory=list,
        description="Accepted `Authorization: Bearer` keys; empty (and no admin_api_keys): no authentication.",
    )
    admin_api_keys: list[str] = Field(
        default_factory=list,
        description="Keys that are accepted like api_keys and also see every key's totals at "
        "GET /v1/usage (other keys see their own).",
    )
    pricing: str | None = Field(
        None, min_length=1,
        description="Pricing YAML (deploy/pricing.yaml, serving/api/usage.py): per served model, the price "
        "per million input and output tokens; relative to the config file when given there. Each "
        "response then carries its cost. null: usage without cost.",
    )
    max_request_body_bytes: int = Field(
        8 * 2**20, ge=1024, description="Larger request bodies are refused with 413."
    )
    degradation: DegradationConfig | None = Field(
        None,
        description="Graceful degradation when a pool is saturated or down (serving/api/degradation.py): "
        "a fallback app, shedding low-priority requests, or both. null: off (429 / 503).",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_keys_and_the_model(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        moved = [old for old in MOVED_KEYS if _has_path(data, old.split("."))]
        if moved:
            raise ValueError("; ".join(
                f"`{old}` moved to `{MOVED_KEYS[old]}` (env {ENV_PREFIX}{MOVED_KEYS[old].upper().replace('.', '__')})"
                for old in moved
            ))
        engine = data.get("engine")
        if isinstance(engine, dict) and "model" in engine:
            raise ValueError(f"engine.model = {engine['model']!r}: the model is the app's; set the top-level `model`")
        return data

    @model_validator(mode="after")
    def _check(self) -> ServeConfig:
        for where, build in (("engine", lambda: EngineConfig(model=self.model, **self.engine.model_dump())),
                             *((f"{name}.engine", lambda pool=pool: self.engine_config(pool)) for name, pool in self.pools.items())):
            try:
                build()
            except ValidationError as exc:
                err = exc.errors()[0]
                raise ValueError(f"{where}: {err['msg'].removeprefix('Value error, ')}") from None
        if any(not key for key in self.api_keys):
            raise ValueError("api_keys must not contain empty strings")
        if any(not key for key in self.admin_api_keys):
            raise ValueError("admin_api_keys must not contain empty strings")
        if self.degradation is not None and self.degradation.fallback is not None and self.degradation.fallback.app == self.app_name:
            raise ValueError(
                f"degradation.fallback.app = {self.app_name!r} is this app itself; name another kvrelay "
                "app of the same Ray cluster"
            )
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def pools(self) -> dict[str, PoolConfig]:
        return {pool: getattr(self, pool) for pool in _POOLS}

    def engine_config(self, pool: PoolConfig) -> EngineConfig:
        """A pool's engine: the app's model and `engine`, then the pool's own keys over them."""
        return EngineConfig.model_validate({
            **self.engine.model_dump(), **pool.engine.model_dump(), "model": self.model,
        })


def load_config(
    path: str | os.PathLike | None = None,
    *,
    overrides: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> ServeConfig:
    """File (optional) < `overrides` (nested dict) < `KVRELAY_*` environment variables."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read the config file ({exc.strerror})") from exc
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of fields, got {type(loaded).__name__}")
        data = loaded or {}
        for key in ("autoscaling_policy", "pricing"):
            value = data.get(key)
            if isinstance(value, str) and value and not Path(value).is_absolute():
                # Relative to the config file, so a config and the files it names move together.
                data[key] = str(Path(path).parent / value)
    apply_overrides(data, overrides or {})
    env_used = []
    for name, raw in sorted((os.environ if env is None else env).items()):
        if not name.startswith(ENV_PREFIX) or name in NON_CONFIG_ENV:
            continue
        field_path = [part.lower() for part in name[len(ENV_PREFIX):].split("__")]
        _set_path(data, field_path, _parse_env_value(field_path, raw))
        env_used.append(name)
    try:
        return ServeConfig.model_validate(data)
    except ValidationError as exc:
        extras = ([f"overrides {', '.join(sorted(overrides))}"] if overrides else []) + (
            [f"env {', '.join(env_used)}"] if env_used else []
        )
        where = source + (f" (with {'; '.join(extras)})" if extras else "")
        raise ConfigError(format_validation_error(exc, where, env_prefix=ENV_PREFIX)) from exc


def format_validation_error(exc: ValidationError, where: str, *, env_prefix: str | None = None) -> str:
    lines = [f"{where}: invalid configuration"]
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            hint = "unknown key; remove it or fix its spelling"
            if env_prefix:
                hint += f" (env: {env_prefix}{field.upper().replace('.', '__')})"
        else:
            hint = err["msg"].removeprefix("Value error, ")
        value = err.get("input")
        shown = "" if isinstance(value, dict) else f" = {value!r}"
        lines.append(f"  {field}{shown}: {hint}")
    return "\n".join(lines)


def parse_set_items(items: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` items -> {dotted key: YAML-parsed value}; ConfigError names a bad item."""
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set wants KEY=VALUE, got {item!r}")
        overrides[key] = yaml.safe_load(value) if value.strip() else value
    return overrides


def apply_overrides(data: dict, overrides: dict[str, Any]) -> dict:
    """Set each dotted key of `overrides` in the nested `data` (in place); returns `data`."""
    for key, value in overrides.items():
        _set_path(data, key.split("."), value)
    return data


def _has_path(data: dict, parts: list[str]) -> bool:
    node: Any = data
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _set_path(data: dict, parts: list[str], value: Any) -> None:
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def _parse_env_value(field_path: list[str], raw: str) -> Any:
    if field_path in (["api_keys"], ["admin_api_keys"]) and not raw.lstrip().startswith("["):
        return [key.strip() for key in raw.split(",") if key.strip()]
    try:
        return yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        return raw
