"""Paged attention on flat K/V slot arrays, in plain PyTorch.

The cache of one layer is a flat array of slots, `[num_blocks * block_size, kv_heads, head_dim]`;
a token's slot is `block_id * block_size + offset`. A step's tokens are laid out as

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
    context_slots: torch.Tensor  # [ctx_len] slot ids of every token the chunk attends to
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, None when plain causal (ctx_len == q_len)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    num_decode_tokens: int
    decode_slots: torch.Tensor | None  # [B, max_ctx] padded with slot 0
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_ctx] bool, True = attend
    prefills: list[PrefillChunk]


def paged_attention(
    q: torch.Tensor,  # [T, heads, d]
    k_cache: torch.Tensor,  # [slots, kv_heads, d] (already holds this step's K/V)
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, heads * d]
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = q.new_empty(num_tokens, num_heads * head_dim)

    b = meta.num_decode_tokens
    if b:
        qd = q[:b].view(b, num_kv_heads, group, head_dim)
        k = k_cache[meta.decode_slots].transpose(1, 2)  # [B, kvh, L, d]
        v = v_cache[meta.decode_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=meta.decode_mask, scale=scale)
        out[:b] = o.reshape(b, num_heads * head_dim)

    for chunk in meta.prefills:
        n = chunk.q_len
        qc = q[chunk.q_start : chunk.q_start + n].transpose(0, 1).unsqueeze(0)  # [1, h, n, d]
        k = k_cache[chunk.context_slots].transpose(0, 1).unsqueeze(0)  # [1, kvh, L, d]
        v = v_cache[chunk.context_slots].transpose(0, 1).unsqueeze(0)
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
