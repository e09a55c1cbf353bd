"""The simulator's cost models: the least-squares fit on synthetic steps, the published GPU fit
against the formulas it comes from, the JSON round trip, the probe's step shapes."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from load_tests.pd.costs import (
    DISTSERVE_OPT13B_A100,
    CostFit,
    CostLine,
    HandoffCost,
    LayoutOverhead,
    ServeOverhead,
    StepCost,
    StepPoint,
    StepShape,
    chunk_pairs,
    fit_step_cost,
    gpu_fit,
)
from load_tests.pd.probe import cpu_fit, handoff_of, overhead_of, step_shape
from load_tests.pd.served_probe import actor_of, cpu_delta, fit_overhead, mend_actor_names, prefill_replica_s, request_overhead_s, serving_cpu
from load_tests.pd.sim import SimRequest, simulate

SHAPES = [StepShape(t, r, p, c, k) for t, r, p, c, k in [
    (1, 1, 0, 100, 0), (4, 4, 0, 800, 0), (16, 16, 0, 4000, 0), (64, 1, 2080, 0, 0), (256, 1, 32896, 0, 0),
    (256, 0, 98432, 0, 256), (260, 4, 32896, 600, 0), (512, 2, 65792, 0, 0), (2, 2, 0, 4100, 0),
    (300, 3, 40000, 300, 0), (30, 1, chunk_pairs(30, 3840), 0, 3840), (34, 5, chunk_pairs(30, 3840), 580, 3840),
]]


def test_chunk_pairs_count_each_new_token_reading_the_cached_ones_and_those_before_it():
    assert chunk_pairs(1, 0) == 1
    assert chunk_pairs(3, 0) == 6  # 1 + 2 + 3
    assert chunk_pairs(2, 10) == 23  # 11 + 12


def test_the_fit_recovers_the_coefficients_of_synthetic_steps():
    truth = StepCost((CostLine(0.012, 0.0011, 0.0002),), pair_s=1e-6, context_s=5e-6, prefix_s=1.3e-5)
    points = [StepPoint(shape, truth.shape_s(shape)) for shape in SHAPES]
    fitted, quality = fit_step_cost(points)
    (line,) = fitted.lines
    assert line.base_s == pytest.approx(0.012, rel=1e-9)
    assert line.token_s == pytest.approx(0.0011, rel=1e-9)
    assert line.row_s == pytest.approx(0.0002, rel=1e-9)
    assert fitted.pair_s == pytest.approx(1e-6, rel=1e-9)
    assert fitted.context_s == pytest.approx(5e-6, rel=1e-9)
    assert fitted.prefix_s == pytest.approx(1.3e-5, rel=1e-9)
    assert quality["num_points"] == 12 and quality["max_rel_error"] < 1e-9


def test_a_short_chunk_after_a_long_prompt_pays_for_the_prefix_whole():
    cost = StepCost((CostLine(0.02, 0.0003),), pair_s=4e-7, prefix_s=1.3e-5)
    # 30 tokens after 3,840: 0.02 + 30 * 0.0003 + (30 * 3840 + 465) * 4e-7 + 3840 * 1.3e-5
    assert cost.step_s(30, 1, chunk_pairs(30, 3840), 0, 3840) == pytest.approx(0.02 + 0.009 + 115665 * 4e-7 + 0.04992, rel=1e-12)


def test_the_fit_keeps_every_coefficient_non_negative():
    # times that a free fit would explain with a negative row cost
    truth = StepCost((CostLine(0.01, 0.001, 0.0),), context_s=1e-5)
    points = [StepPoint(shape, truth.shape_s(shape) - 0.0004 * shape.num_rows) for shape in SHAPES]
    fitted, _ = fit_step_cost(points)
    (line,) = fitted.lines
    assert min(line.base_s, line.token_s, line.row_s, fitted.pair_s, fitted.context_s, fitted.prefix_s) >= 0.0
    with pytest.raises(ValueError, match="at least 6 steps"):
        fit_step_cost(points[:5])


def test_the_gpu_fit_reproduces_distserves_published_formulas():
    fit = gpu_fit()
    a, b, c = DISTSERVE_OPT13B_A100["prefill"]
    for tokens in (128, 512, 1536):  # a whole prompt alone: DistServe's prefill fit, in ms
        assert fit.step.prefill_s(tokens) * 1e3 == pytest.approx(a + b * tokens + c * tokens**2, rel=1e-12)
    a, ctx, per_row = DISTSERVE_OPT13B_A100["decoding_smallbs"]
    assert fit.step.decode_s(8, 500) * 1e3 == pytest.approx(a + ctx * 8 * 500 + per_row * 8, rel=1e-12)
    a_large, _, per_row_large = DISTSERVE_OPT13B_A100["decoding_largebs"]
    # a large batch: the large-batch line's per-row cost, the small-batch fit's context cost
    assert fit.step.decode_s(256, 500) * 1e3 == pytest.approx(a_large + per_row_large * 256 + ctx * 256 * 500, rel=1e-12)
    # Vidur: 2 KiB in 0.024 ms, 64 MiB in 8.586 ms between A100 nodes
    assert fit.handoff.seconds(0) == pytest.approx(0.024e-3)
    assert fit.handoff.bytes_per_token == 819_200
    assert fit.handoff.seconds(1000) == pytest.approx(0.024e-3 + 819_200_000 * 8.562e-3 / (67108864 - 2048), rel=1e-12)
    assert fit.overhead == ServeOverhead()


def test_a_fit_survives_its_json():
    fit = CostFit("cpu", StepCost((CostLine(0.01, 0.001, 0.0001), CostLine(0.02)), 1e-6, 2e-6, 3e-6),
                  HandoffCost(0.001, 23040, 3e9),
                  ServeOverhead(LayoutOverhead(0.04, 0.0, 0.0006, 0.02, 0.003, 0.1), LayoutOverhead(0.05, 0.001)),
                  kv_capacity_tokens=1000, corun_s=0.004, corun_ref_s=0.019, source="here", assumptions=("one",), info={"x": 1})
    assert CostFit.from_json(fit.to_json()) == fit
    older = fit.to_json()  # a fit written before the prefix term and the co-run probe
    del older["step"]["prefix_s"], older["corun_s"], older["corun_ref_s"]
    assert CostFit.from_json(older).step.prefix_s == 0.0
    assert (CostFit.from_json(older).corun_s, CostFit.from_json(older).corun_ref_s) == (0.0, 0.02)


def _seq(computed: int, prompt: int):
    return SimpleNamespace(num_computed_tokens=computed, num_prompt_tokens=prompt)


def test_the_probe_reads_a_steps_shape_from_the_scheduler_output():
    scheduled = [(_seq(10, 5), 1), (_seq(40, 20), 1), (_seq(0, 300), 256), (_seq(0, 50), 50)]
    # two decoding rows (reading 11 and 41 tokens), a long prompt's first chunk (no sample), a whole prompt
    assert step_shape(scheduled) == StepShape(1 + 1 + 256 + 50, 3, chunk_pairs(256, 0) + chunk_pairs(50, 0), 11 + 41, 0)
    assert step_shape([(_seq(256, 300), 44)]) == StepShape(44, 1, chunk_pairs(44, 256), 0, 256)
    # two chunks after prefixes of 3,840 and 512, beside a decoding row reading 20 tokens
    assert step_shape([(_seq(3840, 3870), 30), (_seq(512, 2000), 256), (_seq(20, 8), 1)]) == StepShape(
        287, 2, chunk_pairs(30, 3840) + chunk_pairs(256, 512), 21, 3840 + 512)


def test_the_hand_off_comes_from_a_serve_overhead_report():
    report = {"config": {"params": {"kv_tokens": 1024}},
              "summary": {"kv_transfer_ms_p50": 8.0, "kv_transfer_bytes": 1024 * 23040}}
    handoff, info = handoff_of(report)
    assert handoff == HandoffCost(0.0, 23040, 1024 * 23040 / 0.008)
    assert handoff.seconds(512) == pytest.approx(0.004)
    assert info["kv_tokens"] == 1024


def _round(streams: int, output_tokens: int, tpot_s: float, *, wall_s: float = 1.0, serving_cpu_s: float = 0.0,
           ttft_s: float = 0.1, prompt: int = 100) -> dict:
    return {"streams": streams, "output_tokens": output_tokens, "wall_s": wall_s, "serving_cpu_s": serving_cpu_s,
            "tpot_s": [tpot_s] * streams, "ttft_s": [ttft_s] * streams, "prompt_tokens": [prompt] * streams}


def test_the_served_step_overhead_is_fitted_over_the_streams():
    # the engine alone: 10 ms + 1 ms a row; served: 2 ms a step more and 1 ms a row more
    layout = {"rounds": [_round(k, 64, 0.012 + 0.002 * k) for k in (1, 2, 4, 8)] + [_round(4, 8, 1.0)]}
    step_s, row_s, points = fit_overhead(layout, lambda prompts, tokens: [0.010 + 0.001 * len(prompts)] * len(prompts))
    assert step_s == pytest.approx(0.002) and row_s == pytest.approx(0.001)
    assert [p["streams"] for p in points] == [1, 2, 4, 8]  # the 8-token rounds are for the CPU fit
    # a served path faster than the engine alone adds nothing
    assert fit_overhead({"rounds": [_round(1, 64, 0.009)]}, lambda prompts, tokens: [0.010])[:2] == (0.0, 0.0)


def test_the_served_step_overhead_leaves_out_the_engines_own_prefill_interference():
    """k prompts at once through one worker: the first ones decode beside the later ones' prefill
    chunks, which the replay has too. Served = the replay + 2 ms a token: the fit finds 2 ms a
    step and nothing a row, where k rows' bare decode step would have put the interference in."""
    fit = CostFit("test", StepCost((CostLine(2**-7, 2**-10, 2**-10),), pair_s=2**-20, context_s=2**-16), HandoffCost(2**-8, 4, 2**20),
                  max_num_batched_tokens=512, long_prefill_token_threshold=256)
    prompt = 200
    rounds = []
    for k in (1, 2, 4, 8):
        replay = simulate([SimRequest(i, 0.0, prompt, 64) for i in range(k)], fit, "colocated", num_decode=1, spare_cores=1)
        served = [r.tpot_s + 0.002 for r in replay.results]
        rounds.append({**_round(k, 64, 0.0, prompt=prompt), "tpot_s": served, "rate": None})
    probe = {"colocated": {"idle": {"wall_s": 4.0, "serving_cpu_s": 0.0, "cpu_s": {}}, "rounds": rounds}}
    overhead, info = overhead_of(probe, fit)
    assert overhead.colocated.step_s == pytest.approx(0.002) and overhead.colocated.row_s == pytest.approx(0.0, abs=1e-12)
    # eight at once decode far slower than eight rows alone: the prompts' chunks shared their steps
    eight = info["colocated"]["tpot_points"][-1]
    assert eight["engine_s"] > fit.step.decode_s(8, prompt + 32) + 0.004


