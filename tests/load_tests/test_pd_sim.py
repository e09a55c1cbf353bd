"""The prefill/decode simulator on tiny deterministic workloads: exact times from a cost fit whose
coefficients are powers of two (every sum below is exact in floating point)."""

from __future__ import annotations

import math

import pytest

from load_tests.pd.costs import CostFit, CostLine, HandoffCost, LayoutOverhead, ServeOverhead, StepCost, chunk_pairs
from load_tests.pd.routing import KvrelayRouters, measure_step, routing_stats
from load_tests.pd.sim import SimRequest, simulate, summarize, ttft_split_ms
from serving.engine.prefill_rate import PrefillRate

BASE, TOKEN, ROW, PAIR, CONTEXT = 2**-6, 2**-10, 2**-9, 2**-20, 2**-16
STEP = StepCost((CostLine(BASE, TOKEN, ROW),), pair_s=PAIR, context_s=CONTEXT)
HANDOFF = HandoffCost(2**-7, 4, 2**12)  # 1/128 s + 1 ms per 1024 bytes, 4 bytes a token


def make_fit(**changes) -> CostFit:
    return CostFit(**{"name": "test", "step": STEP, "handoff": HANDOFF, **changes})


def prefill_s(tokens: int, computed: int = 0, *, rows: int = 1) -> float:
    return BASE + TOKEN * tokens + ROW * rows + PAIR * chunk_pairs(tokens, computed)


def decode_s(context: int) -> float:
    return BASE + TOKEN + ROW + CONTEXT * context


def test_one_request_colocated_ttft_is_its_prefill_step_and_tpot_its_decode_steps():
    run = simulate([SimRequest(0, 0.0, 64, 3)], make_fit(), "colocated", num_decode=1)
    (result,) = run.results
    assert result.ttft_s == prefill_s(64)
    # the two decode steps read 65 then 66 tokens
    assert result.last_token_s == prefill_s(64) + decode_s(65) + decode_s(66)
    assert result.tpot_s == (decode_s(65) + decode_s(66)) / 2
    assert run.num_steps == 3 and run.busy_s == [result.last_token_s]


def test_a_prompt_chunk_slows_the_decode_step_it_shares_by_exactly_its_cost():
    # A decodes; B (300 tokens: long, 256 a step) arrives during A's first decode step
    a_first = prefill_s(16)
    b_arrival = a_first + 0.001
    run = simulate([SimRequest(0, 0.0, 16, 4), SimRequest(1, b_arrival, 300, 2)], make_fit(), "colocated", num_decode=1)
    a, b = run.results
    t2 = a_first + decode_s(17)  # A's second token, alone
    # A's third token comes from a step shared with B's first 256 tokens (which samples nothing)
    shared = BASE + TOKEN * (1 + 256) + ROW * 1 + PAIR * chunk_pairs(256, 0) + CONTEXT * 18
    assert shared - decode_s(18) == TOKEN * 256 + PAIR * chunk_pairs(256, 0)
    # then A's last token beside B's remaining 44 tokens, which end B's prompt: 2 rows sample
    last = BASE + TOKEN * (1 + 44) + ROW * 2 + PAIR * chunk_pairs(44, 256) + CONTEXT * 19
    assert a.ttft_s == a_first
    assert a.last_token_s == t2 + shared + last
    assert b.first_token_s == t2 + shared + last
    assert b.ttft_s == t2 + shared + last - b_arrival


def test_each_chunk_after_the_first_pays_for_the_prompt_computed_before_it():
    prefix = 2**-12
    fit = make_fit(step=StepCost((CostLine(BASE, TOKEN, ROW),), pair_s=PAIR, context_s=CONTEXT, prefix_s=prefix))
    run = simulate([SimRequest(0, 0.0, 600, 1)], fit, "colocated", num_decode=1)
    # 600 tokens, 256 a step: chunks after 0, 256 and 512 computed tokens, the last (88) samples
    chunks = [BASE + TOKEN * 256 + PAIR * chunk_pairs(256, 0),
              BASE + TOKEN * 256 + PAIR * chunk_pairs(256, 256) + prefix * 256,
              BASE + TOKEN * 88 + ROW + PAIR * chunk_pairs(88, 512) + prefix * 512]
    assert run.results[0].ttft_s == chunks[0] + chunks[1] + chunks[2]


