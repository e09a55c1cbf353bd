"""The autoscaling decision on synthetic traces (exact replica counts), and its Serve adapter."""

from __future__ import annotations

from collections import namedtuple

from router.autoscaling.decide import (
    SIGNALS,
    Observation,
    ReplicaSignals,
    ScaleState,
    decide,
    observation_from_serve,
    prefill_policy,
    serve_autoscaling_config,
)
from router.autoscaling.policy import PrefillPoolPolicy, WorkerPoolPolicy, parse_policy

TICK_S = 5.0
TARGETS = {"ttft_p95_ms": None, "queued_prefill_tokens_per_replica": 100}
Point = namedtuple("Point", "timestamp value")


def pool(**overrides) -> PrefillPoolPolicy:
    """Queued prefill tokens only, 100 per replica; round numbers everywhere."""
    base = dict(
        min_replicas=1, max_replicas=5, max_step=2, window_s=30, metrics_interval_s=5, stale_after_s=15,
        upscale_delay_s=10, upscale_cooldown_s=30, downscale_delay_s=60, downscale_threshold=0.5,
        targets=TARGETS,
    )
    return PrefillPoolPolicy.model_validate({**base, **overrides})


def even(n: int, total: float, now: float, **signals) -> Observation:
    """n fresh replicas sharing `total` queued prefill tokens evenly."""
    replica = ReplicaSignals(updated_at_s=now, num_queued_prefill_tokens=total / n, **signals)
    return Observation(n, (replica,) * n)


def run(policy, loads, *, start: int | None = None) -> tuple[list[int], list[str]]:
    """One decision per tick (TICK_S apart) on the pool's total queued prefill tokens; the count
    each decision picks is the next observation's."""
    n = start or policy.min_replicas
    state = ScaleState()
    counts, reasons = [], []
    for i, load in enumerate(loads):
        now = i * TICK_S
        n, state, reason = decide(policy, even(n, load, now), state, now)
        counts.append(n)
        reasons.append(reason)
    return counts, reasons


def changes(counts: list[int]) -> int:
    return sum(a != b for a, b in zip(counts, counts[1:]))


# ---- traces ----------------------------------------------------------------------------------
def test_step_scales_up_after_the_delay_by_max_step_then_again_after_the_cooldown():
    counts, reasons = run(pool(), [50] * 4 + [350] * 16)
    #                  t = 0  5 10 15 20 25 30 35 40 45 50 55 60 ...
    assert counts == [1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4, 4]
    assert reasons[0] == "hold: demand 0.50 (queued_prefill_tokens) within (0.00, 1]"
    assert reasons[4] == "hold: demand 3.50 (queued_prefill_tokens) > 1 for 0.0s of upscale_delay_s 10"
    assert reasons[6] == "up: 1 -> 3, demand 3.50 (queued_prefill_tokens)"  # capped by max_step 2
    assert reasons[9] == (
        "hold: demand 3.50 (queued_prefill_tokens), 15.0s since the last scale-up of upscale_cooldown_s 30"
    )
    assert reasons[12] == "up: 3 -> 4, demand 3.50 (queued_prefill_tokens)"  # ceil(3.5), not max_step
    assert reasons[13] == "hold: demand 3.50 (queued_prefill_tokens) within (1.50, 4]"


def test_ramp_follows_the_load_up_one_replica_at_a_time():
    counts, reasons = run(pool(), [20 * i for i in range(30)])  # demand grows 0.2 replicas a tick
    # Above 1 from t=30, up at t=40 to ceil(1.6) = 2; above 2 from t=55, delay done at t=65 but
    # the cooldown runs to t=70: up to 3; above 3 from t=80, up at t=100 (cooldown); above 4 from
    # t=105, up at t=130 to max_replicas 5 (ceil(5.2) = 6 is capped).
    assert counts == [1] * 8 + [2] * 6 + [3] * 6 + [4] * 6 + [5] * 4
    assert reasons[14] == "up: 2 -> 3, demand 2.80 (queued_prefill_tokens)"
    assert reasons[26] == "up: 4 -> 5, demand 5.20 (queued_prefill_tokens)"


def test_spike_shorter_than_the_upscale_delay_does_not_scale():
    for spike_ticks in (1, 2):  # 0 s and 5 s above target, upscale_delay_s 10
        counts, _ = run(pool(), [50] * 4 + [1000] * spike_ticks + [50] * 20)
        assert counts == [1] * (24 + spike_ticks)
    counts, _ = run(pool(), [50] * 4 + [1000] * 3 + [50] * 4)  # 10 s above: it does
    assert counts == [1] * 6 + [3] * 5


