"""The planner: its YAML section's errors, its capacity arithmetic, its joint plan (ratio bound,
hysteresis, the prefill -> decode flow, learning) and the forecast, on hand-built figures."""

from __future__ import annotations

from dataclasses import replace

import pytest

from router.autoscaling.decode_model import stream_law
from router.autoscaling.forecast import Holt
from router.autoscaling.planner import (
    PoolLoad,
    PoolPlanState,
    count_arrivals,
    decode_replicas,
    plan,
    plan_pool,
    prefill_replicas,
    recent_rise,
)
from router.autoscaling.planner_policy import PlannerPolicy
from router.autoscaling.policy import DecodePoolPolicy, PolicyError, PrefillPoolPolicy, load_policy, parse_policy
from tests.helpers import REPO

PROFILES = {"prefill": {"tokens_per_s": 100}, "decode": {"tpot_base_ms": 20, "tpot_ms_per_seq": 20}, "learn": False}


def planner(**overrides) -> PlannerPolicy:
    """Round numbers: 100 prompt tokens/s per prefill replica; TPOT 20 + 20 n ms, so a decode
    replica holds a batch of 4 within 100 ms; no smoothing (the forecast is the value now)."""
    base = {
        "interval_s": 30, "targets": {"ttft_ms": 2000, "tpot_ms": 100, "attainment": 0.95},
        "forecast": {"alpha": 1, "beta": 0}, "profiles": PROFILES,
        "ratio": {"min_prefill_per_decode": 0.5, "max_prefill_per_decode": 1.5},
        "downscale_delay_s": 60, "dead_band": 0,
    }
    return PlannerPolicy.model_validate({**base, **overrides})


BOUNDS = {"prefill": PrefillPoolPolicy(max_replicas=8), "decode": DecodePoolPolicy(max_replicas=8)}


def error_of(tmp_path, text: str) -> str:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    return str(info.value).replace(str(path), "p.yaml")


# ---- the YAML section --------------------------------------------------------------------------
def test_shipped_planner_policy_loads():
    config = load_policy(REPO / "deploy/autoscaling/planner.yaml")
    assert config.mode == "planner" and config.planner.targets.attainment == 0.97
    assert config.planner.profiles.decode.tpot_ms(4) == pytest.approx(89.28)  # the measured 89.27 ms at batch 4
    assert config.planner.max_batch() == pytest.approx((100 - 27.68) / 15.40)


def test_the_forecast_looks_one_cold_start_ahead():
    # 1.75 req/s now; Holt (alpha = beta = 0.5) from level 1.375 and trend 0.375 keeps level 1.75
    # and trend 0.375. One interval ahead (cold_start_s 30) that is 2.125 req/s, 2 replicas of 100
    # tokens/s for 50-token prompts; two (cold_start_s 60), 2.5 req/s, 3 replicas.
    assert (prefill_replicas(planner(), 2.125, 50), prefill_replicas(planner(), 2.5, 50)) == (2, 3)
    state = PoolPlanState(planned_at=0.0, rate_level=1.375, rate_trend=0.375, tokens_level=50.0)
    out = {}
    for cold_start_s in (0, 30, 60):
        policy = planner(cold_start_s=cold_start_s, forecast={"alpha": 0.5, "beta": 0.5})
        out[cold_start_s] = (policy.horizon_steps, plan_pool(policy, "prefill", BOUNDS["prefill"], PoolLoad(1.75, 50),
                                                             2, state, 30.0).reason)
    assert out == {0: (0.0, "hold: 2 (1.75 req/s x 50 tok, capacity x1)"),
                   30: (1.0, "hold: 2 (2.12 req/s x 50 tok, capacity x1)"),
                   60: (2.0, "up: 2 -> 3 (2.5 req/s x 50 tok, capacity x1)")}


