"""RouterState: stats feed the index and the loads, routed tokens count until stats cover them."""

from __future__ import annotations

from router.index import encode_hashes
from router.policies import LeastKVPolicy, PrefixCostPolicy, RouteRequest
from router.replica_stats import RoutingStats
from router.routing_state import InflightTokens, RouterState, load_from_stats

PREFIX = [11, 12, 13, 14]  # 4 blocks of 16 tokens


def stats(time_s: float, queued: int = 0, hashes=(), version: int = 1, **more) -> RoutingStats:
    return RoutingStats(
        kv_version=version, kv_hashes=encode_hashes(hashes), wall_time_s=time_s,
        num_queued_prefill_tokens=queued, prefill_tokens_per_s=1000.0, num_running=1, **more,
    )


def test_load_from_stats_defaults_and_fields():
    assert load_from_stats("a", None).num_queued_prefill_tokens == 0
    load = load_from_stats("a", stats(0.0, queued=7, num_free_blocks=3, kv_usage=0.5))
    assert (load.num_queued_prefill_tokens, load.prefill_tokens_per_s, load.num_running) == (7, 1000.0, 1)
    assert (load.num_free_blocks, load.kv_usage) == (3, 0.5)


def test_inflight_tokens_until_stats_cover_them_or_the_horizon():
    inflight = InflightTokens(horizon_s=10.0)
    inflight.add("a", 1.0, 100)
    inflight.add("a", 2.0, 50)
    assert inflight.unreported("a", stats_time=0.5, now=2.0) == 150
    assert inflight.unreported("a", stats_time=1.0, now=2.0) == 50  # stats at 1.0 include the first
    assert inflight.unreported("a", stats_time=1.0, now=12.5) == 0  # older than the horizon
    assert inflight.unreported("b", stats_time=0.0, now=0.0) == 0
    inflight.add("a", 13.0, 20, 2)
    inflight.add("a", 14.0, 30, 3)
    assert inflight.unreported_load("a", stats_time=10.0, now=14.0) == (50, 5, 2, 0)
    assert inflight.unreported_load("a", stats_time=13.0, now=14.0) == (30, 3, 1, 0)


def test_a_completed_request_leaves_the_sent_count_or_the_stats_that_still_count_it():
    """Serve says when a request completed (on_request_completed): the replica that answered it
    no longer looks busy with it, whether the router still counted it as sent or its stats, taken
    while it ran, count it as queued."""
    state = RouterState(PrefixCostPolicy(max_load_ratio=None))  # two requests on one replica of two: no spill
    holder = stats(0.0, hashes=PREFIX)

    def send(i: int, at: float, holder_stats: RoutingStats) -> str:
        request = RouteRequest(f"r{i}", num_prompt_tokens=80, block_hashes=PREFIX + [20 + i], block_size=16)
        return state.route(request, [("a", stats(0.0)), ("b", holder_stats)], now=at, key=f"serve-{i}").chosen

    assert send(0, 1.0, holder) == "b" and state.load("b", holder, now=1.01).num_queued_prefill_tokens == 16
    state.completed("serve-0", 1.05)  # before any stats covered it: out of the sent count
    load = state.load("b", holder, now=1.06)
    assert (load.num_queued_prefill_tokens, load.unreported_done_tokens) == (0, 16)  # computed: load its counters lack
    assert state.index.num_matched_blocks("b", PREFIX + [20]) == 5  # its blocks stay until a snapshot should show them
    assert send(1, 1.1, holder) == "b"
    running = stats(1.15, queued=16, hashes=PREFIX, version=2)  # taken while r1 ran: it counts it
    assert state.load("b", running, now=1.2).num_queued_prefill_tokens == 16
    state.completed("serve-1", 1.3)
    load = state.load("b", running, now=1.35)
    assert (load.num_queued_prefill_tokens, load.unreported_done_tokens) == (0, 16)  # the stale stats' 16 taken off
    assert state.load("b", stats(1.15, queued=5, hashes=PREFIX, version=2), now=1.35).num_queued_prefill_tokens == 0  # never below 0
    later = stats(1.4, queued=3, hashes=PREFIX, version=3)  # taken after they completed: as they are
    load = state.load("b", later, now=1.45)
    assert (load.num_queued_prefill_tokens, load.unreported_done_tokens) == (3, 0)
    state.completed("serve-1", 1.5)  # again, and a key never sent: nothing
    state.completed("nobody", 1.5)
    assert state.load("b", later, now=1.55).num_queued_prefill_tokens == 3


