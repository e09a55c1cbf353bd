"""The two roofs of this machine, and the model FLOPs a workload costs.

    bandwidth roof   read bytes/s of a 1 GiB float32 `.sum()` (measure_read_bandwidth): bounds a
                     single stream's decode, which reads every weight once per token
    compute roof     GFLOPS of torch matrix products (measure_gemm_roof), bf16 and fp32, on the
                     threads the benchmark uses: bounds prefill and batched decode

The compute roof is the best sustained rate over a few shapes: a square GEMM (up to 2048^3) and
the model's own linear layers at batch sizes M = 64 and 512 (MLP up and down projections). Each
shape gets a warm-up call, then its repeats are timed in three groups and the best group's mean
rate counts, so one lucky call does not. The whole measurement is bounded by `budget_s` (a few
seconds): the square grows only while its next size fits, and a shape whose one call would not
fit is skipped and named (measure_gemm_roof).

What a workload costs (model FLOPs: the arithmetic the model needs, not what an engine happens to
do; see flops_per_token and workload_flops) divided by its wall time and by the roof is the
fraction of the compute roof it reached (compute_roof_fraction).

torch is imported inside the measuring functions only; the FLOP arithmetic needs none.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "SQUARE_SIZES", "GemmRoof", "ModelShape", "compute_roof_fraction", "flops_per_token", "gemm_shapes", "lm_head_params",
    "matmul_params_per_layer", "measure_gemm_roof", "measure_read_bandwidth", "workload_flops",
]

GiB = 2**30
DTYPES = ("bfloat16", "float32")


class ModelShape(Protocol):
    """What the FLOP count reads of a model (serving.engine.modeling.loader.ModelSpec has it all)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


# ---- model FLOPs (pure) ------------------------------------------------------------------------
def matmul_params_per_layer(spec: ModelShape) -> int:
    """Weights one decoder layer multiplies each token by: q, k, v, o and the gated MLP.

    q: h x (H d), k and v: h x (Hkv d) each, o: (H d) x h, gate, up, down: 3 x h x i
    (h hidden size, H heads, Hkv KV heads, d head dim, i intermediate size). Biases and norms
    are additions, left out.
    """
    h, d = spec.hidden_size, spec.head_dim
    return h * spec.num_heads * d * 2 + h * spec.num_kv_heads * d * 2 + 3 * h * spec.intermediate_size


def lm_head_params(spec: ModelShape) -> int:
    """The vocabulary projection h x V (a matmul whether or not its weight is tied to the embedding)."""
    return spec.hidden_size * spec.vocab_size


def flops_per_token(spec: ModelShape, context_len: int, *, with_lm_head: bool = True) -> int:
    """Model FLOPs of one token's forward pass when it attends to `context_len` positions (itself included).

        2 x (L x matmul_params_per_layer + V h)      a multiply and an add per weight
      + 4 x L x H x d x context_len                  attention: q.k over the context (2 H d c)
                                                     and the weighted sum of values (2 H d c)

    The lm head (V h) is counted only where a token is sampled (`with_lm_head`). The embedding
    lookup, norms, rotary embedding, softmax and sampling are not matmuls and are left out.
    """
    attention = 4 * spec.num_layers * spec.num_heads * spec.head_dim * context_len
    params = spec.num_layers * matmul_params_per_layer(spec) + (lm_head_params(spec) if with_lm_head else 0)
    return 2 * params + attention


def workload_flops(spec: ModelShape, *, num_requests: int, prompt_len: int, output_len: int) -> int:
    """Model FLOPs of `num_requests` requests of `prompt_len` tokens generating `output_len` each.

    A request runs n = prompt_len + output_len - 1 positions through the model (every prompt token,
    then each output token but the last, which is sampled and never fed back); the position at
    index j attends to j + 1 positions, so attention sums to 4 L H d x n (n + 1) / 2. The lm head
    runs output_len times: on the last prompt position and on each fed-back output token.

        per request = 2 L P_layer n + 2 V h x output_len + 4 L H d x n (n + 1) / 2
    """
    assert output_len >= 1 and prompt_len >= 1, (prompt_len, output_len)
    n = prompt_len + output_len - 1
    per_request = (
        2 * spec.num_layers * matmul_params_per_layer(spec) * n
        + 2 * lm_head_params(spec) * output_len
        + 4 * spec.num_layers * spec.num_heads * spec.head_dim * n * (n + 1) // 2
    )
    return num_requests * per_request


def compute_roof_fraction(flops: float, elapsed_s: float | None, roof_flops_per_s: float | None) -> float | None:
    """(flops / elapsed_s) / roof_flops_per_s; None when a figure is missing or zero."""
    if not elapsed_s or not roof_flops_per_s:
        return None
    return flops / elapsed_s / roof_flops_per_s


# ---- measurements ------------------------------------------------------------------------------
def measure_read_bandwidth(num_bytes: int = GiB, repeats: int = 5) -> float:
    """Bytes per second of a `.sum()` over a `num_bytes` float32 tensor, best of `repeats`."""
    import torch

    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


SQUARE_SIZES = (256, 512, 1024, 2048)  # the square GEMM's ladder (load_tests/roofline.py docstring)


def gemm_shapes(spec: ModelShape | None = None) -> list[tuple[int, int, int]]:
    """The model's linear layers to time, (M, K, N): its MLP up (h -> i) and down (i -> h)
    projections at M = 64 and 512 tokens; none without a spec. The square GEMM comes on top."""
    if spec is None:
        return []
    h, i = spec.hidden_size, spec.intermediate_size
    return [(64, h, i), (512, h, i), (512, i, h)]


