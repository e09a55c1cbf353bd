"""The planner in Ray Serve 2.60: one plan for both pools, from both pools' metrics.

Serve 2.60 has two kinds of custom autoscaling policy:

    per deployment    (ctx) -> (replicas, state)                ctx: that deployment's metrics only
    per application   ({deployment: ctx}) -> ({deployment: replicas}, {deployment: state})
                      every autoscaling deployment's metrics; Serve reads it only from a declarative
                      config (`applications[].autoscaling_policy`); `serve.run` has no way to pass it

The joint plan needs both pools' metrics (decode is sized from the prefill pool's flow, and the
ratio bound needs both counts), so:

    declarative deploy        plan_policy, the application's policy: one plan from both contexts,
    (kvrelay serve, Helm,     both counts, ratio and flow included; reactive pools (worker) get
     kvrelay policy apply)    router.autoscaling.decide's decision, as they would alone
    serve.run (tests,         prefill_plan_policy / decode_plan_policy, per deployment: each pool's
     benchmarks)              plan_pool from its own metrics: forecast, capacity, backlog, hysteresis,
                              but no ratio bound and no prefill -> decode flow (neither hook sees
                              the other pool: Serve gives a deployment's policy nothing else)

Under `mode: planner` the deployments carry the per-deployment hooks (their policy_kwargs hold
the pool and planner sections, which plan_policy reads too: Serve hands a function policy no
kwargs of its own); with plan_policy registered, Serve runs it instead, and logs once per
deployment that the application's policy takes precedence. The state of each pool is kept in
its own policy_state (PoolPlanState).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from router.autoscaling.decide import ReplicaSignals, data_problem, observation_from_serve, serve_decide
from router.autoscaling.planner import PLANNED_POOLS, PoolLoad, PoolPlanState, plan, plan_pool
from router.autoscaling.planner_policy import PlannerPolicy
from router.autoscaling.policy import POOL_POLICIES, AutoscalingPolicyConfig, PoolPolicy
from serving.observability.metrics import record_autoscaler_decision

__all__ = ["APP_POLICY_FUNCTION", "app_autoscaling_policy", "pool_load", "plan_policy", "prefill_plan_policy",
           "decode_plan_policy"]

APP_POLICY_FUNCTION = f"{__name__}:plan_policy"
# What a pool's replicas must have reported for the planner (ReplicaSignals fields).
_NEEDED = {"prefill": ("requests_per_s", "prompt_tokens_per_request", "num_queued_prefill_tokens"),
           "decode": ("requests_per_s", "output_tokens_per_request", "num_seqs", "output_tokens_per_s")}
_serve_logger = logging.getLogger("ray.serve")
_parsed: dict[str, tuple[PoolPolicy, PlannerPolicy]] = {}


def app_autoscaling_policy(config: AutoscalingPolicyConfig) -> dict[str, Any] | None:
    """The application's `autoscaling_policy` for a declarative Serve config (None: reactive)."""
    return {"policy_function": APP_POLICY_FUNCTION} if config.mode == "planner" else None


def pool_load(pool: str, replicas: tuple[ReplicaSignals, ...]) -> PoolLoad | None:
    """A pool's load for the planner from its replicas' signals (None: nothing to plan with yet)."""
    if not replicas or any(r.updated_at_s is None or r.requests_per_s is None for r in replicas):
        return None
    rate = sum(r.requests_per_s or 0.0 for r in replicas)
    # Each replica's arrival counter, where every replica reports one (the planner counts from them).
    counted = all(r.replica is not None and r.requests_total is not None for r in replicas)
    totals = tuple((r.replica, r.requests_total) for r in replicas) if counted else ()
    if pool == "prefill":
        measured = [r.prefill_tokens_per_s for r in replicas if r.prefill_tokens_per_s]
        return PoolLoad(rate, _weighted(replicas, "prompt_tokens_per_request"),
                        backlog=sum(r.num_queued_prefill_tokens or 0.0 for r in replicas),
                        measured_tokens_per_s=sum(measured) / len(measured) if measured else None,
                        request_totals=totals)
    tokens = _weighted(replicas, "output_tokens_per_request")
    if rate > 0 and tokens <= 0:
        return None  # requests arrive, none has finished yet: no output length to plan with
    # Tokens per step: 0 (not reported) or below 1 (a window's mean over a report of 0) is 1.
    per_step = [max(1.0, r.decode_tokens_per_step or 1.0) for r in replicas]
    made = [r.output_tokens_per_s or 0.0 for r in replicas]
    steps = [t / m for t, m in zip(made, per_step)]
    # The pool's: its tokens over its steps; with nothing made, the replicas' plain mean.
    tokens_per_step = sum(made) / sum(steps) if sum(steps) > 0 else sum(per_step) / len(per_step)
    # The engines' decode step account, of the replicas that counted steps in the window (an idle
    # one tells nothing of a step's time; an older worker reports none).
    stepped = [r for r in replicas if (r.decode_steps_per_s or 0.0) > 0]
    decode_steps = (sum(r.decode_steps_per_s for r in stepped), sum(r.decode_rows_per_s or 0.0 for r in stepped),
                    sum(r.decode_busy_s_per_s or 0.0 for r in stepped)) if stepped else None
    return PoolLoad(rate, tokens, backlog=sum(r.num_seqs or 0.0 for r in replicas),
                    measured_decode=tuple((r.num_seqs or 0.0, s) for r, s in zip(replicas, steps)),
                    tokens_per_step=tokens_per_step, request_totals=totals, decode_steps=decode_steps)


