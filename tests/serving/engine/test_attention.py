"""The native decode kernel against the PyTorch path, and against plain attention."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from serving.engine.modeling.attention import AttentionMetadata, _decode_attention_torch
from serving.engine.modeling.cpu_kernels import native_kernels


def make_case(dtype, *, num_seqs=5, num_heads=6, num_kv_heads=2, head_dim=64, block_size=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 40
    k_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=gen).to(dtype)
    lens = torch.tensor([1, 4, 5, 17, 30][:num_seqs], dtype=torch.long)
    max_blocks = int(-(-lens.max() // block_size))
    tables = torch.randperm(num_blocks, generator=gen)[: num_seqs * max_blocks].view(num_seqs, max_blocks)
    q = torch.randn(num_seqs, num_heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), num_seqs, tables, lens, [])
    return q, k_cache, v_cache, meta


def reference(q, k_cache, v_cache, meta, scale):
    """Per sequence: gather its context token by token and run plain attention in fp32."""
    outs = []
    block_size = k_cache.shape[2]
    group = q.shape[1] // k_cache.shape[1]
    for b in range(q.shape[0]):
        n = int(meta.decode_context_lens[b])
        rows = [(int(meta.decode_block_tables[b, p // block_size]), p % block_size) for p in range(n)]
        k = torch.stack([k_cache[blk, :, off] for blk, off in rows], dim=1).float()  # [kvh, n, d]
        v = torch.stack([v_cache[blk, :, off] for blk, off in rows], dim=1).float()
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
        o = F.scaled_dot_product_attention(q[b].float()[:, None], k, v, scale=scale)
        outs.append(o[:, 0])
    return torch.stack(outs).flatten(1)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("head_dim", [64, 48])
def test_native_decode_kernel_matches_reference(dtype, tol, head_dim):
    kernels = native_kernels()
    assert kernels is not None, "the native kernel failed to build (see the log)"
    q, k_cache, v_cache, meta = make_case(dtype, head_dim=head_dim)
    scale = head_dim**-0.5
    expected = reference(q, k_cache, v_cache, meta, scale)
    got = kernels.paged_decode_attention(
        q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale
    )
    assert (got.float().flatten(1) - expected).abs().max().item() < tol
    torch_path = _decode_attention_torch(q, k_cache, v_cache, meta, scale)
    assert (torch_path.float() - expected).abs().max().item() < tol


def test_native_glue_kernels_match_torch():
    kernels = native_kernels()
    gen = torch.Generator().manual_seed(3)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 0.02)):
        h = torch.randn(5, 96, generator=gen).to(dtype)
        delta = torch.randn(5, 96, generator=gen).to(dtype)
        weight = torch.randn(96, generator=gen).to(dtype)
        expected_h = h + delta
        x32 = expected_h.float()
        expected = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        got = kernels.add_rms_norm(h, delta, weight, 1e-5)
        assert torch.equal(h, expected_h)  # updated in place
        assert (got.float() - expected.float()).abs().max().item() < tol * expected.abs().max().item()

        gate_up = torch.randn(4, 2 * 40, generator=gen).to(dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        expected = F.silu(gate) * up
        assert (kernels.silu_mul(gate_up).float() - expected.float()).abs().max().item() < tol * 4


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_small_m_linear_matches_torch_bf16(rows):
    kernels = native_kernels()
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 200, generator=gen).to(torch.bfloat16)  # K not a multiple of 32: tail path
    w = torch.randn(70, 200, generator=gen).to(torch.bfloat16)
    b = torch.randn(70, generator=gen).to(torch.bfloat16)
    expected = F.linear(x.float(), w.float(), b.float())
    got = kernels.small_m_linear(x, w, b).float()
    # one bf16 rounding of the product and one of the sum: well under 2% of the magnitude
    assert (got - expected).abs().max().item() <= 0.02 * expected.abs().max().item()


@pytest.mark.parametrize("rows", [1, 2, 3, 17, 64])
def test_small_m_linear_matches_torch_fp32(rows):
    """Every tile shape (full 2x4 tiles, odd rows, a ragged last block of weight rows) and a K
    that is not a multiple of the vector width: the same products as torch, to fp32 rounding."""
    kernels = native_kernels()
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 203, generator=gen)
    w = torch.randn(70, 203, generator=gen)  # 70 = 17 blocks of 4 rows + 2
    b = torch.randn(70, generator=gen)
    expected = F.linear(x.double(), w.double(), b.double())
    for bias in (b, None):
        got = kernels.small_m_linear(x, w, bias).double()
        want = expected if bias is not None else expected - b.double()
        assert got.shape == (rows, 70)
        assert (got - want).abs().max().item() < 1e-4


def test_linear_choice_takes_rows_up_to_the_first_where_native_is_not_faster():
    from serving.engine.modeling.linear_choice import LinearChoice, choose_linear

    class Lin:
        def __init__(self):
            self.weight = torch.zeros(8, 4)

    # Fake timings: native sleeps 1 ms; torch 20 ms below 16 rows, nothing from 16 on.
    def run_native(lin, x):
        time.sleep(0.001)

    def run_torch(lin, x):
        if x.shape[0] < 16:
            time.sleep(0.02)

    choice = choose_linear([Lin()], run_native, run_torch, torch.float32, working_set_bytes=1)
    assert choice.native_max_rows == 8
    measured = [part.split(":")[0] for part in choice.reason.split("rows: ")[1].split(", ")]
    assert measured == ["1", "2", "4", "8", "16"]  # stopped at the first loss
    assert choose_linear([Lin()], run_native, run_torch, torch.float16) == LinearChoice(0, "no native kernel for torch.float16")
    bf16 = choose_linear([Lin()], run_native, lambda lin, x: time.sleep(0.02), torch.bfloat16, working_set_bytes=1)
    assert bf16.native_max_rows == 8  # the bf16 kernel's limit, however fast it is
    # weights that fit in cache: torch, without timing anything
    small = choose_linear([Lin()], run_native, run_torch, torch.float32)
    assert small == LinearChoice(0, "the linear weights (0.0 MiB) fit in cache: torch's GEMM")
