"""`dtype: auto`: the weights' and KV cache's dtype, chosen by measuring this machine.

bf16 halves the bytes every decode step streams, but whether its matrix products are fast depends
on the CPU, which changes between machines of one kind:

    CPU                                  bf16 GEMM vs fp32 (one core, 64 rows)   auto picks
    Intel Xeon with AMX                  5-9x faster                             bfloat16
    AMD EPYC with AVX-512 BF16           ~2x faster                              bfloat16
    AMD EPYC with AVX2 only              ~9x slower (no bf16 instructions)       float32

So `auto` times one GEMM of the model's shape in both dtypes, on the threads the engine will use,
and keeps bf16 unless it is more than BF16_SLOWDOWN_LIMIT times slower than fp32 (the margin
buys bf16's halved memory traffic). CUDA always gets bf16. The choice and its figures go in the
engine's start-up log line and stats.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["BF16_SLOWDOWN_LIMIT", "DtypeChoice", "choose_dtype"]

logger = logging.getLogger(__name__)

BF16_SLOWDOWN_LIMIT = 1.25


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # "bfloat16" | "float32" | "float16"
    reason: str

    def __str__(self) -> str:
        return f"{self.dtype} ({self.reason})"


def _gemm_s(dtype: torch.dtype, rows: int, hidden: int, repeats: int = 5) -> float:
    x = torch.randn(rows, hidden).to(dtype)
    w = torch.randn(hidden * 3, hidden).to(dtype)
    F.linear(x, w)  # first call: oneDNN picks and builds its kernel
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        F.linear(x, w)
        best = min(best, time.perf_counter() - started)
    return best


def choose_dtype(requested: str, device: torch.device, *, hidden_size: int = 1024, rows: int = 64) -> DtypeChoice:
    """The dtype to run: `requested` unless it is "auto", which measures (see the module doc)."""
    if requested != "auto":
        return DtypeChoice(requested, "configured")
    if device.type != "cpu":
        return DtypeChoice("bfloat16", f"auto: bf16 on {device.type}")
    hidden = max(64, min(hidden_size, 2048))
    bf16_s, fp32_s = _gemm_s(torch.bfloat16, rows, hidden), _gemm_s(torch.float32, rows, hidden)
    slowdown = bf16_s / fp32_s
    figures = f"bf16 GEMM {slowdown:.2f}x the time of fp32 here ({rows}x{hidden}x{3 * hidden})"
    if slowdown > BF16_SLOWDOWN_LIMIT:
        return DtypeChoice("float32", f"auto: {figures}, over the {BF16_SLOWDOWN_LIMIT}x limit")
    return DtypeChoice("bfloat16", f"auto: {figures}")
