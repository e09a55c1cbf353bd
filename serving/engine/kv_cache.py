"""The paged KV cache: one tensor holding every layer's K and V blocks.

    data[layer, 0 = K | 1 = V, block, kv_head, offset, head_dim]

One tensor (rather than one per layer) lets a request's blocks for all layers be exported as
one contiguous payload with a single gather, and imported with a single scatter. Within a block
each KV head's rows are contiguous, which is what the decode kernel streams through.
"""

from __future__ import annotations

import logging
import os

import torch

__all__ = ["KVCache", "kv_bytes_per_token", "available_memory_bytes"]

logger = logging.getLogger(__name__)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class KVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.data = torch.zeros(
            num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype, device=device
        )
        # Per-layer (K, V), each [num_blocks, kv_heads, block_size, head_dim].
        self.layers = [(self.data[i, 0], self.data[i, 1]) for i in range(num_layers)]

    @property
    def num_bytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def read_blocks(self, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """[layers, 2, len(block_ids), kv_heads, block_size, head_dim], contiguous (a copy), in
        `out` when given: bytes (uint8) or the cache's dtype, exactly the payload's size, e.g.
        a range of a shared-memory arena."""
        layers, two, _, heads, size, dim = self.data.shape
        flat = self.data.view(layers * two, self.num_blocks, heads * size * dim)
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        shape = (layers, two, len(block_ids), heads, size, dim)
        # One gather over rows of whole blocks: several times faster than index_select on the
        # 6-D tensor (measured: 2.7 ms vs 6.6 ms for 22.5 MiB on one thread).
        if out is None:
            return flat.index_select(1, index).view(shape)
        target = out.view(self.data.dtype) if out.dtype != self.data.dtype else out
        expected = layers * two * len(block_ids) * heads * size * dim
        if target.numel() != expected or not target.is_contiguous():
            raise ValueError(f"out holds {target.numel()} {self.data.dtype} values, the blocks need {expected}, contiguous")
        torch.index_select(flat, 1, index, out=target.view(layers * two, len(block_ids), heads * size * dim))
        return target.view(shape)

    def write_blocks(self, block_ids: list[int], payload: torch.Tensor) -> None:
        layers, two, _, heads, size, dim = self.data.shape
        flat = self.data.view(layers * two, self.num_blocks, heads * size * dim)
        src = payload.to(device=self.data.device, dtype=self.data.dtype).reshape(
            layers * two, len(block_ids), heads * size * dim
        )
        runs = _runs(block_ids)
        if len(runs) <= 4:  # slice copies: 1.4 ms for 22.5 MiB, index_copy_ 5.7 ms
            for offset, (start, length) in zip(_offsets(runs), runs):
                flat[:, start : start + length].copy_(src[:, offset : offset + length])
        else:
            flat.index_copy_(1, torch.tensor(block_ids, device=self.data.device), src)


def _runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs of block ids as (first id, length)."""
    runs: list[tuple[int, int]] = []
    for block_id in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block_id, 1))
    return runs


def _offsets(runs: list[tuple[int, int]]) -> list[int]:
    offsets, total = [], 0
    for _, length in runs:
        offsets.append(total)
        total += length
    return offsets
