"""KVRelayConnector: vLLM's KV moves through kvrelay's hand-off (a vLLM v1 KV connector).

vLLM builds this class twice in its EngineCore process (or its workers'): once beside its scheduler
and once beside its model runner. The replica (serving/engine/vllm/engine.py) asks for a hand-off
per request in `kv_transfer_params["kvrelay"]`; the bytes go straight between vLLM's paged cache
and a shared-memory range the replica names (the node's KV arena, or a staging memfd), so they
are copied once, by the process that holds the cache:

    prefill replica                    EngineCore: scheduler side        EngineCore: worker side
    generate(max_tokens=1,             on_new_request: keep the spec
      {op: save, range, receipt})      build_connector_meta: in the step
                                       that computes the prompt's last    wait_for_save (after the
                                       token, SaveOp(its block ids) ────▶ forward): gather the
    final output; the receipt                                             blocks into the range,
    says saved (and the format) ◀─────────────────────────────────────── then write the receipt

    decode replica
    generate(prompt + first token,     get_num_new_matched_tokens: the    start_load_kv (before the
      {op: load, range, receipt})      payload's tokens past the local    forward): scatter the
                                       prefix hit; update_state_after_    range's blocks into the
                                       alloc: LoadOp(the blocks they go   allocated blocks, then
                                       to) ─────────────────────────────▶ the receipt; a range too
                                                                          late or gone: its blocks
                                                                          are reported invalid and
                                                                          vLLM recomputes them
                                                                          (kv_load_failure_policy
                                                                          recompute)

The receipt (a file the worker side writes after its copy, then the replica reads) is the positive
answer the replica needs before it offers the KV: vLLM's own channel back from the workers
(KVConnectorOutput) reaches the scheduler after a request with one token has already finished.
The payload is [layers, num_blocks, *vLLM's per-layer block] in vLLM's own block layout, whose
name (attention backend, ISA, block shape, dtype) travels as the payload's format: a range from an
engine of another layout is refused at load, never misread. Every copy starts before the range's
deadline (the arena's lease; one monotonic clock per node) or not at all.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from serving.engine.kv.payload import ShmRange

__all__ = ["HANDOFF_KEY", "HandoffSpec", "KVRelayConnector", "read_receipt"]

logger = logging.getLogger(__name__)

HANDOFF_KEY = "kvrelay"  # the key of kv_transfer_params a request's hand-off rides in


@dataclass(frozen=True)
class HandoffSpec:
    """One request's hand-off, as the replica asks for it (kv_transfer_params["kvrelay"])."""

    op: str  # "save" (prefill: write the prompt's KV) or "load" (decode: read it)
    range: ShmRange
    num_tokens: int  # the prompt tokens whose KV is (to be) in the range
    receipt: str  # the file the worker side writes once its copy is over
    deadline: float | None  # time.monotonic(): no copy starts at or after it
    format: str = ""  # load: the payload's block layout (the saver's receipt said it)

    def to_params(self) -> dict[str, Any]:
        return {HANDOFF_KEY: {
            "op": self.op, "path": self.range.path, "offset": self.range.offset, "num_bytes": self.range.num_bytes,
            "header": self.range.header.hex(), "num_tokens": self.num_tokens, "receipt": self.receipt,
            "deadline": self.deadline, "format": self.format,
        }}

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> HandoffSpec | None:
        spec = (params or {}).get(HANDOFF_KEY)
        if not spec:
            return None
        return cls(spec["op"], ShmRange(spec["path"], spec["offset"], spec["num_bytes"], bytes.fromhex(spec["header"])),
                   spec["num_tokens"], spec["receipt"], spec["deadline"], spec.get("format", ""))


def read_receipt(path: str) -> tuple[str, str] | None:
    """The worker side's receipt (what happened, and the format or the reason), removed once
    read; None when it wrote none (its copy never started)."""
    try:
        with open(path) as f:
            what, _, detail = f.read().partition("\n")
    except FileNotFoundError:
        return None
    os.unlink(path)
    return what, detail


def _write_receipt(path: str, what: str, detail: str = "") -> None:
    # whole or absent: written aside, then renamed over the name the replica reads
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{what}\n{detail}")
    os.replace(tmp, path)


@dataclass
class _Copy:
    """One copy for the worker side: `blocks` of the range (its block indices) to or from the
    cache's blocks `block_ids`."""

    spec: HandoffSpec
    blocks: tuple[int, int]  # the range's block indices [first, last)
    block_ids: list[int]


@dataclass
class KVRelayMetadata(KVConnectorMetadata):
    saves: list[_Copy] = field(default_factory=list)
    loads: list[_Copy] = field(default_factory=list)


class KVRelayConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        # scheduler side
        self._specs: dict[str, tuple[Any, HandoffSpec]] = {}  # request id -> (vLLM's Request, its spec)
        self._loads: list[_Copy] = []  # allocated this step, for the next metadata
        # worker side
        self._layers: list[torch.Tensor] = []  # one per distinct cache tensor, in the model's order
        self._format = ""
        self._load_errors: set[int] = set()

    # ---- scheduler side ----------------------------------------------------------------------
    def on_new_request(self, request) -> None:
        spec = HandoffSpec.from_params(request.kv_transfer_params)
        if spec is not None:
            self._specs[request.request_id] = (request, spec)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """A load's payload tokens past the local prefix hit, while its range may still be read
        (a late range is recomputed from the start: nothing to load)."""
        _, spec = self._specs.get(request.request_id, (None, None))
        if spec is None or spec.op != "load" or not _in_time(spec):
            return 0, False
        # at least the token after the payload is computed here (the first token, sent as prompt)
        num_tokens = min(spec.num_tokens, request.num_tokens - 1)
        return max(num_tokens - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        _, spec = self._specs.get(request.request_id, (None, None))
        if spec is None or spec.op != "load":
            return
        del self._specs[request.request_id]  # one try: a request scheduled again (preempted) recomputes
        if num_external_tokens <= 0:  # nothing to read: the local prefix cache held it, or too late
            _write_receipt(spec.receipt, *(("cached",) if _in_time(spec) else ("failed", "its lease ran out")))
            return
        end = min(spec.num_tokens, request.num_tokens - 1)
        first, last = (end - num_external_tokens) // self._block_size, -(-end // self._block_size)
        block_ids = blocks.get_block_ids()[0][first:last]
        self._loads.append(_Copy(spec, (first, last), list(block_ids)))

    def build_connector_meta(self, scheduler_output) -> KVRelayMetadata:
        meta = KVRelayMetadata(loads=self._loads)
        self._loads = []
        for request_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            request, spec = self._specs.get(request_id, (None, None))
            # a save in the step that computes the prompt's last token (counts before this step)
            if spec is None or spec.op != "save" or request.num_computed_tokens + num_scheduled < spec.num_tokens:
                continue
            num_blocks = -(-spec.num_tokens // self._block_size)
            block_ids = self._kv_cache_manager.get_block_ids(request_id)[0][:num_blocks]
            meta.saves.append(_Copy(spec, (0, num_blocks), list(block_ids)))
            del self._specs[request_id]  # saved once
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # every copy ends inside the step that asked for it: nothing to hold the blocks for
        self._specs.pop(request.request_id, None)
        return False, None

    # ---- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        seen: set[int] = set()
        num_blocks = self._kv_cache_config.num_blocks
        context = self._vllm_config.compilation_config.static_forward_context
        for name, cache in kv_caches.items():
            if cache.data_ptr() in seen:  # a layer that shares another's cache
                continue
            seen.add(cache.data_ptr())
            if cache.shape[0] != num_blocks:
                raise ValueError(f"KVRelayConnector: {name}'s KV cache {tuple(cache.shape)} does not put its "
                                 f"{num_blocks} blocks first; this attention backend cannot hand off through kvrelay")
            self._layers.append(cache)
            if not self._format:
                layer = context.get(name)
                backend = getattr(getattr(layer, "attn_backend", None), "get_name", lambda: "?")()
                isa = getattr(layer, "isa", "")
                shape = "x".join(str(d) for d in cache.shape[1:])
                self._format = f"vllm/{backend}/{isa}/{shape}/{str(cache.dtype).removeprefix('torch.')}"
        if any(c.shape != self._layers[0].shape or c.dtype != self._layers[0].dtype for c in self._layers):
            raise ValueError("KVRelayConnector: the layers' KV caches differ in shape or dtype; "
                             "this model cannot hand off through kvrelay")

    def _block_view(self, spec: HandoffSpec) -> torch.Tensor:
        """The range as [layers, blocks, *block]; ValueError when its size is not whole blocks."""
        block_bytes = self._layers[0][0].numel() * self._layers[0].element_size()
        per_layer = len(self._layers) * block_bytes
        if spec.range.num_bytes % per_layer:
            raise ValueError(f"{spec.range.num_bytes} bytes are not whole blocks of {len(self._layers)} x {block_bytes}")
        raw = spec.range.tensor()
        return raw.view(self._layers[0].dtype).view(len(self._layers), -1, *self._layers[0].shape[1:])

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for copy in meta.loads:
            try:
                if copy.spec.format != self._format:
                    raise ValueError(f"the payload's layout {copy.spec.format!r} is not this engine's {self._format!r}")
                if not _in_time(copy.spec):
                    raise TimeoutError("its range's lease ran out before the load")
                payload = self._block_view(copy.spec)
                first, last = copy.blocks
                if last > payload.shape[1] or len(copy.block_ids) != last - first:
                    raise ValueError(f"blocks {first}..{last} of a payload of {payload.shape[1]}")
                for cache, src in zip(self._layers, payload):
                    index = torch.tensor(copy.block_ids, device=cache.device)
                    cache.index_copy_(0, index, src[first:last].to(cache.device))
            except Exception as exc:  # noqa: BLE001 - this request's KV is recomputed, no other's
                self._load_errors.update(copy.block_ids)
                logger.warning("loading a handed-off KV failed (%s); vLLM recomputes it", exc)
                _write_receipt(copy.spec.receipt, "failed", f"{type(exc).__name__}: {exc}")
            else:
                _write_receipt(copy.spec.receipt, "loaded", self._format)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole before the forward (start_load_kv)."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        """Saves are made after the forward, every layer at once (wait_for_save)."""

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        for copy in meta.saves:
            try:
                if not _in_time(copy.spec):
                    raise TimeoutError("its range's lease ran out before the save")
                payload = self._block_view(copy.spec)
                if payload.shape[1] != len(copy.block_ids):
                    raise ValueError(f"a range of {payload.shape[1]} blocks for {len(copy.block_ids)}")
                for cache, dst in zip(self._layers, payload):
                    index = torch.tensor(copy.block_ids, device=cache.device)
                    if cache.device.type == "cpu":
                        torch.index_select(cache, 0, index, out=dst)
                    else:
                        dst.copy_(cache.index_select(0, index))
            except Exception as exc:  # noqa: BLE001 - this request's decode recomputes its prompt
                logger.warning("saving a KV for its hand-off failed (%s)", exc)
                _write_receipt(copy.spec.receipt, "failed", f"{type(exc).__name__}: {exc}")
            else:
                _write_receipt(copy.spec.receipt, "saved", self._format)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors


def _in_time(spec: HandoffSpec) -> bool:
    return spec.deadline is None or time.monotonic() < spec.deadline
