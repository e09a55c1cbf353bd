"""The autoscaling policy YAML (`deploy/autoscaling/*.yaml`): one section per worker pool.

    name: default                      # shows up in logs and in `kvrelay policy check`
    prefill:                           # PrefillWorker   (absent: fixed replicas from ServeConfig)
      min_replicas: 1
      max_replicas: 4
      targets: {ttft_p95_ms: 2000, queued_prefill_tokens_per_replica: 4096}
      upscale_delay_s: 10              # ... windows, delays, step, hysteresis: see PoolPolicy
    decode:                            # DecodeWorker
      max_replicas: 4
      targets: {num_seqs_per_replica: 32, kv_utilization: 0.85, tpot_p95_ms: 250}
    worker:                            # Worker (colocated mode): any of the five targets
    mode: reactive                     # or planner: the planner section sizes prefill and decode
    planner: ...                       # together (router/autoscaling/planner_policy.py)

Every target is per replica; a null target turns its signal off (at least one stays on). The
decision that reads this is `router.autoscaling.decide.decide`; the Serve options it becomes are
`router.autoscaling.decide.serve_autoscaling_config`.

`load_policy(path)` raises `PolicyError` naming the file, each bad field, its value and the
allowed values (serving/engine/config_file.py, the one loader of kvrelay's files), e.g.

    deploy/autoscaling/bad.yaml: invalid autoscaling policy
      prefill.max_step = 0: Input should be greater than or equal to 1 (allowed: >= 1 and <= 64)
      decode.targets.tpot_ms = 200: unknown key; remove it or fix its spelling (allowed keys: ...)
"""

from __future__ import annotations

import math
import os
from typing import Any, Literal

from pydantic import Field, model_validator

from router.autoscaling.bounds import DEFAULT_DOWNSCALE_DELAY_S, DOWNSCALE_DELAY_S, MAX_REPLICAS, REPLICAS, TPOT_MS, TTFT_MS
from router.autoscaling.errors import FieldError as _FieldError
from router.autoscaling.errors import PolicyError
from router.autoscaling.planner_policy import PlannerPolicy
from serving.engine.config_file import read_yaml_mapping, validate_model
from serving.engine.strict import StrictModel

__all__ = [
    "PoolName",
    "PrefillTargets",
    "DecodeTargets",
    "WorkerTargets",
    "PoolPolicy",
    "PrefillPoolPolicy",
    "DecodePoolPolicy",
    "WorkerPoolPolicy",
    "AutoscalingPolicyConfig",
    "PolicyError",
    "POOL_POLICIES",
    "TARGET_SIGNALS",
    "load_policy",
    "parse_policy",
]

PoolName = Literal["prefill", "decode", "worker"]


# Target field -> the per-replica signal it bounds (the keys replicas report; see
# serving/observability/worker_metrics.py). Every target is "this much per replica".
TARGET_SIGNALS: dict[str, str] = {
    "queued_prefill_tokens_per_replica": "num_queued_prefill_tokens",
    "ttft_p95_ms": "ttft_p95_ms",
    "num_seqs_per_replica": "num_seqs",
    "kv_utilization": "kv_usage",
    "tpot_p95_ms": "tpot_p95_ms",
}


# ---- targets ---------------------------------------------------------------------------------
_TTFT = dict(
    **TTFT_MS,
    description="TTFT p95 per replica in ms (arrival at the engine to first token, over the "
    "replica's recent requests). null: not a scaling signal.",
)
_QUEUED = dict(
    ge=1, le=10_000_000,
    description="Prompt tokens waiting to be prefilled per replica (waiting and running "
    "sequences' uncomputed prompt tokens). null: not a scaling signal.",
)
_SEQS = dict(
    gt=0, le=65_536,
    description="Running + waiting sequences per replica. null: not a scaling signal.",
)
_KV = dict(
    gt=0, le=1,
    description="Fraction of the KV cache blocks in use per replica. null: not a scaling signal.",
)
_TPOT = dict(
    **TPOT_MS,
    description="TPOT p95 per replica in ms ((finish - first token) / (tokens - 1) over recent "
    "requests). null: not a scaling signal.",
)


