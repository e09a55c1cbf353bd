"""PoolLoad: what each replica of a pool computed lately, from the replicas' own counters, so that
every router (one per ingress replica) bounds the same load.

    replica (every stats period)                         router (each decision)
    RoutingStats.num_computed_tokens  (cumulative) ──▶ PoolLoad.observe(replica, tokens, requests)
    RoutingStats.num_requests         (cumulative)        Δtokens, Δrequests since its last stats
                                                          clock += Δrequests / (window x replicas)
                                                          tokens(r) = Σ Δtokens(r) x e^-(clock - clock then)

A replica's load is the tokens it computed, decayed per request the pool takes: a window of about
`window_per_replica` requests per replica, as PrefixCostPolicy's bound had when each router
counted what it sent itself (router/prefix_cost.py). Counting what the replicas computed instead
makes the figure the same for every router: with two routers each saw half the traffic, so its
bound came into force at half the rate and missed what the other sent (issue 19: a hot prefix
stayed on one replica at 6.7x the mean load, against 1.4x with one router). The counters are
cumulative, not rates, so that nothing is lost between two stats a router did not read, and the
window counts requests, not seconds: it means the same on a CPU taking a request every few
seconds and on a GPU taking a hundred a second.

A router's first stats of a replica set its baseline (a router started while the pool is warm
counts from then on: its bound comes into force as it sees the pool work, and until then admits
every replica, as a router at a cold start does). A worker reports its counters from its first
stats on, zeros before its first request, and a router at a cold start takes those zeros as its
baseline. (Once only non-zero counters were: a replica whose first non-zero stats reached the
router late had the prefills before them left out of its load while the other's were in; seen on
a loaded machine, 320 tokens against 0 for two replicas that had computed 576 each, and the bound
sent a prefix's next request to compute it again on the replica that looked idle.) Counters that
go down are a restarted engine: its new counts start a new baseline. What was routed after a
replica's last stats is not in its counters; the router adds it (its queued prefill tokens,
router/routing_state.py).
"""

from __future__ import annotations

import math
from collections.abc import Hashable

__all__ = ["PoolLoad"]


class PoolLoad:
    def __init__(self, window_per_replica: int = 64) -> None:
        if window_per_replica < 1:
            raise ValueError(f"window_per_replica must be >= 1, got {window_per_replica}")
        self.window_per_replica = window_per_replica
        self._clock = 0.0  # decay exponent so far: pool requests / (window x replicas)
        self._last: dict[Hashable, tuple[int, int]] = {}  # replica -> counters of its last stats
        self._tokens: dict[Hashable, tuple[float, float]] = {}  # replica -> (decayed tokens, clock then)
        self._requests: dict[Hashable, tuple[float, float]] = {}  # replica -> (decayed requests, clock then)

    @property
    def reported(self) -> bool:
        """Whether any replica reports its counters (a worker too old to, or a hand-built test
        load, does not: the policy then counts what it routed itself)."""
        return bool(self._last)

    def observe(self, replica_id: Hashable, num_computed_tokens: int, num_requests: int, num_replicas: int) -> None:
        """A replica's cumulative counters, from its newest stats; repeated ones change nothing."""
        if num_computed_tokens < 0 or num_requests < 0:
            return  # not reported
        last = self._last.get(replica_id)
        self._last[replica_id] = (num_computed_tokens, num_requests)
        if last is None or num_computed_tokens < last[0] or num_requests < last[1]:
            return  # a baseline: the first stats, or a restarted engine's
        new_tokens, new_requests = num_computed_tokens - last[0], num_requests - last[1]
        if new_requests:
            self._clock += new_requests / (self.window_per_replica * max(1, num_replicas))
            self._add(self._requests, replica_id, new_requests)
        if new_tokens:
            self._add(self._tokens, replica_id, new_tokens)

    def tokens(self, replica_id: Hashable) -> float:
        """The replica's decayed computed tokens (0 before two of its stats)."""
        return self._value(self._tokens, replica_id)

    def requests(self, replica_id: Hashable) -> float:
        """The replica's decayed request count, on the same window."""
        return self._value(self._requests, replica_id)

    def remove(self, replica_id: Hashable) -> None:
        for table in (self._last, self._tokens, self._requests):
            table.pop(replica_id, None)

    def _add(self, table: dict[Hashable, tuple[float, float]], replica_id: Hashable, amount: float) -> None:
        table[replica_id] = (self._value(table, replica_id) + amount, self._clock)

    def _value(self, table: dict[Hashable, tuple[float, float]], replica_id: Hashable) -> float:
        value, then = table.get(replica_id, (0.0, self._clock))
        return value * math.exp(then - self._clock)
