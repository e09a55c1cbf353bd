"""The planner: prefill and decode replica counts together, from the workload and each replica's
capacity at the SLO (the approach of NVIDIA Dynamo's SLA planner).

    every interval_s, per pool:  observed load ─▶ Holt forecast ─▶ load = max(observed, forecast)
                                 reported capacity ─▶ learnt correction of the profile
    prefill replicas = fewest c that keep P(TTFT > ttft_ms) <= 1 - attainment      (Erlang C)
    decode replicas  = fewest c whose streams quantile fits c batches within tpot_ms   (Little)
    then hysteresis per pool, then the prefill:decode ratio bound, then [min, max]

Load. A pool's load is its request rate and tokens per request (prefill: prompt tokens; decode:
tokens decoded per request), as its replicas report them (`PoolLoad`). The rate is counted from
the replicas' arrival counters (`count_arrivals`) where they report them: a sum of their windowed
rates loses a stopped replica's arrivals and counts a new one's few seconds as a window. Each series is forecast
with Holt's linear trend (forecast.py) cold_start_s ahead: a count decided now has to carry the
load until a replica asked for later can work, and since a pool whose need outgrows its count
scales up at once (between plans too), that is cold_start_s from now, not a plan later. The plan
takes the larger of the value now and the forecast: on a line, the peak of that time is at one
of its ends. The request rate "now" is the window's only when it rose above the smoothed level by
more than forecast.significance standard deviations of its Poisson count (sqrt(rate / window_s));
otherwise it is the level. A pool sitting just below a replica's boundary would otherwise scale up
on the first window that counted a few arrivals more, and its hysteresis would keep the replica.
A surge fills the window one sample at a time, so a recent part of it that rose by twice the
significance (its count is shorter) counts too, at its own rate (`recent_rise`): with the load
known, the burst trace met 0.957 of its requests where the counted windows met 0.871.
With forecast.recurrence, a surge that came twice is pre-warmed before the next, at the same gap
(recurrence.py).

Capacity. How many replicas carry a load at the targets, and the learnt correction of the
profiles: router/autoscaling/sizing.py.

Flow. Prefill is planned first, and decode plans for at least the rate prefill plans for (its
arrivals and its queue's drain): every prefilled request decodes next, so a burst sizes decode as
soon as prefill sees it, not a prefill time and a window later. This is what needs both pools'
metrics in one call (router/autoscaling/plan_serve.py).

Between plans the forecast and the learning stand still, but a pool whose need, with the load
now, outgrows its count scales up at once (a burst's queue does not wait for the next plan).

Hysteresis. Up at once to the plan. Down only when the plan, and the arrivals grown by dead_band,
fit fewer replicas continuously for downscale_delay_s; then to the highest need of the arrivals
(grown by dead_band) over that time, or the plan now if higher. A backlog's drain raises the plan
while it lasts but is not held. A significant fall (the window's rate forecast.significance
standard deviations below the level) is a step of the load, not noise: the level takes it (Holt's
trend would carry it on below the load), and the pool goes down to what the load needs now after
one interval_s from the fall's first plan. Not after a surge whose return the planner cannot time
yet (recurrence.py: no gap known): that one keeps its replicas downscale_delay_s, which meets it if
it comes back soon, and its return gives the gap that pre-warms the next.

Ratio. After hysteresis, prefill / decode outside [min_prefill_per_decode, max_prefill_per_decode]
raises the smaller side (never lowers the one the SLO needs); max_replicas wins over the ratio.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, NamedTuple

from router.autoscaling.forecast import Holt
from router.autoscaling.planner_policy import PlannerPolicy
from router.autoscaling.policy import PoolPolicy
from router.autoscaling.recurrence import Surges, moved_down, observe, period, prewarm
from router.autoscaling.sizing import PoolLoad, decode_replicas, learn_correction, prefill_replicas, replicas_for

__all__ = ["PoolLoad", "PoolPlanState", "PoolPlan", "Plan", "prefill_replicas", "decode_replicas", "count_arrivals",
           "recent_rise", "plan_pool", "plan", "Flow", "PLANNED_POOLS"]

PLANNED_POOLS = ("prefill", "decode")
_STATE_PREFIX = "kvrelay.plan."
_EPS = 1e-9


@dataclass(frozen=True)
class PoolPlanState:
    """What the planner remembers of one pool between calls (Serve keeps it in policy_state)."""

    planned_at: float | None = None
    rate_level: float | None = None
    rate_trend: float = 0.0
    tokens_level: float | None = None
    tokens_trend: float = 0.0
    correction: float = 1.0  # prefill: capacity multiplier; decode: TPOT multiplier
    below_since: float | None = None  # the lower plan has held since
    peak_below: int | None = None  # the highest lower plan since below_since
    fell: bool = False  # the lower plan began with a significant fall of the rate
    surges: Surges = Surges()  # recurring surges (recurrence.py)
    seen: tuple[tuple[str, float], ...] = ()  # each replica's arrival counter at the last look
    counted: tuple[tuple[float, float], ...] = ()  # (time, the pool's arrivals counted since the first look)

    def to_dict(self) -> dict[str, Any]:
        return {_STATE_PREFIX + k: v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PoolPlanState:
        found = {f.name: data[_STATE_PREFIX + f.name] for f in fields(cls) if _STATE_PREFIX + f.name in data}
        if isinstance(found.get("surges"), Mapping):
            found["surges"] = Surges(**found["surges"])
        for name in ("seen", "counted"):
            if name in found:
                found[name] = tuple(tuple(item) for item in found[name])
        return cls(**found)


class PoolPlan(NamedTuple):
    num_replicas: int
    state: PoolPlanState
    reason: str
    flow: Flow | None = None


class Plan(NamedTuple):
    num_replicas: dict[str, int]  # pool -> count
    states: dict[str, PoolPlanState]
    reason: str


def count_arrivals(state: PoolPlanState, load: PoolLoad, now: float, window_s: float) -> tuple[float | None, PoolPlanState]:
    """The pool's request rate over the last window_s, counted from its replicas' arrival counters
    (None: not reported, or not window_s / 5 of counting yet), and the state that keeps counting.

    A pool's summed windowed rates miss the arrivals of replicas that have stopped and count a
    new replica's short life as a whole window: each scale-down reads as a fall of the load and
    each scale-up as a slower rise. The counters' increments do not: a replica's arrivals are
    counted once, at the first look after they happened, wherever it is now."""
    if not load.request_totals:
        return None, state
    before = dict(state.seen)
    new = sum(max(0.0, total - before.get(replica, 0.0)) for replica, total in load.request_totals)
    total = state.counted[-1][1] + new if state.counted else 0.0  # the first look is the baseline
    old = [point for point in state.counted if point[0] < now - window_s + _EPS]
    counted = ([old[-1]] if old else []) + [point for point in state.counted if point[0] >= now - window_s + _EPS]
    if counted and now - counted[-1][0] < 1.0:  # at most a point a second (Serve calls every 0.1 s)
        counted[-1] = (counted[-1][0], total)
    else:
        counted.append((now, total))
    state = replace(state, seen=tuple(load.request_totals), counted=tuple(counted))
    start_s, start_total = counted[0]
    if now - start_s < window_s / 5 - _EPS:
        return None, state
    return (total - start_total) / (now - start_s), state


def recent_rise(policy: PlannerPolicy, state: PoolPlanState, level: float | None, bounds: PoolPolicy) -> float | None:
    """The highest rate over a recent part of the window that rose above the smoothed level by
    twice forecast.significance standard deviations of its own count (None: no such part).

    A surge fills a window's count one sample at a time: a 30-s window reads a fifth of a 5x
    surge 5 s into it, and its full rate only a window later. The part since the surge began reads
    it at once. Parts start and end where the counters moved, not at the looks between them, and
    last a metrics interval at least: replicas report their counters at their own times, so a
    shorter part can hold a whole interval's arrivals of the replicas that reported in it. A
    shorter count is noisier too: twice the significance."""
    if level is None or policy.forecast.significance <= 0:
        return None
    moved = [point for i, point in enumerate(state.counted) if i == 0 or point[1] != state.counted[i - 1][1]]
    if len(moved) < 2:
        return None
    end_s, end_total = moved[-1]
    best = None
    for start_s, start_total in moved[:-1]:
        span_s = end_s - start_s
        if span_s < bounds.metrics_interval_s - _EPS or span_s > bounds.window_s + _EPS:
            continue
        rate = (end_total - start_total) / span_s
        if _rose(policy, rate, level, span_s, times=2):
            best = rate if best is None else max(best, rate)
    return best


def _rose(policy: PlannerPolicy, observed: float, before: float | None, window_s: float, times: float = 1.0) -> bool:
    """The window's rate rose above the smoothed level it found by more than `times` x
    forecast.significance standard deviations of its count (module docstring)."""
    if before is None:
        return True
    return observed > before + times * policy.forecast.significance * math.sqrt(max(observed, before) / window_s)


def _fell(policy: PlannerPolicy, observed: float, before: float | None, window_s: float) -> bool:
    """The window's rate fell below the smoothed level it found by more than forecast.significance
    standard deviations of its count: the load went down, it is not noise (module docstring)."""
    if before is None or policy.forecast.significance <= 0:
        return False
    return observed < before - policy.forecast.significance * math.sqrt(max(observed, before) / window_s)


def _rate_now(policy: PlannerPolicy, observed: float, before: float | None, level: float | None,
              window_s: float) -> float:
    """The request rate to plan for now: the window's, if it rose above the smoothed level it
    found (`before`) by more than forecast.significance standard deviations of its count; else the
    level (`level`: after this window, if it was folded in). Module docstring."""
    if before is None or level is None:
        return observed
    return observed if _rose(policy, observed, before, window_s) else level


def _observe_surges(policy: PlannerPolicy, pool: str, bounds: PoolPolicy, load: PoolLoad, state: PoolPlanState,
                    now: float, before: float | None, rate: float, tokens: float, correction: float) -> Surges:
    """The surge history with this look at the load folded in (recurrence.py): whether the rate
    rose significantly, and what `rate` needs without the backlog, grown by the dead band."""
    if not policy.forecast.recurrence:
        return state.surges
    size = replicas_for(policy, pool, rate * (1 + policy.dead_band), tokens, correction, 0.0, load.tokens_per_step)
    # A surge's onset is held to twice the significance: the rate is looked at every metrics
    # interval, and a pattern made of noise would pre-warm for nothing.
    rise = 0 if before is None else sum(_rose(policy, load.requests_per_s, before, bounds.window_s, times=k) for k in (1, 2))
    return observe(state.surges, now, rise, min(max(size, bounds.min_replicas), bounds.max_replicas),
                   policy.cold_start_s + 2 * policy.interval_s, policy.interval_s)


# ---- one pool ----------------------------------------------------------------------------------
class Flow(NamedTuple):
    """Requests/s a pool plans for, passed on to the next pool (every prefilled request decodes)."""

    planned: float  # the forecast's: what to scale up to
    held: float  # the observed and smoothed, without the trend: what a pool shrinks no lower than
    drain: float = 0.0  # the backlog's, while it lasts


def _plan_between(policy: PlannerPolicy, pool: str, bounds: PoolPolicy, load: PoolLoad, current: int,
                  state: PoolPlanState, now: float, upstream: Flow, rate: Holt, tokens: Holt,
                  surge: float | None) -> PoolPlan:
        # Between plans the forecast and the learning stand still, but a pool whose load (a
        # burst's queue, the prefill pool's flow) outgrows it scales up now, not at the next plan.
        rate_now = _rate_now(policy, load.requests_per_s, rate.level, rate.level, bounds.window_s)
        rate_now = max(rate_now, surge or 0.0)
        planned_rate = max(rate_now, rate.forecast(policy.horizon_steps), upstream.planned)
        planned_tokens = max(load.tokens_per_request, tokens.forecast(policy.horizon_steps))
        need = replicas_for(policy, pool, planned_rate + upstream.drain, planned_tokens, state.correction, load.backlog,
                         load.tokens_per_step)
        need = min(max(need, bounds.min_replicas), bounds.max_replicas)
        drain = load.backlog / (planned_tokens * policy.interval_s) if pool == "prefill" and planned_tokens > 0 else 0.0
        flow = Flow(planned_rate, max(rate_now, upstream.held), drain)
        state = replace(state, surges=_observe_surges(policy, pool, bounds, load, state, now, rate.level,
                                                      max(rate_now, upstream.held), planned_tokens, state.correction))
        if need > current:
            why = f"{planned_rate + upstream.drain:.3g} req/s x {planned_tokens:.4g} tok, backlog {load.backlog:.4g}"
            return PoolPlan(need, replace(state, below_since=None, peak_below=None, fell=False),
                            f"up: {current} -> {need} ({why})", flow)
        return PoolPlan(current, state, f"hold: next plan in {policy.interval_s - (now - state.planned_at):.1f}s", flow)


def _settle(policy: PlannerPolicy, bounds: PoolPolicy, current: int, state: PoolPlanState, now: float, need: int,
            steady: int, fell_now: bool, why: str, flow: Flow) -> PoolPlan:
    """A new plan's count (module docstring: Hysteresis): up at once to `need`; down to the highest
    `steady` need once the lower plan has held its delay."""
    lo, hi = bounds.min_replicas, bounds.max_replicas
    surges = state.surges
    reset = replace(state, below_since=None, peak_below=None, fell=False)
    if not lo <= current <= hi:
        target = max(need, min(max(current, lo), hi))
        return PoolPlan(target, reset, f"clamp: {current} -> {target} ({why})", flow)
    if need > current:
        return PoolPlan(need, reset, f"up: {current} -> {need} ({why})", flow)
    if max(steady, need) < current:
        since = state.below_since if state.below_since is not None else now
        peak = max(steady, state.peak_below or 0)
        fell = state.fell
        # A surge whose return the planner cannot time yet (no period: recurrence.py) keeps its
        # replicas the usual downscale_delay_s: they meet it if it comes back soon, and its
        # return gives the period that pre-warms the next.
        untimed_surge = policy.forecast.recurrence and surges.rising and period(surges) is None
        if fell_now and not untimed_surge:
            # The load went down: what the plans wanted before the fall is not what it needs now.
            # The lower plan must hold one interval from the fall's first plan, not downscale_delay_s.
            since, peak = (since if fell else now), steady
            fell = True
        delay = policy.interval_s if fell else policy.downscale_delay_s
        state = replace(state, fell=fell)
        if now - since >= delay - _EPS:
            peak = max(peak, need)
            return PoolPlan(peak, replace(reset, surges=moved_down(reset.surges)), f"down: {current} -> {peak} ({why})", flow)
        return PoolPlan(current, replace(state, below_since=since, peak_below=peak),
                        f"hold: {max(peak, need)} < {current} for {now - since:.0f}s of "
                        f"{'one interval after a fall' if fell else 'downscale_delay_s'} {delay:g} ({why})", flow)
    return PoolPlan(current, reset, f"hold: {current} ({why})", flow)


def plan_pool(policy: PlannerPolicy, pool: str, bounds: PoolPolicy, load: PoolLoad, current: int,
              state: PoolPlanState, now: float, upstream: Flow | None = None) -> PoolPlan:
    """One pool's count now: a new plan every interval_s, else the current count. `upstream`
    (decode) is the prefill pool's flow, which reaches decode next."""
    assert pool in PLANNED_POOLS, pool
    upstream = upstream or Flow(0.0, 0.0)
    counted_rate, state = count_arrivals(state, load, now, bounds.window_s)
    if counted_rate is not None:
        load = replace(load, requests_per_s=counted_rate)
    alpha, beta = policy.forecast.alpha, policy.forecast.beta
    rate = Holt(state.rate_level, state.rate_trend)
    tokens = Holt(state.tokens_level, state.tokens_trend)
    between = state.planned_at is not None and now - state.planned_at < policy.interval_s - _EPS
    surge = recent_rise(policy, state, rate.level, bounds) if counted_rate is not None else None
    if between:
        return _plan_between(policy, pool, bounds, load, current, state, now, upstream, rate, tokens, surge)
    before = rate.level
    fell_now = _fell(policy, load.requests_per_s, before, bounds.window_s)
    # A significant fall is a step, not a trend: the level takes it, and the trend starts over
    # (Holt's trend would carry the fall on below the load for several plans).
    rate = Holt(load.requests_per_s, 0.0) if fell_now else rate.update(load.requests_per_s, alpha, beta)
    tokens = tokens.update(load.tokens_per_request, alpha, beta)
    correction = learn_correction(policy, pool, load, state.correction)
    held_rate = max(_rate_now(policy, load.requests_per_s, before, rate.level, bounds.window_s), surge or 0.0,
                    upstream.held)
    planned_rate = max(held_rate, rate.forecast(policy.horizon_steps), upstream.planned)
    planned_tokens = max(load.tokens_per_request, tokens.forecast(policy.horizon_steps))
    held_tokens = max(load.tokens_per_request, tokens.level)
    need = replicas_for(policy, pool, planned_rate + upstream.drain, planned_tokens, correction, load.backlog,
                     load.tokens_per_step)
    # What the arrivals need without the trend, grown by the dead band: the level a pool shrinks
    # to. A backlog's drain and a trend's overshoot last a few intervals; they are not held.
    steady = replicas_for(policy, pool, held_rate * (1 + policy.dead_band), held_tokens, correction, 0.0,
                       load.tokens_per_step)
    drain = load.backlog / (planned_tokens * policy.interval_s) if pool == "prefill" and planned_tokens > 0 else 0.0
    flow = Flow(planned_rate, held_rate, drain)
    lo, hi = bounds.min_replicas, bounds.max_replicas
    need, steady = min(max(need, lo), hi), min(max(steady, lo), hi)
    surges = _observe_surges(policy, pool, bounds, load, state, now, before, held_rate, held_tokens, correction)
    if policy.forecast.recurrence:
        # An onset is seen a detection lag after it comes, under one window: the pre-warm leads by
        # a window more than a replica's start and a plan.
        lead_s = policy.cold_start_s + policy.interval_s + bounds.window_s
        need, surges = prewarm(surges, now, need, lead_s, policy.interval_s)
        need = min(need, hi)
    state = replace(state, planned_at=now, rate_level=rate.level, rate_trend=rate.trend,
                    tokens_level=tokens.level, tokens_trend=tokens.trend, correction=correction, surges=surges)
    why = f"{planned_rate + upstream.drain:.3g} req/s x {planned_tokens:.4g} tok, capacity x{correction:.3g}"
    if load.tokens_per_step != 1.0:
        why += f", {load.tokens_per_step:.3g} tok/step"
    return _settle(policy, bounds, current, state, now, need, steady, fell_now, why, flow)


