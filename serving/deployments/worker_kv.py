"""WorkerKV: one worker replica's side of the KV hand-off, between its engine and KVHandoff.

    prefill side  reserve(request)   a range of the node's arena for the engine to export into
                                     (of the engine's KVExportTarget kind), or None: through Ray
                  export_and_offer   in the background, after the first token went back: the
                                     engine's payload offered as the range, else ray.put + offer
    decode side   claim(kv)          the prefill's KV (a range read in place, a copy, a ref), or
                                     None: the decode worker recomputes the prompt

Every failure here is a recompute on the decode side, never a failed request: the claim misses,
and the hand-off's cost (its wait) is recorded for the placement policy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import ray

from serving.deployments.kv_handoff import KVHandoff
from serving.deployments.kv_transfer import ACTOR_ERRORS
from serving.deployments.messages import ClaimMiss, KVHandle, KVSlot
from serving.engine.contract import EngineClient, KVExportTarget
from serving.engine.kv.payload import KVPayload, ShmRange
from serving.observability import tracing
from serving.observability.worker_metrics import WorkerRecorder

__all__ = ["WorkerKV"]

logger = logging.getLogger(__name__)


class WorkerKV:
    def __init__(self, engine: EngineClient, kv: KVHandoff, recorder: WorkerRecorder, node_id: Callable[[], str]):
        self.engine, self.kv, self.recorder, self._node_id = engine, kv, recorder, node_id
        self.offers: set[asyncio.Task] = set()  # background exports, referenced until done

    # ---- prefill side ------------------------------------------------------------------------
    async def reserve(self, request_id: str, num_tokens: int) -> tuple[KVSlot | None, object]:
        """A range of the node's arena for the engine's export and what the engine writes into
        (its bytes, or the range's name: KVExportTarget); (None, None): through Ray's object store."""
        if self.engine.kv_export_target is KVExportTarget.NONE:
            return None, None  # a CUDA engine of kvrelay's: its KV goes through Ray's object store
        num_bytes = self.engine.kv_payload_bytes(num_tokens)
        slot = await self.kv.reserve(self._node_id(), request_id, num_bytes)
        export_into = self._arena_target(slot)
        return (slot, export_into) if export_into is not None else (None, None)

    def _arena_target(self, slot: KVSlot | None):
        """Where the engine exports into the reserved range: its bytes (kvrelay's engine), or the
        range's name (vLLM's, whose cache is in another process); None: no range, or the arena is
        gone (the actor was restarted since: the range is given back, the KV goes through Ray)."""
        if slot is None:
            return None
        if self.engine.kv_export_target is KVExportTarget.SHM_RANGE:
            return self.kv.shm_range(slot)
        try:
            return self.kv.arena(slot)
        except (OSError, ValueError) as exc:
            logger.warning("the KV arena %s cannot be opened (%s); the KV goes through Ray", slot.path, exc)
            self.kv.release_slot_soon(self._node_id(), slot)
            return None

    def handle(self, request_id: str, num_tokens: int) -> KVHandle:
        """Where the decode worker claims the KV of a `num_tokens`-token prompt."""
        return self.kv.handle(request_id, self._node_id(), num_tokens, self.engine.kv_payload_bytes(num_tokens))

    def offer_later(self, request_id: str, trace: tracing.CarriedTrace | None, slot: KVSlot | None, export_into) -> None:
        """Export and offer in the background (the decode worker's claim waits for the offer)."""
        task = asyncio.create_task(self._export_and_offer(request_id, trace, slot, export_into))
        self.offers.add(task)
        task.add_done_callback(self.offers.discard)

    async def _export_and_offer(
        self, request_id: str, trace: tracing.CarriedTrace | None = None, slot: KVSlot | None = None,
        export_into=None,
    ) -> None:
        start_ns = time.time_ns() if trace is not None else 0
        node_id = self._node_id()
        try:
            payload = await self.engine.export_kv(request_id)
            if slot is not None:
                if _written_into(payload, export_into) and await self.kv.offer_slot(node_id, slot.described(payload)):
                    self._exported(payload.num_bytes, trace, start_ns, "arena")
                    return
                # Not in the range (its lease ran out first: the engine never wrote it) or refused:
                # through Ray's object store. A refused range is quarantined or in an arena that
                # is gone, so what the engine wrote stays readable meanwhile.
                self.kv.release_slot_soon(node_id, slot, written=True)
                slot = None
            ref = await asyncio.to_thread(ray.put, payload)
            await self.kv.offer(node_id, request_id, ref, payload.num_bytes)
        except Exception as exc:  # noqa: BLE001 - the decode worker's claim fails and it recomputes
            if isinstance(exc, ACTOR_ERRORS):
                logger.warning("offering the KV of %s failed: the KVTransfer actor is gone (%s)", request_id, type(exc).__name__)
            else:
                logger.exception("exporting the KV of %s failed", request_id)
            if trace is not None:
                trace.record("kv_transfer", start_ns, time.time_ns(), {"kvrelay.kv.side": "export"}, error=f"{type(exc).__name__}: {exc}")
            if slot is not None:
                self.kv.release_slot_soon(node_id, slot)
            await self.engine.release_kv(request_id)
            return
        self._exported(payload.num_bytes, trace, start_ns, "object_store")

    def _exported(self, num_bytes: int, trace: tracing.CarriedTrace | None, start_ns: int, path: str) -> None:
        self.recorder.kv_exported(num_bytes)
        if trace is not None:
            trace.record("kv_transfer", start_ns, time.time_ns(),
                         {"kvrelay.kv.side": "export", "kvrelay.kv.bytes": num_bytes, "kvrelay.kv.path": path})

    # ---- decode side -------------------------------------------------------------------------
    async def claim(
        self, kv: KVHandle, trace: tracing.CarriedTrace | None = None,
    ) -> tuple[KVPayload | None, KVSlot | None]:
        """The request's KV from the prefill worker (and its arena slot, if it is read in place),
        or None: recompute the prompt here."""
        start, start_ns = time.monotonic(), time.time_ns()
        fetched = await self.kv.fetch(kv, self._node_id())
        payload, slot = (None, None) if isinstance(fetched, ClaimMiss) else fetched
        if payload is None:
            # a hand-off that failed cost its wait (what auto placement weighs, router/disaggregation.py)
            self.recorder.kv_fallback(fetched.value, None if fetched is ClaimMiss.RELEASED else time.monotonic() - start)
            logger.warning("KV of %s not imported (%s): recomputing its %d tokens", kv.request_id, fetched.value, kv.num_tokens)
        else:
            self.recorder.kv_imported(time.monotonic() - start, payload.num_bytes)
        if trace is not None:
            attributes = {"kvrelay.kv.side": "import", "kvrelay.kv.imported": payload is not None}
            if payload is not None:
                attributes["kvrelay.kv.bytes"] = payload.num_bytes
            trace.record("kv_transfer", start_ns, time.time_ns(), attributes,
                         error=None if payload is not None else "not imported; the prompt is recomputed")
        return payload, slot


def _written_into(payload: KVPayload, export_into) -> bool:
    """Whether the engine's export is the range it was given (else its lease ran out first)."""
    if isinstance(export_into, ShmRange):
        return payload.shm == export_into
    return payload.kv.data_ptr() == export_into.data_ptr()
