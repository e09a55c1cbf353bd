"""KV export and import: a request's computed KV as one compact, contiguous payload.

    payload.kv: [layers, 2 (K|V), num_blocks, kv_heads, block_size, head_dim]

The payload holds the blocks covering `token_ids` (the last one may be partial); the importing
engine verifies the tokens, hashes the blocks itself, skips those it already caches and registers
the rest in its own prefix cache. Importing and continuing gives the same tokens
as never having moved.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["KVPayload", "KVLayout"]


@dataclass(frozen=True)
class KVLayout:
    """What must match between exporter and importer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # torch dtype name, e.g. "bfloat16"


@dataclass
class KVPayload:
    request_id: str
    token_ids: list[int]  # tokens whose KV is in `kv`
    layout: KVLayout
    kv: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[2]

    @property
    def num_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def __reduce__(self):
        # Ship the tensor as a raw numpy buffer: Ray's object store then maps it zero-copy.
        raw = self.kv.contiguous().view(torch.uint8).numpy()
        return (
            _rebuild,
            (self.request_id, self.token_ids, self.layout, raw, tuple(self.kv.shape)),
        )


def _rebuild(request_id, token_ids, layout, raw: np.ndarray, shape) -> KVPayload:
    dtype = getattr(torch, layout.dtype)
    if not raw.size:
        kv = torch.empty(shape, dtype=dtype)
    else:
        with warnings.catch_warnings():
            # Out of Ray's object store the buffer is a read-only shared-memory mapping. Viewing
            # it without a copy is the point; the importer only reads it (into its own blocks).
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            kv = torch.from_numpy(raw).view(dtype).view(shape)
    return KVPayload(request_id, list(token_ids), layout, kv)
