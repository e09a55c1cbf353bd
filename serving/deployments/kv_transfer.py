"""KVTransfer: one actor per node that holds exported KV until a decode worker claims it (the
actor's side of the KV hand-off; the callers' side is kv_handoff.py).

On one node, the hand-off goes through the node's shared-memory arena, which this actor owns
(kv_arena.py): the prefill worker reserves a range before its prompt runs, the engine gathers the
KV blocks straight into it, the worker offers the range (a KVSlot: path, offset, lease); the
decode worker claims it, its engine scatters the range straight into its own blocks, and it says
done. Only leases cross Ray. When the arena has no free range, when the decode worker is on
another node (the actor copies the range into Ray's object store for it: a KVCopy), or when a
lease ran out, the hand-off goes through Ray's object store as below.

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

If the actor dies, Ray restarts it (`max_restarts=-1`) with nothing held and a new arena (the
old one's memory goes when the last process that maps it lets go):
offers and claims in flight fail, and those requests recompute their prompt on the decode worker
(counted as KV fallbacks). A caller whose call fails with an actor error drops its handle and looks the actor
up again (`get_or_create`, kv_handoff.py), which also recreates one that was killed for good.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from serving.deployments.kv_arena import ArenaAllocator, ArenaFile
from serving.deployments.messages import ClaimMiss, KVCopy, KVSlot, KVTransferStats

__all__ = ["KVTransfer", "actor_name", "get_or_create", "NAMESPACE", "kill_all", "ACTOR_ERRORS"]

logger = logging.getLogger(__name__)

NAMESPACE = "kvrelay"


def actor_name(app_name: str, node_id: str) -> str:
    return f"KVTransfer:{app_name}:{node_id[:16]}"


# A range whose writer's or reader's lease ran out stays unused this long: far longer than any copy
# that started before the lease's end takes (a few ms for tens of MiB).
ARENA_QUARANTINE_S = 30.0
_MIN_ARENA_BYTES = 16 << 20


def memory_available() -> int:
    """Bytes this node can still give: MemAvailable, or less under a cgroup v2 memory limit."""
    available = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read())
        if limit != "max":
            available = min(available, int(limit) - current)
    except (OSError, ValueError):
        pass
    return max(0, available)


def create_arena(num_bytes: int) -> ArenaFile | None:
    """This actor's arena of `num_bytes` (at most a quarter of the memory the node has available),
    pre-faulted; None when `num_bytes` is 0 or that leaves under 16 MiB, or shared memory cannot
    be made here (hand-offs then go through Ray's object store)."""
    if num_bytes <= 0:
        return None
    available = memory_available()
    size = min(num_bytes, available // 4) // 4096 * 4096
    if size < _MIN_ARENA_BYTES:
        logger.warning("the node has %d bytes of memory available: no KV arena (hand-offs go through Ray's object store)", available)
        return None
    if size < num_bytes:
        logger.warning("the KV arena is %d bytes, not %d: a quarter of the memory available", size, num_bytes)
    try:
        return ArenaFile.create(size)
    except OSError as exc:
        logger.warning("no KV arena (%s): hand-offs go through Ray's object store", exc)
        return None


class KVTransfer:
    def __init__(self, app_name: str, node_id: str, arena_bytes: int = 0):
        self.app_name = app_name
        self.node_id = node_id
        self.arena = create_arena(arena_bytes)
        self.allocator = ArenaAllocator(self.arena.capacity, quarantine_s=ARENA_QUARANTINE_S) if self.arena else None
        # id -> ([ref] or an arena slot, bytes, deadline)
        self._held: dict[str, tuple[list[ray.ObjectRef] | KVSlot, int, float]] = {}
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
        self.num_arena_offers = 0
        self.num_arena_full = 0
        self.num_arena_copies = 0

    # ---- the arena (same-node hand-offs) -----------------------------------------------------
    async def reserve(self, request_id: str, num_bytes: int, lease_s: float) -> KVSlot | None:
        """A range of the arena for a prefill worker to export `request_id`'s KV into, or None
        (no arena, or no free range that large: the KV then goes through Ray's object store)."""
        if self.allocator is None or request_id in self._gone:
            return None
        # A retried request: its earlier writer's range (and offer of it) give way to this one.
        self.allocator.release(request_id)
        if request_id in self._held and isinstance(self._held[request_id][0], KVSlot):
            del self._held[request_id]
        lease = self.allocator.reserve(request_id, num_bytes, lease_s)
        if lease is None:
            self.num_arena_full += 1
            return None
        return KVSlot(self.arena.path, lease, self.allocator.deadline_of(lease), arena_id=self.arena.arena_id)

    async def offer_slot(self, slot: KVSlot, lease_s: float) -> bool:
        """The writer filled its range (`slot`, described): hold it for a claim. False when its
        lease ran out or its request was released meanwhile (the writer then offers the bytes
        through Ray's object store, or drops them)."""
        self._ensure_expiry_loop()
        request_id = slot.lease.request_id
        if self.allocator is None or slot.arena_id != self.arena.arena_id or request_id in self._gone:
            return False
        if not self.allocator.offer(slot.lease, lease_s):
            return False
        self.num_offered += 1
        self.num_arena_offers += 1
        self.bytes_offered += slot.lease.num_bytes
        deadline = self.allocator.deadline_of(slot.lease)
        self._held[request_id] = (slot, slot.lease.num_bytes, deadline)
        self._wake(request_id)
        self._wakeup.set()
        return True

    async def release_slot(self, slot: KVSlot, written: bool = False) -> bool:
        """The writer will not offer its range (its request ended, or its bytes went through Ray
        instead): free it, at once if it has `written` (its engine's copy is over), else after
        the quarantine (its engine may still be copying)."""
        if self.allocator is None or slot.arena_id != self.arena.arena_id:
            return False
        return self.allocator.release_lease(slot.lease, written=written)

    async def done(self, slot: KVSlot) -> bool:
        """The reader has copied its range out: free it. False when its lease had run out (the
        range was in quarantine: what a copy that started before the deadline read is good)."""
        if self.allocator is None or slot.arena_id != self.arena.arena_id:
            return False
        return self.allocator.done(slot.lease)

    def _claimed_slot(self, slot: KVSlot, node_id: str | None, lease_s: float) -> KVSlot | KVCopy | None:
        lease = self.allocator.claim(slot.lease.request_id, lease_s)
        if lease is None:
            return None
        reading = replace(slot, lease=lease, deadline=self.allocator.deadline_of(lease))
        if node_id == self.node_id:
            return reading
        # Another node cannot map this arena: copy the range into Ray's object store for it.
        try:
            raw = np.frombuffer(self.arena.view(lease), dtype=np.uint8).copy()
        finally:
            self.allocator.done(lease)
        self.num_arena_copies += 1
        return KVCopy(ray.put(raw), slot.token_ids, slot.layout, slot.shape)

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

    async def claim(
        self, request_id: str, wait_s: float = 0.0, node_id: str | None = None, lease_s: float = 30.0,
    ) -> list[ray.ObjectRef] | KVSlot | KVCopy | ClaimMiss:
        """Hand over the payload (once), waiting up to `wait_s` for its offer (the prefill worker
        offers after it has returned the first token). Otherwise why not. An arena range goes
        to a claimer on this node (`node_id`) as a reading lease of `lease_s`; to one on
        another node (or one that does not say), as a copy in Ray's object store."""
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
        if entry is not None and isinstance(entry[0], KVSlot):
            claimed = self._claimed_slot(entry[0], node_id, lease_s)
            if claimed is None:  # the arena reclaimed the range first (its lease ran out)
                self.num_missed += 1
                return ClaimMiss.EXPIRED
            entry = (claimed,)
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
        if self.allocator is not None:
            self.allocator.release(request_id)  # its range, if any: free, or quarantined if in use
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
            arena_bytes=self.arena.capacity if self.arena else 0,
            arena_free_bytes=self.allocator.free_bytes if self.allocator else 0,
            num_arena_offers=self.num_arena_offers,
            num_arena_full=self.num_arena_full,
            num_arena_copies=self.num_arena_copies,
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
                    if self.allocator is not None:
                        self.allocator.release(request_id)
                    self._gone[request_id] = (ClaimMiss.EXPIRED, now + 60.0)
                    self.num_expired += 1
                    logger.warning(
                        "KV of %s (%d bytes) was not claimed within its lease; freed", request_id, num_bytes
                    )
            for request_id, (_, forget_at) in list(self._gone.items()):
                if forget_at <= now:
                    del self._gone[request_id]
            if self.allocator is not None:
                self.allocator.expire()  # quarantines that ended, leases that ran out
            deadlines = [entry[2] for entry in self._held.values()] + [entry[1] for entry in self._gone.values()]
            if self.allocator is not None and self.allocator.next_deadline() is not None:
                deadlines.append(self.allocator.next_deadline())
            self._wakeup.clear()
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout)
            except TimeoutError:
                pass


_RemoteKVTransfer = ray.remote(num_cpus=0, max_concurrency=1000, max_restarts=-1)(KVTransfer)

# What a call to a KVTransfer actor raises when the actor died, is restarting or was killed.
ACTOR_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


def get_or_create(app_name: str, node_id: str, arena_bytes: int = 0):
    """The node's KVTransfer actor, started on first use (blocking: a GCS round trip) with an
    arena of `arena_bytes` (the first caller's figure: every worker of an app has the same)."""
    return _RemoteKVTransfer.options(
        name=actor_name(app_name, node_id),
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(app_name, node_id, arena_bytes)


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
    return killed  # their arenas went with them (kv_arena.ArenaFile: nothing is left behind)
