"""Multi-LoRA: PEFT adapters over one base model, mixed in one batch (the S-LoRA / Punica idea).

    registry (EngineConfig.lora.adapters: name -> PEFT directory)
        │ first request for a name: read, checked, laid out for the fused linears
        ▼
    resident adapters (at most lora.max_loras; LRU among those no running request uses)
        │ each step: the step's tokens grouped by adapter
        ▼
    every linear:  y = x W^T  +  for each adapter a in the step:  y[rows_a] += (x[rows_a] A_a^T) B_a^T

Not merged into the base weights and not one pass per adapter: the base GEMM runs once over the
whole step, and each adapter adds its low-rank product on its own rows. On a CPU one native call
per linear does that for every row (csrc/kernels.cpp `lora_segmented`, the SGMV idea: a row costs
its own adapter's rank only); elsewhere PyTorch products (LoRABatch says which form runs).

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
import math
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from serving.engine.errors import InvalidRequestError, ModelLoadError
from serving.engine.modeling.cpu_kernels import native_kernels
from serving.engine.modeling.model_spec import permute_qk_rows

__all__ = ["LoRAAdapter", "LoRAManager", "LoRABatch", "StackedLinear", "load_adapter", "LoRAError"]

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
    from safetensors.torch import load_file

    root = Path(path)
    config_path = root / "adapter_config.json"
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

    weights_path = root / "adapter_model.safetensors"
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

    pieces = _pieces(spec)
    by_linear: dict[tuple[int, str], list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
    ranks = set()
    for (layer, module), pair in sorted(found.items()):
        where = f"adapter {name!r}: {weights_path}: layers.{layer}.{module}"
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
    if not by_linear:
        raise LoRAError(f"adapter {name!r}: {weights_path} holds no lora_A/lora_B weights")
    declared = config.get("r")
    if declared is not None and not config.get("rank_pattern") and ranks != {declared}:
        refuse("r", f"is {declared}, but the weights have rank {sorted(ranks)}")

    adapter = LoRAAdapter(name, root, adapter_id, max(ranks))
    for (layer, linear), parts in by_linear.items():
        out = pieces[linear]["all"][1]
        a_all = torch.cat([a for _, a, _ in parts])
        b_all = torch.zeros(out, a_all.shape[0])
        col = 0
        for piece, a, b in parts:
            lo, hi = pieces[linear][piece]
            b_all[lo:hi, col : col + a.shape[0]] = b
            col += a.shape[0]
        if linear == "qkv":  # a partial RoPE: q/k outputs in the engine's order (ModelSpec.rope_permutation)
            b_all = permute_qk_rows(b_all, spec)
        adapter.weights[layer, linear] = (a_all.to(device=device, dtype=dtype).contiguous(),
                                          b_all.to(device=device, dtype=dtype).contiguous())
    return adapter


@dataclass
class LoRABatch:
    """One step's adapters, in one of three forms:

    segmented  (CPU with the native kernels) every row with an adapter, sorted by slot, and its
               slot in the resident set (LoRAManager.stacked); one kernel call per linear adds
               each row's own adapter's product (csrc/kernels.cpp `lora_segmented`). A row costs
               its own adapter's rank, nothing else.
    groups     each adapter with the rows it applies to (None: every row), one pair of products
               per adapter (one adapter in the step, or no native kernels).
    stacked    every resident adapter's A and B side by side and each token's slot (-1: the base
               model), two products for all, each token's columns kept by a mask: every token
               pays every resident adapter's rank, but a handful of calls per linear.

    8 adapters of rank 16 in a 64-request batch, SmolLM2 bf16 on 2 cores: docs/benchmarks.md."""

    groups: list[tuple[LoRAAdapter, torch.Tensor | None]] = field(default_factory=list)
    slots: torch.Tensor | None = None  # [tokens] int64 (stacked)
    stacked: dict[tuple[int, str], StackedLinear] | None = None
    rows: torch.Tensor | None = None  # [n] int64, sorted by slot (segmented)
    row_slots: torch.Tensor | None = None  # [n] int64
    kernels: object = None  # the native module (segmented)

    def apply(self, y: torch.Tensor, x: torch.Tensor, layer: int, linear: str) -> torch.Tensor:
        """y (= x W^T) plus each adapter's (x A^T) B^T on its rows."""
        if self.stacked is not None:
            entry = self.stacked.get((layer, linear))
            if entry is None:
                return y
            if self.rows is not None:
                y = y.contiguous()
                if entry.bp is not None:
                    self.kernels.lora_segmented_packed(y, x.contiguous(), entry.a, entry.bp, self.rows, self.row_slots,
                                                       entry.ranges, entry.pair_starts)
                else:
                    self.kernels.lora_segmented(y, x.contiguous(), entry.a, entry.bt, self.rows, self.row_slots,
                                                entry.ranges)
                return y
            h = x @ entry.a.T
            h = h * (self.slots[:, None] == entry.col_slot[None, :]).to(h.dtype)
            return y + h @ entry.bt
        for adapter, rows in self.groups:
            pair = adapter.weights.get((layer, linear))
            if pair is None:
                continue
            a, b = pair
            if rows is None:
                y = y + (x @ a.T) @ b.T
            else:
                y = y.index_add(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)
        return y


