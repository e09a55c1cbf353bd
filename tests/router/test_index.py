"""The exact prefix index: engine events to a worker-side set, snapshots to the router's index."""

from __future__ import annotations

from router.index import CachedBlockSet, PrefixIndex, decode_hashes, encode_hashes, eviction_order
from serving.engine.kv.block_hash import hash_blocks
from serving.engine.kv.block_manager import BlockManager
from serving.engine.kv.events import BlockRemoved, BlockStored
from serving.engine.params import SamplingParams
from serving.engine.request import Sequence


def stored(*hashes):
    return BlockStored(tuple(hashes), 0, tuple(range(16 * len(hashes))), 16)


def test_cached_block_set_replays_events_and_versions():
    blocks = CachedBlockSet()
    blocks.apply([stored(1, 2, 3)])
    blocks.apply([BlockRemoved((2,)), stored(4)])
    assert blocks.hashes == {1, 3, 4} and blocks.version == 2
    blocks.apply([])
    assert blocks.version == 2  # nothing happened: same snapshot
    blocks.apply([BlockRemoved((1, 3, 4)), stored(9)])
    assert blocks.hashes == {9} and blocks.version == 3
    version, encoded = blocks.snapshot()
    assert version == 3 and decode_hashes(encoded) == [9]


def test_cached_block_set_lists_hashes_in_eviction_order():
    blocks = CachedBlockSet()
    blocks.apply([stored(1, 2, 3), stored(7, 8)])  # two prompts: [1 2 3] then [7 8]
    assert list(blocks.hashes) == [1, 2, 3, 7, 8]
    # The first prompt's request ends (hits on 1, 2; its block 3 and an unknown 5 as well):
    # its blocks become the most recent, freed tail first, so its head is the newest.
    blocks.touch([1, 2, 3, 5])
    assert list(blocks.hashes) == [7, 8, 3, 2, 1] and blocks.version == 2
    blocks.touch([1, 2, 3])  # already in that order: no new snapshot
    assert blocks.version == 2
    blocks.apply([stored(2)])  # stored again: the most recent
    assert decode_hashes(blocks.snapshot()[1]) == [7, 8, 3, 1, 2]


def test_cached_block_set_lists_the_prompts_taken_and_not_finished_last():
    blocks = CachedBlockSet()
    blocks.apply([stored(1, 2)])
    blocks.take("r1", [1, 2, 3, 4])  # hits 1, 2; computes 3, 4
    blocks.take("r2", [4, 5])
    # Each prompt taken as it will be once computed: the most recent, tail first, in the order
    # taken (r2 reuses r1's 4 after r1), cached blocks it hits included.
    assert blocks.version == 3 and decode_hashes(blocks.snapshot()[1]) == [3, 2, 1, 5, 4]
    blocks.apply([stored(3, 4)])  # r1 computed its blocks
    blocks.touch([1, 2, 3, 4], "r1")  # and ended: its blocks are the most recent, head last
    assert decode_hashes(blocks.snapshot()[1]) == [3, 2, 1, 5, 4]  # r2 still taken: the same order
    blocks.touch([4, 5], "r2")  # r2 ended without storing 5 (aborted): nothing left of it
    assert decode_hashes(blocks.snapshot()[1]) == [3, 2, 1, 4] and blocks.version == 6


def test_hashes_round_trip_as_uint64_bytes_in_order():
    hashes = [2**64 - 1, 0, 1234567890123456789, 1]
    assert len(encode_hashes(hashes)) == 8 * len(hashes)
    assert decode_hashes(encode_hashes(hashes)) == hashes


def test_index_matches_the_longest_cached_prefix_only():
    index = PrefixIndex()
    index.update("a", 1, {10, 11, 13})
    assert index.num_matched_blocks("a", [10, 11, 12, 13]) == 2  # block 13 is useless after a miss
    assert index.num_matched_blocks("a", [12, 10]) == 0
    assert index.num_matched_blocks("unknown", [10]) == 0


