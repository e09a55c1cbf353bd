"""What the engine hands back after each step: per-request deltas."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["TokenLogprob", "CompletionOutput", "RequestOutput", "RequestMetrics"]


@dataclass
class TokenLogprob:
    """The sampled token's logprob and the `k` most likely alternatives (raw model distribution)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class CompletionOutput:
    """One choice's new tokens and text since the previous output (a delta)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that matched

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """Deltas for one request (every choice that advanced this step)."""

    request_id: str
    outputs: list[CompletionOutput]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int
    metrics: RequestMetrics | None = None
