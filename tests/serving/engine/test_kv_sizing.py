"""KV cache sizing from a byte budget or a memory fraction, and the start-up capacity log."""

from __future__ import annotations

import logging

import pytest

import serving.engine.setup as engine_setup
from serving.engine import EngineConfig, LLMEngine


def test_capacity_from_bytes_is_logged(tiny_model_dir, caplog):
    # tiny model: 2 layers x 2 KV heads x 16 head_dim x 4 bytes (fp32) x 2 (K and V) = 512 B/token
    with caplog.at_level(logging.INFO, logger="serving.engine.setup"):
        engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_bytes=100_000))
    assert engine.bytes_per_token == 512
    assert engine.block_manager.num_blocks == 100_000 // (512 * 16) == 12
    assert "KV cache: 12 blocks x 16 tokens = 192 tokens, 512 bytes/token" in caplog.text
    assert engine.max_model_len == 192  # capped by what the cache holds


def test_capacity_from_memory_fraction(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(engine_setup, "available_memory_bytes", lambda device: 8 * 2**20)
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), dtype="bfloat16", kv_cache_memory_fraction=0.5)
    )
    assert engine.bytes_per_token == 256
    assert engine.block_manager.num_blocks == (4 * 2**20) // (256 * 16) == 1024


def test_budget_too_small_for_one_block_says_so(tiny_model_dir):
    with pytest.raises(ValueError, match="holds no block: one block of 16 tokens needs 8192 bytes"):
        LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_bytes=100))


def test_config_rejects_unknown_keys_and_bad_values():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="kv_cache_byte"):
        EngineConfig(kv_cache_byte=10)
    with pytest.raises(ValidationError, match="block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(ValidationError, match="dtype"):
        EngineConfig(dtype="int8")