def test_late_and_duplicate_snapshots_are_ignored():
    index = PrefixIndex()
    assert index.update("a", 5, {1, 2})
    assert not index.update("a", 5, {7})  # duplicate
    assert not index.update("a", 4, {8})  # late
    assert index.num_matched_blocks("a", [1, 2]) == 2
    assert index.update("a", 1, {8}, epoch=2)  # a restarted engine counts again from 1
    assert index.num_matched_blocks("a", [1]) == 0 and index.num_matched_blocks("a", [8]) == 1


def test_dead_and_removed_replicas_are_dropped():
    index = PrefixIndex()
    index.update("a", 1, {1})
    index.update("b", 1, {1})
    index.update("c", 1, {1})
    index.remove("a")
    index.retain(["b"])
    assert index.replicas == ["b"]
    assert index.num_matched_blocks("c", [1]) == 0


def test_note_routed_is_replaced_by_the_next_snapshot():
    index = PrefixIndex()
    index.update("a", 1, set())
    index.note_routed("a", [5, 6])
    assert index.num_matched_blocks("a", [5, 6, 7]) == 2
    index.update("a", 2, {5})  # the engine had evicted block 6 meanwhile
    assert index.num_matched_blocks("a", [5, 6]) == 1


def test_note_routed_makes_the_prompt_recent_and_evicts_beyond_capacity():
    index = PrefixIndex()
    index.update("a", 1, [1, 2, 3, 4], num_blocks=6)  # 1 is the oldest
    assert index.capacity("a") == 6 and index.victims("a", 2) == []  # 2 empty blocks
    assert index.victims("a", 4) == [1, 2]
    assert index.victims("a", 4, keep={1}) == [2, 3]  # the request's own hit is taken, not evicted
    index.note_routed("a", [3, 9, 10, 11])  # 3 hits; 9..11 new: 7 blocks in 6, the oldest (1) goes
    assert index.num_blocks("a") == 6 and not index.holds("a", 1)
    assert index.victims("a", 6) == [2, 4, 11, 10, 9, 3]  # the prompt's head is the most recent
    assert index.update("a", 2, [4, 3], num_blocks=6)  # the snapshot replaces the guess
    assert index.victims("a", 6) == [4, 3] and index.victims("b", 6) == []  # unknown capacity: no victims


def test_a_snapshot_longer_than_the_capacity_keeps_its_most_recent_blocks():
    # The prompts a replica has taken come last in its snapshot; once computed they evict its
    # oldest blocks. Every router, the sender or not, keeps the same newest `capacity` hashes.
    index = PrefixIndex()
    index.update("a", 1, [1, 2, 3, 4, 5, 6], num_blocks=4)
    assert index.num_blocks("a") == 4 and [index.holds("a", h) for h in (1, 2, 3)] == [False, False, True]
    assert index.update("b", 1, [1, 2, 3]) and index.num_blocks("b") == 3  # capacity unknown: all kept


def test_eviction_order_puts_the_prompts_taken_last_tail_first():
    assert eviction_order([1, 2, 3], [[2, 9], [9, 8]]) == [1, 3, 2, 8, 9]
    assert eviction_order([1, 2], []) == [1, 2]


def test_index_counts_the_replicas_holding_each_block():
    index = PrefixIndex()
    index.update("a", 1, [1, 2])
    index.update("b", 1, [2, 3])
    assert [index.num_holders(h) for h in (1, 2, 3, 4)] == [1, 2, 1, 0]
    index.note_routed("a", [3])
    index.update("b", 2, [2])  # b dropped 3
    assert [index.num_holders(h) for h in (1, 2, 3)] == [1, 2, 1]
    index.remove("a")
    assert [index.num_holders(h) for h in (1, 2, 3)] == [0, 1, 0]


