"""load_tests/engine/spec_suffix.py: a smoke run on the tiny model (the report's arithmetic and the
lossless check, not the figures' values) and the proposer-cost run's deterministic tree sizes."""

from __future__ import annotations

import torch

from load_tests.engine.spec_suffix import VARIANTS, main, proposer_cost, run


def test_tiny_model_run_reports_each_engine_and_same_tokens(tiny_model_dir, tmp_path):
    saved = torch.get_num_threads()
    try:
        report = run(model=str(tiny_model_dir), output_len=12, repeats=1, threads=1, dtype="float32")
    finally:
        torch.set_num_threads(saved)
    s = report["summary"]
    assert s["identical"] is True  # float32, greedy: speculation is lossless
    assert s["ngram"]["first_difference"] == s["suffix"]["first_difference"] == [None] * len(VARIANTS)
    assert s["off"]["later_speedup"] == 1.0 and s["off"]["acceptance_rate"] == 0.0
    for name in ("off", "ngram", "suffix"):
        (one,) = report["runs"][name]
        assert one["output_tokens"] == [12] * len(VARIANTS)  # the random model never stops early here
        assert s[name]["later_decode_tokens_per_s"] == one["later_decode_tokens_per_s"] > 0
        assert 0 <= one["later_accepted"] <= one["later_proposed"] <= one["proposed"]
    assert len(report["output_texts"]["off"]) == len(VARIANTS)


def test_proposer_cost_builds_the_same_trees_every_run():
    out = proposer_cost()
    assert (out["300_tokens"]["tree_nodes"], out["3000_tokens"]["tree_nodes"]) == (4664, 46452)
    assert out["300_tokens"]["step_us"] > 0 and out["cache_128_token_output_ms"] > 0


def test_cost_command_writes_its_json(tmp_path):
    assert main(["--cost", "--json", str(tmp_path / "cost.json")]) == 0
    assert (tmp_path / "cost.json").read_text().count('"tree_nodes"') == 2
