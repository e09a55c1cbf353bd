"""load_tests/roofline.py: the model-FLOP formulas on a small made-up model (exact), the compute
roof fraction, and the GEMM measurement's shape and bookkeeping (no timed assert)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from load_tests.roofline import (
    GemmRoof,
    compute_roof_fraction,
    flops_per_token,
    gemm_shapes,
    lm_head_params,
    matmul_params_per_layer,
    measure_gemm_roof,
    workload_flops,
)


@dataclass(frozen=True)
class Spec:
    vocab_size: int = 32
    hidden_size: int = 8
    intermediate_size: int = 16
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 4


SPEC = Spec()
SMOLLM2_135M = Spec(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                    num_kv_heads=3, head_dim=64)


def test_params_per_layer_and_lm_head():
    # q 8x8 + o 8x8 = 128, k and v 8x4 each = 64, gate/up/down 3 x 8x16 = 384
    assert matmul_params_per_layer(SPEC) == 576
    assert lm_head_params(SPEC) == 256


def test_flops_per_token():
    # 2 x (2 layers x 576 + 256) + 4 x 2 layers x 2 heads x 4 x 10 positions
    assert flops_per_token(SPEC, 10) == 2816 + 640
    assert flops_per_token(SPEC, 10, with_lm_head=False) == 2304 + 640
    # SmolLM2-135M: ~0.27 GFLOP per token before attention (../shared/PEERS.md)
    assert flops_per_token(SMOLLM2_135M, 0) == 268_959_744


def test_workload_flops_is_the_sum_over_positions():
    # 3 requests, 5 prompt tokens, 3 output tokens: 7 positions each, the lm head on the last 3
    per_request = 2 * 2 * 576 * 7 + 2 * 256 * 3 + 4 * 2 * 2 * 4 * (7 * 8 // 2)
    assert per_request == 19456
    assert workload_flops(SPEC, num_requests=3, prompt_len=5, output_len=3) == 3 * 19456
    by_position = sum(flops_per_token(SPEC, j + 1, with_lm_head=j >= 4) for j in range(7))
    assert by_position == 19456


def test_compute_roof_fraction():
    assert compute_roof_fraction(1_600_000_000_000, 16.0, 400e9) == 0.25
    assert compute_roof_fraction(1e12, None, 400e9) is None
    assert compute_roof_fraction(1e12, 16.0, None) is None
    assert compute_roof_fraction(1e12, 0.0, 400e9) is None


def test_gemm_shapes():
    assert gemm_shapes() == []
    assert gemm_shapes(SPEC) == [(64, 8, 16), (512, 8, 16), (512, 16, 8)]  # MLP up, up, down


def test_gemm_roof_best_and_json():
    roof = GemmRoof(2, {"bfloat16": {"a": 300.0, "b": 420.0}, "float32": {"a": 180.0}},
                    skipped={"bfloat16": {"c": "too slow"}}, elapsed_s=3.0)
    assert roof.best_gflops("bfloat16") == 420.0
    assert roof.best_gflops("float16") is None
    assert roof.to_json() == {
        "num_threads": 2, "gflops_by_shape": roof.gflops, "skipped_shapes": {"bfloat16": {"c": "too slow"}},
        "elapsed_s": 3.0, "best_gflops": {"bfloat16": 420.0, "float32": 180.0},
    }


def test_measure_gemm_roof_on_tiny_shapes_restores_threads():
    threads = torch.get_num_threads()
    roof = measure_gemm_roof(1, shapes=[(16, 32, 8), (4, 8, 8)], budget_s=0.06, square_sizes=(8, 16))
    assert torch.get_num_threads() == threads
    assert roof.num_threads == 1
    assert list(roof.gflops) == ["bfloat16", "float32"]
    for dtype, by_shape in roof.gflops.items():
        square = next(iter(by_shape))
        assert square in ("8x8x8", "16x16x16"), square  # as far up the ladder as the budget allows
        timed = set(by_shape) - {square}
        assert timed | set(roof.skipped[dtype]) == {"16x32x8", "4x8x8"}  # each shape timed or said why not
        assert not timed & set(roof.skipped[dtype])
        assert all(v > 0 for v in by_shape.values())
    with pytest.raises(AttributeError):
        measure_gemm_roof(1, dtypes=("no_such_dtype",), shapes=[(4, 4, 4)], budget_s=0.01)
    assert torch.get_num_threads() == threads


def test_a_shape_too_slow_for_the_budget_is_skipped_and_named():
    # a budget no real call fits: the square stays at the ladder's first rung, every shape is skipped
    roof = measure_gemm_roof(1, dtypes=("float32",), shapes=[(512, 512, 512)], budget_s=1e-9, square_sizes=(64, 128))
    assert list(roof.gflops["float32"]) == ["64x64x64"]
    assert list(roof.skipped["float32"]) == ["512x512x512"]
    assert roof.skipped["float32"]["512x512x512"].startswith("one call ~")
