"""The simulator's workloads, the goodput search and crossover, and the replay of a measured
scenario: exact values on synthetic inputs."""

from __future__ import annotations

import pytest

from load_tests.pd.costs import CostFit, CostLine, HandoffCost, StepCost
from load_tests.pd.sweep import Cell, crossovers, goodput, search_splits, slos_for
from load_tests.pd.validate import METRICS, TOLERANCE, compare, compare_median, simulate_scenario
from load_tests.pd.workload import MIXES, Lengths, Mix, generate, scenario_requests

FIT = CostFit("test", StepCost((CostLine(2**-6, 2**-10, 2**-9),), 2**-20, 2**-16), HandoffCost(2**-7, 4, 2**12))


def test_a_mix_at_two_rates_holds_the_same_requests_at_scaled_times():
    slow = generate(MIXES["chat"], 50, 2.0, num_replicas=2)
    fast = generate(MIXES["chat"], 50, 4.0, num_replicas=2)
    assert [(r.prompt_tokens, r.output_tokens) for r in slow] == [(r.prompt_tokens, r.output_tokens) for r in fast]
    assert slow[0].arrival_s == 0.0
    assert all(f.arrival_s == s.arrival_s / 2 for s, f in zip(slow, fast))
    assert all(64 <= r.prompt_tokens <= 512 and 64 <= r.output_tokens <= 256 for r in slow)


def test_long_prompts_arrive_in_bursts_sized_to_the_pool():
    requests = generate(MIXES["chat-bursts"], 100, 2.0, num_replicas=4)
    long = [r for r in requests if r.kind == "long"]
    # 5 long prompts in bursts of ceil(0.5 * 4) = 2, one burst every 2 / (2.0 * 0.05) = 20 s
    assert len(long) == 5 and len(requests) == 100
    assert [r.arrival_s for r in long] == [10.0, 10.0, 30.0, 30.0, 30.0]
    assert all(1536 <= r.prompt_tokens <= 1920 and 32 <= r.output_tokens <= 64 for r in long)
    assert [r.request_id for r in requests] == list(range(100))


def test_mix_means_weigh_the_long_prompts_by_their_share():
    mix = Mix("m", Lengths(100, 300), Lengths(10, 30), long_share=0.25, long_prompt=Lengths(1000, 1000),
              long_output=Lengths(50, 50))
    assert mix.mean_prompt() == 0.75 * 200 + 0.25 * 1000
    assert mix.mean_output() == 0.75 * 20 + 0.25 * 50