def test_mode_planner_needs_a_planner_section(tmp_path):
    assert error_of(tmp_path, "mode: planner\nprefill: {max_replicas: 2}\n") == (
        "p.yaml: invalid autoscaling policy\n"
        "  mode = 'planner': no planner section; add one (deploy/autoscaling/planner.yaml) or set mode: reactive "
        "(allowed: reactive, planner)"
    )
    assert error_of(tmp_path, "mode: plan\nprefill: {max_replicas: 2}\n") == (
        "p.yaml: invalid autoscaling policy\n"
        "  mode = 'plan': Input should be 'reactive' or 'planner'"
    )


def test_planner_needs_both_pools(tmp_path):
    text = "prefill: {max_replicas: 2}\nplanner: {profiles: {prefill: {tokens_per_s: 100}, decode: {tpot_base_ms: 20, tpot_ms_per_seq: 20}}}\n"
    assert error_of(tmp_path, text) == (
        "p.yaml: invalid autoscaling policy\n"
        "  planner: needs a decode section too: their min_replicas and max_replicas bound the plan"
    )


def test_planner_field_errors_name_the_field(tmp_path):
    text = """
prefill: {max_replicas: 2}
decode: {max_replicas: 2, min_replicas: 2}
planner:
  interval_s: 0
  targets: {attainment: 1.0}
  forecast: {alpha: 0, gamma: 1}
  profiles: {prefill: {tokens_per_s: 100, cv: 1}, decode: {tpot_base_ms: 20}}
"""
    assert error_of(tmp_path, text) == (
        "p.yaml: invalid autoscaling policy\n"
        "  planner.interval_s = 0: Input should be greater than or equal to 1 (allowed: >= 1 and <= 3600)\n"
        "  planner.targets.attainment = 1.0: Input should be less than 1 (allowed: >= 0.5 and < 1)\n"
        "  planner.forecast.alpha = 0: Input should be greater than 0 (allowed: > 0 and <= 1)\n"
        "  planner.forecast.gamma = 1: unknown key; remove it or fix its spelling (allowed keys: alpha, beta, "
            "significance, recurrence)\n"
        "  planner.profiles.prefill.cv = 1: unknown key; remove it or fix its spelling (allowed keys: "
        "tokens_per_s, time_cv)\n"
        "  planner.profiles.decode.tpot_ms_per_seq: Field required (allowed: > 0 and <= 60000)"
    )


def test_planner_cross_field_errors(tmp_path):
    head = "prefill: {max_replicas: 2}\ndecode: {max_replicas: 4, min_replicas: 2}\n"
    profiles = "profiles: {prefill: {tokens_per_s: 100}, decode: {tpot_base_ms: 60, tpot_ms_per_seq: 50}}"
    assert error_of(tmp_path, head + f"planner: {{{profiles}}}\n") == (
        "p.yaml: invalid autoscaling policy\n"
        "  planner.targets.tpot_ms = 100.0: below one sequence's TPOT in the decode profile (110 ms = tpot_base_ms "
        "+ tpot_ms_per_seq): no batch meets it (allowed: >= 110)"
    )
    profiles = "profiles: {prefill: {tokens_per_s: 100}, decode: {tpot_base_ms: 20, tpot_ms_per_seq: 20}}"
    assert error_of(tmp_path, head + f"planner: {{{profiles}, ratio: {{min_prefill_per_decode: 2, max_prefill_per_decode: 1}}}}\n") == (
        "p.yaml: invalid autoscaling policy\n"
        "  planner.ratio.max_prefill_per_decode = 1.0: below min_prefill_per_decode = 2.0 (allowed: >= 2.0 and <= 64)"
    )
    assert error_of(tmp_path, head + f"planner: {{{profiles}, ratio: {{min_prefill_per_decode: 1.5}}}}\n") == (
        "p.yaml: invalid autoscaling policy\n"
        "  planner.ratio.min_prefill_per_decode = 1.5: needs 3 prefill replicas at decode.min_replicas = 2, above "
        "prefill.max_replicas = 2 (allowed: <= 1)"
    )


def test_reactive_files_stay_reactive():
    config = parse_policy({"prefill": {"max_replicas": 2}})
    assert (config.mode, config.planner) == ("reactive", None)


