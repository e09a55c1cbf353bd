"""Output processing: a step's logits made into each request's deltas.

    logits ──sample (a row per choice, 1 + k with proposals)──▶ token, logprob
           ──append: grammar accepts? → detokenize → stop check → max_model_len──▶ CompletionOutput delta
    prompt rows ──score──▶ prompt logprobs (choice 0; a max_tokens=0 request ends when they are done)

A row, a detokenizer, a grammar or a stop check that fails fails its request alone
(RequestTable.fail); the rest of the batch goes on. Choice 0 of an n > 1 request forks the
waiting choices off its prompt blocks as its first token is appended.
"""

from __future__ import annotations

import logging
import time

import torch

from serving.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from serving.engine.request import RequestStatus, Sequence
from serving.engine.request_table import RequestTable, TrackedRequest
from serving.engine.sampling.grammar import SpeculativeMask
from serving.engine.sampling.prompt_logprobs import score_span
from serving.engine.sampling.sampler import Sampler, SamplingRow

__all__ = ["OutputProcessor"]

logger = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, table: RequestTable, sampler: Sampler, block_manager, scheduler, eos_token_ids, max_model_len: int):
        self.table, self.sampler = table, sampler
        self.block_manager, self.scheduler = block_manager, scheduler
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len
        self.num_generated_tokens = 0

    def sample(
        self, logits: torch.Tensor, seqs: list[Sequence], num_rows: list[int],
    ) -> list[list[tuple[int | None, TokenLogprob | None]]]:
        """Each sequence's (token, logprob) per row (1 + its proposed tokens); a row at fault fails
        its request alone (Sampler.sample_each)."""
        rows: list[SamplingRow] = []
        owners: list[int] = []
        for i, (seq, n) in enumerate(zip(seqs, num_rows)):
            rows += [self._sampling_row(seq, m) for m in range(n)]
            owners += [i] * n
        results, failures = self.sampler.sample_each(logits, rows)
        for failure in failures:
            self.table.fail(seqs[owners[failure.row]].request_id, "sampling", failure.error)
        per_seq: list[list[tuple[int | None, TokenLogprob | None]]] = [[] for _ in seqs]
        for owner, result in zip(owners, results):
            per_seq[owner].append(result)
        return per_seq

    def _sampling_row(self, seq: Sequence, num_proposed: int = 0) -> SamplingRow:
        """The row of `seq`'s next token after its first `num_proposed` proposed tokens."""
        params = seq.params
        request = self.table[seq.request_id]
        output = seq.output_token_ids + seq.spec_token_ids[:num_proposed]
        matcher = request.seqs[seq.index].matcher  # row m: its grammar after the first m proposals
        return SamplingRow(
            params=params,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=output,
            eos_token_ids=self.eos_token_ids,
            seed_key=None if params.seed is None else (params.seed, seq.index, len(output)),
            logit_bias=request.logit_bias,
            grammar=matcher if matcher is None or not num_proposed else SpeculativeMask(matcher, seq.spec_token_ids[:num_proposed]),
        )

    def append(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None, now: float) -> CompletionOutput:
        """Append one sampled token: its grammar, text and stop checks; the choice's delta."""
        request = self.table[seq.request_id]
        state = request.seqs[seq.index]
        if seq.first_token_mono_s is None:
            seq.first_token_mono_s = now
        if state.matcher is not None and not state.matcher.accept(token_id):
            raise RuntimeError(f"the sampler chose token {token_id}, which the grammar does not allow")
        seq.append_token(token_id)
        self.num_generated_tokens += 1
        if seq.index == 0 and request.waiting_children:
            self._fork_children(seq, request)
        text = state.detokenizer.step([token_id]) if state.detokenizer is not None else ""
        result = state.stop_checker.check(token_id, text, seq.num_output_tokens)
        delta = CompletionOutput(seq.index, result.text, [token_id], [logprob] if logprob else None)
        if result.finish_reason is None and seq.num_tokens >= self.max_model_len:
            result.finish_reason = "length"
        if result.finish_reason is not None:
            if not isinstance(result.stop_reason, str) and state.detokenizer is not None:
                # Not cut by a stop string: release what was held back for a possible match.
                delta.text += state.stop_checker.flush() + state.detokenizer.flush()
            delta.finish_reason = result.finish_reason
            delta.stop_reason = result.stop_reason
            state.finish_reason = result.finish_reason
            self.table.finish(seq, RequestStatus(result.finish_reason))
        return delta

    def _fork_children(self, parent: Sequence, request: TrackedRequest) -> None:
        num_blocks = (request.num_prompt_tokens - 1) // self.block_manager.block_size
        parent.forks_pending = False
        for child in request.waiting_children:
            self.block_manager.fork(parent, child, num_blocks)
            child.num_cached_tokens = parent.num_cached_tokens
            self.scheduler.add(child)
        request.waiting_children = []

    def score_prompts(self, logits: torch.Tensor, spans) -> None:
        """Extend each span's sequence's prompt logprobs from its rows of `logits`; a span that
        fails fails its request alone."""
        row = 0
        for span in spans:
            rows = logits[row : row + span.num_rows]
            row += span.num_rows
            try:
                span.seq.prompt_logprobs += score_span(rows, span)
            except Exception as exc:  # noqa: BLE001 - its request alone
                self.table.fail(span.seq.request_id, "prompt logprobs", exc)

    def finish_scored(self, request: TrackedRequest) -> RequestOutput:
        """A max_tokens=0 request whose prompt is computed: every choice ends with "length" and
        no tokens (the choices waiting for choice 0 never start)."""
        first = request.seqs[0].seq
        first.first_token_mono_s = time.monotonic()  # its answer is ready: what a client waits for
        outputs = []
        for state in request.seqs:
            state.finish_reason = RequestStatus.FINISHED_LENGTH.value
            if state.seq is first:
                self.table.finish(first, RequestStatus.FINISHED_LENGTH)
            else:
                state.seq.status = RequestStatus.FINISHED_LENGTH
            outputs.append(CompletionOutput(state.seq.index, "", [], None, state.finish_reason))
        request.waiting_children.clear()
        return self.table.output(request, outputs)
