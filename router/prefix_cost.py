"""PrefixCostPolicy (name "prefix_cost"): the prefill pool's routing policy. For each candidate
replica r, the cost of placing the request there, in seconds somebody waits:

    cost(r) = ttft(r) + delay(r) + evict(r)

    ttft(r)  = (uncached(r) + queued(r)) / rate(r) + wait(r)        this request's time to first token
    delay(r) = arrivals(r) x service(r)^2 / 2                         what it makes later requests wait
    evict(r) = recompute seconds of what r evicts for it, x how likely each block is wanted again

    uncached(r)  prompt tokens not covered by r's cached prefix (exact index, router/index.py)
    queued(r)    prefill tokens r still has to compute (its last stats plus what this router
                 sent it since)
    rate(r)      the pool's prefill tokens/s: the median of the candidates' measured rates
                 (default_prefill_tokens_per_s while none is measured); r's own measured rate
                 only where it is more than `rate_spread` times off that median (a slower node,
                 a throttled device). Replicas of a pool run one engine on one kind of hardware,
                 and their measured rates differ by noise: the median of a replica's recent
                 prefills mixes 32-token hits with 288-token misses, which run at 2-3x different
                 rates, and two identical replicas measured 17k and 24k tokens/s in one run.
                 Taken as they are, the faster-looking one took 2 requests in 3 of a prefix both
                 held. `rate_spread=None` takes every measured rate as it is
    wait(r)      extra queueing delay r reports (0 unless known)
    service(r)   uncached(r) / rate(r): how long r is busy with this prompt
    arrivals(r)  requests per second r takes (its stats), at least the pool's mean per replica:
                 the requests that arrive while it computes wait half of it on average (the
                 first-order M/G/1 cost). A hit is short and costs others almost nothing; a
                 cold prefill of a prompt whose prefix another replica holds costs every request
                 that follows it there, which is what makes a second copy dearer than a short
                 wait for the holder (`price_delay`)
    evict(r)     router/eviction.py: the blocks r's engine would evict, in its eviction order
                 (the snapshot's), each priced at block_size / rate(r) x the probability that
                 one of the next H requests uses it (H: how many requests the pool takes to turn
                 its cache over), a block held by n replicas at 1/n. 0 while r has room
                 (`price_evictions`)

Without the last two terms (the cost before issue 19), a request whose prefix is cached nowhere
goes wherever it starts soonest, and a busy holder's request goes to an idle replica that then
computes a second copy: under cache pressure both evict prefixes that come back as misses (0.70
of the oracle's hit rate at 64 prefixes on 16 replicas of 4096 tokens, against the character
tree's 0.91; 0.90 with them: docs/benchmarks.md, issue 19). With them, a cold prompt goes where what it evicts is least wanted (empty blocks,
then suffixes nobody reuses, then cold prefixes), and a prefix is copied only where the copy is
worth its compute: the hot ones, which the load bound below spreads; the cold ones stay on one
replica.

Admission: a prompt's new blocks are computed on the chosen replica whatever happens; whether
they then stay cached is a second choice (Decision.retain, carried to the engine as the request's
`keep_cached`, serving/engine/kv/block_manager.py). Kept, they sit at the replica's recent end and
the next prompt there evicts its oldest cached blocks instead of them; not kept, they go to the
eviction end and are the next prompt's room. They are kept unless the blocks the next prompt of
the same size would evict instead are worth more (the reuse value of router/eviction.py, for the
new blocks against those). This is what LRU alone cannot do under pressure: with more prefixes
than room, every cold prompt pushes out a prefix that will come back, which comes back as a miss
that pushes out another; here a prefix seen once does not displace one seen often, and the
resident set changes only when popularity does (TinyLFU's admission, with the router's exact
counts of every request instead of a per-cache sketch). `admission=False` keeps everything.

Bounded load (consistent hashing with bounded loads, after Mirrokni et al.): only replicas whose
recent load stays within `max_load_ratio` x the pool's mean are eligible. The load is the tokens
a replica computed, as its own counters report them (RoutingStats.num_computed_tokens, decayed
per request the pool takes over a window of `load_window_per_replica` requests per replica:
router/pool_load.py), plus what it still has to compute (its queued prefill tokens and what this
router sent it since its stats). Every router (one per ingress replica) reads the same counters,
so they bound the same load; where the replicas report none, the load is what this router sent.
The cheapest eligible replica wins ("load_bound" when that is not the cheapest overall), so a
replica that holds several popular prefixes sheds the excess to the next cheapest, which then
holds that prefix too: a hot prefix is replicated as far as its load needs. Exempt is a holder
of a prefix too cold to need a second copy (its share of recent requests, p, is within its
holders' share: p x replicas <= holders) on a replica that does not take more than
`max_load_ratio` x its share of the pool's requests (the same counters, else
RoutingStats.requests_per_s, else what this router sent): spilling that request would compute
the prefix again elsewhere, more work in all, to relieve the holder of one hit; the bound instead
steers cold placements away from the holder. A replica over its share of requests holds too many
prefixes, and its requests do spill: the prefix moves. The window is long enough that one cold
prefill does not push its replica over at once. `max_load_ratio=None` turns the bound off.

Candidates within `tie_tolerance` of the cheapest that hold as much of the prompt (and the
request's LoRA adapter) as it does are ties (a holder is never traded for a non-holder at equal cost), broken by queued tokens, then by
routed load: equal replicas share the work, and new prefixes spread over the pool.

Imbalance guard: if the chosen replica's queued tokens exceed the least-loaded candidate's by
more than `max_imbalance_tokens`, or (when `max_imbalance_ratio` is set) exceed that many times
the pool's mean while leading by more than `min_imbalance_tokens`, the least-loaded candidate is
taken instead. The cost already weighs queues, so the guard is a backstop for queues the stats
missed; the relative guard, which fired on every long cold prefill, is off by default (under
cache pressure it moved held prefixes to replicas that then evicted others).

LoRA adapters: a request for an adapter costs, on a replica that does not hold it resident, the
replica's measured load time on top (RoutingStats.lora_load_s): the adapter's requests gather where
it is loaded, unless that replica's queue costs more than a load elsewhere. An adapter this router
sent to a replica counts as resident there for LORA_SENT_S, before the replica's stats list it.

Session affinity (optional): requests with the same session key (the `user` field) prefer the
replica rendezvous hashing assigns that key, while its cost stays within `affinity_slack_s` of
the cheapest.
"""

