"""The Llama-family forward pass (Llama, SmolLM2, Qwen2, Qwen3, Mistral without sliding window, Phi-3).

    embed ─▶ [ RMSNorm ─▶ QKV (fused) ─▶ RoPE ─▶ write K/V to paged cache ─▶ paged attention
               ─▶ O proj ─▶ +residual ─▶ RMSNorm ─▶ gate|up (fused) ─▶ SiLU·up ─▶ down ─▶ +residual ] × L
          ─▶ RMSNorm ─▶ lm_head (only at the positions that sample)

Weights are plain tensors (no nn.Module): fewer Python layers per op, which is most of the
cost of a small-batch decode step on CPU. On CPU the glue between the matrix products (residual
add + RMSNorm, RoPE + cache write, SiLU·up) runs as fused native kernels (cpu_kernels.py); the
plain PyTorch path computes the same thing elsewhere. Numerics follow transformers'
LlamaForCausalLM, rounding step for step, so fp32 runs match it token for token.

Batch-invariant mode (`deterministic`, EngineConfig.deterministic): a token's numbers do not depend
on how its step was put together (batch_invariance.py says how and where it runs). The module map:

    weights.py    the checkpoint's tensors in the fused layout above
    linear.py     each linear layer's CPU routine by row count
    rope.py       the RoPE tables and rotation
    attention.py  paged attention over the KV cache
"""

from __future__ import annotations

import logging
import sys

import torch
import torch.nn.functional as F

from serving.engine.modeling.attention import AttentionMetadata, paged_attention
from serving.engine.modeling.batch_invariance import batch_invariance
from serving.engine.modeling.cpu_kernels import native_kernels
from serving.engine.modeling.linear import Linear, can_pack_bf16
from serving.engine.modeling.linear_choice import LinearChoice, choose_linear
from serving.engine.modeling.lora import LoRABatch
from serving.engine.modeling.model_spec import ModelSpec
from serving.engine.modeling.rope import apply_rope, rope_tables
from serving.engine.modeling.weights import Layer, load_weights

__all__ = ["LlamaModel"]

logger = logging.getLogger(__name__)