def test_disaggregated_the_first_token_comes_from_the_prefill_and_the_rest_after_the_hand_off():
    run = simulate([SimRequest(0, 0.0, 64, 3)], make_fit(), "disaggregated", num_prefill=1, num_decode=1)
    (result,) = run.results
    assert (result.prefill_replica, result.decode_replica) == (0, 1)
    assert result.ttft_s == prefill_s(64)
    handoff = 2**-7 + 64 * 4 / 2**12
    assert HANDOFF.seconds(64) == handoff
    assert result.last_token_s == prefill_s(64) + handoff + decode_s(65) + decode_s(66)
    assert run.busy_s == [prefill_s(64), decode_s(65) + decode_s(66)]


def test_the_prefill_replicas_own_work_per_request_lengthens_the_step_that_admits_it():
    own = 2**-5
    fit = make_fit(overhead=ServeOverhead(disaggregated=LayoutOverhead(prefill_request_s=own)))
    # two prompts admitted in one step: it costs both prompts' work and twice the replica's own
    run = simulate([SimRequest(0, 0.0, 64, 2), SimRequest(1, 0.0, 64, 2)], fit, "disaggregated", num_prefill=1, num_decode=1)
    both = BASE + TOKEN * 128 + ROW * 2 + PAIR * 2 * chunk_pairs(64, 0)
    assert [r.ttft_s for r in run.results] == [both + 2 * own] * 2
    # the decode replica and the colocated layout do not pay it
    assert run.busy_s[0] == both + 2 * own
    colocated = simulate([SimRequest(0, 0.0, 64, 2)], make_fit(overhead=ServeOverhead(colocated=LayoutOverhead(prefill_request_s=own))),
                         "colocated", num_decode=1)
    assert colocated.results[0].ttft_s == prefill_s(64)


def test_other_processes_cpu_slows_the_busy_replicas_steps():
    # one replica, one core, half of it taken by another process: every step lasts twice as long
    run = simulate([SimRequest(0, 0.0, 64, 2)], make_fit(), "colocated", num_decode=1, foreign_cpu=0.5)
    assert run.results[0].ttft_s == 2 * prefill_s(64)
    assert run.results[0].last_token_s == 2 * (prefill_s(64) + decode_s(65))


def test_a_step_beside_another_replicas_step_takes_the_co_run_time_longer_scaled_by_how_short_that_step_is():
    # Two workers, a prompt each at t = 0: the second to start finds the first mid-step. With the
    # reference step longer than that prefill, it reads weights at least as often: the whole term.
    corun = 2**-8
    requests = [SimRequest(0, 0.0, 64, 1), SimRequest(1, 0.0, 64, 1)]
    whole = simulate(requests, make_fit(corun_s=corun, corun_ref_s=1.0), "colocated", num_decode=2, router="least_loaded")
    assert sorted(r.ttft_s for r in whole.results) == [prefill_s(64), prefill_s(64) + corun]
    # A reference step half the prefill's: the prefill reads the weights half as often, half the term.
    half = simulate(requests, make_fit(corun_s=corun, corun_ref_s=prefill_s(64) / 2), "colocated", num_decode=2, router="least_loaded")
    assert sorted(r.ttft_s for r in half.results) == [prefill_s(64), prefill_s(64) + corun / 2]
    # Alone on its replica (or without the term: the GPU fits) nothing is added.
    (alone,) = simulate(requests[:1], make_fit(corun_s=corun, corun_ref_s=1.0), "colocated", num_decode=2).results
    assert alone.ttft_s == prefill_s(64)
    plain = simulate(requests, make_fit(), "colocated", num_decode=2, router="least_loaded")
    assert [r.ttft_s for r in plain.results] == [prefill_s(64)] * 2


