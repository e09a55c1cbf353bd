"""Speculative verification: a sequence's proposed tokens checked against its 1 + k sampled rows.

With `config.speculative` (spec/speculative.py), a sequence gets proposed tokens after each of
its steps, and its next step verifies them: its 1 + k sampling rows are sampled as ones, each row
with the proposals before it as output so far (and that position's seed key); the proposals the
rows' tokens agree with, then the first disagreeing row's token, are appended one at a time
through the usual checks (so a stop ends the sequence at the first token that triggers it), into
one delta; KV slots of rejected proposals are dropped. For sampled rows that is rejection
sampling with a one-hot draft (speculative.py says why it is exact). A structured output's row m
is masked by its grammar after the first m proposals (SpeculativeMask, output_processing.py), and
its proposals are cut to the prefix its grammar allows before they are run.
"""

from __future__ import annotations

import logging

from serving.engine.output_processing import OutputProcessor
from serving.engine.outputs import CompletionOutput, TokenLogprob
from serving.engine.request import Sequence
from serving.engine.request_table import RequestTable

__all__ = ["SpecVerifier"]

logger = logging.getLogger(__name__)


class SpecVerifier:
    def __init__(self, speculator, table: RequestTable, processor: OutputProcessor, block_manager, scheduler):
        self.speculator, self.table, self.processor = speculator, table, processor
        self.block_manager, self.scheduler = block_manager, scheduler

    def append_verified(self, seq: Sequence, rows: list[tuple[int, TokenLogprob | None]], now: float) -> CompletionOutput:
        """Keep the proposed tokens the model agrees with and its own next token, appended one at a
        time (a stop ends it at the first that triggers); drop the rest and their KV. One delta."""
        proposed, seq.spec_token_ids = seq.spec_token_ids, []
        model_tokens = [token_id for token_id, _ in rows]
        num_kept = self.speculator.verify(seq, proposed, model_tokens) + 1
        delta: CompletionOutput | None = None
        for token_id, logprob in rows[:num_kept]:
            # Every token before this one is known and its KV computed (the proposals before it were kept).
            seq.num_computed_tokens = seq.num_tokens
            self.block_manager.commit(seq)
            one = self.processor.append(seq, token_id, logprob, now)
            if delta is None:
                delta = one
            else:
                delta.text += one.text
                delta.token_ids += one.token_ids
                if one.logprobs:
                    delta.logprobs = (delta.logprobs or []) + one.logprobs
                delta.finish_reason, delta.stop_reason = one.finish_reason, one.stop_reason
            if one.finish_reason is not None:
                break
        if not seq.is_finished:
            self.block_manager.trim(seq)  # the blocks that held only rejected tokens' KV
        return delta

    def wants_proposals(self, seq: Sequence) -> bool:
        return self.speculator is not None and not seq.is_finished and self.speculator.speculates(seq.params)

    def propose(self, seqs: list[Sequence]) -> None:
        """Proposals for the next step's verification, for these sequences together (a draft model
        runs once), cut to what their grammars allow."""
        seqs = [seq for seq in seqs if seq.request_id in self.table]
        if not seqs:
            return
        # Every other running sequence has a row in the next step too (the knee counts them).
        self.speculator.propose(seqs, num_other_rows=len(self.scheduler.running) - len(seqs))
        for seq in seqs:
            matcher = self.table.state(seq).matcher
            if matcher is not None and seq.spec_token_ids:
                try:
                    del seq.spec_token_ids[matcher.allowed_prefix(seq.spec_token_ids):]
                except Exception:  # noqa: BLE001 - the request decodes without proposals
                    logger.exception("grammar check of %s's proposals failed", seq.request_id)
                    seq.spec_token_ids.clear()
