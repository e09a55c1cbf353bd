"""Routing policies: which replica gets a request. Pure objects, testable without Ray.

PrefixCostPolicy (name "prefix_cost", the prefill pool): router/prefix_cost.py. The estimated
    time to first token on each replica, plus the delay it causes later requests there and the
    recompute time of the cached blocks it would evict, under a bound on each replica's load.

LeastKVPolicy (name "least_kv", the decode pool)
    Among replicas with enough free KV blocks for the import, the lowest KV utilization, then
    the fewest running sequences; if none has room, the one with the most free blocks. Each
    figure includes what this router sent the replica after its stats were taken (the import's
    blocks, one sequence each: ReplicaLoad.unreported_*, counted by router/routing_state.py).
    Without that, every request of a stats period (0.5 s) saw the same figures and went to
    the same replica: a burst herded onto one decode replica while the others idled.

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

import itertools
import math
import random
from collections.abc import Sequence
from typing import Any

from router.char_prefix_tree import CharPrefixTree, token_text
from router.index import PrefixIndex
from router.policy_params import parse_params
from router.prefix_cost import PrefixCostPolicy
from router.route_types import Decision, ReplicaLoad, RouteRequest

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


class LeastKVPolicy:
    name = "least_kv"

    def __init__(self, **params: Any) -> None:
        parse_params(self.name, params)  # none: refuses any

    def choose(self, request: RouteRequest, loads: Sequence[ReplicaLoad], index: PrefixIndex | None = None) -> Decision:
        assert loads, "choose() needs at least one candidate"
        free = {load.replica_id: load.num_free_blocks - load.unreported_blocks for load in loads}

        def usage(load: ReplicaLoad) -> float:
            # the engine's usage is 1 - free / blocks (serving/engine/kv/block_manager.py): in blocks,
            # so that equal counts compare equal (0.14 + 0.07 is not 0.21 in floating point)
            if not load.num_blocks:
                return load.kv_usage
            return (load.num_blocks - free[load.replica_id]) / load.num_blocks

        def sequences(load: ReplicaLoad) -> int:
            return load.num_running + load.num_waiting + load.unreported_sequences

        fits = [load for load in loads if free[load.replica_id] >= request.num_blocks_needed]
        if fits:
            ranked = sorted(fits, key=lambda load: (usage(load), sequences(load)))
            rest = sorted((load for load in loads if load not in fits), key=lambda load: -free[load.replica_id])
            return Decision([load.replica_id for load in ranked + rest], "least_kv")
        ranked = sorted(loads, key=lambda load: -free[load.replica_id])
        return Decision([load.replica_id for load in ranked], "no_room")


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self, **params: Any) -> None:
        parse_params(self.name, params)  # none: refuses any
        self._counter = itertools.count()

    def choose(self, request: RouteRequest, loads: Sequence[ReplicaLoad], index: PrefixIndex | None = None) -> Decision:
        ids = sorted((load.replica_id for load in loads), key=str)
        start = next(self._counter) % len(ids)
        return Decision(ids[start:] + ids[:start], "round_robin")


class PowerOfTwoPolicy:
    name = "pow2"

    def __init__(self, **params: Any) -> None:
        """`params`: PowerOfTwoParams' fields (router/policy_params.py)."""
        self._rng = random.Random(parse_params(self.name, params).seed)

    def choose(self, request: RouteRequest, loads: Sequence[ReplicaLoad], index: PrefixIndex | None = None) -> Decision:
        pair = self._rng.sample(list(loads), min(2, len(loads)))
        best = min(pair, key=lambda load: load.num_queued_prefill_tokens + load.num_running + load.num_waiting)
        rest = [load.replica_id for load in loads if load is not best]
        return Decision([best.replica_id] + rest, "pow2")


class CharPrefixTreePolicy:
    name = "char_prefix_tree"

    def __init__(self, **params: Any) -> None:
        """`params`: CharPrefixTreeParams' fields (router/policy_params.py)."""
        p = parse_params(self.name, params)
        self.match_rate_threshold = p.match_rate_threshold
        self.imbalanced_threshold = math.inf if p.imbalanced_threshold is None else p.imbalanced_threshold
        self.tree = CharPrefixTree()
        self._rng = random.Random(p.seed)
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
    """A policy by its name, with its parameters (router/policy_params.py types and checks them:
    unknown ones and values of the wrong type are errors)."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name](**params)
