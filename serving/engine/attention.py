"""Paged attention on flat K/V slot arrays, in plain PyTorch.

The cache of one layer is `[num_blocks, block_size, kv_heads, head_dim]`; a token's slot in its
flat view is `block_id * block_size + offset`. New K/V are written by slot; contexts are read by
whole blocks (a block is one contiguous run of memory, so gathering blocks rather than slots
moves the same bytes in far fewer, larger copies). A step's tokens are laid out as

    [ decode tokens (one per sequence) | prefill chunk 0 | prefill chunk 1 | ... ]

Decodes are batched into one SDPA call over their gathered, right-padded contexts; each
prefill chunk gets its own call with a causal mask shifted by the tokens already cached.
Grouped-query attention never repeats K/V: the `group` query heads that share a KV head are
folded into the query-length axis, `[kv_heads, group * q_len, head_dim]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["PrefillChunk", "AttentionMetadata", "paged_attention"]


@dataclass
class PrefillChunk:
    q_start: int  # offset of the chunk's first token in the step's token array
    q_len: int
    ctx_len: int  # tokens attended to: those cached before the chunk plus the chunk
    block_ids: torch.Tensor  # [ceil(ctx_len / block_size)] the blocks holding them
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, None when plain causal (ctx_len == q_len)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [B, max_blocks] padded with block 0
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] bool, True = attend
    prefills: list[PrefillChunk]


def paged_attention(
    q: torch.Tensor,  # [T, heads, d]
    k_cache: torch.Tensor,  # [blocks, block_size, kv_heads, d] (already holds this step's K/V)
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, heads * d]
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = q.new_empty(num_tokens, num_heads * head_dim)

    b = meta.num_decode_tokens
    if b:
        qd = q[:b].view(b, num_kv_heads, group, head_dim)
        k = _gather(k_cache, meta.decode_block_tables)  # [B, kvh, L, d]
        v = _gather(v_cache, meta.decode_block_tables)
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=meta.decode_mask, scale=scale)
        out[:b] = o.reshape(b, num_heads * head_dim)

    for chunk in meta.prefills:
        n = chunk.q_len
        qc = q[chunk.q_start : chunk.q_start + n].transpose(0, 1).unsqueeze(0)  # [1, h, n, d]
        k = _gather(k_cache, chunk.block_ids[None])[:, :, : chunk.ctx_len]  # [1, kvh, L, d]
        v = _gather(v_cache, chunk.block_ids[None])[:, :, : chunk.ctx_len]
        o = F.scaled_dot_product_attention(
            qc,
            k,
            v,
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=scale,
            enable_gqa=group > 1,
        )
        out[chunk.q_start : chunk.q_start + n] = o[0].transpose(0, 1).reshape(n, num_heads * head_dim)
    return out


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[B, max_blocks] block ids -> [B, kv_heads, max_blocks * block_size, d]."""
    b, n = tables.shape
    _, block_size, kv_heads, d = cache.shape
    blocks = cache.index_select(0, tables.reshape(-1))
    return blocks.view(b, n * block_size, kv_heads, d).transpose(1, 2)
