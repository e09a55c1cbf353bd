"""The exact prefix index: which block hashes each replica's engine holds right now, and in which
order its engine would evict them.

    engine KV events ──▶ CachedBlockSet (in the worker) ──snapshot(version, hashes)──▶
        Serve controller (routing stats, broadcast to every router) ──▶ PrefixIndex (router)

Worker side, `CachedBlockSet` replays the engine's KV events (BlockStored adds hashes,
BlockRemoved drops them) and publishes versioned snapshots as routing stats. Snapshots, not
deltas: Serve broadcasts one routing-stats dict to every router (one per ingress replica), so
nobody could consume a delta exactly once, and a router that starts while the caches are warm
holds every replica's blocks from the first stats it reads. A snapshot is 8 bytes per cached
block (10k blocks: 80 KB).

A snapshot lists its hashes in eviction order, least recently used first, the way the engine's
free queue (serving/engine/kv/block_manager.py) takes them: a stored block joins as the most recent,
and when a request ends the worker `touch`es its prompt's blocks, tail first, so the head of a
shared prefix is the most recent, as the engine frees them. Nothing more crosses the wire than a
set would; the order is what lets a router price what a placement would evict
(router/eviction.py). After the cached blocks come those of the prompts the worker has `take`n
and not finished: a prompt queued behind a long prefill is not cached for seconds, and with
several routers (one per ingress replica) only the one that sent it would know where it went;
listed, it draws its prefix's next requests from every router.

    snapshot:  [ s9 s8 | p3 p2 p1 p0 | q1 q0 ]     p0..p3 a prefix, s* a suffix nobody reuses
                 ▲ evicted first                ▲ most recently used

Router side, `PrefixIndex` keeps per replica the hashes of its newest snapshot in that order; an
older or repeated version is ignored (late or duplicate stats), a dead or removed replica is
dropped. Between snapshots the router applies its own decision at once (`note_routed`): the
routed prompt's hashes become the most recent, and if the replica's capacity is known, the
oldest hashes beyond it are dropped as the engine will drop them. So a burst of requests sharing
a new prefix follows the first one instead of scattering before the next snapshot lands, and the
next placement sees the evictions this one causes. The next snapshot replaces the guesses with
facts.

Matching walks the prompt's chained hashes in order: block i can only be cached usefully if
blocks 0..i-1 are (the engine's prefix lookup stops at the first miss), so the match length is
the first miss, not a count.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Hashable, Iterable, Sequence

import numpy as np

from serving.engine.kv.events import BlockRemoved, BlockStored, KVEvent

__all__ = ["CachedBlockSet", "PrefixIndex", "encode_hashes", "decode_hashes", "eviction_order"]


def encode_hashes(hashes: Iterable[int]) -> bytes:
    return np.fromiter(hashes, dtype=np.uint64).tobytes()


def decode_hashes(data: bytes) -> list[int]:
    """The hashes of `encode_hashes`, in their order."""
    return np.frombuffer(data, dtype=np.uint64).tolist()


def _move_to_end(order: dict[int, None], block_hashes: Sequence[int]) -> bool:
    """The held ones of `block_hashes` become the most recent, the first one last (a request's
    blocks are freed tail first). True if the order changed."""
    held = [block_hash for block_hash in block_hashes if block_hash in order]
    if list(itertools.islice(reversed(order), len(held))) == held:
        return False
    for block_hash in reversed(held):
        del order[block_hash]
        order[block_hash] = None
    return True


class CachedBlockSet:
    """The block hashes one engine holds, rebuilt from its KV events, in eviction order, and the
    hashes of the prompts it has taken but not computed yet."""

    def __init__(self) -> None:
        self._order: dict[int, None] = {}  # least recently used first
        self._taken: dict[str, Sequence[int]] = {}  # request id -> prompt hashes, oldest first
        self._held_at_take: dict[str, int] = {}  # request id -> leading blocks held when it came
        self.version = 0  # bumped by every change the snapshot shows

    @property
    def hashes(self) -> Collection[int]:
        return self._order.keys()

    def apply(self, events: Sequence[KVEvent]) -> None:
        changed = False
        for event in events:
            if isinstance(event, BlockStored):
                for block_hash in event.block_hashes:
                    self._order.pop(block_hash, None)
                    self._order[block_hash] = None
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    self._order.pop(block_hash, None)
            changed = True
        if changed:
            self.version += 1

    def take(self, request_id: str, block_hashes: Sequence[int]) -> None:
        """A request arrived: until it ends, its prompt's hashes are in the snapshot as the most
        recent (computed or not), so that every router, not only the one that sent it, sends the
        next request of that prefix here rather than computing it a second time elsewhere."""
        if block_hashes:
            self._taken[request_id] = block_hashes
            self._held_at_take[request_id] = self._num_held(block_hashes, len(block_hashes))
            self.version += 1

    def num_leading(self, block_hashes: Sequence[int], max_blocks: int) -> tuple[int, int]:
        """Of a prompt's first `max_blocks` blocks: how many lead it that the engine holds, and how
        many that it holds or that a prompt it has taken and not finished shares (being computed,
        or queued to be). Hashes chain, so a taken prompt shares a leading run: its length is
        found by bisection."""
        limit = min(max_blocks, len(block_hashes))
        held = pending = self._num_held(block_hashes, limit)
        for taken in self._taken.values():
            lo, hi = pending, min(limit, len(taken))  # does it share more than `pending` blocks?
            if hi <= lo or taken[lo] != block_hashes[lo]:
                continue
            lo += 1  # the first lo blocks are shared, at most hi: the longest shared run between
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if taken[mid - 1] == block_hashes[mid - 1]:
                    lo = mid
                else:
                    hi = mid - 1
            pending = lo
        return held, pending

    def _num_held(self, block_hashes: Sequence[int], limit: int) -> int:
        """How many of the prompt's first `limit` blocks lead it that the engine holds."""
        held = 0
        while held < limit and block_hashes[held] in self._order:
            held += 1
        return held

    def touch(self, block_hashes: Sequence[int], request_id: str | None = None, *, keep: bool = True) -> None:
        """A request over these blocks ended: the held ones are now the most recently used. One
        not kept cached (WorkerRequest.keep_cached, the router's admission) leaves the blocks it
        computed at the eviction end instead, tail first out, as the engine frees them
        (serving/engine/kv/block_manager.py); the blocks it found cached still move."""
        changed = self._taken.pop(request_id, None) is not None if request_id is not None else False
        num_hits = self._held_at_take.pop(request_id, len(block_hashes)) if request_id is not None else len(block_hashes)
        if keep:
            if _move_to_end(self._order, block_hashes) or changed:
                self.version += 1
            return
        _move_to_end(self._order, block_hashes[:num_hits])
        cold = [block_hash for block_hash in reversed(block_hashes[num_hits:]) if block_hash in self._order]
        if cold:
            for block_hash in cold:
                del self._order[block_hash]
            self._order = {**dict.fromkeys(cold), **self._order}
        self.version += 1

    def all_hashes(self) -> list[int]:
        """The hashes a snapshot lists: cached, and of the prompts taken (unordered, once each)."""
        out = dict.fromkeys(self._order)
        for block_hashes in self._taken.values():
            out.update(dict.fromkeys(block_hashes))
        return list(out)

    def snapshot(self) -> tuple[int, bytes]:
        """(version, the encoded hashes in eviction order as the engine will have them once the
        prompts taken are computed: RoutingStats.kv_version and kv_hashes; `eviction_order`)."""
        return self.version, encode_hashes(eviction_order(self._order, self._taken.values()))


