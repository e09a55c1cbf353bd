"""dtype auto: bf16 unless this machine's bf16 matrix products are too slow, said with the figures."""

from __future__ import annotations

import torch

from serving.engine.modeling import dtype_choice
from serving.engine.modeling.dtype_choice import DtypeChoice, choose_dtype


def fake_gemm(seconds: dict):
    return lambda dtype, rows, hidden: seconds[dtype]


def test_a_configured_dtype_is_kept():
    assert choose_dtype("float32", torch.device("cpu")) == DtypeChoice("float32", "configured")
    assert choose_dtype("bfloat16", torch.device("cpu")) == DtypeChoice("bfloat16", "configured")


def test_auto_on_cuda_is_bf16():
    assert choose_dtype("auto", torch.device("cuda")) == DtypeChoice("bfloat16", "auto: bf16 on cuda")


def test_auto_keeps_bf16_where_it_is_fast_or_close(monkeypatch):
    monkeypatch.setattr(dtype_choice, "_gemm_s", fake_gemm({torch.bfloat16: 1.0, torch.float32: 4.0}))
    assert choose_dtype("auto", torch.device("cpu"), hidden_size=576) == DtypeChoice(
        "bfloat16", "auto: bf16 GEMM 0.25x the time of fp32 here (64x576x1728)")
    monkeypatch.setattr(dtype_choice, "_gemm_s", fake_gemm({torch.bfloat16: 1.25, torch.float32: 1.0}))
    assert choose_dtype("auto", torch.device("cpu"), hidden_size=576).dtype == "bfloat16"


def test_auto_takes_fp32_where_bf16_is_slow(monkeypatch):
    # an AVX2-only CPU: no bf16 instructions, its bf16 GEMM ~9x slower than fp32
    monkeypatch.setattr(dtype_choice, "_gemm_s", fake_gemm({torch.bfloat16: 9.0, torch.float32: 1.0}))
    assert choose_dtype("auto", torch.device("cpu"), hidden_size=576) == DtypeChoice(
        "float32", "auto: bf16 GEMM 9.00x the time of fp32 here (64x576x1728), over the 1.25x limit")


def test_the_engine_runs_and_reports_the_dtype_auto_chose(tiny_model_dir, monkeypatch):
    from serving.engine import EngineConfig, LLMEngine

    monkeypatch.setattr(dtype_choice, "_gemm_s", fake_gemm({torch.bfloat16: 9.0, torch.float32: 1.0}))
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="auto", kv_cache_bytes=2**20))
    assert engine.config.dtype == "float32"
    assert engine.kv_cache.data.dtype == torch.float32
    assert engine.kv_layout.dtype == "float32"
    stats = engine.stats()
    assert (stats.dtype, stats.dtype_reason) == ("float32", "auto: bf16 GEMM 9.00x the time of fp32 here (64x64x192), over the 1.25x limit")
