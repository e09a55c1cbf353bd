"""ModelSpec: the shape of a Llama-family model, read from its config through transformers.

Everything the engine needs of a model's config is read once, here, and checked: a supported
architecture, RoPE type, activation and partial RoPE, each refusal naming the file and the field.
What is read is remembered per model files (loader.py, _remembered): a change to this module
makes every remembered entry stale.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path

from serving.engine.errors import ModelLoadError
from serving.engine.modeling.offline import offline

__all__ = ["GEMMA_ARCHITECTURES", "SUPPORTED_ARCHITECTURES", "SUPPORTED_ROPE_TYPES", "ModelSpec", "permute_qk_rows",
           "read_model_spec"]

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM",
    "Gemma2ForCausalLM", "Gemma3ForCausalLM",
)
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


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

        with offline():
            return AutoConfig.from_pretrained(self.path)


def read_model_spec(model_dir: Path) -> ModelSpec:
    config = _read_config(model_dir)
    arch = _architecture(config, model_dir)
    params = getattr(config, "rope_parameters", None) or {}
    # Gemma 3 keeps one rope_parameters per layer type; everything else one for every layer
    per_type = {k: v for k, v in params.items() if isinstance(v, dict)}
    _check_rope_types(per_type.values() or [params], model_dir)
    gemma = arch in GEMMA_ARCHITECTURES
    _check_activation(config, gemma, model_dir)
    rotary_dim = _rotary_dim(config, params, model_dir, whole_head=gemma or bool(per_type))
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
        eos_token_ids=_eos_token_ids(config, model_dir),
        rope_parameters=dict(params),
        qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
        layer_windows=_layer_windows(arch, config),
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


def _read_config(model_dir: Path):
    from transformers import AutoConfig

    with offline():
        try:
            return AutoConfig.from_pretrained(model_dir)
        except Exception as exc:
            raise ModelLoadError(f"cannot read {model_dir}/config.json: {exc}") from exc


def _architecture(config, model_dir: Path) -> str:
    architectures = list(getattr(config, "architectures", None) or [])
    arch = architectures[0] if architectures else type(config).__name__
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r} in {model_dir}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _check_rope_types(all_rope_params, model_dir: Path) -> None:
    for rope_params in all_rope_params:
        rope_type = rope_params.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(
                f"unsupported rope_type {rope_type!r} in {model_dir}; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )


def _check_activation(config, gemma: bool, model_dir: Path) -> None:
    act_field, supported_act = ("hidden_activation", "gelu_pytorch_tanh") if gemma else ("hidden_act", "silu")
    act = getattr(config, act_field, supported_act)
    if act != supported_act:
        raise ModelLoadError(f"unsupported {act_field} {act!r} in {model_dir}/config.json; supported: {supported_act}")


def _rotary_dim(config, params: dict, model_dir: Path, *, whole_head: bool) -> int:
    """The head dims RoPE turns; `whole_head`: a model whose RoPE must turn all of them (Gemma,
    one RoPE per layer type)."""
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rotary_dim = int(head_dim * partial)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2 or (rotary_dim < head_dim and whole_head):
        raise ModelLoadError(
            f"partial_rotary_factor {partial} in {model_dir}/config.json gives a RoPE over {rotary_dim} of "
            f"{head_dim} head dims; supported: an even number of dims in (0, head_dim], and all of them for Gemma"
        )
    return rotary_dim


def _eos_token_ids(config, model_dir: Path) -> tuple[int, ...]:
    """The generation config's end tokens, then the model config's, each once."""
    from transformers import GenerationConfig

    eos: list[int] = []
    with offline():
        with contextlib.suppress(OSError, ValueError):
            gen = GenerationConfig.from_pretrained(model_dir)
            eos += _as_list(gen.eos_token_id)
    eos += _as_list(config.eos_token_id)
    return tuple(dict.fromkeys(eos))


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
