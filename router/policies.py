"""Routing policies: which replica gets a request. Pure objects, testable without Ray.

PrefixCostPolicy (name "prefix_cost", the prefill pool)
    For each candidate replica r, the estimated time to first token is

        ttft(r) = (uncached(r) + queued(r)) / rate(r) + wait(r)

    uncached(r)  prompt tokens not covered by r's cached prefix (exact index, router/index.py)
    queued(r)    prefill tokens r still has to compute (its last stats plus what this router
                 sent it since)
    rate(r)      r's measured prefill tokens/s; until measured, the mean of the candidates that
                 are (replicas of a pool are alike), or default_prefill_tokens_per_s if none is
    wait(r)      extra queueing delay r reports (0 unless known)

    Bounded load (consistent hashing with bounded loads, after Mirrokni et al.): only replicas
    whose recent routed load stays within `max_load_ratio` x the pool's mean are eligible. The
    load is the uncached tokens this router sent each replica, decayed by 1 / (
    `load_window_per_replica` x replicas) per decision (a window of about that many requests
    per replica). The cheapest eligible replica wins ("load_bound" when that is not the
    cheapest overall): a replica that holds several popular prefixes sheds the excess to the
    next cheapest, which then holds that prefix too, and prefixes end up spread so that no
    replica computes much more than the mean. Without it, prefixes placed at random (or a
    skewed popularity) leave some replicas with two or three times the mean work and others
    idle, at loads where queues stay too short for the guards below to notice (the routing
    benchmark's simulation, load_tests/routing_sim.py: max/mean computed tokens 1.9-4.2 without
    the bound, 1.1-1.3 with it, at 0.99 of the oracle's prefix hit rate either way). The window
    is long enough that one cold prefill (17x a cached prompt in that benchmark) does not push
    its replica over the bound at once; shorter windows cascade spills (16 per replica did).
    `max_load_ratio=None` turns the bound off.

    Candidates within `tie_tolerance` of the cheapest are ties, broken by power of two choices
    on queued tokens (two random ties, the less loaded one), so equal replicas share load
    instead of the first one taking everything.

    Imbalance guards keep a popular prefix from piling onto one replica while others idle:
    if the chosen replica's queued tokens exceed the least-loaded candidate's by more than
    `max_imbalance_tokens` (absolute), or exceed `max_imbalance_ratio` x the pool's mean queued
    tokens while also leading the least-loaded by more than `min_imbalance_tokens` (relative;
    the floor keeps tiny queues from tripping it), the least-loaded candidate is taken instead
    (its cost then includes recomputing the prefix, the price of not piling up).

    Session affinity (optional): requests with the same session key (the `user` field) prefer
    the replica rendezvous hashing assigns that key, while its cost stays within
    `affinity_slack_s` of the cheapest.

LeastKVPolicy (name "least_kv", the decode pool)
    Among replicas with enough free KV blocks for the import, the lowest KV utilization, then
    the fewest running sequences; if none has room, the one with the most free blocks.

RoundRobinPolicy, PowerOfTwoPolicy: the baselines the routing benchmark compares against.

CharPrefixTreePolicy (name "char_prefix_tree"): the third baseline, in the manner of Ray Serve
    LLM's PrefixCacheAffinityRouter: an approximate character prefix tree of the texts sent to each
    replica (router/char_prefix_tree.py). If the replicas' queue lengths (running + waiting
    requests) differ by more than `imbalanced_threshold`, power of two choices. Otherwise the
    replicas owning the longest match if it covers at least `match_rate_threshold` of the text,
    else the replicas with the fewest characters in the tree; of those the shortest queue.
    Defaults are Ray's (0.1, no imbalance threshold). It does not know what the engines evicted.
    The text is `RouteRequest.text`, or the token ids one character per token when that is None
    (the workers' requests carry no text).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from router.char_prefix_tree import CharPrefixTree, token_text
from router.index import PrefixIndex

__all__ = [
    "ReplicaLoad",
    "RouteRequest",
    "Decision",
    "PrefixCostPolicy",
    "LeastKVPolicy",
    "RoundRobinPolicy",
    "PowerOfTwoPolicy",
    "CharPrefixTreePolicy",
    "build_policy",
    "POLICIES",
]


@dataclass
class ReplicaLoad:
    """What a policy knows of one replica (from its routing stats, plus local accounting)."""

    replica_id: Hashable
    queued_prefill_tokens: int = 0
    prefill_tokens_per_s: float = 0.0  # 0: not measured yet
    queue_wait_s: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    kv_usage: float = 0.0


@dataclass
class RouteRequest:
    request_id: str
    num_prompt_tokens: int
    block_hashes: Sequence[int] = ()
    block_size: int = 16
    session: str | None = None
    token_ids: Sequence[int] = ()  # the prompt, for policies that match text (char_prefix_tree)
    text: str | None = None  # the prompt's text if known; else such policies use token_text(token_ids)

    @property
    def num_blocks_needed(self) -> int:
        return -(-(self.num_prompt_tokens + 1) // self.block_size)


@dataclass
class Decision:
    ranked: list[Hashable]  # best first
    reason: str  # for metrics: prefix_hit | least_cost | load_bound | tie_break | imbalance_guard | session_affinity | ...
    estimated_ttft_s: dict[Hashable, float] = field(default_factory=dict)
    num_matched_tokens: int = 0

    @property
    def chosen(self) -> Hashable:
        return self.ranked[0]


class PrefixCostPolicy:
    name = "prefix_cost"

    def __init__(
        self,
        *,
        default_prefill_tokens_per_s: float = 2000.0,
        tie_tolerance: float = 0.05,
        max_imbalance_tokens: int = 16384,
        max_imbalance_ratio: float = 2.0,
        min_imbalance_tokens: int = 512,
        max_load_ratio: float | None = 1.25,
        load_window_per_replica: int = 64,
        session_affinity: bool = False,
        affinity_slack_s: float = 0.05,
        seed: int | None = None,
    ):
        if default_prefill_tokens_per_s <= 0:
            raise ValueError(f"default_prefill_tokens_per_s must be > 0, got {default_prefill_tokens_per_s}")
        if not 0 <= tie_tolerance < 1:
            raise ValueError(f"tie_tolerance must be in [0, 1), got {tie_tolerance}")
        if max_imbalance_tokens < 0:
            raise ValueError(f"max_imbalance_tokens must be >= 0, got {max_imbalance_tokens}")
        if max_imbalance_ratio < 1:
            raise ValueError(f"max_imbalance_ratio must be >= 1, got {max_imbalance_ratio}")
        if min_imbalance_tokens < 0:
            raise ValueError(f"min_imbalance_tokens must be >= 0, got {min_imbalance_tokens}")
        if max_load_ratio is not None and max_load_ratio < 1:
            raise ValueError(f"max_load_ratio must be >= 1 (or None: no bound), got {max_load_ratio}")
        if load_window_per_replica < 1:
            raise ValueError(f"load_window_per_replica must be >= 1, got {load_window_per_replica}")
        self.default_prefill_tokens_per_s = default_prefill_tokens_per_s
        self.tie_tolerance = tie_tolerance
        self.max_imbalance_tokens = max_imbalance_tokens
        self.max_imbalance_ratio = max_imbalance_ratio
        self.min_imbalance_tokens = min_imbalance_tokens
        self.max_load_ratio = max_load_ratio
        self.load_window_per_replica = load_window_per_replica
        self.session_affinity = session_affinity
        self.affinity_slack_s = affinity_slack_s
        self._rng = random.Random(seed)
        self.routed_tokens: dict[Hashable, float] = {}  # replica -> decayed uncached tokens sent

    def choose(self, request: RouteRequest, loads: Sequence[ReplicaLoad], index: PrefixIndex) -> Decision:
        assert loads, "choose() needs at least one candidate"
        matched = {
            load.replica_id: index.num_matched_blocks(load.replica_id, request.block_hashes) * request.block_size
            for load in loads
        }
        measured = [load.prefill_tokens_per_s for load in loads if load.prefill_tokens_per_s > 0]
        pool_rate = sum(measured) / len(measured) if measured else self.default_prefill_tokens_per_s
        costs = {load.replica_id: self._ttft_s(request, load, matched[load.replica_id], pool_rate) for load in loads}
        uncached = {replica_id: max(1, request.num_prompt_tokens - num) for replica_id, num in matched.items()}
        eligible = self._within_load_bound(loads, uncached)
        by_cost = sorted(eligible, key=lambda load: (costs[load.replica_id], load.queued_prefill_tokens))
        best = by_cost[0]
        reason = "prefix_hit" if matched[best.replica_id] > 0 else "least_cost"
        if costs[best.replica_id] > min(costs.values()):
            reason = "load_bound"

        ties = [load for load in by_cost if costs[load.replica_id] <= costs[best.replica_id] * (1 + self.tie_tolerance) + 1e-9]
        if len(ties) > 1:
            pair = self._rng.sample(ties, 2)
            best = min(pair, key=lambda load: (load.queued_prefill_tokens, costs[load.replica_id]))
            reason = "tie_break" if matched[best.replica_id] == 0 else reason

        least = min(loads, key=lambda load: (load.queued_prefill_tokens, costs[load.replica_id]))
        mean_queued = sum(load.queued_prefill_tokens for load in loads) / len(loads)
        lead = best.queued_prefill_tokens - least.queued_prefill_tokens
        if best is not least and (
            lead > self.max_imbalance_tokens
            or (lead > self.min_imbalance_tokens and best.queued_prefill_tokens > self.max_imbalance_ratio * mean_queued)
        ):
            best, reason = least, "imbalance_guard"

        if self.session_affinity and request.session:
            preferred = _rendezvous(request.session, [load.replica_id for load in eligible])
            if preferred != best.replica_id and costs[preferred] <= costs[best.replica_id] + self.affinity_slack_s:
                best = next(load for load in loads if load.replica_id == preferred)
                reason = "session_affinity"

        self._account(best.replica_id, uncached[best.replica_id], len(loads))
        rest = sorted((load for load in loads if load is not best), key=lambda load: (costs[load.replica_id], load.queued_prefill_tokens))
        ranked = [best.replica_id] + [load.replica_id for load in rest]
        return Decision(ranked, reason, costs, matched[best.replica_id])

    def _within_load_bound(self, loads: Sequence[ReplicaLoad], uncached: dict[Hashable, int]) -> list[ReplicaLoad]:
        """The candidates whose routed load plus this request stays within the bound (all of
        them while none does: early on, when one cold prompt outweighs the pool's mean)."""
        if self.max_load_ratio is None:
            return list(loads)
        routed = {load.replica_id: self.routed_tokens.get(load.replica_id, 0.0) for load in loads}
        bound = self.max_load_ratio * (sum(routed.values()) + min(uncached.values())) / len(loads)
        eligible = [load for load in loads if routed[load.replica_id] + uncached[load.replica_id] <= bound]
        return eligible or list(loads)

    def _account(self, replica_id: Hashable, num_tokens: int, num_replicas: int) -> None:
        decay = 1.0 - 1.0 / (self.load_window_per_replica * num_replicas)
        self.routed_tokens = {r: tokens * decay for r, tokens in self.routed_tokens.items() if tokens * decay >= 1.0}
        self.routed_tokens[replica_id] = self.routed_tokens.get(replica_id, 0.0) + num_tokens

    def _ttft_s(self, request: RouteRequest, load: ReplicaLoad, num_matched_tokens: int, pool_rate: float) -> float:
        rate = load.prefill_tokens_per_s or pool_rate
        uncached = max(1, request.num_prompt_tokens - num_matched_tokens)
        return (uncached + load.queued_prefill_tokens) / rate + load.queue_wait_s


class LeastKVPolicy:
    name = "least_kv"

    def choose(self, request: RouteRequest, loads: Sequence[ReplicaLoad], index: PrefixIndex | None = None) -> Decision:
        assert loads, "choose() needs at least one candidate"
        fits = [load for load in loads if load.num_free_blocks >= request.num_blocks_needed]
        if fits:
            ranked = sorted(fits, key=lambda load: (load.kv_usage, load.num_running + load.num_waiting))
            rest = sorted((load for load in loads if load not in fits), key=lambda load: -load.num_free_blocks)
            return Decision([load.replica_id for load in ranked + rest], "least_kv")
        ranked = sorted(loads, key=lambda load: -load.num_free_blocks)
        return Decision([load.replica_id for load in ranked], "no_room")


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, request: RouteRequest, loads: Sequence[ReplicaLoad], index: PrefixIndex | None = None) -> Decision:
        ids = sorted((load.replica_id for load in loads), key=str)
        start = next(self._counter) % len(ids)
        return Decision(ids[start:] + ids[:start], "round_robin")


