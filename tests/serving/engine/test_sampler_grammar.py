"""Step 4b of the sampler: a row's grammar bitmask, applied inside the batch (exact tokens).

The constraints here are stand-ins that allow a fixed set of tokens: the sampler's side is only
"fill your row of the bitmask", and what it does with the bits is what is tested.
"""

from __future__ import annotations

import math

import pytest
import torch

from serving.engine.params import SamplingParams
from serving.engine.sampling.ops import apply_token_bitmask
from serving.engine.sampling.sampler import Sampler, SamplingRow

VOCAB = 100


class Allow:
    """A constraint that allows exactly `token_ids`."""

    def __init__(self, *token_ids: int):
        self.token_ids = token_ids
        self.num_fills = 0

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self.num_fills += 1
        bitmask[index] = 0
        for t in self.token_ids:
            word = int(bitmask[index, t // 32]) | (1 << (t % 32))
            bitmask[index, t // 32] = word - (1 << 32) if word >= 1 << 31 else word  # int32 wraps


def row(grammar=None, seed_key=None, **params) -> SamplingRow:
    return SamplingRow(params=SamplingParams(**params), prompt_token_ids=[1], output_token_ids=[], grammar=grammar, seed_key=seed_key)


def logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3.0


def test_apply_token_bitmask_keeps_exactly_the_set_bits_of_each_listed_row():
    x = logits(3)
    original = x.clone()
    bitmask = torch.zeros((2, 4), dtype=torch.int32)
    Allow(0, 31, 32, 99).fill_bitmask(bitmask, 0)  # word 0 bits 0 and 31 (the sign bit), word 1 bit 0, word 3 bit 3
    Allow(50).fill_bitmask(bitmask, 1)
    assert bitmask[0].tolist() == [1 - 2**31, 1, 0, 8]
    apply_token_bitmask(x, bitmask, [0, 2])
    kept = [[t for t in range(VOCAB) if x[r, t] != -math.inf] for r in range(3)]
    assert kept == [[0, 31, 32, 99], list(range(VOCAB)), [50]]
    assert torch.equal(x[0, [0, 31, 32, 99]], original[0, [0, 31, 32, 99]])
    assert torch.equal(x[1], original[1])


def test_a_greedy_constrained_row_takes_the_best_allowed_token():
    x = logits(1)
    allowed = (3, 40, 77)
    best = max(allowed, key=lambda t: x[0, t].item())
    assert x[0].argmax().item() not in allowed  # the mask decides
    out = Sampler(VOCAB, seed=0)(x, [row(Allow(*allowed), temperature=0)])
    assert out.token_ids == [best]


@pytest.mark.parametrize("params", [
    {"temperature": 1.0}, {"temperature": 1.5, "top_p": 0.9}, {"temperature": 0.7, "top_k": 5}, {"temperature": 1.0, "min_p": 0.2},
])
def test_sampled_constrained_rows_only_ever_draw_allowed_tokens(params):
    allowed = {5, 6, 64, 95}
    sampler = Sampler(VOCAB, seed=1)
    drawn = set()
    for step in range(200):
        x = logits(4, seed=step)
        rows = [row(Allow(*allowed), seed_key=(step, i, 0), **params) for i in range(4)]
        drawn |= set(sampler(x, rows).token_ids)
    assert drawn <= allowed and len(drawn) > 1


def test_free_rows_beside_constrained_ones_are_exactly_as_alone():
    """Greedy free rows and seeded sampled free rows give the same token in a mixed batch as alone."""
    x = logits(6, seed=3)
    free = {1: row(temperature=0), 3: row(temperature=1.0, seed_key=(7, 0, 0)), 5: row(temperature=0.8, top_p=0.9, seed_key=(8, 0, 0))}
    constrained = {0: row(Allow(2, 9), temperature=0), 2: row(Allow(11), temperature=1.0, seed_key=(9, 0, 0)), 4: row(Allow(12, 13), temperature=0)}
    rows = [{**free, **constrained}[i] for i in range(6)]
    mixed = Sampler(VOCAB, seed=0)(x, rows).token_ids
    for i, r in free.items():
        assert mixed[i] == Sampler(VOCAB, seed=0)(x[i : i + 1], [r]).token_ids[0]
    assert mixed[0] in (2, 9) and mixed[2] == 11 and mixed[4] in (12, 13)


def test_a_free_greedy_batch_takes_the_argmax_path_and_fills_nothing():
    constraint = Allow(1)
    x = logits(2)
    out = Sampler(VOCAB, seed=0)(x, [row(temperature=0), row(temperature=0)])
    assert out.token_ids == x.argmax(dim=-1).tolist() and constraint.num_fills == 0


def test_logprobs_of_a_constrained_row_are_the_models_not_the_masked_ones():
    x = logits(1, seed=5)
    out = Sampler(VOCAB, seed=0)(x, [row(Allow(7, 8), temperature=0, logprobs=2)])
    raw = torch.log_softmax(x[0], dim=-1)
    lp = out.logprobs[0]
    assert lp.token_id in (7, 8)
    assert lp.logprob == pytest.approx(raw[lp.token_id].item(), abs=1e-6)
    assert [t for t, _ in lp.top] == raw.topk(2).indices.tolist()


def test_a_row_whose_grammar_fails_fails_alone():
    class Broken:
        def fill_bitmask(self, bitmask, index):
            raise RuntimeError("matcher state lost")

    x = logits(3)
    results, failures = Sampler(VOCAB, seed=0).sample_each(x, [row(temperature=0), row(Broken(), temperature=0), row(Allow(4), temperature=0)])
    assert [f.row for f in failures] == [1] and str(failures[0].error) == "matcher state lost"
    assert results[0][0] == x[0].argmax().item() and results[1] == (None, None) and results[2][0] == 4


def test_a_row_whose_grammar_allows_nothing_fails_alone():
    x = logits(2)
    results, failures = Sampler(VOCAB, seed=0).sample_each(x, [row(Allow(), temperature=1.0), row(temperature=0)])
    assert [f.row for f in failures] == [0] and str(failures[0].error) == "the grammar of row 0 allows no token"
    assert results[1][0] == x[1].argmax().item()


def test_plain_greedy_rows_split_off_change_no_other_rows_token():
    """Plain greedy rows take the argmax of the caller's tensor apart from the rest of the batch;
    they draw no uniform, so unseeded sampled rows get the same draws as in a batch without them."""
    x = logits(6, seed=11)
    others = [row(temperature=1.0), row(Allow(3, 4, 5), temperature=0.9), row(temperature=0, logprobs=1), row(temperature=1.2)]
    mixed = [row(temperature=0), others[0], others[1], row(temperature=0), others[2], others[3]]
    alone = Sampler(VOCAB, seed=4)(x[[1, 2, 4, 5]], others)
    together = Sampler(VOCAB, seed=4)(x, mixed)
    assert [together.token_ids[i] for i in (1, 2, 4, 5)] == alone.token_ids
    assert [together.token_ids[i] for i in (0, 3)] == x[[0, 3]].argmax(dim=-1).tolist()
    assert together.logprobs[4] == alone.logprobs[2] and together.logprobs[0] is None
