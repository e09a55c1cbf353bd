"""`kvrelay policy simulate FILE --workload ...`: replay a whole workload through three autoscaling
policies and score each on SLO attainment and replica-seconds.

    requests (workload.py) ─▶ prefill pool ─▶ decode pool        (pool_model.py)
                                    ▲              ▲
               every tick_s: policy(observed signals, counts, now) ─▶ counts per pool

The three policies, every one within the file's [min_replicas, max_replicas] per pool:

    reactive    router.autoscaling.decide.decide per pool, with the file's prefill / decode sections
    planner     router.autoscaling.planner.plan, with the file's planner section
    ray-default Ray Serve 2.60's default policy per pool: desired = total ongoing requests (the
                window's mean, summed over replicas) / target_ongoing_requests (2), applied after
                upscale_delay_s 30 / downscale_delay_s 600 of the same wish
                (ray/serve/autoscaling_policy.py: replica_queue_length_autoscaling_policy,
                _apply_scaling_factors, _apply_delay_logic; the defaults of AutoscalingConfig)

A request meets the SLO when its TTFT <= planner.targets.ttft_ms and its TPOT <= tpot_ms. The
score counts every request that arrives before the trace ends, run to completion; replica-seconds
count both pools from 0 to the trace's end. Every policy sees the same requests (one seed).

Beside the three, each trace's model floor (`model_floor`): the replica-seconds of a clairvoyant
plan that runs every segment of the trace on the fewest replicas the planner's capacity model, at
the replicas' true speed, says keep the attainment target at that segment's own rate and lengths,
with no cold start, no estimate's noise and no hysteresis. It is a yardstick, not a bound the
policies must respect: the model is an approximation (on the steady trace its 3 prefill and 4
decode replicas meet 0.974 of the requests in this replay), and a policy may spend less by
missing more requests than the target allows.

And the planner with the load known (`KNOWN_LOAD`, "known load" in the table): the planner as
shipped, every look fed the trace's own request rate and mean prompt and decode lengths at that
moment in place of what the replicas counted (their queues, step account and speeds are still
read). It splits the planner's spend above the floor in two: what estimating the load from
counts costs (planner against known load), and what the planner's own rules cost on the true
load (known load against the floor: the cold start, hysteresis, a backlog's drain, rounding to
whole replicas while the load moves).
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from router.autoscaling.decide import Observation, ScaleState, decide
from router.autoscaling.plan_serve import pool_load
from router.autoscaling.planner import PLANNED_POOLS, PoolLoad, PoolPlanState, decode_replicas, plan, prefill_replicas
from router.autoscaling.policy import AutoscalingPolicyConfig
from router.autoscaling.pool_model import CALIBRATION, Capacity, DecodeReplica, Pool, PrefillReplica, percentile
from router.autoscaling.workload import Segment, WorkloadTrace, generate_requests

__all__ = ["POLICIES", "KNOWN_LOAD", "RAY_DEFAULTS", "PolicyResult", "replay", "model_floor", "compare",
           "format_table"]

POLICIES = ("reactive", "planner", "ray-default")
KNOWN_LOAD = "planner-known-load"  # a yardstick beside the model floor, not a policy to compare
# ray.serve.config.AutoscalingConfig's defaults in Ray 2.60 (a test checks them against Ray's).
RAY_DEFAULTS = {"target_ongoing_requests": 2.0, "upscale_delay_s": 30.0, "downscale_delay_s": 600.0,
                "look_back_period_s": 30.0}


@dataclass
class PolicyResult:
    policy: str
    num_requests: int = 0
    num_met: int = 0
    num_ttft_met: int = 0
    num_tpot_met: int = 0
    replica_seconds: dict[str, float] = field(default_factory=dict)
    max_replicas: dict[str, int] = field(default_factory=dict)
    ttft_p95_ms: float = 0.0
    tpot_p95_ms: float = 0.0
    num_scale_events: int = 0

    @property
    def attainment(self) -> float:
        return self.num_met / self.num_requests if self.num_requests else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy, "slo_attainment": round(self.attainment, 4), "num_requests": self.num_requests,
            "num_met": self.num_met, "num_ttft_met": self.num_ttft_met, "num_tpot_met": self.num_tpot_met,
            "replica_seconds": round(sum(self.replica_seconds.values()), 1),
            "replica_seconds_by_pool": {k: round(v, 1) for k, v in self.replica_seconds.items()},
            "max_replicas": self.max_replicas, "ttft_p95_ms": round(self.ttft_p95_ms, 1),
            "tpot_p95_ms": round(self.tpot_p95_ms, 1), "num_scale_events": self.num_scale_events,
        }


# ---- the policies ------------------------------------------------------------------------------
class _Reactive:
    def __init__(self, config: AutoscalingPolicyConfig):
        self.config = config
        self.states = {pool: ScaleState() for pool in PLANNED_POOLS}

    def decide(self, pools: dict[str, Pool], now: float) -> dict[str, int]:
        counts = {}
        for name, pool in pools.items():
            observation = Observation(pool.target, pool.observed(now))
            counts[name], self.states[name], _ = decide(self.config.pool(name), observation, self.states[name], now)
        return counts


class _Planner:
    def __init__(self, config: AutoscalingPolicyConfig):
        assert config.planner is not None
        self.config = config
        self.states = {pool: PoolPlanState() for pool in PLANNED_POOLS}

    def decide(self, pools: dict[str, Pool], now: float) -> dict[str, int]:
        loads = {name: self.load(name, pool, now) for name, pool in pools.items()}
        bounds = {name: self.config.pool(name) for name in PLANNED_POOLS}
        currents = {name: pool.target for name, pool in pools.items()}
        counts, self.states, _ = plan(self.config.planner, bounds, loads, currents, self.states, now)
        return counts

    def load(self, name: str, pool: Pool, now: float) -> PoolLoad | None:
        return pool_load(name, pool.observed(now))


class _KnownLoadPlanner(_Planner):
    """The planner fed the trace's true load at each look (module docstring)."""

    def __init__(self, config: AutoscalingPolicyConfig, trace: WorkloadTrace):
        super().__init__(config)
        self.trace = trace

    def load(self, name: str, pool: Pool, now: float) -> PoolLoad | None:
        load = super().load(name, pool, now)
        if load is None:
            return None
        segment = _segment_at(self.trace, now)
        # Decode runs the tokens after the first, which prefill makes. No arrival counters: the
        # planner then takes requests_per_s as the pool's rate.
        tokens = segment.prompt_tokens if name == "prefill" else max(0.0, segment.output_tokens - 1)
        return replace(load, requests_per_s=segment.requests_per_s, tokens_per_request=tokens, request_totals=())


