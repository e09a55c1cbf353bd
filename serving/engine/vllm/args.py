"""vLLM's AsyncEngineArgs from an EngineConfig (VLLMEngine's module docstring has the table):
blocks rounded up to vLLM's CPU attention's multiple of 32, the KV budget as kvrelay's engine
reads it on a CPU, the context window capped at what that budget holds, kvrelay's KV connector
for a pool that hands KV over."""

from __future__ import annotations

import logging

from serving.engine.config import EngineConfig, VLLMOptions
from serving.engine.errors import ModelLoadError

__all__ = ["capped_max_model_len", "engine_args"]

logger = logging.getLogger(__name__)


def capped_max_model_len(config: EngineConfig, spec, kv_bytes: int | None) -> int | None:
    """The context window to ask vLLM for: as kvrelay's engine does, capped (with a warning) at
    what a KV budget of `kv_bytes` holds, in whole blocks of `config.block_size` less the null block
    vLLM keeps, where vLLM would refuse to start instead; None: vLLM's own (a GPU's budget is vLLM's to work out)."""
    if kv_bytes is None:
        return config.max_model_len
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * (4 if config.dtype == "float32" else 2)
    capacity = (kv_bytes // (per_token * config.block_size) - 1) * config.block_size  # vLLM keeps a null block
    if capacity <= 0:
        raise ModelLoadError(f"kv_cache_bytes {kv_bytes} holds no block of {config.block_size} tokens beside vLLM's null block "
                             f"({per_token} bytes each): give the engine more KV cache")
    window = min(config.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)
    if capacity < window:
        logger.warning("the KV cache holds %d tokens, less than the context window %d: capping it", capacity, window)
        return capacity
    return config.max_model_len


def engine_args(config: EngineConfig, model_dir, events_endpoint: str, kv_handoff: bool, spec=None):
    """vLLM's AsyncEngineArgs for `config` (the module docstring's table)."""
    import torch
    from vllm import AsyncEngineArgs
    from vllm.config import KVEventsConfig, KVTransferConfig

    from serving.engine.kv.cache import available_memory_bytes

    options = config.vllm or VLLMOptions()
    lora = {}
    if config.lora is not None:
        lora = dict(enable_lora=True, max_loras=options.max_loras, max_lora_rank=options.max_lora_rank)
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=events_endpoint)
    # vLLM's CPU attention takes blocks of a multiple of 32 tokens: the next one up. The block
    # size it runs is the one the engine reports (ModelInfo.block_size), so the ingress hashes
    # prompts in its blocks and the router's predictions stay exact.
    block_size = config.block_size if config.device != "cpu" else -(-config.block_size // 32) * 32
    # The KV budget as kvrelay's engine reads it on a CPU (kv_cache_bytes, else a share of the
    # memory available); on a GPU vLLM's gpu_memory_utilization decides
    kv_bytes = config.kv_cache_bytes
    if kv_bytes is None and config.device == "cpu":
        kv_bytes = int(available_memory_bytes(torch.device("cpu")) * config.kv_cache_memory_fraction)
    max_model_len = config.max_model_len if spec is None else capped_max_model_len(
        config.model_copy(update={"block_size": block_size}), spec, kv_bytes)
    transfer = None
    if kv_handoff:  # a pool that hands KV over: kvrelay's connector, a failed load recomputed
        if options.tensor_parallel_size > 1:
            raise ModelLoadError("vllm.tensor_parallel_size > 1 cannot hand KV off through kvrelay yet (each "
                                 "rank holds a slice of every block); run the P/D pools with 1, or mode: colocated")
        transfer = KVTransferConfig(kv_connector="KVRelayConnector", kv_connector_module_path="serving.engine.vllm.connector",
                                    kv_role="kv_both", kv_load_failure_policy="recompute")
    return AsyncEngineArgs(
        model=str(model_dir), tokenizer=str(model_dir), dtype="auto" if config.dtype == "auto" else config.dtype,
        block_size=block_size, max_model_len=max_model_len, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, enable_prefix_caching=config.enable_prefix_caching,
        seed=config.seed, enforce_eager=options.enforce_eager, tensor_parallel_size=options.tensor_parallel_size,
        gpu_memory_utilization=options.gpu_memory_utilization, quantization=options.quantization,
        kv_events_config=events if config.enable_prefix_caching else None,
        kv_cache_memory_bytes=kv_bytes, scheduling_policy="priority", kv_transfer_config=transfer,
        **lora,  # priority: the tiers', lower first
    )
