"""Paged attention on flat K/V slot arrays, in plain PyTorch.

The cache of one layer is `[num_blocks, kv_heads, block_size, head_dim]`: one head's rows of a
block are contiguous. A token lives at (block_id, offset) = divmod(slot, block_size). A step's
tokens are laid out as

    [ decode tokens (one per sequence) | prefill chunk 0 | prefill chunk 1 | ... ]

Decodes go to the native kernel (csrc/paged_attention.cpp), which reads K/V through the block
tables without copying them; without it (or on CUDA) they are gathered by whole blocks and
batched into one SDPA call with a padding mask. Each prefill chunk gets its own SDPA call over
its gathered context, with a causal mask shifted by the tokens already cached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from serving.engine.modeling.cpu_kernels import native_kernels

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
    decode_block_tables: torch.Tensor | None  # [B, max_blocks] int64, padded with block 0
    decode_context_lens: torch.Tensor | None  # [B] int64
    prefills: list[PrefillChunk]
    # The same rows over the sliding layers' pool (kv/cache.py), which their attention reads;
    # None: one pool
    sliding: AttentionMetadata | None = None

    def for_layer(self, window: int) -> AttentionMetadata:
        """The metadata a layer with this window (0: none) reads and writes its KV by."""
        return self.sliding if window and self.sliding is not None else self


def paged_attention(
    q: torch.Tensor,  # [T, heads, d]
    k_cache: torch.Tensor,  # [blocks, kv_heads, block_size, d] (already holds this step's K/V)
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,  # a sliding window: a token at position i sees keys i - window + 1 .. i; 0: all
    softcap: float = 0.0,  # Gemma 2: scores -> tanh(scores / softcap) * softcap before the softmax
) -> torch.Tensor:  # [T, heads * d]
    if softcap:
        return _softcapped_attention(q, k_cache, v_cache, meta, scale, window, softcap)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = q.new_empty(num_tokens, num_heads * head_dim)

    b = meta.num_decode_tokens
    if b:
        kernels = native_kernels() if q.device.type == "cpu" else None
        if kernels is not None:
            o = kernels.paged_decode_attention(
                q[:b], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale, window
            )
            out[:b] = o.view(b, num_heads * head_dim)
        else:
            out[:b] = _decode_attention_torch(q[:b], k_cache, v_cache, meta, scale, window)

    for chunk in meta.prefills:
        n = chunk.q_len
        qc = q[chunk.q_start : chunk.q_start + n].transpose(0, 1).unsqueeze(0)  # [1, h, n, d]
        k = _gather(k_cache, chunk.block_ids[None])[:, :, : chunk.ctx_len]  # [1, kvh, L, d]
        v = _gather(v_cache, chunk.block_ids[None])[:, :, : chunk.ctx_len]
        mask = _window_mask(chunk, window, q.device) if window and chunk.ctx_len > window else chunk.mask
        o = F.scaled_dot_product_attention(
            qc,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=group > 1,
        )
        out[chunk.q_start : chunk.q_start + n] = o[0].transpose(0, 1).reshape(n, num_heads * head_dim)
    return out


def _softcapped_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int,
                          softcap: float) -> torch.Tensor:
    """Attention with soft-capped scores (Gemma 2), explicitly, as transformers' eager attention:
    scores = tanh(q.k * scale / softcap) * softcap, masked, softmax in fp32. Decode rows and
    prefill chunks alike, each over its gathered context."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[1]
    out = q.new_empty(num_tokens, num_heads * head_dim)

    def attend(rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        # rows [n, h, d]; k, v [kvh, L, d]; visible [n, L]
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
        scores = torch.einsum("nhd,hld->hnl", rows, k) * scale
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~visible[None], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        return torch.einsum("hnl,hld->nhd", probs, v).reshape(rows.shape[0], num_heads * head_dim)

    for b in range(meta.num_decode_tokens):
        length = int(meta.decode_context_lens[b])
        k = _gather(k_cache, meta.decode_block_tables[b : b + 1])[0, :, :length]
        v = _gather(v_cache, meta.decode_block_tables[b : b + 1])[0, :, :length]
        positions = torch.arange(length, device=q.device)
        visible = (positions >= length - window if window else positions >= 0)[None]
        out[b] = attend(q[b : b + 1], k, v, visible)[0]
    for chunk in meta.prefills:
        k = _gather(k_cache, chunk.block_ids[None])[0, :, : chunk.ctx_len]
        v = _gather(v_cache, chunk.block_ids[None])[0, :, : chunk.ctx_len]
        visible = _window_mask(chunk, window or chunk.ctx_len, q.device)
        out[chunk.q_start : chunk.q_start + chunk.q_len] = attend(q[chunk.q_start : chunk.q_start + chunk.q_len], k, v, visible)
    return out


def _window_mask(chunk: PrefillChunk, window: int, device: torch.device) -> torch.Tensor:
    """[q_len, ctx_len] bool: causal within a sliding window. The chunk's queries are the last
    q_len positions of its context."""
    q_pos = torch.arange(chunk.ctx_len - chunk.q_len, chunk.ctx_len, device=device)[:, None]
    k_pos = torch.arange(chunk.ctx_len, device=device)[None, :]
    return (k_pos <= q_pos) & (k_pos > q_pos - window)


def _decode_attention_torch(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int = 0) -> torch.Tensor:
    b, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    tables = meta.decode_block_tables
    k = _gather(k_cache, tables)
    v = _gather(v_cache, tables)
    positions = torch.arange(k.shape[2], device=q.device)
    lens = meta.decode_context_lens[:, None]
    visible = positions[None, :] < lens
    if window:
        visible &= positions[None, :] >= lens - window
    mask = visible[:, None, None, :]
    # GQA without repeating K/V: the query heads sharing a KV head become query rows.
    qd = q.view(b, num_kv_heads, num_heads // num_kv_heads, head_dim)
    o = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale)
    return o.reshape(b, num_heads * head_dim)


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[B, max_blocks] block ids -> [B, kv_heads, max_blocks * block_size, d] (a copy)."""
    b, n = tables.shape
    _, kv_heads, block_size, d = cache.shape
    blocks = cache.index_select(0, tables.reshape(-1)).view(b, n, kv_heads, block_size, d)
    return blocks.transpose(1, 2).reshape(b, kv_heads, n * block_size, d)
