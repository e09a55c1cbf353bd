"""The Llama-family forward pass (Llama, SmolLM2, Qwen2, Qwen3, Mistral without sliding window, Phi-3).

    embed ─▶ [ RMSNorm ─▶ QKV (fused) ─▶ RoPE ─▶ write K/V to paged cache ─▶ paged attention
               ─▶ O proj ─▶ +residual ─▶ RMSNorm ─▶ gate|up (fused) ─▶ SiLU·up ─▶ down ─▶ +residual ] × L
          ─▶ RMSNorm ─▶ lm_head (only at the positions that sample)

Weights are plain tensors (no nn.Module): fewer Python layers per op, which is most of the
cost of a small-batch decode step on CPU. On CPU the glue between the matrix products (residual
add + RMSNorm, RoPE + cache write, SiLU·up) runs as fused native kernels (cpu_kernels.py); the
plain PyTorch path computes the same thing elsewhere. Numerics follow transformers'
LlamaForCausalLM, rounding step for step, so fp32 runs match it token for token.

Batch-invariant mode (`deterministic=True`, EngineConfig.deterministic): a token's numbers do not
depend on how its step was put together: how many other rows share it, whether its prefix came
from the prefix cache, a KV hand-off or this step, how its prompt was chunked. Every linear
layer, for any number of rows, runs the native small-M kernel, which sums each output in one
fixed order per row (csrc/kernels.cpp); attention runs every token, prefill or decode, through the
one paged kernel, one query row at a time over its own context (model_runner.py); the glue
kernels (RMSNorm, RoPE, SiLU) are per row already. Without it, oneDNN's GEMM runs the rows above
the native limit, whose rounding varies with the row count, and prefill chunks go through SDPA,
whose sums differ from the decode kernel's: in bf16 enough to change a sampled or greedy token.
It needs the native kernels and a bf16 or fp32 model (`is_batch_invariant` says whether it runs).
The default, `deterministic: "auto"`, turns it on only where it was measured to cost nothing: bf16
on a CPU with AVX512-BF16 (the packed kernel) and without AMX (_batch_invariance).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from serving.engine.errors import ModelLoadError
from serving.engine.modeling.attention import AttentionMetadata, paged_attention
from serving.engine.modeling.cpu_kernels import native_kernels
from serving.engine.modeling.linear_choice import LinearChoice, choose_linear
from serving.engine.modeling.loader import ModelSpec, permute_qk_rows
from serving.engine.modeling.lora import LoRABatch

__all__ = ["LlamaModel"]

logger = logging.getLogger(__name__)

_pack_support: bool | None = None


def _can_pack_bf16() -> bool:
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


class _Linear:
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


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: _Linear
    o: _Linear
    post_norm: torch.Tensor
    gate_up: _Linear
    down: _Linear
    q_norm: torch.Tensor | None = None  # Qwen3, Gemma 3: [head_dim], applied to each query head before RoPE
    k_norm: torch.Tensor | None = None
    pre_ff_norm: torch.Tensor | None = None  # Gemma: before the MLP (post_norm is then after attention)
    post_ff_norm: torch.Tensor | None = None  # Gemma: after the MLP


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
        self.is_batch_invariant, invariance_reason = _batch_invariance(deterministic, device, dtype, speculative=speculative)
        if spec.family == "gemma" and self.is_batch_invariant:
            self.is_batch_invariant, invariance_reason = False, "off: Gemma runs the PyTorch path, not the native kernels"
        self.invariance_reason = invariance_reason
        if deterministic is True and not self.is_batch_invariant:
            logger.warning("deterministic: batch-invariant kernels unavailable, results may vary with the batch: %s", invariance_reason)
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

        gemma = spec.family == "gemma"

        def norm(name: str) -> torch.Tensor:
            """A norm's weight; Gemma's scale by (1 + w), in fp32 (Gemma3RMSNorm)."""
            if not gemma:
                return take(name)
            return 1.0 + state_dict.pop(name).to(device=device, dtype=torch.float32)

        def cat(*tensors: torch.Tensor | None) -> torch.Tensor | None:
            if all(t is None for t in tensors):
                return None
            return torch.cat(list(tensors)).contiguous()

        # Pre-packed oneDNN weights pay off for bf16 on CPU (see _Linear); elsewhere plain ones.
        # Batch-invariant mode runs no oneDNN linear: no packed copies.
        pack = (
            not self.is_batch_invariant and device.type == "cpu" and dtype == torch.bfloat16
            and native_kernels() is not None and _can_pack_bf16()
        )
        invariant = self.is_batch_invariant
        self.embed = take("model.embed_tokens.weight")
        self.layers: list[_Layer] = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            attn_bias = spec.attention_bias
            if spec.fused_projections:  # Phi-3: the projections come fused, q|k|v and gate|up
                qkv_weight, qkv_bias = take(p + "self_attn.qkv_proj.weight"), take(p + "self_attn.qkv_proj.bias", attn_bias)
                gate_up_weight = take(p + "mlp.gate_up_proj.weight")
                gate_up_bias = take(p + "mlp.gate_up_proj.bias", spec.mlp_bias)
            else:
                qkv_weight = cat(take(p + "self_attn.q_proj.weight"), take(p + "self_attn.k_proj.weight"),
                                 take(p + "self_attn.v_proj.weight"))
                qkv_bias = cat(take(p + "self_attn.q_proj.bias", attn_bias), take(p + "self_attn.k_proj.bias", attn_bias),
                               take(p + "self_attn.v_proj.bias", attn_bias))
                gate_up_weight = cat(take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight"))
                gate_up_bias = cat(take(p + "mlp.gate_proj.bias", spec.mlp_bias), take(p + "mlp.up_proj.bias", spec.mlp_bias))
            q_norm = norm(p + "self_attn.q_norm.weight") if spec.qk_norm else None
            k_norm = norm(p + "self_attn.k_norm.weight") if spec.qk_norm else None
            perm = spec.rope_permutation
            if perm is not None:  # a partial RoPE: each q/k head's dims in the order the kernels turn them
                qkv_weight, qkv_bias = permute_qk_rows(qkv_weight, spec), permute_qk_rows(qkv_bias, spec)
                q_norm, k_norm = (None if w is None else w[perm].contiguous() for w in (q_norm, k_norm))
            self.layers.append(
                _Layer(
                    input_norm=norm(p + "input_layernorm.weight"),
                    qkv=_Linear(qkv_weight, qkv_bias, pack=pack, invariant=invariant),
                    o=_Linear(take(p + "self_attn.o_proj.weight"), take(p + "self_attn.o_proj.bias", False), pack=pack, invariant=invariant),
                    post_norm=norm(p + "post_attention_layernorm.weight"),
                    gate_up=_Linear(gate_up_weight, gate_up_bias, pack=pack, invariant=invariant),
                    down=_Linear(take(p + "mlp.down_proj.weight"), take(p + "mlp.down_proj.bias", spec.mlp_bias), pack=pack, invariant=invariant),
                    q_norm=q_norm,
                    k_norm=k_norm,
                    pre_ff_norm=norm(p + "pre_feedforward_layernorm.weight") if gemma else None,
                    post_ff_norm=norm(p + "post_feedforward_layernorm.weight") if gemma else None,
                )
            )
        self.norm = norm("model.norm.weight")
        lm_head = take("lm_head.weight", required=not spec.tie_word_embeddings)
        self.lm_head = _Linear(self.embed if lm_head is None else lm_head, None, pack=pack, invariant=invariant)
        if spec.layer_rope_types:  # Gemma 3: a table per layer type (local and global bases)
            tables = {t: _rope_tables(spec, device, dtype, t) for t in set(spec.layer_rope_types)}
            self.layer_rope = [tables[t] for t in spec.layer_rope_types]
            self.cos, self.sin = self.layer_rope[0]
        else:
            self.cos, self.sin = _rope_tables(spec, device, dtype)
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

    def _lin(self, index: int, name: str, linear: _Linear, x: torch.Tensor, kernels=None, rows: int = 0) -> torch.Tensor:
        """Layer `index`'s linear `name` on x, plus the step's LoRA adapters' products (lora.py)."""
        y = linear(x, kernels, rows) if kernels is not None else linear(x)
        return y if self._lora is None else self._lora.apply(y, x, index, name)

    def _qk_norm(self, qkv: torch.Tensor, layer: _Layer) -> None:
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
        self._lora = lora  # the step's adapters (lora.py), read by _linear
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
            qk = _apply_rope(qk, cos, sin)
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
            qk = _apply_rope(qk, cos, sin)
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


