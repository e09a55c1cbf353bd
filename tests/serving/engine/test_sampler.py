"""Sampler: greedy, bias, min_tokens, penalties, filters, seeded draws, statistics, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from serving.engine.params import SamplingParams
from serving.engine.sampling.sampler import (
    LogitBias,
    Sampler,
    SamplingRow,
    _inverse_cdf,
    apply_penalties,
    seed_from_key,
    top_k_top_p_min_p,
)


def make_row(
    prompt: tuple[int, ...] = (),
    output: tuple[int, ...] = (),
    eos: tuple[int, ...] = (),
    seed_key: tuple[int, int, int] | None = None,
    **params: object,
) -> SamplingRow:
    sampling = SamplingParams(**params)
    return SamplingRow(
        params=sampling,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        eos_token_ids=eos,
        seed_key=seed_key,
        logit_bias=LogitBias.of(sampling.logit_bias),
    )


def random_logits(num_rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=g) * 3.0


def inverse_cdf(probs: torch.Tensor, us: list[float]) -> list[int]:
    """The sampler's inverse-CDF search for one probability row and several uniforms."""
    batch = probs.expand(len(us), -1).contiguous()
    return _inverse_cdf(batch, torch.tensor(us, dtype=torch.float64)).tolist()


# --- greedy ---------------------------------------------------------------------------------


def test_greedy_is_argmax_with_ties_to_lowest_id() -> None:
    logits = torch.tensor(
        [
            [0.0, 1.0, 5.0, 2.0, -1.0],
            [3.0, 1.0, 4.0, 1.0, 4.0],  # tie between 2 and 4
            [-9.0, -8.0, -7.0, -6.0, -5.0],
        ]
    )
    before = logits.clone()
    out = Sampler(5, seed=0)(logits, [make_row(temperature=0.0) for _ in range(3)])
    assert out.token_ids == [2, 2, 4]
    assert out.logprobs == [None, None, None]
    assert torch.equal(logits, before)


def test_greedy_accepts_bfloat16() -> None:
    logits = torch.tensor([[0.5, 2.0, 1.0], [3.0, -1.0, 3.5]], dtype=torch.bfloat16)
    rows = [make_row(temperature=0.0), make_row(temperature=0.0, presence_penalty=0.1)]
    assert Sampler(3, seed=0)(logits, rows).token_ids == [1, 2]


def test_temperature_below_epsilon_is_greedy() -> None:
    logits = random_logits(8, 300, seed=8)
    rows = [make_row(temperature=1e-7) for _ in range(8)]
    assert Sampler(300, seed=0)(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_1_equals_greedy() -> None:
    logits = random_logits(32, 1000, seed=1)
    sampler = Sampler(1000, seed=0)
    greedy = sampler(logits, [make_row(temperature=0.0) for _ in range(32)]).token_ids
    top1 = sampler(logits, [make_row(temperature=0.7, top_k=1) for _ in range(32)]).token_ids
    assert top1 == greedy == logits.argmax(dim=-1).tolist()


def test_empty_batch() -> None:
    out = Sampler(4, seed=0)(torch.empty(0, 4), [])
    assert out.token_ids == [] and out.logprobs == []


# --- logit_bias and min_tokens -------------------------------------------------------------


def test_logit_bias_moves_the_argmax_exactly() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 4)
    rows = [
        make_row(temperature=0.0, logit_bias={0: 3.5}),  # 3.5 > 3.0
        make_row(temperature=0.0, logit_bias={0: 2.5}),  # 2.5 < 3.0
        make_row(temperature=0.0, logit_bias={1: 2.0}),  # 3.0 == 3.0: tie -> lower id
        make_row(temperature=0.0, logit_bias={3: -100.0, 2: -0.5}),  # 1.5 > 1.0
    ]
    assert Sampler(4, seed=0)(logits, rows).token_ids == [0, 3, 1, 2]


