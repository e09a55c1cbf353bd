"""The Llama-family forward pass (Llama, SmolLM2, Qwen2, Mistral without sliding window).

    embed ─▶ [ RMSNorm ─▶ QKV (fused) ─▶ RoPE ─▶ write K/V to paged cache ─▶ paged attention
               ─▶ O proj ─▶ +residual ─▶ RMSNorm ─▶ gate|up (fused) ─▶ SiLU·up ─▶ down ─▶ +residual ] × L
          ─▶ RMSNorm ─▶ lm_head (only at the positions that sample)

Weights are plain tensors (no nn.Module): fewer Python layers per op, which is most of the
cost of a small-batch decode step on CPU. On CPU the glue between the matrix products (residual
add + RMSNorm, RoPE + cache write, SiLU·up) runs as fused native kernels (cpu_kernels.py); the
plain PyTorch path computes the same thing elsewhere. Numerics follow transformers'
LlamaForCausalLM, rounding step for step, so fp32 runs match it token for token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from serving.engine.attention import AttentionMetadata, paged_attention
from serving.engine.cpu_kernels import native_kernels
from serving.engine.errors import ModelLoadError
from serving.engine.model_loader import ModelSpec

__all__ = ["LlamaModel"]

logger = logging.getLogger(__name__)

# Up to this many rows, bf16 matrix products use the native GEMV (memory-bound regime).
SMALL_M = 8


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_w: torch.Tensor
    gate_up_b: torch.Tensor | None
    down_w: torch.Tensor
    down_b: torch.Tensor | None


class LlamaModel:
    def __init__(
        self,
        spec: ModelSpec,
        state_dict: dict[str, torch.Tensor],
        *,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.spec = spec
        self.dtype = dtype
        self.device = device
        self.scale = spec.head_dim**-0.5
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim

        def take(name: str, required: bool = True) -> torch.Tensor | None:
            tensor = state_dict.pop(name, None)
            if tensor is None:
                if required:
                    raise ModelLoadError(f"weight {name!r} missing from {spec.path}")
                return None
            return tensor.to(device=device, dtype=dtype).contiguous()

        def cat(*tensors: torch.Tensor | None) -> torch.Tensor | None:
            if all(t is None for t in tensors):
                return None
            return torch.cat(list(tensors)).contiguous()

        self.embed = take("model.embed_tokens.weight")
        self.layers: list[_Layer] = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            attn_bias = spec.attention_bias
            self.layers.append(
                _Layer(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv_w=cat(
                        take(p + "self_attn.q_proj.weight"),
                        take(p + "self_attn.k_proj.weight"),
                        take(p + "self_attn.v_proj.weight"),
                    ),
                    qkv_b=cat(
                        take(p + "self_attn.q_proj.bias", attn_bias),
                        take(p + "self_attn.k_proj.bias", attn_bias),
                        take(p + "self_attn.v_proj.bias", attn_bias),
                    ),
                    o_w=take(p + "self_attn.o_proj.weight"),
                    o_b=take(p + "self_attn.o_proj.bias", False),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up_w=cat(take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")),
                    gate_up_b=cat(
                        take(p + "mlp.gate_proj.bias", spec.mlp_bias),
                        take(p + "mlp.up_proj.bias", spec.mlp_bias),
                    ),
                    down_w=take(p + "mlp.down_proj.weight"),
                    down_b=take(p + "mlp.down_proj.bias", spec.mlp_bias),
                )
            )
        self.norm = take("model.norm.weight")
        lm_head = take("lm_head.weight", required=not spec.tie_word_embeddings)
        self.lm_head = self.embed if lm_head is None else lm_head
        self.cos, self.sin = _rope_tables(spec, device, dtype)

    @property
    def num_weight_bytes(self) -> int:
        tensors = [self.embed, self.norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        for layer in self.layers:
            tensors += [t for t in vars(layer).values() if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # transformers' LlamaRMSNorm: normalise in fp32, round to the model dtype, then scale.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.spec.rms_norm_eps)
        return weight * x32.to(x.dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden] after the final norm
        kernels = native_kernels() if self.device.type == "cpu" else None
        if kernels is None:
            return self._forward_torch(input_ids, positions, kv_caches, meta)
        spec = self.spec
        eps = spec.rms_norm_eps
        num_tokens = input_ids.shape[0]
        h = F.embedding(input_ids, self.embed)
        cos = self.cos.index_select(0, positions)
        sin = self.sin.index_select(0, positions)
        # A few rows (decoding a small batch) stream the weights through our GEMV instead.
        linear = F.linear
        if self.dtype == torch.bfloat16 and num_tokens <= SMALL_M:
            linear = kernels.small_m_linear
        delta = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = kernels.add_rms_norm(h, delta, layer.input_norm, eps)  # h += delta
            qkv = linear(x, layer.qkv_w, layer.qkv_b)
            kernels.rope_cache_write(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, spec.num_heads)
            q = qkv[:, : self.q_size].view(num_tokens, spec.num_heads, spec.head_dim)
            attn = paged_attention(q, k_cache, v_cache, meta, self.scale)
            delta = linear(attn, layer.o_w, layer.o_b)
            x = kernels.add_rms_norm(h, delta, layer.post_norm, eps)
            act = kernels.silu_mul(linear(x, layer.gate_up_w, layer.gate_up_b))
            delta = linear(act, layer.down_w, layer.down_b)
        return kernels.add_rms_norm(h, delta, self.norm, eps)

    def _forward_torch(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        """The same computation in plain PyTorch ops (CUDA, or no C++ compiler)."""
        spec = self.spec
        num_tokens = input_ids.shape[0]
        h = F.embedding(input_ids, self.embed)
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, d]
        sin = self.sin[positions].unsqueeze(1)
        qk_heads = spec.num_heads + spec.num_kv_heads
        block_size = kv_caches[0][0].shape[2]
        write_blocks = meta.slot_mapping // block_size
        write_offsets = meta.slot_mapping % block_size
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = self._rms_norm(h, layer.input_norm)
            qkv = F.linear(x, layer.qkv_w, layer.qkv_b)
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, qk_heads, spec.head_dim)
            qk = _apply_rope(qk, cos, sin)
            q = qk[:, : spec.num_heads]
            k = qk[:, spec.num_heads :]
            v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, spec.num_kv_heads, spec.head_dim)
            k_cache[write_blocks, :, write_offsets] = k
            v_cache[write_blocks, :, write_offsets] = v
            attn = paged_attention(q, k_cache, v_cache, meta, self.scale)
            h = h + F.linear(attn, layer.o_w, layer.o_b)
            x = self._rms_norm(h, layer.post_norm)
            gate, up = F.linear(x, layer.gate_up_w, layer.gate_up_b).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer.down_w, layer.down_b)
        return self._rms_norm(h, self.norm)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, vocab] float32
        kernels = native_kernels() if self.device.type == "cpu" else None
        if kernels is not None and self.dtype == torch.bfloat16 and 0 < hidden.shape[0] <= SMALL_M:
            return kernels.small_m_linear(hidden, self.lm_head, None).float()
        return F.linear(hidden, self.lm_head).float()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _rope_tables(spec: ModelSpec, device: torch.device, dtype: torch.dtype):
    """cos/sin for every position, [max_pos, head_dim], from transformers' rope init functions."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = spec.hf_config
    rope_type = spec.rope_type
    if rope_type == "default":
        base = config.rope_parameters["rope_theta"]
        inv_freq = 1.0 / (
            base ** (torch.arange(0, spec.head_dim, 2, dtype=torch.int64).float() / spec.head_dim)
        )
        attention_scaling = 1.0
    else:
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    positions = torch.arange(spec.max_position_embeddings, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * attention_scaling).to(device=device, dtype=dtype)
    sin = (emb.sin() * attention_scaling).to(device=device, dtype=dtype)
    return cos, sin