@dataclass
class GemmRoof:
    """Best sustained GFLOPS per dtype and shape ("MxKxN"), on `num_threads` torch threads."""

    num_threads: int
    gflops: dict[str, dict[str, float]] = field(default_factory=dict)  # dtype -> shape -> GFLOPS
    skipped: dict[str, dict[str, str]] = field(default_factory=dict)  # dtype -> shape -> why not timed
    elapsed_s: float = 0.0

    def best_gflops(self, dtype: str) -> float | None:
        by_shape = self.gflops.get(dtype)
        return max(by_shape.values()) if by_shape else None

    def to_json(self) -> dict:
        return {"num_threads": self.num_threads, "gflops_by_shape": self.gflops, "skipped_shapes": self.skipped,
                "elapsed_s": self.elapsed_s, "best_gflops": {dtype: self.best_gflops(dtype) for dtype in self.gflops}}


class _Gemm:
    """(m x k) @ (k x n) in one dtype, its operands made once."""

    def __init__(self, torch, m: int, k: int, n: int, dtype):
        gen = torch.Generator().manual_seed(0)
        self.torch, self.flops, self.name = torch, 2 * m * k * n, f"{m}x{k}x{n}"
        self.a = torch.randn(m, k, generator=gen).to(dtype)
        self.b = torch.randn(k, n, generator=gen).to(dtype)
        self.out = torch.empty(m, n, dtype=dtype)

    def once_s(self) -> float:
        start = time.perf_counter()
        self.torch.mm(self.a, self.b, out=self.out)
        return max(time.perf_counter() - start, 1e-9)

    def sustained_gflops(self, budget_s: float) -> float:
        """Warm-up, then three groups of calls filling about budget_s; the best group's mean rate."""
        self.once_s()  # kernel selection, page faults of `out`
        per_group = max(1, int(budget_s / 3 / self.once_s()))
        best_s = min(sum(self.once_s() for _ in range(per_group)) / per_group for _ in range(3))
        return self.flops / best_s / 1e9


def measure_gemm_roof(num_threads: int, *, spec: ModelShape | None = None, dtypes: tuple[str, ...] = DTYPES,
                      shapes: list[tuple[int, int, int]] | None = None, budget_s: float = 4.0,
                      square_sizes: tuple[int, ...] = SQUARE_SIZES) -> GemmRoof:
    """GEMM GFLOPS for each dtype on `num_threads` torch threads (restored afterwards).

    Per dtype: a square GEMM as large as the budget allows (the ladder `square_sizes`, climbed
    while the next size's call, estimated at 8x the last, fits a quarter of a shape's share of
    the budget), then `shapes` (default: gemm_shapes(spec)). A shape whose one call, estimated
    at the smallest square's rate, would not fit that quarter is skipped and says so: on a CPU
    without bf16 instructions torch's bf16 GEMM can run at ~1 GFLOPS, and one 2048^3 call would
    take a minute.
    """
    import torch

    shapes = gemm_shapes(spec) if shapes is None else shapes
    per_shape_s = budget_s / len(dtypes) / (1 + len(shapes))
    max_call_s = per_shape_s / 4
    saved = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    roof = GemmRoof(num_threads)
    started = time.perf_counter()
    try:
        with torch.inference_mode():
            for dtype_name in dtypes:
                dtype = getattr(torch, dtype_name)
                gflops, skipped = roof.gflops.setdefault(dtype_name, {}), roof.skipped.setdefault(dtype_name, {})
                square, probe_gflops = None, None
                for size in square_sizes:
                    gemm = _Gemm(torch, size, size, size, dtype)
                    gemm.once_s()  # warm-up
                    call_s = gemm.once_s()
                    square, probe_gflops = gemm, probe_gflops or gemm.flops / call_s / 1e9
                    if call_s * 8 > max_call_s:
                        break
                gflops[square.name] = square.sustained_gflops(per_shape_s)
                for m, k, n in shapes:
                    estimate_s = 2 * m * k * n / (probe_gflops * 1e9)
                    if estimate_s > max_call_s:
                        skipped[f"{m}x{k}x{n}"] = (f"one call ~{estimate_s:.2g} s at {probe_gflops:.3g} GFLOPS "
                                                   f"(the {square_sizes[0]}^3 rate), over {max_call_s:.2g} s")
                        continue
                    gemm = _Gemm(torch, m, k, n, dtype)
                    gflops[gemm.name] = gemm.sustained_gflops(per_shape_s)
    finally:
        torch.set_num_threads(saved)
    roof.elapsed_s = time.perf_counter() - started
    return roof


@contextlib.contextmanager
def torch_threads(num: int):
    """torch's intra-op threads set to `num` for a measurement, put back afterwards."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(num)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def resolve_dtype(requested: str, model_dir):
    """The dtype a one-thread kvrelay replica resolves `requested` to on this machine (`auto`
    measures: serving/engine/modeling/dtype_choice.py). Benchmarks run every system in it."""
    import torch

    from serving.engine.modeling.dtype_choice import choose_dtype
    from serving.engine.modeling.loader import load_model_spec

    with torch_threads(1):
        return choose_dtype(requested, torch.device("cpu"), hidden_size=load_model_spec(model_dir).hidden_size)
