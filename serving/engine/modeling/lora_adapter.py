"""One PEFT LoRA adapter: read from its directory, checked against the base model, and laid out for
the engine's fused linears (lora.py runs the resident ones in each step).

Layout. The engine's linears are fused: qkv = [q | k | v] and gate_up = [gate | up] along the
output. An adapter's pieces for one fused linear become one A (its pieces' A stacked along the
rank: [sum r, in]) and one B ([out, sum r], each piece's B in its output range and its own rank
columns, zero elsewhere), with the piece's scaling (lora_alpha / r, or / sqrt(r) with rslora)
folded into B. A module the adapter does not target contributes nothing.

Checked at load, each failure naming the file and the field: adapter_config.json present and a
LoRA (`peft_type`), `target_modules` within the architecture's projections, no DoRA, no bias, no
modules_to_save, no fan_in_fan_out, no alpha_pattern; every lora_A / lora_B tensor of a known
layer and module, with shapes that fit the base model ([r, in] and [out, r], the same r).
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from serving.engine.errors import ModelLoadError
from serving.engine.modeling.model_spec import permute_qk_rows

__all__ = ["LoRAAdapter", "LoRAError", "load_adapter"]

logger = logging.getLogger(__name__)

# Each PEFT target module: (our fused linear, which piece of its output)
_MODULES = {
    "q_proj": ("qkv", "q"), "k_proj": ("qkv", "k"), "v_proj": ("qkv", "v"), "o_proj": ("o", "all"),
    "gate_proj": ("gate_up", "gate"), "up_proj": ("gate_up", "up"), "down_proj": ("down", "all"),
    "qkv_proj": ("qkv", "all"), "gate_up_proj": ("gate_up", "all"),  # Phi-3's fused projections
}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAError(ModelLoadError):
    """An adapter that cannot be loaded: the message names the file and the field."""


@dataclass(eq=False)  # one object per load: hashed by identity (a step groups its rows by adapter)
class LoRAAdapter:
    name: str
    path: Path
    adapter_id: int  # unique per load
    rank: int
    # (layer, fused linear) -> (A [sum r, in], B [out, sum r]) in the model dtype
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    num_running: int = 0  # requests using it now: never evicted while > 0

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def _pieces(spec) -> dict[str, dict[str, tuple[int, int]]]:
    """Each fused linear's output ranges by piece, and its input size."""
    q, kv, inter = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_size
    return {
        "qkv": {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv), "all": (0, q + 2 * kv)},
        "o": {"all": (0, spec.hidden_size)},
        "gate_up": {"gate": (0, inter), "up": (inter, 2 * inter), "all": (0, 2 * inter)},
        "down": {"all": (0, spec.hidden_size)},
    }


def _in_features(spec, linear: str) -> int:
    return {"qkv": spec.hidden_size, "o": spec.num_heads * spec.head_dim, "gate_up": spec.hidden_size,
            "down": spec.intermediate_size}[linear]


def load_adapter(name: str, path: str | Path, spec, dtype: torch.dtype, device: torch.device,
                 adapter_id: int) -> LoRAAdapter:
    """Read and check a PEFT LoRA adapter for the base model `spec` (module docstring)."""
    root = Path(path)
    config_path = root / "adapter_config.json"
    config = _read_config(name, config_path)
    weights_path = root / "adapter_model.safetensors"
    found = _read_tensors(name, weights_path, spec)
    by_linear, ranks = _scaled_factors(f"adapter {name!r}: {weights_path}", found, spec, config)
    declared = config.get("r")
    if declared is not None and not config.get("rank_pattern") and ranks != {declared}:
        raise LoRAError(f"adapter {name!r}: {config_path}: r is {declared}, but the weights have rank {sorted(ranks)}")
    adapter = LoRAAdapter(name, root, adapter_id, max(ranks))
    pieces = _pieces(spec)
    for (layer, linear), parts in by_linear.items():
        a_all, b_all = _fuse(parts, pieces[linear])
        if linear == "qkv":  # a partial RoPE: q/k outputs in the engine's order (ModelSpec.rope_permutation)
            b_all = permute_qk_rows(b_all, spec)
        adapter.weights[layer, linear] = (a_all.to(device=device, dtype=dtype).contiguous(),
                                          b_all.to(device=device, dtype=dtype).contiguous())
    return adapter