def test_slos_scale_the_mixs_unloaded_prefill_and_decode_step():
    (tight_ttft, tight_tpot), (loose_ttft, loose_tpot) = slos_for(FIT, MIXES["long-output"], (("t", 2.0), ("l", 5.0))).values()
    # mean prompt 160 alone in one step; a decode row reading 160 + 640 / 2 tokens
    prefill = 2**-6 + 160 * 2**-10 + 2**-9 + (160 * 161 // 2) * 2**-20
    decode = 2**-6 + 2**-10 + 2**-9 + 480 * 2**-16
    assert (tight_ttft, tight_tpot) == (2.0 * prefill * 1e3, 2.0 * decode * 1e3)
    assert (loose_ttft, loose_tpot) == (5.0 * prefill * 1e3, 5.0 * decode * 1e3)


def test_goodput_is_the_highest_rate_meeting_the_attainment_by_bisection():
    calls = []

    def measure(rate: float, high: float) -> dict[str, float]:
        calls.append(rate)
        return {"a": 1.0 if rate <= 3.3 else 0.5, "b": 1.0 if rate <= 1.2 else 0.0}

    found = goodput(measure, ["a", "b"], target=0.9, high=2.0, steps=3)
    # the bracket's top (2) passes "a": it doubles to 4, which fails both; a: 2 and 3 pass, 3.5
    # fails; b: 2 (known) fails, 1 passes, 1.5 fails
    assert found == {"a": 3.0, "b": 1.0}
    assert calls == [2.0, 4.0, 3.0, 3.5, 1.0, 1.5]  # every rate once: the searches share them


def test_the_split_search_climbs_to_the_best_prefill_share():
    tried = []

    def evaluate(p: int) -> dict[str, float]:
        tried.append(p)
        return {"x": -float((p - 8) ** 2)}

    found = search_splits(evaluate, 16, 3, ["x"])
    assert max(found, key=lambda p: found[p]["x"]) == 8
    # 3 -> 4 -> 5 -> 6 -> 8 (x1.25 rounds 6 up to 8), each split run once
    assert sorted(tried) == [2, 3, 4, 5, 6, 8, 10] and len(tried) == len(set(tried))
    assert sorted(search_splits(evaluate, 4, 1, ["x"])) == [1, 2, 3]  # small pools: every split


def _cell(n: int, ratio: float, slo: str = "tight") -> Cell:
    return Cell("gpu", "chat", n, slo, 100.0, 40.0, 1.0, ratio, 1, {1: ratio})


def test_the_crossover_is_the_smallest_pool_where_disaggregated_wins():
    cells = [_cell(2, 0.8), _cell(8, 1.1), _cell(32, 1.5), _cell(2, 1.0, "loose"), _cell(8, 1.2, "loose"),
             _cell(32, 0.95, "loose")]
    (loose, tight) = crossovers(cells)
    assert (tight["slo"], tight["crossover_replicas"], tight["holds_above"]) == ("tight", 8, True)
    # a tie (within the search's resolution) is not a win; a win that does not last is flagged
    assert (loose["crossover_replicas"], loose["holds_above"]) == (8, False)
    assert tight["ratio_by_size"] == {"2": 0.8, "8": 1.1, "32": 1.5}
    assert crossovers([_cell(2, 0.5)])[0]["crossover_replicas"] is None


def _record(i: int, kind: str, at: float, prompt: int, output: int) -> dict:
    return {"request_id": i, "kind": kind, "scheduled_s": at, "num_prompt_tokens": prompt,
            "num_output_tokens": output, "is_success": True}


def _report() -> dict:
    steady = [_record(0, "random", 0.0, 64, 4), _record(1, "random", 0.5, 64, 4)]
    burst = [_record(0, "chat", 0.0, 64, 4), _record(2, "long", 0.2, 600, 2), _record(1, "chat", 0.5, 64, 4)]
    runs = {f"{mode}/{run}": {"records": records} for mode in ("disaggregated", "colocated")
            for run, records in (("steady", steady), ("burst", burst))}
    return {"raw": {"runs": runs}, "summary": {"slo": {"ttft_ms": 2000.0, "tpot_ms": 100.0}}}


def test_a_scenario_run_is_replayed_request_for_request():
    requests = scenario_requests(_report(), "colocated/burst")
    assert [(r.request_id, r.arrival_s, r.prompt_tokens, r.output_tokens, r.kind) for r in requests] == [
        (0, 0.0, 64, 4, "chat"), (2, 0.2, 600, 2, "long"), (1, 0.5, 64, 4, "chat")]


def test_the_replayed_scenario_is_summarised_as_the_scenario_summarises_itself():
    simulated = simulate_scenario(_report(), FIT)
    disagg = simulated["modes"]["disaggregated"]
    assert disagg["num_requests_burst"] == 3
    assert set(disagg) >= {"chat_ttft_ms_steady", "chat_tpot_ms_burst", "long_ttft_ms_burst", "goodput_burst"}
    assert simulated["tpot_p99_burst_ratio_coloc"] == pytest.approx(
        simulated["modes"]["colocated"]["chat_tpot_ms_burst"]["p99"] / simulated["modes"]["colocated"]["chat_tpot_ms_steady"]["p99"])


def test_compare_reports_each_figures_relative_error():
    measured = {"modes": {m: {"chat_ttft_ms_steady": {"p50": 100.0, "p95": 200.0}} for m in ("disaggregated", "colocated")},
                "goodput_ratio_disagg_vs_coloc": 2.0}
    simulated = {"modes": {m: {"chat_ttft_ms_steady": {"p50": 110.0, "p95": 260.0}} for m in ("disaggregated", "colocated")},
                 "goodput_ratio_disagg_vs_coloc": 1.5}
    rows = compare(measured, simulated, metrics=METRICS[:2])
    by = {(r["metric"], r["mode"]): r for r in rows}
    assert by[("chat TTFT p50 steady, ms", "colocated")]["error"] == pytest.approx(0.1)
    assert by[("chat TTFT p95 steady, ms", "colocated")]["within"] is False
    assert by[("goodput_ratio_disagg_vs_coloc", None)]["error"] == pytest.approx(-0.25)
    assert by[("tpot_p99_burst_ratio_disagg", None)]["error"] is None  # not measured
    assert TOLERANCE == 0.15


def test_compare_median_judges_each_figures_median_with_the_measured_spread():
    def summary(p50: float, ratio: float) -> dict:
        return {"modes": {m: {"chat_ttft_ms_steady": {"p50": p50, "p95": 2 * p50}} for m in ("disaggregated", "colocated")},
                "goodput_ratio_disagg_vs_coloc": ratio}

    measured = [summary(100.0, 2.0), summary(300.0, 1.0), summary(120.0, 1.5)]
    simulated = [summary(110.0, 1.0), summary(130.0, 1.0), summary(90.0, 1.0)]
    rows = compare_median(measured, simulated, metrics=METRICS[:2])
    by = {(r["metric"], r["mode"]): r for r in rows}
    p50 = by[("chat TTFT p50 steady, ms", "colocated")]
    # medians 120 measured, 110 simulated; spread (300 - 100) / 120
    assert (p50["measured"], p50["simulated"], p50["measured_values"]) == (120.0, 110.0, [100.0, 300.0, 120.0])
    assert p50["error"] == pytest.approx(110 / 120 - 1) and p50["within"] is True
    assert p50["spread"] == pytest.approx(200 / 120)
    ratio = by[("goodput_ratio_disagg_vs_coloc", None)]
    assert (ratio["measured"], ratio["simulated"], ratio["error"], ratio["within"]) == (1.5, 1.0, pytest.approx(-1 / 3), False)
    assert by[("tpot_p99_burst_ratio_disagg", None)]["measured"] is None  # not measured: no median, no spread
    assert by[("tpot_p99_burst_ratio_disagg", None)]["spread"] is None
