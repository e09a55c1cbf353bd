"""The context window a vLLM engine is asked for (serving/engine/vllm/args.py): capped at what
its KV budget holds, as kvrelay's engine caps it, where vLLM would refuse to start. Needs no vLLM."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from serving.engine import EngineConfig
from serving.engine.errors import ModelLoadError
from serving.engine.vllm.args import capped_max_model_len

# SmolLM2-135M's shape: 30 layers, 3 KV heads of 64, a window of 8192
SPEC = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64, max_position_embeddings=8192)
PER_TOKEN_BF16 = 2 * 30 * 3 * 64 * 2  # 23,040 bytes


def config(**kwargs) -> EngineConfig:
    return EngineConfig(**{"model": "m", "backend": "vllm", "block_size": 32, "dtype": "bfloat16", **kwargs})


def test_a_budget_below_the_window_caps_it_in_whole_blocks():
    kv_bytes = 100 * 32 * PER_TOKEN_BF16 + 5  # 100 blocks and a little, one of them vLLM's null block
    assert capped_max_model_len(config(), SPEC, kv_bytes) == 99 * 32
    assert capped_max_model_len(config(max_model_len=4096), SPEC, kv_bytes) == 99 * 32
    assert capped_max_model_len(config(dtype="float32"), SPEC, kv_bytes) == 49 * 32  # fp32: half the blocks


def test_a_budget_that_holds_the_window_leaves_it_as_asked():
    kv_bytes = 2**29
    assert capped_max_model_len(config(), SPEC, kv_bytes) is None  # vLLM's own: the model's 8192
    assert capped_max_model_len(config(max_model_len=1024), SPEC, kv_bytes) == 1024
    assert capped_max_model_len(config(max_model_len=1024), SPEC, None) == 1024  # a GPU: vLLM's to size


def test_a_budget_without_one_block_is_refused_naming_it():
    with pytest.raises(ModelLoadError, match="kv_cache_bytes 1000000 holds no block of 32 tokens beside"):
        capped_max_model_len(config(), SPEC, 1_000_000)  # one block of 737,280 bytes: the null block