def test_the_request_overhead_is_the_one_stream_ttft_beyond_the_prefill():
    layout = {"rounds": [_round(1, 64, 0.01, ttft_s=0.35, prompt=200), _round(1, 64, 0.01, ttft_s=0.33, prompt=200),
                         _round(4, 64, 0.01, ttft_s=9.0)]}
    assert request_overhead_s(layout, lambda tokens: tokens * 0.0015) == pytest.approx(0.04)


def test_the_serving_cpu_is_split_into_per_second_per_request_and_per_token():
    # 0.1 CPU-s a second, 20 ms a request, 2 ms a token
    def cpu(wall: float, k: int, tokens: int) -> float:
        return 0.1 * wall + 0.02 * k + 0.002 * k * tokens

    rounds = [_round(k, o, 0.01, wall_s=w, serving_cpu_s=cpu(w, k, o)) for k, o, w in
              [(1, 64, 1.0), (4, 64, 1.6), (8, 64, 2.5), (4, 8, 0.5), (8, 8, 0.6)]]
    layout = {"idle": {"wall_s": 4.0, "serving_cpu_s": 0.4}, "rounds": rounds}
    per_request, per_token, per_second = serving_cpu(layout)
    assert (per_request, per_token, per_second) == (pytest.approx(0.02), pytest.approx(0.002), pytest.approx(0.1))


