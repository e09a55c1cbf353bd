"""A checkpoint's tensors laid out for the engine's forward pass (model.py).

    checkpoint (transformers' names)                 engine (one Layer per decoder layer)
    q_proj | k_proj | v_proj  ─ concatenated ─▶      qkv      (Phi-3: qkv_proj as it comes)
    gate_proj | up_proj       ─ concatenated ─▶      gate_up  (Phi-3: gate_up_proj as it comes)
    o_proj, down_proj                         ─▶     o, down
    *_layernorm, q_norm, k_norm               ─▶     norms    (Gemma: 1 + w, in fp32)

Every tensor is popped from the state dict as it is placed, on the model's device and in its
dtype, so the checkpoint's copy is freed as the model's grows. With a partial RoPE the q and k
rows (and q/k norms) are put in the order the kernels turn them (ModelSpec.rope_permutation).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from serving.engine.errors import ModelLoadError
from serving.engine.modeling.linear import Linear
from serving.engine.modeling.model_spec import ModelSpec, permute_qk_rows

__all__ = ["Layer", "ModelWeights", "load_weights"]

logger = logging.getLogger(__name__)


@dataclass
class Layer:
    """One decoder layer's weights, in the fused layout of the module docstring."""

    input_norm: torch.Tensor
    qkv: Linear
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear
    q_norm: torch.Tensor | None = None  # Qwen3, Gemma 3: [head_dim], applied to each query head before RoPE
    k_norm: torch.Tensor | None = None
    pre_ff_norm: torch.Tensor | None = None  # Gemma: before the MLP (post_norm is then after attention)
    post_ff_norm: torch.Tensor | None = None  # Gemma: after the MLP


@dataclass
class ModelWeights:
    """Every weight of the model, out of the checkpoint."""

    embed: torch.Tensor
    layers: list[Layer]
    norm: torch.Tensor
    lm_head: Linear  # the embedding's weight where the checkpoint ties them


class _Checkpoint:
    """The state dict's tensors, taken one by one onto the model's device and dtype."""

    def __init__(self, spec: ModelSpec, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device):
        self.spec, self.state_dict, self.dtype, self.device = spec, state_dict, dtype, device

    def take(self, name: str, required: bool = True) -> torch.Tensor | None:
        tensor = self.state_dict.pop(name, None)
        if tensor is None:
            if required:
                raise ModelLoadError(f"weight {name!r} missing from {self.spec.path}")
            return None
        return tensor.to(device=self.device, dtype=self.dtype).contiguous()

    def norm(self, name: str) -> torch.Tensor:
        """A norm's weight; Gemma's scale by (1 + w), in fp32 (Gemma3RMSNorm)."""
        if self.spec.family != "gemma":
            return self.take(name)
        return 1.0 + self.state_dict.pop(name).to(device=self.device, dtype=torch.float32)

    def fused(self, prefix: str, names: tuple[str, ...], bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weights `prefix + name` of `names`, and their biases (where `bias`), concatenated
        along the output."""
        weight = _cat(*(self.take(f"{prefix}{name}.weight") for name in names))
        return weight, _cat(*(self.take(f"{prefix}{name}.bias", bias) for name in names))


def _cat(*tensors: torch.Tensor | None) -> torch.Tensor | None:
    if all(t is None for t in tensors):
        return None
    return torch.cat(list(tensors)).contiguous()


def load_weights(spec: ModelSpec, state_dict: dict[str, torch.Tensor], *, dtype: torch.dtype,
                 device: torch.device, pack: bool, invariant: bool) -> ModelWeights:
    """Every weight of `spec`'s model, taken out of `state_dict`; each linear built with `pack`
    and `invariant` (Linear)."""
    checkpoint = _Checkpoint(spec, state_dict, dtype, device)
    embed = checkpoint.take("model.embed_tokens.weight")
    layers = [_layer(checkpoint, f"model.layers.{i}.", pack=pack, invariant=invariant) for i in range(spec.num_layers)]
    norm = checkpoint.norm("model.norm.weight")
    lm_head = checkpoint.take("lm_head.weight", required=not spec.tie_word_embeddings)
    return ModelWeights(embed, layers, norm, Linear(embed if lm_head is None else lm_head, None, pack=pack,
                                                    invariant=invariant))


def _layer(checkpoint: _Checkpoint, p: str, *, pack: bool, invariant: bool) -> Layer:
    """Decoder layer `p` ("model.layers.<i>.")."""
    spec, take, norm = checkpoint.spec, checkpoint.take, checkpoint.norm
    attn_bias = spec.attention_bias
    if spec.fused_projections:  # Phi-3: the projections come fused, q|k|v and gate|up
        qkv_weight, qkv_bias = take(p + "self_attn.qkv_proj.weight"), take(p + "self_attn.qkv_proj.bias", attn_bias)
        gate_up_weight = take(p + "mlp.gate_up_proj.weight")
        gate_up_bias = take(p + "mlp.gate_up_proj.bias", spec.mlp_bias)
    else:
        qkv_weight, qkv_bias = checkpoint.fused(p + "self_attn.", ("q_proj", "k_proj", "v_proj"), attn_bias)
        gate_up_weight, gate_up_bias = checkpoint.fused(p + "mlp.", ("gate_proj", "up_proj"), spec.mlp_bias)
    q_norm = norm(p + "self_attn.q_norm.weight") if spec.qk_norm else None
    k_norm = norm(p + "self_attn.k_norm.weight") if spec.qk_norm else None
    perm = spec.rope_permutation
    if perm is not None:  # a partial RoPE: each q/k head's dims in the order the kernels turn them
        qkv_weight, qkv_bias = permute_qk_rows(qkv_weight, spec), permute_qk_rows(qkv_bias, spec)
        q_norm, k_norm = (None if w is None else w[perm].contiguous() for w in (q_norm, k_norm))
    gemma = spec.family == "gemma"

    def linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        return Linear(weight, bias, pack=pack, invariant=invariant)

    return Layer(
        input_norm=norm(p + "input_layernorm.weight"),
        qkv=linear(qkv_weight, qkv_bias),
        o=linear(take(p + "self_attn.o_proj.weight"), take(p + "self_attn.o_proj.bias", False)),
        post_norm=norm(p + "post_attention_layernorm.weight"),
        gate_up=linear(gate_up_weight, gate_up_bias),
        down=linear(take(p + "mlp.down_proj.weight"), take(p + "mlp.down_proj.bias", spec.mlp_bias)),
        q_norm=q_norm,
        k_norm=k_norm,
        pre_ff_norm=norm(p + "pre_feedforward_layernorm.weight") if gemma else None,
        post_ff_norm=norm(p + "post_feedforward_layernorm.weight") if gemma else None,
    )
