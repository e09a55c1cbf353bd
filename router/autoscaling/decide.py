"""Autoscaling: a pool's replica count as a pure function of what its replicas report.

    replica ── record_autoscaling_stats() ──▶ Serve controller ── every tick (0.1 s) ──▶
    (serving/observability/worker_metrics.py: queued prefill     prefill_policy(ctx) / decode_policy(ctx) / worker_policy(ctx)
     tokens, seqs, KV use, TTFT/TPOT p95)           ctx ─▶ Observation ─▶ decide(policy, obs, state, now)
                                                    ─▶ (num_replicas, state), Serve applies it

The decision, `decide(policy, observation, state, now) -> (num_replicas, state, reason)`
------------------------------------------------------------------------------------------
`current` is the count Serve is driving towards (the last decision), so a replica still starting
counts and the same load does not buy it twice. Each replica reports five signals; the policy's
targets pick which ones count (router/autoscaling/policy.py). For each counted signal

    demand(signal) = sum over running replicas of signal / target          (in replicas)

the replicas needed for the per-replica average to sit at its target, if load spreads evenly.
`demand` is the largest of them: the most pressed signal decides. Then, in order:

    1. clamp  current outside [min_replicas, max_replicas]: the nearest bound, at once.
    2. hold   on missing or stale data: no running replica, a replica with no sample of a
              counted signal in the window, or whose newest sample is older than stale_after_s.
    3. up     demand > current, continuously for upscale_delay_s, and the last scale-up at least
              upscale_cooldown_s ago: current + min(max_step, ceil(demand) - current), capped at
              max_replicas. Fast: the whole gap up to max_step in one decision.
    4. down   demand <= (current - 1) * downscale_threshold, i.e. one replica fewer would still
              run every signal at or below that fraction of its target, continuously for
              downscale_delay_s: current - 1. Slow: one replica per downscale_delay_s.
    5. hold   otherwise: demand is inside the band ((current - 1) * threshold, current].

Every hold that is not a delay or cooldown in progress restarts both delay clocks, and every
scaling action restarts them too, so a scale-down always waits downscale_delay_s after the last
action. The band is the hysteresis: after scaling to n, demand has to fall to (n - 1) x
threshold or below, and stay there for downscale_delay_s, before the pool shrinks. So load that
oscillates faster than the delays takes the pool up to the count that covers its peaks and leaves
it there (it never flaps), and a spike shorter than upscale_delay_s moves nothing.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, NamedTuple

from router.autoscaling.policy import POOL_POLICIES, AutoscalingPolicyConfig, PoolPolicy
from serving.observability.metrics import record_autoscaler_decision

__all__ = [
    "SIGNALS",
    "SIGNAL_NAMES",
    "signal_name",
    "WORKLOAD_SIGNALS",
    "WIRE_SIGNALS",
    "ReplicaSignals",
    "Observation",
    "ScaleState",
    "ScaleDecision",
    "decide",
    "observation_from_serve",
    "data_problem",
    "serve_decide",
    "serve_autoscaling_config",
    "prefill_policy",
    "decode_policy",
    "worker_policy",
]

logger = logging.getLogger(__name__)

_STATE_PREFIX = "kvrelay."  # our keys in Serve's policy_state, which also holds Serve's own
_EPS = 1e-9


@dataclass(frozen=True)
class ReplicaSignals:
    """One running replica's signals (means over the window); None: no sample in the window."""

    updated_at_s: float | None = None  # newest sample, on the clock of `now`; None: never reported
    num_queued_prefill_tokens: float | None = None
    ttft_p95_ms: float | None = None
    num_seqs: float | None = None  # running + waiting sequences
    kv_usage: float | None = None
    tpot_p95_ms: float | None = None
    # The workload and capacity the planner reads (router/autoscaling/planner.py), over the window:
    requests_per_s: float | None = None  # requests that arrived here
    prompt_tokens_per_request: float | None = None  # their mean prompt length
    output_tokens_per_request: float | None = None  # mean tokens generated here per request finished here
    output_tokens_per_s: float | None = None  # tokens generated here (with num_seqs: the decode step time)
    prefill_tokens_per_s: float | None = None  # the engine's measured prefill rate (0: none yet)
    # Requests that arrived here since the replica started: a counter, its newest value, not a
    # mean. The planner counts a pool's arrivals from the counters' increments (planner.py), which
    # replicas that start or stop do not distort as they do a sum of windowed rates.
    requests_total: float | None = None
    # Tokens a decoding sequence gains per engine step: 1 without speculative decoding, 1 + the
    # accepted proposals with it (serving/observability/worker_metrics.py TokensPerStep); the
    # planner's decode capacity scales with it. 0 on the wire: not reported (an older worker).
    decode_tokens_per_step: float | None = None
    # The engine's decode steps run back to back, since the previous report: steps/s, sequences
    # they decoded/s, and their periods' seconds/s (serving/engine/engine.py DecodeSteps). The
    # planner's decode correction comes from the replicas that counted steps; 0: none counted,
    # or an older worker (with none in the pool, the stream law's fit: sizing.learn_correction).
    decode_steps_per_s: float | None = None
    decode_rows_per_s: float | None = None
    decode_busy_s_per_s: float | None = None
    replica: str | None = None  # which replica (Serve's replica id): not on the wire, Serve keys by it

    def to_wire(self) -> dict[str, float]:
        """What a replica's record_autoscaling_stats returns: Serve keeps a time series per key
        (and its controller unpickles them without our packages, hence plain floats)."""
        return {signal: float(getattr(self, signal) or 0.0) for signal in WIRE_SIGNALS}


