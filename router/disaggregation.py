"""Where a request's prompt is prefilled in disaggregated mode when `min_remote_prefill_tokens` is
`auto`: on the decode replica itself, or on the prefill pool with a KV hand-off.

    local cost   the decode side's interference: prefilling U uncached tokens on a decode
                 replica that runs N sequences (its running and waiting ones, plus every request
                 this ingress sent the decode pool to prefill after the replica's stats were
                 taken: any of them may be there) delays each of them by about U / rate, the
                 replica's measured prefill rate: N * U / rate seconds of stream time in all
    remote cost  the hand-off: the decode replicas' measured time from claiming a request's KV to
                 holding it (an average over recent hand-offs, weighted to the newest; one that
                 failed counts the wait it cost: RoutingStats.kv_import_s)

    prefill locally  iff  min over decode replicas of N * U / rate  <=  hand-off

An idle decode replica (N = 0) therefore prefills itself: nothing waits behind it and nothing is
handed off. A busy one sends any prompt whose prefill would hold its streams longer than a
hand-off takes to the prefill pool. Until both figures are measured (a replica's prefill rate:
its own, else the prefill pool's; the hand-off: at least one import) every prompt goes to the
prefill pool, the configured layout.

Ray-free: the ingress (serving/deployments/serve_backend.py) reads the stats from its routers.

Whether to disaggregate at all is the pool's choice, not the request's: disaggregate only where it
pays. `kvrelay bench pd-sim` (load_tests/pd/sim.py, issue 19 part 4) simulated pools of 2-64
replicas, with this machine's engine and with DistServe's published OPT-13B/A100 costs:
- 1 prefill + 1 decode replica lose to 2 colocated ones in every GPU cell (0.31-0.93x goodput
  per replica).
- Disaggregated wins from 4-8 replicas when the TPOT target is tight (2x an unloaded decode step):
  1.29-2.17x at 64 on the GPU fit. It also wins when outputs are long (1.12-1.19x at a loose
  target).
- Colocated chunked prefill stays ahead when TPOT has room and prompts dominate (0.62-0.96x).

Hence `mode: auto` splits a node only from 4 cores (serving/config/layout.py), and this rule only
decides where each prompt of a split pool is prefilled. The tables are in docs/benchmarks.md.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from router.replica_stats import RoutingStats

__all__ = ["PrefillPlace", "PrefillChoice", "choose_prefill_place"]


class PrefillPlace(str, enum.Enum):
    LOCAL = "local"  # on the decode replica
    REMOTE = "remote"  # on the prefill pool, then a KV hand-off


@dataclass(frozen=True)
class PrefillChoice:
    place: PrefillPlace
    reason: str  # "unmeasured", "cheaper_locally", "cheaper_remotely"
    local_cost_s: float | None = None  # the cheapest decode replica's interference
    handoff_s: float | None = None


def choose_prefill_place(
    num_uncached_tokens: int,
    decode: Sequence[RoutingStats],
    prefill: Sequence[RoutingStats] = (),
    *,
    local_sent_at: Sequence[float] = (),
) -> PrefillChoice:
    """The place for a prompt with `num_uncached_tokens` left to compute, from the newest stats
    of the decode and prefill pools' replicas. `local_sent_at`: when (wall clock, as
    RoutingStats.wall_time_s) this ingress sent prompts to be prefilled on the decode pool; those sent
    after a replica's stats were taken count on it (a burst arrives faster than the stats)."""
    imports = [s.kv_import_s for s in decode if s.kv_import_s > 0]
    prefill_rates = [s.prefill_tokens_per_s for s in prefill if s.prefill_tokens_per_s > 0]
    pool_rate = sum(prefill_rates) / len(prefill_rates) if prefill_rates else 0.0
    costs = []
    for stats in decode:
        rate = stats.prefill_tokens_per_s or pool_rate
        if rate > 0:
            unseen = sum(1 for sent in local_sent_at if sent > stats.wall_time_s)
            costs.append((stats.num_running + stats.num_waiting + unseen) * num_uncached_tokens / rate)
    if not imports or not costs:
        return PrefillChoice(PrefillPlace.REMOTE, "unmeasured")
    handoff_s = sum(imports) / len(imports)
    cheapest = min(costs)
    if cheapest <= handoff_s:
        return PrefillChoice(PrefillPlace.LOCAL, "cheaper_locally", cheapest, handoff_s)
    return PrefillChoice(PrefillPlace.REMOTE, "cheaper_remotely", cheapest, handoff_s)
