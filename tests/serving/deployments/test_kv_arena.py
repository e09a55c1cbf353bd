"""The KV arena's allocator: leases, their expiry, and that no range is handed to a new holder
while an old one may still touch it."""

from __future__ import annotations

import os
import random

import pytest

from serving.deployments.kv_arena import ArenaAllocator, ArenaFile, RangeState

PAGE = 4096


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def arena(pages: int = 16, quarantine_s: float = 30.0) -> tuple[ArenaAllocator, Clock]:
    clock = Clock()
    return ArenaAllocator(pages * PAGE, align=PAGE, quarantine_s=quarantine_s, clock=clock), clock


def test_a_hand_off_moves_a_range_through_its_states_and_frees_it():
    a, _ = arena()
    lease = a.reserve("r1", 5000, lease_s=10)
    assert (lease.offset, lease.num_bytes) == (0, 5000) and a.free_bytes == 14 * PAGE  # 2 pages
    assert a.state_of("r1") is RangeState.WRITING
    assert a.claim("r1", lease_s=10) is None  # not offered yet
    assert a.offer(lease, lease_s=10)
    read = a.claim("r1", lease_s=10)
    assert (read.offset, read.num_bytes) == (0, 5000) and read.generation != lease.generation
    assert a.claim("r1", lease_s=10) is None  # one reader
    assert a.done(read)
    assert a.free_bytes == 16 * PAGE and a.state_of("r1") is None


def test_first_fit_and_neighbours_merge():
    a, _ = arena(pages=8)
    leases = [a.reserve(f"r{i}", PAGE, lease_s=10) for i in range(8)]
    assert [lease.offset for lease in leases] == [i * PAGE for i in range(8)]
    assert a.reserve("r9", 1, lease_s=10) is None  # full: the caller uses Ray's object store
    for i in (1, 2, 4):
        a.offer(leases[i], 10)
        a.release(f"r{i}")  # offered: free at once
    assert a.free_bytes == 3 * PAGE
    big = a.reserve("big", 2 * PAGE, lease_s=10)
    assert big.offset == PAGE  # pages 1-2 merged, first fit
    assert a.reserve("big2", 2 * PAGE, lease_s=10) is None  # page 4 alone is too small


def test_an_expired_writer_is_quarantined_and_its_late_offer_refused():
    """A writer that outlives its lease (slow, or dead) must not have its range reused while it
    may still be writing: the range waits out the quarantine, and the late offer is refused."""
    a, clock = arena(pages=1, quarantine_s=30)
    lease = a.reserve("r1", PAGE, lease_s=10)
    clock.now = 11
    assert a.reserve("r2", PAGE, lease_s=10) is None  # quarantined, not free
    assert a.num_quarantined == 1
    assert not a.offer(lease, lease_s=10)  # the writer learns its bytes are void
    clock.now = 11 + 30
    assert a.reserve("r2", PAGE, lease_s=10) is not None  # after the quarantine


def test_a_reader_whose_lease_ran_out_is_told_its_copy_is_void():
    a, clock = arena(pages=1, quarantine_s=5)
    lease = a.reserve("r1", PAGE, lease_s=10)
    a.offer(lease, lease_s=10)
    read = a.claim("r1", lease_s=10)
    clock.now = 30
    assert a.reserve("r2", PAGE, lease_s=10) is None  # quarantined while the reader may copy
    clock.now = 36
    new = a.reserve("r2", PAGE, lease_s=10)
    assert new is not None and new.offset == read.offset
    assert not a.done(read)  # another request owns the bytes now: the old reader must recompute


def test_an_offer_nobody_claims_is_freed_when_it_runs_out():
    a, clock = arena(pages=1)
    lease = a.reserve("r1", PAGE, lease_s=10)
    a.offer(lease, lease_s=10)
    clock.now = 11
    assert a.reserve("r2", PAGE, lease_s=10) is not None  # nobody held it: no quarantine
    assert a.claim("r1", lease_s=10) is None