def test_the_co_run_term_counts_a_replicas_node_neighbour_not_the_whole_pool():
    # Four workers, four prompts at t = 0, two replicas to a node (ids 0-1, 2-3): each replica
    # that starts finds at most its one neighbour mid-step, never the other node's two.
    corun = 2**-8
    requests = [SimRequest(i, 0.0, 64, 1) for i in range(4)]
    run = simulate(requests, make_fit(corun_s=corun, corun_ref_s=1.0), "colocated", num_decode=4, router="least_loaded")
    assert sorted(r.ttft_s for r in run.results) == [prefill_s(64)] * 2 + [prefill_s(64) + corun] * 2


def test_the_same_two_requests_interfere_colocated_and_not_disaggregated():
    requests = [SimRequest(0, 0.0, 16, 4), SimRequest(1, prefill_s(16) + 0.001, 300, 2)]
    colocated = simulate(requests, make_fit(), "colocated", num_decode=1).results[0]
    disaggregated = simulate(requests, make_fit(), "disaggregated", num_prefill=1, num_decode=1).results[0]
    # disaggregated, A decodes alone on its decode replica: 17, 18, 19 tokens of context
    assert disaggregated.last_token_s - disaggregated.first_token_s == HANDOFF.seconds(16) + decode_s(17) + decode_s(18) + decode_s(19)
    assert colocated.tpot_s > disaggregated.tpot_s


def test_a_waiting_long_prompt_is_passed_over_for_a_short_one():
    requests = [SimRequest(0, 0.0, 600, 1), SimRequest(1, 0.0, 600, 1), SimRequest(2, 0.0, 16, 1)]
    run = simulate(requests, make_fit(), "colocated", num_decode=1)
    long1, long2, short = run.results
    # step 1: 256 of the first long prompt and the whole short one (the second long one waits)
    step1 = BASE + TOKEN * (256 + 16) + ROW * 1 + PAIR * (chunk_pairs(256, 0) + chunk_pairs(16, 0))
    assert short.ttft_s == step1
    assert long2.first_token_s > long1.first_token_s > short.first_token_s


def test_a_request_waits_for_kv_until_the_one_before_it_finishes():
    fit = make_fit(kv_capacity_tokens=100)  # one request of 40 + 20 at a time
    run = simulate([SimRequest(0, 0.0, 40, 20), SimRequest(1, 0.0, 40, 20)], fit, "colocated", num_decode=1)
    first, second = run.results
    assert second.first_token_s == first.last_token_s + prefill_s(40)


def test_the_served_path_overheads_are_added_per_request_per_step_and_per_row():
    fit = make_fit(overhead=ServeOverhead(colocated=LayoutOverhead(request_s=2**-5, step_s=2**-8, row_s=2**-10)))
    (result,) = simulate([SimRequest(0, 0.0, 64, 2)], fit, "colocated", num_decode=1).results
    assert result.ttft_s == 2**-5 + prefill_s(64) + 2**-8 + 2**-10
    assert result.tpot_s == decode_s(65) + 2**-8 + 2**-10


def test_the_ttft_split_is_the_request_overhead_the_replicas_queue_and_the_prefill():
    fit = make_fit(kv_capacity_tokens=100, overhead=ServeOverhead(colocated=LayoutOverhead(request_s=2**-5)))
    run = simulate([SimRequest(0, 0.0, 40, 20), SimRequest(1, 0.0, 40, 20)], fit, "colocated", num_decode=1)
    first, second = run.results
    # the second waits in the replica's queue for the first's KV (it finishes 19 decode steps later)
    assert (first.arrived_s, first.scheduled_s) == (2**-5, 2**-5)
    assert (second.arrived_s, second.scheduled_s) == (2**-5, first.last_token_s)
    split = ttft_split_ms(run.results)
    assert split == {"overhead": 2**-5 * 1e3, "queue": (first.last_token_s - 2**-5) / 2 * 1e3,
                     "prefill": prefill_s(40) * 1e3}
    assert sum(split.values()) == pytest.approx(summarize(run, {})["ttft_ms"]["mean"], rel=1e-12)
    assert summarize(run, {})["ttft_split_ms"] == split


