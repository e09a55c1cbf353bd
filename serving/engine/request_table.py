"""The requests an LLMEngine holds, and the one way each of them leaves.

A request is one `TrackedRequest`: its choices (`SeqState`: the sequence, its detokenizer, stop
checker and grammar matcher), from `add` until its last output. It leaves in one of three ways,
all here, so the blocks, the adapter slot and the proposer's state are given back alike:

    finish(seq)      a choice ended on its own (stop, length): its KV freed, or held for export
    end(request)     ended from outside (abort, queue timeout): its final output
    fail(request)    its own error in a step: the error waits in `take_failures()`

While it waits outside the scheduler it is also in `compiling` (its grammar) or `lora_waiting`
(its adapter's slot); leaving takes it off those too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from serving.engine.errors import InvalidRequestError, RequestFailedError
from serving.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from serving.engine.request import RequestStatus, Sequence
from serving.engine.sampling.detokenizer import IncrementalDetokenizer
from serving.engine.sampling.grammar import GrammarMatcher, PendingGrammars
from serving.engine.sampling.sampler import LogitBias
from serving.engine.sampling.stop_checker import StopChecker

__all__ = ["RequestTable", "SeqState", "TrackedRequest"]

logger = logging.getLogger(__name__)


@dataclass
class SeqState:
    seq: Sequence
    detokenizer: IncrementalDetokenizer | None  # None: the caller detokenizes (params.detokenize False)
    stop_checker: StopChecker
    finish_reason: str | None = None
    matcher: GrammarMatcher | None = None  # its place in params.guided's grammar


@dataclass
class TrackedRequest:
    request_id: str
    seqs: list[SeqState]
    num_prompt_tokens: int
    arrival_mono_s: float  # time.monotonic()
    waiting_children: list[Sequence] = field(default_factory=list)
    logit_bias: LogitBias | None = None  # its params' logit_bias as tensors, for every step's rows
    prompt_logprobs_sent: bool = False  # its prompt logprobs went out (in its first output after them)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


class RequestTable:
    """The engine's requests by id, with what ends them (module docstring)."""

    def __init__(self, scheduler, block_manager, held_kv, loras, speculator):
        self.scheduler, self.block_manager, self.held_kv = scheduler, block_manager, held_kv
        self.loras, self.speculator = loras, speculator
        self.requests: dict[str, TrackedRequest] = {}
        self.pending_outputs: list[RequestOutput] = []  # ended between steps (aborts): the next step's
        self.failures: list[RequestFailedError | InvalidRequestError] = []  # requests a step ended on their own error
        # Requests waiting for their grammar; its on_ready wakes an AsyncEngine's step loop.
        self.compiling = PendingGrammars()
        # Requests whose LoRA adapter has no slot yet (intake.py): request id -> (adapter name, its path then)
        self.lora_waiting: dict[str, tuple[str, str]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def __getitem__(self, request_id: str) -> TrackedRequest:
        return self.requests[request_id]

    def state(self, seq: Sequence) -> SeqState:
        return self.requests[seq.request_id].seqs[seq.index]

    def release_lora(self, seq: Sequence) -> None:
        if seq.lora is not None:
            self.loras.release(seq.lora)
            seq.lora = None

    def _stop(self, seq: Sequence, status: RequestStatus) -> None:
        """A choice stops running: its adapter slot, its scheduler place and its proposals go."""
        seq.status = status
        self.release_lora(seq)
        self.scheduler.remove(seq)
        if self.speculator is not None:
            self.speculator.release(seq)

    def finish(self, seq: Sequence, status: RequestStatus) -> None:
        """A choice ended on its own: its KV freed, or held for export (hold_kv)."""
        self._stop(seq, status)
        if seq.hold_kv:
            self.block_manager.trim(seq)  # held: not the blocks rejected proposed tokens were written to
            self.held_kv.hold(seq)
        else:
            self.block_manager.free(seq)

    def end(self, request: TrackedRequest, status: RequestStatus) -> RequestOutput:
        """End a request before it finished on its own (aborted, or timed out in the queue): its
        unfinished choices end with `status`, their blocks are freed; its final output."""
        self._unlist(request.request_id)
        outputs = []
        for state in request.seqs:
            if state.finish_reason is None:
                state.finish_reason = status.value
                self._stop(state.seq, status)
                if state.seq.block_ids:
                    self.block_manager.free(state.seq)
                outputs.append(CompletionOutput(state.seq.index, "", [], None, status.value))
        request.waiting_children.clear()
        del self.requests[request.request_id]
        return self.output(request, outputs)

    def fail(self, request_id: str, stage: str, cause: Exception) -> None:
        """A request failed on its own in `stage`: it leaves, its error waits in take_failures."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        self._unlist(request_id)
        for state in request.seqs:
            seq = state.seq
            if state.finish_reason is None:
                state.finish_reason = "error"
                self._stop(seq, RequestStatus.FINISHED_ABORTED)
            if seq.block_ids and not self.held_kv.holds(seq):
                self.block_manager.free(seq)
        request.waiting_children.clear()
        self.held_kv.release(request_id)
        if isinstance(cause, InvalidRequestError):  # the client's to change (a 400 naming the field)
            error = InvalidRequestError(cause.param, cause.message)  # its own: a cached compile error is shared
            error.request_id = request_id
            logger.warning("request %s ended in the engine's %s: %s", request_id, stage, cause)
            self.failures.append(error)
            return
        error = RequestFailedError.caused_by(request_id, stage, cause)
        logger.error("%s", error, exc_info=cause)
        self.failures.append(error)

    def _unlist(self, request_id: str) -> None:
        self.compiling.discard(request_id)
        self.lora_waiting.pop(request_id, None)

    def take_failures(self) -> list[RequestFailedError | InvalidRequestError]:
        failures, self.failures = self.failures, []
        return failures

    def output(self, request: TrackedRequest, outputs: list[CompletionOutput]) -> RequestOutput:
        """The request's output of these choices' deltas (its prompt logprobs the first time they are all scored)."""
        first = request.seqs[0].seq
        finished = request.finished
        prompt_logprobs = None
        if first.prompt_logprobs is not None and not request.prompt_logprobs_sent and not first.needs_prompt_logprobs:
            prompt_logprobs = first.prompt_logprobs
            request.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=request.request_id,
            outputs=outputs,
            finished=finished,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=first.num_cached_tokens,
            metrics=RequestMetrics(
                arrival_mono_s=request.arrival_mono_s,
                first_scheduled_mono_s=first.first_scheduled_mono_s,
                first_token_mono_s=first.first_token_mono_s,
                finished_mono_s=time.monotonic() if finished else None,
            ),
            prompt_logprobs=prompt_logprobs,
        )
