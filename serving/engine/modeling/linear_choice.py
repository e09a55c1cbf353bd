"""Which routine runs a linear layer of few rows: the native small-M kernel or torch's GEMM,
chosen by measuring this machine at start-up.

A decode step multiplies each weight by as many rows as sequences run (1-32 here). How well
torch's GEMM does that depends on the CPU and its BLAS, which change between machines of one kind
(measured, every weight of SmolLM2-135M plus its lm_head, fp32, 2 threads):

    CPU                              rows   torch (MKL)   native small_m_linear
    AMD EPYC, AVX2 only                 1       69 ms           32 ms
                                        4      130 ms           43 ms
                                       16      163 ms           84 ms
                                       64      252 ms          206 ms

MKL does few rows poorly on that AMD part (4 rows take twice the time of one, far from the
memory bound); the native kernel (csrc/kernels.cpp) streams each weight row once for every row
of x. On a CPU where torch does better, the measurement says so and torch keeps those sizes. So
`choose_linear` times both on the model's own weights, as many layers as outgrow the last-level
cache (a decode step streams its weights from memory), for 1, 2, 4, ... rows, and the native
kernel takes every row count up to the first one where it is not NATIVE_MARGIN faster. bf16
rows stop at 8 (past that oneDNN's packed GEMM wins here: 0.35 against 0.44 ms for one layer at
16 rows), against torch's path for bf16 weights here (oneDNN, pre-packed where it can be).
Batch-invariant mode (model.py) skips the choice: one kernel for every row count. The choice and its figures go in the engine's start-up log line;
the row limit in its stats (`linear_path`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["LinearChoice", "choose_linear", "ROW_COUNTS"]

ROW_COUNTS = (1, 2, 4, 8, 16, 32, 64)
BF16_MAX_ROWS = 8
WORKING_SET_BYTES = 48 * 2**20  # over the last-level cache of the CPUs seen here (16-32 MiB)
# A row count goes native only when that is this much faster: a count near even would go one way
# in one replica and the other in the next (fp32 sums in another order: the same values to
# rounding, not bit for bit).
NATIVE_MARGIN = 1.25


@dataclass(frozen=True)
class LinearChoice:
    native_max_rows: int  # linear layers of at most this many rows run the native kernel; 0: none
    reason: str

    @property
    def summary(self) -> str:
        if self.native_max_rows == sys.maxsize:
            return "native linear for every row count (batch-invariant)"
        return f"native small-M linear up to {self.native_max_rows} rows"

    def __str__(self) -> str:
        return f"{self.summary} ({self.reason})"


def choose_linear(
    linears: Sequence[Any],
    run_native: Callable[[Any, torch.Tensor], torch.Tensor],
    run_torch: Callable[[Any, torch.Tensor], torch.Tensor],
    dtype: torch.dtype,
    *,
    working_set_bytes: int = WORKING_SET_BYTES,
) -> LinearChoice:
    """Up to how many rows `run_native(linear, x)` beats `run_torch(linear, x)` by NATIVE_MARGIN
    here, on the threads already set, timed over the model's own `linears` (objects with a
    `weight [N, K]`), as many as make `working_set_bytes`. A model whose linear weights all fit
    in less stays on torch: its steps are not memory-bound (a test's tiny model: no timing
    decides its path)."""
    if dtype not in (torch.float32, torch.bfloat16):
        return LinearChoice(0, f"no native kernel for {dtype}")
    chosen, size = [], 0
    for linear in linears:
        chosen.append(linear)
        size += linear.weight.numel() * linear.weight.element_size()
        if size >= working_set_bytes:
            break
    if size < working_set_bytes:
        return LinearChoice(0, f"the linear weights ({size / 2**20:.1f} MiB) fit in cache: torch's GEMM")
    max_rows, figures = 0, []
    generator = torch.Generator().manual_seed(0)  # never the global one: the sampler seeds from it
    for rows in ROW_COUNTS:
        if dtype == torch.bfloat16 and rows > BF16_MAX_ROWS:
            break
        inputs = {k: torch.randn(rows, k, generator=generator).to(dtype) for k in {lin.weight.shape[1] for lin in chosen}}
        native_s = _time_s(run_native, chosen, inputs)
        torch_s = _time_s(run_torch, chosen, inputs)
        figures.append(f"{rows}: {torch_s / native_s:.2f}x")
        if torch_s < NATIVE_MARGIN * native_s:
            break
        max_rows = rows
    return LinearChoice(max_rows, f"measured here, torch time / native time by rows: {', '.join(figures)}")


def _time_s(run, linears: Sequence[Any], inputs: dict[int, torch.Tensor], repeats: int = 2) -> float:
    for linear in linears[:2]:
        run(linear, inputs[linear.weight.shape[1]])  # first calls: a library picks its kernel
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for linear in linears:
            run(linear, inputs[linear.weight.shape[1]])
        best = min(best, time.perf_counter() - started)
    return best
