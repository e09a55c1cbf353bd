"""Adaptive speculation (speculative.py, Adaptive; step_costs.py): the k rule, the back-off, the
compute-bound off-switch, the measured step costs, and greedy output unchanged with it on."""

from __future__ import annotations

import dataclasses

import pydantic
import pytest

from serving.engine import SamplingParams
from serving.engine.config import SpeculativeConfig
from serving.engine.request import Sequence
from serving.engine.spec.speculative import Speculator, next_k
from serving.engine.step_costs import KNEE_FRACTION, measure_step_costs, step_costs_from
from tests.serving.engine.test_engine import make_engine, tokens_of
from tests.serving.engine.test_speculative import GREEDY, SPEC, plain_outputs, spec_engine, workload  # noqa: F401 - a fixture

FIXED = {"verify_row_cost": 0.15, "max_batch_rows": 64}  # no start-up measurement: exact behaviour


class ScriptedProposer:
    """Proposes max_k tokens for every sequence (or none where `no_match`), and records what it was asked."""

    name = "scripted"

    def __init__(self):
        self.asked: list[list[int]] = []
        self.no_match = False

    def propose_batch(self, seqs, max_ks):
        self.asked.append(list(max_ks))
        return [[] if self.no_match else [7] * min(k, 4) for k in max_ks]

    def release(self, seq):
        pass


def speculator(**config) -> Speculator:
    spec = Speculator(SpeculativeConfig(**{**FIXED, **config}), max_model_len=10_000)
    spec.proposer = ScriptedProposer()
    return spec


def decoding_seq(name: str = "r") -> Sequence:
    seq = Sequence(name, 0, [1, 2, 3], SamplingParams(max_tokens=1000), max_tokens=1000)
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


def offered_ks(spec: Speculator, seq: Sequence, verdicts: list[int | None]) -> list[int]:
    """The k offered each step; after it, `verdicts[i]` of them kept (None: nothing proposed)."""
    ks = []
    for kept in verdicts:
        spec.propose([seq])
        ks.append(len(seq.spec_token_ids))
        if seq.spec_token_ids:
            assert kept is not None, f"step {len(ks)} offered {ks[-1]}"
            spec.observe(seq, kept, len(seq.spec_token_ids))
        else:
            assert kept is None, f"step {len(ks)} offered nothing"
    return ks


# ---- the rule ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "acceptance, row_cost, max_k, expected",
    [
        (1.0, 0.15, 4, 4),  # always kept: all
        (0.9, 0.15, 4, 4),  # 0.9^4 = 0.66 >= 0.15
        (0.6, 0.15, 4, 3),  # 0.6^3 = 0.216 >= 0.15 > 0.6^4 = 0.13
        (0.5, 0.15, 4, 2),  # 0.25 >= 0.15 > 0.125
        (0.3, 0.15, 4, 1),
        (0.1, 0.15, 4, 0),  # not even one pays
        (0.0, 0.15, 4, 0),
        (0.5, 0.0, 4, 4),  # rows are free
        (0.5, 0.5, 4, 1),  # 0.5^1 = 0.5 >= 0.5: an exact tie pays
        (0.9, 1.0, 4, 0),  # compute-bound: a verify row costs a sure token's compute
    ],
)
def test_next_k(acceptance, row_cost, max_k, expected):
    assert next_k(acceptance, row_cost, max_k) == expected


def test_k_follows_the_module_docstring_example():
    spec = speculator(backoff_steps=2, acceptance_ema=0.3)
    seq = decoding_seq()
    verdicts = [0, None, None, 0, None, None, 0, None, None, 1, 1, 2, 4]
    ks, ps = [], []
    for kept in verdicts:
        ks += offered_ks(spec, seq, [kept])
        ps.append(round(spec._estimates[seq].acceptance, 2))
    assert ks == [4, 0, 0, 1, 0, 0, 1, 0, 0, 1, 2, 2, 4]
    assert ps == [0.0] * 9 + [0.39, 0.45, 0.69, 0.86]
    assert spec.proposer.asked == [[4], [1], [1], [1], [2], [2], [4]]  # not asked while backing off


