"""A per-node shared-memory arena for same-node KV hand-offs (driven by kv_transfer.py's actor).

    KVTransfer actor (owner)             prefill worker (writer)            decode worker (reader)
    ArenaFile.create(size)
    allocator.reserve(id, n) ──lease──▶  ArenaFile.open(path, id).view(lease)
                                         engine gathers its blocks into it
    allocator.offer(lease)   ◀────────── (the lease, not the bytes, crosses Ray)
    allocator.claim(id)      ──lease──────────────────────────────────────▶ view(lease): scatter
    allocator.done(lease)    ◀──────────────────────────────────────────── the copy is over

Only leases cross Ray: (path, offset, size, lease id, generation). A range of the arena moves
WRITING -> OFFERED -> READING -> free. Safety, the point of this module, rests on one rule its
users keep: a holder starts a copy into or out of its range only before its lease's deadline
(one monotonic clock for the node's processes), and a copy takes far less than `quarantine_s`.
- a range is never handed out while a writer or reader may still touch it: a lease that runs out,
  or is released, while WRITING or READING goes to quarantine until `quarantine_s` after the
  later of its deadline and now, so a slow, abandoned or dead holder's late copy cannot land in
  (or read from) another request's range;
- a holder that reports (offer, done) after its lease ran out is told so (False): its copy began
  before the deadline, so it is whole, but the range is no longer its own;
- a released OFFERED range, and a writer's range given back after its copy, are free at once.
The allocator is first fit over a sorted free list with merging of neighbours; sizes are rounded
up to `align` (a page) so every range starts page-aligned.

This module is Ray-free (the actor drives the allocator; tests drive it with a fake clock).
"""

from __future__ import annotations

import bisect
import enum
import itertools
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ArenaAllocator", "ArenaFile", "Lease", "RangeState"]


class RangeState(str, enum.Enum):
    WRITING = "writing"
    OFFERED = "offered"
    READING = "reading"
    QUARANTINED = "quarantined"


@dataclass(frozen=True)
class Lease:
    request_id: str
    lease_id: int
    generation: int  # bumped each time the range is handed to a new holder
    offset: int
    num_bytes: int  # what the holder asked for (the range may be larger: aligned)


@dataclass
class _Range:
    lease: Lease
    size: int  # aligned
    state: RangeState
    deadline: float


