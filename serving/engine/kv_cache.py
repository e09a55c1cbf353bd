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

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """[layers, 2, len(block_ids), kv_heads, block_size, head_dim], contiguous (a copy)."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        return self.data.index_select(2, index)

    def write_blocks(self, block_ids: list[int], payload: torch.Tensor) -> None:
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        self.data.index_copy_(2, index, payload.to(device=self.data.device, dtype=self.data.dtype))