def _segment_at(trace: WorkloadTrace, now: float) -> Segment:
    index = bisect.bisect_right([segment.start_s for segment in trace.segments], now) - 1
    return trace.segments[max(0, index)]


class _RayDefault:
    def __init__(self, config: AutoscalingPolicyConfig):
        self.config = config
        self.wish: dict[str, tuple[int, float | None]] = {pool: (0, None) for pool in PLANNED_POOLS}

    def decide(self, pools: dict[str, Pool], now: float) -> dict[str, int]:
        counts = {}
        for name, pool in pools.items():
            running = pool.running(now)
            target = pool.target
            # Ongoing requests per replica, the mean of its samples in the look-back window.
            total = sum(_mean_ongoing(r, now) for r in running)
            desired = total / RAY_DEFAULTS["target_ongoing_requests"] if running else target
            scaled = math.ceil(desired) if running else target  # scaling factors 1.0
            if running and math.ceil(desired) < len(running) and scaled == len(running):
                scaled -= 1
            counts[name] = self._delay(name, scaled, target, now)
            bounds = self.config.pool(name)
            counts[name] = min(max(counts[name], bounds.min_replicas), bounds.max_replicas)
        return counts

    def _delay(self, pool: str, desired: int, target: int, now: float) -> int:
        direction, since = self.wish[pool]
        want = (desired > target) - (desired < target)
        if want == 0:
            self.wish[pool] = (0, None)
            return target
        if want != direction:
            since = now
        delay = RAY_DEFAULTS["upscale_delay_s"] if want > 0 else RAY_DEFAULTS["downscale_delay_s"]
        if now - since + 1e-6 >= delay:
            self.wish[pool] = (0, None)
            return max(1, desired)
        self.wish[pool] = (want, since)
        return target


def _mean_ongoing(replica, now: float) -> float:
    # The pool model's num_seqs is each replica's ongoing requests (prefill: queued or running
    # prompts; decode: running sequences), the figure Serve's default policy counts.
    return replica.observed(now).num_seqs or 0.0