def test_release_while_writing_or_reading_quarantines():
    a, clock = arena(pages=2, quarantine_s=5)
    w = a.reserve("w", PAGE, lease_s=10)
    r = a.reserve("r", PAGE, lease_s=10)
    a.offer(r, 10)
    read = a.claim("r", 10)
    assert a.release("w") and a.release("r")
    assert a.free_bytes == 0 and a.num_quarantined == 2
    assert not a.offer(w, 10) and not a.done(read)
    clock.now = 6
    assert a.reserve("x", 2 * PAGE, lease_s=10) is not None  # both freed and merged
    assert not a.release("nobody")


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="multiple of 4096"):
        ArenaAllocator(1000, align=PAGE)
    a, _ = arena()
    with pytest.raises(ValueError, match="num_bytes must be > 0"):
        a.reserve("r", 0, lease_s=10)
    a.reserve("r", 1, lease_s=10)
    with pytest.raises(ValueError, match="already holds a range"):
        a.reserve("r", 1, lease_s=10)


def test_random_traffic_never_hands_out_a_held_range():
    """Thousands of random reserves, offers, claims, dones, releases and clock jumps: held and
    free ranges never overlap and always add up to the arena, and whenever a holder is told its
    copy is good (offer or done answers True), no other request was given any of its bytes since
    its range was reserved."""
    rng = random.Random(7)
    a, clock = arena(pages=64, quarantine_s=3)
    writing, offered, reading = {}, {}, {}
    grants: list[tuple[int, int, int, int]] = []  # (step, lease id, start, end) of every reserve
    reserved_at: dict[int, int] = {}  # lease id -> step

    def untouched_since(lease) -> bool:
        start, end = lease.offset, lease.offset + lease.num_bytes
        return not any(step > reserved_at[lease.lease_id] and lease_id != lease.lease_id and s < end and start < e
                       for step, lease_id, s, e in grants)

    told_good = 0
    for step in range(20000):
        op = rng.random()
        if op < 0.3:
            rid = f"r{step}"
            lease = a.reserve(rid, rng.randint(1, 6 * PAGE), lease_s=rng.uniform(1, 5))
            if lease is not None:
                writing[rid] = lease
                grants.append((step, lease.lease_id, lease.offset, lease.offset + lease.num_bytes))
                reserved_at[lease.lease_id] = step
        elif op < 0.5 and writing:
            rid = rng.choice(list(writing))
            lease = writing.pop(rid)
            if a.offer(lease, lease_s=rng.uniform(1, 5)):
                assert untouched_since(lease)
                offered[rid] = lease
                told_good += 1
        elif op < 0.65 and offered:
            rid = rng.choice(list(offered))
            offered.pop(rid)
            read = a.claim(rid, lease_s=rng.uniform(1, 5))
            if read is not None:
                reading[rid] = read
        elif op < 0.8 and reading:
            rid = rng.choice(list(reading))
            read = reading.pop(rid)
            if a.done(read):
                assert untouched_since(read)
                told_good += 1
        elif op < 0.85:
            pool = writing or offered or reading
            if pool:
                rid = rng.choice(list(pool))
                pool.pop(rid)
                a.release(rid)
        else:
            clock.now += rng.uniform(0, 2)
        pieces = sorted([(r.lease.offset, r.size) for r in a._ranges.values()] + a._free)
        assert sum(size for _, size in pieces) == a.size
        for (o1, s1), (o2, _) in zip(pieces, pieces[1:]):
            assert o1 + s1 <= o2
    assert told_good > 1000  # the checks above ran, not only the refusals


def test_the_arena_is_shared_between_mappings_and_gone_with_its_owner():
    owner = ArenaFile.create(4 * PAGE)
    assert owner.path.startswith(f"/proc/{os.getpid()}/fd/") and owner.size == 4 * PAGE
    a, _ = arena(pages=4)
    lease = a.reserve("r1", 100, lease_s=10)
    owner.view(lease)[:5] = b"hello"
    other = ArenaFile.open(owner.path)
    assert bytes(other.view(lease)[:5]) == b"hello" and len(other.view(lease)) == 100
    other.view(lease)[5:7] = b"!!"  # both ways
    assert bytes(owner.view(lease)[:7]) == b"hello!!"
    other.close()
    owner.close()
    assert not os.path.exists(owner.path)  # closed by its owner: nothing left to open
