"""PoolLoad: the replicas' cumulative counters turned into the same decayed load on every router."""

from __future__ import annotations

import math

import pytest

from router.pool_load import PoolLoad


def test_counters_become_a_load_decayed_per_request_the_pool_takes():
    pool = PoolLoad(window_per_replica=2)  # 2 replicas: the clock moves 1/4 per request
    assert not pool.reported
    pool.observe("a", -1, -1, num_replicas=2)  # not reported: ignored
    assert not pool.reported
    pool.observe("a", 100, 1, num_replicas=2)  # the first stats: a baseline, not load
    assert pool.reported and pool.tokens("a") == 0.0
    pool.observe("a", 300, 3, num_replicas=2)  # 200 tokens, 2 requests: clock 0.5
    assert (pool.tokens("a"), pool.requests("a")) == (200.0, 2.0)
    pool.observe("b", 50, 1, num_replicas=2)
    pool.observe("b", 150, 3, num_replicas=2)  # 2 more requests: clock 1.0
    assert pool.tokens("b") == 100.0
    assert pool.tokens("a") == pytest.approx(200 * math.exp(-0.5))
    assert pool.requests("a") == pytest.approx(2 * math.exp(-0.5))
    pool.observe("b", 150, 3, num_replicas=2)  # the same stats again: nothing changes
    assert pool.tokens("b") == 100.0 and pool.tokens("a") == pytest.approx(200 * math.exp(-0.5))


def test_a_cold_replicas_zeros_are_its_baseline():
    # A worker reports zeros before its first request: everything after them is load, however
    # late its next stats reach the router.
    pool = PoolLoad(window_per_replica=64)
    pool.observe("a", 0, 0, num_replicas=2)
    pool.observe("b", 0, 0, num_replicas=2)
    pool.observe("a", 576, 2, num_replicas=2)  # a's stats after one request, then another
    pool.observe("b", 576, 2, num_replicas=2)  # b's only after both
    # (a's 576 decayed by b's two requests, of a window of 64 x 2)
    assert (pool.tokens("a"), pool.tokens("b")) == (pytest.approx(576 * math.exp(-2 / 128)), 576.0)


def test_a_restarted_engine_starts_a_new_baseline_and_a_removed_replica_is_forgotten():
    pool = PoolLoad(window_per_replica=1)
    pool.observe("a", 500, 5, num_replicas=1)
    pool.observe("a", 700, 6, num_replicas=1)  # clock 1: 200 tokens
    pool.observe("a", 30, 1, num_replicas=1)  # counters went down: a new engine, a new baseline
    assert pool.tokens("a") == 200.0
    pool.observe("a", 90, 2, num_replicas=1)  # clock 2: 200 e^-1 + 60
    assert pool.tokens("a") == pytest.approx(200 * math.exp(-1) + 60)
    pool.remove("a")
    assert pool.tokens("a") == 0.0 and not pool.reported
    with pytest.raises(ValueError, match="window_per_replica"):
        PoolLoad(window_per_replica=0)
