"""`kvrelay bench serve-overhead`: its arithmetic and table on fabricated figures, and a smoke run
of the whole command (in-process, both served modes, KV transfer) on a tiny model."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest

from load_tests.serve_overhead.bench import (
    FULL,
    QUICK,
    PathResult,
    RequestTiming,
    format_table,
    params_from_args,
    summarize,
    timing_from_sse,
)
from load_tests.serve_overhead.kv_transfer_timing import KVTransferResult
from serving.cli.parser import build_parser
from tests.helpers import REPO as REPO_ROOT

# Figures chosen to be exact in binary floating point.
R = RequestTiming
INPROCESS = PathResult("in-process", [R(0.25, 1.25, 5), R(0.5, 1.5, 5), R(0.75, 2.75, 9)])  # TPOT 0.25 s each
DISAGG = PathResult(
    "disaggregated", [R(0.515625, 1.546875, 5), R(0.5, 1.53125, 5), R(0.75, 2.8125, 9)], num_text_matches=3,
)  # TTFT p50 0.515625 s, TPOT 0.2578125 s each
COLOC = PathResult("colocated", [R(0.5078125, 1.5078125, 5)] * 3, num_text_matches=2)
KV = KVTransferResult(
    num_tokens=1024, num_bytes=2**20,
    steps_s={"gather": [0.0625] * 3, "handover": [0.125, 0.125, 0.1875], "view": [0.0625] * 3,
             "write": [0.25] * 3},  # hand-offs 0.5, 0.5, 0.5625 s
    memcpy_s=[0.25, 0.25, 0.5], is_verified=True, path="arena",
)
STORE = KVTransferResult(
    num_tokens=1024, num_bytes=2**20,
    steps_s={"gather": [0.25] * 3, "put": [0.125, 0.125, 0.25], "handover": [0.125] * 3,
             "get": [0.0] * 3, "write": [0.25] * 3},  # hand-offs 0.75, 0.75, 0.875 s
    memcpy_s=[0.25, 0.25, 0.5], is_verified=True, path="object_store",
)


def test_request_and_transfer_arithmetic():
    assert R(0.25, 1.25, 5).tpot_s == 0.25  # (E2E - TTFT) / (tokens - 1)
    assert R(0.25, 0.25, 1).tpot_s is None
    assert (DISAGG.ttft_ms_p50, DISAGG.tpot_ms_p50, DISAGG.e2e_ms_p50) == (515.625, 257.8125, 1546.875)
    assert KV.transfer_s == [0.5, 0.5, 0.5625] and STORE.transfer_s == [0.75, 0.75, 0.875]
    assert (KV.transfer_ms_p50, KV.memcpy_ms_p50, KV.fraction_of_memcpy) == (500.0, 250.0, 0.5)
    assert KV.steps == ("gather", "handover", "view", "write")
    assert STORE.steps == ("gather", "put", "handover", "get", "write")
    assert KV.to_json()["steps_ms_p50"]["handover"] == 125.0
    assert R(0.5, 1.5, 3, text="abc", first_token_s=0.25).to_json() == {
        "ttft_s": 0.5, "e2e_s": 1.5, "num_output_tokens": 3, "first_token_s": 0.25, "tpot_s": 0.5,
    }


def test_summary_and_targets():
    summary = summarize(INPROCESS, {"disaggregated": DISAGG, "colocated": COLOC}, {"arena": KV, "object_store": STORE})
    assert summary["added_ttft_ms_p50"] == 15.625
    assert summary["added_tpot_ms_p50"] == 7.8125
    assert summary["added_ttft_ms_p50_colocated"] == 7.8125
    assert summary["added_tpot_ms_p50_colocated"] == 0.0
    assert summary["kv_transfer_fraction_of_memcpy"] == 0.5
    assert summary["kv_object_store_fraction_of_memcpy"] == 250.0 / 750.0
    assert summary["kv_transfer_timed_steps"] == "gather + handover + view + write"
    assert (summary["kv_transfer_ms_p50"], summary["memcpy_ms_p50"], summary["kv_transfer_bytes"]) == (500.0, 250.0, 2**20)
    assert (summary["ttft_ms_p50_inprocess"], summary["tpot_ms_p50_colocated"]) == (500.0, 250.0)
    assert summary["targets"] == {
        "added_ttft_ms_p50": {"target": "<= 15", "met": False},
        "added_tpot_ms_p50": {"target": "<= 2", "met": False},
        "kv_transfer_fraction_of_memcpy": {"target": ">= 0.5", "met": True},  # the bound passes
    }
    json.dumps(summary, allow_nan=False)


def test_summary_without_served_modes_or_kv_is_null():
    summary = summarize(INPROCESS, {"colocated": COLOC}, {})
    assert summary["added_ttft_ms_p50"] is None and summary["added_tpot_ms_p50"] is None
    assert summary["added_ttft_ms_p50_colocated"] == 7.8125
    assert summary["kv_transfer_fraction_of_memcpy"] is None and summary["kv_transfer_bytes"] is None
    assert summary["targets"]["added_ttft_ms_p50"]["met"] is None
    assert "ttft_ms_p50_disaggregated" not in summary


def test_table():
    summary = summarize(INPROCESS, {"disaggregated": DISAGG, "colocated": COLOC}, {"arena": KV, "object_store": STORE})
    # run() has resolved FULL's dtype "auto" by the time it prints (here, as on an AVX2-only CPU)
    table = format_table(dataclasses.replace(FULL, dtype="float32"), [INPROCESS, DISAGG, COLOC], {"arena": KV, "object_store": STORE}, summary, load_avg_1m=2.5)
    assert table.splitlines() == [
        "workload: 8 prompts x 256 -> 64 tokens, one at a time, streamed; float32, 1 torch thread per engine",
        "",
        "p50                            in-process  disaggregated      colocated",
        "TTFT, ms                            500.0          515.6          507.8",
        "TPOT, ms                           250.00         257.81         250.00",
        "E2E, ms                            1500.0         1546.9         1507.8",
        "same text as in-process                 -            3/3            2/3",
        "",
        "KV hand-off through the arena of 1024 tokens (1.0 MiB), p50 of 3:",
        "  whole    500.000 ms = gather 62.500 + handover 125.000 + view 62.500 + write 250.000",
        "  memcpy   250.000 ms: 0.500 of memcpy speed",
        "",
        "KV hand-off through the object store of 1024 tokens (1.0 MiB), p50 of 3:",
        "  whole    750.000 ms = gather 250.000 + put 125.000 + handover 125.000 + get 0.000 + write 250.000",
        "  memcpy   250.000 ms: 0.333 of memcpy speed",
        "",
        "summary                                  value    target  result",
        "added TTFT p50, ms (disaggregated)      15.625     <= 15    miss",
        "added TPOT p50, ms (disaggregated)       7.812      <= 2    miss",
        "KV hand-off (arena) / memcpy speed       0.500    >= 0.5    pass",
        "added TTFT / TPOT p50, colocated           7.8 / 0.00 ms",
        "note: 1-min load average 2.50 at start: other processes shared the CPU",
    ]


def test_table_without_kv_or_colocated():
    summary = summarize(INPROCESS, {"disaggregated": DISAGG}, {})
    lines = format_table(QUICK, [INPROCESS, DISAGG], {}, summary).splitlines()
    assert lines[0].startswith("workload: 4 prompts x 256 -> 16 tokens,")
    assert not any(line.startswith(("KV hand-off through", "note:")) for line in lines)
    assert "KV hand-off (arena) / memcpy speed           -    >= 0.5     n/a" in lines
    assert not any(line.startswith("added TTFT / TPOT p50, colocated") for line in lines)


def test_timing_from_sse():
    events = [
        (10.25, {"choices": [{"index": 0, "text": "", "finish_reason": None}], "usage": None}),
        (10.5, {"choices": [{"index": 0, "text": "Hel", "finish_reason": None}], "usage": None}),
        (11.0, {"choices": [{"index": 0, "text": "lo", "finish_reason": None}], "usage": None}),  # 2 tokens
        (11.5, {"choices": [{"index": 0, "text": "!", "finish_reason": "length"}], "usage": None}),
        (11.75, {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 5, "total_tokens": 13}}),
    ]
    timing = timing_from_sse(10.0, events)
    assert (timing.ttft_s, timing.e2e_s, timing.num_output_tokens, timing.text) == (0.5, 1.5, 5, "Hello!")
    assert timing.tpot_s == 0.25  # the usage chunk is not a token
    with pytest.raises(RuntimeError, match="without text or without a usage chunk"):
        timing_from_sse(10.0, events[:-1])
    with pytest.raises(RuntimeError, match="the stream failed"):
        timing_from_sse(10.0, [events[1], (11.0, {"error": {"message": "boom"}})])


def test_presets_and_overrides():
    parse = build_parser().parse_args
    assert params_from_args(parse(["bench", "serve-overhead"])) == FULL
    p = params_from_args(parse(["bench", "serve-overhead", "--quick", "--output-len", "8", "--mode", "colocated"]))
    assert (p.num_prompts, p.output_len, p.num_warmup, p.kv_repeats, p.prompt_len) == (4, 8, 2, 5, 256)
    assert (p.quick, p.modes) == (True, ("colocated",))
    p = params_from_args(parse(["bench", "serve-overhead", "--mode", "colocated", "--mode", "disaggregated", "--kv-repeats", "0"]))
    assert (p.modes, p.kv_repeats) == (("disaggregated", "colocated"), 0)
    with pytest.raises(SystemExit, match="--output-len must be >= 2"):
        params_from_args(parse(["bench", "serve-overhead", "--output-len", "1"]))
    with pytest.raises(SystemExit, match="--num-prompts must be >= 1"):
        params_from_args(parse(["bench", "serve-overhead", "--num-prompts", "0"]))


def test_transport_reaches_the_apps_config(tmp_path):
    from load_tests.serve_overhead.bench import serve_config

    parse = build_parser().parse_args
    assert FULL.transport == "grpc"
    p = params_from_args(parse(["bench", "serve-overhead", "--transport", "objects"]))
    assert p.transport == "objects"
    assert serve_config(p, tmp_path, "colocated", 8001).ray.grpc_transport is False
    assert serve_config(FULL, tmp_path, "colocated", 8001).ray.grpc_transport is True


@pytest.mark.integration
def test_smoke_run_on_tiny_model(tiny_model_dir, tmp_path):
    """The whole command in its own process (it starts and stops its own Ray), tiny sizes."""
    path = tmp_path / "bench.json"
    command = [
        sys.executable, "-m", "serving.cli", "bench", "serve-overhead", "--model", str(tiny_model_dir),
        "--dtype", "float32", "--num-prompts", "2", "--prompt-len", "32", "--output-len", "4",
        "--num-warmup", "1", "--kv-tokens", "64", "--kv-repeats", "2", "--kv-cache-mib", "16",
        "--json", str(path),
    ]
    proc = subprocess.run(command, check=False, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(path.read_text())
    summary, raw = report["summary"], report["raw"]
    for key in (
        "added_ttft_ms_p50", "added_tpot_ms_p50", "added_ttft_ms_p50_colocated", "added_tpot_ms_p50_colocated",
        "kv_transfer_fraction_of_memcpy", "kv_transfer_ms_p50", "memcpy_ms_p50",
    ):
        assert isinstance(summary[key], float) and math.isfinite(summary[key]), key
    assert summary["kv_transfer_fraction_of_memcpy"] > 0 and summary["kv_object_store_fraction_of_memcpy"] > 0
    for kv_path, kv in raw["kv_transfer"].items():
        assert kv["is_verified"] is True and kv["path"] == kv_path, kv_path  # the importer's blocks equal the exporter's

    paths = raw["paths"]
    assert list(paths) == ["in-process", "disaggregated", "colocated"]
    for name, result in paths.items():
        assert [r["num_output_tokens"] for r in result["requests"]] == [4, 4], name  # exactly max_tokens
        assert all(0 < r["ttft_s"] <= r["e2e_s"] for r in result["requests"]), name
    # float32 greedy: the same tokens everywhere, so the same prompts reached every path
    assert paths["disaggregated"]["num_text_matches"] == paths["colocated"]["num_text_matches"] == 2
    decode = paths["disaggregated"]["info"]["worker_stats"]["DecodeWorker"]
    assert (decode["num_kv_imports"], decode["num_kv_fallbacks"]) == (3, 0)  # 1 warm-up + 2 timed
    assert paths["colocated"]["info"]["worker_stats"]["Worker"]["num_generated_tokens"] == 3 * 4

    assert list(raw["kv_transfer"]) == ["arena", "object_store"]
    for kv in raw["kv_transfer"].values():
        # 64 tokens x 2 layers x (K, V) x 2 KV heads x head_dim 16 x 4 bytes
        assert (kv["num_tokens"], kv["num_bytes"], summary["kv_transfer_bytes"]) == (64, 32768, 32768)
        assert all(len(kv["steps_s"][step]) == 2 for step in kv["timed_steps"])
    assert report["config"]["params"]["modes"] == ["disaggregated", "colocated"]
    assert report["hardware"]["num_cores"] >= 1 and report["hardware"]["num_threads"] == 1
    assert set(report["hardware"]["isa"]) == {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "amx_int8"}  # hardware.machine_record
    assert "KV hand-off through the arena of 64 tokens" in proc.stdout and "added TTFT p50" in proc.stdout