# ---- capacity at the targets -------------------------------------------------------------------
def test_prefill_replicas_by_erlang_c():
    # s = 50 / 100 = 0.5 s, a = 0.5, waiting budget 2 - 0.5 = 1.5 s, time_cv 1 (exponential):
    # c = 1: P(wait > 1.5) = 0.5 * exp(-0.5 / 0.5 * 1.5) = 0.1116 > 0.05
    # c = 2: Erlang C(2, 0.5) = 0.1, P = 0.1 * exp(-1.5 / 0.5 * 1.5) = 0.0011
    policy = planner()
    assert prefill_replicas(policy, 1.0, 50) == 2
    assert prefill_replicas(planner(targets={"ttft_ms": 2000, "tpot_ms": 100, "attainment": 0.85}), 1.0, 50) == 1
    assert prefill_replicas(policy, 0.0, 50) == 0
    # A queue of 4500 tokens drained within the 30 s interval: 3 more requests/s of 50 tokens.
    assert prefill_replicas(policy, 1.0, 50, queued_tokens=4500) == prefill_replicas(policy, 4.0, 50) == 3
    # Half the measured capacity: every prompt takes twice as long.
    assert prefill_replicas(policy, 1.0, 50, correction=0.5) == 3


def test_decode_replicas_by_the_batch_the_tokens_see():
    # 2 req/s x 50 tokens = 100 tokens/s; TPOT(n) = 20 + 20 n ms, so a batch of 4 meets 100 ms.
    # c = 2 cannot decode it (100 tokens/s x 20 ms / 2 = 1); at c = 3 the tokens see a batch of
    # 3.09 on average (sd 1.64): 3.09 + 1.645 x 1.64 = 5.79 > 4; at c = 4, 1.68 + 1.645 x 0.79 =
    # 2.98 <= 4. (Little's law at the mean batch planned 3: 6 streams, 2 per replica.)
    policy = planner()
    assert policy.max_batch() == 4.0
    assert decode_replicas(policy, 2.0, 50) == 4
    # Running sequences stay where their KV cache is: replicas added now serve only new arrivals,
    # so 17 running streams size nothing beyond the arrivals' plan (they keep one replica at least).
    assert decode_replicas(policy, 2.0, 50, num_seqs=17) == 4
    assert decode_replicas(policy, 0.0, 50) == 0
    assert decode_replicas(policy, 0.0, 50, num_seqs=3) == 1
    assert decode_replicas(policy, 0.0, 50, num_seqs=17) == 1


def test_decode_capacity_scales_with_the_measured_tokens_per_step():
    # With speculative decoding a step gives each sequence m tokens: a request of 50 tokens takes
    # 50 / m steps, and a step may take m x 100 ms, so a replica holds a batch of (100 m - 20) / 20.
    policy = planner()
    assert policy.max_batch(1 / 2) == 9.0
    assert [decode_replicas(policy, 2.0, 50, tokens_per_step=m) for m in (1.0, 1.5, 2.0, 3.0)] == [4, 3, 2, 1]
    # m = 2 is the steps of 1 req/s of 50 tokens at twice the target: the same 2 replicas.
    assert decode_replicas(policy, 1.0, 50) == 2
    # The decision changes with it, and says so.
    decisions = [plan_pool(policy, "decode", BOUNDS["decode"], PoolLoad(2.0, 50, tokens_per_step=m), 1, PoolPlanState(), 0.0)
                 for m in (1.0, 2.0)]
    assert [(d.num_replicas, d.reason) for d in decisions] == [
        (4, "up: 1 -> 4 (2 req/s x 50 tok, capacity x1)"),
        (2, "up: 1 -> 2 (2 req/s x 50 tok, capacity x1, 2 tok/step)"),
    ]


# ---- the joint plan ----------------------------------------------------------------------------
def run_plan(policy, steps):
    counts = {"prefill": 1, "decode": 1}
    states = {"prefill": PoolPlanState(), "decode": PoolPlanState()}
    out = []
    for now, prefill_rate, decode_rate in steps:
        loads = {"prefill": PoolLoad(prefill_rate, 50), "decode": PoolLoad(decode_rate, 10)}
        result = plan(policy, BOUNDS, loads, counts, states, now)
        counts, states = result.num_replicas, result.states
        out.append((counts["prefill"], counts["decode"], result.reason))
    return out


