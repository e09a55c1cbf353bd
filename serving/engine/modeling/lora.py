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

An adapter's files are read, checked and laid out for the fused linears in lora_adapter.py.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from serving.engine.errors import InvalidRequestError
from serving.engine.modeling.cpu_kernels import native_kernels
from serving.engine.modeling.lora_adapter import LoRAAdapter, LoRAError, load_adapter

# LoRAAdapter, LoRAError and load_adapter are lora_adapter.py's, re-exported
__all__ = ["LoRAAdapter", "LoRAManager", "LoRABatch", "StackedLinear", "load_adapter", "LoRAError"]


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
        self.check_known(name)
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