class PowerOfTwoPolicy:
    name = "pow2"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, loads: Sequence[ReplicaLoad], index: PrefixIndex | None = None) -> Decision:
        pair = self._rng.sample(list(loads), min(2, len(loads)))
        best = min(pair, key=lambda load: load.queued_prefill_tokens + load.num_running + load.num_waiting)
        rest = [load.replica_id for load in loads if load is not best]
        return Decision([best.replica_id] + rest, "pow2")


class CharPrefixTreePolicy:
    name = "char_prefix_tree"

    def __init__(
        self, *, match_rate_threshold: float = 0.1, imbalanced_threshold: float = math.inf, seed: int | None = None,
    ) -> None:
        if not 0 <= match_rate_threshold <= 1:
            raise ValueError(f"match_rate_threshold must be in [0, 1], got {match_rate_threshold}")
        if imbalanced_threshold < 0:
            raise ValueError(f"imbalanced_threshold must be >= 0, got {imbalanced_threshold}")
        self.match_rate_threshold = match_rate_threshold
        self.imbalanced_threshold = imbalanced_threshold
        self.tree = CharPrefixTree()
        self._rng = random.Random(seed)
        self._pow2 = PowerOfTwoPolicy(seed=self._rng.randrange(2**32))

    def choose(self, request: RouteRequest, loads: Sequence[ReplicaLoad], index: PrefixIndex | None = None) -> Decision:
        assert loads, "choose() needs at least one candidate"
        text = request.text if request.text is not None else token_text(request.token_ids)
        queue = {load.replica_id: load.num_running + load.num_waiting for load in loads}
        for load in loads:
            self.tree.add_tenant(load.replica_id)
        if max(queue.values()) - min(queue.values()) > self.imbalanced_threshold:
            best, reason = self._pow2.choose(request, loads).chosen, "imbalanced"
        else:
            ids = [load.replica_id for load in loads]
            num_matched, owners = self.tree.match(text, ids)
            if text and owners and num_matched / len(text) >= self.match_rate_threshold:
                group, reason = owners, "prefix_match"
            else:
                group, reason = self.tree.smallest_tenants(ids), "smallest_tenant"
            shortest = min(queue[replica_id] for replica_id in group)
            best = self._rng.choice([replica_id for replica_id in group if queue[replica_id] == shortest])
        self.tree.insert(text, best)
        rest = sorted((load.replica_id for load in loads if load.replica_id != best), key=lambda r: queue[r])
        # num_matched_tokens stays 0: the tree knows characters sent, not blocks cached.
        return Decision([best] + rest, reason)


POLICIES = {
    cls.name: cls
    for cls in (PrefixCostPolicy, LeastKVPolicy, RoundRobinPolicy, PowerOfTwoPolicy, CharPrefixTreePolicy)
}


def build_policy(name: str, **params):
    """A policy by its name, with its documented parameters (unknown ones are errors)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}") from None
    try:
        return cls(**params)
    except TypeError as exc:
        raise ValueError(f"routing policy {name!r}: {exc}") from exc


def _rendezvous(key: str, replicas: Sequence[Hashable]) -> Hashable:
    """Highest-random-weight hashing: stable under replicas joining or leaving."""
    def weight(replica: Hashable) -> int:
        digest = hashlib.blake2b(f"{key}\x00{replica}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little")

    return max(replicas, key=weight)
