"""What the engine hands back after each step: per-request deltas."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["TokenLogprob", "CompletionOutput", "RequestOutput", "RequestMetrics", "EngineStats", "merge_outputs"]


@dataclass
class TokenLogprob:
    """The sampled token's logprob and the `k` most likely alternatives (raw model distribution).
    A prompt token's (prompt logprobs) is the same, for the token the prompt holds there, with its
    `rank`: 1 + how many tokens the model found strictly more likely."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # prompt logprobs only


@dataclass
class CompletionOutput:
    """One choice's new tokens and text since the previous output (a delta)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "queue_timeout" (no tokens)
    stop_reason: str | int | None = None  # the stop string or stop token id that matched

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When a request reached each stage in this engine, on the node's time.monotonic() clock, in
    seconds (one clock for every process of a node; tracing and the ingress's TTFT split shift
    them onto their own clocks)."""

    arrival_mono_s: float
    first_scheduled_mono_s: float | None = None
    first_token_mono_s: float | None = None
    finished_mono_s: float | None = None


@dataclass
class RequestOutput:
    """Deltas for one request (every choice that advanced this step)."""

    request_id: str
    outputs: list[CompletionOutput]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int
    metrics: RequestMetrics | None = None
    # params.prompt_logprobs: one per prompt token after the first (the first has no context to
    # be predicted from), in the request's first output after its prompt is computed; else None
    prompt_logprobs: list[TokenLogprob] | None = None


def merge_outputs(acc: RequestOutput | None, new: RequestOutput) -> RequestOutput:
    """Fold a step's deltas into an accumulated output (a copy on first use)."""
    if acc is None:
        acc = RequestOutput(new.request_id, [], False, new.num_prompt_tokens, new.num_cached_tokens, new.metrics)
    by_index = {c.index: c for c in acc.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            by_index[c.index] = CompletionOutput(
                c.index, c.text, list(c.token_ids), list(c.logprobs) if c.logprobs else None,
                c.finish_reason, c.stop_reason,
            )
        else:
            old.text += c.text
            old.token_ids += c.token_ids
            if c.logprobs:
                old.logprobs = (old.logprobs or []) + c.logprobs
            old.finish_reason = c.finish_reason or old.finish_reason
            old.stop_reason = c.stop_reason if c.stop_reason is not None else old.stop_reason
    acc.outputs = [by_index[i] for i in sorted(by_index)]
    acc.finished = new.finished
    acc.metrics = new.metrics
    acc.num_cached_tokens = new.num_cached_tokens
    if new.prompt_logprobs is not None:
        acc.prompt_logprobs = new.prompt_logprobs
    return acc


@dataclass
class EngineStats:
    """An engine's figures now (LLMEngine.stats): its queues, KV blocks, counters, and what runs."""

    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    kv_usage: float
    num_preemptions: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    num_computed_tokens: int  # every token run through the model
    num_generated_tokens: int
    num_held_exports: int
    num_expired_imports: int = 0  # KV imports whose shared-memory lease ran out before scheduling
    num_queue_timeouts: int = 0  # requests refused after waiting max_queue_wait_s for their first step
    num_queued_prefill_tokens: int = 0  # prompt tokens of waiting and running sequences not yet computed
    prefill_tokens_per_s: float = 0.0  # measured over recent steps that ran prefill (EMA); 0 before any
    # Decode steps back to back, since the start (engine.DecodeSteps): how many, their
    # sequences summed, and their seconds from one step's start to the next's (a step's period as
    # its streams see it: the step, the outputs' hand-over and whatever shared the core meanwhile)
    decode_steps: int = 0
    decode_step_rows: int = 0
    decode_step_s: float = 0.0
    dtype: str = ""  # the dtype that runs (config "auto" resolved) and why: dtype_choice.DtypeChoice
    dtype_reason: str = ""
    kernel_path: str = ""  # "native" or "pytorch" (cpu_kernels.KernelPath)
    kernel_reason: str = ""  # why that path (cpu_kernels.KernelStatus.reason)
    linear_path: str = ""  # up to how many rows the native linear kernel runs (linear_choice.py)
    deterministic: str = ""  # batch-invariant mode: "on (...)" or "off (...)", and why (modeling/batch_invariance.py)
    # Speculative decoding (speculative.py), since the engine started; all 0 and "" when it is off
    lora_resident: tuple[str, ...] = ()  # LoRA adapters in the engine's slots now (lora.py)
    lora_load_s: float = 0.0  # an adapter's load on first use, seconds (recent loads weigh most); 0: none yet
    lora_slots_free: int = -1  # adapter slots no running request holds (a new adapter may take one); -1: no LoRA
    spec_method: str = ""  # the proposer, e.g. "ngram"
    spec_proposed_tokens: int = 0  # proposed tokens a forward pass verified
    spec_accepted_tokens: int = 0  # of those, kept
    spec_verify_steps: int = 0  # sequence-steps that verified proposals (each emitted accepted + 1 tokens at most)
    spec_knee_dropped_tokens: int = 0  # adaptive: proposals dropped as the step's rows passed spec_max_batch_rows
    spec_max_batch_rows: int = 0  # adaptive: decode rows past which no proposals (the measured knee; 0: none)
    spec_single_row_cost: float = 0.0  # adaptive, measured: a verify row / a single-stream step (0: not measured)

    @property
    def spec_acceptance_rate(self) -> float:
        """Kept / proposed; 0 before any proposal."""
        return self.spec_accepted_tokens / self.spec_proposed_tokens if self.spec_proposed_tokens else 0.0

    @property
    def spec_tokens_per_step(self) -> float:
        """Mean tokens a verifying sequence-step kept (accepted proposals + the model's own); 0 before any."""
        return (self.spec_accepted_tokens + self.spec_verify_steps) / self.spec_verify_steps if self.spec_verify_steps else 0.0