def test_disaggregated_the_ttft_split_ends_at_the_prefill_replicas_first_token():
    run = simulate([SimRequest(0, 0.0, 64, 3)], make_fit(), "disaggregated", num_prefill=1, num_decode=1)
    assert ttft_split_ms(run.results) == {"overhead": 0.0, "queue": 0.0, "prefill": prefill_s(64) * 1e3}


def test_the_serving_processes_cpu_slows_the_busy_replicas_beyond_what_idle_cores_absorb():
    fit = make_fit(overhead=ServeOverhead(colocated=LayoutOverhead(background_cpu=0.5)))
    # one replica on one core: half of it is taken, every step lasts twice its cost
    (alone,) = simulate([SimRequest(0, 0.0, 64, 2)], fit, "colocated", num_decode=1).results
    assert alone.ttft_s == 2 * prefill_s(64)
    assert alone.tpot_s == 2 * decode_s(65)
    # two replicas, one busy: the idle one's core takes the half core
    (beside,) = simulate([SimRequest(0, 0.0, 64, 2)], fit, "colocated", num_decode=2).results
    assert beside.ttft_s == prefill_s(64)


def test_a_spare_core_takes_the_serving_processes_load_before_a_busy_replica_does():
    # the served probe's colocated layout: one worker, and a core no replica runs on
    fit = make_fit(overhead=ServeOverhead(colocated=LayoutOverhead(background_cpu=1.5)))
    (spare,) = simulate([SimRequest(0, 0.0, 64, 2)], fit, "colocated", num_decode=1, spare_cores=1).results
    assert spare.ttft_s == 2 * prefill_s(64)  # 1.5 cores of load: the spare takes 1, half the busy core is left taken
    (ample,) = simulate([SimRequest(0, 0.0, 64, 2)], fit, "colocated", num_decode=1, spare_cores=2).results
    assert ample.ttft_s == prefill_s(64) and ample.tpot_s == decode_s(65)


def test_the_serving_cpu_per_token_is_a_rate_over_the_last_second():
    overhead = LayoutOverhead(cpu_per_token_s=0.25)
    (result,) = simulate([SimRequest(0, 0.0, 64, 3)], make_fit(overhead=ServeOverhead(colocated=overhead)),
                         "colocated", num_decode=1).results
    first = prefill_s(64)
    # the first token's 0.25 CPU-s is a rate of 0.25 cores at once: the next step lasts 1 / 0.75
    second = decode_s(65) / 0.75
    assert result.last_token_s - first == pytest.approx(
        second + decode_s(66) / (1 - (0.25 * math.exp(-second) + 0.25)), rel=1e-12)


def test_routing_spreads_simultaneous_requests_over_the_least_loaded_replicas():
    requests = [SimRequest(i, 0.0, 32, 2) for i in range(4)]
    colocated = simulate(requests, make_fit(), "colocated", num_decode=2)
    assert sorted(r.decode_replica for r in colocated.results) == [0, 0, 1, 1]
    disaggregated = simulate(requests, make_fit(), "disaggregated", num_prefill=2, num_decode=2)
    assert sorted(r.prefill_replica for r in disaggregated.results) == [0, 0, 1, 1]
    assert sorted(r.decode_replica for r in disaggregated.results) == [2, 2, 3, 3]


