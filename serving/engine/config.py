"""Engine configuration: one pydantic model, unknown keys rejected (StrictModel, strict.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator, model_validator

from serving.engine.strict import StrictModel

if TYPE_CHECKING:
    import torch

__all__ = ["EngineConfig", "LoRAConfig", "SpeculativeConfig", "VLLMOptions"]


class LoRAConfig(StrictModel):
    """Multi-LoRA (lora.py): PEFT adapters over the base model, mixed in one batch."""

    adapters: dict[str, str] = Field(
        default_factory=dict,
        description="Adapter name -> local PEFT directory (adapter_config.json, adapter_model.safetensors). "
        "A request names its adapter (LLMEngine.add_request(lora_name=...)); it is read on first use.",
    )
    max_loras: int = Field(
        4, ge=1, le=1024,
        description="Adapters resident at once; the least recently used one no running request uses is "
        "evicted for a new one.",
    )
    @field_validator("adapters")
    @classmethod
    def _normalized(cls, adapters: dict[str, str]) -> dict[str, str]:
        """Each path as pathlib writes it ("/a/b/" -> "/a/b"): the ingress and the engines hash an
        adapter's blocks with its path, so both must spell it alike."""
        for name in adapters:
            if not name or ":" in name:
                raise ValueError(f"adapter name {name!r}: must be non-empty and hold no ':' (base:adapter names one)")
        return {name: str(Path(path)) for name, path in adapters.items()}

    allow_runtime_updates: bool = Field(
        False,
        description="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's) may add and remove "
        "adapters while serving: admin keys only (admin_api_keys), or anyone where no keys are configured. "
        "An adapter loaded so reads from a path every worker can reach (a shared volume); several ingress "
        "replicas share them through the app's AdapterRegistry.",
    )


