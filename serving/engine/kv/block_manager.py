"""KV block allocation with reference counts and prefix caching.

    free queue (LRU ─▶ MRU):  [b7 b2 b9 | b4(h=..) b1(h=..)]
                               └ unhashed   └ hashed: still findable by hash until reused

A block is in use while its ref count is > 0. Freed blocks join the free queue; a hashed one
stays in the prefix cache (findable by hash) until it is taken for new data, which evicts the
least recently freed first. Blocks holding nothing reusable go to the front so they are reused
before any cached block. A request's blocks are freed tail first, so a shared prefix outlives
the suffixes hanging off it. A request the router does not want cached (`keep_cached` False:
what its blocks would push out is worth more, router/prefix_cost.py) frees the blocks it
computed just behind those, so they are reused next and the cache keeps what it held.

The block table of a sequence only grows (append-only) while it runs, but for one exception: a
speculative step allocates blocks for proposed tokens, and `trim` gives back the tail blocks that
held only rejected ones (never computed into anything kept, so never hashed). Counters: prefix-cache
queries and hits, in tokens. Events (BlockStored / BlockRemoved) say which hashes this engine
holds, for a router's exact index.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from serving.engine.kv.block_hash import ROOT_HASH, hash_blocks
from serving.engine.kv.events import BlockRemoved, BlockStored, KVEvent
from serving.engine.request import Sequence

__all__ = ["NULL_BLOCK", "Block", "BlockManager"]

# A table entry a sequence never reads (before its sliding window); any valid id does.
NULL_BLOCK = 0

logger = logging.getLogger(__name__)


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, hashed={self.block_hash is not None})"


class BlockManager:
    # Whether a sequence held for export gives back blocks its window passed (the scheduler asks):
    # not in one pool, where a payload holds every layer's blocks.
    releases_held = False

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0, (num_blocks, block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._events: list[KVEvent] = []
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0

    # ---- state -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be taken now (free, including evictable cached ones)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    # ---- prefix cache -------------------------------------------------------------------------
    def update_hashes(self, seq: Sequence) -> None:
        """Extend `seq.block_hashes` over its full blocks of known tokens."""
        if not self.enable_prefix_caching:
            return
        start = len(seq.block_hashes)
        if (start + 1) * self.block_size > seq.num_tokens:
            return
        parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH
        seq.block_hashes += hash_blocks(
            seq.token_ids, self.block_size, seq.extra_keys, start_block=start, parent_hash=parent
        )

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Ids of cached blocks holding `seq`'s leading tokens (verified), without taking them.

        At least one token is always left to compute, so the step produces logits. A sequence
        that still needs prompt logprobs finds nothing: a cached block holds KV, not the logits
        its prompt logprobs come from (as vLLM does; its blocks are still cached for others).
        """
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return []
        self.update_hashes(seq)
        hits: list[int] = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            block_id = self.cached_block(seq, i)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def cached_block(self, seq: Sequence, index: int) -> int | None:
        """The cached block holding `seq`'s block `index` (hashes updated), verified; None: none."""
        block_id = self._cached.get(seq.block_hashes[index])
        if block_id is None:
            return None
        tokens = tuple(seq.token_ids[index * self.block_size : (index + 1) * self.block_size])
        return block_id if self.blocks[block_id].token_ids == tokens else None  # a collision is a miss

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted lookup (failed admissions retry and are not counted twice)."""
        self.num_prefix_query_tokens += num_tokens
        self.num_prefix_hit_tokens += num_hit_tokens

    # ---- allocation ---------------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_tokens: int, cached_block_ids: list[int] = (), skip: int = 0) -> int:
        """Free blocks `allocate` would take (new ones and free cached ones)."""
        num_new = self._num_new_blocks(seq, num_tokens, cached_block_ids, skip)
        return num_new + sum(1 for b in cached_block_ids if self.blocks[b].ref_count == 0)

    def allocate(self, seq: Sequence, num_tokens: int, cached_block_ids: list[int] = (), skip: int = 0) -> bool:
        """Give `seq` blocks for `num_tokens` tokens in total, first taking `cached_block_ids`
        (from lookup_prefix, only when seq has no blocks yet), after `skip` leading blocks it will
        never read (a sliding window's: NULL_BLOCK entries, released). False, with nothing
        changed, when too few blocks are free.
        """
        if cached_block_ids or skip:
            assert not seq.block_ids, f"{seq}: cached blocks only for a sequence with none"
        if self.blocks_needed(seq, num_tokens, cached_block_ids, skip) > len(self._free):
            return False
        num_new = self._num_new_blocks(seq, num_tokens, cached_block_ids, skip)
        seq.block_ids += [NULL_BLOCK] * skip
        seq.num_released_blocks = max(seq.num_released_blocks, skip)
        for block_id in cached_block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            seq.block_ids.append(block_id)
        if cached_block_ids or skip:
            seq.num_committed_blocks = skip + len(cached_block_ids)
            seq.num_computed_tokens = (skip + len(cached_block_ids)) * self.block_size
        for _ in range(num_new):
            seq.block_ids.append(self._take_free_block())
        return True

    def _num_new_blocks(self, seq: Sequence, num_tokens: int, cached_block_ids: list[int], skip: int) -> int:
        """Blocks past those `seq` holds, the skipped and the cached ones that `num_tokens` need."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_ids) - skip - len(cached_block_ids))

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
                self._events.append(BlockRemoved((block.block_hash,)))
            block.block_hash = None
            block.token_ids = None
        block.ref_count = 1
        return block_id

    def commit(self, seq: Sequence) -> None:
        """Register `seq`'s newly computed full blocks in the prefix cache (by hash)."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        start = seq.num_committed_blocks
        if num_full <= start:
            return
        self.update_hashes(seq)
        run: list[int] = []  # indices of a contiguous run of newly stored blocks
        for i in range(start, num_full):
            block = self.blocks[seq.block_ids[i]]
            block_hash = seq.block_hashes[i]
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                block.token_ids = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
                self._cached[block_hash] = block.block_id
                run.append(i)
            elif run:
                self._emit_stored(seq, run)
                run = []
        if run:
            self._emit_stored(seq, run)
        seq.num_committed_blocks = num_full

    def _emit_stored(self, seq: Sequence, run: list[int]) -> None:
        first, last = run[0], run[-1]
        self._events.append(
            BlockStored(
                block_hashes=tuple(seq.block_hashes[first : last + 1]),
                parent_hash=seq.block_hashes[first - 1] if first else ROOT_HASH,
                token_ids=tuple(seq.token_ids[first * self.block_size : (last + 1) * self.block_size]),
                block_size=self.block_size,
            )
        )

    def trim(self, seq: Sequence) -> int:
        """Give back `seq`'s blocks past those its computed tokens fill (what rejected proposed
        tokens were written to); they are reused first. The number given back."""
        keep = -(-seq.num_computed_tokens // self.block_size)
        tail = seq.block_ids[keep:]
        for block_id in reversed(tail):
            block = self.blocks[block_id]
            assert block.ref_count == 1 and block.block_hash is None, f"{seq}: trimming a shared or cached {block}"
            block.ref_count = 0
            self._free[block_id] = None
            self._free.move_to_end(block_id, last=False)
        del seq.block_ids[keep:]
        return len(tail)

    def release_before(self, seq: Sequence, position: int) -> int:
        """A sliding window: give back `seq`'s leading blocks that hold only positions before
        `position` (no query of it will read them again). Their table entries stay, so a block's
        index is still its positions; attention never reads them (attention.py). A hashed block
        stays cached, as any freed one. The number given back."""
        keep_from = min(position // self.block_size, seq.num_committed_blocks if self.enable_prefix_caching
                        else len(seq.block_ids))
        released = 0
        for i in range(seq.num_released_blocks, keep_from):
            block = self.blocks[seq.block_ids[i]]
            if self._unref(block) and block.block_hash is None:
                self._free.move_to_end(block.block_id, last=False)
            released += 1
        seq.num_released_blocks = max(seq.num_released_blocks, keep_from)
        return released

    def fork(self, parent: Sequence, child: Sequence, num_blocks: int) -> None:
        """Share `parent`'s first `num_blocks` (fully computed) blocks with `child`. A parent with
        forks pending gives no block back before (Sequence.forks_pending)."""
        assert not child.block_ids and num_blocks <= parent.num_computed_tokens // self.block_size
        assert parent.num_released_blocks == 0, f"{parent}: forking after its window released blocks"
        for block_id in parent.block_ids[:num_blocks]:
            self.blocks[block_id].ref_count += 1
            child.block_ids.append(block_id)
        child.num_computed_tokens = num_blocks * self.block_size
        child.num_committed_blocks = min(parent.num_committed_blocks, num_blocks)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references, tail first; blocks at zero become free (hashed ones stay cached).
        With `seq.keep_cached` False, the hashed blocks it computed itself go to the eviction end,
        tail first out (still findable until taken), behind only the blocks holding nothing."""
        num_hits = seq.num_cached_tokens // self.block_size
        empty: list[int] = []
        cold: list[int] = []  # tail first
        for i in range(len(seq.block_ids) - 1, seq.num_released_blocks - 1, -1):
            block_id = seq.block_ids[i]
            block = self.blocks[block_id]
            if self._unref(block):
                if block.block_hash is None:
                    empty.append(block_id)
                elif not seq.keep_cached and i >= num_hits:
                    cold.append(block_id)
        for block_id in [*reversed(cold), *empty]:  # the last moved is the first reused
            self._free.move_to_end(block_id, last=False)
        seq.block_ids = []
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0
        seq.num_released_blocks = 0

    def _unref(self, block: Block) -> bool:
        """Drop one reference to `block`; True when that freed it (it joins the free queue's MRU end)."""
        block.ref_count -= 1
        assert block.ref_count >= 0, f"double free of {block}"
        if block.ref_count == 0:
            self._free[block.block_id] = None
        return block.ref_count == 0

    def allocate_import(self, seq: Sequence, num_tokens: int, num_imported: int) -> bool:
        """Blocks for `num_tokens`, the first `num_imported` of them a KV payload's."""
        return self.allocate(seq, num_tokens)

    def kv_tables(self, seq: Sequence, num_blocks: int) -> tuple[list[int], list[int | None] | None]:
        """`seq`'s first `num_blocks` block ids in each pool of the KV cache (one pool: None)."""
        return seq.block_ids[:num_blocks], None