def test_load_oscillating_around_the_target_does_not_flap():
    fast, _ = run(pool(), [90, 110] * 100)  # across the target every tick
    assert fast == [1] * 200
    slow, reasons = run(pool(), ([80] * 4 + [130] * 4) * 50)  # 20 s below, 20 s above
    assert changes(slow) == 1 and slow[-1] == 2
    assert reasons[-1] == "hold: demand 1.30 (queued_prefill_tokens) within (0.50, 2]"
    # At 3 replicas, demand swinging between 1.5 and 3.5 buys one replica and then sits in the
    # band: 1.5 is at the downscale threshold of 4 replicas (3 x 0.5) only every other 15 s.
    swing, _ = run(pool(), ([150] * 3 + [350] * 3) * 40, start=3)
    assert changes(swing) == 1 and swing[-1] == 4


def test_scales_down_one_replica_per_downscale_delay_to_min_replicas():
    counts, reasons = run(pool(), [0] * 45, start=4)
    # below since t=0 -> 3 at t=60; the clock restarts: below since t=65 -> 2 at t=125, ...
    assert counts == [4] * 12 + [3] * 13 + [2] * 13 + [1] * 7
    assert reasons[12] == "down: 4 -> 3, demand 0.00 (queued_prefill_tokens)"
    assert reasons[13] == "hold: demand 0.00 (queued_prefill_tokens) <= 1.00 for 0.0s of downscale_delay_s 60"
    assert reasons[-1] == "hold: at min_replicas 1, demand 0.00 (queued_prefill_tokens)"


def test_no_scale_down_right_after_a_scale_up():
    # Up at t=0 (no delay), then the load vanishes: a scale-down waits downscale_delay_s from the
    # first tick below the threshold (t=15), never less than that after the scale-up.
    counts, _ = run(pool(upscale_delay_s=0), [1000] * 3 + [0] * 16)
    assert counts[:3] == [3, 3, 3] and counts[3:] == [3] * 12 + [2] * 4  # below since t=15 -> t=75


def test_max_step_caps_each_scale_up_and_max_replicas_the_total():
    counts, reasons = run(pool(upscale_delay_s=0), [1000] * 16)
    assert counts == [3] * 6 + [5] * 10  # 1 -> 3 at t=0, -> 5 after the 30 s cooldown
    assert reasons[-1] == "hold: at max_replicas 5, demand 10.00 (queued_prefill_tokens)"
    counts, _ = run(pool(upscale_delay_s=0, max_step=1, upscale_cooldown_s=0), [1000] * 6)
    assert counts == [2, 3, 4, 5, 5, 5]


def test_clamps_to_min_and_max_at_once():
    assert decide(pool(), even(7, 0, 0.0), ScaleState(), 0.0)[::2] == (5, "clamp: 7 -> 5 (max_replicas 5)")
    assert decide(pool(min_replicas=2), Observation(1, ()), ScaleState(), 0.0)[::2] == (
        2, "clamp: 1 -> 2 (min_replicas 2)",
    )


# ---- missing and stale data ------------------------------------------------------------------
def test_stale_data_holds_and_restarts_the_upscale_delay():
    policy = pool()
    state = ScaleState()
    counts, reasons = [], []
    for now, age in ((0, 0), (5, 0), (10, 20), (15, 0), (20, 0), (25, 0)):
        observation = Observation(1, (ReplicaSignals(updated_at_s=now - age, num_queued_prefill_tokens=500),))
        n, state, reason = decide(policy, observation, state, now)
        counts.append(n)
        reasons.append(reason)
    # Without the stale tick the pool would have scaled at t=10; it waits a full delay after.
    assert counts == [1, 1, 1, 1, 1, 3]
    assert reasons[2] == "hold: replica 0 last reported 20.0s ago (stale_after_s 15)"


def test_missing_data_holds():
    policy = pool(upscale_delay_s=0)
    fresh = ReplicaSignals(updated_at_s=0.0, num_queued_prefill_tokens=500)
    cases = {
        (): "hold: no running replica",
        (fresh, ReplicaSignals()): "hold: replica 1 has not reported yet",
        (fresh, ReplicaSignals(updated_at_s=0.0, ttft_p95_ms=10.0)): "hold: replica 1 has no queued_prefill_tokens in the window",
    }
    for replicas, reason in cases.items():
        n = max(1, len(replicas))
        assert decide(policy, Observation(n, replicas), ScaleState(above_since=-60.0), 0.0) == (n, ScaleState(), reason)
    # A signal without a target may be missing.
    assert decide(policy, Observation(1, (fresh,)), ScaleState(), 0.0).num_replicas == 3