class _Untouchable(dict):
    """A logit_bias dict that fails if a step reads its entries (it may only test truthy)."""

    def _read(self, *args):
        raise AssertionError("a step read the request's logit_bias dict")

    __iter__ = keys = values = items = __getitem__ = get = _read


def test_a_step_applies_logit_bias_from_the_rows_tensors_not_its_dict() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 3)
    rows = [
        make_row(temperature=0.0, logit_bias={0: 3.5, 2: -5.0}),
        make_row(temperature=0.0),
        make_row(temperature=0.0, logit_bias={1: 2.5}),
    ]
    for row in rows:
        if row.params.logit_bias:
            row.params.logit_bias = _Untouchable(row.params.logit_bias)
    assert rows[0].logit_bias.token_ids.tolist() == [0, 2] and rows[0].logit_bias.values.tolist() == [3.5, -5.0]

    assert Sampler(4, seed=0)(logits, rows).token_ids == [0, 3, 1]
    assert logits.tolist() == [[0.0, 1.0, 2.0, 3.0]] * 3  # the caller's logits are not touched


def test_a_row_without_its_requests_logit_bias_tensors_is_a_bug() -> None:
    row = make_row(temperature=0.0, logit_bias={0: 1.0})
    row.logit_bias = None
    with pytest.raises(AssertionError, match="a row's logit_bias must be LogitBias.of"):
        Sampler(4, seed=0)(torch.zeros(1, 4), [row])


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_ids_until_reached(ignore_eos: bool) -> None:
    # eos 3 is the argmax, stop id 2 second, token 1 third.
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 4)
    common = {"temperature": 0.0, "stop_token_ids": [2], "ignore_eos": ignore_eos}
    rows = [
        make_row(output=(), eos=(3,), min_tokens=2, **common),
        make_row(output=(5,), eos=(3,), min_tokens=2, **common),
        make_row(output=(5, 5), eos=(3,), min_tokens=2, **common),
        make_row(output=(), eos=(3,), min_tokens=0, **common),
    ]
    assert Sampler(4, seed=0)(logits, rows).token_ids == [1, 1, 3, 3]


# --- penalties -----------------------------------------------------------------------------


def test_apply_penalties_exact_values() -> None:
    logits = torch.tensor(
        [
            [2.0, -1.0, 0.5, -0.5, 1.0, 0.0],
            [2.0, -1.0, 0.5, -0.5, 1.0, 0.0],
            [2.0, -1.0, 0.5, -0.5, 1.0, 0.0],
        ]
    )
    apply_penalties(
        logits,
        prompt_token_ids=[[0, 1], [1, 4], [0, 1]],
        output_token_ids=[[2, 2, 3, 0], [], [5]],
        repetition_penalties=[2.0, 4.0, 1.0],
        presence_penalties=[0.5, 0.5, 0.0],
        frequency_penalties=[0.25, 0.0, 0.0],
    )
    # Row 0: seen {0,1,2,3}: 2/2=1, -1*2=-2, 0.5/2=0.25, -0.5*2=-1; then presence+frequency on
    # output counts {2:2, 3:1, 0:1}: 0 -> 1-0.5-0.25, 2 -> 0.25-0.5-0.5, 3 -> -1-0.5-0.25.
    # Row 1: repetition only on prompt tokens 1 and 4; presence has no output to act on.
    # Row 2: nothing to do.
    expected = torch.tensor(
        [
            [0.25, -2.0, -0.75, -1.75, 1.0, 0.0],
            [2.0, -4.0, 0.5, -0.5, 0.25, 0.0],
            [2.0, -1.0, 0.5, -0.5, 1.0, 0.0],
        ]
    )
    assert torch.equal(logits, expected)