class ArenaAllocator:
    def __init__(self, size: int, *, align: int = 4096, quarantine_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        if size <= 0 or size % align:
            raise ValueError(f"arena size {size} must be a positive multiple of {align}")
        self.size = size
        self.align = align
        self.quarantine_s = quarantine_s
        self._clock = clock
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, size), sorted by offset
        self._ranges: dict[int, _Range] = {}  # lease id -> range
        self._by_request: dict[str, int] = {}  # request id -> lease id (not quarantined)
        self._ids = itertools.count(1)
        self._generation = itertools.count(1)

    # ---- the hand-off ------------------------------------------------------------------------
    def reserve(self, request_id: str, num_bytes: int, lease_s: float) -> Lease | None:
        """A range for a writer, or None when no free range is large enough (the caller then
        hands the KV over through Ray's object store). A request holds one range at a time."""
        self.expire()
        if num_bytes <= 0:
            raise ValueError(f"num_bytes must be > 0, got {num_bytes}")
        if request_id in self._by_request:
            raise ValueError(f"request {request_id!r} already holds a range")
        size = -(-num_bytes // self.align) * self.align
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                lease = Lease(request_id, next(self._ids), next(self._generation), offset, num_bytes)
                self._ranges[lease.lease_id] = _Range(lease, size, RangeState.WRITING, self._clock() + lease_s)
                self._by_request[request_id] = lease.lease_id
                return lease
        return None

    def offer(self, lease: Lease, lease_s: float) -> bool:
        """The writer has filled its range: it waits for a reader. False when the lease was
        reclaimed meanwhile (the writer's bytes are void)."""
        held = self._current(lease, RangeState.WRITING)
        if held is None:
            return False
        held.state = RangeState.OFFERED
        held.deadline = self._clock() + lease_s
        return True

    def claim(self, request_id: str, lease_s: float) -> Lease | None:
        """The offered range of `request_id` for a reader (a new generation), or None."""
        self.expire()
        lease_id = self._by_request.get(request_id)
        held = self._ranges.get(lease_id) if lease_id is not None else None
        if held is None or held.state is not RangeState.OFFERED:
            return None
        lease = Lease(request_id, held.lease.lease_id, next(self._generation), held.lease.offset, held.lease.num_bytes)
        held.lease, held.state, held.deadline = lease, RangeState.READING, self._clock() + lease_s
        return lease

    def done(self, lease: Lease) -> bool:
        """The reader has copied the range out: it is free. False when the lease was reclaimed
        meanwhile (what the reader copied may be another request's: it must not be used)."""
        held = self._current(lease, RangeState.READING)
        if held is None:
            return False
        self._drop(held, quarantine=False)
        return True

    def release_lease(self, lease: Lease, *, written: bool = False) -> bool:
        """A writer gives up its range (only while it is still its own): as release(); free at
        once when it has `written` (its copy is over: it will not touch the range again)."""
        held = self._current(lease, RangeState.WRITING)
        if held is None:
            return False
        self._drop(held, quarantine=not written)
        return True

    def release(self, request_id: str) -> bool:
        """The request is gone (the client left, the decode worker recomputed): free its range,
        after the quarantine if a writer or reader may still hold it."""
        lease_id = self._by_request.get(request_id)
        if lease_id is None:
            return False
        held = self._ranges[lease_id]
        self._drop(held, quarantine=held.state is not RangeState.OFFERED)
        return True

    def expire(self) -> int:
        """Reclaim what ran out: leases past their deadline (to quarantine, or free if OFFERED),
        quarantines past theirs (free). Returns how many ranges changed."""
        now = self._clock()
        changed = 0
        for held in [r for r in self._ranges.values() if r.deadline <= now]:
            if held.state is RangeState.QUARANTINED:
                self._free_range(held)
            else:
                self._drop(held, quarantine=held.state is not RangeState.OFFERED)
            changed += 1
        return changed

    # ---- figures -----------------------------------------------------------------------------
    def deadline_of(self, lease: Lease) -> float:
        """When `lease` runs out, on the allocator's clock (time.monotonic(): the node's)."""
        return self._ranges[lease.lease_id].deadline

    def next_deadline(self) -> float | None:
        """The soonest time something here runs out (a lease or a quarantine), or None."""
        return min((r.deadline for r in self._ranges.values()), default=None)

    @property
    def free_bytes(self) -> int:
        return sum(size for _, size in self._free)

    def state_of(self, request_id: str) -> RangeState | None:
        lease_id = self._by_request.get(request_id)
        return self._ranges[lease_id].state if lease_id is not None else None

    @property
    def num_quarantined(self) -> int:
        return sum(1 for r in self._ranges.values() if r.state is RangeState.QUARANTINED)

    # ---- internals ---------------------------------------------------------------------------
    def _current(self, lease: Lease, state: RangeState) -> _Range | None:
        self.expire()
        held = self._ranges.get(lease.lease_id)
        if held is None or held.state is not state or held.lease.generation != lease.generation:
            return None
        return held

    def _drop(self, held: _Range, *, quarantine: bool) -> None:
        self._by_request.pop(held.lease.request_id, None)
        if quarantine:
            # Its holder may start a copy until its lease's deadline, released or not: the
            # quarantine runs from whichever is later, that deadline or now.
            held.state = RangeState.QUARANTINED
            held.deadline = max(self._clock(), held.deadline) + self.quarantine_s
        else:
            self._free_range(held)

    def _free_range(self, held: _Range) -> None:
        del self._ranges[held.lease.lease_id]
        offset, size = held.lease.offset, held.size
        i = bisect.bisect_left(self._free, (offset, 0))
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # merge with the left
            i -= 1
            offset, size = self._free[i][0], self._free[i][1] + size
            del self._free[i]
        if i < len(self._free) and offset + size == self._free[i][0]:  # and the right
            size += self._free[i][1]
            del self._free[i]
        self._free.insert(i, (offset, size))


class ArenaFile:
    """The arena's bytes: an anonymous shared-memory file (memfd) of the owner's, mapped by every
    process of the node that opens its path, /proc/<owner pid>/fd/<fd>. Nothing is named in a
    file system: the memory goes when the owner has closed it (or died) and the last mapping is
    gone, and /dev/shm's size (64 MiB in a default container) does not bound it. The first page
    holds the arena's random id: a path that names another file (a restarted owner with the same
    pid and fd) is refused when opened. Leases' offsets count from after it (`capacity` bytes)."""

    HEADER = 4096

    def __init__(self, path: str, mapping: mmap.mmap, size: int, arena_id: bytes, fd: int | None = None):
        self.path = path
        self.mapping = mapping
        self.size = size
        self.arena_id = arena_id
        self._fd = fd  # the owner's: the path names it

    @property
    def capacity(self) -> int:
        return self.size - self.HEADER

    @classmethod
    def create(cls, size: int, *, prefault: bool = True) -> ArenaFile:
        """A new arena of `size` bytes (the header page included), mapped; every page touched so
        no copy page-faults."""
        fd = os.memfd_create("kvrelay-kv-arena", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        if prefault:
            for offset in range(0, size, mmap.PAGESIZE):
                mapping[offset] = 0
        arena_id = os.urandom(16)
        mapping[:len(arena_id)] = arena_id
        return cls(f"/proc/{os.getpid()}/fd/{fd}", mapping, size, arena_id, fd)

    @classmethod
    def open(cls, path: str, arena_id: bytes) -> ArenaFile:
        """Map another process's arena (OSError when it is gone, not ours to open, or not the
        arena `arena_id` names)."""
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size <= cls.HEADER:
                raise OSError(f"{path} is not a KV arena ({size} bytes)")
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if mapping[:len(arena_id)] != arena_id:
            mapping.close()
            raise OSError(f"{path} is not the KV arena it was named as (its owner was restarted)")
        return cls(path, mapping, size, arena_id)

    def view(self, lease: Lease) -> memoryview:
        """The lease's bytes (exactly num_bytes), writable."""
        if lease.offset + lease.num_bytes > self.capacity:
            raise ValueError(f"lease {lease} is outside the arena {self.path} ({self.capacity} bytes)")
        start = self.HEADER + lease.offset
        return memoryview(self.mapping)[start: start + lease.num_bytes]

    def close(self) -> None:
        self.mapping.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