class _Targets(StrictModel):
    @model_validator(mode="after")
    def _at_least_one(self):
        if all(value is None for value in self.model_dump().values()):
            raise ValueError(
                f"every target is null; set at least one of {', '.join(type(self).model_fields)}"
            )
        return self

    def by_signal(self) -> dict[str, float]:
        """Signal name -> target, for the targets that are set."""
        return {TARGET_SIGNALS[k]: float(v) for k, v in self.model_dump().items() if v is not None}


class PrefillTargets(_Targets):
    ttft_p95_ms: float | None = Field(2000.0, **_TTFT)
    queued_prefill_tokens_per_replica: int | None = Field(4096, **_QUEUED)


class DecodeTargets(_Targets):
    num_seqs_per_replica: float | None = Field(32.0, **_SEQS)
    kv_utilization: float | None = Field(0.85, **_KV)
    tpot_p95_ms: float | None = Field(250.0, **_TPOT)


class WorkerTargets(_Targets):
    ttft_p95_ms: float | None = Field(2000.0, **_TTFT)
    queued_prefill_tokens_per_replica: int | None = Field(4096, **_QUEUED)
    num_seqs_per_replica: float | None = Field(32.0, **_SEQS)
    kv_utilization: float | None = Field(0.85, **_KV)
    tpot_p95_ms: float | None = Field(250.0, **_TPOT)


# ---- pools -----------------------------------------------------------------------------------
class PoolPolicy(StrictModel):
    """Bounds, windows and delays of one pool; `targets` is added per pool below."""

    min_replicas: int = Field(
        1, **REPLICAS,
        description="Fewest replicas (also the count at deploy). Scale to zero is not supported: "
        "the signals come from the replicas themselves.",
    )
    max_replicas: int = Field(
        ..., **REPLICAS,
        description="Most replicas. Each replica reserves its pool's num_cpus/num_gpus, so the "
        "cluster must have room for max_replicas of them.",
    )
    max_step: int = Field(
        2, ge=1, le=64, description="Most replicas added by one scale-up (scale-down is always one)."
    )
    window_s: float = Field(
        30.0, ge=0.5, le=3600,
        description="Each replica's signals are averaged over this many recent seconds "
        "(Serve's look_back_period_s).",
    )
    metrics_interval_s: float = Field(
        5.0, ge=0.1, le=60,
        description="How often replicas push their signals to the Serve controller (Serve's "
        "metrics_interval_s); must be below window_s.",
    )
    stale_after_s: float = Field(
        30.0, ge=0.5, le=3600,
        description="A replica whose newest sample is older than this counts as not reporting, "
        "and the pool holds its size; at least 2 x metrics_interval_s.",
    )
    upscale_delay_s: float = Field(
        10.0, ge=0, le=3600,
        description="Demand must stay above capacity this long before a scale-up (a shorter "
        "spike is ignored).",
    )
    upscale_cooldown_s: float = Field(
        30.0, ge=0, le=3600,
        description="Least time between two scale-ups: new replicas start and the latency "
        "windows refresh before more are added.",
    )
    downscale_delay_s: float = Field(
        DEFAULT_DOWNSCALE_DELAY_S, **DOWNSCALE_DELAY_S,
        description="Demand must stay below the downscale threshold this long before each "
        "one-replica scale-down; the clock restarts after every scaling action.",
    )
    downscale_threshold: float = Field(
        0.7, gt=0, lt=1,
        description="Scale down only if, with one replica fewer, demand would stay at or below "
        "this fraction of the targets (hysteresis against flapping).",
    )

    @model_validator(mode="after")
    def _check(self):
        if self.max_replicas < self.min_replicas:
            raise _FieldError(
                "max_replicas", self.max_replicas,
                f"below min_replicas = {self.min_replicas} (allowed: >= {self.min_replicas} and <= {MAX_REPLICAS})",
            )
        if self.metrics_interval_s >= self.window_s:
            raise _FieldError(
                "metrics_interval_s", self.metrics_interval_s,
                f"not below window_s = {self.window_s} (allowed: >= 0.1 and < {self.window_s})",
            )
        if self.stale_after_s < 2 * self.metrics_interval_s:
            raise _FieldError(
                "stale_after_s", self.stale_after_s,
                f"below 2 x metrics_interval_s, so fresh data would look stale (allowed: >= "
                f"{2 * self.metrics_interval_s} and <= 3600)",
            )
        return self

    def target_by_signal(self) -> dict[str, float]:
        return self.targets.by_signal()  # type: ignore[attr-defined]  # every subclass has targets


