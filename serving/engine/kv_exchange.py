"""KV export and import: a prefill worker's held KV read out as one payload, and a decode
worker's payload written into its blocks before its first step.

    export: hold_kv request finishes ──HeldKV (kv/held.py)──▶ export(request id[, into]) ──▶ KVPayload
    import: add(kv_payload) ──scheduler: blocks allocated──▶ write_import(seq) ──▶ blocks committed

A payload is whole blocks in the engine's KVLayout; `payload_bytes(n)` is its size for an
n-token prompt, so a worker can reserve a shared-memory range before the request runs and pass
it as `export_into` (a contiguous host tensor of exactly that size).
"""

from __future__ import annotations

import logging

import torch

from serving.engine.errors import InvalidRequestError
from serving.engine.kv.payload import KVPayload
from serving.engine.request import Sequence

__all__ = ["KVExchange"]

logger = logging.getLogger(__name__)


class KVExchange:
    def __init__(self, held_kv, block_manager, kv_cache, block_size: int, bytes_per_token: int):
        self.held_kv, self.block_manager, self.kv_cache = held_kv, block_manager, kv_cache
        self.block_size, self.bytes_per_token = block_size, bytes_per_token

    def export(self, request_id: str, *, release: bool = True, into: torch.Tensor | None = None) -> KVPayload:
        """The computed KV of a finished `hold_kv` request, as one contiguous payload (read out
        `into` a buffer when given: as EngineRequest.export_into)."""
        return self.held_kv.export(request_id, release=release, into=into)

    def release(self, request_id: str) -> bool:
        return self.held_kv.release(request_id)

    @property
    def exports_to_host(self) -> bool:
        """Whether an export can be read out into host memory (the node's shared-memory arena)."""
        return self.kv_cache.data.device.type == "cpu"

    def payload_bytes(self, num_tokens: int) -> int:
        """The size of the KV payload of `num_tokens` tokens (whole blocks), as export makes it."""
        return -(-num_tokens // self.block_size) * self.block_size * self.bytes_per_token

    def check_export_into(self, export_into: torch.Tensor, hold_kv: bool, num_prompt: int) -> None:
        """InvalidRequestError unless `export_into` can take the payload of a `num_prompt`-token prompt."""
        need = self.payload_bytes(num_prompt)
        have = export_into.numel() * export_into.element_size()
        device = self.kv_cache.data.device
        if not hold_kv or have != need or not export_into.is_contiguous() or export_into.device != device:
            raise InvalidRequestError(
                "export_into", f"needs hold_kv and a contiguous {device} buffer of "
                f"{need} bytes for a {num_prompt}-token prompt; got {have} bytes",
            )

    def write_import(self, seq: Sequence) -> None:
        """Write `seq`'s imported payload into the blocks the scheduler gave it."""
        payload = seq.pending_import
        seq.pending_import = None
        full_ids, sliding_ids = self.block_manager.kv_tables(seq, payload.num_blocks)
        self.kv_cache.write_blocks(full_ids, payload.kv, sliding_ids)
        self.block_manager.commit(seq)