@pytest.mark.parametrize(
    ("num_repeats", "expected"),
    [(3, 0), (4, 0), (5, 1)],  # 3 - 0.25 n vs 2.0: 2.25 > 2, 2.0 == 2 (tie -> 0), 1.75 < 2
)
def test_frequency_penalty_flips_greedy_choice_exactly(num_repeats: int, expected: int) -> None:
    logits = torch.tensor([[3.0, 2.0]])
    row = make_row(output=(0,) * num_repeats, temperature=0.0, frequency_penalty=0.25)
    assert Sampler(2, seed=0)(logits, [row]).token_ids == [expected]


def test_repetition_penalty_covers_prompt_presence_only_output() -> None:
    logits = torch.tensor([[3.0, 2.0]] * 2)
    rows = [
        make_row(prompt=(0,), temperature=0.0, repetition_penalty=2.0),  # 1.5 < 2
        make_row(prompt=(0,), temperature=0.0, presence_penalty=2.0),  # prompt: no presence
    ]
    assert Sampler(2, seed=0)(logits, rows).token_ids == [1, 0]


def test_a_repetition_penalty_that_rounds_to_zero_keeps_every_logit_ordered_and_masked_ones_masked() -> None:
    # float32(4.7e-76) is 0: a positive repeated logit / 0 would be +inf and a masked one * 0 NaN
    grid = torch.tensor([[2.0, -1.0, float("-inf"), 0.5]])
    apply_penalties(grid, [[0, 1, 2]], [[]], [4.7e-76], [0.0], [0.0])
    assert grid.tolist() == [[torch.finfo(torch.float32).max, -0.0, float("-inf"), 0.5]]
    rows = [make_row(prompt=(0, 1, 2), temperature=1.0, repetition_penalty=4.7e-76, seed_key=(1, 0, 0))]
    assert Sampler(4, seed=0)(torch.tensor([[2.0, -1.0, -3.0, 0.5]]), rows).token_ids == [0]


def test_penalties_touch_only_their_rows() -> None:
    logits = torch.tensor([[3.0, 2.0]] * 3)
    rows = [
        make_row(output=(0,) * 5, temperature=0.0),
        make_row(output=(0,) * 5, temperature=0.0, frequency_penalty=0.25),  # 1.75 < 2
        make_row(output=(0,) * 5, temperature=0.0),
    ]
    assert Sampler(2, seed=0)(logits, rows).token_ids == [0, 1, 0]

    grid = torch.zeros(3, 4)
    apply_penalties(grid, [[]], [[1, 1, 3]], [1.0], [0.5], [1.0], row_ids=[2])
    assert grid.tolist() == [[0.0] * 4, [0.0] * 4, [0.0, -2.5, 0.0, -1.5]]


def test_caller_logits_are_left_untouched() -> None:
    logits = random_logits(4, 50, seed=9)
    before = logits.clone()
    rows = [
        make_row(output=(1, 2), repetition_penalty=1.5, presence_penalty=1.0, top_p=0.9),
        make_row(temperature=0.5, logit_bias={3: 5.0}, min_tokens=3, eos=(0,)),
        make_row(),
        make_row(temperature=0.0, logprobs=2),
    ]
    Sampler(50, seed=0)(logits, rows)
    assert torch.equal(logits, before)


def test_bias_is_applied_before_penalties() -> None:
    # Token 0: (1 + 1) / 2 = 1.0 < 1.25 when bias comes first; 1 / 2 + 1 = 1.5 if it did not.
    logits = torch.tensor([[1.0, 1.25]])
    row = make_row(output=(0,), temperature=0.0, logit_bias={0: 1.0}, repetition_penalty=2.0)
    assert Sampler(2, seed=0)(logits, [row]).token_ids == [1]


# --- top_k / top_p / min_p -----------------------------------------------------------------

# Token:        0     1     2     3     4
_PROBS = [0.05, 0.40, 0.10, 0.30, 0.15]  # sorted: 1 (.40), 3 (.30), 4 (.15), 2 (.10), 0 (.05)


