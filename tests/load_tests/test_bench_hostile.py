"""`kvrelay bench hostile`'s pure parts: the summary's figures and verdict, the table, the presets."""

from __future__ import annotations

from collections import Counter

import pytest

from load_tests.hostile.bench import FULL, QUICK, CaseResult, format_table, params_from_args, summarize
from serving.cli.parser import build_parser


def test_summary_ratio_and_unexpected_answers():
    cases = [
        CaseResult("nested", 400, Counter({400: 5}), [0.01] * 5),
        CaseResult("model", 404, Counter({404: 3, 500: 1}), [0.02] * 4, num_errors=2),
    ]
    s = summarize([0.10, 0.12, 0.11], [0.20, 0.30, 0.22], cases)
    assert s["ttft_ms_p50_idle"] == pytest.approx(110.0)
    assert s["ttft_ms_p50_hostile"] == pytest.approx(220.0)
    assert s["ttft_ratio_p50"] == pytest.approx(2.0)
    assert s["targets"]["ttft_ratio_p50"] == {"target": "<= 2x", "met": True}
    assert (s["num_hostile_requests"], s["num_hostile_unexpected"]) == (11, 3)
    assert summarize([0.1], [0.21], [])["targets"]["ttft_ratio_p50"]["met"] is False


def test_table_names_each_case_and_the_verdict():
    cases = [CaseResult("nested", 400, Counter({400: 2}), [0.01, 0.03])]
    s = summarize([0.1], [0.15], cases)
    table = format_table(FULL, cases, s, {"cpu_model": "AMD EPYC", "isa": {"avx2": True, "amx_bf16": False}, "num_cores": 2})
    assert "AMD EPYC (avx2); 2 cores" in table
    assert "nested                                      2     2 x 400       20.0      30.0" in table
    assert "normal stream TTFT p50 under hostile input / idle: 1.50x (target <= 2x: pass)" in table


def test_presets_and_bad_values():
    args = build_parser().parse_args(["bench", "hostile", "--quick", "--num-rounds", "5"])
    assert params_from_args(args) == QUICK.__class__(**{**QUICK.__dict__, "num_rounds": 5})
    with pytest.raises(SystemExit, match="--output-len must be >= 1, got 0"):
        params_from_args(build_parser().parse_args(["bench", "hostile", "--output-len", "0"]))
