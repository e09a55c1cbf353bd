"""The exact prefix index: which block hashes each replica's engine holds right now.

    engine KV events ──▶ CachedBlockSet (in the worker) ──snapshot(version, hashes)──▶
        Serve controller (routing stats, broadcast to every router) ──▶ PrefixIndex (router)

Worker side, `CachedBlockSet` replays the engine's KV events (BlockStored adds hashes,
BlockRemoved drops them) and publishes versioned snapshots as
routing stats. Snapshots, not deltas: Serve broadcasts one routing-stats dict to every router
(one per ingress replica), so nobody could consume a delta exactly once. A snapshot is 8 bytes
per cached block (10k blocks: 80 KB).

Router side, `PrefixIndex` keeps per replica the hash set of its newest snapshot; an older or
repeated version is ignored (late or duplicate stats), a dead or removed replica is dropped.
Between snapshots the router adds a routed request's prompt hashes to the chosen replica at
once (`note_routed`), so a burst of requests sharing a new prefix follows the first one instead
of scattering before the next snapshot lands. The next snapshot replaces the guesses with facts.

Matching walks the prompt's chained hashes in order: block i can only be cached usefully if
blocks 0..i-1 are (the engine's prefix lookup stops at the first miss), so the match length is
the first miss, not a count.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from serving.engine.kv_events import BlockRemoved, BlockStored, KVEvent

__all__ = ["CachedBlockSet", "PrefixIndex", "encode_hashes", "decode_hashes"]


def encode_hashes(hashes: Iterable[int]) -> bytes:
    return np.fromiter(hashes, dtype=np.uint64).tobytes()


def decode_hashes(data: bytes) -> set[int]:
    return set(np.frombuffer(data, dtype=np.uint64).tolist())


class CachedBlockSet:
    """The set of block hashes one engine holds, rebuilt from its KV events."""

    def __init__(self) -> None:
        self.hashes: set[int] = set()
        self.version = 0  # bumped by every applied batch that changed something

    def apply(self, events: Sequence[KVEvent]) -> None:
        before = len(self.hashes)
        changed = False
        for event in events:
            if isinstance(event, BlockStored):
                self.hashes.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.hashes.difference_update(event.block_hashes)
            changed = True
        if changed or len(self.hashes) != before:
            self.version += 1

    def snapshot(self) -> tuple[int, bytes]:
        """(version, the encoded hashes): RoutingStats.kv_version and kv_hashes."""
        return self.version, encode_hashes(self.hashes)


class PrefixIndex:
    def __init__(self) -> None:
        self._hashes: dict[Hashable, set[int]] = {}
        self._versions: dict[Hashable, tuple[int, int]] = {}  # replica -> (epoch, version)

    @property
    def replicas(self) -> list[Hashable]:
        return list(self._hashes)

    def update(self, replica: Hashable, version: int, hashes: set[int] | bytes, *, epoch: int = 0) -> bool:
        """Replace a replica's set with a snapshot; False (ignored) if not newer than the last.
        `epoch` orders snapshots of different engine lifetimes (a restarted replica's pid)."""
        last = self._versions.get(replica)
        if last is not None and (epoch, version) <= last:
            return False
        self._versions[replica] = (epoch, version)
        self._hashes[replica] = decode_hashes(hashes) if isinstance(hashes, bytes) else set(hashes)
        return True

    def note_routed(self, replica: Hashable, block_hashes: Sequence[int]) -> None:
        """Optimistically: the replica will hold these blocks once it has prefilled them."""
        self._hashes.setdefault(replica, set()).update(block_hashes)

    def remove(self, replica: Hashable) -> None:
        self._hashes.pop(replica, None)
        self._versions.pop(replica, None)

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
