"""Speculative decoding: a cheap proposer guesses k tokens, one forward pass verifies them all.

    step t     sequence  ... x │ p1 p2 p3          (│: known tokens end; p: proposed, spec_token_ids)
    forward    rows      x  p1  p2  p3           1 + k query rows, causal among themselves, in the
                                                 same batch as plain decodes and prefill chunks
    model's    tokens    y1 y2  y3  y4           y_i: the model's token after x p1 .. p(i-1)
    accept     p1 == y1, p2 == y2, p3 != y3  ──▶ keep p1 p2, then y3 (the model's own):
                                                 3 tokens this step, and p3's KV slot is dropped

Lossless for greedy requests: every token kept is the model's argmax after exactly the tokens
before it (y_i is computed on the accepted prefix), so the output is the one decoding without
speculation gives, token for token, up to the numerics of computing a position as one row of a
chunk rather than alone (the same as chunked prefill vs. a single decode). Each kept token goes
through the sampler with its own row (output so far + the proposals before it: penalties,
min_tokens, logit_bias, logprobs stay exact) and then through the stop checks one at a time, so
eos, stop strings and max_tokens end the sequence at the first token that triggers them and
nothing after it is emitted.

KV: the step writes all 1 + k positions. Accepting j proposals keeps the first 1 + j
(num_computed_tokens), the rest are garbage that later tokens overwrite, and the tail blocks that
held only rejected positions go back to the pool (BlockManager.trim). Blocks are hashed for the
prefix cache only over computed tokens, so a rejected token never reaches the cache.

Who speculates (this slice): greedy requests without a structured output. A sampled request
needs rejection sampling to keep its distribution, a grammar needs its matcher rolled through
the proposals: both decode one token per step until they are added. Proposals are capped so a
step never runs past max_tokens or the context window, and the scheduler drops them rather than
preempt anyone or exceed the step's token budget (scheduler.py).
"""

from __future__ import annotations

import logging

from serving.engine.config import SpeculativeConfig
from serving.engine.params import SamplingParams
from serving.engine.request import Sequence
from serving.engine.sampler import is_greedy
from serving.engine.spec_ngram import NgramProposer

__all__ = ["Speculator", "num_accepted"]

logger = logging.getLogger(__name__)


def num_accepted(proposed: list[int], model_tokens: list[int]) -> int:
    """How many leading proposals the model agrees with: `model_tokens[i]` is the model's token
    after the proposals before i (len(proposed) + 1 of them, the last one follows them all)."""
    assert len(model_tokens) == len(proposed) + 1, (len(proposed), len(model_tokens))
    j = 0
    while j < len(proposed) and proposed[j] == model_tokens[j]:
        j += 1
    return j


class Speculator:
    """Proposes tokens for the sequences that speculate, and counts how many were kept."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(
            min_n=config.prompt_lookup_min, max_n=config.prompt_lookup_max, k=config.num_speculative_tokens,
        )
        self.num_proposed_tokens = 0  # proposals verified by a forward pass
        self.num_accepted_tokens = 0  # of those, kept
        self.num_verified_seqs = 0  # sequence-steps that verified proposals

    @staticmethod
    def speculates(params: SamplingParams) -> bool:
        """Whether a request's sequences get proposals (see the module docstring)."""
        return is_greedy(params) and params.guided is None

    def propose(self, seq: Sequence) -> None:
        """Set `seq.spec_token_ids` for its next step: at most what fits before max_tokens and the
        context window, with one token left for the model's own."""
        assert seq.num_computed_tokens == seq.num_tokens - 1, f"{seq} is not decoding"
        max_k = min(seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
        seq.spec_token_ids = self.proposer.propose(seq.token_ids, max_k) if max_k > 0 else []

    def verify(self, proposed: list[int], model_tokens: list[int]) -> int:
        """num_accepted, counted."""
        j = num_accepted(proposed, model_tokens)
        self.num_proposed_tokens += len(proposed)
        self.num_accepted_tokens += j
        self.num_verified_seqs += 1
        return j