def eviction_order(cached: Iterable[int], taken: Iterable[Sequence[int]]) -> list[int]:
    """The order a snapshot lists: the cached hashes least recently used first, then each prompt
    taken and not finished, in the order taken, tail first (cached or not: computing it makes
    its blocks the most recent, and the engine frees a prompt's blocks tail first). This is the
    order `PrefixIndex.note_routed` gives the prompts a router sent itself, so that every router
    predicts the same evictions from the same snapshot, whichever of them sent what."""
    order = dict.fromkeys(cached)
    for block_hashes in taken:
        for block_hash in reversed(block_hashes):
            order.pop(block_hash, None)
            order[block_hash] = None
    return list(order)


class PrefixIndex:
    def __init__(self) -> None:
        self._hashes: dict[Hashable, dict[int, None]] = {}  # replica -> hashes, least recent first
        self._versions: dict[Hashable, tuple[int, int]] = {}  # replica -> (epoch, version)
        self._capacity: dict[Hashable, int] = {}  # replica -> KV blocks, where reported
        self._holders: dict[int, int] = {}  # hash -> how many replicas hold it

    @property
    def replicas(self) -> list[Hashable]:
        return list(self._hashes)

    def update(
        self, replica: Hashable, version: int, hashes: bytes | Iterable[int], *, epoch: int = 0, num_blocks: int = 0,
    ) -> bool:
        """Replace a replica's hashes with a snapshot (in eviction order); False (ignored) if not
        newer than the last. `epoch` orders snapshots of different engine lifetimes (a restarted
        replica's pid); `num_blocks` is the replica's KV capacity (0: unknown)."""
        if num_blocks > 0:
            self._capacity[replica] = num_blocks
        last = self._versions.get(replica)
        if last is not None and (epoch, version) <= last:
            return False
        self._versions[replica] = (epoch, version)
        new = dict.fromkeys(decode_hashes(hashes) if isinstance(hashes, bytes) else hashes)
        capacity = self._capacity.get(replica, 0)
        if capacity and len(new) > capacity:  # the prompts taken will evict the oldest
            new = dict.fromkeys(itertools.islice(new, len(new) - capacity, None))
        old = self._hashes.get(replica, {})
        self._count(old.keys() - new.keys(), -1)
        self._count(new.keys() - old.keys(), +1)
        self._hashes[replica] = new
        return True

    def note_routed(self, replica: Hashable, block_hashes: Sequence[int]) -> None:
        """Optimistically: the replica will hold these blocks, most recent, once it has prefilled
        them, and will have evicted its oldest ones to make room."""
        held = self._hashes.setdefault(replica, {})
        added = [block_hash for block_hash in block_hashes if block_hash not in held]
        held.update(dict.fromkeys(added))
        self._count(added, +1)
        _move_to_end(held, block_hashes)
        capacity = self._capacity.get(replica, 0)
        if capacity:
            evicted = list(_oldest(held, len(held) - capacity))
            for block_hash in evicted:
                del held[block_hash]
            self._count(evicted, -1)

    def remove(self, replica: Hashable) -> None:
        self._count(self._hashes.pop(replica, {}), -1)
        self._versions.pop(replica, None)
        self._capacity.pop(replica, None)

    def retain(self, replicas: Iterable[Hashable]) -> None:
        """Drop every replica not in `replicas` (the router's current replica set)."""
        keep = set(replicas)
        for replica in [r for r in self._hashes if r not in keep]:
            self.remove(replica)

    def num_matched_blocks(self, replica: Hashable, block_hashes: Sequence[int]) -> int:
        held = self._hashes.get(replica)
        if not held:
            return 0
        for i, block_hash in enumerate(block_hashes):
            if block_hash not in held:
                return i
        return len(block_hashes)

    def num_blocks(self, replica: Hashable) -> int:
        return len(self._hashes.get(replica, ()))

    def capacity(self, replica: Hashable) -> int:
        """The replica's KV blocks, 0 if it has not said."""
        return self._capacity.get(replica, 0)

    def holds(self, replica: Hashable, block_hash: int) -> bool:
        return block_hash in self._hashes.get(replica, ())

    def num_holders(self, block_hash: int) -> int:
        """How many replicas hold this block."""
        return self._holders.get(block_hash, 0)

    def _count(self, block_hashes: Iterable[int], step: int) -> None:
        holders = self._holders
        for block_hash in block_hashes:
            count = holders.get(block_hash, 0) + step
            if count > 0:
                holders[block_hash] = count
            else:
                holders.pop(block_hash, None)

    def victims(self, replica: Hashable, num_new_blocks: int, keep: Collection[int] = ()) -> list[int]:
        """The hashes the replica would evict to take `num_new_blocks` more blocks, oldest first:
        none while it has that many empty blocks, none if its capacity is unknown. Hashes in
        `keep` (the blocks the request itself reuses) are taken out of the queue, not evicted."""
        capacity = self._capacity.get(replica, 0)
        held = self._hashes.get(replica, {})
        num_over = num_new_blocks - (capacity - len(held))
        if not capacity or num_over <= 0:
            return []
        return list(_oldest((h for h in held if h not in keep), num_over))


def _oldest(hashes: Iterable[int], count: int) -> Iterable[int]:
    if count <= 0:
        return ()
    out = []
    for block_hash in hashes:
        out.append(block_hash)
        if len(out) == count:
            break
    return out
