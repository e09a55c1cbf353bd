"""KVTransfer: one actor per node that holds exported KV until a decode worker claims it.

    PrefillWorker (node A)                 KVTransfer (node A)               DecodeWorker (node A|B)
    engine.export_kv ─▶ ray.put(payload) ──────────────▶ offer(id, [ref], lease)
                    ◀──────── KVHandle(id, actor name, bytes) ───────────── (via the ingress)
                                                 claim(id) ◀────────────────  get_actor(name)
                                                 [ref] ─────────────────────▶ await ref
                                                                             same node: plasma
                                                                             mmap, zero copy;
                                                                             other node: Ray
                                                                             object transfer

The payload lives in Ray's object store. The prefill replica that put it owns it (Ray 2.56
removed `ray.put(_owner=...)`), so if that replica dies before the claim, the object is lost and
the decode worker recomputes the prompt. The actor only keeps a reference: claiming hands it over
and drops ours; a lease that runs out drops it too, which frees the object. Nothing here touches
the bytes.

Workers find their node's actor by name (`actor_name(app, node_id)`) and create it if it does not
exist yet (`get_if_exists`), pinned to that node, detached so it outlives any one replica.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

__all__ = ["KVTransfer", "KVHandle", "actor_name", "get_or_create", "NAMESPACE", "kill_all"]

logger = logging.getLogger(__name__)

NAMESPACE = "kvrelay"


@dataclass(frozen=True)
class KVHandle:
    """Where a request's exported KV waits: small, travels with the request through the ingress."""

    request_id: str
    actor_name: str
    node_id: str
    num_tokens: int
    num_bytes: int


def actor_name(app_name: str, node_id: str) -> str:
    return f"KVTransfer:{app_name}:{node_id[:16]}"


class KVTransfer:
    def __init__(self, app_name: str, node_id: str):
        self.app_name = app_name
        self.node_id = node_id
        self._held: dict[str, tuple[list[ray.ObjectRef], int, float]] = {}  # id -> refs, bytes, deadline
        self._expiry_task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self.num_offered = 0
        self.num_claimed = 0
        self.num_released = 0
        self.num_expired = 0
        self.num_missed = 0  # claims for ids not (or no longer) held
        self.bytes_offered = 0

    async def offer(self, request_id: str, refs: list[ray.ObjectRef], num_bytes: int, lease_s: float) -> None:
        if self._expiry_task is None:
            self._wakeup = asyncio.Event()
            self._expiry_task = asyncio.create_task(self._expire_loop())
        self._held[request_id] = (refs, num_bytes, time.monotonic() + lease_s)
        self.num_offered += 1
        self.bytes_offered += num_bytes
        self._wakeup.set()

    async def claim(self, request_id: str) -> list[ray.ObjectRef] | None:
        """Hand over the payload's reference (once); None when expired, released or unknown."""
        entry = self._held.pop(request_id, None)
        if entry is None:
            self.num_missed += 1
            return None
        self.num_claimed += 1
        return entry[0]

    async def release(self, request_id: str) -> bool:
        """Drop a payload nobody will claim (the request was aborted)."""
        if self._held.pop(request_id, None) is None:
            return False
        self.num_released += 1
        return True

    async def stats(self) -> dict:
        return {
            "node_id": self.node_id,
            "num_held": len(self._held),
            "bytes_held": sum(entry[1] for entry in self._held.values()),
            "num_offered": self.num_offered,
            "num_claimed": self.num_claimed,
            "num_released": self.num_released,
            "num_expired": self.num_expired,
            "num_missed": self.num_missed,
            "bytes_offered": self.bytes_offered,
        }

    async def _expire_loop(self) -> None:
        while True:
            now = time.monotonic()
            for request_id, (_, num_bytes, deadline) in list(self._held.items()):
                if deadline <= now:
                    del self._held[request_id]
                    self.num_expired += 1
                    logger.warning(
                        "KV of %s (%d bytes) was not claimed within its lease; freed", request_id, num_bytes
                    )
            next_deadline = min((entry[2] for entry in self._held.values()), default=None)
            self._wakeup.clear()
            timeout = None if next_deadline is None else max(0.0, next_deadline - time.monotonic())
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout)
            except TimeoutError:
                pass


_RemoteKVTransfer = ray.remote(num_cpus=0, max_concurrency=1000)(KVTransfer)


def get_or_create(app_name: str, node_id: str):
    """This node's KVTransfer actor, started on first use."""
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
