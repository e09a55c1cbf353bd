"""KV export and import: a request's computed KV as one compact, contiguous payload.

    payload.kv: [layers, 2 (K|V), num_blocks, kv_heads, block_size, head_dim]

The payload holds the blocks covering `token_ids` (the last one may be partial); the importing
engine verifies the tokens, hashes the blocks itself, skips those it already caches and registers
the rest in its own prefix cache. Importing and continuing gives the same tokens
as never having moved.

An engine whose KV lives in another process (vLLM's EngineCore: serving/engine/vllm/connector.py)
reads and writes a payload where it lies in shared memory: a ShmRange names that file range, and a
payload over one carries it (`shm`), so the bytes are copied once, by the process that owns the
KV cache. The layout's `format` says whose block layout the bytes are in: "kvrelay" (the shape
above) or "vllm" ([layers, num_blocks, *vLLM's per-layer block]); neither engine imports the other's.
"""

from __future__ import annotations

import mmap
import os
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["KVPayload", "KVLayout", "ShmRange"]


@dataclass(frozen=True)
class KVLayout:
    """What must match between exporter and importer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # torch dtype name, e.g. "bfloat16"
    # layers in a sliding pool of their own (cache.py): their blocks follow the others'
    sliding_layers: tuple[int, ...] = ()
    format: str = "kvrelay"  # whose block layout the bytes are in (module docstring)


@dataclass(frozen=True)
class ShmRange:
    """`num_bytes` bytes at `offset` of a shared-memory file another process of the node can open
    (an arena's /proc/<pid>/fd/<fd>, a staging memfd). `header` is what the file's first bytes
    must be (an arena's random id): a path that now names another file is refused."""

    path: str
    offset: int
    num_bytes: int
    header: bytes = b""

    def tensor(self) -> torch.Tensor:
        """The range as a writable uint8 tensor over a shared mapping (OSError when the file is
        gone, not the one named, or too short)."""
        fd = os.open(self.path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if self.offset + self.num_bytes > size:
                raise OSError(f"{self.path} has {size} bytes: no range of {self.num_bytes} at {self.offset}")
            start = self.offset - self.offset % mmap.ALLOCATIONGRANULARITY  # mmap maps from a page
            mapping = mmap.mmap(fd, self.offset + self.num_bytes - start, mmap.MAP_SHARED,
                                mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
            if self.header and os.pread(fd, len(self.header), 0) != self.header:
                mapping.close()
                raise OSError(f"{self.path} is not the file it was named as (its owner was restarted)")
        finally:
            os.close(fd)
        if not self.num_bytes:
            return torch.empty(0, dtype=torch.uint8)
        # the tensor keeps the mapping alive; it is unmapped with its last view
        return torch.frombuffer(mapping, dtype=torch.uint8, offset=self.offset - start, count=self.num_bytes)


@dataclass
class KVPayload:
    request_id: str
    token_ids: list[int]  # tokens whose KV is in `kv`
    layout: KVLayout
    kv: torch.Tensor
    # A view of a shared-memory arena range (serving/deployments/kv_arena.py) may be read only
    # before this time (time.monotonic(), the node's clock): later the range may be another
    # request's, and the importing engine computes the prompt instead. None: always readable.
    readable_until: float | None = None
    # Where `kv`'s bytes lie in shared memory, when they do (module docstring). None: only here.
    shm: ShmRange | None = None

    @property
    def is_readable(self) -> bool:
        return self.readable_until is None or time.monotonic() < self.readable_until

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[2]

    @property
    def num_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @staticmethod
    def from_raw(request_id: str, token_ids, layout: KVLayout, raw: np.ndarray, shape) -> KVPayload:
        """A payload over raw bytes (a uint8 array, e.g. out of Ray's object store), no copy."""
        return _rebuild(request_id, token_ids, layout, raw, shape)

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
