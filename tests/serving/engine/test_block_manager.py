"""Block manager: exact block ids, reference counts, LRU eviction order and KV events."""

from __future__ import annotations

from serving.engine.kv.block_hash import ROOT_HASH, hash_block, hash_blocks
from serving.engine.kv.block_manager import BlockManager
from serving.engine.kv.events import BlockRemoved, BlockStored
from serving.engine.params import SamplingParams
from serving.engine.request import Sequence


def make_seq(tokens, extra_keys=()) -> Sequence:
    return Sequence("r", 0, list(tokens), SamplingParams(), max_tokens=16, extra_keys=extra_keys)


def compute(bm: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """Pretend the model computed `num_tokens` more tokens of `seq`."""
    assert bm.allocate(seq, seq.num_computed_tokens + num_tokens)
    seq.num_computed_tokens += num_tokens
    bm.commit(seq)


def test_hashes_chain_over_full_blocks_only_and_include_extra_keys():
    tokens = list(range(10))
    hashes = hash_blocks(tokens, 4)
    assert len(hashes) == 2  # the partial third block is not hashed
    assert hashes[0] == hash_block(ROOT_HASH, [0, 1, 2, 3])
    assert hashes[1] == hash_block(hashes[0], [4, 5, 6, 7])
    assert hash_blocks(tokens, 4, ("adapter-a",)) != hashes
    assert hash_blocks([9, 1, 2, 3, 4, 5, 6, 7], 4)[1] != hashes[1]  # parent changes the chain


def test_allocate_takes_lowest_free_blocks_and_free_returns_them():
    bm = BlockManager(8, 4)
    seq = make_seq(range(10))
    assert bm.allocate(seq, 10)
    assert seq.block_ids == [0, 1, 2]
    assert bm.num_free_blocks == 5
    assert not bm.allocate(make_seq(range(30)), 30)  # needs 8 > 5 free: nothing changes
    assert bm.num_free_blocks == 5
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_ids == []


def test_prefix_hit_shares_blocks_by_reference_and_is_counted():
    bm = BlockManager(8, 4)
    a = make_seq(range(10))
    compute(bm, a, 10)
    assert [e for e in bm.take_events()] == [
        BlockStored(tuple(a.block_hashes[:2]), ROOT_HASH, tuple(range(8)), 4)
    ]
    b = make_seq(list(range(8)) + [99, 98])
    hits = bm.lookup_prefix(b)
    assert hits == [0, 1]
    assert bm.allocate(b, 10, hits)
    assert b.block_ids == [0, 1, 3] and b.num_computed_tokens == 8
    assert [bm.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]


def test_full_hit_still_leaves_one_token_to_compute():
    bm = BlockManager(8, 4)
    a = make_seq(range(8))
    compute(bm, a, 8)
    assert bm.lookup_prefix(make_seq(range(8))) == [0]  # not [0, 1]: the last token must run


def test_free_cached_blocks_evicted_lru_and_reported():
    bm = BlockManager(4, 2)
    a = make_seq([1, 2, 3, 4])  # blocks 0, 1
    compute(bm, a, 4)
    b = make_seq([5, 6, 7, 8])  # blocks 2, 3
    compute(bm, b, 4)
    bm.take_events()
    bm.free(a)  # tail first: free queue 1, 0
    bm.free(b)  # then 3, 2
    c = make_seq([9, 9, 9, 9, 9, 9])
    assert bm.allocate(c, 6)
    assert c.block_ids == [1, 0, 3]  # least recently freed first
    assert bm.take_events() == [
        BlockRemoved((a.block_hashes[1],)),
        BlockRemoved((a.block_hashes[0],)),
        BlockRemoved((b.block_hashes[1],)),
    ]
    # b's first block survived and still hits
    assert bm.lookup_prefix(make_seq([5, 6, 7])) == [2]


def test_unhashed_free_blocks_are_reused_before_cached_ones():
    bm = BlockManager(4, 4)
    a = make_seq([1, 2, 3, 4, 5])  # block 0 full (cached), block 1 partial
    compute(bm, a, 5)
    bm.free(a)
    c = make_seq([7])
    assert bm.allocate(c, 1)
    assert c.block_ids == [1]  # the partial block, not the cached block 0


def test_hash_collision_is_caught_by_token_check():
    bm = BlockManager(4, 2)
    a = make_seq([1, 2, 3])
    compute(bm, a, 3)
    bm.blocks[a.block_ids[0]].token_ids = (7, 7)  # simulate a colliding hash with other tokens
    assert bm.lookup_prefix(make_seq([1, 2, 3])) == []


def test_extra_keys_separate_caches():
    bm = BlockManager(8, 2)
    a = make_seq([1, 2, 3], extra_keys=("salt-a",))
    compute(bm, a, 3)
    assert bm.lookup_prefix(make_seq([1, 2, 3], extra_keys=("salt-b",))) == []
    assert bm.lookup_prefix(make_seq([1, 2, 3], extra_keys=("salt-a",))) == [0]


def test_fork_shares_blocks_and_refcounts_return_to_zero():
    bm = BlockManager(8, 2)
    parent = make_seq([1, 2, 3, 4, 5])
    compute(bm, parent, 5)
    child = make_seq([1, 2, 3, 4, 5])
    bm.fork(parent, child, 2)
    assert child.block_ids == [0, 1] and child.num_computed_tokens == 4
    assert [bm.blocks[i].ref_count for i in range(3)] == [2, 2, 1]
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_a_sequence_not_kept_cached_frees_what_it_computed_to_the_eviction_end():
    bm = BlockManager(8, 4)
    old = make_seq(range(100, 108))  # 2 blocks cached first: the oldest
    compute(bm, old, 8)
    bm.free(old)
    shared = make_seq(range(8))
    compute(bm, shared, 8)
    bm.free(shared)  # blocks 2, 3: cached, more recent than 0, 1
    seq = make_seq(list(range(8)) + [50, 51, 52, 53, 54])  # hits 2, 3; computes a third block and a partial
    seq.keep_cached = False
    hits = bm.lookup_prefix(seq)
    assert hits == [2, 3]
    assert bm.allocate(seq, 13, hits)
    seq.num_cached_tokens = 8
    seq.num_computed_tokens = 13
    bm.commit(seq)
    assert seq.block_ids == [2, 3, 4, 5]
    bm.free(seq)
    # Reused first: the partial block (nothing in it), then the block it computed; then the
    # free blocks never used, then the cached ones as freed (each request's tail first). Its hits
    # went back to the recent end as ever.
    assert list(bm._free) == [5, 4, 6, 7, 1, 0, 3, 2]
    # Findable until taken: a prompt with the same third block hits it.
    again = make_seq(list(range(8)) + [50, 51, 52, 53, 60])
    assert bm.lookup_prefix(again) == [2, 3, 4]
