"""Routing policies on crafted states: exact choices and reasons."""

from __future__ import annotations

from collections import Counter

import pytest

from router.index import PrefixIndex
from router.policies import (
    LeastKVPolicy,
    PowerOfTwoPolicy,
    PrefixCostPolicy,
    ReplicaLoad,
    RoundRobinPolicy,
    RouteRequest,
    build_policy,
)

PREFIX = [101, 102, 103, 104]  # 4 blocks of 16 tokens
REQUEST = RouteRequest("r", num_prompt_tokens=80, block_hashes=PREFIX + [105], block_size=16)


def loads(**queued) -> list[ReplicaLoad]:
    return [ReplicaLoad(name, num_queued_prefill_tokens=q, prefill_tokens_per_s=1000.0) for name, q in queued.items()]


def index_with(**held) -> PrefixIndex:
    index = PrefixIndex()
    for name, hashes in held.items():
        index.update(name, 1, set(hashes))
    return index


def test_prefix_holder_wins_when_load_is_equal():
    decision = PrefixCostPolicy().choose(REQUEST, loads(a=0, b=0, c=0), index_with(b=PREFIX))
    assert decision.chosen == "b" and decision.reason == "prefix_hit"
    assert decision.num_matched_tokens == 64
    assert decision.estimated_ttft_s == {"a": 0.08, "b": 0.016, "c": 0.08}


def test_queued_work_outweighs_a_small_hit():
    # b holds 1 block (16 tokens) but has 500 tokens queued: a is cheaper (80 vs 564 tokens).
    decision = PrefixCostPolicy().choose(REQUEST, loads(a=0, b=500), index_with(b=PREFIX[:1]))
    assert decision.chosen == "a" and decision.reason == "least_cost"
    assert decision.ranked == ["a", "b"]


def test_measured_rate_counts():
    # b holds the prefix but prefills 10x slower, beyond the rate spread: it keeps its own rate.
    # a, within 2x of the median 550, is taken at it: 16 tokens at 100/s = 0.16 s > 80 at 550/s.
    state = [ReplicaLoad("a", prefill_tokens_per_s=1000.0), ReplicaLoad("b", prefill_tokens_per_s=100.0)]
    decision = PrefixCostPolicy().choose(REQUEST, state, index_with(b=PREFIX))
    assert decision.chosen == "a" and decision.estimated_ttft_s == {"a": 80 / 550, "b": 16 / 100}


def test_unmeasured_rate_uses_the_pool_median_then_the_default():
    state = [ReplicaLoad("a"), ReplicaLoad("b", num_queued_prefill_tokens=100)]
    decision = PrefixCostPolicy(default_prefill_tokens_per_s=400.0).choose(REQUEST, state, PrefixIndex())
    assert decision.estimated_ttft_s == {"a": 0.2, "b": 0.45}
    state = [ReplicaLoad("a"), ReplicaLoad("b", prefill_tokens_per_s=800.0), ReplicaLoad("c", prefill_tokens_per_s=1600.0)]
    decision = PrefixCostPolicy(default_prefill_tokens_per_s=1.0, rate_spread=None).choose(REQUEST, state, PrefixIndex())
    assert decision.estimated_ttft_s == {"a": 80 / 1200, "b": 0.1, "c": 0.05}


def test_rates_within_the_spread_are_the_pool_median():
    # Noise between alike replicas (17k and 24k tokens/s measured on two identical ones) does not
    # steer the pool; a replica more than rate_spread off the median keeps its own rate.
    state = [ReplicaLoad("a", prefill_tokens_per_s=800.0), ReplicaLoad("b", prefill_tokens_per_s=1000.0),
             ReplicaLoad("c", prefill_tokens_per_s=1300.0), ReplicaLoad("d", prefill_tokens_per_s=500.0)]
    decision = PrefixCostPolicy().choose(REQUEST, state, PrefixIndex())
    assert decision.estimated_ttft_s == {"a": 80 / 900, "b": 80 / 900, "c": 80 / 900, "d": 80 / 900}
    decision = PrefixCostPolicy(rate_spread=1.5).choose(REQUEST, state, PrefixIndex())
    assert decision.estimated_ttft_s == {"a": 80 / 900, "b": 80 / 900, "c": 80 / 900, "d": 80 / 500}
    with pytest.raises(ValueError, match="rate_spread must be >= 1"):
        PrefixCostPolicy(rate_spread=0.5)


def test_absolute_imbalance_guard_moves_a_popular_prefix():
    # b holds the prefix: 16 uncached + 50 queued = 66 tokens beats a's 80, and b leads a by 50.
    policy = PrefixCostPolicy(max_imbalance_tokens=100, max_imbalance_ratio=100.0)
    decision = policy.choose(REQUEST, loads(a=0, b=50), index_with(b=PREFIX))
    assert decision.chosen == "b" and decision.reason == "prefix_hit"  # lead 50 <= 100
    policy = PrefixCostPolicy(max_imbalance_tokens=40, max_imbalance_ratio=100.0)
    decision = policy.choose(REQUEST, loads(a=0, b=50), index_with(b=PREFIX))
    assert decision.chosen == "a" and decision.reason == "imbalance_guard"


