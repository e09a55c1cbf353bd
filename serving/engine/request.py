"""One sequence being generated (one choice of a request), described by counters, not phases.

A sequence holds `token_ids` (prompt + generated) and `num_computed_tokens`, how many of them
have KV in the cache. The scheduler's only question each step is how many of the
`num_tokens - num_computed_tokens` pending tokens to compute. A prefill worker is the same
sequence asked for one token with its KV held for export.

Speculative decoding (speculative.py) adds `spec_token_ids`: tokens proposed after `token_ids`,
not yet part of the sequence. A decoding sequence with k of them computes 1 + k tokens in its step
(`num_tokens_with_spec`); the engine keeps the ones the model agrees with and drops the rest.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from serving.engine.params import SamplingParams

if TYPE_CHECKING:
    from serving.engine.kv.payload import KVPayload
    from serving.engine.outputs import TokenLogprob

__all__ = ["RequestStatus", "Sequence"]

_seq_counter = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_PARENT = "waiting_for_parent"  # choice > 0 of an n > 1 request
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_QUEUE_TIMEOUT = "queue_timeout"  # waited longer than max_queue_wait_s for its first step

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_QUEUE_TIMEOUT,
        )


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int  # choice index within the request
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: never None
    priority: int = 0
    arrival_mono_s: float = field(default_factory=time.monotonic)
    # Extra keys mixed into every block hash (adapter id, cache salt).
    extra_keys: tuple = ()
    lora: object | None = None  # its LoRA adapter (lora.LoRAAdapter) while it runs; None: the base model
    # Keep the KV blocks after finishing, for export (prefill worker).
    hold_kv: bool = False
    # Whether the blocks it computes stay cached as the most recently used when freed (False: at
    # the eviction end; the router's admission, router/prefix_cost.py). Cache hits are not moved.
    keep_cached: bool = True

    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # prompt tokens it should find cached (the engine's lookup as it was queued, or the worker's
    # expectation if more): until it is scheduled, its queued prefill is the rest (LLMEngine.stats)
    expected_cached_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of full blocks, in order
    num_committed_blocks: int = 0  # leading blocks whose KV is computed and registered by hash
    # leading blocks given back as a sliding window moved past them (their table entries stay, unread)
    num_released_blocks: int = 0
    # its blocks in the sliding layers' pool (kv/hybrid_block_manager.py); None: one pool
    sliding_table: object | None = None
    # choice 0 of n > 1 before its first token: its children will share its prompt's blocks, so
    # a sliding window gives none back until they are forked (OutputProcessor._fork_children, output_processing.py)
    forks_pending: bool = False
    num_preemptions: int = 0
    pending_import: KVPayload | None = None
    # hold_kv: where its payload is read out when it finishes (a shared-memory arena range,
    # serving/deployments/kv_arena.py); None: a new tensor
    export_into: object | None = None
    export_until_mono_s: float | None = None  # time.monotonic() after which export_into must not be written
    first_scheduled_mono_s: float | None = None
    first_token_mono_s: float | None = None
    # params.prompt_logprobs (choice 0 only): the logprob of prompt token i + 1 at index i, filled
    # as the prompt's chunks are computed; None when not asked for (then nothing costs anything)
    prompt_logprobs: list[TokenLogprob] | None = None
    # Proposed tokens after token_ids, verified in the next step (speculative.py); only while
    # decoding (num_computed_tokens == num_tokens - 1), cleared when preempted
    spec_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """Tokens a step may compute up to: the known ones and the proposed ones after them."""
        return len(self.token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs that are not all computed yet."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Lower runs first: priority, then arrival (FCFS), then creation order."""
        return (self.priority, self.arrival_mono_s, self.seq_id)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id}#{self.index}, {self.status.value}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens}, blocks={len(self.block_ids)})"
        )
