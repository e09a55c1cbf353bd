"""Shared fixtures: tiny random Llama-family models built on the fly, and the default model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from serving.engine.model_loader import resolve_model_dir


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The built-in SmolLM2 converted to safetensors (converted once, then cached)."""
    return resolve_model_dir("smollm2-135m-instruct")


def build_tiny_model(
    out_dir: Path,
    tokenizer_dir: Path,
    *,
    architecture: str = "llama",
    num_heads: int = 4,
    num_kv_heads: int = 2,
    tie_word_embeddings: bool = False,
    rope_parameters: dict | None = None,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    init_std: float = 0.15,
) -> Path:
    """A seeded random model with the default model's tokenizer (so text round-trips).

    The init std is larger than usual so next-token distributions are peaked: greedy
    comparisons then test the math, not which of two near-equal logits rounding favours.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=49152,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=init_std,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(seed)
    if architecture == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    """A 2-layer GQA Llama with untied embeddings."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), default_model_dir)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    """The default model's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))