NO_SIGNIFICANCE = {"alpha": 1, "beta": 0, "significance": 0}  # every window as it is; a fall waits the delay


def test_joint_plan_ratio_bound_interval_and_hysteresis():
    out = run_plan(planner(forecast=NO_SIGNIFICANCE),
                   [(0, 1.0, 0.1), (10, 1.0, 0.1), (30, 0.2, 0.1), (60, 0.2, 0.1), (90, 0.2, 0.1)])
    assert out == [
        # Decode alone needs 1, though it plans for the prefill pool's 1 req/s (what reaches it next):
        # 2 prefill per decode replica is above max_prefill_per_decode 1.5, so decode is raised.
        (2, 2, "prefill up: 1 -> 2 (1 req/s x 50 tok, capacity x1); decode hold: 1 (1 req/s x 10 tok, capacity x1); "
               "ratio: decode 1 -> 2 (max_prefill_per_decode 1.5)"),
        (2, 2, "prefill hold: next plan in 20.0s; decode hold: next plan in 20.0s"),
        (2, 2, "prefill hold: 1 < 2 for 0s of downscale_delay_s 60 (0.2 req/s x 50 tok, capacity x1); "
               "decode hold: 1 < 2 for 0s of downscale_delay_s 60 (0.2 req/s x 10 tok, capacity x1)"),
        (2, 2, "prefill hold: 1 < 2 for 30s of downscale_delay_s 60 (0.2 req/s x 50 tok, capacity x1); "
               "decode hold: 1 < 2 for 30s of downscale_delay_s 60 (0.2 req/s x 10 tok, capacity x1)"),
        (1, 1, "prefill down: 2 -> 1 (0.2 req/s x 50 tok, capacity x1); decode down: 2 -> 1 (0.2 req/s x 10 tok, capacity x1)"),
    ]


def test_min_ratio_raises_prefill():
    policy = planner(ratio={"min_prefill_per_decode": 1, "max_prefill_per_decode": 4})
    counts = {"prefill": 1, "decode": 1}
    states = {"prefill": PoolPlanState(), "decode": PoolPlanState()}
    loads = {"prefill": PoolLoad(0.1, 50), "decode": PoolLoad(2.0, 50)}
    result = plan(policy, BOUNDS, loads, counts, states, 0.0)
    assert result.num_replicas == {"prefill": 4, "decode": 4}
    assert result.reason.endswith("ratio: prefill 1 -> 4 (min_prefill_per_decode 1)")


def test_a_dip_shorter_than_the_delay_moves_nothing_and_the_peak_is_held():
    # Prefill up to 3 at 4 req/s, then 0.2 req/s with one 1.2 req/s interval inside the delay: it
    # goes down to what that interval needed (2), not to 1; decode to 1, which the ratio raises.
    out = run_plan(planner(forecast=NO_SIGNIFICANCE), [(0, 4.0, 4.0), (30, 0.2, 0.2), (60, 1.2, 1.2), (90, 0.2, 0.2)])
    assert [(p, d) for p, d, _ in out] == [(3, 2), (3, 2), (3, 2), (2, 2)]
    assert out[2][2].startswith("prefill hold: 2 < 3 for 30s of downscale_delay_s 60")
    assert out[3][2] == (
        "prefill down: 3 -> 2 (0.2 req/s x 50 tok, capacity x1); decode down: 2 -> 1 (0.2 req/s x 10 tok, "
        "capacity x1); ratio: decode 1 -> 2 (max_prefill_per_decode 1.5)"
    )


