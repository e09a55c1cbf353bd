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

Adaptive (config `adaptive`, on by default). A proposal pays when the tokens it is expected to
add outweigh the rows it costs. Model a sequence's proposals as kept one after another with
probability p each (kept until the first miss), so the i-th proposal is kept with p^i; verifying it
costs one more row, c of the sequence's share of the step (step_costs.py: ~0.3 for a single
stream of SmolLM2 on this CPU, where a step streams the weights whatever its rows; ~1 once the
batch is compute-bound). The i-th proposal pays when p^i >= c, so each step a sequence is offered

    k = the largest k <= num_speculative_tokens with p^k >= c      (p = 1: all; c = 0: all)

    p   estimate of the sequence's per-token acceptance, an EMA over its verify steps of
        accepted / trials (trials = accepted, + 1 if a proposal was rejected: the kept-until-a-miss
        estimate), with weight `acceptance_ema` for the newest step; before its first verify
        p = 1 (try the most: an input-grounded request pays off from the start).
    c   `verify_row_cost`, or measured: row_cost(the step's rows before proposals).

k = 0 starts a back-off: the sequence is offered nothing for `backoff_steps` steps, then exactly
one token (a probe) whose verdict updates p. A step where the proposer finds no match teaches
nothing and changes nothing. For example (c = 0.15, num_speculative_tokens 4, ema 0.3, backoff 2),
a sequence whose first guesses miss and that later starts copying its prompt:

    step                 1    2   3   4    5   6   7    8   9   10   11   12   13
    k offered            4    0   0   1    0   0   1    0   0   1    2    2    4
    verdict (kept/k)     0/4  -   -   0/1  -   -   0/1  -   -   1/1  1/2  2/2  4/4
    p after the step     0    0   0   0    0   0   0    0   0   .39  .45  .69  .86

The rule weighs the i-th proposal alone (kept-token gain minus row cost, not tokens per second),
which is simple and errs little where c is small; the back-off bounds what a sequence that never
matches costs: one verify row every backoff_steps + 1 steps, ~2% of a step at c = 0.15 and the
default backoff_steps 8.

Compute-bound off: the step's decode rows (every running sequence's one, plus the proposals) may
not pass `max_batch_rows`, by default the measured knee (step_costs.py): past it a verify row
costs nearly a sure token's compute, so it is better spent on other sequences. Proposals are kept
for the sequences with the highest p first and cut where the rows run out; at or past the knee
without proposals, the proposer is not even asked. The knee is measured as a number of sequences
each verifying k proposals and applied here to rows (sequences + proposals): the cautious reading,
as a step's cost grows with both.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from serving.engine.config import SpeculativeConfig
from serving.engine.params import SamplingParams
from serving.engine.request import Sequence
from serving.engine.spec.draft import DraftModelProposer
from serving.engine.spec.ngram import NgramProposer
from serving.engine.spec.proposer import Proposer, TokenProposer
from serving.engine.spec.suffix import SuffixProposer
from serving.engine.step_costs import StepCosts

if TYPE_CHECKING:
    from serving.engine.setup import EngineParts

__all__ = ["Proposer", "Speculator", "TokenProposer", "build_proposer", "next_k", "num_accepted"]

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


@dataclass
class _Estimate:
    """A sequence's acceptance so far (module docstring, Adaptive)."""

    accepted: float = 0.0  # EMA of kept proposals per verify step
    trials: float = 0.0  # EMA of proposals judged per verify step (kept, + 1 for the miss)
    backoff: int = 0  # steps left proposing nothing
    probe: bool = False  # the back-off is over: offer one token

    @property
    def acceptance(self) -> float:
        return self.accepted / self.trials if self.trials else 1.0


def next_k(acceptance: float, row_cost: float, max_k: int) -> int:
    """The largest k <= max_k with acceptance^k >= row_cost (module docstring, Adaptive)."""
    if row_cost <= 0.0 or acceptance >= 1.0:
        return max_k
    if acceptance <= 0.0 or acceptance < row_cost:
        return 0
    return min(max_k, int(math.log(row_cost) / math.log(acceptance) + 1e-9))