class SpeculativeConfig(StrictModel):
    """Speculative decoding (speculative.py): guess tokens cheaply, verify them in one forward pass."""

    method: Literal["ngram", "suffix", "draft"] = Field(
        "ngram",
        description="Proposer. ngram: prompt lookup, the tokens that followed the latest earlier occurrence "
        "of the sequence's last n tokens in its own prompt and output (spec_ngram.py). suffix: the most "
        "frequent continuation of the sequence's longest matching suffix in its own text and in the outputs "
        "of recently finished requests (spec_suffix.py; the suffix_* fields). draft: a smaller "
        "model with the same tokenizer (draft_model) decodes k tokens greedily, batched, with its own "
        "paged KV cache (spec_draft.py).",
    )
    num_speculative_tokens: int = Field(
        4, ge=1, le=16,
        description="Most tokens proposed per sequence per step; a step verifies them all and keeps the "
        "longest prefix the model agrees with, plus the model's own next token.",
    )
    prompt_lookup_min: int = Field(
        2, ge=1, le=32, description="Shortest n-gram (the sequence's last tokens) that may match; shorter: no proposal.",
    )
    prompt_lookup_max: int = Field(
        4, ge=1, le=32, description="Longest n-gram tried first; a longer match predicts better.",
    )
    adaptive: bool = Field(
        True,
        description="Size each sequence's proposals by its acceptance so far and the measured cost of a "
        "verify row, back off where guesses keep failing, and propose nothing in steps whose decode rows "
        "would pass the compute-bound knee (speculative.py). false: always num_speculative_tokens.",
    )
    acceptance_ema: float = Field(
        0.3, gt=0.0, le=1.0,
        description="adaptive: weight of a sequence's newest verify step in its acceptance estimate "
        "(an exponential moving average; 1: the last step alone).",
    )
    backoff_steps: int = Field(
        8, ge=1, le=1024,
        description="adaptive: steps a sequence proposes nothing once its estimate says no proposal pays; "
        "then it tries one token again.",
    )
    verify_row_cost: float | None = Field(
        None, ge=0.0, le=2.0,
        description="adaptive: what verifying one proposed token costs, as a fraction of a sequence's share "
        "of a step; null: measured at start-up from step time vs rows (step_costs.py), by the step's rows.",
    )
    max_batch_rows: int | None = Field(
        None, ge=1,
        description="adaptive: most decode rows (sequences + proposals) a step may have and still get "
        "proposals, past it decode is compute-bound; null: the knee measured at start-up (step_costs.py).",
    )

    suffix_max_depth: int = Field(
        16, ge=2, le=64,
        description="suffix: tokens per suffix kept in the trees (match + proposals); memory is up to this "
        "many nodes per token of text. Must exceed num_speculative_tokens.",
    )
    suffix_max_cached_requests: int = Field(
        256, ge=0, le=100_000,
        description="suffix: finished requests whose outputs the global tree keeps, oldest evicted first (0: none).",
    )
    suffix_max_cached_tokens: int = Field(
        65_536, ge=1, le=10_000_000,
        description="suffix: tokens the global tree keeps, oldest requests evicted first; its memory is at most "
        "suffix_max_depth nodes (~100 bytes each) per token.",
    )
    suffix_min_probability: float = Field(
        0.1, ge=0.0, le=1.0,
        description="suffix: stop proposing where the path's estimated probability (the product of each "
        "token's count over its siblings' counts) falls below this.",
    )
    suffix_max_spec_factor: float = Field(
        1.0, gt=0.0, le=16.0,
        description="suffix: propose at most this many tokens per matched token (at least 1): a short match proposes few.",
    )
    suffix_cache_prompts: bool = Field(
        False, description="suffix: also put finished requests' prompts (not only their outputs) in the global tree.",
    )

    draft_model: str | None = Field(
        None,
        description="method draft: the draft model, as EngineConfig.model (a built-in name, a .gguf file or a "
        "local Hugging Face directory); it must have the model's tokenizer (same vocabulary and eos tokens). "
        "It runs in the model's dtype and on its device.",
    )
    draft_num_blocks: int = Field(
        256, ge=1, le=1_000_000,
        description="method draft: KV blocks (of the engine's block_size tokens) of the draft model's own cache. "
        "A sequence whose draft KV does not fit gets no proposals (it decodes one token per step), never an "
        "error. Bytes: blocks x block_size x the draft's KV bytes per token (2 x layers x KV heads x head "
        "dim x dtype size; SmolLM2-135M bf16: 23040).",
    )

    @model_validator(mode="after")
    def _check_draft(self) -> SpeculativeConfig:
        if self.method == "draft" and not self.draft_model:
            raise ValueError(
                "method 'draft' needs draft_model: the path or built-in name of a smaller model with the "
                "same tokenizer (or choose method 'ngram')"
            )
        if self.method != "draft" and self.draft_model is not None:
            raise ValueError(
                f"draft_model is only used by method 'draft', the method is {self.method!r}: "
                "set method: draft or remove draft_model"
            )
        return self

    @model_validator(mode="after")
    def _check_window(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must be at most prompt_lookup_max "
                f"({self.prompt_lookup_max}): raise prompt_lookup_max or lower prompt_lookup_min"
            )
        if self.method == "suffix" and self.suffix_max_depth <= self.num_speculative_tokens:
            raise ValueError(
                f"suffix_max_depth ({self.suffix_max_depth}) must exceed num_speculative_tokens "
                f"({self.num_speculative_tokens}): a match and its proposals must fit in a suffix; raise suffix_max_depth"
            )
        return self


class VLLMOptions(StrictModel):
    """vLLM's own options where `backend: vllm` (serving/engine/vllm/engine.py); the rest of
    EngineConfig maps onto vLLM's (model, dtype, block_size, max_model_len, max_num_seqs,
    max_num_batched_tokens, enable_prefix_caching, seed, lora, kv_cache_bytes)."""

    enforce_eager: bool = Field(
        True, description="Run eagerly: no torch.compile or CUDA graphs (about 70 s less start-up on a CPU; "
        "false on GPUs for speed).",
    )
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="GPUs one replica's model is split over (CUDA).")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="CUDA: the share of the GPU's memory vLLM may take (weights, activations, KV).",
    )
    quantization: str | None = Field(None, description="vLLM's `quantization` (e.g. awq, gptq, fp8); null: none.")
    max_loras: int = Field(4, ge=1, le=256, description="With `lora`: adapters resident at once in vLLM's slots.")
    max_lora_rank: int = Field(16, ge=1, le=512, description="With `lora`: the highest adapter rank vLLM sizes its slots for.")


