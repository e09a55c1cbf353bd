"""What a model's files say, read through transformers once and remembered under the cache dir
(serving/engine/modeling/loader.py, _remembered): the spec and the tokenizer a second process gets
are the ones transformers gives, and it gets them without importing a model's config class."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from serving.engine.modeling import loader as model_loader
from serving.engine.modeling.loader import load_model_spec, load_tokenizer
from serving.engine.modeling.rope import rope_tables
from tests.helpers import build_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[3]

VARIANTS = {
    "llama-rope-llama3": dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
    "gemma3": dict(architecture="gemma3", num_layers=3),
    "qwen3-window-layer-1": dict(architecture="qwen3", sliding_window=20, max_window_layers=1),
    "phi3-partial-rotary": dict(architecture="phi3", rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(path))
    return path


def _not_transformers(*args, **kwargs):
    raise AssertionError("read through transformers again")


def _rope(spec):
    types = sorted(set(spec.layer_rope_types)) or [None]
    return {t: rope_tables(spec, torch.device("cpu"), torch.float32, t) for t in types}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_remembered_spec_equals_transformers_reading(variant, tmp_path, cache, default_model_dir, monkeypatch):
    model_dir = build_tiny_model(tmp_path / variant, default_model_dir, **VARIANTS[variant])
    read = load_model_spec(model_dir)
    assert [p.name for p in (cache / "model-reads").iterdir()] == [next((cache / "model-reads").iterdir()).name]
    monkeypatch.setattr(model_loader, "read_model_spec", _not_transformers)
    again = load_model_spec(model_dir)
    assert again == read and again.rope_parameters == read.rope_parameters and again.path == model_dir
    assert "hf_config" not in again.__dict__  # not read back: only a RoPE other than the default one reads it
    for key, (cos, sin) in _rope(read).items():
        again_cos, again_sin = _rope(again)[key]
        assert torch.equal(cos, again_cos) and torch.equal(sin, again_sin), key


def test_a_changed_config_or_an_unreadable_entry_is_read_again(tmp_path, cache, default_model_dir):
    model_dir = build_tiny_model(tmp_path / "llama", default_model_dir)
    assert load_model_spec(model_dir).rms_norm_eps == 1e-5
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 3e-6}))
    assert load_model_spec(model_dir).rms_norm_eps == 3e-6
    entries = sorted((cache / "model-reads").iterdir())
    assert len(entries) == 2
    for entry in entries:
        entry.write_text("{not json")
    assert load_model_spec(model_dir).rms_norm_eps == 3e-6
    rewritten = [json.loads(e.read_text())["rms_norm_eps"] for e in entries if e.read_text() != "{not json"]
    assert rewritten == [3e-6]  # this config's entry, read again and written again


def test_a_spec_transformers_refuses_is_not_remembered(tmp_path, cache, default_model_dir):
    model_dir = build_tiny_model(tmp_path / "llama", default_model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "hidden_act": "relu"}))
    for _ in range(2):
        with pytest.raises(model_loader.ModelLoadError, match="unsupported hidden_act 'relu'"):
            load_model_spec(model_dir)
    assert not (cache / "model-reads").exists()


def test_a_remembered_tokenizer_is_the_class_autotokenizer_picked_and_encodes_alike(cache, default_model_dir, monkeypatch):
    from transformers import AutoTokenizer

    first = load_tokenizer(default_model_dir)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", _not_transformers)
    again = load_tokenizer(default_model_dir)
    assert type(again) is type(first) and type(first).__name__ == "TokenizersBackend"
    text = "Hello, world! Ünïcödé\n\n  spaces\t<|im_start|>user"
    assert again.encode(text) == first.encode(text) and again.all_special_ids == first.all_special_ids
    chat = [{"role": "user", "content": "What is 2+2?"}]
    assert again.apply_chat_template(chat, tokenize=False) == first.apply_chat_template(chat, tokenize=False)


def test_a_process_with_the_reads_remembered_builds_an_engine_without_a_model_config_class(tmp_path, tiny_model_dir):
    """The point of remembering: the config classes' imports (torch.distributed.tensor, sympy).
    The session's cache dir (its built kernels kept; native kernels off anyway: imports are the
    question) and a model whose config no earlier test read."""
    model_dir = Path(shutil.copytree(tiny_model_dir, tmp_path / "tiny"))
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "kvrelay_test_copy": str(tmp_path)}))
    script = (
        "import sys; from serving.engine.async_engine import AsyncEngine; from serving.engine.config import EngineConfig; "
        f"AsyncEngine(EngineConfig(model={str(model_dir)!r}, kv_cache_bytes=2**20)).shutdown(); "
        "print(sorted(m for m in ('sympy', 'transformers.core_model_loading', 'transformers.models.llama.configuration_llama') "
        "if m in sys.modules))"
    )
    env = {**os.environ, "KVRELAY_DISABLE_NATIVE": "1"}
    runs = [subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                           timeout=300, check=False) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr[-3000:]
    assert runs[0].stdout.splitlines()[-1] == "['sympy', 'transformers.core_model_loading', 'transformers.models.llama.configuration_llama']"
    assert runs[1].stdout.splitlines()[-1] == "[]"