def test_block_manager_events_rebuild_its_exact_cache():
    """End to end with the engine's own block manager and hash: the set equals what is cached."""
    manager = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    blocks = CachedBlockSet()
    prompts = [list(range(100, 108)), list(range(200, 208)), list(range(300, 308))]
    for i, prompt in enumerate(prompts):
        seq = Sequence(request_id=f"r{i}", index=0, prompt_token_ids=prompt, params=SamplingParams(), max_tokens=1,
                       priority=0, arrival_mono_s=0.0)
        manager.allocate(seq, len(prompt))
        seq.num_computed_tokens = len(prompt)
        manager.commit(seq)
        manager.free(seq)
        blocks.apply(manager.take_events())
    # 4 blocks of capacity: the first prompt's two blocks were evicted for the third.
    assert blocks.hashes == set(hash_blocks(prompts[1], 4)) | set(hash_blocks(prompts[2], 4))


def test_what_an_engine_holds_of_a_prompt_as_it_arrives():
    """Leading blocks held, and held or shared with a prompt taken and not finished (hashes chain:
    a taken prompt shares a leading run, found by bisection), both capped."""
    blocks = CachedBlockSet()
    blocks.apply([stored(1, 2)])
    assert blocks.num_leading([1, 2, 3, 4, 5], 5) == (2, 2)
    blocks.take("r1", [1, 2, 3, 4, 9])  # computing 3, 4, 9
    blocks.take("r2", [1, 7])
    assert blocks.num_leading([1, 2, 3, 4, 5], 5) == (2, 4)
    assert blocks.num_leading([1, 2, 3, 4, 5], 3) == (2, 3)  # capped
    assert blocks.num_leading([1, 2, 3, 4, 9, 10], 6) == (2, 5)
    assert blocks.num_leading([6, 2, 3], 3) == (0, 0)
    assert blocks.num_leading([], 0) == (0, 0)
    blocks.touch([1, 2, 3, 4, 9], "r1")  # r1 ended without storing its blocks (aborted)
    assert blocks.num_leading([1, 2, 3, 4, 5], 5) == (2, 2)


def test_the_snapshot_follows_the_engine_when_a_request_is_not_kept_cached():
    """A worker's eviction order is the engine's free queue, hashed blocks only, also when the
    router's admission frees a request's computed blocks to the eviction end."""
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    blocks = CachedBlockSet()

    def run(request_id: str, prompt: list[int], keep: bool) -> None:
        seq = Sequence(request_id=request_id, index=0, prompt_token_ids=prompt, params=SamplingParams(), max_tokens=1,
                       priority=0, arrival_mono_s=0.0, keep_cached=keep)
        hashes = hash_blocks(prompt, 4)
        blocks.take(request_id, hashes)
        hits = manager.lookup_prefix(seq)
        manager.allocate(seq, len(prompt), hits)
        seq.num_cached_tokens = len(hits) * 4
        seq.num_computed_tokens = len(prompt)
        manager.commit(seq)
        blocks.apply(manager.take_events())
        manager.free(seq)
        blocks.touch(hashes, request_id, keep=keep)

    def engine_order() -> list[int]:
        return [manager.blocks[b].block_hash for b in manager._free if manager.blocks[b].block_hash is not None]

    run("a", list(range(100, 112)), keep=True)
    run("b", list(range(200, 208)), keep=True)
    run("c", list(range(100, 108)) + list(range(300, 308)), keep=False)  # hits a's first two blocks
    assert list(blocks.hashes) == engine_order()
    c = hash_blocks(list(range(100, 108)) + list(range(300, 308)), 4)
    assert list(blocks.hashes)[:2] == [c[3], c[2]]  # what c computed goes first, tail first
    assert list(blocks.hashes)[-2:] == [c[1], c[0]]  # what it found cached is the most recent
    run("d", list(range(400, 412)), keep=False)  # nothing cached: all of it first out
    assert list(blocks.hashes) == engine_order()