class EngineConfig(StrictModel):
    model: str = Field(
        "smollm2-135m-instruct",
        description="Built-in name, a .gguf file, or a local Hugging Face model directory.",
    )
    dtype: Literal["auto", "bfloat16", "float32", "float16"] = Field(
        "auto",
        description="Weights and KV cache dtype. auto: bfloat16 where this machine's bf16 matrix "
        "products are fast, else float32 (measured at start-up, dtype_choice.py); float32 for exact parity checks.",
    )
    device: str = Field("cpu", description="'cpu' or 'cuda[:N]'.")
    block_size: int = Field(16, ge=1, le=256, description="Tokens per KV block.")
    kv_cache_bytes: int | None = Field(
        None, gt=0, description="KV cache budget in bytes; overrides kv_cache_memory_fraction."
    )
    kv_cache_memory_fraction: float = Field(
        0.1, gt=0.0, le=0.95, description="KV cache budget as a fraction of available memory."
    )
    max_model_len: int | None = Field(
        None, ge=1, description="Context window; default the model's, capped by the KV capacity."
    )
    max_num_seqs: int = Field(128, ge=1, le=4096, description="Sequences running at once.")
    max_num_batched_tokens: int = Field(
        512, ge=1, description="Token budget per step (prefill chunks + decodes)."
    )
    long_prefill_token_threshold: int = Field(
        0, ge=0,
        description="A prompt with more tokens than this left to compute is 'long': it gets at most "
        "this many tokens per step, so short prompts and decodes share the step (0: off).",
    )
    max_long_partial_prefills: int = Field(
        1, ge=1, description="Long prompts prefilling at once; further long ones let shorter ones pass."
    )
    enable_prefix_caching: bool = Field(True, description="Reuse KV of shared prompt prefixes.")
    max_queue_wait_s: float | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="A request still waiting for its first step this many seconds after it reached the "
        "engine is finished with finish_reason 'queue_timeout' (the API answers 503 queue_timeout with "
        "Retry-After) instead of waiting on. Only a request that has generated nothing: a preempted one, "
        "or one continued from tokens generated elsewhere, waits as long as it takes. null: no limit.",
    )
    priority_aging_s: float | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="A request waiting to start becomes one priority level more important per this many "
        "seconds it has waited, so a stream of more important requests cannot starve it: its place in the "
        "admission order, never a running request's. null: no aging (strict priority, then arrival).",
    )
    num_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads for this engine; default: torch's choice."
    )
    seed: int = Field(0, description="Seed of the sampler's generator for unseeded requests.")
    deterministic: bool | Literal["auto"] = Field(
        "auto",
        description="Batch-invariant kernels: a request's tokens (greedy, or sampled with a seed) do not depend "
        "on what else runs in its step, whether its prefix came from the prefix cache or a KV hand-off, or how "
        "its prompt was chunked; bitwise, in bf16 too. Every linear layer runs one native kernel with one "
        "summation order per row, and every token's attention the one paged kernel (model.py). Needs the "
        "native CPU kernels and dtype bfloat16 or float32; elsewhere it logs a warning and runs the usual path. "
        "auto: on where it costs nothing measured: bf16 on a CPU with AVX512-BF16 and no AMX (prefill 0.94-1.04x, "
        "decode 1.1-1.36x the usual path's speed: docs/benchmarks.md), and on AMX too when this engine speculates "
        "(greedy output equal to decoding without speculation needs it); off elsewhere (fp32, CUDA, AVX2, and "
        "AMX, whose oneDNN GEMM outruns the native kernel on prefill). true forces it, false turns it off.",
    )
    lora: LoRAConfig | None = Field(
        None, description="Multi-LoRA serving: adapters over this base model, mixed in one batch. null: off.",
    )
    backend: Literal["kvrelay", "vllm"] = Field(
        "kvrelay", description="The engine behind the workers: kvrelay's own, or vLLM's AsyncLLM (the optional "
        "`kvrelay[vllm]` install) with its kernels and model coverage, behind the same workers.",
    )
    vllm: VLLMOptions | None = Field(None, description="vLLM's own options (backend: vllm); null: their defaults.")
    speculative: SpeculativeConfig | None = Field(
        None,
        description="Speculative decoding, lossless: greedy and seeded requests give the same tokens as "
        "without it, sampled ones the same distribution (rejection sampling), in fewer steps when the "
        "proposer guesses well. Requests with a structured output decode one token per step. null: off.",
    )

    @model_validator(mode="after")
    def _check_backend(self) -> EngineConfig:
        if self.backend == "vllm" and self.speculative is not None:
            raise ValueError("speculative is kvrelay's engine's (backend: kvrelay); with backend: vllm leave it "
                             "null (vLLM's own speculative decoding is not wired in yet)")
        return self

    @model_validator(mode="after")
    def _check_device(self) -> EngineConfig:
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # here: a config loads without torch (the router, the ops commands)

        assert self.dtype != "auto", "dtype auto is resolved by the engine (dtype_choice.choose_dtype)"
        return getattr(torch, self.dtype)
