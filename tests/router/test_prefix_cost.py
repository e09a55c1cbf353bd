"""PrefixCostPolicy's issue-19 terms on hand-built states: what a placement evicts, the delay it
causes, the load bound's exemption for cold prefixes, and ties that never trade a holder away."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from router.index import PrefixIndex
from router.policies import PrefixCostPolicy, ReplicaLoad, RouteRequest

PREFIX = [1, 2, 3, 4]  # 4 blocks of 16 tokens


def load(name: str, queued: int = 0, rate: float = 1000.0, requests_per_s: float = 0.0) -> ReplicaLoad:
    return ReplicaLoad(name, num_queued_prefill_tokens=queued, prefill_tokens_per_s=rate, requests_per_s=requests_per_s)


def policy(**params) -> PrefixCostPolicy:
    return PrefixCostPolicy(reuse_window_requests=10**9, **params)  # no decay: p = uses / requests


def test_a_cold_prompt_goes_where_it_evicts_the_least_wanted_blocks():
    # a's oldest blocks are a prefix three of four recent requests used; b's are a suffix seen once.
    p = policy(tie_tolerance=0.05)
    for _ in range(3):
        p.reuse.observe([10, 11, 12, 13], num_new_blocks=4)
    p.reuse.observe(list(range(20, 28)), num_new_blocks=8)
    index = PrefixIndex()
    index.update("a", 1, [10, 11, 12, 13, 14, 15, 16, 17], num_blocks=8)  # full, 10 the oldest
    index.update("b", 1, list(range(20, 28)), num_blocks=8)
    request = RouteRequest("r", num_prompt_tokens=64, block_hashes=[30, 31, 32, 33], block_size=16)
    decision = p.choose(request, [load("a"), load("b")], index)
    # Horizon: 16 pool blocks / (20 new blocks / 4 requests) = 3.2 requests. Each victim costs
    # 16 tokens / 1000 per s x P(wanted): 4 x (1 - e^(-0.75 x 3.2)) on a, 4 x (1 - e^(-0.25 x 3.2)) on b.
    assert decision.eviction_s == pytest.approx({
        "a": 4 * 0.016 * (1 - math.exp(-2.4)), "b": 4 * 0.016 * (1 - math.exp(-0.8)),
    })
    assert (decision.chosen, decision.reason) == ("b", "least_cost")
    assert decision.estimated_ttft_s == {"a": 0.064, "b": 0.064}
    # Room on a (two of its eight blocks empty and the prompt needs two): nothing evicted there.
    index.update("a", 2, [10, 11, 12, 13, 14, 15], num_blocks=8)
    short = RouteRequest("s", num_prompt_tokens=32, block_hashes=[40, 41], block_size=16)
    decision = p.choose(short, [load("a"), load("b")], index)
    assert "a" not in decision.eviction_s and decision.chosen == "a"
    # Without the term the two are alike again (no eviction priced).
    assert policy(price_evictions=False).choose(request, [load("a"), load("b")], index).eviction_s == {}


def test_the_delay_a_cold_prefill_causes_keeps_a_request_with_its_busy_holder():
    # a holds the prefix but has 100 tokens queued; b is idle and has room. At 100 tokens/s:
    # ttft a = (16 + 100) / 100 = 1.16 s, b = 80 / 100 = 0.8 s. b's 0.8 s of prefill delays the
    # requests arriving there meanwhile: at least the pool's mean of 2 per s, 2 x 0.8^2 / 2.
    request = RouteRequest("r", num_prompt_tokens=80, block_hashes=PREFIX + [5], block_size=16)
    loads = [load("a", queued=100, rate=100.0, requests_per_s=4.0), load("b", rate=100.0)]
    index = PrefixIndex()
    index.update("a", 1, PREFIX)
    decision = policy().choose(request, loads, index)
    assert decision.delay_s == pytest.approx({"a": 4 * 0.16**2 / 2, "b": 2 * 0.8**2 / 2})
    # b's total, 1.44 s, is within a's 1.21 x 1.25 but holds less of the prompt: not a tie.
    assert (decision.chosen, decision.reason, decision.num_matched_tokens) == ("a", "prefix_hit", 64)
    # Priced on TTFT alone, the idle replica would compute a second copy.
    decision = policy(price_delay=False).choose(request, loads, index)
    assert (decision.chosen, decision.reason, decision.delay_s) == ("b", "least_cost", {})


def test_the_load_bound_spares_a_cold_prefix_and_spreads_a_hot_one():
    request = RouteRequest("r", num_prompt_tokens=80, block_hashes=PREFIX + [5], block_size=16)
    index = PrefixIndex()
    index.update("a", 1, PREFIX)
    loads = [load("a"), load("b"), load("c", queued=5)]

    def over_the_bound(uses_of_prefix: int, requests_by_replica: dict[str, float]) -> PrefixCostPolicy:
        p = policy(tie_tolerance=0.05)
        for i in range(100):
            p.reuse.observe(PREFIX if i < uses_of_prefix else [1000 + i], num_new_blocks=1)
        # bound = 1.25 x (1400 + 16) / 3 = 590: a's 1000 + 16 is over it.
        p.routed_tokens = {"a": 1000.0, "b": 200.0, "c": 200.0}
        p.routed_requests = requests_by_replica
        return p

    even = {"a": 4.0, "b": 4.0, "c": 4.0}
    # 1 request in 100 used the prefix: 0.01 x 3 replicas <= 1 holder. Spilling it would compute
    # it again elsewhere to spare a one hit: it stays.
    decision = over_the_bound(1, even).choose(request, loads, index)
    assert (decision.chosen, decision.reason) == ("a", "prefix_hit")
    # Half the requests use it: 0.5 x 3 > 1 holder, more than one replica's share: it spreads.
    decision = over_the_bound(50, even).choose(request, loads, index)
    assert (decision.chosen, decision.reason) == ("b", "load_bound")
    # A cold prefix on a replica that takes more than 1.25 x its share of requests (10 of 12
    # here: 2.5 x) is not spared either: that replica holds too much, and the bound moves it.
    decision = over_the_bound(1, {"a": 10.0, "b": 1.0, "c": 1.0}).choose(request, loads, index)
    assert (decision.chosen, decision.reason) == ("b", "load_bound")
    # The replicas' own request rates, where reported, stand for what this router sent them
    # (every router reads the same): here a takes 5 of 7 requests a second.
    reported = [load("a", requests_per_s=5.0), load("b", requests_per_s=1.0), load("c", queued=5, requests_per_s=1.0)]
    decision = over_the_bound(1, even).choose(request, reported, index)
    assert (decision.chosen, decision.reason) == ("b", "load_bound")


def test_ties_break_by_queue_then_routed_load_among_equal_holders():
    request = RouteRequest("r", num_prompt_tokens=80, block_hashes=[50, 51, 52, 53, 54], block_size=16)
    p = policy()
    p.routed_tokens = {"a": 300.0, "b": 100.0, "c": 200.0}
    # All cold and idle: within 25% of each other; the least routed load wins.
    decision = p.choose(request, [load("a"), load("b"), load("c")], PrefixIndex())
    assert (decision.chosen, decision.reason) == ("b", "tie_break")
    decision = p.choose(request, [load("a"), load("b", queued=10), load("c")], PrefixIndex())
    assert (decision.chosen, decision.reason) == ("c", "tie_break")  # a queue first, then load


def counted(name: str, computed: int, requests: int, queued: int = 0) -> ReplicaLoad:
    """A replica's load with the cumulative counters of its stats."""
    return ReplicaLoad(name, num_queued_prefill_tokens=queued, prefill_tokens_per_s=1000.0,
                       num_computed_tokens=computed, num_requests=requests)


