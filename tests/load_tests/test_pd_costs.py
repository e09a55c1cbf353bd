"""The simulator's cost models: the least-squares fit on synthetic steps, the published GPU fit
against the formulas it comes from, the JSON round trip, the probe's step shapes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from load_tests.pd_costs import (
    DISTSERVE_OPT13B_A100,
    CostFit,
    CostLine,
    HandoffCost,
    ServeOverhead,
    StepCost,
    StepPoint,
    StepShape,
    chunk_pairs,
    fit_step_cost,
    gpu_fit,
)
from load_tests.pd_probe import serve_overhead_parts, step_shape
from load_tests.pd_served_probe import cpu_delta, fit_overhead, serving_cpu_per_token

SHAPES = [StepShape(t, r, p, c) for t, r, p, c in [
    (1, 1, 0, 100), (4, 4, 0, 800), (16, 16, 0, 4000), (64, 1, 2080, 0), (256, 1, 32896, 0), (256, 0, 98432, 0),
    (260, 4, 32896, 600), (512, 2, 65792, 0), (2, 2, 0, 4100), (300, 3, 40000, 300),
]]


def test_chunk_pairs_count_each_new_token_reading_the_cached_ones_and_those_before_it():
    assert chunk_pairs(1, 0) == 1
    assert chunk_pairs(3, 0) == 6  # 1 + 2 + 3
    assert chunk_pairs(2, 10) == 23  # 11 + 12


def test_the_fit_recovers_the_coefficients_of_synthetic_steps():
    truth = StepCost((CostLine(0.012, 0.0011, 0.0002),), pair_s=1e-6, context_s=5e-6)
    points = [StepPoint(shape, truth.shape_s(shape)) for shape in SHAPES]
    fitted, quality = fit_step_cost(points)
    (line,) = fitted.lines
    assert line.base_s == pytest.approx(0.012, rel=1e-9)
    assert line.token_s == pytest.approx(0.0011, rel=1e-9)
    assert line.row_s == pytest.approx(0.0002, rel=1e-9)
    assert fitted.pair_s == pytest.approx(1e-6, rel=1e-9)
    assert fitted.context_s == pytest.approx(5e-6, rel=1e-9)
    assert quality["num_points"] == 10 and quality["max_rel_error"] < 1e-9


def test_the_fit_keeps_every_coefficient_non_negative():
    # times that a free fit would explain with a negative row cost
    truth = StepCost((CostLine(0.01, 0.001, 0.0),), context_s=1e-5)
    points = [StepPoint(shape, truth.shape_s(shape) - 0.0004 * shape.num_rows) for shape in SHAPES]
    fitted, _ = fit_step_cost(points)
    (line,) = fitted.lines
    assert min(line.base_s, line.token_s, line.row_s, fitted.pair_s, fitted.context_s) >= 0.0
    with pytest.raises(ValueError, match="at least 5 steps"):
        fit_step_cost(points[:4])


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
    fit = CostFit("cpu", StepCost((CostLine(0.01, 0.001, 0.0001), CostLine(0.02)), 1e-6, 2e-6),
                  HandoffCost(0.001, 23040, 3e9), ServeOverhead(0.04, 0.0, 0.0006, 0.05, 0.0, 0.0, 0.003, 0.004),
                  kv_capacity_tokens=1000, source="here", assumptions=("one",), info={"x": 1})
    assert CostFit.from_json(fit.to_json()) == fit


def _seq(computed: int, prompt: int):
    return SimpleNamespace(num_computed_tokens=computed, num_prompt_tokens=prompt)


def test_the_probe_reads_a_steps_shape_from_the_scheduler_output():
    scheduled = [(_seq(10, 5), 1), (_seq(40, 20), 1), (_seq(0, 300), 256), (_seq(0, 50), 50)]
    # two decoding rows (reading 11 and 41 tokens), a long prompt's first chunk (no sample), a whole prompt
    assert step_shape(scheduled) == StepShape(1 + 1 + 256 + 50, 3, chunk_pairs(256, 0) + chunk_pairs(50, 0), 11 + 41)
    assert step_shape([(_seq(256, 300), 44)]) == StepShape(44, 1, chunk_pairs(44, 256), 0)


def test_serve_overhead_parts_reads_a_serve_overhead_report():
    report = {"config": {"params": {"kv_tokens": 1024}}, "summary": {
        "added_ttft_ms_p50": 48.0, "added_ttft_ms_p50_colocated": 40.0, "added_tpot_ms_p50": 0.01,
        "added_tpot_ms_p50_colocated": -0.2, "kv_transfer_ms_p50": 8.0, "kv_transfer_bytes": 1024 * 23040}}
    request, handoff, info = serve_overhead_parts(report)
    assert request == {"colocated_request_s": 0.04, "disaggregated_request_s": 0.048}
    assert handoff == HandoffCost(0.0, 23040, 1024 * 23040 / 0.008)
    assert handoff.seconds(512) == pytest.approx(0.004)
    assert info["kv_tokens"] == 1024


def test_the_served_overhead_is_fitted_over_the_streams():
    measured = {1: {"tpot_s": 0.013, "context": 100}, 2: {"tpot_s": 0.016, "context": 100},
                4: {"tpot_s": 0.022, "context": 100}, 8: {"tpot_s": 0.034, "context": 100}}
    # the engine alone: 10 ms + 1 ms a row; served: 2 ms a step more and 1 ms a row more
    step_s, row_s, points = fit_overhead(measured, lambda k, context: 0.010 + 0.001 * k)
    assert step_s == pytest.approx(0.002) and row_s == pytest.approx(0.001)
    assert [p["streams"] for p in points] == [1, 2, 4, 8]
    # a served path faster than the engine alone adds nothing
    assert fit_overhead({1: {"tpot_s": 0.009, "context": 1}}, lambda k, c: 0.010) == (0.0, 0.0, [
        {"streams": 1, "served_s": 0.009, "engine_s": 0.010}])


def test_the_serving_cpu_is_what_the_non_engine_processes_used_per_token():
    before = {1: ("Worker", 10.0), 2: ("OpenAIIngress", 1.0), 3: ("ProxyActor", 2.0)}
    after = {1: ("Worker", 13.0), 2: ("OpenAIIngress", 1.5), 3: ("ProxyActor", 2.25), 4: ("client", 0.25)}
    assert cpu_delta(before, after) == {"Worker": 3.0, "OpenAIIngress": 0.5, "ProxyActor": 0.25, "client": 0.25}
    measured = {1: {"num_tokens": 64, "cpu_s": {"Worker": 3.0, "OpenAIIngress": 0.5, "ProxyActor": 0.25}},
                2: {"num_tokens": 192, "cpu_s": {"DecodeWorker": 5.0, "client": 0.25, "PrefillWorker": 1.0}}}
    assert serving_cpu_per_token(measured) == 1.0 / 256