def test_a_sequence_that_completed_leaves_the_decode_pools_counts():
    state = RouterState(LeastKVPolicy())
    request = RouteRequest("r", num_prompt_tokens=100, block_size=16)  # 7 blocks
    assert state.route(request, [("a", decode_stats(0.0, 0, 0))], now=0.1, key="s").chosen == "a"
    busy = decode_stats(0.2, 7, 1)  # its stats hold the sequence
    state.completed("s", 0.3)
    load = state.load("a", busy, now=0.35)
    assert (load.unreported_blocks, load.unreported_sequences) == (-7, -1)  # least_kv sees it free again


def decode_stats(time_s: float, used_blocks: int, running: int) -> RoutingStats:
    return RoutingStats(wall_time_s=time_s, num_blocks=100, num_free_blocks=100 - used_blocks, kv_usage=used_blocks / 100,
                        num_running=running)


def test_least_kv_spreads_a_burst_between_two_stats():
    """Six requests of 7 blocks arrive between two stats of idle replicas a and b: before the
    router counted what it sent, all six went to a (same stale figures, same ranking)."""
    state = RouterState(LeastKVPolicy())
    request = RouteRequest("r", num_prompt_tokens=100, block_size=16)  # 7 blocks
    idle = [("a", decode_stats(0.0, 0, 0)), ("b", decode_stats(0.0, 0, 0))]
    chosen = [state.route(request, idle, now=0.1 + 0.05 * i).chosen for i in range(6)]
    assert chosen == ["a", "b", "a", "b", "a", "b"]
    assert state.load("a", decode_stats(0.0, 0, 0), now=0.4).unreported_blocks == 21
    # New stats of a, taken at 0.22 (after its first two requests, 0.1 and 0.2), hold their 14
    # blocks; the third (0.3) is still counted: 14 + 7 = 21 blocks against b's 21 unreported.
    a_new = decode_stats(0.22, 14, 2)
    load_a = state.load("a", a_new, now=0.4)
    assert (load_a.unreported_blocks, load_a.unreported_sequences) == (7, 1)
    assert state.route(request, [("a", a_new), ("b", decode_stats(0.0, 0, 0))], now=0.4).chosen == "a"
    # ...a tie on usage (0.21 each) and on sequences (3 each): the first candidate. Then b.
    assert state.route(request, [("a", a_new), ("b", decode_stats(0.0, 0, 0))], now=0.41).chosen == "b"
    assert state.decisions == {"least_kv": 8}


def test_route_follows_the_snapshot_then_counts_what_it_sent():
    state = RouterState(PrefixCostPolicy())
    request = RouteRequest("r1", num_prompt_tokens=80, block_hashes=PREFIX + [15], block_size=16)
    candidates = [("a", stats(0.0)), ("b", stats(0.0, hashes=PREFIX))]
    decision = state.route(request, candidates, now=1.0)
    assert decision.chosen == "b" and decision.num_matched_tokens == 64
    # b now carries the 16 uncached tokens it was sent after its stats, and the request's hashes.
    assert state.load("b", stats(0.0, hashes=PREFIX), now=1.5).num_queued_prefill_tokens == 16
    assert state.index.num_matched_blocks("b", PREFIX + [15]) == 5
    # Newer stats cover the request: its tokens are no longer added; the snapshot replaces the guess.
    assert state.load("b", stats(2.0, queued=3, hashes=PREFIX, version=2), now=2.5).num_queued_prefill_tokens == 3
    assert state.index.num_matched_blocks("b", PREFIX + [15]) == 4
    assert state.decisions == {"prefix_hit": 1}


def test_route_forgets_replicas_that_left():
    state = RouterState(PrefixCostPolicy())
    request = RouteRequest("r", num_prompt_tokens=80, block_hashes=PREFIX, block_size=16)
    state.route(request, [("a", stats(0.0, hashes=PREFIX)), ("b", stats(0.0))], now=1.0)
    state.route(request, [("b", stats(0.0))], now=1.0)
    assert state.index.replicas == ["b"]
    state.remove("b")
    assert state.index.replicas == []


def test_routing_stats_round_trip_the_wire_and_ignore_unknown_keys():
    sent = stats(2.5, queued=9, hashes=[7, 8], version=4, num_blocks=64, metrics=(("m", "gauge", "help", []),))
    wire = sent.to_wire()
    assert type(wire) is dict and RoutingStats.from_wire(wire) == sent
    assert RoutingStats.from_wire({**wire, "added_by_a_newer_worker": 1}) == sent
    assert RoutingStats.from_wire({}) is None and RoutingStats.from_wire(None) is None