class PrefillPoolPolicy(PoolPolicy):
    targets: PrefillTargets = Field(
        default_factory=PrefillTargets, description="Per-replica targets of the prefill pool."
    )


class DecodePoolPolicy(PoolPolicy):
    targets: DecodeTargets = Field(
        default_factory=DecodeTargets, description="Per-replica targets of the decode pool."
    )


class WorkerPoolPolicy(PoolPolicy):
    targets: WorkerTargets = Field(
        default_factory=WorkerTargets, description="Per-replica targets of the colocated pool."
    )


POOL_POLICIES: dict[str, type[PoolPolicy]] = {
    "prefill": PrefillPoolPolicy, "decode": DecodePoolPolicy, "worker": WorkerPoolPolicy,
}


class AutoscalingPolicyConfig(StrictModel):
    name: str = Field(
        "default", pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Policy name, for logs and metrics."
    )
    prefill: PrefillPoolPolicy | None = Field(None, description="PrefillWorker pool; null: fixed replicas.")
    decode: DecodePoolPolicy | None = Field(None, description="DecodeWorker pool; null: fixed replicas.")
    worker: WorkerPoolPolicy | None = Field(None, description="Worker pool (colocated); null: fixed replicas.")
    mode: Literal["reactive", "planner"] = Field(
        "reactive",
        description="What sizes the prefill and decode pools live: each from its own signals (reactive), "
        "or both together from the workload (planner: the planner section). The worker pool is always reactive.",
    )
    planner: PlannerPolicy | None = Field(
        None, description="The planner (router/autoscaling/planner_policy.py); needs prefill and decode sections."
    )

    @model_validator(mode="after")
    def _some_pool(self):
        if self.prefill is None and self.decode is None and self.worker is None:
            raise ValueError("no pool is configured; add at least one of prefill, decode, worker")
        if self.mode == "planner" and self.planner is None:
            raise _FieldError("mode", self.mode, "no planner section; add one (deploy/autoscaling/planner.yaml) "
                              "or set mode: reactive (allowed: reactive, planner)")
        if self.planner is not None:
            missing = [pool for pool in ("prefill", "decode") if self.pool(pool) is None]
            if missing:
                raise _FieldError("planner", None, f"needs a {' and a '.join(missing)} section too: their "
                                  "min_replicas and max_replicas bound the plan")
            lowest = math.ceil(self.planner.ratio.min_prefill_per_decode * self.decode.min_replicas - 1e-9)
            if lowest > self.prefill.max_replicas:
                raise _FieldError(
                    "planner.ratio.min_prefill_per_decode", self.planner.ratio.min_prefill_per_decode,
                    f"needs {lowest} prefill replicas at decode.min_replicas = {self.decode.min_replicas}, above "
                    f"prefill.max_replicas = {self.prefill.max_replicas} (allowed: <= "
                    f"{self.prefill.max_replicas / self.decode.min_replicas:g})",
                )
        return self

    def pool(self, name: PoolName) -> PoolPolicy | None:
        return getattr(self, name)


# ---- loading ---------------------------------------------------------------------------------
def load_policy(path: str | os.PathLike) -> AutoscalingPolicyConfig:
    """Read and validate a policy file; every problem is a PolicyError naming the file."""
    data = read_yaml_mapping(path, what="autoscaling policy", shape="with prefill/decode/worker sections", error=PolicyError)
    return parse_policy(data, str(path))


def parse_policy(data: dict[str, Any], where: str = "policy") -> AutoscalingPolicyConfig:
    return validate_model(
        AutoscalingPolicyConfig, data, where, title="invalid autoscaling policy", error=PolicyError, explain=True,
    )
