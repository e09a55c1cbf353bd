"""KVHandoff: the callers' side of the KV hand-off (the actor's side is kv_transfer.py).

    prefill worker                       decode worker                      ingress
    handle(...) ─▶ KVHandle              fetch(kv) ─▶ KVPayload | reason    release_soon(kv) when
    offer(node, id, ref, bytes)            claim at the node's actor,       the client left before
      once more to a restarted actor       waiting for the offer, then      the decode worker
                                           the object; any failure or the   claimed it
                                           timeout is a reason to recompute

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

from serving.config import KVTransferConfig
from serving.deployments.kv_transfer import ACTOR_ERRORS, get_or_create
from serving.deployments.messages import ClaimMiss, KVHandle
from serving.engine.kv_payload import KVPayload

__all__ = ["KVHandoff"]

logger = logging.getLogger(__name__)

class KVHandoff:
    def __init__(self, app_name: str, config: KVTransferConfig):
        self.app_name = app_name
        self.config = config
        self._actors: dict[str, object] = {}
        self._background: set[asyncio.Task] = set()  # releases in flight, referenced until done
        self.num_lookups = 0

    # ---- the node's actor --------------------------------------------------------------------
    async def actor(self, node_id: str):
        actor = self._actors.get(node_id)
        if actor is None:
            actor = await asyncio.to_thread(get_or_create, self.app_name, node_id)
            self._actors[node_id] = actor
            self.num_lookups += 1
        return actor

    def forget(self, node_id: str) -> None:
        """After an actor error: look the actor up again next time."""
        self._actors.pop(node_id, None)

    # ---- prefill side ------------------------------------------------------------------------
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
    async def claim(self, kv: KVHandle) -> list[ray.ObjectRef] | ClaimMiss:
        """The actor's answer, waiting up to timeout_s for the offer (the margin covers the round
        trip); raises TimeoutError past it, and the actor's errors."""
        actor = await self.actor(kv.node_id)
        timeout_s = self.config.timeout_s
        answer = await asyncio.wait_for(actor.claim.remote(kv.request_id, timeout_s), timeout_s + 5.0)
        if answer == ClaimMiss.TIMEOUT:
            self.release_soon(kv)  # drop the offer when it comes
        return answer

    async def fetch(self, kv: KVHandle) -> KVPayload | ClaimMiss:
        """Claim and get the payload within timeout_s, or why not (the caller recomputes the
        prompt). A cancelled caller (its client left during the hand-off) releases the offer and
        is cancelled, which is not a miss."""
        start = time.monotonic()
        try:
            answer = await self.claim(kv)
            if isinstance(answer, str):  # a ClaimMiss (an actor of an older version: its value)
                return ClaimMiss(answer)
            remaining = max(0.0, self.config.timeout_s - (time.monotonic() - start))
            return await asyncio.wait_for(answer[0], remaining)
        except TimeoutError:
            self.release_soon(kv)  # do not leave it held until the lease ends
            return ClaimMiss.TIMEOUT
        except ray.exceptions.TaskCancelledError:
            self.release_soon(kv)
            raise asyncio.CancelledError() from None
        except (ray.exceptions.RayError, ValueError) as exc:  # the actor or the object is lost
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
        # Outside the current request's context: Ray keeps an async actor's current task in a
        # context variable and cancels the calls a cancelled task made, so a release made in a
        # cancelled request's cleanup would be cancelled with it (3 of 5,000 soak requests, once).
        task = asyncio.get_running_loop().create_task(self.release(node_id, request_id), context=contextvars.Context())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def release(self, node_id: str, request_id: str) -> None:
        """Release a request's KV at the node's actor. Never raises: a release that fails is
        logged, and the KV's lease frees it anyway."""
        try:
            actor = await self.actor(node_id)
            await actor.release.remote(request_id)
        except Exception as exc:  # noqa: BLE001 - its lease frees it anyway
            if isinstance(exc, ACTOR_ERRORS):
                self.forget(node_id)
            logger.warning("releasing the KV of %s failed (%s); its lease will free it", request_id, exc)
