"""`kvrelay bench engine --speculative` (load_tests/bench_speculative.py): presets, the table, and a
smoke run on the tiny model (the figures' arithmetic and the lossless check, not their values)."""

from __future__ import annotations

import json

import pytest
import torch

from load_tests.bench_speculative import FULL, QUICK, SpeculativeParams, format_table, params_from_args, run
from serving.cli import main
from serving.cli.parser import build_parser


def test_presets_and_overrides():
    p = params_from_args(build_parser().parse_args(["bench", "engine", "--speculative"]))
    assert p == FULL and (p.output_len, p.repeats, p.num_speculative_tokens) == (128, 3, 4)
    argv = ["bench", "engine", "--speculative", "--quick", "--repeats", "5", "--num-speculative-tokens", "6"]
    p = params_from_args(build_parser().parse_args(argv))
    assert p == SpeculativeParams(output_len=QUICK.output_len, repeats=5, num_speculative_tokens=6, quick=True)
    p = params_from_args(build_parser().parse_args(["bench", "engine", "--speculative", "--single-output-len", "32", "--output-len", "7"]))
    assert p.output_len == 32  # --output-len is the throughput run's
    with pytest.raises(SystemExit, match="--single-output-len must be >= 2"):
        params_from_args(build_parser().parse_args(["bench", "engine", "--speculative", "--single-output-len", "1"]))
    p = params_from_args(build_parser().parse_args(["bench", "engine", "--speculative", "--spec-method", "draft", "--draft-model", "/d"]))
    assert (p.spec_method, p.draft_model) == ("draft", "/d")
    with pytest.raises(SystemExit, match="--draft-model needs --spec-method draft"):
        params_from_args(build_parser().parse_args(["bench", "engine", "--speculative", "--draft-model", "/d"]))


def test_table():
    machine = {"cpu_model": "AMD EPYC", "isa": {"avx2": True, "avx512f": False}, "dtype": "bfloat16", "load_avg_1m_at_start": 0.1}
    summary = {"prompt_tokens": 230, "output_tokens": 128, "off_decode_tokens_per_s": 40.0, "on_decode_tokens_per_s": 70.0,
               "speedup": 1.75, "acceptance_rate": 0.6, "tokens_per_verify_step": 3.4, "identical": True,
               "output_copies_text": True}
    assert format_table(FULL, summary, machine).splitlines() == [
        "speculative decoding (ngram, k=4, n=2..4): smollm2-135m-instruct, 1 x 230 -> 128 tokens, greedy, repeat-the-text "
        "task, 2 threads, median of 3 (AMD EPYC; avx2; dtype bfloat16)",
        "  speculation off           40.0 decode tok/s",
        "  speculation on            70.0 decode tok/s",
        "  speedup                  1.750",
        "  acceptance               0.600   tokens per verifying step 3.40",
        "  same tokens          yes   output copies the text: yes",
    ]


def test_table_names_the_draft_model():
    machine = {"cpu_model": "AMD EPYC", "isa": {"avx2": True}, "dtype": "bfloat16", "load_avg_1m_at_start": 0.1}
    summary = {"prompt_tokens": 230, "output_tokens": 128, "off_decode_tokens_per_s": 40.0, "on_decode_tokens_per_s": 36.0,
               "speedup": 0.9, "acceptance_rate": 1.0, "tokens_per_verify_step": 5.0, "identical": True,
               "output_copies_text": True}
    p = SpeculativeParams(spec_method="draft")
    assert format_table(p, summary, machine).splitlines()[0].startswith(
        "speculative decoding (draft smollm2-135m-instruct, k=4): smollm2-135m-instruct, 1 x 230 -> 128 tokens"
    )


def test_smoke_run_with_the_tiny_model_as_its_own_draft(tiny_model_dir):
    p = SpeculativeParams(
        model=str(tiny_model_dir), output_len=16, repeats=1, threads=1, kv_cache_mib=16, dtype="float32", spec_method="draft",
    )
    summary = run(p)["summary"]
    # 1 token from the prefill, then 3 steps of 1 + 4 (fp32: the draft is the model, row for row)
    assert summary["identical"] is True and summary["acceptance_rate"] == 1.0 and summary["tokens_per_verify_step"] == 5.0


def test_smoke_run_on_tiny_model(tiny_model_dir, tmp_path, capsys):
    threads = torch.get_num_threads()
    path = tmp_path / "speculative.json"
    rc = main([
        "bench", "engine", "--speculative", "--model", str(tiny_model_dir), "--single-output-len", "16",
        "--repeats", "1", "--kv-cache-mib", "16", "--threads", "1", "--json", str(path),
    ])
    assert rc == 0 and torch.get_num_threads() == threads
    report = json.loads(path.read_text())
    summary, runs = report["summary"], report["results"]["runs"]
    (off,), (on,) = runs["off"], runs["on"]
    assert off["proposed"] == off["verify_steps"] == 0  # the random model does not copy: on may propose nothing
    assert summary["identical"] is True and summary["output_tokens"] == 16
    assert summary["speedup"] == pytest.approx(summary["on_decode_tokens_per_s"] / summary["off_decode_tokens_per_s"])
    assert summary["acceptance_rate"] == (on["accepted"] / on["proposed"] if on["proposed"] else 0.0)
    assert report["results"]["machine"]["cpu_model"]
    assert report["results"]["command"].startswith("kvrelay bench engine --speculative")
    assert "speculation on" in capsys.readouterr().out
