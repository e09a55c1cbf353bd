"""ServeConfig: the whole app's configuration (the module docstring of serving/config/__init__.py
says how it is loaded)."""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, model_validator

from serving.config.access import DEFAULT_TIER, APIKey, TierConfig, parse_key_entries
from serving.config.api_limits import APIConfig, ToolCallingConfig
from serving.config.layout import auto_mode, node_cores
from serving.config.sections import (
    MOVED_KEYS,
    POOLS,
    DegradationConfig,
    EngineSettings,
    HTTPConfig,
    IngressConfig,
    KVTransferConfig,
    PoolConfig,
    RayConfig,
    RoutingConfig,
)
from serving.engine.config import EngineConfig
from serving.engine.strict import StrictModel

__all__ = ["ServeConfig", "ENV_PREFIX"]

ENV_PREFIX = "KVRELAY_"

logger = logging.getLogger(__name__)


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
    mode: Literal["disaggregated", "colocated", "auto"] = Field(
        "disaggregated",
        description="disaggregated: PrefillWorker + DecodeWorker pools with KV transfer; "
        "colocated: one Worker pool does both; auto: decided from the cores of the machine that "
        "loads the config, disaggregated from 4 cores up, else colocated (serving/config/layout.py). "
        "Loading resolves auto, so a loaded config names the mode that runs.",
    )
    min_remote_prefill_tokens: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        0,
        description="Prompts with fewer uncached tokens than this (the prompt's length less the "
        "prefix every decode replica holds, per the decode router's prefix index) are "
        "prefilled on the decode worker itself (disaggregated mode). auto: measured per request, "
        "on the decode worker when the wait it would cause the decode replica's sequences "
        "(their number x the uncached tokens / its prefill rate) is no longer than a KV hand-off "
        "takes there (router/disaggregation.py).",
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
    api_keys: list[APIKey] = Field(
        default_factory=list,
        description="Accepted `Authorization: Bearer` keys (serving/config/access.py): plain keys, hashed "
        "when the config loads, or {name, key_sha256, hint, tier} entries from `kvrelay hash-key`; "
        "empty (and no admin_api_keys): no authentication.",
    )
    admin_api_keys: list[APIKey] = Field(
        default_factory=list,
        description="Keys that are accepted like api_keys and also see every key's totals at "
        "GET /v1/usage (other keys see their own).",
    )
    require_api_keys: bool = Field(
        False,
        description="Refuse to start without API keys, so an empty key list (a Secret whose value is "
        "empty) never means an open API; the Helm chart sets it unless auth.allowUnauthenticated.",
    )
    tiers: dict[str, TierConfig] = Field(
        default_factory=lambda: {DEFAULT_TIER: TierConfig()},
        description="Per-key limits and priorities by tier name (serving/config/access.py); a key's `tier` "
        "names one, `default` (no limits unless set) is the tier of keys that name none and of every "
        "request when no keys are configured.",
    )
    pricing: str | None = Field(
        None, min_length=1,
        description="Pricing YAML (deploy/pricing.yaml, serving/api/usage.py): per served model, the price "
        "per million input and output tokens; relative to the config file when given there. Each "
        "response then carries its cost. null: usage without cost.",
    )
    max_request_body_bytes: int = Field(
        8 * 2**20, ge=1024,
        description="Larger request bodies are refused with 413: at once when Content-Length says "
        "so, else as soon as the body read passes it.",
    )
    api: APIConfig = Field(
        default_factory=APIConfig,
        description="What one API request may ask for (prompts, n, max_tokens, logprobs, logit_bias, "
        "stop, chat template kwargs) and how long its prompt may take to render; over a limit: 400.",
    )
    tool_calling: ToolCallingConfig = Field(
        default_factory=ToolCallingConfig,
        description="How the model is shown tools and how its own tool calls are parsed (tool_choice auto).",
    )
    request_timeout_s: float | None = Field(
        600.0, gt=0, allow_inf_nan=False,
        description="A completion request's deadline, from when the ingress receives it, unless it sends "
        "its own `timeout` (serving/api/admission/deadlines.py); capped per tier by its max_timeout_s. A request out of "
        "time is aborted everywhere: 408 (with the partial output), or an SSE error event once streaming. "
        "Without a tier max_timeout_s, also the longest `timeout` a request may ask for. null: no deadline.",
    )
    degradation: DegradationConfig | None = Field(
        None,
        description="Graceful degradation when a pool is saturated or down (serving/api/admission/degradation.py): "
        "a fallback app, shedding low-priority requests, or both. null: off (429 / 503).",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_keys_and_the_model(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        moved = [old for old in MOVED_KEYS if has_path(data, old.split("."))]
        if moved:
            raise ValueError("; ".join(
                f"`{old}` moved to `{MOVED_KEYS[old]}` (env {ENV_PREFIX}{MOVED_KEYS[old].upper().replace('.', '__')})"
                for old in moved
            ))
        for field, is_admin in (("api_keys", False), ("admin_api_keys", True)):
            if field in data:
                data = {**data, field: parse_key_entries(data[field], field=field, is_admin=is_admin)}
        if isinstance(data.get("tiers"), dict) and DEFAULT_TIER not in data["tiers"]:
            data = {**data, "tiers": {**data["tiers"], DEFAULT_TIER: {}}}
        engine = data.get("engine")
        if isinstance(engine, dict) and "model" in engine:
            raise ValueError(f"engine.model = {engine['model']!r}: the model is the app's; set the top-level `model`")
        if data.get("mode") == "auto":
            mode, why = auto_mode(node_cores())
            logger.info("%s", why)
            data = {**data, "mode": mode}
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
        if self.prefill.engine.speculative is not None:
            raise ValueError(
                "prefill.engine.speculative is set, but a prefill worker computes a prompt and its first token "
                "and never decodes, so it has nothing to speculate on; set `decode.engine.speculative` "
                "(disaggregated) or `worker.engine.speculative` (colocated), or `engine.speculative` for both"
            )
        prefill, decode = self.engine_config(self.prefill), self.engine_config(self.decode)
        if self.mode == "disaggregated":
            if prefill.backend != decode.backend:
                raise ValueError(
                    f"prefill.engine.backend = {prefill.backend!r} but decode.engine.backend = {decode.backend!r}: "
                    "a KV hand-off stays within one engine's block layout; set `engine.backend` for both pools"
                )
            for name, pool in (("prefill", prefill), ("decode", decode)):
                if pool.vllm is not None and pool.vllm.tensor_parallel_size > 1:
                    raise ValueError(
                        f"{name}.engine.vllm.tensor_parallel_size = {pool.vllm.tensor_parallel_size}: a KV hand-off "
                        "through kvrelay moves whole blocks from one rank; set it to 1 for the P/D pools, or "
                        "mode: colocated"
                    )
        for key in HANDOFF_KEYS:  # the prefill pool's KV goes into the decode pool's cache
            if getattr(prefill, key) != getattr(decode, key):
                raise ValueError(
                    f"prefill.engine.{key} = {getattr(prefill, key)!r} but decode.engine.{key} = "
                    f"{getattr(decode, key)!r}: the pools hand KV over, so they must agree; set it in "
                    f"`engine` for both"
                )
        if self.require_api_keys and not self.keys:
            raise ValueError(
                "require_api_keys is true but no api_keys or admin_api_keys are configured (is "
                "KVRELAY_API_KEYS, or the Secret it comes from, empty?); give keys, or set require_api_keys: false"
            )
        names = [key.name for key in self.keys]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"API key names must be unique; {', '.join(repeated)} named more than once")
        for key in self.keys:
            if key.tier not in self.tiers:
                raise ValueError(f"API key {key.name!r} has tier {key.tier!r}, which `tiers` does not define "
                                 f"(defined: {', '.join(sorted(self.tiers))})")
        if self.degradation is not None and self.degradation.fallback is not None and self.degradation.fallback.app == self.app_name:
            raise ValueError(
                f"degradation.fallback.app = {self.app_name!r} is this app itself; name another kvrelay "
                "app of the same Ray cluster"
            )
        return self

    @property
    def keys(self) -> list[APIKey]:
        """Every accepted key, admin keys marked."""
        return [*self.api_keys, *(k if k.is_admin else k.model_copy(update={"is_admin": True}) for k in self.admin_api_keys)]

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def pools(self) -> dict[str, PoolConfig]:
        return {pool: getattr(self, pool) for pool in POOLS}

    @property
    def lora(self):
        """The LoRA settings (EngineConfig.lora) of the pool that answers requests: the worker pool
        when colocated, else the decode pool (the prefill pool agrees: HANDOFF_KEYS)."""
        return self.engine_config(self.worker if self.mode == "colocated" else self.decode).lora

    def engine_config(self, pool: PoolConfig | str) -> EngineConfig:
        """A pool's engine (the pool, or its name): the app's model and `engine`, then the pool's
        own keys over them. The prefill pool's never speculates (`engine.speculative` is for the
        pools that decode): it generates one token per request, and a proposer's state (a draft
        model) would only take its memory."""
        if isinstance(pool, str):
            assert pool in POOLS, f"no pool {pool!r} (pools: {', '.join(POOLS)})"
            name, pool = pool, self.pools[pool]
        else:  # one PoolConfig given for several pools is the decoding pools' too
            name = next((n for n in ("decode", "worker", "prefill") if self.pools[n] is pool), "")
        settings = {**self.engine.model_dump(), **pool.engine.model_dump(), "model": self.model}
        if name == "prefill":
            settings["speculative"] = None
        return EngineConfig.model_validate(settings)


# Engine keys the prefill and decode pools must share: the KV layout, and the context window the
# ingress checks a request against.
HANDOFF_KEYS = ("block_size", "dtype", "max_model_len", "lora")  # lora: the decode side continues with the adapter


def has_path(data: dict, parts: list[str]) -> bool:
    node: Any = data
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True
