"""Speculative decoding: a cheap proposer guesses k tokens, one forward pass verifies them all.

    step t     sequence  ... x │ p1 p2 p3          (│: known tokens end; p: proposed, spec_token_ids)
    forward    rows      x  p1  p2  p3           1 + k query rows, causal among themselves, in the
                                                 same batch as plain decodes and prefill chunks
    model's    tokens    y1 y2  y3  y4           y_i: the model's token after x p1 .. p(i-1)
    accept     p1 == y1, p2 == y2, p3 != y3  ──▶ keep p1 p2, then y3 (the model's own):
                                                 3 tokens this step, and p3's KV slot is dropped

Lossless. Every row is sampled by the usual sampler with its own inputs: the output so far plus
the proposals before it (penalties, min_tokens and logit_bias see exactly the tokens the sequence
would have at that position), and for a seeded request the seed key of that output position.
The proposals the rows' tokens agree with are kept, then the first row's token that disagrees
(or, all agreeing, the bonus row's). Each kept token goes through the stop checks one at a time,
so eos, stop strings and max_tokens end the sequence at the first token that triggers them and
nothing after it is emitted.

Greedy rows: a kept token is the model's argmax after exactly the tokens before it, so the output
is the one decoding without speculation gives, token for token, up to the numerics of computing a
position as one row of a chunk rather than alone (the same as chunked prefill vs. a single decode).

Sampled rows (temperature > 0): this "sample, then compare" is standard speculative rejection
sampling for a deterministic proposer. The draft distribution q is one-hot on the proposal d, so
the rule "accept d with probability min(1, p(d) / q(d)) = p(d); on rejection draw from
norm(max(0, p - q)) = p without d, renormalised" applies, with p the row's processed distribution
(bias, penalties, temperature, top-k/top-p/min-p). Drawing t ~ p and keeping d iff t == d does
exactly that: P(keep) = p(d), and given t != d, t is distributed as p without d, renormalised.
After k kept proposals the bonus row draws from the next position's p. Hence the distribution of
every output is the one without speculation. A seeded row draws its uniform from (seed, choice,
output position), the same key decoding without speculation uses for that position, over the
same prefix: a seeded request gives the same tokens with speculation on or off, up to rounding
(a position computed in a chunk moves its logits by ~1e-6, which moves a draw only where its
uniform falls that close to a CDF boundary: flat distributions, rarely), and always the same
tokens run after run. Unseeded rows
draw from the engine's generator, one uniform per row, i.i.d.: rows after a rejection are drawn
and dropped, which moves the generator but not any distribution.

KV: the step writes all 1 + k positions. Accepting j proposals keeps the first 1 + j
(num_computed_tokens), the rest are garbage that later tokens overwrite, and the tail blocks that
held only rejected positions go back to the pool (BlockManager.trim). Blocks are hashed for the
prefix cache only over computed tokens, so a rejected token never reaches the cache.

Who speculates: every request but those that opt out (`params.speculative` False, the API's
`speculative: false`). A structured output (params.guided) speculates too: its proposals are cut
to the prefix its grammar allows, and each of its rows is masked by the grammar's state after the
proposals before that row (the matcher is advanced through them, each row's mask filled, then
rolled back: engine.py), so a row samples exactly what decoding one token at a time would at that
position; the kept tokens then advance the matcher as usual. Proposals are
capped so a step never runs past max_tokens or the context window, and the scheduler drops them
rather than preempt anyone or exceed the step's token budget (scheduler.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from serving.engine.config import SpeculativeConfig
from serving.engine.params import SamplingParams
from serving.engine.request import Sequence
from serving.engine.spec_draft import DraftModelProposer
from serving.engine.spec_ngram import NgramProposer
from serving.engine.spec_proposer import Proposer, TokenProposer
from serving.engine.spec_suffix import SuffixProposer

if TYPE_CHECKING:
    from serving.engine.setup import EngineParts

__all__ = ["Proposer", "Speculator", "TokenProposer", "build_proposer", "num_accepted"]

logger = logging.getLogger(__name__)


def num_accepted(proposed: list[int], model_tokens: list[int]) -> int:
    """How many leading proposals the model agrees with: `model_tokens[i]` is the model's token
    after the proposals before i (len(proposed) + 1 of them, the last one follows them all)."""
    assert len(model_tokens) == len(proposed) + 1, (len(proposed), len(model_tokens))
    j = 0
    while j < len(proposed) and proposed[j] == model_tokens[j]:
        j += 1
    return j


def build_proposer(config: SpeculativeConfig, target: EngineParts | None = None) -> Proposer:
    """The proposer `config.method` names. `target`, what the engine is built from (setup.py), is
    what a draft model needs: the device and dtype it runs in, the block size of its KV cache, and
    the tokenizer it must share."""
    if config.method == "draft":
        assert target is not None, "method draft needs the engine's parts (setup.EngineParts)"
        return DraftModelProposer(config, target)
    if config.method == "suffix":
        return SuffixProposer(
            k=config.num_speculative_tokens,
            max_depth=config.suffix_max_depth,
            max_cached_requests=config.suffix_max_cached_requests,
            max_cached_tokens=config.suffix_max_cached_tokens,
            min_probability=config.suffix_min_probability,
            max_spec_factor=config.suffix_max_spec_factor,
            cache_prompts=config.suffix_cache_prompts,
        )
    assert config.method == "ngram", config.method
    return NgramProposer(min_n=config.prompt_lookup_min, max_n=config.prompt_lookup_max, k=config.num_speculative_tokens)


class Speculator:
    """Proposes tokens for the sequences that speculate, and counts how many were kept."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, target: EngineParts | None = None):
        self.config = config
        self.max_model_len = max_model_len
        self.proposer: Proposer = build_proposer(config, target)
        self.num_proposed_tokens = 0  # proposals verified by a forward pass
        self.num_accepted_tokens = 0  # of those, kept
        self.num_verified_seqs = 0  # sequence-steps that verified proposals

    @staticmethod
    def speculates(params: SamplingParams) -> bool:
        """Whether a request's sequences get proposals: all but those that opt out
        (params.speculative False)."""
        return params.speculative

    def propose(self, seqs: list[Sequence]) -> None:
        """Set each decoding sequence's `spec_token_ids` for its next step: at most what fits
        before max_tokens and the context window, with one token left for the model's own. A
        proposer that fails costs its proposals, never a request: the step decodes one token each."""
        max_ks = []
        for seq in seqs:
            assert seq.num_computed_tokens == seq.num_tokens - 1, f"{seq} is not decoding"
            max_ks.append(min(seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1)
        try:
            proposals = self.proposer.propose_batch(seqs, max_ks)
        except Exception:  # noqa: BLE001 - speculation is an optimisation
            logger.exception("proposer %s failed: %d sequences decode without proposals", self.proposer.name, len(seqs))
            proposals = [[] for _ in seqs]
        for seq, max_k, proposed in zip(seqs, max_ks, proposals):
            seq.spec_token_ids = list(proposed[: max(max_k, 0)])

    def release(self, seq: Sequence) -> None:
        """`seq` ended: its proposer drops (or keeps, to learn from) what it held for it."""
        self.proposer.release(seq)

    def stats(self) -> dict[str, int | str]:
        """Its EngineStats fields (spec_*)."""
        return {
            "spec_method": self.proposer.name,
            "spec_proposed_tokens": self.num_proposed_tokens,
            "spec_accepted_tokens": self.num_accepted_tokens,
            "spec_verify_steps": self.num_verified_seqs,
        }

    def verify(self, proposed: list[int], model_tokens: list[int]) -> int:
        """num_accepted, counted."""
        j = num_accepted(proposed, model_tokens)
        self.num_proposed_tokens += len(proposed)
        self.num_accepted_tokens += j
        self.num_verified_seqs += 1
        return j
