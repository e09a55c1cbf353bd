"""The measured rule of `min_remote_prefill_tokens: auto` (router/disaggregation.py), with exact
figures: prefill on the decode replica iff the wait it causes there is no longer than a hand-off."""

from __future__ import annotations

from router.disaggregation import PrefillPlace, choose_prefill_place
from router.replica_stats import RoutingStats


def decode(running: int, rate: float = 1000.0, kv_import_s: float = 0.05, waiting: int = 0) -> RoutingStats:
    return RoutingStats(num_running=running, num_waiting=waiting, prefill_tokens_per_s=rate, kv_import_s=kv_import_s)


def test_an_idle_decode_replica_prefills_itself():
    choice = choose_prefill_place(500, [decode(0)])
    assert (choice.place, choice.reason, choice.local_cost_s, choice.handoff_s) == (PrefillPlace.LOCAL, "cheaper_locally", 0.0, 0.05)


def test_a_busy_one_sends_prompts_whose_prefill_holds_its_streams_longer_than_a_hand_off():
    # 2 sequences x 25 tokens / 1000 tok/s = 0.05 s: not longer than the 0.05 s hand-off
    assert choose_prefill_place(25, [decode(2)]).place is PrefillPlace.LOCAL
    # 2 x 26 / 1000 = 0.052 s > 0.05 s
    choice = choose_prefill_place(26, [decode(2)])
    assert (choice.place, choice.reason) == (PrefillPlace.REMOTE, "cheaper_remotely")
    assert choice.local_cost_s == 0.052
    # waiting sequences wait too: 1 running + 1 waiting is 2
    assert choose_prefill_place(26, [decode(1, waiting=1)]).place is PrefillPlace.REMOTE


def test_the_cheapest_replica_counts_and_the_hand_off_is_the_pools_average():
    replicas = [decode(8, kv_import_s=0.02), decode(1, rate=2000.0, kv_import_s=0.04)]
    # replica 2: 1 x 60 / 2000 = 0.03 s <= (0.02 + 0.04) / 2 = 0.03 s
    choice = choose_prefill_place(60, replicas)
    assert choice.place is PrefillPlace.LOCAL and choice.local_cost_s == 0.03 and choice.handoff_s == 0.03


def test_local_prefills_sent_after_a_replicas_stats_count_on_it():
    # a burst: the stats (taken at t=10) say idle, but this ingress sent 3 local prefills since
    idle = RoutingStats(wall_time_s=10.0, prefill_tokens_per_s=1000.0, kv_import_s=0.05)
    assert choose_prefill_place(100, [idle], local_sent_at=[8.0, 9.5]).place is PrefillPlace.LOCAL  # in the stats
    choice = choose_prefill_place(100, [idle], local_sent_at=[9.5, 10.5, 11.0, 12.0])  # 3 x 100 / 1000 = 0.3 s
    assert choice.place is PrefillPlace.REMOTE and choice.local_cost_s == 0.3
    # per replica: a newer snapshot already shows them
    newer = RoutingStats(wall_time_s=12.5, num_running=0, prefill_tokens_per_s=1000.0, kv_import_s=0.05)
    assert choose_prefill_place(100, [idle, newer], local_sent_at=[10.5, 11.0, 12.0]).local_cost_s == 0.0


def test_until_both_figures_are_measured_every_prompt_goes_to_the_prefill_pool():
    assert choose_prefill_place(10, []).reason == "unmeasured"
    assert choose_prefill_place(10, [decode(0, kv_import_s=0.0)]).reason == "unmeasured"  # no hand-off yet
    assert choose_prefill_place(10, [decode(0, rate=0.0)]).reason == "unmeasured"  # no rate anywhere
    # a decode replica that never prefilled takes the prefill pool's rate: 1 x 10 / 500 = 0.02 s
    choice = choose_prefill_place(10, [decode(1, rate=0.0)], [RoutingStats(prefill_tokens_per_s=500.0)])
    assert choice.place is PrefillPlace.LOCAL and choice.local_cost_s == 0.02