class Speculator:
    """Proposes tokens for the sequences that speculate, and counts how many were kept. With
    `adaptive`, how many each gets (module docstring) from `step_costs`, called once here at
    construction (the engine's start-up, ~1-2 s on SmolLM2) when a figure is not pinned in the
    config (verify_row_cost or max_batch_rows null)."""

    def __init__(
        self, config: SpeculativeConfig, max_model_len: int, step_costs: Callable[[], StepCosts] | None = None,
        target: EngineParts | None = None,
    ):
        self.config = config
        self.max_model_len = max_model_len
        self.proposer: Proposer = build_proposer(config, target)
        self.num_proposed_tokens = 0  # proposals verified by a forward pass
        self.num_accepted_tokens = 0  # of those, kept
        self.num_verified_seqs = 0  # sequence-steps that verified proposals
        self.num_knee_dropped_tokens = 0  # proposals dropped for the step's rows passing max_batch_rows
        self._estimates: dict[Sequence, _Estimate] = {}
        self.step_costs: StepCosts | None = None
        needs_costs = config.adaptive and (config.verify_row_cost is None or config.max_batch_rows is None)
        if needs_costs:
            assert step_costs is not None, "adaptive speculation without verify_row_cost/max_batch_rows needs step_costs"
            self.step_costs = step_costs()
        self.max_batch_rows = (
            config.max_batch_rows if config.max_batch_rows is not None
            else self.step_costs.knee_rows if self.step_costs is not None else None
        )

    @staticmethod
    def speculates(params: SamplingParams) -> bool:
        """Whether a request's sequences get proposals: all but those that opt out
        (params.speculative False)."""
        return params.speculative

    def row_cost(self, num_rows: int) -> float:
        """c of the module docstring at `num_rows` rows in the step."""
        if self.config.verify_row_cost is not None:
            return self.config.verify_row_cost
        return self.step_costs.row_cost(num_rows)

    def propose(self, seqs: list[Sequence], num_other_rows: int = 0) -> None:
        """Set each decoding sequence's `spec_token_ids` for its next step: at most what fits
        before max_tokens and the context window, with one token left for the model's own, and
        with `adaptive` what its estimate and the step's rows allow (`num_other_rows`: the next
        step's rows of sequences not in `seqs`). A proposer that fails costs its proposals, never
        a request: the step decodes one token each."""
        max_ks = []
        for seq in seqs:
            assert seq.num_computed_tokens == seq.num_tokens - 1, f"{seq} is not decoding"
            max_ks.append(min(seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1)
        num_rows = num_other_rows + len(seqs)
        if self.config.adaptive:
            if self.max_batch_rows is not None and num_rows >= self.max_batch_rows:
                max_ks = [0] * len(seqs)  # compute-bound: no step for the proposer either
            else:
                row_cost = self.row_cost(num_rows)
                max_ks = [min(max_k, self._offer(seq, row_cost)) for seq, max_k in zip(seqs, max_ks)]
        if not any(max_k > 0 for max_k in max_ks):
            for seq in seqs:
                seq.spec_token_ids = []
            return
        try:
            proposals = self.proposer.propose_batch(seqs, max_ks)
        except Exception:  # noqa: BLE001 - speculation is an optimisation
            logger.exception("proposer %s failed: %d sequences decode without proposals", self.proposer.name, len(seqs))
            proposals = [[] for _ in seqs]
        for seq, max_k, proposed in zip(seqs, max_ks, proposals):
            seq.spec_token_ids = list(proposed[: max(max_k, 0)])
        if self.config.adaptive and self.max_batch_rows is not None:
            self._fit_rows(seqs, self.max_batch_rows - num_rows)

    def _offer(self, seq: Sequence, row_cost: float) -> int:
        """How many proposals `seq` may get this step (module docstring, Adaptive); counts its back-off down."""
        est = self._estimates.get(seq)
        if est is None:
            est = self._estimates[seq] = _Estimate()
        if est.backoff > 0:
            est.backoff -= 1
            est.probe = est.backoff == 0
            return 0
        if est.probe:
            return 1
        k = next_k(est.acceptance, row_cost, self.config.num_speculative_tokens)
        if k == 0:
            est.backoff = self.config.backoff_steps - 1  # this step is the first of the back-off
            est.probe = est.backoff == 0
        return k

    def _fit_rows(self, seqs: list[Sequence], free_rows: int) -> None:
        """Keep proposals within `free_rows`, for the sequences with the best estimates first."""
        by_estimate = sorted(
            (seq for seq in seqs if seq.spec_token_ids),
            key=lambda seq: -self._estimates[seq].acceptance if seq in self._estimates else -1.0,
        )
        for seq in by_estimate:
            keep = max(0, min(len(seq.spec_token_ids), free_rows))
            self.num_knee_dropped_tokens += len(seq.spec_token_ids) - keep
            del seq.spec_token_ids[keep:]
            free_rows -= keep

    def release(self, seq: Sequence) -> None:
        """`seq` ended: its proposer drops (or keeps, to learn from) what it held for it."""
        self._estimates.pop(seq, None)
        self.proposer.release(seq)

    def stats(self) -> dict[str, int | str]:
        """Its EngineStats fields (spec_*)."""
        return {
            "spec_method": self.proposer.name,
            "spec_proposed_tokens": self.num_proposed_tokens,
            "spec_accepted_tokens": self.num_accepted_tokens,
            "spec_verify_steps": self.num_verified_seqs,
            "spec_knee_dropped_tokens": self.num_knee_dropped_tokens,
            "spec_max_batch_rows": self.max_batch_rows or 0,
            "spec_single_row_cost": self.step_costs.single_row_cost if self.step_costs is not None else 0.0,
        }

    def verify(self, seq: Sequence, proposed: list[int], model_tokens: list[int]) -> int:
        """num_accepted, counted, and with `adaptive` learnt into `seq`'s estimate."""
        j = num_accepted(proposed, model_tokens)
        self.num_proposed_tokens += len(proposed)
        self.num_accepted_tokens += j
        self.num_verified_seqs += 1
        if self.config.adaptive:
            self.observe(seq, j, len(proposed))
        return j

    def observe(self, seq: Sequence, num_accepted_tokens: int, num_proposed_tokens: int) -> None:
        """Fold one verify step's verdict into `seq`'s acceptance estimate."""
        assert 0 <= num_accepted_tokens <= num_proposed_tokens > 0, (num_accepted_tokens, num_proposed_tokens)
        est = self._estimates.get(seq)
        if est is None:
            est = self._estimates[seq] = _Estimate()
        alpha = self.config.acceptance_ema
        trials = num_accepted_tokens + (num_accepted_tokens < num_proposed_tokens)
        est.accepted = (1 - alpha) * est.accepted + alpha * num_accepted_tokens
        est.trials = (1 - alpha) * est.trials + alpha * trials
        est.probe = False