def test_the_load_bound_counts_what_the_replicas_report_the_same_on_every_router():
    request = RouteRequest("r", num_prompt_tokens=80, block_hashes=PREFIX + [5], block_size=16)
    index = PrefixIndex()
    index.update("a", 1, PREFIX)
    first = [counted("a", 1, 1), counted("b", 1, 1), counted("c", 1, 1, queued=5)]
    later = [counted("a", 1001, 11), counted("b", 201, 3), counted("c", 201, 3, queued=5)]
    one, other = policy(tie_tolerance=0.05), policy(tie_tolerance=0.05)
    other.routed_tokens = {"a": 0.0, "b": 10**6, "c": 0.0}  # what this router sent itself: not the load
    for router in (one, other):
        # The first stats are a baseline: no load yet, and one prompt outweighs the pool's mean
        # (5 / 3 tokens) everywhere; those at or under it stay eligible: the holder keeps it.
        decision = router.choose(request, first, index)
        assert (decision.chosen, decision.reason) == ("a", "prefix_hit")
    for router in (one, other):
        # a computed 1000 tokens for 10 of the 14 requests since; the clock moves 1 / (64 x 3)
        # per request, a's first: a = 1000 e^(-4/192), b = 200 e^(-2/192), c = 200 (+ 5 queued).
        decision = router.choose(request, later, index)
        assert router.pool.tokens("a") == pytest.approx(1000 * math.exp(-4 / 192))
        # bound = 1.25 x (979.4 + 197.9 + 205 + 16) / 3 = 582.7: a's 995 is over, and a takes
        # 2.1 x its share of the requests: not spared. b (0.08 s) beats c (0.085 s).
        assert (decision.chosen, decision.reason) == ("b", "load_bound")