def test_cpu_deltas_are_taken_per_process():
    before = {1: ("Worker", 10.0), 2: ("OpenAIIngress", 1.0), 3: ("ProxyActor", 2.0)}
    after = {1: ("Worker", 13.0), 2: ("OpenAIIngress", 1.5), 3: ("ProxyActor", 2.25), 4: ("client", 0.25)}
    assert cpu_delta(before, after) == {"Worker": 3.0, "OpenAIIngress": 0.5, "ProxyActor": 0.25, "client": 0.25}


def test_a_replica_caught_running_a_method_is_still_that_replica():
    assert actor_of("ray::ServeReplica:kvrelay-pd-probe-disaggregated:DecodeWorker.record_routing_stats") == "DecodeWorker"
    assert actor_of("ray::ServeReplica:kvrelay-pd-probe-disaggregated:DecodeWorker") == "DecodeWorker"
    assert actor_of("ray::ServeController.listen_for_change") == "ServeController"
    assert actor_of("ray::KVTransfer") == "KVTransfer"


def test_an_earlier_probes_misnamed_replica_cpu_is_taken_out_of_the_serving_cpu():
    # the 2026-12-03 round: the decode replica caught in record_routing_stats, counted as serving work
    round_ = {**_round(8, 64, 0.03), "serving_cpu_s": 4.81,
              "cpu_s": {"DecodeWorker.record_routing_stats": 3.23, "OpenAIIngress": 0.61, "PrefillWorker": 1.93,
                        "ServeController.listen_for_change": 0.26, "ProxyActor": 0.41, "client": 0.31}}
    idle = {"wall_s": 4.0, "serving_cpu_s": 0.5, "cpu_s": {"DecodeWorker": 0.1, "ServeController.listen_for_change": 0.2}}
    mended = mend_actor_names({"disaggregated": {"idle": idle, "rounds": [round_]}})["disaggregated"]
    assert mended["rounds"][0]["serving_cpu_s"] == pytest.approx(1.58)
    assert mended["rounds"][0]["cpu_s"] == {"DecodeWorker": 3.23, "OpenAIIngress": 0.61, "PrefillWorker": 1.93,
                                            "ServeController": 0.26, "ProxyActor": 0.41, "client": 0.31}
    assert mended["idle"]["serving_cpu_s"] == 0.5  # the controller's method is the controller's: serving work still
    assert mend_actor_names({"disaggregated": mended}) == {"disaggregated": mended}  # a mended or new probe stays as it is


