"""KV blocks for a model whose sliding-window layers are interleaved with full-attention ones
(Gemma 2/3, Qwen's layer_types): two BlockManager pools behind the one BlockManager interface the
scheduler sees (HybridBlockManager's docstring draws the two tables).
"""

from __future__ import annotations

import logging

from serving.engine.kv.block_manager import BlockManager
from serving.engine.kv.events import KVEvent
from serving.engine.request import Sequence

__all__ = ["HybridBlockManager", "PrefixHits", "SlidingTable"]

logger = logging.getLogger(__name__)


class SlidingTable:
    """A sequence's blocks in the sliding layers' pool: its own table and counts of committed and
    released blocks; its tokens, hashes and computed count are the sequence's."""

    def __init__(self, seq: Sequence):
        self.seq = seq
        self.block_ids: list[int] = []
        self.num_committed_blocks = 0
        self.num_released_blocks = 0

    def __getattr__(self, name: str):  # token_ids, extra_keys, keep_cached, num_cached_tokens, ...
        return getattr(self.seq, name)

    @property
    def num_computed_tokens(self) -> int:
        return self.seq.num_computed_tokens

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        self.seq.num_computed_tokens = value

    @property
    def block_hashes(self) -> list[int]:
        return self.seq.block_hashes

    @block_hashes.setter
    def block_hashes(self, value: list[int]) -> None:
        self.seq.block_hashes = value


class PrefixHits(list):
    """lookup_prefix's answer for two pools: the full layers' cached block ids (the list), and the
    sliding layers': `skip` leading blocks outside the window, then `sliding_ids`."""

    def __init__(self, full_ids: list[int], skip: int, sliding_ids: list[int]):
        super().__init__(full_ids)
        self.skip = skip
        self.sliding_ids = sliding_ids


def _full_pools(name: str) -> property:
    """HybridBlockManager's `name`: the full pool's."""
    return property(lambda self: getattr(self.full, name), doc=f"The full pool's {name}.")


class HybridBlockManager:
    """Blocks for a model whose sliding-window layers are interleaved with full-attention ones
    (Gemma 2/3, Qwen's layer_types): two pools (cache.py), each a BlockManager with its own
    ids, free queue and prefix cache, and a table per pool for each sequence.

        full layers     [b3 b8 b1 b6 b2 b9]        every block, to the end
        sliding layers  [ -  -  - b4 b7 b5]        the window's: blocks it passed are given back

    A prefix hit of n blocks needs the full pool's first n and the sliding pool's blocks that the
    n * block_size-th position's window reaches; the rest of the sliding table is NULL_BLOCK. A
    sequence held for export (hold_kv) gives back what its window passed too: its payload's
    sliding blocks before the window are not read (kv_tables: None), and the importer allocates
    and writes only the window's (allocate_import). The router's index follows the full pool (its
    events); a hit the sliding pool cannot complete is shorter than the index predicts, which the
    predicted-vs-seen metric shows.
    """

    releases_held = True

    def __init__(self, full: BlockManager, sliding: BlockManager, window: int):
        assert full.block_size == sliding.block_size and window > 0
        self.full, self.sliding, self.window = full, sliding, window
        self.block_size = full.block_size
        self.enable_prefix_caching = full.enable_prefix_caching

    @staticmethod
    def table(seq: Sequence) -> SlidingTable:
        if seq.sliding_table is None:
            seq.sliding_table = SlidingTable(seq)
        return seq.sliding_table

    # ---- state (the full pool's, which holds every token; usage the fuller pool's) ------------
    num_blocks = _full_pools("num_blocks")
    num_free_blocks = _full_pools("num_free_blocks")
    num_prefix_query_tokens = _full_pools("num_prefix_query_tokens")
    num_prefix_hit_tokens = _full_pools("num_prefix_hit_tokens")

    @property
    def usage(self) -> float:
        return max(self.full.usage, self.sliding.usage)

    def take_events(self) -> list[KVEvent]:
        self.sliding.take_events()
        return self.full.take_events()

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.full.record_prefix_query(num_tokens, num_hit_tokens)

    def update_hashes(self, seq: Sequence) -> None:
        self.full.update_hashes(seq)

    # ---- both pools ---------------------------------------------------------------------------
    def lookup_prefix(self, seq: Sequence) -> list[int]:
        hits = self.full.lookup_prefix(seq)
        present = [self.sliding.cached_block(seq, i) is not None for i in range(len(hits))]
        for n in range(len(hits), 0, -1):
            skip = self._window_start(n * self.block_size)
            if all(present[skip:n]):
                return PrefixHits(hits[:n], skip, [self.sliding.cached_block(seq, i) for i in range(skip, n)])
        return []

    def _window_start(self, position: int) -> int:
        """The first block the window of `position` reaches (it sees back to position - window + 1)."""
        return max(0, position - self.window + 1) // self.block_size

    def allocate(self, seq: Sequence, num_tokens: int, cached_block_ids: list[int] = ()) -> bool:
        skip, sliding_ids = (cached_block_ids.skip, cached_block_ids.sliding_ids) if cached_block_ids else (0, [])
        return self._allocate_both(seq, num_tokens, list(cached_block_ids), sliding_ids, skip)

    def allocate_import(self, seq: Sequence, num_tokens: int, num_imported: int) -> bool:
        """The full pool's blocks for every token, the sliding pool's from the window of the first
        position computed here (num_imported) on."""
        return self._allocate_both(seq, num_tokens, [], [], self._window_start(num_imported))

    def _allocate_both(self, seq: Sequence, num_tokens: int, full_ids: list[int], sliding_ids: list[int],
                       skip: int) -> bool:
        """Both pools' blocks for `num_tokens`, or neither (False) when either pool is short."""
        table = self.table(seq)
        if (self.full.blocks_needed(seq, num_tokens, full_ids) > self.full.num_free_blocks
                or self.sliding.blocks_needed(table, num_tokens, sliding_ids, skip) > self.sliding.num_free_blocks):
            return False
        self.full.allocate(seq, num_tokens, full_ids)
        self.sliding.allocate(table, num_tokens, sliding_ids, skip)
        return True

    def commit(self, seq: Sequence) -> None:
        self.full.commit(seq)
        self.sliding.commit(self.table(seq))

    def trim(self, seq: Sequence) -> int:
        self.sliding.trim(self.table(seq))
        return self.full.trim(seq)

    def release_before(self, seq: Sequence, position: int) -> int:
        """The sliding pool's blocks before `position` (the full pool keeps every block)."""
        return self.sliding.release_before(self.table(seq), position)

    def fork(self, parent: Sequence, child: Sequence, num_blocks: int) -> None:
        self.full.fork(parent, child, num_blocks)
        self.sliding.fork(self.table(parent), self.table(child), num_blocks)

    def free(self, seq: Sequence) -> None:
        self.full.free(seq)
        self.sliding.free(self.table(seq))

    def kv_tables(self, seq: Sequence, num_blocks: int) -> tuple[list[int], list[int | None]]:
        """The sliding pool's entries its window passed are None: not read, not written."""
        table = self.table(seq)
        released = table.num_released_blocks
        return seq.block_ids[:num_blocks], [None if i < released else b for i, b in enumerate(table.block_ids[:num_blocks])]
