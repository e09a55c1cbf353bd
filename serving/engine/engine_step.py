"""The scheduling step: schedule → (write imported KV) → one forward pass → score prompt rows →
sample → append (verify proposals) → propose → each request's output.

    take in      requests whose grammar compiled or whose adapter got a slot join the queue
    schedule     the scheduler's batch (scheduler.py); queue timeouts end, imports are written
    forward      ModelRunner: one pass over every scheduled token; the prefill rate measured
    score        prompt rows (prompt logprobs) split off the sampling rows
    sample       OutputProcessor / SpecVerifier: deltas; proposals for the next step

A failure that belongs to one request ends that request alone (RequestTable.fail); one with no
culprit (the forward pass, scheduling) raises out of `step()`, and the engine is dead.
"""

from __future__ import annotations

import logging
import time

import torch

from serving.engine.outputs import CompletionOutput, RequestOutput
from serving.engine.request import RequestStatus, Sequence

__all__ = ["StepRunner"]

logger = logging.getLogger(__name__)

_MIN_RATE_TOKENS = 32  # steps with fewer prefill tokens say more about overhead than about rate


class StepRunner:
    """One engine step at a time over the engine's parts (LLMEngine wires them)."""

    def __init__(self, *, table, intake, scheduler, runner, block_manager, kv, processor, verifier, prefill_rate):
        self.table, self.intake, self.scheduler, self.runner = table, intake, scheduler, runner
        self.block_manager, self.kv, self.processor, self.verifier = block_manager, kv, processor, verifier
        self.prefill_rate = prefill_rate
        self.num_computed_tokens = 0
        self.is_stalled = False  # the last step could schedule nothing (see step)
        # Sequences the last step decoded when it computed no prompt token, else 0 (the step
        # loop's decode account, engine.DecodeSteps)
        self.last_decode_rows = 0

    def step(self) -> list[RequestOutput]:
        table = self.table
        outputs, table.pending_outputs = table.pending_outputs, []
        self.last_decode_rows = 0
        if table.compiling:
            self.intake.queue_compiled()
        if table.lora_waiting:
            outputs += self.intake.queue_lora_waiting()
        sched = self.scheduler.schedule()
        scheduled = self._start(sched, outputs)
        self.is_stalled = not scheduled and not sched.preempted and not sched.timed_out
        if not scheduled:
            # Only possible while held exports pin the blocks a waiting request needs, or while
            # grammars compile: nothing changes until one is exported, released or aborted, or
            # a grammar is ready (compiling.on_ready).
            return outputs
        step, logits = self._forward(scheduled)
        sampling_seqs, num_rows, logits = self._split_scoring(step, logits)
        for seq in step.scored_seqs:
            if seq.request_id in table:  # not failed in this step
                outputs.append(self.processor.finish_scored(table.requests.pop(seq.request_id)))
        if sampling_seqs:
            outputs += self._append_sampled(logits, sampling_seqs, num_rows)
        return outputs

    def _start(self, sched, outputs: list[RequestOutput]) -> list[tuple[Sequence, int]]:
        """End what timed out in the queue, write imported KV; the sequences still to run."""
        for seq in sched.timed_out:  # waited past max_queue_wait_s: refused, nothing generated
            outputs.append(self.table.end(self.table[seq.request_id], RequestStatus.FINISHED_QUEUE_TIMEOUT))
        for seq in sched.kv_imports:
            try:
                self.kv.write_import(seq)
            except Exception as exc:  # a payload that does not fit its blocks: its request alone
                self.table.fail(seq.request_id, "KV import", exc)
        scheduled = sched.scheduled
        if self.table.failures:
            scheduled = [(seq, n) for seq, n in scheduled if seq.request_id in self.table]
        return scheduled

    def _forward(self, scheduled: list[tuple[Sequence, int]]):
        """One forward pass over the scheduled tokens; their KV counted computed."""
        num_prefill_tokens = sum(
            n for seq, n in scheduled if seq.num_computed_tokens < seq.num_prompt_tokens
        )
        self.last_decode_rows = 0 if num_prefill_tokens else len(scheduled)
        started = time.perf_counter()
        step = self.runner.prepare(scheduled)
        logits = self.runner.execute(step)
        if num_prefill_tokens >= _MIN_RATE_TOKENS:
            self.prefill_rate.add(num_prefill_tokens, max(time.perf_counter() - started, 1e-6))
        for seq, n in scheduled:
            # Proposed tokens' KV counts once they are accepted (SpecVerifier.append_verified).
            seq.num_computed_tokens += min(n, seq.num_tokens - seq.num_computed_tokens)
            self.num_computed_tokens += n
            self.block_manager.commit(seq)
        return step, logits

    def _split_scoring(self, step, logits: torch.Tensor):
        """Score the prompt rows; the sampling sequences, their row counts and their logits (a
        request whose scoring failed samples nothing)."""
        sampling_seqs, num_rows = step.sampling_seqs, step.num_sample_rows
        if not step.prompt_spans:
            return sampling_seqs, num_rows, logits
        num_sampling = sum(num_rows)
        self.processor.score_prompts(logits[num_sampling:], step.prompt_spans)
        logits = logits[:num_sampling]
        kept = [i for i, seq in enumerate(sampling_seqs) if seq.request_id in self.table]
        if len(kept) < len(sampling_seqs):
            first_rows = [sum(num_rows[:i]) for i in range(len(num_rows))]
            rows = [r for i in kept for r in range(first_rows[i], first_rows[i] + num_rows[i])]
            logits = logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device))
            sampling_seqs, num_rows = [sampling_seqs[i] for i in kept], [num_rows[i] for i in kept]
        return sampling_seqs, num_rows, logits

    def _append_sampled(self, logits: torch.Tensor, seqs: list[Sequence], num_rows: list[int]) -> list[RequestOutput]:
        """Sample, append (or verify) each sequence's tokens, propose for the next step; the outputs."""
        table = self.table
        sampled = self.processor.sample(logits, seqs, num_rows)
        now = time.monotonic()
        deltas: dict[str, list[CompletionOutput]] = {}
        to_propose: list[Sequence] = []  # proposed for together: a draft model runs once
        for seq, seq_rows in zip(seqs, sampled):
            if seq.request_id not in table:
                continue  # failed in this step
            try:
                if seq.spec_token_ids:
                    delta = self.verifier.append_verified(seq, seq_rows, now)
                else:
                    delta = self.processor.append(seq, *seq_rows[0], now)
                if self.verifier.wants_proposals(seq):
                    to_propose.append(seq)
            except Exception as exc:  # its grammar, detokenizer or stop checker
                table.fail(seq.request_id, "grammar / detokenize / stop check", exc)
                continue
            deltas.setdefault(seq.request_id, []).append(delta)
        self.verifier.propose(to_propose)
        outputs = []
        for request_id, completion_outputs in deltas.items():
            request = table.requests.get(request_id)
            if request is None:
                continue  # another of its choices failed after this one advanced
            outputs.append(table.output(request, completion_outputs))
            if request.finished:
                del table.requests[request_id]
        return outputs