def test_a_significant_fall_waits_one_interval_not_the_downscale_delay():
    # 1.0 -> 0.2 req/s over a 30-s window is (1.0 - 0.2) / sqrt(1.0 / 30) = 4.4 standard
    # deviations of its count below the level: the load went down. Prefill (1 replica at 0.2
    # req/s) goes down one interval after the fall's first plan, not downscale_delay_s (60 s) after.
    # Decode's own rate (0.1 req/s) did not fall: it waits the delay, and the ratio holds it at 1.
    out = run_plan(planner(), [(0, 1.0, 0.1), (30, 0.2, 0.1), (60, 0.2, 0.1)])
    assert out == [
        (2, 2, "prefill up: 1 -> 2 (1 req/s x 50 tok, capacity x1); decode hold: 1 (1 req/s x 10 tok, capacity x1); "
               "ratio: decode 1 -> 2 (max_prefill_per_decode 1.5)"),
        (2, 2, "prefill hold: 1 < 2 for 0s of one interval after a fall 30 (0.2 req/s x 50 tok, capacity x1); "
               "decode hold: 1 < 2 for 0s of downscale_delay_s 60 (0.2 req/s x 10 tok, capacity x1)"),
        (1, 2, "prefill down: 2 -> 1 (0.2 req/s x 50 tok, capacity x1); "
               "decode hold: 1 < 2 for 30s of downscale_delay_s 60 (0.2 req/s x 10 tok, capacity x1)"),
    ]
    # A dip that is not significant (1.0 -> 0.7: 1.6 standard deviations) waits the delay.
    out = run_plan(planner(), [(0, 1.0, 0.1), (30, 0.7, 0.1), (60, 0.7, 0.1)])
    assert out[1][2].startswith("prefill hold: 1 < 2 for 0s of downscale_delay_s 60")
    assert out[2][2].startswith("prefill hold: 1 < 2 for 30s of downscale_delay_s 60")


def test_the_dead_band_keeps_a_load_just_below_a_replica():
    # 1.0 req/s needs 2 prefill replicas, 0.7 req/s needs 1; grown by a 90% dead band (1.33
    # req/s), 0.7 still needs 2, so the pool does not shrink.
    assert (prefill_replicas(planner(), 0.7, 50), prefill_replicas(planner(), 1.33, 50)) == (1, 2)
    out = run_plan(planner(dead_band=0.9, downscale_delay_s=0), [(0, 1.0, 0.1), (30, 0.7, 0.1)])
    assert [(p, d) for p, d, _ in out] == [(2, 2), (2, 2)]
    out = run_plan(planner(downscale_delay_s=0), [(0, 1.0, 0.1), (30, 0.7, 0.1)])
    assert [(p, d) for p, d, _ in out] == [(2, 2), (1, 1)]


def test_a_window_that_counted_a_few_more_arrivals_is_noise_a_significant_rise_is_not():
    # Smoothed level 2.0 req/s over a 30-s window. 50-token prompts at 100 tokens/s: 2.0 and
    # 2.4 req/s need 2 prefill replicas, 2.5 and more need 3 (Erlang C, 0.95 within 2 s).
    policy = planner(forecast={"alpha": 0.5, "beta": 0, "significance": 2})
    assert [prefill_replicas(policy, r, 50) for r in (2.0, 2.4, 2.5, 2.8)] == [2, 2, 3, 3]
    level = plan_pool(policy, "prefill", BOUNDS["prefill"], PoolLoad(2.0, 50), 1, PoolPlanState(), 0.0)
    assert level.num_replicas == 2
    # A window of 2.5 req/s is (2.5 - 2.0) / sqrt(2.5 / 30) = 1.73 standard deviations of its
    # count above the level: noise. The level it moves (2.25) is planned for: still 2.
    noise = plan_pool(policy, "prefill", BOUNDS["prefill"], PoolLoad(2.5, 50), 2, level.state, 30.0)
    assert (noise.num_replicas, noise.reason) == (2, "hold: 2 (2.25 req/s x 50 tok, capacity x1)")
    # 2.8 req/s is 2.62 standard deviations above it: planned for at once.
    rise = plan_pool(policy, "prefill", BOUNDS["prefill"], PoolLoad(2.8, 50), 2, level.state, 30.0)
    assert (rise.num_replicas, rise.reason) == (3, "up: 2 -> 3 (2.8 req/s x 50 tok, capacity x1)")
    # The same between plans; significance 0 takes every window above the level (the old rule).
    assert plan_pool(policy, "prefill", BOUNDS["prefill"], PoolLoad(2.5, 50), 2, level.state, 10.0).num_replicas == 2
    assert plan_pool(policy, "prefill", BOUNDS["prefill"], PoolLoad(2.8, 50), 2, level.state, 10.0).num_replicas == 3
    eager = planner(forecast={"alpha": 0.5, "beta": 0, "significance": 0})
    assert plan_pool(eager, "prefill", BOUNDS["prefill"], PoolLoad(2.5, 50), 2, level.state, 10.0).num_replicas == 3


