"""PrefillRate: the median of recent prefills, once there are a few; a cold start's slow first
prefills do not make a replica look slower than its twin."""

from __future__ import annotations

from serving.engine.prefill_rate import PrefillRate


def test_the_median_of_the_last_prefills_from_the_third_on():
    rate = PrefillRate(window=4, min_samples=3)
    rate.add(100, 1.0)  # a cold start: 10x slower than what follows
    rate.add(1000, 1.0)
    assert rate.tokens_per_s == 0.0  # not measured yet: a router takes the pool's mean
    rate.add(1000, 1.0)
    assert rate.tokens_per_s == 1000.0  # the outlier does not move it
    rate.add(0, 1.0)  # nothing computed, or no time: not a measurement
    rate.add(500, 0.0)
    assert rate.tokens_per_s == 1000.0
    for _ in range(3):  # the replica really slowed down (a busier core): it follows
        rate.add(400, 1.0)
    assert rate.tokens_per_s == 400.0
