"""`kvrelay bench engine --speculative` (load_tests/engine/speculative.py): presets, the table, and a
smoke run on the tiny model (the figures' arithmetic and the lossless check, not their values)."""

from __future__ import annotations

import json

import pytest
import torch

from load_tests.engine.speculative import (
    CHAT_PROMPTS,
    FULL,
    GROUNDED_ASKS,
    QUICK,
    SpeculativeParams,
    batch_prompts,
    chat_ids,
    format_table,
    params_from_args,
    prompt_ids,
    run,
)
from serving.cli import main
from serving.cli.parser import build_parser


def test_presets_and_overrides():
    p = params_from_args(build_parser().parse_args(["bench", "engine", "--speculative"]))
    assert p == FULL and (p.output_len, p.batch_output_len, p.num_requests, p.repeats, p.num_speculative_tokens) == (128, 64, 64, 3, 4)
    argv = ["bench", "engine", "--speculative", "--quick", "--repeats", "5", "--num-speculative-tokens", "6"]
    p = params_from_args(build_parser().parse_args(argv))
    assert p == SpeculativeParams(output_len=QUICK.output_len, batch_output_len=32, num_requests=16, repeats=5,
                                  num_speculative_tokens=6, quick=True)
    argv = ["bench", "engine", "--speculative", "--single-output-len", "32", "--output-len", "7", "--num-requests", "5"]
    p = params_from_args(build_parser().parse_args(argv))
    assert (p.output_len, p.batch_output_len, p.num_requests) == (32, 7, 5)  # --output-len is the throughput run's
    with pytest.raises(SystemExit, match="--single-output-len must be >= 2"):
        params_from_args(build_parser().parse_args(["bench", "engine", "--speculative", "--single-output-len", "1"]))
    p = params_from_args(build_parser().parse_args(["bench", "engine", "--speculative", "--spec-method", "draft", "--draft-model", "/d"]))
    assert (p.spec_method, p.draft_model) == ("draft", "/d")
    with pytest.raises(SystemExit, match="--draft-model needs --spec-method draft"):
        params_from_args(build_parser().parse_args(["bench", "engine", "--speculative", "--draft-model", "/d"]))


def test_batch_prompts_alternate_grounded_and_chat():
    from serving.engine.modeling.loader import load_tokenizer, resolve_model_dir

    tokenizer = load_tokenizer(resolve_model_dir("smollm2-135m-instruct"))
    grounded = [prompt_ids(tokenizer, ask) for ask in GROUNDED_ASKS]
    chat = [chat_ids(tokenizer, content) for content in CHAT_PROMPTS]
    assert batch_prompts(tokenizer, 6) == [grounded[0], chat[0], grounded[1], chat[1], grounded[0], chat[2]]


def test_table():
    machine = {"cpu_model": "AMD EPYC", "isa": {"avx2": True, "avx512f": False}, "dtype": "bfloat16", "load_avg_1m_at_start": 0.1}
    stream = {"prompt_tokens": 230, "output_tokens": 128, "off_decode_tokens_per_s": 40.0, "on_decode_tokens_per_s": 70.0,
              "speedup": 1.75, "acceptance_rate": 0.6, "tokens_per_verify_step": 3.4, "identical": True}
    summary = {
        "spec_max_batch_rows": 32, "spec_single_row_cost": 0.125, "speculative_acceptance_rate": 0.55,
        "grounded": {**stream, "output_copies_text": True},
        "chat": {**stream, "prompt_tokens": 40, "on_decode_tokens_per_s": 39.0, "speedup": 0.975, "acceptance_rate": 0.1,
                 "tokens_per_verify_step": 1.1, "identical": False},
        "throughput": {"num_requests": 64, "off_tokens_per_s": 500.0, "on_tokens_per_s": 490.0, "ratio": 0.98,
                       "acceptance_rate": 0.5, "tokens_per_verify_step": 2.0, "num_identical": 63},
    }
    assert format_table(FULL, summary, machine).splitlines() == [
        "speculative decoding (ngram, adaptive, k<=4, n=2..4): smollm2-135m-instruct, greedy, 2 threads, median of 3 "
        "(AMD EPYC; avx2; dtype bfloat16; knee 32 rows, verify row 0.12 of a step)",
        "  scenario                        off          on    speedup  acceptance  tokens/verify  same tokens",
        "  grounded  1 x 230 -> 128       40.0       70.0     1.750       0.600           3.40  yes",
        "  chat      1 x  40 -> 128       40.0       39.0     0.975       0.100           1.10  NO",
        "  throughput   64 x -> 64       500.0      490.0     0.980       0.500           2.00  63/64",
        "  (single streams: decode tok/s; throughput: generated tok/s; grounded output copies the text: yes; "
        "acceptance over all: 0.550)",
    ]