# ---- both pools --------------------------------------------------------------------------------
def plan(policy: PlannerPolicy, bounds: Mapping[str, PoolPolicy], loads: Mapping[str, PoolLoad | None],
         currents: Mapping[str, int], states: Mapping[str, PoolPlanState], now: float) -> Plan:
    """Both pools' counts now, from both pools' loads (None: that pool has no usable data)."""
    missing = [pool for pool in PLANNED_POOLS if loads.get(pool) is None]
    if missing:
        return Plan(dict(currents), dict(states), f"hold: no usable data from the {' and '.join(missing)} pool")
    # Prefill first: every request it plans for reaches decode next, and it sees them first (a
    # burst shows in its arrivals, then its queue, one prefill time before decode's).
    plans = {"prefill": plan_pool(policy, "prefill", bounds["prefill"], loads["prefill"], currents["prefill"],
                                  states["prefill"], now)}
    plans["decode"] = plan_pool(policy, "decode", bounds["decode"], loads["decode"], currents["decode"],
                                states["decode"], now, upstream=plans["prefill"].flow)
    counts = {pool: p.num_replicas for pool, p in plans.items()}
    reasons = [f"{pool} {p.reason}" for pool, p in plans.items()]
    ratio = policy.ratio
    if counts["prefill"] < ratio.min_prefill_per_decode * counts["decode"] - _EPS:
        raised = min(bounds["prefill"].max_replicas, math.ceil(ratio.min_prefill_per_decode * counts["decode"] - _EPS))
        reasons.append(f"ratio: prefill {counts['prefill']} -> {raised} (min_prefill_per_decode "
                       f"{ratio.min_prefill_per_decode:g})")
        counts["prefill"] = raised
    elif counts["prefill"] > ratio.max_prefill_per_decode * counts["decode"] + _EPS:
        raised = min(bounds["decode"].max_replicas, math.ceil(counts["prefill"] / ratio.max_prefill_per_decode - _EPS))
        reasons.append(f"ratio: decode {counts['decode']} -> {raised} (max_prefill_per_decode "
                       f"{ratio.max_prefill_per_decode:g})")
        counts["decode"] = raised
    states_out = {}
    for pool, p in plans.items():
        # A pool the ratio raised above its own plan is not waiting to shrink.
        raised = counts[pool] > p.num_replicas
        states_out[pool] = replace(p.state, below_since=None, peak_below=None, fell=False) if raised else p.state
    return Plan(counts, states_out, "; ".join(reasons))