def test_a_burst_between_plans_scales_up_at_once():
    policy = planner()
    state = plan_pool(policy, "prefill", BOUNDS["prefill"], PoolLoad(1.0, 50), 1, PoolPlanState(), 0.0).state
    assert state.planned_at == 0.0
    # 10 s later the queue holds 6000 tokens: 4 more requests/s over the interval, 5 in all.
    result = plan_pool(policy, "prefill", BOUNDS["prefill"], PoolLoad(1.0, 50, backlog=6000.0), 2, state, 10.0)
    assert (result.num_replicas, result.reason) == (4, "up: 2 -> 4 (1 req/s x 50 tok, backlog 6000)")
    assert prefill_replicas(policy, 5.0, 50) == 4
    assert result.state.planned_at == 0.0  # the forecast waits for the next plan


def test_learning_corrects_the_profiles():
    policy = planner(profiles={**PROFILES, "learn": True, "learn_weight": 0.5})
    # The engines measure 50 tokens/s against the profile's 100: correction (1 + 0.5) / 2.
    prefill = plan_pool(policy, "prefill", BOUNDS["prefill"], PoolLoad(1.0, 50, measured_tokens_per_s=50.0), 1,
                        PoolPlanState(), 0.0)
    assert prefill.state.correction == 0.75
    # Two decode replicas made 40 tokens/s holding the mean streams the pool's law holds with a
    # step 1.6 times the profile's: TPOT x1.6, correction (1 + 1.6) / 2.
    held = stream_law(40.0, 2, 0.02 * 1.6, 0.02 * 1.6).mean
    load = PoolLoad(1.0, 10, measured_decode=((held / 2, 20.0), (held / 2, 20.0)))
    decode = plan_pool(policy, "decode", BOUNDS["decode"], load, 1, PoolPlanState(), 0.0)
    assert decode.state.correction == pytest.approx(1.3, rel=1e-9)
    assert policy.max_batch(1.3) == pytest.approx((100 / 1.3 - 20) / 20)
    # The engines' step account, where they keep one, comes first: 10 steps/s of 30 sequences/s
    # took 1.2 s/s where the profile (20 ms + 20 ms a sequence) gives 0.2 + 0.6: x1.5, (1 + 1.5) / 2.
    counted = replace(load, decode_steps=(10.0, 30.0, 1.2))
    decode = plan_pool(policy, "decode", BOUNDS["decode"], counted, 1, PoolPlanState(), 0.0)
    assert decode.state.correction == pytest.approx(1.25, rel=1e-12)


def test_missing_data_holds_both_pools():
    result = plan(planner(), BOUNDS, {"prefill": PoolLoad(1.0, 50), "decode": None}, {"prefill": 2, "decode": 3},
                  {"prefill": PoolPlanState(), "decode": PoolPlanState()}, 0.0)
    assert (result.num_replicas, result.reason) == ({"prefill": 2, "decode": 3}, "hold: no usable data from the decode pool")


def test_plan_state_round_trips_through_serve_policy_state():
    state = PoolPlanState(planned_at=30.0, rate_level=1.5, rate_trend=0.25, correction=1.1, below_since=0.0, peak_below=3)
    assert PoolPlanState.from_dict({**state.to_dict(), "serve.counter": 2}) == state
    assert PoolPlanState.from_dict({}) == PoolPlanState()