def test_acceptance_shrinks_k_and_full_acceptance_grows_it_back():
    spec = speculator(acceptance_ema=0.5, backoff_steps=8)
    seq = decoding_seq()
    # verdict       4/4   1/4    0/4    1/2      2/2      4/4
    # accepted EMA  2     1.5    0.75   0.875    1.4375   2.71875
    # trials EMA    2     2      1.5    1.75     1.875    2.9375    (a miss adds one trial)
    # p             1     0.75   0.5    0.5      0.767    0.926
    # k next        4     4      2      2        4        4         (0.75^4 = 0.32; 0.5^2 >= 0.15 > 0.5^3)
    assert offered_ks(spec, seq, [4, 1, 0, 1, 2, 4]) == [4, 4, 4, 2, 2, 4]
    est = spec._estimates[seq]
    assert (est.accepted, est.trials) == (2.71875, 2.9375)
    spec.propose([seq])
    assert len(seq.spec_token_ids) == 4


def test_a_step_without_a_match_teaches_nothing():
    spec = speculator(acceptance_ema=0.5)
    seq = decoding_seq()
    assert offered_ks(spec, seq, [1]) == [4]  # p = 1 / 2
    before = (spec._estimates[seq].accepted, spec._estimates[seq].trials)
    spec.proposer.no_match = True
    for _ in range(3):
        spec.propose([seq])
        assert seq.spec_token_ids == []
    assert (spec._estimates[seq].accepted, spec._estimates[seq].trials) == before
    assert spec.proposer.asked == [[4], [2], [2], [2]]  # 0.5^2 >= 0.15 > 0.5^3


def test_a_probe_that_finds_no_match_is_offered_again():
    spec = speculator(backoff_steps=1, acceptance_ema=1.0)
    seq = decoding_seq()
    assert offered_ks(spec, seq, [0, None]) == [4, 0]  # p = 0: back off one step
    spec.proposer.no_match = True
    spec.propose([seq])
    spec.proposer.no_match = False
    assert offered_ks(spec, seq, [1, 1]) == [1, 4]  # the probe waited for a match; kept: p = 1
    assert spec.proposer.asked == [[4], [1], [1], [4]]


def test_release_forgets_the_sequence():
    spec = speculator()
    seq = decoding_seq()
    offered_ks(spec, seq, [0])
    assert seq in spec._estimates
    spec.release(seq)
    assert seq not in spec._estimates


def test_adaptive_off_always_offers_the_most():
    spec = speculator(adaptive=False)
    seq = decoding_seq()
    assert offered_ks(spec, seq, [0, 0, 0, 0]) == [4, 4, 4, 4]
    assert spec.proposer.asked == [[999]] * 4  # up to max_tokens (1000, less the model's token); the proposer caps it
    other = decoding_seq("other")
    spec.verify(other, [5, 6], [9, 9, 9])
    assert other not in spec._estimates  # verify learns nothing without adaptive


def test_verify_learns_into_the_estimate():
    spec = speculator(acceptance_ema=1.0)
    seq = decoding_seq()
    assert spec.verify(seq, [5, 6, 7], [5, 6, 9, 1]) == 2
    assert (spec._estimates[seq].accepted, spec._estimates[seq].trials) == (2.0, 3.0)
    assert (spec.num_proposed_tokens, spec.num_accepted_tokens, spec.num_verified_seqs) == (3, 2, 1)


# ---- the compute-bound off-switch ----------------------------------------------------------------
def test_no_proposals_and_no_proposer_call_at_the_knee():
    spec = speculator(max_batch_rows=8)
    seqs = [decoding_seq(f"r{i}") for i in range(3)]
    spec.propose(seqs, num_other_rows=5)  # 8 rows before any proposal: at the knee
    assert [s.spec_token_ids for s in seqs] == [[], [], []] and spec.proposer.asked == []


