"""Rotary position embeddings: the cos/sin tables for every position, and their rotation of q and k.

A partial RoPE (Phi-3's partial_rotary_factor < 1) keeps its unturned dims beside each turned half,
where the tables hold cos 1 and sin 0 (ModelSpec.rope_permutation), so one rotation of whole heads
serves every model.
"""

from __future__ import annotations

import logging

import torch

from serving.engine.errors import ModelLoadError
from serving.engine.modeling.model_spec import ModelSpec

__all__ = ["apply_rope", "rope_tables"]

logger = logging.getLogger(__name__)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_tables(spec: ModelSpec, device: torch.device, dtype: torch.dtype, layer_type: str | None = None):
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