def test_with_nobody_within_the_bound_the_replicas_at_or_under_the_mean_stay_eligible():
    # A 2000-token prompt outweighs the bound everywhere: 1.25 x (1000 + 1936) / 3 = 1223.
    request = RouteRequest("r", num_prompt_tokens=2000, block_hashes=PREFIX + [5], block_size=16)
    index = PrefixIndex()
    index.update("a", 1, PREFIX)
    p = policy(tie_tolerance=0.05)
    p.routed_tokens = {"a": 1000.0, "b": 0.0, "c": 0.0}
    p.routed_requests = {"a": 10.0, "b": 1.0, "c": 1.0}  # a takes 10 of 12 requests: not spared
    decision = p.choose(request, [load("a"), load("b"), load("c", queued=5)], index)
    # The mean is 333 tokens: b and c stay eligible, a (1000) does not.
    assert (decision.chosen, decision.reason) == ("b", "load_bound")


def test_equal_cold_candidates_go_where_rendezvous_hashing_puts_the_prefix_on_every_router():
    # Four idle replicas, nothing cached: every one is a tie. Two routers that know nothing of
    # each other send a new prefix to the same replica; different prefixes spread.
    def first_choice(prefix_head: int) -> str:
        request = RouteRequest("r", num_prompt_tokens=80, block_hashes=[prefix_head, 2, 3, 4, 5], block_size=16)
        return policy().choose(request, [load(name) for name in "abcd"], PrefixIndex()).chosen

    choices = [first_choice(head) for head in range(1000, 1064)]
    assert choices == [first_choice(head) for head in range(1000, 1064)]
    assert Counter(choices) == {"a": 14, "b": 15, "c": 19, "d": 16}  # 64 prefixes, 16 each on average


def test_admission_keeps_new_blocks_only_where_they_are_worth_what_they_would_push_out():
    # a is full: 10-13 go to make room for the prompt whatever happens; keeping the prompt's
    # blocks would make the next prompt evict 14-17 instead of them.
    def state(hot: list[int]) -> PrefixCostPolicy:
        p = policy()
        for _ in range(3):
            p.reuse.observe(hot, num_new_blocks=4)
        return p

    full = PrefixIndex()
    full.update("a", 1, [10, 11, 12, 13, 14, 15, 16, 17], num_blocks=8)
    cold_prompt = RouteRequest("r", num_prompt_tokens=64, block_hashes=[30, 31, 32, 33], block_size=16)
    # 14-17 were used by three of the four requests so far, the prompt's blocks by this one only.
    decision = state([14, 15, 16, 17]).choose(cold_prompt, [load("a")], full)
    assert (decision.chosen, decision.retain) == ("a", False)
    # The same prompt when it is the popular one and 14-17 are not: kept.
    assert state([30, 31, 32, 33]).choose(cold_prompt, [load("a")], full).retain is True
    # Room for the prompt (4 of 8 blocks empty): nothing is lost by keeping it.
    roomy = PrefixIndex()
    roomy.update("a", 1, [14, 15, 16, 17], num_blocks=8)
    assert state([14, 15, 16, 17]).choose(cold_prompt, [load("a")], roomy).retain is True
    # Admission off: always kept.
    p = PrefixCostPolicy(reuse_window_requests=10**9, admission=False)
    for _ in range(3):
        p.reuse.observe([14, 15, 16, 17], num_new_blocks=4)
    assert p.choose(cold_prompt, [load("a")], full).retain is True


