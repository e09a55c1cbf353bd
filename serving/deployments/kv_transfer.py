"""KVTransfer: one actor per node that holds exported KV until a decode worker claims it (the
actor's side of the KV hand-off; the callers' side is kv_handoff.py).

    PrefillWorker (node A)                 KVTransfer (node A)               DecodeWorker (node A|B)
    engine.export_kv ─▶ ray.put(payload) ──────────────▶ offer(id, [ref], lease)
                    ◀──────── KVHandle(id, node, bytes) ────────────────── (via the ingress)
                                                 claim(id, wait) ◀──────────  get_actor(name)
                                                 [ref] ─────────────────────▶ await ref
                                                                             same node: plasma
                                                                             mmap, zero copy;
                                                                             other node: Ray
                                                                             object transfer

The prefill worker returns the first token before it exports: the offer usually lands while the
ingress is already calling the decode worker, so a claim waits (bounded) for its offer. A release
that comes first (the client left) leaves a tombstone that drops the late offer.

The payload lives in Ray's object store. The prefill replica that put it owns it (Ray 2.56
removed `ray.put(_owner=...)`), so if that replica dies before the claim, the object is lost and
the decode worker recomputes the prompt. The actor only keeps a reference: claiming hands it over
and drops ours; a lease that runs out drops it too, which frees the object. Nothing here touches
the bytes.

Workers find their node's actor by name (`actor_name(app, node_id)`) and create it if it does not
exist yet (`get_if_exists`), pinned to that node, detached so it outlives any one replica.

If the actor dies, Ray restarts it (`max_restarts=-1`) with nothing held: offers and claims in
flight fail, and those requests recompute their prompt on the decode worker (counted as KV
fallbacks). A caller whose call fails with an actor error drops its handle and looks the actor
up again (`get_or_create`, kv_handoff.py), which also recreates one that was killed for good.
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from serving.deployments.messages import ClaimMiss, KVTransferStats

__all__ = ["KVTransfer", "actor_name", "get_or_create", "NAMESPACE", "kill_all", "ACTOR_ERRORS"]

logger = logging.getLogger(__name__)

NAMESPACE = "kvrelay"


def actor_name(app_name: str, node_id: str) -> str:
    return f"KVTransfer:{app_name}:{node_id[:16]}"


class KVTransfer:
    def __init__(self, app_name: str, node_id: str):
        self.app_name = app_name
        self.node_id = node_id
        self._held: dict[str, tuple[list[ray.ObjectRef], int, float]] = {}  # id -> refs, bytes, deadline
        # Ids released or expired before (or without) their offer, so a late offer is dropped
        # at once and a late claim learns why: id -> (reason, forget-after deadline).
        self._gone: dict[str, tuple[ClaimMiss, float]] = {}
        self._waiters: dict[str, asyncio.Event] = {}  # claims that arrived before their offer
        self._expiry_task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self.num_offered = 0
        self.num_claimed = 0
        self.num_released = 0
        self.num_expired = 0
        self.num_missed = 0  # claims that got nothing (timeout, released, expired)
        self.bytes_offered = 0

    async def offer(self, request_id: str, refs: list[ray.ObjectRef], num_bytes: int, lease_s: float) -> bool:
        """Hold a payload for `lease_s`; False (and dropped) if its request was released already."""
        self._ensure_expiry_loop()
        self.num_offered += 1
        self.bytes_offered += num_bytes
        if request_id in self._gone:
            self.num_released += 1
            return False
        self._held[request_id] = (refs, num_bytes, time.monotonic() + lease_s)
        self._wake(request_id)
        self._wakeup.set()
        return True

    async def claim(self, request_id: str, wait_s: float = 0.0) -> list[ray.ObjectRef] | ClaimMiss:
        """Hand over the payload's reference (once), waiting up to `wait_s` for its offer (the
        prefill worker offers after it has returned the first token). Otherwise why not."""
        entry = self._held.pop(request_id, None)
        if entry is None and request_id not in self._gone and wait_s > 0:
            event = self._waiters.setdefault(request_id, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), wait_s)
            except TimeoutError:
                pass
            finally:
                self._waiters.pop(request_id, None)
            entry = self._held.pop(request_id, None)
        if entry is None:
            self.num_missed += 1
            return self._gone.get(request_id, (ClaimMiss.TIMEOUT, 0.0))[0]
        self.num_claimed += 1
        return entry[0]

    async def release(self, request_id: str, lease_s: float = 60.0) -> bool:
        """Drop a payload nobody will claim (the request was aborted or its claim timed out),
        now or when it is offered. True if it was held."""
        self._ensure_expiry_loop()
        entry = self._held.pop(request_id, None)
        self._gone[request_id] = (ClaimMiss.RELEASED, time.monotonic() + lease_s)
        self._wake(request_id)
        if entry is None:
            return False
        self.num_released += 1
        return True

    async def stats(self) -> KVTransferStats:
        return KVTransferStats(
            node_id=self.node_id,
            num_held=len(self._held),
            bytes_held=sum(entry[1] for entry in self._held.values()),
            num_offered=self.num_offered,
            num_claimed=self.num_claimed,
            num_released=self.num_released,
            num_expired=self.num_expired,
            num_missed=self.num_missed,
            bytes_offered=self.bytes_offered,
        )

    def _wake(self, request_id: str) -> None:
        event = self._waiters.get(request_id)
        if event is not None:
            event.set()

    def _ensure_expiry_loop(self) -> None:
        if self._expiry_task is None:
            self._wakeup = asyncio.Event()
            self._expiry_task = asyncio.create_task(self._expire_loop())

    async def _expire_loop(self) -> None:
        while True:
            now = time.monotonic()
            for request_id, (_, num_bytes, deadline) in list(self._held.items()):
                if deadline <= now:
                    del self._held[request_id]
                    self._gone[request_id] = (ClaimMiss.EXPIRED, now + 60.0)
                    self.num_expired += 1
                    logger.warning(
                        "KV of %s (%d bytes) was not claimed within its lease; freed", request_id, num_bytes
                    )
            for request_id, (_, forget_at) in list(self._gone.items()):
                if forget_at <= now:
                    del self._gone[request_id]
            deadlines = [entry[2] for entry in self._held.values()] + [entry[1] for entry in self._gone.values()]
            self._wakeup.clear()
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout)
            except TimeoutError:
                pass


_RemoteKVTransfer = ray.remote(num_cpus=0, max_concurrency=1000, max_restarts=-1)(KVTransfer)

# What a call to a KVTransfer actor raises when the actor died, is restarting or was killed.
ACTOR_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


def get_or_create(app_name: str, node_id: str):
    """The node's KVTransfer actor, started on first use (blocking: a GCS round trip)."""
    return _RemoteKVTransfer.options(
        name=actor_name(app_name, node_id),
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(app_name, node_id)


def kill_all(app_name: str) -> int:
    """Stop every KVTransfer actor of an app (they are detached: shutting Serve down leaves them)."""
    killed = 0
    for node in ray.nodes():
        try:
            actor = ray.get_actor(actor_name(app_name, node["NodeID"]), namespace=NAMESPACE)
        except ValueError:
            continue  # none on this node
        ray.kill(actor)
        killed += 1
    return killed