@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p", "kept"),
    [
        (0, 1.0, 0.0, {0, 1, 2, 3, 4}),
        (2, 1.0, 0.0, {1, 3}),
        (5, 1.0, 0.0, {0, 1, 2, 3, 4}),
        (0, 0.75, 0.0, {1, 3, 4}),  # mass before token 4 is 0.70 < 0.75, before 2 is 0.85
        (0, 0.65, 0.0, {1, 3}),  # mass before 4 is 0.70 >= 0.65
        (0, 0.3, 0.0, {1}),  # the top token always stays
        (0, 1.0, 0.3, {1, 3, 4}),  # threshold 0.12
        (0, 1.0, 0.5, {1, 3}),  # threshold 0.20
        # top_p on the renormalised top-3 (.4, .3, .15)/.85: mass before 4 is .824 >= .8.
        # Without renormalising it would be 0.70 and token 4 would stay.
        (3, 0.8, 0.0, {1, 3}),
        (4, 0.95, 0.3, {1, 3, 4}),
    ],
)
def test_filters_keep_exactly_the_expected_tokens(
    top_k: int, top_p: float, min_p: float, kept: set[int]
) -> None:
    # Filter a batch with a disabled row next to it, to check rows do not leak into each other.
    logits = torch.tensor([_PROBS, _PROBS]).log()
    probs = top_k_top_p_min_p(logits, [top_k, 0], [top_p, 1.0], [min_p, 0.0])
    assert set(torch.nonzero(probs[0]).flatten().tolist()) == kept
    assert torch.all(probs[1] > 0)


