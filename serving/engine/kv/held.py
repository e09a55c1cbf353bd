"""HeldKV: the KV of finished `hold_kv` requests (a prefill worker's), kept for export.

    a hold_kv request finishes ─▶ hold(seq): its blocks stay allocated, and its payload is read
                                  out at once, on the step thread, so an export does not wait
                                  behind the next step
    export(id) / take_ready(id) ─▶ the payload (KVPayload: one contiguous copy of its blocks)
    release(id)                 ─▶ the blocks are freed (once exported, or when nobody will)
"""

from __future__ import annotations

import time

from serving.engine.kv.block_manager import BlockManager
from serving.engine.kv.cache import KVCache
from serving.engine.kv.hybrid_block_manager import HybridBlockManager
from serving.engine.kv.payload import KVLayout, KVPayload
from serving.engine.request import Sequence

__all__ = ["HeldKV"]


class HeldKV:
    def __init__(self, block_manager: BlockManager | HybridBlockManager, kv_cache: KVCache, layout: KVLayout):
        self._block_manager = block_manager
        self._kv_cache = kv_cache
        self._layout = layout
        self._seqs: dict[str, Sequence] = {}  # finished with hold_kv, blocks kept
        self._ready: dict[str, KVPayload] = {}  # their payloads, read out when they finished

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def holds(self, seq: Sequence) -> bool:
        return self._seqs.get(seq.request_id) is seq

    def hold(self, seq: Sequence) -> None:
        self._seqs[seq.request_id] = seq
        self._ready[seq.request_id] = self._payload(seq)

    def export(self, request_id: str, *, release: bool = True, into=None) -> KVPayload:
        """The computed KV of a held request, as one contiguous payload (read out again `into`
        a given buffer, as add_request's export_into)."""
        seq = self._seqs.get(request_id)
        if seq is None:
            raise KeyError(f"no held KV for request {request_id!r} (add it with hold_kv=True)")
        ready = self._ready.pop(request_id, None)
        payload = self._payload(seq, into) if into is not None or ready is None else ready
        if release:
            self.release(request_id)
        return payload

    def take_ready(self, request_id: str) -> KVPayload | None:
        """The payload read out when the request finished; None if there is none. Safe from any
        thread (one dict pop); the blocks stay held until `release`."""
        return self._ready.pop(request_id, None)

    def release(self, request_id: str) -> bool:
        """Free a held request's blocks; False if none were held."""
        self._ready.pop(request_id, None)
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self._block_manager.free(seq)
        return True

    def _payload(self, seq: Sequence, out=None) -> KVPayload:
        num_tokens = seq.num_computed_tokens
        num_blocks = -(-num_tokens // self._block_manager.block_size)
        if out is None:
            out = seq.export_into
            if out is not None and seq.export_until_mono_s is not None and time.monotonic() >= seq.export_until_mono_s:
                out = None  # the arena range's lease ran out: it may be another request's now
            seq.export_into = None  # read out once
        full_ids, sliding_ids = self._block_manager.kv_tables(seq, num_blocks)
        kv = self._kv_cache.read_blocks(full_ids, out=out, sliding_block_ids=sliding_ids)
        return KVPayload(request_id=seq.request_id, token_ids=seq.token_ids[:num_tokens], layout=self._layout, kv=kv)
