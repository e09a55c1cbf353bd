"""One linear layer of the engine's model, run by whichever CPU routine is fastest for its row count
(Linear's docstring), and whether oneDNN can pre-pack bf16 weights on this CPU."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from serving.engine.modeling.cpu_kernels import native_kernels

__all__ = ["Linear", "can_pack_bf16"]

logger = logging.getLogger(__name__)

_pack_support: bool | None = None


def can_pack_bf16() -> bool:
    """Whether oneDNN can pre-pack bf16 linear weights on this CPU: it needs AVX-512 (BW, VL, DQ)
    or AVX-NE-CONVERT, and refuses elsewhere (an AVX2-only CPU). Tried once, on a small weight."""
    global _pack_support
    if _pack_support is None:
        try:
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros(64, 64, dtype=torch.bfloat16), 64)
            _pack_support = True
        except (AttributeError, RuntimeError) as exc:
            _pack_support = False
            logger.info("bf16 linear layers use the plain layout: oneDNN cannot pre-pack them here (%s)", exc)
    return _pack_support


class Linear:
    """y = x W^T + b, by whichever CPU routine is fastest for the number of rows.

    A few rows (decoding a small batch) is memory-bound: the native kernel streams W once, and
    runs up to `native_rows` rows (measured at start-up, linear_choice.py). More rows are
    compute-bound: oneDNN with W pre-packed in its blocked layout (bf16 on CPU) runs ~1.3x
    faster at 64 rows than with the plain layout, with identical results; else torch's GEMM.

    Batch-invariant (`invariant`): every row count runs one native kernel whose sums do not depend
    on the other rows: for bf16 with AVX512-BF16, `packed_linear` over W packed once in its dot
    product layout (`invariant_weight`); else `small_m_linear` (native_rows is unbounded then).
    """

    __slots__ = ("weight", "bias", "packed", "invariant_weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, pack: bool, invariant: bool = False):
        self.weight = weight
        self.bias = bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64) if pack else None
        self.invariant_weight = None
        kernels = native_kernels() if invariant else None
        if kernels is not None and weight.dtype == torch.bfloat16 and kernels.has_packed_linear():
            self.invariant_weight = kernels.pack_linear_weight(weight)

    def __call__(self, x: torch.Tensor, kernels=None, native_rows: int = 0) -> torch.Tensor:
        rows = x.shape[0]
        if self.invariant_weight is not None:
            return kernels.packed_linear(x, self.invariant_weight, self.weight.shape[0], self.bias)
        if kernels is not None and 0 < rows <= native_rows:
            return kernels.small_m_linear(x, self.weight, self.bias)
        if self.packed is not None and rows > 0:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @property
    def num_bytes(self) -> int:
        b = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.weight.numel() * self.weight.element_size() + b
