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


def test_a_reader_whose_lease_ran_out_is_told_so_after_the_quarantine():
    a, clock = arena(pages=1, quarantine_s=5)
    lease = a.reserve("r1", PAGE, lease_s=10)
    a.offer(lease, lease_s=10)
    read = a.claim("r1", lease_s=10)
    clock.now = 30
    assert a.reserve("r2", PAGE, lease_s=10) is None  # quarantined while the reader may copy
    clock.now = 36
    new = a.reserve("r2", PAGE, lease_s=10)
    assert new is not None and new.offset == read.offset
    assert not a.done(read)  # the range is another request's now (the reader's copy began before its deadline)


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
    # Released holders may still start a copy until their leases' deadline (10): the quarantine
    # runs from then, not from the release.
    clock.now = 14.9
    assert a.reserve("x", PAGE, lease_s=10) is None
    clock.now = 15
    assert a.reserve("x", 2 * PAGE, lease_s=10) is not None  # both freed and merged
    assert not a.release("nobody")


def test_a_writer_that_has_written_gives_its_range_back_at_once():
    a, _ = arena(pages=1, quarantine_s=5)
    first = a.reserve("w1", PAGE, lease_s=10)
    assert a.release_lease(first, written=True) and a.free_bytes == PAGE
    second = a.reserve("w2", PAGE, lease_s=10)
    assert not a.release_lease(first, written=True)  # not its range any more
    assert a.release_lease(second) and a.num_quarantined == 1  # may still be writing


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="multiple of 4096"):
        ArenaAllocator(1000, align=PAGE)
    a, _ = arena()
    with pytest.raises(ValueError, match="num_bytes must be > 0"):
        a.reserve("r", 0, lease_s=10)
    a.reserve("r", 1, lease_s=10)
    with pytest.raises(ValueError, match="already holds a range"):
        a.reserve("r", 1, lease_s=10)


def test_random_traffic_never_hands_out_a_range_a_holder_may_still_copy():
    """Thousands of random reserves, offers, claims, dones, releases and clock jumps. Every
    holder (writer or reader) may start a copy at any time before its lease's deadline, whether
    or not it was released or expired meanwhile, and a copy ends within the quarantine: no range
    is granted over bytes whose earlier holder's window (its deadline + the quarantine) is still
    open, unless that holder reported (offer or done: its copy is over). Held and free ranges
    never overlap and always add up to the arena."""
    rng = random.Random(7)
    a, clock = arena(pages=64, quarantine_s=3)
    writing, offered, reading = {}, {}, {}
    windows: dict[tuple[int, int], tuple[int, int, float]] = {}  # (lease id, generation) -> (start, end, until)

    def open_window(lease) -> None:
        windows[(lease.lease_id, lease.generation)] = (lease.offset, lease.offset + lease.num_bytes,
                                                       a.deadline_of(lease) + a.quarantine_s)

    def close_window(lease) -> None:
        windows.pop((lease.lease_id, lease.generation), None)

    granted = 0
    for step in range(20000):
        op = rng.random()
        if op < 0.3:
            rid = f"r{step}"
            lease = a.reserve(rid, rng.randint(1, 6 * PAGE), lease_s=rng.uniform(1, 5))
            if lease is not None:
                start, end = lease.offset, lease.offset + lease.num_bytes
                assert not any(s < end and start < e and clock.now < until for s, e, until in windows.values())
                granted += 1
                writing[rid] = lease
                open_window(lease)
        elif op < 0.5 and writing:
            rid = rng.choice(list(writing))
            lease = writing.pop(rid)
            close_window(lease)  # it reports: its copy is over
            if a.offer(lease, lease_s=rng.uniform(1, 5)):
                offered[rid] = lease
        elif op < 0.65 and offered:
            rid = rng.choice(list(offered))
            offered.pop(rid)
            read = a.claim(rid, lease_s=rng.uniform(1, 5))
            if read is not None:
                reading[rid] = read
                open_window(read)
        elif op < 0.8 and reading:
            rid = rng.choice(list(reading))
            read = reading.pop(rid)
            close_window(read)
            a.done(read)
        elif op < 0.85:
            pool = writing or offered or reading
            if pool:
                rid = rng.choice(list(pool))
                pool.pop(rid)  # released: its holder may still copy until its window closes
                a.release(rid)
        else:
            clock.now += rng.uniform(0, 2)
        pieces = sorted([(r.lease.offset, r.size) for r in a._ranges.values()] + a._free)
        assert sum(size for _, size in pieces) == a.size
        for (o1, s1), (o2, _) in zip(pieces, pieces[1:]):
            assert o1 + s1 <= o2
    assert granted > 3000  # the check above ran, not only refusals


def test_the_arena_is_shared_between_mappings_and_gone_with_its_owner():
    owner = ArenaFile.create(4 * PAGE)
    assert owner.path.startswith(f"/proc/{os.getpid()}/fd/") and owner.capacity == 3 * PAGE  # a header page
    a, _ = arena(pages=3)
    lease = a.reserve("r1", 100, lease_s=10)
    owner.view(lease)[:5] = b"hello"
    with pytest.raises(OSError, match="not the KV arena"):  # a path reused by another arena
        ArenaFile.open(owner.path, os.urandom(16))
    other = ArenaFile.open(owner.path, owner.arena_id)
    assert bytes(other.view(lease)[:5]) == b"hello" and len(other.view(lease)) == 100
    other.view(lease)[5:7] = b"!!"  # both ways
    assert bytes(owner.view(lease)[:7]) == b"hello!!"
    other.close()
    owner.close()
    assert not os.path.exists(owner.path)  # closed by its owner: nothing left to open