def _weighted(replicas: tuple[ReplicaSignals, ...], signal: str) -> float:
    """The pool's mean of a per-request signal, weighted by each replica's request rate; with no
    arrivals in the window, the plain mean of the replicas that report one (a decode replica's
    output lengths come from requests that arrived earlier)."""
    rate = sum(r.requests_per_s or 0.0 for r in replicas)
    if rate > 0:
        return sum((r.requests_per_s or 0.0) * (getattr(r, signal) or 0.0) for r in replicas) / rate
    values = [getattr(r, signal) for r in replicas if getattr(r, signal)]
    return sum(values) / len(values) if values else 0.0


def _policies(ctx) -> tuple[str, PoolPolicy, PlannerPolicy, str]:
    kwargs = dict(ctx.config.policy.policy_kwargs)
    key = json.dumps(kwargs, sort_keys=True)
    if key not in _parsed:
        pool = kwargs["pool_name"]
        _parsed[key] = (POOL_POLICIES[pool].model_validate(kwargs["pool"]), PlannerPolicy.model_validate(kwargs["planner"]))
    bounds, planner = _parsed[key]
    return kwargs["pool_name"], bounds, planner, kwargs.get("policy_name", "")


def _load(pool: str, bounds: PoolPolicy, ctx, now: float) -> tuple[PoolLoad | None, str]:
    observation = observation_from_serve(ctx.raw_metrics or {}, ctx.running_replicas, ctx.target_num_replicas,
                                         bounds.window_s, now)
    problem = data_problem(observation.replicas, dict.fromkeys(_NEEDED[pool], 1.0), bounds.stale_after_s, now)
    if problem:
        return None, problem
    load = pool_load(pool, observation.replicas)
    return load, "" if load is not None else "no request has finished yet"


def _now(ctx) -> float:
    return ctx.current_time if ctx.current_time is not None else time.time()


def _log(pool: str, ctx, before: int, after: int, reason: str, policy_name: str) -> None:
    if after != before:
        record_autoscaler_decision(pool, "up" if after > before else "down")
        _serve_logger.info("kvrelay planner %r, %s pool (%s): %s", policy_name, pool, ctx.deployment_name, reason)


def plan_policy(contexts: dict) -> tuple[dict, dict]:
    """Serve's application-level policy: the joint plan (module docstring)."""
    decisions: dict = {}
    states: dict = {}
    planned: dict[str, tuple[Any, Any]] = {}  # pool -> (deployment id, ctx)
    for deployment_id, ctx in contexts.items():
        kwargs = ctx.config.policy.policy_kwargs or {}
        if kwargs.get("planner") is not None and kwargs.get("pool_name") in PLANNED_POOLS:
            planned[kwargs["pool_name"]] = (deployment_id, ctx)
        else:  # a reactive pool (the colocated worker): its own decision, as alone
            pool = str(ctx.config.policy.policy_function).rsplit(":", 1)[-1].removesuffix("_policy")
            decisions[deployment_id], states[deployment_id] = serve_decide(pool, ctx)
    if len(planned) < len(PLANNED_POOLS):  # one pool only (never with a valid policy): per pool
        for deployment_id, ctx in planned.values():
            decisions[deployment_id], states[deployment_id] = _plan_one(ctx)
        return decisions, states
    parsed = {pool: _policies(ctx) for pool, (_, ctx) in planned.items()}
    planner = parsed["prefill"][2]
    now = _now(planned["prefill"][1])
    loads, problems = {}, []
    for pool, (_, ctx) in planned.items():
        loads[pool], problem = _load(pool, parsed[pool][1], ctx, now)
        if problem:
            problems.append(f"{pool}: {problem}")
    result = plan(planner, {pool: parsed[pool][1] for pool in planned}, loads,
                  {pool: ctx.target_num_replicas for pool, (_, ctx) in planned.items()},
                  {pool: PoolPlanState.from_dict(ctx.policy_state) for pool, (_, ctx) in planned.items()}, now)
    reason = result.reason + (f" ({'; '.join(problems)})" if problems else "")
    for pool, (deployment_id, ctx) in planned.items():
        decisions[deployment_id] = result.num_replicas[pool]
        states[deployment_id] = result.states[pool].to_dict()
        _log(pool, ctx, ctx.target_num_replicas, result.num_replicas[pool], reason, parsed[pool][3])
    return decisions, states


def _plan_one(ctx) -> tuple[int, dict[str, Any]]:
    pool, bounds, planner, policy_name = _policies(ctx)
    now = _now(ctx)
    load, problem = _load(pool, bounds, ctx, now)
    state = PoolPlanState.from_dict(ctx.policy_state)
    if load is None:
        return ctx.target_num_replicas, state.to_dict()
    count, state, reason, _ = plan_pool(planner, pool, bounds, load, ctx.target_num_replicas, state, now)
    _log(pool, ctx, ctx.target_num_replicas, count, reason, policy_name)
    return count, state.to_dict()


def prefill_plan_policy(ctx, **_policy_kwargs) -> tuple[int, dict[str, Any]]:
    """Serve policy of the PrefillWorker pool where the application's policy is not registered."""
    return _plan_one(ctx)


def decode_plan_policy(ctx, **_policy_kwargs) -> tuple[int, dict[str, Any]]:
    """Serve policy of the DecodeWorker pool where the application's policy is not registered."""
    return _plan_one(ctx)