def test_proposals_are_cut_to_the_knee_best_estimate_first():
    spec = speculator(max_batch_rows=10, acceptance_ema=1.0)
    seqs = [decoding_seq(f"r{i}") for i in range(3)]
    spec.observe(seqs[0], 2, 4)  # p = 2/3
    spec.observe(seqs[1], 4, 4)  # p = 1
    # seqs[2]: no verdict yet, p = 1 (ties keep the order given)
    spec.propose(seqs, num_other_rows=2)  # 5 rows, 5 left for proposals
    assert spec.proposer.asked == [[4, 4, 4]]  # (2/3)^4 = 0.198 >= 0.15
    assert [len(s.spec_token_ids) for s in seqs] == [0, 4, 1]
    assert spec.stats()["spec_knee_dropped_tokens"] == 7 and spec.stats()["spec_max_batch_rows"] == 10


def test_measured_row_cost_depends_on_the_steps_rows():
    # cost(n) = (verify / decode - 1) / 4: 0.1, 0.2, 0.75 (knee at 4), 0.5 -> 0.75 (non-decreasing)
    costs = step_costs_from([1, 2, 4, 8], [0.010, 0.012, 0.016, 0.024], [0.014, 0.0216, 0.064, 0.072], 4)
    spec = Speculator(SpeculativeConfig(), max_model_len=10_000, step_costs=lambda: costs)
    spec.proposer = ScriptedProposer()
    assert costs.costs() == pytest.approx([0.1, 0.2, 0.75, 0.75]) and costs.single_row_cost == pytest.approx(0.1)
    assert spec.max_batch_rows == 4 == costs.knee_rows
    assert [spec.row_cost(n) for n in (1, 2, 3, 4, 7, 100)] == pytest.approx([0.1, 0.2, 0.2, 0.75, 0.75, 0.75])
    seq = decoding_seq()
    spec.observe(seq, 1, 4)  # 1 kept, 2 trials: p = 0.5
    spec.propose([seq], num_other_rows=0)  # 1 row: c = 0.1, 0.5^3 = 0.125 >= 0.1 > 0.5^4
    assert len(seq.spec_token_ids) == 3
    spec.propose([seq], num_other_rows=1)  # 2 rows: c = 0.2, 0.5^2 = 0.25 >= 0.2 > 0.125
    assert len(seq.spec_token_ids) == 2


# ---- step costs ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "decode_ms, verify_ms, expected_knee",
    [
        ([10, 11, 12, 14, 18], [12, 14, 18, 50, 80], 16),  # costs 0.05 0.068 0.125 0.64 0.86
        ([10, 10], [40, 50], 1),  # compute-bound from the first sequence
        ([10, 10, 10], [11, 11, 11], 4),  # verifying pays throughout: the last measured
        ([10, 10, 10, 10], [10, 39, 20, 40], 2),  # 0, 0.725, 0.25 -> 0.725, 0.75: non-decreasing
    ],
)
def test_knee_is_where_a_verify_row_costs_nearly_a_full_row(decode_ms, verify_ms, expected_knee):
    rows = [2**i for i in range(len(decode_ms))]
    costs = step_costs_from(rows, [ms / 1000 for ms in decode_ms], [ms / 1000 for ms in verify_ms], 4)
    assert costs.costs() == sorted(costs.costs())
    assert costs.knee_rows == expected_knee
    assert all(c < KNEE_FRACTION for n, c in zip(rows, costs.costs()) if n < expected_knee)