def test_table_names_the_draft_model():
    machine = {"cpu_model": "AMD EPYC", "isa": {"avx2": True}, "dtype": "bfloat16", "load_avg_1m_at_start": 0.1}
    stream = {"prompt_tokens": 230, "output_tokens": 128, "off_decode_tokens_per_s": 40.0, "on_decode_tokens_per_s": 36.0,
              "speedup": 0.9, "acceptance_rate": 1.0, "tokens_per_verify_step": 5.0, "identical": True}
    summary = {
        "spec_max_batch_rows": 16, "spec_single_row_cost": 0.5, "speculative_acceptance_rate": 1.0,
        "grounded": {**stream, "output_copies_text": True}, "chat": stream,
        "throughput": {"num_requests": 64, "off_tokens_per_s": 500.0, "on_tokens_per_s": 450.0, "ratio": 0.9,
                       "acceptance_rate": 1.0, "tokens_per_verify_step": 5.0, "num_identical": 64},
    }
    assert format_table(SpeculativeParams(spec_method="draft"), summary, machine).splitlines()[0].startswith(
        "speculative decoding (draft smollm2-135m-instruct, adaptive, k<=4): smollm2-135m-instruct, greedy"
    )


def test_smoke_run_with_the_tiny_model_as_its_own_draft(tiny_model_dir):
    p = SpeculativeParams(
        model=str(tiny_model_dir), output_len=16, batch_output_len=8, num_requests=2, repeats=1, threads=1,
        kv_cache_mib=16, dtype="float32", spec_method="draft", verify_row_cost=0.1, max_batch_rows=64,
    )
    summary = run(p)["summary"]
    # 1 token from the prefill, then 3 steps of 1 + 4 (fp32: the draft is the model, row for row)
    g = summary["grounded"]
    assert g["identical"] is True and g["acceptance_rate"] == 1.0 and g["tokens_per_verify_step"] == 5.0


def test_smoke_run_on_tiny_model(tiny_model_dir, tmp_path, capsys):
    threads = torch.get_num_threads()
    path = tmp_path / "speculative.json"
    rc = main([
        "bench", "engine", "--speculative", "--model", str(tiny_model_dir), "--single-output-len", "16",
        "--output-len", "8", "--num-requests", "4", "--repeats", "1", "--kv-cache-mib", "16", "--threads", "1",
        "--json", str(path),
    ])
    assert rc == 0 and torch.get_num_threads() == threads
    report = json.loads(path.read_text())
    summary, runs = report["summary"], report["results"]["runs"]
    for scenario in ("grounded", "chat"):
        (off,), (on,) = runs[scenario]["off"], runs[scenario]["on"]
        assert off["proposed"] == off["verify_steps"] == 0  # the random model does not copy: on may propose nothing
        s = summary[scenario]
        assert s["identical"] is True and s["output_tokens"] == 16
        assert s["speedup"] == pytest.approx(s["on_decode_tokens_per_s"] / s["off_decode_tokens_per_s"])
        assert s["acceptance_rate"] == (on["accepted"] / on["proposed"] if on["proposed"] else 0.0)
    (off,), (on,) = runs["throughput"]["off"], runs["throughput"]["on"]
    t = summary["throughput"]
    assert off["num_output_tokens"] == on["num_output_tokens"] == t["output_tokens"] == 4 * 8
    assert t["ratio"] == pytest.approx(on["tokens_per_s"] / off["tokens_per_s"])
    assert on["tokens_per_s"] == pytest.approx(on["num_output_tokens"] / on["wall_s"])
    proposed = sum(runs[s]["on"][0]["proposed"] for s in runs)
    accepted = sum(runs[s]["on"][0]["accepted"] for s in runs)
    assert summary["speculative_acceptance_rate"] == (accepted / proposed if proposed else 0.0)
    assert summary["speculative_speedup_grounded"] == summary["grounded"]["speedup"]
    assert summary["speculative_speedup_chat"] == summary["chat"]["speedup"]
    assert summary["speculative_throughput_ratio"] == t["ratio"]
    assert summary["spec_max_batch_rows"] >= 1  # measured at the engine's start
    assert report["results"]["machine"]["cpu_model"]
    assert report["results"]["command"].startswith("kvrelay bench engine --speculative")
    assert "grounded  1 x" in capsys.readouterr().out
