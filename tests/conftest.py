"""Shared fixtures: tiny random Llama-family models built on the fly, and the default model.

Also the suite's hygiene, so a test passes on a fresh machine whatever ran before it:

- `pytest_configure`: Ray's default temp root (`$RAY_TMPDIR/ray`) is a short directory of this
  session's own under the system temp dir, created here; token authentication is on for every
  Ray of the session (`RAY_AUTH_MODE=token`). Ray writes there even when a
  node gets `temp_dir=` (the address file of `ray.cluster_utils.Cluster`), and a fresh machine has
  none. Each fixture that starts Ray still passes its own `_temp_dir` as well, and a test that
  starts Ray in a subprocess gives it `RAY_TMPDIR` = `own_ray_tmpdir`.
- `_no_leaks` (module, autouse): after a module's fixtures are torn down, the environment, the
  working directory and Ray's connection are as they were before it; a leak fails the module's
  last test, naming what leaked.
- `require_tool(name)`: the path of a binary a test needs (helm, promtool, prometheus). Missing, the
  test skips, saying how to get it; under CI (`CI` set) it fails instead, since the Makefile
  installs them there.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
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


@pytest.fixture(scope="session")
def tiny_fallback_model_dir(tmp_path_factory, default_model_dir) -> Path:
    """Another tiny model (seed 7) with a chat template of its own and a shorter context (512):
    what graceful degradation falls back on, different enough that an answer shows who made it
    and whose template tokenized its prompt."""
    out = build_tiny_model(tmp_path_factory.mktemp("tiny-fallback"), default_model_dir, seed=7)
    (out / "chat_template.jinja").write_text(
        "{% for message in messages %}[{{ message['role'] }}] {{ message['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    tokenizer_config = out / "tokenizer_config.json"
    if tokenizer_config.exists():  # a template there would win over the file
        tokenizer_config.write_text(json.dumps({k: v for k, v in json.loads(tokenizer_config.read_text()).items() if k != "chat_template"}))
    config = out / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "max_position_embeddings": 512}))
    return out


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


# ---- hygiene ---------------------------------------------------------------------------------
_SESSION_ENV: dict[str, str | None] = {}  # the values pytest_configure replaced, put back at the end


def pytest_configure(config):
    """Before any test module is imported (one that touches Ray's C++ side fixes its auth mode for
    the process), the session's Ray settings:

    - its temp root (`$RAY_TMPDIR/ray`): a new, short directory directly under the system temp dir,
      not under an inherited RAY_TMPDIR (CI's is a path nothing created, /tmp/kvrelay-ci.XXXXXX/
      raytmp): Ray's socket paths live under it and AF_UNIX paths stop at 107 bytes;
    - token authentication on and usage stats off, what a local ray.init() would set for good, so
      every Ray of the session (local, simulated cluster, subprocess) runs the same way whatever
      order the modules run in: Ray's C++ side keeps the mode it first saw.
    """
    root = Path(tempfile.mkdtemp(prefix="kvt-"))
    (root / "ray").mkdir()
    config.kvrelay_ray_root = root
    for key, value in {"RAY_TMPDIR": str(root), "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}.items():
        _SESSION_ENV[key] = os.environ.get(key)
        os.environ[key] = value


def pytest_unconfigure(config):
    for key, value in _SESSION_ENV.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    root = getattr(config, "kvrelay_ray_root", None)
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def _ray_temp_root(pytestconfig) -> Path:
    return pytestconfig.kvrelay_ray_root / "ray"


@pytest.fixture
def own_ray_tmpdir(_ray_temp_root) -> Path:
    """A `RAY_TMPDIR` of this test's own (its `ray` root created), for a Ray it starts in a subprocess."""
    path = Path(tempfile.mkdtemp(prefix="t-", dir=_ray_temp_root.parent))
    (path / "ray").mkdir()
    return path


# Set by pytest and the libraries themselves and never put back (importing Ray sets
# RAY_CLIENT_MODE=0; ray.init points Python's breakpoint() at Ray's debugger; torch's extension
# builder sets its inductor cache dir): not ours to restore.
_ENV_SET_BY_LIBRARIES = {"PYTEST_CURRENT_TEST", "PYTHONBREAKPOINT", "RAY_CLIENT_MODE", "TORCHINDUCTOR_CACHE_DIR"}


def process_state() -> dict:
    """What a test or fixture must leave as it found it."""
    ray = sys.modules.get("ray")
    return {
        "environment": {k: v for k, v in os.environ.items() if k not in _ENV_SET_BY_LIBRARIES},
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


@pytest.fixture(scope="module", autouse=True)
def _no_leaks(_ray_temp_root):
    before = process_state()
    yield
    changes = state_changes(before, process_state())
    assert not changes, "this module's tests or fixtures left process state behind: " + "; ".join(changes)


def require_tool(name: str, how: str) -> str:
    """The path of the binary `name`; missing, skip (fail under CI) and say `how` to install it."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed: {how}"
        if os.environ.get("CI"):
            pytest.fail(f"{message} (CI must run this test: `make test` installs {name})", pytrace=False)
        pytest.skip(message)
    return path
