"""`kvrelay bench engine --structured` (load_tests/engine/structured.py): presets, the table, and a
smoke run on the tiny model (the figures' arithmetic and the equal-work check, not their values)."""

from __future__ import annotations

import json

import pytest
import torch

from load_tests.engine.structured import FULL, QUICK, StructuredParams, format_table, params_from_args
from serving.cli import main
from serving.cli.parser import build_parser


def test_presets_and_overrides():
    p = params_from_args(build_parser().parse_args(["bench", "engine", "--structured"]))
    assert p == FULL and (p.num_requests, p.prompt_len, p.output_len, p.repeats) == (32, 128, 128, 3)
    p = params_from_args(build_parser().parse_args(["bench", "engine", "--structured", "--quick", "--repeats", "5", "--num-requests", "8"]))
    assert p == StructuredParams(num_requests=8, output_len=QUICK.output_len, repeats=5, quick=True)
    with pytest.raises(SystemExit, match="--num-requests must be >= 2 with --structured"):
        params_from_args(build_parser().parse_args(["bench", "engine", "--structured", "--num-requests", "1"]))


def test_table():
    machine = {"cpu_model": "AMD EPYC", "isa": {"avx2": True, "avx512f": True, "amx_bf16": False}, "dtype": "bfloat16",
               "load_avg_1m_at_start": 0.1}
    summary = {"unconstrained_tokens_per_s": 200.0, "half_constrained_tokens_per_s": 190.0, "ratio": 0.95, "met": True,
               "schema_compile_ms": 12.34}
    assert format_table(FULL, summary, machine).splitlines() == [
        "structured outputs: 32 requests x 128 -> 128 tokens, greedy, 2 threads, median of 3 (AMD EPYC; avx2, avx512f; dtype bfloat16)",
        "  unconstrained            200.0 output tok/s",
        "  half constrained         190.0 output tok/s",
        "  ratio                    0.950   target >= 0.8: pass",
        "  schema compile            12.3 ms (once, before the timed runs)",
    ]


def test_smoke_run_on_tiny_model(tiny_model_dir, tmp_path, capsys):
    threads = torch.get_num_threads()
    path = tmp_path / "structured.json"
    rc = main([
        "bench", "engine", "--structured", "--model", str(tiny_model_dir), "--num-requests", "4", "--prompt-len", "16",
        "--output-len", "8", "--repeats", "1", "--kv-cache-mib", "16", "--threads", "1", "--json", str(path),
    ])
    assert rc == 0 and torch.get_num_threads() == threads
    report = json.loads(path.read_text())
    summary, runs = report["summary"], report["results"]["runs"]
    for name in ("unconstrained", "half_constrained"):
        (run,) = runs[name]
        assert run["num_output_tokens"] == 4 * 8  # the schema runs past max_tokens: equal work
        assert run["finish_reasons"] == {"length": 4}
    assert summary["ratio"] == pytest.approx(summary["half_constrained_tokens_per_s"] / summary["unconstrained_tokens_per_s"])
    assert summary["schema_compile_ms"] > 0 and summary["target_ratio"] == 0.8
    assert report["results"]["command"].startswith("kvrelay bench engine --structured")
    assert "half constrained" in capsys.readouterr().out