@dataclass(frozen=True)
class StackedLinear:
    """Every resident adapter's factors for one (layer, linear), side by side along the rank."""

    a: torch.Tensor  # [R, in]
    bt: torch.Tensor | None  # [R, out]: the B factors transposed (None where bp replaces them)
    col_slot: torch.Tensor  # [R] int64: which slot owns each rank row
    ranges: torch.Tensor  # [slots, 2] int64 on the CPU: each slot's rank rows [lo, hi) (empty: none)
    # bf16 on AVX512-BF16 (lora_segmented_packed): each slot's B^T by pairs of rank rows,
    # [ceil(r / 2), out, 2] from pair_starts[slot] pairs on
    bp: torch.Tensor | None = None
    pair_starts: torch.Tensor | None = None


def _pack_pairs(bts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each [r, out] B^T as [ceil(r / 2), out, 2] (an odd rank padded with a zero row), one after
    another, and where each starts (in pairs)."""
    packed, starts, at = [], [], 0
    for bt in bts:
        if bt.shape[0] % 2:
            bt = torch.cat([bt, bt.new_zeros(1, bt.shape[1])])
        packed.append(bt.view(bt.shape[0] // 2, 2, bt.shape[1]).transpose(1, 2).reshape(-1))
        starts.append(at)
        at += bt.shape[0] // 2
    return torch.cat(packed).contiguous(), torch.tensor(starts, dtype=torch.long)


class LoRAManager:
    """The engine's adapters: registered by name, at most `max_loras` resident, loaded on first
    use and evicted least recently used among those no running request holds."""

    def __init__(self, adapters: dict[str, str], max_loras: int, spec, dtype: torch.dtype, device: torch.device):
        self.paths = dict(adapters)
        self.max_loras = max_loras
        self.spec, self.dtype, self.device = spec, dtype, device
        self.resident: OrderedDict[str, LoRAAdapter] = OrderedDict()  # LRU first
        self._next_id = 1
        self.num_loads = 0
        self.load_s = 0.0  # an adapter's load on first use, seconds: the recent ones weigh most (routers price it)
        self.num_evictions = 0
        self._stacked: dict | None = None  # built on demand for the resident set (stacked())
        self.slot_of: dict[str, int] = {}  # adapter name -> its slot in the stacked tensors
        # bf16 on a CPU whose native kernels have AVX512-BF16: B^T also packed by pairs (StackedLinear.bp)
        kernels = native_kernels() if device.type == "cpu" and dtype == torch.bfloat16 else None
        self.pack_pairs = kernels is not None and kernels.has_packed_linear()

    def register(self, name: str, path: str) -> None:
        """`name` now means the adapter at `path` (read on first use). The same path again changes
        nothing; another path replaces the resident copy, refused while a running request uses it."""
        path = str(path)
        if self.paths.get(name) == path:
            return
        adapter = self.resident.get(name)
        if adapter is not None:
            if adapter.num_running:
                raise InvalidRequestError(
                    "model", f"adapter {name!r} is being replaced ({self.paths[name]} -> {path}) and "
                    f"{adapter.num_running} running request(s) still use the old one; retry when they finish")
            del self.resident[name]
            self._stacked = None
        self.paths[name] = path

    def check(self, name: str, path: str) -> None:
        """Read and check the adapter at `path` for this base model without making it resident
        (on the CPU, whatever the engine's device: it reads only the spec, so any thread may
        call it); a LoRAError names the file and the field."""
        load_adapter(name, path, self.spec, torch.float32, torch.device("cpu"), adapter_id=0)

    def unregister(self, name: str) -> None:
        """Forget `name`; refused while a running request uses it."""
        adapter = self.resident.get(name)
        if adapter is not None and adapter.num_running:
            raise InvalidRequestError("lora_name", f"adapter {name!r} is in use by {adapter.num_running} running "
                                      "request(s)")
        if self.resident.pop(name, None) is not None:
            self._stacked = None
        self.paths.pop(name, None)

    @property
    def slots_free(self) -> int:
        """Slots a new adapter may take now: empty ones and those of idle resident adapters."""
        return self.max_loras - sum(1 for a in self.resident.values() if a.num_running)

    def check_known(self, name: str) -> None:
        if name not in self.paths:
            raise InvalidRequestError(
                "model", f"unknown adapter {name!r}; registered: {', '.join(sorted(self.paths)) or 'none'}")

    def try_acquire(self, name: str, uses: int = 1) -> LoRAAdapter | None:
        """acquire, `uses` times (a request's choices); None, with nothing taken, while every slot
        is held by running requests (the request waits for one: LLMEngine.lora_waiting)."""
        self.check_known(name)
        if name not in self.resident and len(self.resident) >= self.max_loras and all(
                a.num_running for a in self.resident.values()):
            return None
        adapter = self.acquire(name)
        adapter.num_running += uses - 1
        return adapter

    def acquire(self, name: str) -> LoRAAdapter:
        """The adapter for a new request, loaded if need be; its use count taken."""
        if name not in self.paths:
            raise InvalidRequestError(
                "model", f"unknown adapter {name!r}; registered: {', '.join(sorted(self.paths)) or 'none'}")
        adapter = self.resident.get(name)
        if adapter is None:
            while len(self.resident) >= self.max_loras:
                idle = next((n for n, a in self.resident.items() if a.num_running == 0), None)
                if idle is None:
                    raise InvalidRequestError(
                        "model", f"all {self.max_loras} adapter slots (lora.max_loras) are in use by running "
                        "requests; retry when one finishes")
                del self.resident[idle]
                self.num_evictions += 1
                self._stacked = None
            started = time.perf_counter()
            adapter = load_adapter(name, self.paths[name], self.spec, self.dtype, self.device, self._next_id)
            took = time.perf_counter() - started
            self.load_s = took if self.num_loads == 0 else 0.7 * self.load_s + 0.3 * took
            self._next_id += 1
            self.num_loads += 1
            self.resident[name] = adapter
            self._stacked = None
        self.resident.move_to_end(name)
        adapter.num_running += 1
        return adapter

    def release(self, adapter: LoRAAdapter) -> None:
        adapter.num_running -= 1
        assert adapter.num_running >= 0, adapter.name

    def stacked(self) -> dict[tuple[int, str], StackedLinear]:
        """Every resident adapter's A and B per (layer, linear), side by side along the rank, and
        which slot owns which rank rows; rebuilt when the resident set changes. Slots are
        `slot_of[name]`."""
        if self._stacked is None:
            self.slot_of = {name: i for i, name in enumerate(self.resident)}
            parts: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
            for name, adapter in self.resident.items():
                for key, (a, b) in adapter.weights.items():
                    parts.setdefault(key, []).append((self.slot_of[name], a, b))
            self._stacked = {}
            for key, group in parts.items():
                ranges = torch.zeros(len(self.slot_of), 2, dtype=torch.long)
                row = 0
                for slot, a, _ in group:
                    ranges[slot] = torch.tensor([row, row + a.shape[0]])
                    row += a.shape[0]
                bp = pair_starts = None
                if self.pack_pairs:
                    by_slot = {slot: b.T for slot, _, b in group}
                    empty = group[0][2].new_zeros(0, group[0][2].shape[0])  # a slot without this linear
                    bp, pair_starts = _pack_pairs([by_slot.get(slot, empty) for slot in range(len(self.slot_of))])
                self._stacked[key] = StackedLinear(
                    a=torch.cat([a for _, a, _ in group]).contiguous(),
                    bt=None if bp is not None else torch.cat([b.T for _, _, b in group]).contiguous(),
                    col_slot=torch.cat([torch.full((a.shape[0],), slot, dtype=torch.long, device=a.device)
                                        for slot, a, _ in group]),
                    ranges=ranges, bp=bp, pair_starts=pair_starts,
                )
        return self._stacked