# What every replica reports (record_autoscaling_stats keys), all per replica: the signals the
# reactive targets bound, and the planner's.
SIGNALS = ("num_queued_prefill_tokens", "ttft_p95_ms", "num_seqs", "kv_usage", "tpot_p95_ms")
WORKLOAD_SIGNALS = ("requests_per_s", "prompt_tokens_per_request", "output_tokens_per_request", "output_tokens_per_s",
                    "prefill_tokens_per_s", "decode_tokens_per_step", "requests_total", "decode_steps_per_s",
                    "decode_rows_per_s", "decode_busy_s_per_s")
# The names users know two signals by, the policy YAML's (its targets' keys spell them so): the
# columns of a `kvrelay policy simulate` trace and the decisions' reasons. In code every signal is
# its ReplicaSignals field, named as the engine's stats name the quantity.
SIGNAL_NAMES = {"num_queued_prefill_tokens": "queued_prefill_tokens", "kv_usage": "kv_utilization"}
COUNTER_SIGNALS = ("requests_total",)  # read as the newest point, not the window's mean
WIRE_SIGNALS = SIGNALS + WORKLOAD_SIGNALS


@dataclass(frozen=True)
class Observation:
    num_replicas: int  # the count Serve is driving towards (the last decision)
    replicas: tuple[ReplicaSignals, ...] = ()  # one per running replica