def _read_config(name: str, config_path: Path) -> dict:
    """adapter_config.json, checked: a LoRA of a kind the engine runs."""
    if not config_path.is_file():
        raise LoRAError(f"adapter {name!r}: {config_path} not found (a PEFT adapter directory has "
                        "adapter_config.json and adapter_model.safetensors)")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LoRAError(f"adapter {name!r}: cannot read {config_path}: {exc}") from exc

    def refuse(field_name: str, why: str):
        raise LoRAError(f"adapter {name!r}: {config_path}: {field_name} {why}")

    if config.get("peft_type", "LORA") != "LORA":
        refuse("peft_type", f"is {config.get('peft_type')!r}; supported: LORA")
    for flag in ("use_dora", "fan_in_fan_out"):
        if config.get(flag):
            refuse(flag, "is true; not supported")
    if config.get("bias", "none") != "none":
        refuse("bias", f"is {config.get('bias')!r}; supported: none")
    if config.get("modules_to_save"):
        refuse("modules_to_save", f"is {config['modules_to_save']!r}; not supported (full copies of modules)")
    if config.get("alpha_pattern"):
        refuse("alpha_pattern", "is set; not supported (one lora_alpha for every module)")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets] if targets in _MODULES else []
    unknown = sorted(set(targets) - set(_MODULES))
    if unknown:
        refuse("target_modules", f"has {unknown}; supported: {', '.join(_MODULES)}")
    alpha = config.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or alpha <= 0:
        refuse("lora_alpha", f"is {alpha!r}; must be a number > 0")
    return config


def _read_tensors(name: str, weights_path: Path, spec) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """adapter_model.safetensors' tensors by (layer, PEFT module), then "A" or "B"."""
    from safetensors.torch import load_file

    if not weights_path.is_file():
        raise LoRAError(f"adapter {name!r}: {weights_path} not found")
    try:
        tensors = load_file(str(weights_path))
    except Exception as exc:  # safetensors raises its own error types
        raise LoRAError(f"adapter {name!r}: cannot read {weights_path}: {exc}") from exc
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise LoRAError(f"adapter {name!r}: {weights_path}: tensor {key!r} is not a lora_A/lora_B weight of "
                            "a decoder layer's projection")
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        if module not in _MODULES:
            raise LoRAError(f"adapter {name!r}: {weights_path}: tensor {key!r} targets {module!r}; supported: "
                            f"{', '.join(_MODULES)}")
        if layer >= spec.num_layers:
            raise LoRAError(f"adapter {name!r}: {weights_path}: tensor {key!r} is for layer {layer}; the base "
                            f"model has {spec.num_layers}")
        found.setdefault((layer, module), {})[which] = tensor
    if not found:
        raise LoRAError(f"adapter {name!r}: {weights_path} holds no lora_A/lora_B weights")
    return found


def _scaled_factors(where_file: str, found: dict[tuple[int, str], dict[str, torch.Tensor]], spec, config: dict):
    """Each (layer, fused linear)'s pieces as (piece, A, B * scaling) in fp32, their shapes checked
    against the base model; and the set of ranks."""
    pieces = _pieces(spec)
    alpha = config["lora_alpha"]
    by_linear: dict[tuple[int, str], list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
    ranks = set()
    for (layer, module), pair in sorted(found.items()):
        where = f"{where_file}: layers.{layer}.{module}"
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"{where}: has lora_{''.join(pair)} without lora_{'B' if 'A' in pair else 'A'}")
        linear, piece = _MODULES[module]
        fused_name, split_name = module in ("qkv_proj", "gate_up_proj"), module in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
        if piece not in pieces[linear] or (fused_name and not spec.fused_projections) or (split_name and spec.fused_projections):
            raise LoRAError(f"{where}: the base model ({spec.architecture}) has no {module}")
        a, b = pair["A"], pair["B"]
        lo, hi = pieces[linear][piece]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != _in_features(spec, linear) or b.shape != (hi - lo, rank):
            raise LoRAError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the base "
                            f"model: expected [r, {_in_features(spec, linear)}] and [{hi - lo}, r]")
        ranks.add(rank)
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        by_linear.setdefault((layer, linear), []).append((piece, a.float(), b.float() * scaling))
    return by_linear, ranks


def _fuse(parts: list[tuple[str, torch.Tensor, torch.Tensor]],
          ranges: dict[str, tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused linear's A [sum r, in] and B [out, sum r] from its pieces (module docstring)."""
    a_all = torch.cat([a for _, a, _ in parts])
    b_all = torch.zeros(ranges["all"][1], a_all.shape[0])
    col = 0
    for piece, a, b in parts:
        lo, hi = ranges[piece]
        b_all[lo:hi, col : col + a.shape[0]] = b
        col += a.shape[0]
    return a_all, b_all
