"""Batch-invariant mode (`deterministic=True`, EngineConfig.deterministic): a token's numbers do not
depend on how its step was put together: how many other rows share it, whether its prefix came
from the prefix cache, a KV hand-off or this step, how its prompt was chunked. Every linear
layer, for any number of rows, runs the native small-M kernel, which sums each output in one
fixed order per row (csrc/kernels.cpp); attention runs every token, prefill or decode, through the
one paged kernel, one query row at a time over its own context (runner.py); the glue
kernels (RMSNorm, RoPE, SiLU) are per row already. Without it, oneDNN's GEMM runs the rows above
the native limit, whose rounding varies with the row count, and prefill chunks go through SDPA,
whose sums differ from the decode kernel's: in bf16 enough to change a sampled or greedy token.
It needs the native kernels and a bf16 or fp32 model (`is_batch_invariant` says whether it runs).
The default, `deterministic: "auto"`, turns it on only where it was measured to cost nothing: bf16
on a CPU with AVX512-BF16 (the packed kernel) and without AMX (batch_invariance()).
"""

from __future__ import annotations

import logging

import torch

__all__ = ["batch_invariance", "cpu_has_amx"]

logger = logging.getLogger(__name__)


def batch_invariance(deterministic: bool | str, device: torch.device, dtype: torch.dtype, kernels, *,
                     speculative: bool = False) -> tuple[bool, str]:
    """Whether batch-invariant mode runs, and why (EngineConfig.deterministic: true, false or "auto").
    `speculative`: the engine verifies proposals, whose rows must compute as decode rows for greedy
    output to be token-identical to decoding without speculation (auto turns the mode on for it
    on AMX too). `kernels`: the native kernels module (None: not loaded)."""
    if deterministic is False:
        return False, "off (deterministic: false)"
    if device.type != "cpu":
        return False, f"off: its kernels are CPU-only; the device is {device}"
    if kernels is None:
        return False, "off: the native CPU kernels are not loaded (kvrelay status says why)"
    if dtype not in (torch.bfloat16, torch.float32):
        return False, f"off: the native linear kernel runs bf16 and fp32, not {dtype}"
    if deterministic is True:
        return True, "on (deterministic: true)"
    # auto: on only where it was measured to cost nothing (the config field's description).
    if dtype != torch.bfloat16:
        return False, "off (auto: fp32 runs the usual path; deterministic: true forces it)"
    if not kernels.has_packed_linear():
        return False, "off (auto: no AVX512-BF16 here, so no packed kernel; deterministic: true forces the slower one)"
    if cpu_has_amx() and speculative:
        return True, "on (auto: speculative decoding needs verify rows equal to decode rows; on AMX prefill pays for it)"
    if cpu_has_amx():
        return False, "off (auto: this CPU has AMX, whose oneDNN GEMM outruns the packed kernel on prefill; " \
                      "deterministic: true forces it)"
    return True, "on (auto: bf16 with AVX512-BF16 and no AMX, where the packed kernel costs nothing)"


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX's bf16 tiles (Linux's CPU flags; False where they cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_bf16" in line.split()
    except OSError:
        pass
    return False