def _reference_kept(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The filters in float64 numpy, over a stable sort (ties: lower id first)."""
    logits = row.double().numpy()
    order = np.argsort(-logits, kind="stable")
    if top_k > 0:
        order = order[:top_k]
    weights = np.exp(logits[order] - logits[order[0]])
    probs = weights / weights.sum()
    mass_before = np.cumsum(probs) - probs
    keep = (mass_before < top_p) & (probs >= min_p * probs[0])
    keep[0] = True
    return set(order[keep].tolist())


@pytest.mark.parametrize(
    ("scale", "top_k", "top_p", "min_p", "num_kept"),
    [
        (1.5, 0, 0.9, 0.0, (5, 26)),  # nucleus within the first 256 candidates
        (0.8, 0, 0.9, 0.0, (583, 794)),  # needs the 4096 candidates
        (0.5, 0, 0.9, 0.01, (200, 2128)),  # same, with min_p cutting into it
        (1.5, 0, 0.5, 0.05, (1, 2)),
        (1.0, 40, 0.95, 0.0, (20, 40)),  # top_p on the renormalised top 40
        (1.0, 300, 1.0, 0.0, (300, 300)),
        (1.0, 0, 1.0, 0.02, (1, 5000)),  # min_p only: no ordering at all
    ],
)
def test_filters_match_reference_on_a_wide_vocab(
    scale: float, top_k: int, top_p: float, min_p: float, num_kept: tuple[int, int]
) -> None:
    logits = random_logits(3, 5000, seed=6) * scale
    probs = top_k_top_p_min_p(logits, [top_k] * 3, [top_p] * 3, [min_p] * 3)
    for r in range(3):
        expected = _reference_kept(logits[r], top_k, top_p, min_p)
        assert num_kept[0] <= len(expected) <= num_kept[1]  # the path the case is meant for
        assert set(torch.nonzero(probs[r]).flatten().tolist()) == expected


def test_top_p_falls_back_to_a_full_sort_when_candidates_hold_too_little() -> None:
    # 4500 tokens at 0.75/4500 each, then 1500 tied tokens at 0.25/1500 each: the top 4096
    # hold 0.68 < top_p, so the row is sorted in full. The mass before low token m is
    # 0.75 + m/6000, below 0.8 + half a low token's share for m <= 300; ties keep id order.
    logits = torch.tensor([[math.log(0.75 / 4500)] * 4500 + [math.log(0.25 / 1500)] * 1500])
    probs = top_k_top_p_min_p(logits, [0], [0.8 + 0.5 / 6000], [0.0])
    assert torch.nonzero(probs[0]).flatten().tolist() == list(range(4801))


def test_inverse_cdf_is_exact_at_boundaries_and_skips_zeros() -> None:
    probs = torch.zeros(1, 600)  # 10 blocks of 64, the last one padded
    probs[0, 1], probs[0, 300], probs[0, 599] = 0.25, 0.5, 0.25
    us = [0.0, 0.2499, 0.25, 0.5, 0.75, 1.0 - 2**-53]
    assert inverse_cdf(probs, us) == [1, 1, 300, 300, 599, 599]


def test_inverse_cdf_resolves_single_tail_tokens() -> None:
    # Token 0 at 0.5 and 1323 tokens at 2**-30. A float32 running sum moves in steps of
    # 2**-24 = 64 tail tokens past 0.5, so a one-level float32 search can miss by up to 64
    # columns; the two-level search is off by at most one token (token 0's block sum rounds
    # to float32 by one tail token's share).
    width, eps = 1324, 2.0**-30
    probs = torch.full((1, width), eps)
    probs[0, 0] = 0.5
    # 1 - 2.4e-6 lands on a tail token in token 0's own block (exact column ~32).
    us = [0.3, 1 - 2.4e-6, 1 - 2e-6, 1 - 1e-6, 1 - 5e-7, 1 - 1e-7, 1 - 3e-9]
    total = 0.5 + (width - 1) * eps
    exact = [0 if u * total < 0.5 else int((u * total - 0.5) / eps) + 1 for u in us]
    columns = inverse_cdf(probs, us)
    assert columns[0] == 0
    for got, want in zip(columns[1:], exact[1:]):
        assert abs(got - want) <= 1, (got, want)


def test_sampler_never_draws_filtered_tokens() -> None:
    logits = torch.tensor([_PROBS] * 512).log()
    rows = [make_row(top_k=3, top_p=0.8) for _ in range(512)]
    assert set(Sampler(5, seed=3)(logits, rows).token_ids) == {1, 3}


# --- seeded draws --------------------------------------------------------------------------


def test_seed_from_key_is_stable_across_processes() -> None:
    # Pinned values: a change here breaks reproducibility of every seeded request.
    assert seed_from_key((1, 0, 0)) == 8100385689227368309
    assert seed_from_key((0, 0, 0)) == 8709664987758080849
    assert seed_from_key((-(2**63), 127, 10**6)) < 2**63


def test_seeded_row_same_alone_and_in_a_mixed_batch() -> None:
    vocab_size = 1000
    target = random_logits(1, vocab_size, seed=10)
    for position in range(8):
        for params in ({"temperature": 1.0}, {"temperature": 0.9, "top_p": 0.95, "top_k": 50}):
            row = make_row(seed_key=(42, 1, position), seed=42, **params)
            alone = Sampler(vocab_size, seed=0)(target, [row]).token_ids[0]

            others = [
                make_row(temperature=1.0),
                make_row(temperature=0.0),
                make_row(seed_key=(7, 0, position), seed=7, top_p=0.5),
                make_row(temperature=0.7, top_k=20, output=(1, 2, 3), frequency_penalty=0.5),
                make_row(seed_key=(42, 0, position), seed=42, logprobs=3),
                make_row(min_p=0.1, logit_bias={5: 2.0}),
                make_row(prompt=(4, 5), repetition_penalty=1.3),
                make_row(temperature=1.5, top_p=0.9),
            ] * 2
            batch_rows = others[:9] + [row] + others[9:]
            batch = torch.cat(
                [random_logits(9, vocab_size, 11), target, random_logits(7, vocab_size, 12)]
            )
            in_batch = Sampler(vocab_size, seed=position)(batch, batch_rows).token_ids[9]
            assert in_batch == alone


def test_seeded_row_same_alone_and_in_a_batch_with_bfloat16_ties() -> None:
    # bf16 logits repeat values often, so candidate order among ties matters.
    vocab_size = 2000
    batch = random_logits(12, vocab_size, seed=13).to(torch.bfloat16)
    assert batch[5].unique().numel() <= vocab_size // 2
    for position in range(6):
        row = make_row(seed_key=(3, 0, position), seed=3, top_k=50, top_p=0.9)
        alone = Sampler(vocab_size, seed=0)(batch[5:6], [row]).token_ids[0]
        others = [
            make_row(top_k=50),
            make_row(top_k=64, top_p=0.8),
            make_row(top_p=0.9, seed_key=(3, 1, position), seed=3),
            make_row(temperature=0.0, logprobs=1),
        ]
        batch_rows = (others * 3)[:5] + [row] + (others * 3)[5:11]
        assert Sampler(vocab_size, seed=1)(batch, batch_rows).token_ids[5] == alone


def test_seeded_rows_differ_across_positions() -> None:
    # Flat distribution over 1000 tokens: 200 positions give ~181 distinct tokens on average
    # (1000 * (1 - 0.999**200)); > 150 would fail only if positions shared draws.
    vocab_size = 1000
    rows = [make_row(seed_key=(5, 0, pos), seed=5) for pos in range(200)]
    tokens = Sampler(vocab_size, seed=0)(torch.zeros(200, vocab_size), rows).token_ids
    assert len(set(tokens)) > 150
    # Same key twice in one batch: same token.
    twice = [make_row(seed_key=(5, 0, 17), seed=5)] * 2
    again = Sampler(vocab_size, seed=1)(torch.zeros(2, vocab_size), twice).token_ids
    assert again == [tokens[17]] * 2


def test_unseeded_rows_reproducible_with_sampler_seed() -> None:
    logits = random_logits(16, 100, seed=2)
    rows = [make_row() for _ in range(16)]
    first = [Sampler(100, seed=9)(logits, rows).token_ids for _ in range(2)]
    assert first[0] == first[1]
    s = Sampler(100, seed=9)
    assert s(logits, rows).token_ids != s(logits, rows).token_ids  # the generator advances


# --- statistics ----------------------------------------------------------------------------

# Toy distribution, tokens in a shuffled vocab order. Ranked: 4 (.35), 0 (.25), 5 (.20),
# 2 (.10), 1 (.06), 3 (.04).
_TOY_PROBS = [0.25, 0.06, 0.10, 0.04, 0.35, 0.20]


def _expected_toy_distribution() -> dict[int, float]:
    """temperature 0.8, top_k 4, top_p 0.9, computed without torch.

    p ** (1 / 0.8) for the ranked top 4: .26921, .17678, .13375, .05623 (sum .63597);
    renormalised .42330, .27797, .21031, .08842; the mass before the 4th is .91158 >= 0.9, so
    the 4th (token 2) goes. Renormalised again: 4 -> .46436, 0 -> .30493, 5 -> .23071.
    """
    ranked = sorted(range(6), key=lambda t: -_TOY_PROBS[t])[:4]
    scaled = {t: _TOY_PROBS[t] ** (1 / 0.8) for t in ranked}
    total = sum(scaled.values())
    kept, mass = [], 0.0
    for t in ranked:
        if mass >= 0.9:
            break
        kept.append(t)
        mass += scaled[t] / total
    kept_total = sum(scaled[t] for t in kept)
    return {t: scaled[t] / kept_total for t in kept}


def test_sampled_frequencies_match_filtered_distribution() -> None:
    expected = _expected_toy_distribution()
    assert sorted(expected) == [0, 4, 5]
    assert [expected[t] for t in (4, 0, 5)] == pytest.approx([0.46436, 0.30493, 0.23071], abs=1e-5)

    num_batches, batch_size = 10, 2000
    num_samples = num_batches * batch_size
    logits = torch.tensor([_TOY_PROBS] * batch_size).log()
    rows = [make_row(temperature=0.8, top_k=4, top_p=0.9) for _ in range(batch_size)]
    sampler = Sampler(6, seed=1234)
    counts = [0] * 6
    for _ in range(num_batches):
        for token in sampler(logits, rows).token_ids:
            counts[token] += 1
    _assert_matches(counts, expected, num_samples)


def test_seeded_draws_follow_the_distribution() -> None:
    # Seeded rows use one generator per key; across positions they must still be unbiased.
    expected = _expected_toy_distribution()
    num_samples = 5000
    logits = torch.tensor([_TOY_PROBS] * num_samples).log()
    rows = [
        make_row(seed_key=(99, 0, pos), seed=99, temperature=0.8, top_k=4, top_p=0.9)
        for pos in range(num_samples)
    ]
    counts = [0] * 6
    for token in Sampler(6, seed=0)(logits, rows).token_ids:
        counts[token] += 1
    _assert_matches(counts, expected, num_samples)


def _assert_matches(counts: list[int], expected: dict[int, float], num_samples: int) -> None:
    for token in range(6):
        p = expected.get(token, 0.0)
        if p == 0.0:
            assert counts[token] == 0, f"filtered token {token} was drawn {counts[token]} times"
            continue
        # Tolerance: 4 standard errors of a binomial proportion (a false alarm about once in
        # 16,000 runs per token; the seeds are fixed, so in practice never) plus 0.002 slack.
        freq = counts[token] / num_samples
        tolerance = 4 * math.sqrt(p * (1 - p) / num_samples) + 0.002
        assert abs(freq - p) <= tolerance, f"token {token}: {freq:.4f} vs {p:.4f} ± {tolerance}"
    # Pearson chi-square with 2 degrees of freedom: P(X > 20) = e**-10, about 4.5e-5.
    chi2 = sum((counts[t] - num_samples * p) ** 2 / (num_samples * p) for t, p in expected.items())
    assert chi2 < 20.0


# --- logprobs ------------------------------------------------------------------------------


def test_logprobs_come_from_the_raw_logits() -> None:
    logits = random_logits(4, 50, seed=4)
    lowest = int(logits[1].argmin())
    rows = [
        make_row(logprobs=5, temperature=0.7, presence_penalty=1.0, output=(1, 2)),
        # Forced to the least likely token: its logprob is reported though it is not in the top 5.
        make_row(logprobs=5, temperature=0.0, logit_bias={lowest: 100.0}),
        make_row(logprobs=0, temperature=0.0),
        make_row(logprobs=None),
    ]
    out = Sampler(50, seed=0)(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)

    assert out.token_ids[1] == lowest
    assert out.token_ids[2] == int(logits[2].argmax())
    assert out.logprobs[3] is None
    for i, k in ((0, 5), (1, 5), (2, 0)):
        lp = out.logprobs[i]
        assert lp is not None
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(raw[i, lp.token_id].item(), abs=1e-6)
        assert len(lp.top) == k
        top_values, top_ids = raw[i].topk(k)
        assert [t for t, _ in lp.top] == top_ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top_values.tolist(), abs=1e-6)
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))
    assert lowest not in [t for t, _ in out.logprobs[1].top]


def test_logprobs_from_bfloat16_are_float32_log_softmax() -> None:
    logits = random_logits(2, 30, seed=5).to(torch.bfloat16)
    out = Sampler(30, seed=0)(logits, [make_row(logprobs=3, temperature=0.0)] * 2)
    raw = torch.log_softmax(logits.float(), dim=-1)
    for i in range(2):
        lp = out.logprobs[i]
        assert lp is not None
        assert lp.logprob == pytest.approx(raw[i].max().item(), abs=1e-6)
        assert [t for t, _ in lp.top] == raw[i].topk(3).indices.tolist()