def test_relative_imbalance_guard():
    # c holds a 20-block (320-token) prefix: by cost alone it wins (80 + 300 < 400 + 0).
    prefix = list(range(1000, 1020))
    request = RouteRequest("r", num_prompt_tokens=400, block_hashes=prefix, block_size=16)
    state = loads(a=0, b=0, c=300)
    index = index_with(c=prefix)
    lenient = PrefixCostPolicy(max_imbalance_tokens=10**9, max_imbalance_ratio=1.5, min_imbalance_tokens=1000)
    assert lenient.choose(request, state, index).chosen == "c"  # lead 300 <= the 1000 floor
    strict = PrefixCostPolicy(max_imbalance_tokens=10**9, max_imbalance_ratio=1.5, min_imbalance_tokens=100)
    decision = strict.choose(request, state, index)  # 300 > 1.5 x mean 100, lead 300 > 100
    assert decision.reason == "imbalance_guard" and decision.chosen in {"a", "b"}


def test_ties_are_broken_by_load_not_by_order():
    # The load bound off: repeating one request would otherwise spread it by its own history.
    policy = PrefixCostPolicy(tie_tolerance=0.5, max_load_ratio=None)
    # a and b within 50% of each other; the pair is always {a, b} -> the less loaded one.
    state = [ReplicaLoad("a", num_queued_prefill_tokens=30, prefill_tokens_per_s=1000.0),
             ReplicaLoad("b", num_queued_prefill_tokens=10, prefill_tokens_per_s=1000.0)]
    choices = Counter(policy.choose(REQUEST, state, PrefixIndex()).chosen for _ in range(20))
    assert choices == Counter({"b": 20})
    equal = loads(a=0, b=0, c=0, d=0)
    policy = PrefixCostPolicy()
    spread = Counter(policy.choose(REQUEST, equal, PrefixIndex()).chosen for _ in range(400))
    assert set(spread) == {"a", "b", "c", "d"} and min(spread.values()) > 60


def test_session_affinity_within_slack():
    policy = PrefixCostPolicy(session_affinity=True, affinity_slack_s=0.01, max_load_ratio=None)
    session_request = RouteRequest("r", 80, PREFIX, 16, session="user-42")
    state = loads(a=0, b=0, c=0)
    preferred = policy.choose(session_request, state, PrefixIndex()).chosen
    for _ in range(10):  # stable
        assert policy.choose(session_request, state, PrefixIndex()).chosen == preferred
    # Beyond the slack the cheaper replica wins.
    busy = [ReplicaLoad(r, num_queued_prefill_tokens=1000 if r == preferred else 0, prefill_tokens_per_s=1000.0) for r in "abc"]
    assert policy.choose(session_request, busy, PrefixIndex()).chosen != preferred


def test_load_bound_sheds_a_prefix_holder_with_too_much_recent_work():
    # a holds the prefix (16 uncached tokens, the cheapest) but was sent 1000 tokens lately.
    policy = PrefixCostPolicy(max_load_ratio=1.25, load_window_per_replica=64, tie_tolerance=0.05)
    policy.routed_tokens = {"a": 1000.0, "b": 200.0, "c": 200.0}
    policy.routed_requests = {"a": 10.0, "b": 2.0, "c": 2.0}  # a takes 10/14 of requests: not exempt
    decision = policy.choose(REQUEST, loads(a=0, b=0, c=5), index_with(a=PREFIX))
    # bound = 1.25 x (1400 + 16) / 3 = 590: a's 1016 is over it; b (80 tokens, 0.08 s) beats c (0.085 s).
    assert (decision.chosen, decision.reason, decision.ranked) == ("b", "load_bound", ["b", "a", "c"])
    decay = 1 - 1 / (64 * 3)
    assert policy.routed_tokens == pytest.approx({"a": 1000 * decay, "b": 200 * decay + 80, "c": 200 * decay})
    # Within the bound the holder keeps its prefix: 316 <= 1.25 x (900 + 16) / 3 = 381.7.
    policy.routed_tokens = {"a": 300.0, "b": 300.0, "c": 300.0}
    decision = policy.choose(REQUEST, loads(a=0, b=0, c=5), index_with(a=PREFIX))
    assert (decision.chosen, decision.reason) == ("a", "prefix_hit")
    # No history yet: one prompt outweighs the mean everywhere, so nobody is excluded.
    fresh = PrefixCostPolicy().choose(REQUEST, loads(a=0, b=0), index_with(a=PREFIX))
    assert (fresh.chosen, fresh.reason) == ("a", "prefix_hit")
    with pytest.raises(ValueError, match="max_load_ratio must be >= 1"):
        PrefixCostPolicy(max_load_ratio=0.5)


