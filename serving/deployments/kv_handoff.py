"""KVHandoff: the callers' side of the KV hand-off (the actor's side is kv_transfer.py).

    prefill worker                       decode worker                      ingress
    reserve(node, id, bytes) ─▶ KVSlot   fetch(kv) ─▶ (KVPayload, slot)     release_soon(kv) when
      | None; arena(slot): its bytes       | reason: claim at the node's    the client left before
    handle(...) ─▶ KVHandle                actor, waiting for the offer;    the decode worker
    offer_slot(node, slot) ─▶ bool         a slot is read in place (a       claimed it
    offer(node, id, ref, bytes)            view of the arena), a copy or
      once more to a restarted actor       a ref is fetched; any failure
    release_slot_soon(node, slot)          or the timeout is a reason to
                                           recompute
                                         done_soon(node, slot) once the
                                           engine has copied the slot out

Every process holds one KVHandoff; it looks each node's actor up once (in a thread: the lookup
blocks on the GCS, never on the event loop), and again after an actor error (the actor was
restarted, empty, or killed for good and is created again). A release never raises and never
blocks its caller: it runs in the background, and the KV's lease frees it anyway if it fails.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time

import ray
import torch

from serving.config import KVTransferConfig
from serving.deployments.kv_arena import ArenaFile
from serving.deployments.kv_transfer import ACTOR_ERRORS, get_or_create
from serving.deployments.messages import ClaimMiss, KVCopy, KVHandle, KVSlot
from serving.engine.kv.payload import KVPayload, ShmRange

__all__ = ["KVHandoff"]

logger = logging.getLogger(__name__)

RESERVE_TIMEOUT_S = 1.0  # an arena reservation's bound (the prefill waits for it)
ACTOR_START_TIMEOUT_S = 60.0  # a node's KVTransfer actor, looked up (or started) by a process
# A release that meets a dead or restarting actor is made again to the restarted one (about 16 s
# in all): otherwise the request's offer, made again there by its prefill worker, would be held
# until its lease ran out (seen in a chaos soak: the client left at its first token while the
# actor restarted).
RELEASE_RETRY_DELAYS_S = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)

class KVHandoff:
    def __init__(self, app_name: str, config: KVTransferConfig):
        self.app_name = app_name
        self.config = config
        self._actors: dict[str, object] = {}
        self._background: set[asyncio.Task] = set()  # releases in flight, referenced until done
        self._arenas: dict[bytes, ArenaFile] = {}  # arena id -> its mapping (one per actor's arena)
        self.num_lookups = 0

    # ---- the node's actor --------------------------------------------------------------------
    async def actor(self, node_id: str):
        actor = self._actors.get(node_id)
        if actor is None:
            actor = await asyncio.to_thread(get_or_create, self.app_name, node_id, self.config.arena_mib << 20)
            # A new actor starts (and pre-faults its arena) before its first call returns: wait
            # for that once here, so no call's own bound (a reservation's 1 s) pays for it.
            ready = getattr(actor, "__ray_ready__", None)
            if ready is not None:
                await asyncio.wait_for(ready.remote(), ACTOR_START_TIMEOUT_S)
            self._actors[node_id] = actor
            self.num_lookups += 1
        return actor

    def forget(self, node_id: str) -> None:
        """After an actor error: look the actor up again next time."""
        self._actors.pop(node_id, None)

    def arena(self, slot: KVSlot) -> torch.Tensor:
        """The slot's bytes, in place: a uint8 tensor over the arena's shared memory."""
        arena = self._arenas.get(slot.arena_id)
        if arena is None:
            arena = ArenaFile.open(slot.path, slot.arena_id)
            # A restarted actor made a new arena: let the old mappings go (a view still in use
            # keeps its own; closing then fails and the mapping goes with its last view).
            for arena_id in list(self._arenas):
                try:
                    self._arenas.pop(arena_id).close()
                except BufferError:
                    pass
            self._arenas[slot.arena_id] = arena
        return torch.frombuffer(arena.view(slot.lease), dtype=torch.uint8)

    @staticmethod
    def shm_range(slot: KVSlot) -> ShmRange:
        """The slot's range, named for another process of the node (an engine's own, as vLLM's)."""
        return ShmRange(slot.path, ArenaFile.HEADER + slot.lease.offset, slot.lease.num_bytes, slot.arena_id)

    # ---- prefill side ------------------------------------------------------------------------
    async def reserve(self, node_id: str, request_id: str, num_bytes: int) -> KVSlot | None:
        """A range of the node's arena to export into, or None (no arena, no room, or the actor
        failed): the KV then goes through Ray's object store. Never raises."""
        if self.config.arena_mib == 0:
            return None
        try:
            actor = await self.actor(node_id)
            # Bounded: the prefill waits for it. Late, the range is left to its lease.
            return await asyncio.wait_for(actor.reserve.remote(request_id, num_bytes, self.config.lease_s), RESERVE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - Ray's object store is the other path
            if isinstance(exc, ACTOR_ERRORS):
                self.forget(node_id)
            logger.warning("reserving arena space for the KV of %s failed (%s)", request_id, exc)
            return None

    async def offer_slot(self, node_id: str, slot: KVSlot) -> bool:
        """Offer a filled range; False when it was refused (its lease ran out, its request was
        released, the actor was restarted): then the bytes go through Ray, or nowhere."""
        try:
            actor = await self.actor(node_id)
            return await actor.offer_slot.remote(slot, self.config.lease_s)
        except ACTOR_ERRORS:
            self.forget(node_id)
            return False

    def release_slot_soon(self, node_id: str, slot: KVSlot, *, written: bool = False) -> None:
        """Give a reserved range back without offering it (in the background; never raises):
        free at once when the engine has `written` it, else after the quarantine."""
        self._background_call(node_id, "release_slot", slot, written)

    def done_soon(self, node_id: str, slot: KVSlot) -> None:
        """The engine has copied a claimed range out: free it (in the background)."""
        self._background_call(node_id, "done", slot)

    def handle(self, request_id: str, node_id: str, num_tokens: int, num_bytes: int) -> KVHandle:
        return KVHandle(request_id, node_id, num_tokens, num_bytes)

    async def offer(self, node_id: str, request_id: str, ref: ray.ObjectRef, num_bytes: int) -> None:
        """Offer a payload's reference for `lease_s`. If the actor died, offer once more to the
        restarted one, so the decode worker's claim still finds it; raises the second failure."""
        for attempt in range(2):
            actor = await self.actor(node_id)
            try:
                await actor.offer.remote(request_id, [ref], num_bytes, self.config.lease_s)
                return
            except ACTOR_ERRORS:
                self.forget(node_id)
                if attempt == 1:
                    raise
                logger.warning("the KVTransfer actor died while offering the KV of %s; offering again", request_id)

    # ---- decode side -------------------------------------------------------------------------
    async def claim(self, kv: KVHandle, node_id: str | None = None) -> list[ray.ObjectRef] | KVSlot | KVCopy | ClaimMiss:
        """The actor's answer for a claimer on `node_id`, waiting up to timeout_s for the offer
        (the margin covers the round trip); raises TimeoutError past it, and the actor's errors."""
        actor = await self.actor(kv.node_id)
        timeout_s = self.config.timeout_s
        answer = await asyncio.wait_for(
            actor.claim.remote(kv.request_id, timeout_s, node_id, self.config.lease_s), timeout_s + 5.0,
        )
        if answer == ClaimMiss.TIMEOUT:
            self.release_soon(kv)  # drop the offer when it comes
        return answer

    async def fetch(self, kv: KVHandle, node_id: str | None = None) -> tuple[KVPayload, KVSlot | None] | ClaimMiss:
        """Claim and get the payload within timeout_s, or why not (the caller recomputes the
        prompt). From the arena of this node (`node_id`), the payload is a view of the range,
        readable until its lease's deadline, and its slot comes with it: the caller says
        `done_soon` once the engine has copied it out. A cancelled caller (its client left
        during the hand-off) releases the offer and is cancelled, which is not a miss."""
        start = time.monotonic()
        slot = None
        try:
            answer = await self.claim(kv, node_id)
            if isinstance(answer, str):  # a ClaimMiss (an actor of an older version: its value)
                return ClaimMiss(answer)
            if isinstance(answer, KVSlot):
                slot = answer
                if time.monotonic() - start > self.config.timeout_s:  # as a get past the timeout
                    raise TimeoutError
                kv_view = self.arena(slot).view(getattr(torch, slot.layout.dtype)).view(slot.shape)
                payload = KVPayload(kv.request_id, list(slot.token_ids), slot.layout, kv_view, readable_until=slot.deadline,
                                    shm=self.shm_range(slot))
                return payload, slot
            remaining = max(0.0, self.config.timeout_s - (time.monotonic() - start))
            if isinstance(answer, KVCopy):
                raw = await asyncio.wait_for(answer.ref, remaining)
                return KVPayload.from_raw(kv.request_id, answer.token_ids, answer.layout, raw, answer.shape), None
            return await asyncio.wait_for(answer[0], remaining), None
        except TimeoutError:
            if slot is not None:
                self.done_soon(kv.node_id, slot)
            self.release_soon(kv)  # do not leave it held until the lease ends
            return ClaimMiss.TIMEOUT
        except ray.exceptions.TaskCancelledError:
            self.release_soon(kv)
            raise asyncio.CancelledError() from None
        except (ray.exceptions.RayError, ValueError, OSError) as exc:  # the actor, the object or the arena is lost
            if slot is not None:
                self.done_soon(kv.node_id, slot)
            if isinstance(exc, ACTOR_ERRORS):
                # Dead or restarting: tell the restarted actor to drop this request's offer,
                # which the prefill worker makes again to it.
                self.forget(kv.node_id)
                self.release_soon(kv)
            logger.warning("KV import of %s failed (%s)", kv.request_id, exc)
            return ClaimMiss.ERROR

    # ---- releases ----------------------------------------------------------------------------
    def release_soon(self, kv: KVHandle) -> None:
        """Release `kv` at its node's actor in the background (a tombstone if it is not offered
        yet), so a caller being cancelled never waits for it or fails on it."""
        self.release_soon_at(kv.node_id, kv.request_id)

    def release_soon_at(self, node_id: str, request_id: str) -> None:
        self._in_background(self.release(node_id, request_id))

    async def release(self, node_id: str, request_id: str) -> None:
        """Release a request's KV at the node's actor (made again to a restarted actor). Never
        raises: a release that fails is logged, and the KV's lease frees it anyway."""
        await self._call_quietly(node_id, "release", request_id, retry_delays_s=RELEASE_RETRY_DELAYS_S)

    def _background_call(self, node_id: str, method: str, *args) -> None:
        self._in_background(self._call_quietly(node_id, method, *args))

    def _in_background(self, coroutine) -> None:
        # Outside the current request's context: Ray keeps an async actor's current task in a
        # context variable and cancels the calls a cancelled task made, so a release made in a
        # cancelled request's cleanup would be cancelled with it (3 of 5,000 soak requests, once).
        task = asyncio.get_running_loop().create_task(coroutine, context=contextvars.Context())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _call_quietly(self, node_id: str, method: str, *args, retry_delays_s: tuple[float, ...] = ()) -> None:
        for attempt in range(len(retry_delays_s) + 1):
            try:
                actor = await self.actor(node_id)
                await getattr(actor, method).remote(*args)
                return
            except Exception as exc:  # noqa: BLE001 - the lease frees it anyway
                if not isinstance(exc, ACTOR_ERRORS) or attempt == len(retry_delays_s):
                    logger.warning("%s at the KVTransfer actor failed (%s); the lease will free it", method, exc)
                    return
                self.forget(node_id)
                await asyncio.sleep(retry_delays_s[attempt])