class LlamaModel:
    def __init__(
        self,
        spec: ModelSpec,
        state_dict: dict[str, torch.Tensor],
        *,
        dtype: torch.dtype,
        device: torch.device,
        deterministic: bool | str = False,
        speculative: bool = False,
    ):
        self.spec = spec
        self.dtype = dtype
        self.device = device
        self._lora: LoRABatch | None = None  # set per forward pass
        self.is_batch_invariant, invariance_reason = batch_invariance(
            deterministic, device, dtype, native_kernels(), speculative=speculative)
        if spec.family == "gemma" and self.is_batch_invariant:
            self.is_batch_invariant, invariance_reason = False, "off: Gemma runs the PyTorch path, not the native kernels"
        self.invariance_reason = invariance_reason
        if deterministic is True and not self.is_batch_invariant:
            logger.warning("deterministic: batch-invariant kernels unavailable, results may vary with the batch: %s", invariance_reason)
        self.scale = spec.head_dim**-0.5
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim

        # Pre-packed oneDNN weights pay off for bf16 on CPU (see Linear); elsewhere plain ones.
        # Batch-invariant mode runs no oneDNN linear: no packed copies.
        pack = (
            not self.is_batch_invariant and device.type == "cpu" and dtype == torch.bfloat16
            and native_kernels() is not None and can_pack_bf16()
        )
        weights = load_weights(spec, state_dict, dtype=dtype, device=device, pack=pack, invariant=self.is_batch_invariant)
        self.embed, self.layers, self.norm, self.lm_head = weights.embed, weights.layers, weights.norm, weights.lm_head
        if spec.layer_rope_types:  # Gemma 3: a table per layer type (local and global bases)
            tables = {t: rope_tables(spec, device, dtype, t) for t in set(spec.layer_rope_types)}
            self.layer_rope = [tables[t] for t in spec.layer_rope_types]
            self.cos, self.sin = self.layer_rope[0]
        else:
            self.cos, self.sin = rope_tables(spec, device, dtype)
            self.layer_rope = [(self.cos, self.sin)] * spec.num_layers
        if spec.query_scale is not None:
            self.scale = spec.query_scale
        if self.is_batch_invariant:
            self.linear_choice = LinearChoice(sys.maxsize, "batch-invariant mode: every row count, one summation order")
        else:
            self.linear_choice = self._choose_linear()
        self.native_rows = self.linear_choice.native_max_rows

    def _choose_linear(self) -> LinearChoice:
        """Up to how many rows the native kernel runs the linear layers, measured on this
        model's weights (linear_choice.py)."""
        kernels = native_kernels() if self.device.type == "cpu" else None
        if kernels is None:
            return LinearChoice(0, "no native kernels")
        linears = [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return choose_linear(
            linears, lambda lin, x: kernels.small_m_linear(x, lin.weight, lin.bias), lambda lin, x: lin(x), self.dtype,
        )

    @property
    def num_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads (the embedding table only once, if tied)."""
        total = sum(t.numel() * t.element_size() for t in (self.embed, self.norm))
        if self.lm_head.weight is not self.embed:
            total += self.lm_head.num_bytes
        for layer in self.layers:
            total += layer.input_norm.numel() * layer.input_norm.element_size() * 2
            total += sum(lin.num_bytes for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
        return total

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # transformers' LlamaRMSNorm: normalise in fp32, round to the model dtype, then scale.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.spec.rms_norm_eps)
        return weight * x32.to(x.dtype)

    def _lin(self, index: int, name: str, linear: Linear, x: torch.Tensor, kernels=None, rows: int = 0) -> torch.Tensor:
        """Layer `index`'s linear `name` on x, plus the step's LoRA adapters' products (lora.py)."""
        y = linear(x, kernels, rows) if kernels is not None else linear(x)
        return y if self._lora is None else self._lora.apply(y, x, index, name)

    def _qk_norm(self, qkv: torch.Tensor, layer: Layer) -> None:
        """Qwen3: RMSNorm over each query and key head (head_dim), in place, before RoPE."""
        num_tokens, spec = qkv.shape[0], self.spec
        q = qkv[:, : self.q_size].view(num_tokens, spec.num_heads, spec.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(num_tokens, spec.num_kv_heads, spec.head_dim)
        qkv[:, : self.q_size] = self._rms_norm(q, layer.q_norm).view(num_tokens, self.q_size)
        qkv[:, self.q_size : self.q_size + self.kv_size] = self._rms_norm(k, layer.k_norm).view(num_tokens, self.kv_size)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:  # [T, hidden] after the final norm
        self._lora = lora  # the step's adapters (lora.py), read by _lin
        if self.spec.family == "gemma":
            return self._forward_gemma(input_ids, positions, kv_caches, meta)
        kernels = native_kernels() if self.device.type == "cpu" else None
        if kernels is None:
            return self._forward_torch(input_ids, positions, kv_caches, meta)
        spec = self.spec
        eps = spec.rms_norm_eps
        num_tokens = input_ids.shape[0]
        h = F.embedding(input_ids, self.embed)
        cos = self.cos.index_select(0, positions)
        sin = self.sin.index_select(0, positions)
        delta = None
        rows = self.native_rows
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            x = kernels.add_rms_norm(h, delta, layer.input_norm, eps)  # h += delta
            qkv = self._lin(i, "qkv", layer.qkv, x, kernels, rows)
            if layer.q_norm is not None:
                self._qk_norm(qkv, layer)
            m = meta.for_layer(spec.window(i))
            kernels.rope_cache_write(qkv, cos, sin, k_cache, v_cache, m.slot_mapping, spec.num_heads)
            q = qkv[:, : self.q_size].view(num_tokens, spec.num_heads, spec.head_dim)
            attn = paged_attention(q, k_cache, v_cache, m, self.scale, spec.window(i))
            delta = self._lin(i, "o", layer.o, attn, kernels, rows)
            x = kernels.add_rms_norm(h, delta, layer.post_norm, eps)
            act = kernels.silu_mul(self._lin(i, "gate_up", layer.gate_up, x, kernels, rows))
            delta = self._lin(i, "down", layer.down, act, kernels, rows)
        return kernels.add_rms_norm(h, delta, self.norm, eps)

    def _forward_torch(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        """The same computation in plain PyTorch ops (CUDA, or no C++ compiler)."""
        spec = self.spec
        num_tokens = input_ids.shape[0]
        h = F.embedding(input_ids, self.embed)
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, d]
        sin = self.sin[positions].unsqueeze(1)
        qk_heads = spec.num_heads + spec.num_kv_heads
        writes = _write_slots(meta, kv_caches[0][0].shape[2])
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            x = self._rms_norm(h, layer.input_norm)
            qkv = self._lin(i, "qkv", layer.qkv, x)
            if layer.q_norm is not None:
                self._qk_norm(qkv, layer)
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, qk_heads, spec.head_dim)
            qk = apply_rope(qk, cos, sin)
            q = qk[:, : spec.num_heads]
            k = qk[:, spec.num_heads :]
            v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, spec.num_kv_heads, spec.head_dim)
            m = meta.for_layer(spec.window(i))
            write_blocks, write_offsets = writes[m is not meta]
            k_cache[write_blocks, :, write_offsets] = k
            v_cache[write_blocks, :, write_offsets] = v
            attn = paged_attention(q, k_cache, v_cache, m, self.scale, spec.window(i))
            h = h + self._lin(i, "o", layer.o, attn)
            x = self._rms_norm(h, layer.post_norm)
            gate, up = self._lin(i, "gate_up", layer.gate_up, x).chunk(2, dim=-1)
            h = h + self._lin(i, "down", layer.down, F.silu(gate) * up)
        return self._rms_norm(h, self.norm)

    def _gemma_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Gemma3RMSNorm: normalise and scale in fp32 (weight is 1 + w already), then round."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.spec.rms_norm_eps)
        return (x32 * weight).to(x.dtype)

    def _forward_gemma(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        """Gemma 2/3 (transformers' Gemma3DecoderLayer): a norm before and after attention and
        before and after the MLP, GeGLU, the embedding times sqrt(hidden) in the model dtype, q/k
        norms (Gemma 3), a RoPE table per layer type (Gemma 3), sliding layers interleaved, and
        soft-capped attention scores (Gemma 2). PyTorch ops, the paged attention of attention.py."""
        spec = self.spec
        num_tokens = input_ids.shape[0]
        h = F.embedding(input_ids, self.embed) * torch.tensor(spec.hidden_size**0.5, dtype=self.dtype)
        qk_heads = spec.num_heads + spec.num_kv_heads
        writes = _write_slots(meta, kv_caches[0][0].shape[2])
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            cos_table, sin_table = self.layer_rope[i]
            cos, sin = cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)
            x = self._gemma_norm(h, layer.input_norm)
            qkv = self._lin(i, "qkv", layer.qkv, x)
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, qk_heads, spec.head_dim)
            if layer.q_norm is not None:
                qk = torch.cat((self._gemma_norm(qk[:, : spec.num_heads], layer.q_norm),
                                self._gemma_norm(qk[:, spec.num_heads :], layer.k_norm)), dim=1)
            qk = apply_rope(qk, cos, sin)
            q, k = qk[:, : spec.num_heads], qk[:, spec.num_heads :]
            v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, spec.num_kv_heads, spec.head_dim)
            m = meta.for_layer(spec.window(i))
            write_blocks, write_offsets = writes[m is not meta]
            k_cache[write_blocks, :, write_offsets] = k
            v_cache[write_blocks, :, write_offsets] = v
            attn = paged_attention(q.contiguous(), k_cache, v_cache, m, self.scale, spec.window(i),
                                   softcap=spec.attn_softcap or 0.0)
            h = h + self._gemma_norm(self._lin(i, "o", layer.o, attn), layer.post_norm)
            x = self._gemma_norm(h, layer.pre_ff_norm)
            gate, up = self._lin(i, "gate_up", layer.gate_up, x).chunk(2, dim=-1)
            h = h + self._gemma_norm(self._lin(i, "down", layer.down, F.gelu(gate, approximate="tanh") * up),
                                     layer.post_ff_norm)
        return self._gemma_norm(h, self.norm)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, vocab] float32
        kernels = native_kernels() if self.device.type == "cpu" else None
        logits = self.lm_head(hidden, kernels, self.native_rows)
        cap = self.spec.final_softcap
        if cap:  # Gemma 2: logits soft-capped to (-cap, cap), in the model dtype as transformers does
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


def _write_slots(meta: AttentionMetadata, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(block, offset) of each new token's K/V: in the full layers' pool, then the sliding layers'."""
    metas = [meta] + ([meta.sliding] if meta.sliding is not None else [])
    return [(m.slot_mapping // block_size, m.slot_mapping % block_size) for m in metas]