def test_a_lora_request_prices_the_adapter_load_where_it_is_not_resident():
    """Idle, cold replicas: the one with the adapter resident wins by exactly the others' load
    time; a holder whose queue costs more than a load elsewhere does not; a base-model request
    sees no such term."""
    request = RouteRequest("r", num_prompt_tokens=80, block_hashes=[60, 61, 62, 63, 64], block_size=16, lora_name="sql")

    def with_lora(name: str, resident: bool, queued: int = 0) -> ReplicaLoad:
        return ReplicaLoad(name, num_queued_prefill_tokens=queued, prefill_tokens_per_s=1000.0,
                           lora_resident=frozenset({"sql"} if resident else ()), lora_load_s=0.05)

    decision = policy().choose(request, [with_lora("a", False), with_lora("b", True), with_lora("c", False)], PrefixIndex())
    assert decision.chosen == "b"
    assert decision.estimated_ttft_s["a"] - decision.estimated_ttft_s["b"] == pytest.approx(0.05)
    busy = policy().choose(request, [with_lora("a", False), with_lora("b", True, queued=1000)], PrefixIndex())
    assert busy.chosen == "a"  # 0.08 + 0.05 s against 0.08 + 1.0 s
    base = RouteRequest("r", num_prompt_tokens=80, block_hashes=[60, 61, 62, 63, 64], block_size=16)
    plain = policy().choose(base, [with_lora("a", False), with_lora("b", True)], PrefixIndex())
    assert plain.estimated_ttft_s["a"] == plain.estimated_ttft_s["b"] == pytest.approx(0.08)


def test_an_adapter_sent_to_a_replica_counts_as_resident_there_until_its_stats_catch_up():
    from router.prefix_cost import DEFAULT_LORA_LOAD_S, LORA_SENT_S

    p = policy(max_load_ratio=None)  # the adapter's term alone (the load bound spreads a hot adapter too)
    now = [100.0]
    p.clock = lambda: now[0]
    idle = [load("a"), load("b"), load("c")]  # no stats of any load yet: the default load time
    first = p.choose(RouteRequest("1", 80, [70, 71, 72, 73, 74], 16, lora_name="sql"), idle, PrefixIndex())
    others = [r for r in "abc" if r != first.chosen]
    assert first.estimated_ttft_s[others[0]] == pytest.approx(0.08 + DEFAULT_LORA_LOAD_S)
    # another prompt for the same adapter follows it, though routed load would tie-break elsewhere
    second = p.choose(RouteRequest("2", 80, [80, 81, 82, 83, 84], 16, lora_name="sql"), idle, PrefixIndex())
    assert second.chosen == first.chosen
    assert second.estimated_ttft_s[first.chosen] == pytest.approx(0.08)
    now[0] += LORA_SENT_S  # its stats never listed it: a load again, like anywhere else
    third = p.choose(RouteRequest("3", 80, [90, 91, 92, 93, 94], 16, lora_name="sql"), idle, PrefixIndex())
    assert len(set(third.estimated_ttft_s.values())) == 1


def test_a_replica_whose_adapter_slots_are_all_busy_costs_a_wait_and_cold_loaders_still_tie():
    from router.prefix_cost import LORA_NO_SLOT_S

    request = RouteRequest("r", num_prompt_tokens=80, block_hashes=[60, 61, 62, 63, 64], block_size=16, lora_name="sql")
    full = ReplicaLoad("a", prefill_tokens_per_s=1000.0, lora_load_s=0.02, lora_slots_free=0)
    free = ReplicaLoad("b", prefill_tokens_per_s=1000.0, lora_load_s=0.03, lora_slots_free=2)
    decision = policy().choose(request, [full, free], PrefixIndex())
    assert decision.chosen == "b"
    assert decision.estimated_ttft_s["a"] == pytest.approx(0.08 + 0.02 + LORA_NO_SLOT_S)
    # two replicas that must both load it, at different measured costs, are still ties: the
    # routed load breaks them (the load bound aside)
    p = policy(max_load_ratio=None)
    p.routed_tokens = {"a": 500.0, "b": 0.0}
    loaders = [ReplicaLoad("a", prefill_tokens_per_s=1000.0, lora_load_s=0.02),
               ReplicaLoad("b", prefill_tokens_per_s=1000.0, lora_load_s=0.03)]
    tied = p.choose(request, loaders, PrefixIndex())
    assert (tied.chosen, tied.reason) == ("b", "tie_break")
