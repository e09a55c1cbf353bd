"""What an LLMEngine is built from: the model's spec, tokenizer and weights, the dtype that runs
(`auto` measured on this machine, dtype_choice.py), the kernel path (cpu_kernels.py), and the KV
cache sized from the budget, with the context window capped by what it holds."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from serving.engine.config import EngineConfig
from serving.engine.kv.cache import KVCache, available_memory_bytes, kv_bytes_per_token
from serving.engine.modeling.cpu_kernels import KernelPath, KernelStatus, kernel_status
from serving.engine.modeling.dtype_choice import DtypeChoice, choose_dtype
from serving.engine.modeling.loader import ModelSpec, load_model_spec, load_state_dict, load_tokenizer, resolve_model_dir
from serving.engine.modeling.model import LlamaModel

__all__ = ["EngineParts", "build_parts"]

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    config: EngineConfig  # with the dtype that runs (not "auto")
    device: torch.device
    spec: ModelSpec
    tokenizer: Any
    dtype_choice: DtypeChoice
    kernels: KernelStatus
    model: LlamaModel
    kv_cache: KVCache
    bytes_per_token: int  # of KV
    max_model_len: int  # the model's context window, capped by the KV cache's capacity


def build_parts(config: EngineConfig) -> EngineParts:
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = torch.device(config.device)

    model_dir = resolve_model_dir(config.model)
    spec = load_model_spec(model_dir)
    tokenizer = load_tokenizer(model_dir)
    # `auto` is measured here, on the threads set above; from now on the config names the
    # dtype that runs, which is also what the KV layout and the stats report.
    dtype_choice = choose_dtype(config.dtype, device, hidden_size=spec.hidden_size)
    config = config.model_copy(update={"dtype": dtype_choice.dtype})
    # Before the model: its weight layout follows the kernel path (model.py).
    kernels = (
        kernel_status() if device.type == "cpu"
        else KernelStatus(KernelPath.PYTORCH, f"the native kernels are CPU-only; the device is {device}")
    )
    t0 = time.monotonic()
    model = LlamaModel(
        spec, load_state_dict(model_dir), dtype=config.torch_dtype, device=device, deterministic=config.deterministic,
        speculative=config.speculative is not None,
    )
    logger.info(
        "loaded %s (%s, %d layers) in %.2fs; dtype: %s; kernels: %s%s; deterministic: %s", config.model,
        spec.architecture, spec.num_layers, time.monotonic() - t0, dtype_choice, kernels,
        f"; {model.linear_choice}" if kernels.path is KernelPath.NATIVE else "", model.invariance_reason,
    )
    kv_cache, bytes_per_token = _kv_cache(spec, config, device)
    max_model_len = _context_window(spec, config, kv_cache)
    return EngineParts(config, device, spec, tokenizer, dtype_choice, kernels, model, kv_cache, bytes_per_token, max_model_len)


def _kv_cache(spec: ModelSpec, config: EngineConfig, device: torch.device) -> tuple[KVCache, int]:
    """The KV cache the budget holds (kv_cache_bytes, else a share of the memory available), and its bytes per token."""
    dtype = config.torch_dtype
    bytes_per_token = kv_bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype)
    budget = config.kv_cache_bytes or int(available_memory_bytes(device) * config.kv_cache_memory_fraction)
    bs = config.block_size
    num_blocks = budget // (bytes_per_token * bs)
    sliding_layers, num_sliding_blocks = spec.sliding_layers, 0
    if sliding_layers and num_blocks >= 1:
        num_blocks, num_sliding_blocks = _split_pools(spec, config, budget, bytes_per_token, num_blocks)
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_bytes={budget} holds no block: one block of {bs} tokens "
            f"needs {bytes_per_token * bs} bytes"
        )
    kv_cache = KVCache(
        num_layers=spec.num_layers, num_blocks=num_blocks, block_size=bs,
        num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, dtype=dtype, device=device,
        sliding_layers=sliding_layers, num_sliding_blocks=num_sliding_blocks,
    )
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens, %d bytes/token, %.1f MiB",
        num_blocks, bs, num_blocks * bs, bytes_per_token, kv_cache.num_bytes / 2**20,
    )
    return kv_cache, bytes_per_token


def _context_window(spec: ModelSpec, config: EngineConfig, kv_cache: KVCache) -> int:
    """The model's context window, capped by what the KV cache (and a sliding pool) holds."""
    bs, chunk = config.block_size, config.max_num_batched_tokens
    capacity, num_sliding_blocks, sliding_layers = kv_cache.num_blocks * bs, kv_cache.num_sliding_blocks, spec.sliding_layers
    max_model_len = min(config.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)
    window = spec.every_layer_window or spec.hybrid_window
    # A windowed layer holds at most its window, one step's chunk and a block at each end of a
    # sequence (the rest go back as the window moves: BlockManager.release_before).
    held = min(window + chunk + 2 * bs, max_model_len) if window else max_model_len
    if spec.every_layer_window:
        logger.info("sliding window of %d tokens in every layer: a sequence holds at most %d tokens of KV "
                    "(window + one step's %d + 2 blocks)", window, held, chunk)
    elif sliding_layers:
        logger.info("sliding window of %d tokens in %d of %d layers, in a pool of their own: %d blocks (%d tokens, "
                    "%.1f MiB); a sequence holds at most %d tokens of it (window + one step's %d + 2 blocks), "
                    "the full layers' pool every token", window, len(sliding_layers), spec.num_layers,
                    num_sliding_blocks, num_sliding_blocks * bs,
                    kv_cache.sliding_data.numel() * kv_cache.sliding_data.element_size() / 2**20, held, chunk)
        if num_sliding_blocks * bs < held:
            logger.warning("the sliding pool holds %d tokens, less than one sequence's window and step: capping "
                           "the context window to it", num_sliding_blocks * bs)
            max_model_len = min(max_model_len, num_sliding_blocks * bs)
    if capacity < (held if spec.every_layer_window else max_model_len):
        logger.warning("KV cache holds %d tokens, less than the context window %d: capping it", capacity, max_model_len)
        max_model_len = min(max_model_len, capacity)
    return max_model_len


def _split_pools(spec: ModelSpec, config: EngineConfig, budget: int, bytes_per_token: int,
                 num_blocks: int) -> tuple[int, int]:
    """(full pool blocks, sliding pool blocks) for a model with interleaved sliding layers: the
    sliding pool holds every running sequence's window, a block at each end and one step's
    chunk (what is left over caches windows for prefix hits), never more blocks than one pool
    would have (then nothing is saved); the full pool gets the rest of the budget."""
    bs, window = config.block_size, spec.hybrid_window
    per_layer_token = bytes_per_token // spec.num_layers
    num_sliding, num_full = len(spec.sliding_layers), spec.num_layers - len(spec.sliding_layers)
    need = config.max_num_seqs * (-(-window // bs) + 2) + -(-config.max_num_batched_tokens // bs)
    num_sliding_blocks = min(need, num_blocks)
    rest = budget - num_sliding_blocks * bs * num_sliding * per_layer_token
    return rest // (bs * num_full * per_layer_token), num_sliding_blocks