def test_decode_policy_prefers_low_kv_usage_with_room():
    request = RouteRequest("r", num_prompt_tokens=100, block_size=16)  # needs 7 blocks
    state = [
        ReplicaLoad("full", num_free_blocks=5, kv_usage=0.1),
        ReplicaLoad("busy", num_free_blocks=50, kv_usage=0.6, num_running=3),
        ReplicaLoad("idle", num_free_blocks=50, kv_usage=0.6, num_running=1),
        ReplicaLoad("low", num_free_blocks=40, kv_usage=0.2, num_running=9),
    ]
    decision = LeastKVPolicy().choose(request, state)
    assert decision.ranked == ["low", "idle", "busy", "full"] and decision.reason == "least_kv"
    none_fit = [ReplicaLoad("x", num_free_blocks=2), ReplicaLoad("y", num_free_blocks=6)]
    decision = LeastKVPolicy().choose(request, none_fit)
    assert decision.ranked == ["y", "x"] and decision.reason == "no_room"


def test_decode_policy_counts_what_the_router_sent_since_the_stats():
    request = RouteRequest("r", num_prompt_tokens=100, block_size=16)  # needs 7 blocks
    # a: 10 of 100 blocks held by stats, plus 7 sent since (0.17); b: 0.15 by stats, nothing since.
    state = [
        ReplicaLoad("a", num_free_blocks=90, num_blocks=100, kv_usage=0.10, unreported_blocks=7, unreported_sequences=1),
        ReplicaLoad("b", num_free_blocks=85, num_blocks=100, kv_usage=0.15, num_running=1),
    ]
    assert LeastKVPolicy().choose(request, state).ranked == ["b", "a"]
    # Equal usage (7 blocks each): the sequences sent since count beside the running ones.
    tie = [
        ReplicaLoad("a", num_free_blocks=100, num_blocks=100, kv_usage=0.0, unreported_blocks=7, unreported_sequences=1),
        ReplicaLoad("b", num_free_blocks=93, num_blocks=100, kv_usage=0.07, num_running=2),
    ]
    assert LeastKVPolicy().choose(request, tie).ranked == ["a", "b"]
    # The blocks sent since are no longer free: a has 10 - 7 = 3 < 7 left, so it does not fit.
    short = [
        ReplicaLoad("a", num_free_blocks=10, num_blocks=100, kv_usage=0.9, unreported_blocks=7),
        ReplicaLoad("b", num_free_blocks=8, num_blocks=100, kv_usage=0.92),
    ]
    decision = LeastKVPolicy().choose(request, short)
    assert decision.ranked == ["b", "a"] and decision.reason == "least_kv"
    short[1].unreported_blocks = 4
    decision = LeastKVPolicy().choose(request, short)
    assert decision.ranked == ["b", "a"] and decision.reason == "no_room"  # 4 free against 3


def test_baselines_and_build_policy():
    rr = RoundRobinPolicy()
    state = loads(a=0, b=0, c=0)
    assert [rr.choose(REQUEST, state).chosen for _ in range(4)] == ["a", "b", "c", "a"]
    pow2 = PowerOfTwoPolicy(seed=0)
    assert pow2.choose(REQUEST, loads(a=5, b=0)).chosen == "b"
    assert isinstance(build_policy("prefix_cost", max_imbalance_tokens=10), PrefixCostPolicy)
    with pytest.raises(ValueError, match="unknown routing policy 'nope'"):
        build_policy("nope")
    with pytest.raises(ValueError, match="routing policy 'prefix_cost': unknown parameter 'bogus' \\(allowed: default_prefill"):
        build_policy("prefix_cost", bogus=1)
    with pytest.raises(ValueError, match=r"max_imbalance_ratio must be >= 1 or null, got 0.5"):
        build_policy("prefix_cost", max_imbalance_ratio=0.5)


@pytest.mark.parametrize(("params", "message"), [
    ({"admission": "off"}, "admission must be bool, got 'off' (str)"),
    ({"session_affinity": 1}, "session_affinity must be bool, got 1 (int)"),
    ({"max_load_ratio": "1.2"}, "max_load_ratio must be float or null, got '1.2' (str)"),
    ({"load_window_per_replica": 3.5}, "load_window_per_replica must be int, got 3.5 (float)"),
    ({"load_window_per_replica": True}, "load_window_per_replica must be int, got True (bool)"),
])
def test_a_parameter_of_the_wrong_type_is_refused_by_name(params, message):
    """YAML gives strings where a user quotes a value: 'off' would be a true bool in Python."""
    with pytest.raises(ValueError) as info:
        build_policy("prefix_cost", **params)
    assert str(info.value) == f"routing policy 'prefix_cost': {message}"


def test_numbers_of_either_kind_and_null_where_allowed_are_accepted():
    policy = build_policy("prefix_cost", max_load_ratio=2, tie_tolerance=0, max_imbalance_ratio=None, admission=False)
    assert (policy.max_load_ratio, policy.tie_tolerance, policy.max_imbalance_ratio, policy.admission) == (2, 0, None, False)