def test_measured_step_costs_on_the_tiny_model(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    costs = measure_step_costs(engine.model, engine.kv_cache, max_rows=64, num_speculative_tokens=4, repeats=1)
    assert costs.rows[0] == 1 and all(b == 2 * a for a, b in zip(costs.rows, costs.rows[1:])) and costs.rows[-1] <= 64
    assert len(costs.decode_s) == len(costs.verify_s) == len(costs.rows)
    assert all(s > 0 for s in costs.decode_s + costs.verify_s) and costs.single_row_cost >= 0
    # Measuring stops at the first point whose cost reaches KNEE_FRACTION (the knee), else at max_rows.
    assert costs.knee_rows == costs.rows[-1]
    assert costs.costs()[-1] >= KNEE_FRACTION or costs.rows[-1] == 64
    assert all(c < KNEE_FRACTION for c in costs.costs()[:-1])


def test_engine_measures_at_start_and_shows_the_knee(tiny_model_dir):
    engine = make_engine(tiny_model_dir, speculative={**SPEC, "adaptive": True}, max_num_seqs=8)
    stats = engine.stats()
    assert stats.spec_max_batch_rows == engine.speculator.step_costs.knee_rows >= 1
    assert stats.spec_single_row_cost == engine.speculator.step_costs.single_row_cost
    assert engine.speculator.step_costs.rows[-1] <= 8  # max_num_seqs


def test_no_measurement_when_both_figures_are_configured(tiny_model_dir):
    engine = make_engine(tiny_model_dir, speculative={**SPEC, "adaptive": True, **FIXED})
    stats = engine.stats()
    assert engine.speculator.step_costs is None
    assert (stats.spec_max_batch_rows, stats.spec_single_row_cost) == (64, 0.0)


# ---- in the engine -------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides", [FIXED, {"verify_row_cost": 0.5, "max_batch_rows": 6, "backoff_steps": 2}, {}])
def test_greedy_output_is_token_identical_with_adaptive_speculation(tiny_model_dir, plain_outputs, overrides):  # noqa: F811
    engine = make_engine(tiny_model_dir, speculative={**SPEC, "adaptive": True, **overrides})
    assert tokens_of(engine.generate(workload(), GREEDY)) == plain_outputs
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert engine.speculator._estimates == {}  # every sequence released


def test_a_single_stream_at_the_knee_never_speculates(tiny_model_dir, plain_outputs):  # noqa: F811
    engine = make_engine(tiny_model_dir, speculative={**SPEC, "adaptive": True, "verify_row_cost": 0.1, "max_batch_rows": 1})
    assert tokens_of(engine.generate(workload(), GREEDY)) == plain_outputs
    assert engine.stats().spec_proposed_tokens == 0


def test_knee_holds_proposals_until_the_batch_shrinks(tiny_model_dir, plain_outputs):  # noqa: F811
    """11 requests with a knee of 4 rows: no step verifies past 4 decode rows, and proposals (an
    oracle's, some right) start once fewer than 4 sequences run."""
    engine = spec_engine(tiny_model_dir, (workload(), plain_outputs),
                         speculative={**SPEC, "adaptive": True, "verify_row_cost": 0.0, "max_batch_rows": 4})
    rows_seen = []
    execute = engine.runner.execute

    def counting(step):
        decoding = [n for s, n in zip(step.seqs, step.num_new_tokens) if s.num_computed_tokens == s.num_tokens - 1]
        if any(n > 1 for n in decoding):  # a step that verifies proposals
            rows_seen.append(sum(decoding))
        return execute(step)

    engine.runner.execute = counting
    max_tokens = [8 + 4 * i for i in range(len(workload()))]  # finishing one after another
    params = [dataclasses.replace(GREEDY, max_tokens=m) for m in max_tokens]
    assert tokens_of(engine.generate(workload(), params)) == [out[:m] for out, m in zip(plain_outputs, max_tokens)]
    assert rows_seen and max(rows_seen) <= 4
    assert engine.stats().spec_accepted_tokens > 0


def test_config_bounds_name_the_field():
    for field, bad in [("acceptance_ema", 0.0), ("backoff_steps", 0), ("verify_row_cost", -0.1), ("max_batch_rows", 0)]:
        with pytest.raises(pydantic.ValidationError, match=field):
            SpeculativeConfig(**{field: bad})
    assert SpeculativeConfig().adaptive is True and SpeculativeConfig().max_batch_rows is None