def _batch_invariance(deterministic: bool | str, device: torch.device, dtype: torch.dtype, *,
                      speculative: bool = False) -> tuple[bool, str]:
    """Whether batch-invariant mode runs, and why (EngineConfig.deterministic: true, false or "auto").
    `speculative`: the engine verifies proposals, whose rows must compute as decode rows for greedy
    output to be token-identical to decoding without speculation (auto turns the mode on for it
    on AMX too)."""
    if deterministic is False:
        return False, "off (deterministic: false)"
    if device.type != "cpu":
        return False, f"off: its kernels are CPU-only; the device is {device}"
    kernels = native_kernels()
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


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _rope_tables(spec: ModelSpec, device: torch.device, dtype: torch.dtype, layer_type: str | None = None):
    """cos/sin for every position, [max_pos, head_dim], from transformers' rope init functions
    (`layer_type`: Gemma 3's rope_parameters of that layer type)."""
    params = spec.rope_parameters[layer_type] if layer_type else spec.rope_parameters
    rope_type = params.get("rope_type", "default") if layer_type else spec.rope_type
    rotary = spec.rotary_dim or spec.head_dim
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary, 2, dtype=torch.int64).float() / rotary))
        attention_scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        extra = {"layer_type": layer_type} if layer_type else {}
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](spec.hf_config, torch.device("cpu"), **extra)
    if inv_freq.numel() != rotary // 2:  # a rope init function that ignored partial_rotary_factor
        raise ModelLoadError(f"RoPE ({rope_type}) gave {inv_freq.numel()} frequencies for {rotary} turned head dims "
                             f"in {spec.path}; expected {rotary // 2}")
    positions = torch.arange(spec.max_position_embeddings, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.float()[None, :]  # [max_pos, rotary / 2]
    # A partial RoPE (spec.rope_permutation): the unturned dims sit beside each turned half and
    # keep cos 1, sin 0.
    unturned = torch.zeros(freqs.shape[0], (spec.head_dim - rotary) // 2)
    cos_half = torch.cat((freqs.cos() * attention_scaling, unturned + 1.0), dim=-1)
    sin_half = torch.cat((freqs.sin() * attention_scaling, unturned), dim=-1)
    cos = torch.cat((cos_half, cos_half), dim=-1).to(device=device, dtype=dtype)
    sin = torch.cat((sin_half, sin_half), dim=-1).to(device=device, dtype=dtype)
    return cos, sin