@dataclass(frozen=True)
class ScaleState:
    """What `decide` remembers between calls (kept by Serve in policy_state)."""

    above_since: float | None = None  # demand above current since (the upscale delay clock)
    below_since: float | None = None  # demand below the downscale threshold since
    last_scale_up_at: float | None = None

    def to_dict(self) -> dict[str, float | None]:
        return {_STATE_PREFIX + k: v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ScaleState:
        return cls(**{f.name: data.get(_STATE_PREFIX + f.name) for f in fields(cls)})


class ScaleDecision(NamedTuple):
    num_replicas: int
    state: ScaleState
    reason: str


def decide(policy: PoolPolicy, observation: Observation, state: ScaleState, now: float) -> ScaleDecision:
    """The replica count for one pool now (module docstring: the rules, in order)."""
    current = observation.num_replicas
    lo, hi = policy.min_replicas, policy.max_replicas
    reset = ScaleState(last_scale_up_at=state.last_scale_up_at)

    # 1. clamp
    if not lo <= current <= hi:
        bound = min(max(current, lo), hi)
        which = "min_replicas" if bound == lo and current < lo else "max_replicas"
        return ScaleDecision(bound, reset, f"clamp: {current} -> {bound} ({which} {bound})")

    # 2. missing or stale data
    targets = policy.target_by_signal()
    problem = data_problem(observation.replicas, targets, policy.stale_after_s, now)
    if problem:
        return ScaleDecision(current, reset, f"hold: {problem}")

    demand, name = max(
        (sum(getattr(r, s) for r in observation.replicas) / target, signal_name(s)) for s, target in targets.items()
    )
    why = f"demand {demand:.2f} ({name})"

    # 3. up
    if demand > current + _EPS:
        if current >= hi:
            return ScaleDecision(current, reset, f"hold: at max_replicas {hi}, {why}")
        above_since = state.above_since if state.above_since is not None else now
        waiting = replace(reset, above_since=above_since)
        if now - above_since < policy.upscale_delay_s - _EPS:
            return ScaleDecision(
                current, waiting,
                f"hold: {why} > {current} for {now - above_since:.1f}s of upscale_delay_s {policy.upscale_delay_s:g}",
            )
        if state.last_scale_up_at is not None and now - state.last_scale_up_at < policy.upscale_cooldown_s - _EPS:
            return ScaleDecision(
                current, waiting,
                f"hold: {why}, {now - state.last_scale_up_at:.1f}s since the last scale-up of "
                f"upscale_cooldown_s {policy.upscale_cooldown_s:g}",
            )
        wanted = min(hi, current + policy.max_step, math.ceil(demand - _EPS))
        return ScaleDecision(wanted, ScaleState(last_scale_up_at=now), f"up: {current} -> {wanted}, {why}")

    # 4. down
    floor = (current - 1) * policy.downscale_threshold
    if demand <= floor + _EPS:
        if current <= lo:
            return ScaleDecision(current, reset, f"hold: at min_replicas {lo}, {why}")
        below_since = state.below_since if state.below_since is not None else now
        if now - below_since < policy.downscale_delay_s - _EPS:
            return ScaleDecision(
                current, replace(reset, below_since=below_since),
                f"hold: {why} <= {floor:.2f} for {now - below_since:.1f}s of downscale_delay_s {policy.downscale_delay_s:g}",
            )
        return ScaleDecision(current - 1, reset, f"down: {current} -> {current - 1}, {why}")

    # 5. inside the band
    return ScaleDecision(current, reset, f"hold: {why} within ({floor:.2f}, {current}]")


def data_problem(
    replicas: tuple[ReplicaSignals, ...], targets: Mapping[str, float], stale_after_s: float, now: float
) -> str | None:
    if not replicas:
        return "no running replica"
    for i, replica in enumerate(replicas):
        if replica.updated_at_s is None:
            return f"replica {i} has not reported yet"
        age = now - replica.updated_at_s
        if age > stale_after_s + _EPS:
            return f"replica {i} last reported {age:.1f}s ago (stale_after_s {stale_after_s:g})"
        for signal in targets:
            if getattr(replica, signal) is None:
                return f"replica {i} has no {signal_name(signal)} in the window"
    return None


def signal_name(signal: str) -> str:
    """The name users know `signal` by (SIGNAL_NAMES)."""
    return SIGNAL_NAMES.get(signal, signal)


# ---- Ray Serve -------------------------------------------------------------------------------
def serve_autoscaling_config(pool: str, config: AutoscalingPolicyConfig) -> dict[str, Any] | None:
    """The deployment's `autoscaling_config` for `pool` (None: the policy leaves it fixed).

    Serve's own delays are zeroed: it applies them after the policy function, against its own
    clock, and `decide` already owns the delays and cooldowns.
    """
    policy = config.pool(pool)  # type: ignore[arg-type]
    if policy is None:
        return None
    function = f"{__name__}:{pool}_policy"
    kwargs: dict[str, Any] = {"policy_name": config.name, "pool": policy.model_dump(mode="json")}
    if config.mode == "planner" and pool in ("prefill", "decode"):
        # Serve runs plan_serve.plan_policy (the app's policy) instead when it can; this one is
        # for apps started with serve.run (plan_serve's docstring).
        function = f"router.autoscaling.plan_serve:{pool}_plan_policy"
        kwargs.update(pool_name=pool, planner=config.planner.model_dump(mode="json"))  # type: ignore[union-attr]
    return {
        "min_replicas": policy.min_replicas,
        "max_replicas": policy.max_replicas,
        "initial_replicas": policy.min_replicas,
        "look_back_period_s": policy.window_s,
        "metrics_interval_s": policy.metrics_interval_s,
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        "policy": {"policy_function": function, "policy_kwargs": kwargs},
    }


def observation_from_serve(
    raw_metrics: Mapping[str, Mapping[Any, Iterable]], running_replicas: Iterable, num_replicas: int,
    window_s: float, now: float,
) -> Observation:
    """Serve's per-replica time series (points with .timestamp and .value) as an Observation:
    each signal the mean of its points in the last window_s, updated_at_s the newest point."""
    replicas = []
    for replica_id in running_replicas:
        values: dict[str, float] = {}
        newest: float | None = None
        for signal in WIRE_SIGNALS:
            series = list(raw_metrics.get(signal, {}).get(replica_id) or ())
            if not series:
                continue
            last = max(series, key=lambda point: point.timestamp)
            newest = last.timestamp if newest is None else max(newest, last.timestamp)
            if signal in COUNTER_SIGNALS:
                values[signal] = last.value
                continue
            recent = [point.value for point in series if point.timestamp >= now - window_s]
            if recent:
                values[signal] = sum(recent) / len(recent)
        replicas.append(ReplicaSignals(updated_at_s=newest, replica=str(replica_id), **values))
    return Observation(num_replicas, tuple(replicas))


def prefill_policy(ctx, **policy_kwargs) -> tuple[int, dict[str, Any]]:
    """Serve autoscaling policy of the PrefillWorker pool."""
    return serve_decide("prefill", ctx, policy_kwargs)


def decode_policy(ctx, **policy_kwargs) -> tuple[int, dict[str, Any]]:
    """Serve autoscaling policy of the DecodeWorker pool."""
    return serve_decide("decode", ctx, policy_kwargs)


def worker_policy(ctx, **policy_kwargs) -> tuple[int, dict[str, Any]]:
    """Serve autoscaling policy of the colocated Worker pool."""
    return serve_decide("worker", ctx, policy_kwargs)


# Serve logs its own scale events under "ray.serve" (the controller's log); the reason goes next
# to them there, where this module's logger would have no handler.
_serve_logger = logging.getLogger("ray.serve")
_policies: dict[str, PoolPolicy] = {}  # validated policy_kwargs, by their JSON (ticks are 0.1 s)


def serve_decide(pool: str, ctx, policy_kwargs: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    """One pool's reactive decision from a Serve AutoscalingContext (also called for the reactive
    pools by the planner's application-level policy, router/autoscaling/plan_serve.py)."""
    # Serve 2.60 hands policy_kwargs only to class policies; functions find them in ctx.config.
    kwargs = policy_kwargs or dict(ctx.config.policy.policy_kwargs)
    key = pool + json.dumps(kwargs, sort_keys=True)
    policy = _policies.get(key)
    if policy is None:
        policy = _policies[key] = POOL_POLICIES[pool].model_validate(kwargs["pool"])
    now = ctx.current_time if ctx.current_time is not None else time.time()
    observation = observation_from_serve(
        ctx.raw_metrics or {}, ctx.running_replicas, ctx.target_num_replicas, policy.window_s, now
    )
    decision = decide(policy, observation, ScaleState.from_dict(ctx.policy_state), now)
    if decision.num_replicas != ctx.target_num_replicas:
        record_autoscaler_decision(pool, decision.reason.split(":", 1)[0])  # up | down | clamp
        _serve_logger.info(
            "kvrelay autoscaling policy %r, %s pool (%s): %s",
            kwargs.get("policy_name"), pool, ctx.deployment_name, decision.reason,
        )
    return decision.num_replicas, decision.state.to_dict()