def test_a_routed_prompt_stays_in_the_index_until_a_snapshot_should_show_it():
    state = RouterState(PrefixCostPolicy())
    request = RouteRequest("r1", num_prompt_tokens=80, block_hashes=PREFIX + [15], block_size=16)
    decision = state.route(request, [("a", stats(0.0, queued=900)), ("b", stats(0.0))], now=1.0)
    # b: 80 cold tokens at 1000/s: TTFT 0.08 s; the prompt should be in b's snapshots from 1.16.
    assert decision.chosen == "b" and decision.estimated_ttft_s["b"] == 0.08
    # A snapshot taken at 1.1 does not have it yet (it is still queued there): kept over it.
    state.load("b", stats(1.1, version=2), now=1.15)
    assert state.index.num_matched_blocks("b", PREFIX + [15]) == 5
    # One taken at 1.2 should have it; it does not (evicted since): the index follows it.
    state.load("b", stats(1.2, version=3), now=1.25)
    assert state.index.num_matched_blocks("b", PREFIX + [15]) == 0
    assert state.pending.unsettled("b", stats_time=1.2, now=1.25) == []


def test_a_router_started_while_the_caches_are_warm_routes_by_them_at_once():
    """A new ingress replica's router has no history; the replicas' stats carry their snapshots
    (every router reads the same ones), so its first decision already follows the prefix."""
    fresh = RouterState(PrefixCostPolicy())
    request = RouteRequest("first", num_prompt_tokens=80, block_hashes=PREFIX + [15], block_size=16)
    candidates = [("a", stats(5.0)), ("b", stats(5.0, hashes=PREFIX)), ("c", stats(5.0))]
    decision = fresh.route(request, candidates, now=5.1)
    assert (decision.chosen, decision.reason, decision.num_matched_tokens) == ("b", "prefix_hit", 64)


def test_each_decision_predicts_the_tokens_its_replica_holds_capped_as_an_engine_caps_a_hit():
    """Whatever the policy, the router's index says what the chosen replica holds of the prompt;
    an engine computes the prompt's last token whatever it holds, so a 64-token prompt whose four
    blocks are all cached can find 48 of them, a 65-token one all 64."""
    from router.policies import RoundRobinPolicy

    for policy in (PrefixCostPolicy(), RoundRobinPolicy()):
        state = RouterState(policy)
        held = [("a", stats(0.0, hashes=PREFIX))]
        assert state.route(RouteRequest("r1", 65, PREFIX, 16), held, now=1.0).num_predicted_tokens == 64
        assert state.route(RouteRequest("r2", 64, PREFIX, 16), held, now=1.0).num_predicted_tokens == 48
        assert state.route(RouteRequest("r3", 80, [11, 12, 99], 16), held, now=1.0).num_predicted_tokens == 32
        assert state.route(RouteRequest("r4", 10, [], 16), held, now=1.0).num_predicted_tokens == 0
    # The prediction is made before the request's own hashes are noted on its replica.
    state = RouterState(PrefixCostPolicy())
    cold = RouteRequest("r5", 80, [21, 22, 23, 24, 25], 16)
    assert state.route(cold, [("a", stats(0.0))], now=1.0).num_predicted_tokens == 0
    assert state.route(RouteRequest("r6", 80, cold.block_hashes, 16), [("a", stats(0.0))], now=1.0).num_predicted_tokens == 64


def test_the_replicas_reuse_reports_reach_the_policy_once_per_stats_and_leave_with_the_replica():
    state = RouterState(PrefixCostPolicy(reuse_window_requests=10**9))
    reuse = state.policy.reuse
    request = RouteRequest("r", num_prompt_tokens=32, block_hashes=[5, 6], block_size=16)
    a = stats(1.0, hashes=[1, 2], block_reuse={1: 3.0}, block_reuse_weight=4.0)
    b = stats(1.0, hashes=[1], block_reuse={1: 1.0}, block_reuse_weight=4.0)
    state.route(request, [("a", a), ("b", b)], now=1.1)
    assert abs(reuse.probability(1) - 0.5) < 1e-9  # (3 + 1) / 8, none of it from this router's own counts
    absorbed = []
    reuse.absorb = lambda *args: absorbed.append(args)  # the same stats again: nothing to absorb
    state.route(request, [("a", a), ("b", b)], now=1.2)
    assert absorbed == []
    state.route(request, [("a", stats(1.5, hashes=[1, 2], block_reuse={1: 2.0}, block_reuse_weight=4.0))], now=1.6)
    # b left the candidates: its report is taken out of the pool (forget); a's newer one is read.
    assert absorbed == [("b", {}, 0.0), ("a", {1: 2.0}, 4.0)]
    del reuse.absorb
    assert "b" not in reuse._reports
