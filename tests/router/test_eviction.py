"""BlockReuse: decayed per-block use counts, the pool's turnover horizon, the value of victims."""

from __future__ import annotations

import math

import pytest

from router.eviction import BlockReuse


def test_probability_and_horizon_decay_over_the_window():
    reuse = BlockReuse(window_requests=4)
    reuse.observe([1, 2], num_new_blocks=2)
    reuse.observe([1, 3], num_new_blocks=1)
    d = math.exp(-1 / 4)  # one request's decay
    assert reuse.probability(1) == pytest.approx(1.0)  # both requests used it
    assert reuse.probability(2) == pytest.approx(d / (1 + d))
    assert reuse.probability(3) == pytest.approx(1 / (1 + d))
    assert reuse.probability(4) == 0.0
    # 100 pool blocks at a decayed mean of (2d + 1) / (d + 1) new blocks per request.
    assert reuse.horizon(100) == pytest.approx(100 * (1 + d) / (2 * d + 1))
    assert BlockReuse().horizon(100) == math.inf  # nothing taken yet


def test_value_of_victims_weighs_reuse_and_copies():
    reuse = BlockReuse(window_requests=10**9)  # no decay to speak of: p = uses / requests
    for _ in range(3):
        reuse.observe([1], num_new_blocks=1)
    reuse.observe([2], num_new_blocks=1)
    horizon = 2.0
    wanted_1, wanted_2 = 1 - math.exp(-0.75 * horizon), 1 - math.exp(-0.25 * horizon)
    assert reuse.value_s([1, 2, 9], horizon, recompute_s=0.5) == pytest.approx(0.5 * (wanted_1 + wanted_2))
    # Block 1 is held by two replicas: evicting one copy loses half of it.
    holders = {1: 2}.get
    assert reuse.value_s([1, 2], horizon, 0.5, lambda h: holders(h, 1)) == pytest.approx(0.5 * (wanted_1 / 2 + wanted_2))
    assert reuse.value_s([1], math.inf, 0.5) == 0.5  # before any turnover every used block is wanted
    assert reuse.value_s([], horizon, 0.5) == 0.0


def test_blocks_not_used_for_several_windows_are_pruned():
    reuse = BlockReuse(window_requests=4)
    reuse.observe([7], num_new_blocks=1)
    for _ in range(15):
        reuse.observe([8], num_new_blocks=1)
    # Pruned at the 16th request: block 7 was used 15 requests ago, exp(-15 / 4) < 0.05.
    assert len(reuse) == 1 and reuse.probability(7) == 0.0 and reuse.probability(8) > 0.9
    with pytest.raises(ValueError, match="window_requests must be >= 1, got 0"):
        BlockReuse(window_requests=0)


def test_replica_reports_pool_into_the_probability():
    """A router that sent none of a block's requests learns its reuse from the replicas' reports;
    its own count wins where it is higher; a replica that leaves takes its report along."""
    router = BlockReuse(window_requests=10**9)  # no decay: p = uses / requests
    router.observe([1, 2], num_new_blocks=2)
    router.observe([3], num_new_blocks=1)
    assert (router.probability(1), router.probability(9)) == pytest.approx((0.5, 0.0))
    replica = BlockReuse(window_requests=10**9)
    for hashes in ([9, 10], [9], [9, 1], [4]):
        replica.observe(hashes, num_new_blocks=0)
    assert replica.counts([9, 10, 1, 4, 77], at_least=1.5) == pytest.approx({9: 3.0})
    assert replica.counts([9, 10, 1], at_least=0.5) == pytest.approx({9: 3.0, 10: 1.0, 1: 1.0})
    assert replica.weight == pytest.approx(4.0)
    router.absorb("a", replica.counts([9, 10, 1]), replica.weight)
    router.absorb("b", {9: 1.0}, 4.0)
    assert router.probability(9) == pytest.approx(0.5)  # (3 + 1) / (4 + 4)
    assert router.probability(1) == pytest.approx(0.5)  # its own 1/2 beats the pool's 1/8
    router.absorb("a", {}, 4.0)  # a's next report replaces its last
    assert router.probability(9) == pytest.approx(0.125)
    router.forget("b")
    router.forget("a")
    assert (router.probability(9), router.probability(1)) == pytest.approx((0.0, 0.5))