def test_kvrelay_routing_spreads_a_decode_burst_between_two_stats():
    """The decode pool routes by kvrelay's least_kv on stats every 0.5 s, counting what it sent
    since. Request 0 decodes on replica 1 (replicas: prefill 0, decode 1 and 2); the stats at
    0.5 s show its KV there (its 32 prompt tokens and the ~25 it has decoded: 4-6 blocks of 16)
    and none on 2. A burst of four 32-token prompts (3 blocks each) arrives at 0.6 and is handed
    off at once, before the next stats: 2 (0 blocks), 2 (3 < 4-6), 1 (6 against 4-6), 2. Before
    least_kv counted what it sent, all four went to replica 2."""
    requests = [SimRequest(0, 0.0, 32, 400)] + [SimRequest(i, 0.6, 32, 50) for i in range(1, 5)]
    run = simulate(requests, make_fit(), "disaggregated", num_prefill=1, num_decode=2)
    assert run.results[0].decode_replica == 1
    assert all(0.6 < r.first_token_s < 1.0 for r in run.results[1:])  # handed off between two stats
    assert [r.decode_replica for r in run.results[1:]] == [2, 2, 1, 2]


def test_summarize_counts_goodput_and_attainment_at_each_slo():
    run = simulate([SimRequest(0, 0.0, 64, 3), SimRequest(1, 0.0, 64, 3)], make_fit(), "colocated", num_decode=1)
    first, second = run.results
    # the second request's prompt shares the first step: both first tokens at its end
    assert first.ttft_s == second.ttft_s == BASE + TOKEN * 128 + ROW * 2 + PAIR * 2 * chunk_pairs(64, 0)
    loose = (1000.0, 1000.0)
    tight = (first.ttft_s * 1e3, 0.001)  # no TPOT that small
    s = summarize(run, {"loose": loose, "tight": tight})
    assert s["attainment"] == {"loose": 1.0, "tight": 0.0}
    assert s["goodput"]["loose"] == 2 / run.span_s
    assert s["span_s"] == first.last_token_s and s["num_requests"] == 2
    assert s["utilisation"] == {"prefill": None, "decode": 1.0}


def test_a_simulated_replicas_stats_are_what_its_worker_reports():
    stats = routing_stats(2.0, queued_prompt=300, prefill_rate=500.0, num_running=3, num_waiting=1, kv_held=33,
                          kv_capacity_tokens=1600, requests_per_s=0.5)
    # 33 tokens hold 3 blocks of 16, of 100
    assert (stats.wall_time_s, stats.num_blocks, stats.num_free_blocks, stats.kv_usage) == (2.0, 100, 97, 0.03)
    assert (stats.num_queued_prefill_tokens, stats.prefill_tokens_per_s, stats.num_running, stats.num_waiting) == (300, 500.0, 3, 1)
    # the engine's measured rate (serving/engine/prefill_rate.py): the median of its steps, from the third
    rate = PrefillRate()
    for tokens, seconds in ((512, 1.0), (256, 1.0), (31, 0.01)):  # the last: too short to say anything
        measure_step(rate, tokens, seconds)
    assert rate.tokens_per_s == 0.0  # two measured steps: not measured yet
    measure_step(rate, 1024, 1.0)
    assert rate.tokens_per_s == 512.0  # the median of 512, 256 and 1024


def test_the_colocated_workers_route_by_prefix_cost_and_the_decode_pool_by_least_kv():
    routers = KvrelayRouters("colocated")
    idle = routing_stats(0.0, queued_prompt=0, prefill_rate=1000.0, num_running=0, num_waiting=0, kv_held=0,
                         kv_capacity_tokens=1600, requests_per_s=0.0)
    busy = routing_stats(0.0, queued_prompt=2000, prefill_rate=1000.0, num_running=0, num_waiting=1, kv_held=0,
                         kv_capacity_tokens=1600, requests_per_s=0.0)
    # a worker with 2000 queued prompt tokens is 2 s away: prefix_cost sends the chat to the other
    assert routers.route("decode", 0, 100, [("a", busy), ("b", idle)], 0.1) == "b"
    assert routers._routers["decode"].policy.name == "prefix_cost"
    disaggregated = KvrelayRouters("disaggregated")
    assert disaggregated.route("decode", 0, 100, [("a", idle), ("b", idle)], 0.1) == "a"  # a tie: the first
    assert disaggregated.route("decode", 1, 100, [("a", idle), ("b", idle)], 0.2) == "b"  # a holds the first now
    assert disaggregated._routers["decode"].policy.name == "least_kv"