def test_the_most_pressed_signal_decides():
    policy = WorkerPoolPolicy(max_replicas=8, upscale_delay_s=0)  # targets: 2000, 4096, 32, 0.85, 250 ms
    replicas = (
        ReplicaSignals(updated_at_s=0.0, num_queued_prefill_tokens=0, ttft_p95_ms=0, num_seqs=40, kv_usage=0.85, tpot_p95_ms=300),
        ReplicaSignals(updated_at_s=0.0, num_queued_prefill_tokens=0, ttft_p95_ms=0, num_seqs=8, kv_usage=0.85, tpot_p95_ms=450),
    )
    # num_seqs 48/32 = 1.5, kv 1.7/0.85 = 2.0, tpot 750/250 = 3.0 replicas
    assert decide(policy, Observation(2, replicas), ScaleState(), 0.0)[::2] == (3, "up: 2 -> 3, demand 3.00 (tpot_p95_ms)")


def test_state_round_trips_through_serve_policy_state():
    state = ScaleState(above_since=1.0, below_since=None, last_scale_up_at=3.0)
    stored = {"serve_internal_counter": 2, **state.to_dict()}
    assert ScaleState.from_dict(stored) == state
    assert ScaleState.from_dict({}) == ScaleState()


# ---- Ray Serve adapter -----------------------------------------------------------------------
def test_observation_from_serve_means_over_the_window_and_newest_timestamp():
    raw = {
        "num_queued_prefill_tokens": {"r1": [Point(90.0, 10.0), Point(95.0, 20.0), Point(99.0, 30.0)], "r2": [Point(50.0, 5.0)]},
        "num_seqs": {"r1": [Point(98.0, 4.0)]},
        # a counter: its newest point, even one older than the window
        "requests_total": {"r1": [Point(95.0, 40.0), Point(99.0, 42.0), Point(97.0, 41.0)], "r2": [Point(50.0, 7.0)]},
        "ongoing_requests": {"r1": [Point(99.5, 1.0)]},  # not ours: ignored
    }
    observation = observation_from_serve(raw, ["r1", "r2", "r3"], 3, window_s=8.0, now=100.0)
    assert observation == Observation(3, (
        ReplicaSignals(updated_at_s=99.0, num_queued_prefill_tokens=25.0, num_seqs=4.0, requests_total=42.0, replica="r1"),
        ReplicaSignals(updated_at_s=50.0, requests_total=7.0, replica="r2"),  # only samples older than the window
        ReplicaSignals(replica="r3"),  # never reported
    ))


def serve_context(config: dict, *, queued: float, now: float = 100.0, policy_state: dict | None = None):
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    return AutoscalingContext(
        deployment_id=None, deployment_name="PrefillWorker", app_name="kvrelay", current_num_replicas=1,
        target_num_replicas=1, running_replicas=["r1"], total_num_requests=4.0, total_queued_requests=0.0,
        aggregated_metrics=None, raw_metrics=lambda: {"num_queued_prefill_tokens": {"r1": [Point(now - 1, queued)]}},
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4, policy_state=policy_state or {},
        last_scale_up_time=None, last_scale_down_time=None, current_time=now, config=AutoscalingConfig(**config),
    )


def test_serve_policy_reads_its_kwargs_and_keeps_its_state():
    policy = parse_policy({
        "name": "t", "prefill": {"max_replicas": 4, "upscale_delay_s": 5, "targets": TARGETS},
    })
    config = serve_autoscaling_config("prefill", policy)
    assert config["policy"]["policy_function"] == "router.autoscaling.decide:prefill_policy"
    assert (config["upscale_delay_s"], config["downscale_delay_s"], config["look_back_period_s"]) == (0.0, 0.0, 30.0)
    assert serve_autoscaling_config("decode", policy) is None

    n, state = prefill_policy(serve_context(config, queued=300, now=100.0))
    assert (n, state["kvrelay.above_since"]) == (1, 100.0)
    n, state = prefill_policy(serve_context(config, queued=300, now=105.0, policy_state=state))
    assert (n, state["kvrelay.last_scale_up_at"]) == (3, 105.0)


def test_serve_applies_the_decision_unchanged():
    """Through what the controller runs: the cloudpickled function, wrapped with Serve's own
    delays and factors (zeroed by serve_autoscaling_config)."""
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.autoscaling_policy import _apply_autoscaling_config
    from ray.serve.config import AutoscalingConfig

    policy = parse_policy({"prefill": {"max_replicas": 4, "upscale_delay_s": 0, "targets": TARGETS}})
    config = serve_autoscaling_config("prefill", policy)
    served = _apply_autoscaling_config(_resolve_policy_callable(AutoscalingConfig(**config).policy))
    n, state = served(serve_context(config, queued=250))
    assert n == 3 and state["kvrelay.last_scale_up_at"] == 100.0


def test_signals_match_the_targets_and_the_replica_fields():
    from router.autoscaling.policy import TARGET_SIGNALS

    assert set(TARGET_SIGNALS.values()) == set(SIGNALS)
    assert set(SIGNALS) < set(ReplicaSignals.__dataclass_fields__)