from __future__ import annotations

import hashlib
import math
import statistics
import time
from collections.abc import Hashable, Sequence
from typing import Any

from router.eviction import BlockReuse
from router.index import PrefixIndex
from router.policy_params import parse_params
from router.pool_load import PoolLoad
from router.route_types import Decision, ReplicaLoad, RouteRequest

__all__ = ["PrefixCostPolicy"]


# A replica that must load a request's LoRA adapter before its prefill: the load's cost until it
# has measured its own (SmolLM2-135M, rank 16 on every projection: ~20 ms on 2 cores), and how long
# a router takes an adapter it sent there as resident (until the replica's stats list it; an
# eviction there since is not seen before them).
DEFAULT_LORA_LOAD_S = 0.02
LORA_SENT_S = 10.0
# ...and where every one of its adapter slots is held by running requests, the wait for one to end:
# not measured per replica, priced as a generation of a few hundred tokens
LORA_NO_SLOT_S = 1.0


class PrefixCostPolicy:
    name = "prefix_cost"

    def __init__(self, **params: Any):
        """`params`: PrefixCostParams' fields (router/policy_params.py declares and checks them)."""
        self.params = p = parse_params(self.name, params)
        self.default_prefill_tokens_per_s = p.default_prefill_tokens_per_s
        self.tie_tolerance = p.tie_tolerance
        self.max_imbalance_tokens = p.max_imbalance_tokens
        self.max_imbalance_ratio = p.max_imbalance_ratio
        self.min_imbalance_tokens = p.min_imbalance_tokens
        self.max_load_ratio = p.max_load_ratio
        self.load_window_per_replica = p.load_window_per_replica
        self.session_affinity = p.session_affinity
        self.affinity_slack_s = p.affinity_slack_s
        self.price_evictions = p.price_evictions
        self.price_delay = p.price_delay
        self.reuse = BlockReuse(p.reuse_window_requests)
        self.admission = p.admission
        self.rate_spread = p.rate_spread
        self.pool = PoolLoad(p.load_window_per_replica)  # what the replicas report they computed
        self.routed_tokens: dict[Hashable, float] = {}  # replica -> decayed uncached tokens sent
        self.routed_requests: dict[Hashable, float] = {}  # replica -> decayed requests sent
        # (replica, LoRA adapter) -> when this router last sent it a request for the adapter: the
        # replica has it resident from then on, before its stats say so (LORA_SENT_S)
        self.lora_sent: dict[tuple[Hashable, str], float] = {}
        self.clock = time.monotonic

    def choose(self, request: RouteRequest, loads: Sequence[ReplicaLoad], index: PrefixIndex) -> Decision:
        assert loads, "choose() needs at least one candidate"
        for load in loads:
            self.pool.observe(load.replica_id, load.num_computed_tokens, load.num_requests, len(loads))
        recent = self._recent_load(loads)
        bs = request.block_size
        matched_blocks = {load.replica_id: index.num_matched_blocks(load.replica_id, request.block_hashes) for load in loads}
        matched = {replica_id: num * bs for replica_id, num in matched_blocks.items()}
        uncached = {replica_id: max(1, request.num_prompt_tokens - num) for replica_id, num in matched.items()}
        rates = self._rates(loads)
        loading = self._lora_load_s(request, loads)
        ttfts = {
            load.replica_id: (uncached[load.replica_id] + load.num_queued_prefill_tokens) / rates[load.replica_id]
            + load.queue_wait_s + loading.get(load.replica_id, 0.0)
            for load in loads
        }
        delays = self._delay_s(loads, uncached, rates) if self.price_delay else {}
        num_prompt_blocks = -(-request.num_prompt_tokens // bs)
        new_blocks = {replica_id: num_prompt_blocks - num for replica_id, num in matched_blocks.items()}
        evictions = self._eviction_s(request, loads, index, new_blocks, rates) if self.price_evictions else {}
        costs = {r: ttft + delays.get(r, 0.0) + evictions.get(r, 0.0) for r, ttft in ttfts.items()}

        eligible = self._within_load_bound(loads, recent, uncached, self._exempt(request, loads, index, matched_blocks))
        by_cost = sorted(eligible, key=lambda load: (costs[load.replica_id], load.num_queued_prefill_tokens))
        best = by_cost[0]
        reason = "prefix_hit" if matched[best.replica_id] > 0 else "least_cost"
        if costs[best.replica_id] > min(costs.values()):
            reason = "load_bound"

        # Ties share load, among replicas that hold as much of the prompt as the cheapest (and its
        # LoRA adapter as it does): a holder is not traded for a replica that would compute a
        # second copy (or load the adapter) at equal cost.
        limit = costs[best.replica_id] * (1 + self.tie_tolerance) + 1e-9
        ties = [load for load in by_cost if costs[load.replica_id] <= limit and matched[load.replica_id] == matched[best.replica_id]
                and (load.replica_id in loading) == (best.replica_id in loading)]
        if len(ties) > 1:
            num = matched_blocks[best.replica_id]
            key = request.block_hashes[num] if num < len(request.block_hashes) else request.request_id
            weight = _rendezvous_weights(key, [load.replica_id for load in ties])
            best = min(ties, key=lambda load: (
                load.num_queued_prefill_tokens, self.routed_tokens.get(load.replica_id, 0.0), -weight[load.replica_id]))
            if reason != "load_bound":
                reason = "tie_break" if matched[best.replica_id] == 0 else reason

        least = self._least_if_imbalanced(best, loads, costs)
        if least is not None:
            best, reason = least, "imbalance_guard"
        preferred = self._session_replica(request, loads, eligible, best, costs)
        if preferred is not None:
            best, reason = preferred, "session_affinity"

        self._account(best.replica_id, uncached[best.replica_id], len(loads))
        if request.lora_name is not None:
            self.lora_sent[best.replica_id, request.lora_name] = self.clock()
        self.reuse.observe(request.block_hashes, new_blocks[best.replica_id])
        retain = not self.admission or self._admit(
            request, loads, index, best.replica_id, matched_blocks[best.replica_id], new_blocks[best.replica_id])
        rest = sorted((load for load in loads if load is not best), key=lambda load: (costs[load.replica_id], load.num_queued_prefill_tokens))
        ranked = [best.replica_id] + [load.replica_id for load in rest]
        return Decision(ranked, reason, ttfts, matched[best.replica_id], delays, evictions, retain=retain)

    def _least_if_imbalanced(self, best: ReplicaLoad, loads: Sequence[ReplicaLoad],
                             costs: dict[Hashable, float]) -> ReplicaLoad | None:
        """The least-loaded candidate where `best`'s queue leads it past the imbalance guard
        (module docstring); None where it does not."""
        least = min(loads, key=lambda load: (load.num_queued_prefill_tokens, costs[load.replica_id]))
        mean_queued = sum(load.num_queued_prefill_tokens for load in loads) / len(loads)
        lead = best.num_queued_prefill_tokens - least.num_queued_prefill_tokens
        if best is not least and (
            lead > self.max_imbalance_tokens
            or (self.max_imbalance_ratio is not None and lead > self.min_imbalance_tokens
                and best.num_queued_prefill_tokens > self.max_imbalance_ratio * mean_queued)
        ):
            return least
        return None

    def _session_replica(self, request: RouteRequest, loads: Sequence[ReplicaLoad], eligible: Sequence[ReplicaLoad],
                         best: ReplicaLoad, costs: dict[Hashable, float]) -> ReplicaLoad | None:
        """The session's replica instead of `best`, where session affinity is on and it costs at most
        affinity_slack_s more; None otherwise."""
        if not (self.session_affinity and request.session):
            return None
        preferred = _rendezvous(request.session, [load.replica_id for load in eligible])
        if preferred != best.replica_id and costs[preferred] <= costs[best.replica_id] + self.affinity_slack_s:
            return next(load for load in loads if load.replica_id == preferred)
        return None

    def _admit(self, request: RouteRequest, loads: Sequence[ReplicaLoad], index: PrefixIndex, replica_id: Hashable,
               num_matched: int, num_new: int) -> bool:
        """Admission (module docstring): whether the chosen replica should keep this prompt's new
        blocks as its most recently used. What taking the request evicts now is gone either way;
        keeping the new blocks costs the blocks the next prompt of this size would evict instead
        of them. Kept unless those are worth more."""
        keep = set(request.block_hashes)
        now = index.victims(replica_id, num_new, keep)
        if not now:  # room to spare: nothing is lost by keeping them
            return True
        instead = index.victims(replica_id, 2 * num_new, keep)[len(now):]
        if not instead:
            return True
        horizon = self.reuse.horizon(sum(index.capacity(load.replica_id) for load in loads))
        gained = self.reuse.value_s(request.block_hashes[num_matched:], horizon, 1.0)
        lost = self.reuse.value_s(instead, horizon, 1.0, index.num_holders)
        return gained >= lost

    # ---- the cost's terms --------------------------------------------------------------------
    def _lora_load_s(self, request: RouteRequest, loads: Sequence[ReplicaLoad]) -> dict[Hashable, float]:
        """Per replica, what loading the request's LoRA adapter would add to its first token: 0
        where the adapter is resident (its stats) or was sent there within LORA_SENT_S; else the
        replica's measured load time (DEFAULT_LORA_LOAD_S before its first load), plus
        LORA_NO_SLOT_S where every adapter slot is held by running requests (the request waits
        for one of them to end)."""
        if request.lora_name is None:
            return {}
        now = self.clock()
        if len(self.lora_sent) > 4096:
            self.lora_sent = {key: at for key, at in self.lora_sent.items() if now - at < LORA_SENT_S}
        return {
            load.replica_id: (load.lora_load_s or DEFAULT_LORA_LOAD_S) + (LORA_NO_SLOT_S if load.lora_slots_free == 0 else 0.0)
            for load in loads
            if request.lora_name not in load.lora_resident
            and now - self.lora_sent.get((load.replica_id, request.lora_name), -math.inf) >= LORA_SENT_S
        }

    def _rates(self, loads: Sequence[ReplicaLoad]) -> dict[Hashable, float]:
        """rate(r) of the module docstring."""
        measured = [load.prefill_tokens_per_s for load in loads if load.prefill_tokens_per_s > 0]
        pool_rate = statistics.median(measured) if measured else self.default_prefill_tokens_per_s
        out = {}
        for load in loads:
            own = load.prefill_tokens_per_s
            alike = self.rate_spread is not None and pool_rate / self.rate_spread <= own <= pool_rate * self.rate_spread
            out[load.replica_id] = pool_rate if own <= 0 or alike else own
        return out

    @staticmethod
    def _delay_s(loads: Sequence[ReplicaLoad], uncached: dict[Hashable, int], rates: dict[Hashable, float]) -> dict[Hashable, float]:
        """delay(r) of the module docstring, where arrivals are known."""
        pool_mean = sum(load.requests_per_s for load in loads) / len(loads)
        out = {}
        for load in loads:
            arrivals = max(load.requests_per_s, pool_mean)
            if arrivals > 0:
                service_s = uncached[load.replica_id] / rates[load.replica_id]
                out[load.replica_id] = arrivals * service_s * service_s / 2
        return out

    def _eviction_s(
        self, request: RouteRequest, loads: Sequence[ReplicaLoad], index: PrefixIndex, new_blocks: dict[Hashable, int],
        rates: dict[Hashable, float],
    ) -> dict[Hashable, float]:
        """evict(r) of the module docstring, for each candidate whose capacity is known."""
        horizon = self.reuse.horizon(sum(index.capacity(load.replica_id) for load in loads))
        keep = set(request.block_hashes)
        out = {}
        for load in loads:
            victims = index.victims(load.replica_id, new_blocks[load.replica_id], keep)
            if victims:
                recompute_s = request.block_size / rates[load.replica_id]
                out[load.replica_id] = self.reuse.value_s(victims, horizon, recompute_s, index.num_holders)
        return out

    # ---- the load bound ----------------------------------------------------------------------
    def _recent_load(self, loads: Sequence[ReplicaLoad]) -> dict[Hashable, float]:
        """Each replica's recent load in tokens: what it reports it computed (router/pool_load.py)
        plus what it has still to compute (queued, and routed since its stats) and what it
        computed for this router since its counters; else, where the replicas report no
        counters, what this router sent it."""
        if self.pool.reported:
            return {load.replica_id: self.pool.tokens(load.replica_id) + load.num_queued_prefill_tokens
                    + load.unreported_done_tokens for load in loads}
        return {load.replica_id: self.routed_tokens.get(load.replica_id, 0.0) for load in loads}

    def _within_load_bound(
        self, loads: Sequence[ReplicaLoad], routed: dict[Hashable, float], uncached: dict[Hashable, int],
        exempt: set[Hashable] = frozenset(),
    ) -> list[ReplicaLoad]:
        """The candidates whose recent load plus this request stays within the bound, and the
        `exempt` ones (all of them while none is: early on, when one cold prompt outweighs the
        pool's mean). Until the pool has taken a request per replica there is no load to bound:
        at a cold start a prefix's second request was sent to compute it again elsewhere because
        its first was the whole pool's load. (A slack of one prompt on the bound did the same
        and cost the pressure sweep its balance: with 64-token hits one 1088-token prompt is a
        sixth of a replica's window, and the worst cell's max/mean load went from 1.15 to 1.50.)"""
        if self.max_load_ratio is None or self._pool_requests(loads) < len(loads):
            return list(loads)
        bound = self.max_load_ratio * (sum(routed.values()) + min(uncached.values())) / len(loads)
        within = [load for load in loads if routed[load.replica_id] + uncached[load.replica_id] <= bound]
        if not within:  # one prompt outweighs the pool's mean: those at or under the mean
            mean = sum(routed.values()) / len(loads)
            within = [load for load in loads if routed[load.replica_id] <= mean]
        keep = {load.replica_id for load in within} | exempt
        return [load for load in loads if load.replica_id in keep]

    def _pool_requests(self, loads: Sequence[ReplicaLoad]) -> float:
        """Requests the pool took lately: as the replicas count them, else as this router sent them."""
        if self.pool.reported:
            return sum(self.pool.requests(load.replica_id) for load in loads)
        return sum(self.routed_requests.get(load.replica_id, 0.0) for load in loads)

    def _exempt(self, request: RouteRequest, loads: Sequence[ReplicaLoad], index: PrefixIndex,
                matched_blocks: dict[Hashable, int]) -> set[Hashable]:
        """The holders of a prefix too cold to need another copy, on a replica that does not take
        more than its share of requests (module docstring)."""
        out = set()
        # Each replica's share of requests: as the replicas count them (the same for every
        # router), else as this router sent them.
        if self.pool.reported:
            taken = {load.replica_id: self.pool.requests(load.replica_id) for load in loads}
        elif any(load.requests_per_s for load in loads):
            taken = {load.replica_id: load.requests_per_s for load in loads}
        else:
            taken = {load.replica_id: self.routed_requests.get(load.replica_id, 0.0) for load in loads}
        total = sum(taken.values())
        for load in loads:
            num = matched_blocks[load.replica_id]
            if not num or self.max_load_ratio is None:
                continue
            deepest = request.block_hashes[num - 1]
            cold = self.reuse.probability(deepest) * len(loads) <= max(1, index.num_holders(deepest))
            share = taken[load.replica_id] / total if total else 0.0
            if cold and share * len(loads) <= self.max_load_ratio:
                out.add(load.replica_id)
        return out

    def _account(self, replica_id: Hashable, num_tokens: int, num_replicas: int) -> None:
        decay = 1.0 - 1.0 / (self.load_window_per_replica * num_replicas)
        self.routed_tokens = {r: tokens * decay for r, tokens in self.routed_tokens.items() if tokens * decay >= 1.0}
        self.routed_tokens[replica_id] = self.routed_tokens.get(replica_id, 0.0) + num_tokens
        self.routed_requests = {r: n * decay for r, n in self.routed_requests.items() if n * decay >= 0.01}
        self.routed_requests[replica_id] = self.routed_requests.get(replica_id, 0.0) + 1.0


def _rendezvous_weights(key: Hashable, replicas: Sequence[Hashable]) -> dict[Hashable, int]:
    """Highest-random-weight hashing's weights: the same on every router, stable under replicas
    joining or leaving."""
    def weight(replica: Hashable) -> int:
        digest = hashlib.blake2b(f"{key}\x00{replica}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little")

    return {replica: weight(replica) for replica in replicas}


def _rendezvous(key: Hashable, replicas: Sequence[Hashable]) -> Hashable:
    weights = _rendezvous_weights(key, replicas)
    return max(replicas, key=weights.__getitem__)