def _step_terms(step) -> list[float]:
    return [x for line in step.lines for x in (line.base_s, line.token_s, line.row_s)] + [step.pair_s, step.context_s, step.prefix_s]


def test_a_refit_of_the_2026_12_03_probe_takes_the_decode_replica_out_of_the_serving_cpu():
    """The stored probe (docs/benchmarks), fitted again without a model or a probe: the steps fit
    as stored, the disaggregated serving CPU as it is once the 8 x 64 round's decode replica,
    caught in record_routing_stats, is its own again."""
    docs = Path(__file__).parents[2] / "docs" / "benchmarks"
    stored = json.loads((docs / "pd-sim-cpu-fit-2026-12-03.json").read_text())["config"]["fits"]["cpu"]
    serve_overhead = json.loads((docs / "serve-overhead-2026-12-03.json").read_text())
    fit = cpu_fit(Path("/nonexistent"), "bfloat16", serve_overhead, earlier=stored)
    # The same fit to the last few bits: a least-squares solve sums in the order its BLAS picks, which
    # moved base_s from ...96 to ...101 (e-17) on one machine.
    assert _step_terms(fit.step) == pytest.approx(_step_terms(CostFit.from_json(stored).step), rel=1e-9, abs=1e-15)
    assert fit.kv_capacity_tokens == stored["kv_capacity_tokens"]
    rounds = fit.info["served_probe"]["disaggregated"]["rounds"]
    assert not [name for r in rounds for name in r["cpu_s"] if "." in name]
    before = stored["overhead"]["disaggregated"]
    after = fit.overhead.disaggregated
    assert after.cpu_per_request_s < 0.5 * before["cpu_per_request_s"]  # 72.9 ms -> 35.4 ms
    assert after.cpu_per_token_s < before["cpu_per_token_s"]  # 2.78 ms -> 1.09 ms
    # the colocated probe had no replica caught in a method (only the controller, serving work either way)
    assert fit.overhead.colocated.cpu_per_token_s == pytest.approx(stored["overhead"]["colocated"]["cpu_per_token_s"], rel=1e-9)


def test_the_prefill_replicas_own_cpu_per_request_comes_from_the_poisson_rounds():
    # idle: 0.25 CPU-s in 5 s (0.05 cores); engine: 1 ms a prompt token
    def stream(k: int, wall: float, cpu: float) -> dict:
        return {**_round(k, 64, 0.01, wall_s=wall, prompt=100), "rate": 1.2, "cpu_s": {"PrefillWorker": cpu}}

    # 10 requests in 8 s: 0.4 idle + 1.0 engine + 0.125 own; 6 in 4 s: 0.2 + 0.6 + 0.075 (12.5 ms each)
    layout = {"idle": {"wall_s": 5.0, "cpu_s": {"PrefillWorker": 0.25}},
              "rounds": [stream(10, 8.0, 1.525), stream(6, 4.0, 0.875), {**_round(4, 64, 0.01), "rate": None,
                                                                          "cpu_s": {"PrefillWorker": 9.0}}]}
    assert prefill_replica_s(layout, lambda tokens: 0.001 * tokens) == pytest.approx(0.0125)
    # a replica that needs less than its engine's prefill adds nothing; a colocated layout has none
    assert prefill_replica_s(layout, lambda tokens: 0.01 * tokens) == 0.0
    colocated = {"idle": {"wall_s": 5.0, "cpu_s": {"Worker": 0.25}}, "rounds": [{**stream(10, 8.0, 1.0), "cpu_s": {"Worker": 2.0}}]}
    assert prefill_replica_s(colocated, lambda tokens: 0.001 * tokens) == 0.0
