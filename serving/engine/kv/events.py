"""KV cache events: what a router subscribes to in order to know which blocks an engine holds.

Events carry block hashes (see block_hash.py), never block ids: hashes mean the same thing on
every replica. A subscriber can rebuild the exact set of cached blocks from the stream:
BlockStored adds hashes, BlockRemoved drops them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BlockStored", "BlockRemoved", "KVEvent"]


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_hash: int  # the hash of the block before the first one here (ROOT_HASH at the start)
    token_ids: tuple[int, ...]  # the tokens of these blocks, block_size each
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]


KVEvent = BlockStored | BlockRemoved