# ---- the replay --------------------------------------------------------------------------------
def replay(config: AutoscalingPolicyConfig, trace: WorkloadTrace, policy: str, *, capacity: Capacity | None = None,
           seed: int = 0, tick_s: float = 1.0) -> PolicyResult:
    """One policy over one trace (module docstring)."""
    assert config.planner is not None and policy in (*POLICIES, KNOWN_LOAD), policy
    capacity = capacity or Capacity()
    controller = _controller(config, trace, policy)
    pools = {name: Pool(name, capacity, config.pool(name).min_replicas) for name in PLANNED_POOLS}
    # Serve's look-back for the default policy; the file's windows for ours.
    window = {name: RAY_DEFAULTS["look_back_period_s"] if policy == "ray-default" else config.pool(name).window_s
              for name in PLANNED_POOLS}
    interval = {name: config.pool(name).metrics_interval_s for name in PLANNED_POOLS}
    targets = config.planner.targets
    requests = generate_requests(trace, seed)
    result = PolicyResult(policy, num_requests=len(requests))
    ttfts: list[float] = []
    tpots: list[float] = []
    to_decode: list[tuple[float, int]] = []  # heap of (first token at, request index)
    unfinished = len(requests)

    def finished(rid: int, joined: float, at: float) -> None:
        nonlocal unfinished
        tpot_ms = 1000 * (at - joined) / (requests[rid].output_tokens - 1)
        tpots.append(tpot_ms)
        ttft_ok = ttfts_by_id[rid] <= targets.ttft_ms
        tpot_ok = tpot_ms <= targets.tpot_ms
        result.num_tpot_met += tpot_ok
        result.num_met += ttft_ok and tpot_ok
        unfinished -= 1

    ttfts_by_id: dict[int, float] = {}
    next_request, t, next_sample = 0, 0.0, dict.fromkeys(PLANNED_POOLS, 0.0)
    result.max_replicas = {name: pool.target for name, pool in pools.items()}
    while unfinished > 0:
        end = t + tick_s
        prefill, decode = pools["prefill"], pools["decode"]
        while next_request < len(requests) and requests[next_request].arrival_s < end:
            request = requests[next_request]
            replica = min(prefill.accepting(request.arrival_s), key=lambda r: r.free_at)
            assert isinstance(replica, PrefillReplica)
            first_token = replica.take(request.arrival_s, request.prompt_tokens)
            ttfts_by_id[next_request] = 1000 * (first_token - request.arrival_s)
            ttfts.append(ttfts_by_id[next_request])
            result.num_ttft_met += ttfts_by_id[next_request] <= targets.ttft_ms
            heapq.heappush(to_decode, (first_token, next_request))
            next_request += 1
        while to_decode and to_decode[0][0] < end:
            at, rid = heapq.heappop(to_decode)
            replica = min(decode.accepting(at), key=lambda r: len(r.active))
            assert isinstance(replica, DecodeReplica)
            replica.join(rid, at, requests[rid].output_tokens - 1, finished)
        for r in decode.replicas:
            r.advance(end, finished)
        prefill.settle(end)
        t = end
        _sample_and_scale(controller, pools, t, next_sample, window, interval, result)
    result.replica_seconds = {name: pool.replica_seconds(trace.end_s) for name, pool in pools.items()}
    result.ttft_p95_ms, result.tpot_p95_ms = percentile(ttfts, 95), percentile(tpots, 95)
    return result


def _controller(config: AutoscalingPolicyConfig, trace: WorkloadTrace, policy: str):
    """The replay's stand-in for `policy`: the known-load planner reads the trace itself."""
    if policy == KNOWN_LOAD:
        return _KnownLoadPlanner(config, trace)
    return {"reactive": _Reactive, "planner": _Planner, "ray-default": _RayDefault}[policy](config)


def _sample_and_scale(controller, pools: dict[str, Pool], t: float, next_sample: dict[str, float],
                      window: dict[str, float], interval: dict[str, float], result: PolicyResult) -> None:
    """The pools' replicas report what their metrics interval has come to, and the controller
    scales the pools on it."""
    for name, pool in pools.items():
        while next_sample[name] <= t:
            pool.sample(t, window[name])
            next_sample[name] += interval[name]
    counts = controller.decide(pools, t)
    for name, pool in pools.items():
        if counts[name] != pool.target:
            result.num_scale_events += 1
            pool.scale_to(counts[name], t)
            result.max_replicas[name] = max(result.max_replicas[name], pool.target)


def model_floor(config: AutoscalingPolicyConfig, trace: WorkloadTrace, capacity: Capacity) -> dict[str, float]:
    """Replica-seconds per pool of the clairvoyant plan (module docstring): each segment on the
    fewest replicas the planner's model, with the replicas' true capacity, says meet the attainment
    target there, within each pool's [min_replicas, max_replicas]."""
    assert config.planner is not None
    profiles = config.planner.profiles.model_copy(update={
        "prefill": config.planner.profiles.prefill.model_copy(update={"tokens_per_s": capacity.prefill_tokens_per_s}),
        "decode": config.planner.profiles.decode.model_copy(update={"tpot_base_ms": capacity.tpot_base_ms,
                                                                    "tpot_ms_per_seq": capacity.tpot_ms_per_seq}),
        "learn": False})
    planner = config.planner.model_copy(update={"profiles": profiles})
    ends = [segment.start_s for segment in trace.segments[1:]] + [trace.end_s]
    seconds = dict.fromkeys(PLANNED_POOLS, 0.0)
    for segment, end in zip(trace.segments, ends):
        # The first output token comes from prefill: decode runs the rest.
        needs = {"prefill": prefill_replicas(planner, segment.requests_per_s, segment.prompt_tokens),
                 "decode": decode_replicas(planner, segment.requests_per_s, max(0.0, segment.output_tokens - 1))}
        for pool, need in needs.items():
            bounds = config.pool(pool)
            seconds[pool] += (end - segment.start_s) * min(max(need, bounds.min_replicas), bounds.max_replicas)
    return seconds


