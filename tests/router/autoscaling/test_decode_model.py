"""The decode pool's stream law (router/autoscaling/decode_model.py): exact against closed forms,
and the learnt correction reads the profile on replicas that run at it."""

from __future__ import annotations

import math

import pytest

from router.autoscaling.decode_model import (
    TokenBatch,
    fit_correction,
    life_average,
    relaxation_s,
    stream_law,
    token_batch,
    token_rate,
)

BASE, PER_SEQ = 0.02768, 0.0154  # this machine's decode step, seconds (pool_model.Capacity)


def test_token_rate_places_streams_evenly():
    # 7 streams on 3 replicas: one holds 3, two hold 2.
    assert token_rate(7, 3, 0.02, 0.02) == pytest.approx(3 / 0.08 + 2 * 2 / 0.06)
    assert token_rate(2, 3, 0.02, 0.02) == pytest.approx(2 / 0.04)  # two replicas at batch 1


def test_one_replica_is_negative_binomial():
    # c = 1: P(m) ~ C(m + r - 1, m) rho^m (1 - rho)^r, r = base / per_seq + 1, rho = work * per_seq.
    work = 30.0
    law = stream_law(work, 1, BASE, PER_SEQ)
    rho, r = work * PER_SEQ, BASE / PER_SEQ + 1
    assert law.mean == pytest.approx(r * rho / (1 - rho), rel=1e-9)
    p3 = math.exp(math.lgamma(3 + r) - math.lgamma(r) - math.lgamma(4)) * rho**3 * (1 - rho) ** r
    assert law.probabilities[3] == pytest.approx(p3, rel=1e-9)


def test_no_law_past_capacity():
    assert stream_law(3 / PER_SEQ, 3, BASE, PER_SEQ) is None
    assert stream_law(0.0, 3, BASE, PER_SEQ).probabilities == (1.0,)


def test_tokens_see_a_larger_batch_than_the_mean():
    # 128 tokens/s on 5 replicas: 6.79 streams on average (1.36 per replica), but the tokens are
    # decoded at a batch of 1.65 on average (a stream is where the batch is).
    law = stream_law(128.0, 5, BASE, PER_SEQ)
    seen = token_batch(law, BASE, PER_SEQ)
    assert round(law.mean, 4) == 6.7893
    assert (round(seen.mean, 4), round(seen.std, 4)) == (1.6469, 0.6922)


def test_the_count_remembers_for_one_life_when_every_stream_runs_alone():
    # A step that does not grow with the batch: every stream lasts L * base whatever the others
    # do, so the count is M/M/infinity (Poisson), whose correlation time is one life exactly.
    base, tokens, arrivals = 0.05, 40, 2.0
    law = stream_law(arrivals * tokens, 1, base, 1e-12)
    assert law.mean == pytest.approx(arrivals * tokens * base, rel=1e-6)  # 4 streams
    assert relaxation_s(law, arrivals) == pytest.approx(tokens * base, rel=1e-6)  # 2 s


def test_a_busier_step_makes_the_count_remember_longer():
    # With the step growing by the batch a crowd drains slower: the correlation outlasts the
    # mean life at the mean batch (3.43 s against 2.12 s at 128 tokens/s on 5 replicas, 40 tokens
    # a stream).
    law = stream_law(128.0, 5, BASE, PER_SEQ)
    life = 40 * (BASE + PER_SEQ * token_batch(law, BASE, PER_SEQ).mean)
    assert round(life, 4) == 2.1217
    assert round(relaxation_s(law, 128.0 / 40), 4) == 3.4286


def test_averaging_over_a_life_narrows_the_spread_by_the_exponential_correlations_factor():
    seen = TokenBatch(3.0, 1.5)
    assert life_average(seen, 2.0, 2.0) == TokenBatch(3.0, pytest.approx(1.5 * math.sqrt(2 * math.exp(-1))))
    # a life much longer than the correlation: variance 2 / x of the step's
    assert life_average(seen, 2000.0, 2.0).std == pytest.approx(1.5 * math.sqrt(2 / 1000 * (1 - 1 / 1000)), rel=1e-6)
    assert life_average(seen, 2.0, 0.0) == seen  # no correlation known: the step's own


@pytest.mark.parametrize(("work", "c", "k"), [(10.0, 1, 1.0), (128.0, 5, 1.0), (300.0, 8, 1.0), (128.0, 5, 1.2),
                                              (40.0, 2, 0.8)])
def test_the_correction_reads_the_step_the_streams_ran_at(work, c, k):
    # Replicas whose step is k times the profile's hold the law's mean at k: the fit gives k back
    # exactly, at any load (the mean batch's estimate read 1.06-1.18 on replicas at the profile).
    held = stream_law(work, c, BASE * k, PER_SEQ * k).mean
    assert fit_correction(held, work, c, BASE, PER_SEQ) == pytest.approx(k, rel=1e-9)


def test_the_correction_needs_decoded_tokens():
    assert fit_correction(0.0, 0.0, 2, BASE, PER_SEQ) is None
    assert fit_correction(1.0, 0.0, 2, BASE, PER_SEQ) is None


def test_the_correction_reads_the_profile_on_the_pool_models_replicas():
    # Three replicas of the replay's pool model, which step exactly at the profile, fed 2 req/s
    # of Poisson streams (32-96 tokens) for 10 minutes, sampled as the replay samples them (every
    # 5 s, 30-s windows); a plan every 30 s from 60 s on. The fit reads 0.994 on average; the
    # tokens/s predicted at each replica's mean batch (an earlier estimate) read 1.056; the step
    # account the planner reads first (sizing.learn_correction) reads 1 at every plan.
    import random
    import statistics

    from router.autoscaling.plan_serve import pool_load
    from router.autoscaling.pool_model import Capacity, Pool

    capacity = Capacity()
    pool = Pool("decode", capacity, 3)
    rng = random.Random(1)
    arrivals, at = [], 0.0
    while (at := at + rng.expovariate(2.0)) <= 600.0:
        arrivals.append((at, rng.randint(32, 96)))
    fits, old, accounts, t, i = [], [], [], 0.0, 0
    while t < 600.0:
        t += 1.0
        while i < len(arrivals) and arrivals[i][0] < t:
            replica = min(pool.accepting(arrivals[i][0]), key=lambda r: len(r.active))
            replica.join(i, arrivals[i][0], arrivals[i][1] - 1, lambda *_: None)
            i += 1
        for replica in pool.replicas:
            replica.advance(t, lambda *_: None)
        if t % 5 == 0:
            pool.sample(t, 30.0)
            if t >= 60 and t % 30 == 0:
                load = pool_load("decode", pool.observed(t))
                measured = load.measured_decode
                fits.append(fit_correction(sum(b for b, _ in measured), sum(m for _, m in measured), 3, BASE, PER_SEQ))
                # The replicas' step account: their seconds over the profile's for their steps.
                steps, rows, seconds = load.decode_steps
                accounts.append(seconds / (BASE * steps + PER_SEQ * rows))
                busy = [(b, m) for b, m in measured if b >= 2 and m > 0]
                if busy:
                    old.append(sum(b / (BASE + PER_SEQ * b) for b, _ in busy) / sum(m for _, m in busy))
    assert (len(fits), round(statistics.mean(fits), 4)) == (19, 0.9938)
    assert round(statistics.mean(old), 4) == 1.0562
    assert accounts == pytest.approx([1.0] * 19, rel=1e-9)  # exact: a step is linear in its batch
