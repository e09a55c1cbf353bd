"""The app's configuration: one pydantic model, loaded from YAML plus `KVRELAY_*` env overrides.

    model / dtype / KV budget ─▶ every worker's EngineConfig (engine_config(pool))
    mode, min_remote_prefill_tokens ─▶ how the ingress routes a request
    prefill / decode / worker pools ─▶ Serve deployments (replicas, CPUs, torch threads)
    http, api_keys, kv_transfer ─▶ the proxy, the ingress, the KVTransfer actors
    degradation ─▶ the ingress, when a pool refuses a request (fallback app, shedding)

Env overrides name a field path with `__` between levels, after the `KVRELAY_` prefix:
`KVRELAY_MODE=colocated`, `KVRELAY_HTTP__PORT=8001`, `KVRELAY_DECODE__NUM_REPLICAS=2`,
`KVRELAY_API_KEYS=key1,key2`. Values are parsed as YAML scalars (so `2`, `true`, `[a, b]`).
Unknown keys, in the file or the environment, are errors that name the key and where it came from.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from serving.engine.config import EngineConfig

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
    "load_config",
    "parse_set_items",
    "apply_overrides",
    "ENV_PREFIX",
]

ENV_PREFIX = "KVRELAY_"
# KVRELAY_* variables that are not config fields.
_NON_CONFIG_ENV = {"KVRELAY_CACHE_DIR", "KVRELAY_DISABLE_NATIVE", "KVRELAY_CONFIG", "KVRELAY_DEV_CLUSTER", "KVRELAY_FAULTS"}


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the source, field, value and fix."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PoolConfig(_Strict):
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
    num_threads: int = Field(
        1, ge=1, le=512,
        description="torch threads per replica. Keep the sum over replicas at or below the "
        "machine's cores: oversubscribed OpenMP threads spin against each other.",
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


class IngressConfig(_Strict):
    num_replicas: int = Field(1, ge=1, le=64, description="OpenAIIngress replicas.")
    num_cpus: float = Field(0.1, gt=0, le=64, description="Ray logical CPUs per ingress replica.")
    max_ongoing_requests: int = Field(1024, ge=1, description="Concurrent requests per ingress replica.")


class HTTPConfig(_Strict):
    host: str = Field("127.0.0.1", description="Address the Serve HTTP proxy binds.")
    port: int = Field(8000, ge=1, le=65535, description="Port of the OpenAI API.")


class RayConfig(_Strict):
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


class RoutingConfig(_Strict):
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


class KVTransferConfig(_Strict):
    lease_s: float = Field(
        30.0, gt=0, le=3600,
        description="Exported KV not claimed by a decode worker within this time is freed.",
    )
    timeout_s: float = Field(
        10.0, gt=0, le=600,
        description="A decode worker waiting longer than this for a KV import recomputes the "
        "prompt instead.",
    )


class FallbackConfig(_Strict):
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


class DegradationConfig(_Strict):
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


class ServeConfig(_Strict):
    # ---- model and engine --------------------------------------------------------------------
    model: str = Field(
        "smollm2-135m-instruct",
        description="Built-in name, a .gguf file, or a local Hugging Face model directory.",
    )
    served_model_name: str | None = Field(
        None, min_length=1, description="The name clients pass as `model`; default: `model`."
    )
    dtype: Literal["auto", "bfloat16", "float32", "float16"] = Field(
        "auto",
        description="Weights and KV dtype; auto: bfloat16 where this machine's bf16 matrix products are fast, else float32 "
        "(measured by each replica at start-up).",
    )
    device: str = Field("cpu", description="'cpu' or 'cuda[:N]'.")
    kv_cache_bytes: int | None = Field(None, gt=0, description="KV cache bytes per replica.")
    kv_cache_memory_fraction: float = Field(
        0.05, gt=0.0, le=0.95, description="KV budget per replica as a fraction of free memory."
    )
    max_model_len: int | None = Field(None, ge=16, description="Context window cap in tokens.")
    block_size: int = Field(16, ge=1, le=256, description="Tokens per KV block.")
    max_num_seqs: int = Field(128, ge=1, le=4096, description="Sequences per engine step.")
    max_num_batched_tokens: int = Field(512, ge=1, description="Token budget per engine step.")
    long_prefill_token_threshold: int = Field(
        256, ge=0,
        description="Prompts with more tokens than this left to compute are prefilled at most this "
        "many tokens per step, one at a time (max_long_partial_prefills), so short prompts are not "
        "queued behind a long one and decodes are not stalled by it (vLLM's option of the same "
        "name). 0: off.",
    )
    max_long_partial_prefills: int = Field(1, ge=1, description="Long prompts prefilling at once per engine.")
    enable_prefix_caching: bool = Field(True, description="Reuse the KV of shared prefixes.")
    seed: int = Field(0, description="Sampler seed for requests without `seed`.")

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

    @model_validator(mode="after")
    def _check(self) -> ServeConfig:
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
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

    def engine_config(self, pool: PoolConfig) -> EngineConfig:
        return EngineConfig(
            model=self.model, dtype=self.dtype, device=self.device, block_size=self.block_size,
            kv_cache_bytes=self.kv_cache_bytes, kv_cache_memory_fraction=self.kv_cache_memory_fraction,
            max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_long_partial_prefills=self.max_long_partial_prefills,
            enable_prefix_caching=self.enable_prefix_caching, num_threads=pool.num_threads,
            seed=self.seed,
        )


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
        if not name.startswith(ENV_PREFIX) or name in _NON_CONFIG_ENV:
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
            hint = err["msg"]
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