# ---- every policy over every trace -------------------------------------------------------------
def compare(config: AutoscalingPolicyConfig, traces: list[WorkloadTrace], *, capacity: Capacity | None = None,
            seed: int = 0) -> dict[str, Any]:
    """Every policy over every trace: the results and, per trace, whether the planner met the
    target (SLO attainment >= each other policy's, replica-seconds <= each other's), with the two
    yardsticks (module docstring): the model floor and the planner with the load known."""
    capacity = capacity or Capacity()
    runs = []
    verdicts = {}
    floors = {}
    known = {}
    for trace in traces:
        floor = model_floor(config, trace, capacity)
        floors[trace.name] = {"replica_seconds": round(sum(floor.values()), 1),
                              "replica_seconds_by_pool": {pool: round(v, 1) for pool, v in floor.items()}}
        known[trace.name] = replay(config, trace, KNOWN_LOAD, capacity=capacity, seed=seed).to_dict()
        results = {policy: replay(config, trace, policy, capacity=capacity, seed=seed) for policy in POLICIES}
        planner = results["planner"]
        others = [r for name, r in results.items() if name != "planner"]
        total = sum(planner.replica_seconds.values())
        verdicts[trace.name] = {
            "attainment_at_least_others": all(planner.attainment >= o.attainment for o in others),
            "replica_seconds_at_most_others": all(total <= sum(o.replica_seconds.values()) for o in others),
        }
        verdicts[trace.name]["met"] = all(verdicts[trace.name].values())
        runs += [{"trace": trace.name, **r.to_dict()} for r in results.values()]
    return {
        "summary": {"planner_met_target_in": [t for t, v in verdicts.items() if v["met"]],
                    "planner_missed_target_in": [t for t, v in verdicts.items() if not v["met"]],
                    "by_trace": verdicts},
        "results": runs,
        "model_floor": floors,
        "known_load": known,
        "capacity": {**asdict(capacity), "calibration": CALIBRATION},
        "slo": {"ttft_ms": config.planner.targets.ttft_ms, "tpot_ms": config.planner.targets.tpot_ms},  # type: ignore[union-attr]
        "seed": seed,
    }


def format_table(report: dict[str, Any]) -> str:
    lines = [f"SLO: TTFT <= {report['slo']['ttft_ms']:g} ms and TPOT <= {report['slo']['tpot_ms']:g} ms; "
             f"cold start {report['capacity']['cold_start_s']:g} s",
             f"{'trace':<10} {'policy':<12} {'SLO met':>8} {'requests':>9} {'replica-s':>10} {'prefill':>8} "
             f"{'decode':>8} {'TTFT p95':>9} {'TPOT p95':>9} {'max P/D':>8}"]
    lines += [_row(r["trace"], r["policy"], r) for r in report["results"]]
    lines += [_row(trace, "known load", r) for trace, r in report.get("known_load", {}).items()]
    floors = report.get("model_floor", {})
    for trace, floor in floors.items():
        by_pool = floor["replica_seconds_by_pool"]
        lines.append(f"{trace:<10} {'model floor':<12} {'':>8} {'':>9} {floor['replica_seconds']:>10.0f} "
                     f"{by_pool['prefill']:>8.0f} {by_pool['decode']:>8.0f}")
    if floors:
        lines.append("model floor: clairvoyant, each segment on the fewest replicas the planner's model says meet the target")
    if report.get("known_load"):
        lines.append("known load: the planner fed the trace's true rate and lengths at each look (what estimating them costs)")
    summary = report["summary"]
    lines.append(f"planner met the target (SLO met >= the others', replica-s <= the others') in: "
                 f"{', '.join(summary['planner_met_target_in']) or 'none'}; missed in: "
                 f"{', '.join(summary['planner_missed_target_in']) or 'none'}")
    return "\n".join(lines)


def _row(trace: str, label: str, r: dict[str, Any]) -> str:
    by_pool = r["replica_seconds_by_pool"]
    return (f"{trace:<10} {label:<12} {r['slo_attainment']:>8.4f} {r['num_requests']:>9} "
            f"{r['replica_seconds']:>10.0f} {by_pool['prefill']:>8.0f} {by_pool['decode']:>8.0f} "
            f"{r['ttft_p95_ms']:>7.0f}ms {r['tpot_p95_ms']:>7.0f}ms "
            f"{r['max_replicas']['prefill']:>4}/{r['max_replicas']['decode']}")