# ---- the forecast ------------------------------------------------------------------------------
def test_holt_on_a_known_series():
    holt = Holt()
    levels = []
    for value in (10, 12, 14, 16):
        holt = holt.update(value, alpha=0.5, beta=0.3)
        levels += [holt.level, holt.trend]
    # 10; 0.5*12 + 0.5*10 = 11, trend 0.3*1 = 0.3; 0.5*14 + 0.5*11.3 = 12.65, trend 0.3*1.65 + 0.7*0.3
    # = 0.705; 0.5*16 + 0.5*13.355 = 14.6775, trend 0.3*2.0275 + 0.7*0.705 = 1.10175.
    assert levels == pytest.approx([10, 0, 11, 0.3, 12.65, 0.705, 14.6775, 1.10175], rel=1e-12)
    assert holt.forecast() == pytest.approx(15.77925, rel=1e-12)
    assert holt.forecast(2) == pytest.approx(16.881, rel=1e-12)


def test_holt_without_trend_is_ewma_and_never_forecasts_below_zero():
    holt = Holt()
    for value in (10, 12, 14, 16):
        holt = holt.update(value, alpha=0.5, beta=0.0)
    assert (holt.level, holt.trend) == (14.25, 0.0)
    falling = Holt(1.0, -3.0)
    assert falling.forecast() == 0.0


def test_arrivals_are_counted_from_the_replicas_counters_through_scale_up_and_down():
    def look(state, now, totals):
        return count_arrivals(state, PoolLoad(99.0, 50, request_totals=totals), now, 30.0)

    rate, state = look(PoolPlanState(), 0.0, (("a", 10.0), ("b", 5.0)))
    assert (rate, state.counted) == (None, ((0.0, 0.0),))  # the first look is the baseline
    rate, state = look(state, 10.0, (("a", 14.0), ("b", 9.0)))
    assert rate == pytest.approx(8 / 10)
    # b stopped (its arrivals were counted at the last look); c started with 3.
    rate, state = look(state, 20.0, (("a", 20.0), ("c", 3.0)))
    assert (rate, state.seen) == (pytest.approx(17 / 20), (("a", 20.0), ("c", 3.0)))
    # 40 s: the window starts at 10 s, the point the count starts from; older ones are dropped.
    rate, state = look(state, 40.0, (("a", 26.0), ("c", 9.0)))
    assert (rate, state.counted) == (pytest.approx((29 - 8) / 30), ((10.0, 8.0), (20.0, 17.0), (40.0, 29.0)))
    rate, state = look(state, 50.0, (("a", 26.0), ("c", 9.0)))
    assert (rate, state.counted[0]) == (pytest.approx((29 - 17) / 30), (20.0, 17.0))
    # A pool whose replicas do not all report the counter: the summed rates, state unchanged.
    assert count_arrivals(state, PoolLoad(99.0, 50), 60.0, 30.0) == (None, state)
    # Serve's state round trip keeps the history.
    assert PoolPlanState.from_dict(state.to_dict()) == state


def test_a_recent_part_of_the_window_that_rose_twice_the_significance_is_read_at_its_own_rate():
    policy = planner(forecast={"alpha": 0.5, "beta": 0, "significance": 2})
    # 1 req/s, counters moving every 5 s (the looks at 1 s and 6 s saw no sample: not part ends),
    # then 30 arrivals in the last 5 s.
    counted = ((0.0, 0.0), (1.0, 0.0), (5.0, 5.0), (6.0, 5.0), (10.0, 10.0), (15.0, 15.0), (20.0, 20.0),
               (25.0, 25.0), (30.0, 55.0))
    state = PoolPlanState(counted=counted)
    bounds = PrefillPoolPolicy(max_replicas=8, window_s=30, metrics_interval_s=5)
    # The last 5 s: 6 req/s, above 1 + 2 x 2 x sqrt(6 / 5) = 5.38; the last 10 s: 3.5 above 3.37;
    # the last 15 s: 2.67, under 2.69. The highest is read; the whole window reads 55 / 30.
    assert recent_rise(policy, state, 1.0, bounds) == 6.0
    assert recent_rise(policy, state, 5.8, bounds) is None  # 6 req/s against a level of 5.8: noise
    assert recent_rise(policy, state, None, bounds) is None
    steady = replace(state, counted=counted[:-1] + ((30.0, 34.0),))  # 9 in the last 5 s: 1.8 req/s
    assert recent_rise(policy, steady, 1.0, bounds) is None
    assert recent_rise(planner(forecast={"alpha": 0.5, "beta": 0, "significance": 0}), state, 1.0, bounds) is None
    # With replicas reporting every 10 s, a 5-s part may hold 10 s of some replicas' arrivals: not read.
    # The 10-s part is (3.5 req/s, above 3.37).
    assert recent_rise(policy, state, 1.0, PrefillPoolPolicy(max_replicas=8, window_s=30, metrics_interval_s=10)) == 3.5


