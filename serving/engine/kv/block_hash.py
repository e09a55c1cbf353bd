"""Chained block hashes for prefix caching, shared by the engine and the router.

    h(block i) = H( h(block i-1) | token ids of block i | extra keys )

Only full blocks are hashed. Extra keys (adapter id, cache salt) keep caches of different
adapters or tenants apart. H is BLAKE2b truncated to 64 bits: stable across processes
(unlike Python's `hash` of strings), so the ingress can hash a prompt once and the router can
compare it with the hashes engines report. A hit is still verified against the block's tokens.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from pathlib import Path

__all__ = ["ROOT_HASH", "hash_block", "hash_blocks"]

ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids: Sequence[int], extra_keys: tuple = ()) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(parent_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return int.from_bytes(h.digest(), "little")


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple = (),
    *,
    start_block: int = 0,
    parent_hash: int = ROOT_HASH,
) -> list[int]:
    """Hashes of the full blocks of `token_ids` from `start_block` on, chained from `parent_hash`."""
    hashes = []
    for i in range(start_block, len(token_ids) // block_size):
        parent_hash = hash_block(parent_hash, token_ids[i * block_size : (i + 1) * block_size], extra_keys)
        hashes.append(parent_hash)
    return hashes


def block_extra_keys(cache_salt: str | None = None, lora_name: str | None = None, lora_path: str | None = None) -> tuple:
    """The extra keys of a request's block hashes, the same at the engine and the ingress (whose
    router hashes prompts to find them): its cache salt, and its LoRA adapter by name and
    directory (so a reload finds its blocks again, and a name registered anew elsewhere does not)."""
    keys: tuple = (cache_salt,) if cache_salt else ()
    if lora_name is not None:
        keys += (("lora", lora_name, str(Path(lora_path or ""))),)
    return keys