def test_a_surge_between_plans_is_planned_for_at_its_rate_since_it_began():
    policy = planner(forecast={"alpha": 0.5, "beta": 0, "significance": 2})

    def look(count, state, now, total):
        return plan_pool(policy, "prefill", BOUNDS["prefill"], PoolLoad(1.0, 50, request_totals=(("a", total),)),
                         count, state, now)

    result = look(1, PoolPlanState(), 0.0, 0.0)  # the counters baseline; the level, the windowed 1 req/s
    for now in range(5, 45, 5):  # 1 req/s; a plan at 30 s sets the level to it
        result = look(result.num_replicas, result.state, float(now), float(now))
    assert (result.num_replicas, result.state.rate_level) == (2, 1.0)
    # 30 arrivals in the 5 s to 45 s: the window reads 70 / 45 = 1.56 req/s (2 replicas), the
    # part since the surge began 6 req/s.
    assert prefill_replicas(policy, 70 / 45, 50) == 2
    result = look(result.num_replicas, result.state, 45.0, 70.0)
    assert (result.num_replicas, result.reason) == (
        prefill_replicas(policy, 6.0, 50), f"up: 2 -> {prefill_replicas(policy, 6.0, 50)} (6 req/s x 50 tok, backlog 0)")


def test_a_surge_whose_return_cannot_be_timed_keeps_its_replicas_the_delay_one_that_can_does_not():
    policy = planner(forecast={"alpha": 1, "beta": 0, "significance": 2, "recurrence": True}, cold_start_s=30)
    low, high = prefill_replicas(policy, 1.0, 50), prefill_replicas(policy, 5.0, 50)
    assert (low, high) == (2, 4)
    state, count, out = PoolPlanState(), 1, {}
    rates = {t: 5.0 if t in (150, 180, 450, 480) else 1.0 for t in range(0, 631, 30)}
    for now, rate in rates.items():
        count, state, reason, _ = plan_pool(policy, "prefill", BOUNDS["prefill"], PoolLoad(rate, 50), count, state, now)
        out[now] = (count, reason)
    assert out[150][0] == high and state.surges.onset_1 == 150 and state.surges.onset_2 == 450
    # The first surge: no gap known, so the fall at 210 waits downscale_delay_s (60 s).
    assert out[210] == (high, "hold: 2 < 4 for 0s of downscale_delay_s 60 (1 req/s x 50 tok, capacity x1)")
    assert [out[t][0] for t in (240, 270)] == [high, low]
    # The second came 300 s later: a gap known, the fall at 510 takes one interval.
    assert out[510] == (high, "hold: 2 < 4 for 0s of one interval after a fall 30 (1 req/s x 50 tok, capacity x1)")
    assert out[540][0] == low
    # The pre-warm for the third, expected at 750: from 750 - (30 + 30 + 30) = 660, not before.
    assert out[630][0] == low
    count, state, reason, _ = plan_pool(policy, "prefill", BOUNDS["prefill"], PoolLoad(1.0, 50), count, state, 660)
    assert (count, state.surges.warmed_for) == (high, 750)
