"""What a placement destroys: the expected recompute time of the cached blocks a replica would
evict to take a request, the second term of PrefixCostPolicy's cost (router/policies.py).

    cost(r) = ttft(r) + evict(r)

    evict(r) = sum over v in victims(r) of  recompute_s(r) x P(v is wanted again within H requests)

    victims(r)       the blocks r's engine would evict to take this request's new blocks: its
                     oldest ones beyond its empty blocks (PrefixIndex.victims, router/index.py:
                     the snapshot lists them in eviction order); none while it has room
    recompute_s(r)   block_size / r's prefill rate: what a later request pays to compute it again
    P(v wanted)      1 - exp(-p(v) x H): at least one of the next H requests uses v, each with
                     the probability p(v) that a recent request used it (BlockReuse below)
    H (horizon)      the pool's KV blocks / the new blocks an average request takes: how many
                     requests it takes the pool to turn its cache over, after which a block not
                     wanted meanwhile is gone whoever evicts it

Without the second term a request whose prefix is cached nowhere goes wherever its TTFT is
lowest now, and a busy holder's request goes to an idle replica, which then computes a second
copy of the prefix: both evict other prefixes that will come back, and under cache pressure
those come back as misses that evict still others (issue 19: 0.72 of the oracle's hit rate with
64 prefixes on 16 replicas). With it, the cold request goes where the blocks it pushes out are
the least wanted (a replica with empty blocks first, then one whose oldest blocks are suffixes
nobody reuses, then the coldest prefixes), and a copy of a prefix is made where that is cheaper
than waiting for its holder, which is where it is wanted enough to keep two copies: a hot prefix
spreads (the load bound makes it spread when its holder cannot carry it), a cold one stays on
one replica. When the caches hold everything, nothing is evicted and the term is 0.

`BlockReuse` counts, per block hash, the requests this router routed that used it, decayed
exponentially over a window of `window_requests` requests, and the blocks each decision made
new. p(v) = the decayed count of v / the decayed count of requests. The entries of blocks not
used for several windows are pruned, so its size is bounded by what recent traffic touched.

Every router keeps its own, and with several routers each sees only its share of the traffic:
the proportions are the same, but estimated from half (or less) of the requests, and the
routers' admission decisions (router/prefix_cost.py) then disagree where counts are small. So
each replica counts the same for the requests it took, from every router (a BlockReuse of its
own: `counts` of the hashes in its snapshot), and reports them with its routing stats;
`absorb` pools the replicas' reports, and p(v) is the larger of this router's estimate and the
pool's (the pool's knows only blocks some replica holds). Simulated with two routers, this is
what brings their hit rates back to one router's (docs/benchmarks.md, issue 19).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence

__all__ = ["BlockReuse", "REPLICA_REUSE_WINDOW", "REUSE_REPORT_MIN"]

# A replica counts over its own last requests: with N replicas that spans N times as many of the
# pool's, as a router's 2048 span 2048 x its share of the traffic.
REPLICA_REUSE_WINDOW = 256
# A replica reports the blocks of its snapshot whose decayed count is at least this: those used
# within about a window. Blocks used once matter (simulated with two routers, reporting only
# those used twice or more keeps 0.934-0.969 of one router's hit rate in the worst cells, against
# 0.955-0.972): the report is up to one count per snapshot hash, about 2.5 times the encoded
# snapshot's bytes on the wire.
REUSE_REPORT_MIN = 0.5

_PRUNE_BELOW = 0.05  # decayed count: a block used once, (ln 20 =) 3 windows ago


class BlockReuse:
    def __init__(self, window_requests: int = 2048) -> None:
        if window_requests < 1:
            raise ValueError(f"window_requests must be >= 1, got {window_requests}")
        self.window_requests = window_requests
        self._decay = math.exp(-1.0 / window_requests)  # per request
        self._counts: dict[int, tuple[float, int]] = {}  # hash -> (count at stamp, stamp)
        self.num_requests = 0
        self._new_blocks = 0.0  # decayed sum of new blocks per request
        self._weight = 0.0  # decayed count of requests: sum of decay^age
        # The replicas' reports (`absorb`): each one's counts and weight, and their sums.
        self._reports: dict[Hashable, tuple[dict[int, float], float]] = {}
        self._pooled: dict[int, float] = {}
        self._pooled_weight = 0.0

    def observe(self, block_hashes: Sequence[int], num_new_blocks: int) -> None:
        """A request was routed: it used these blocks, and took `num_new_blocks` new ones."""
        n = self.num_requests = self.num_requests + 1
        self._weight = self._weight * self._decay + 1.0
        self._new_blocks = self._new_blocks * self._decay + num_new_blocks
        counts = self._counts
        for block_hash in block_hashes:
            count, stamp = counts.get(block_hash, (0.0, n))
            counts[block_hash] = (count * self._decay ** (n - stamp) + 1.0, n)
        if n % self.window_requests == 0:
            self._prune()

    def probability(self, block_hash: int) -> float:
        """How likely a request is to use this block, from the recent ones: this router's count,
        or the replicas' pooled one where that is higher."""
        own = 0.0
        entry = self._counts.get(block_hash)
        if entry is not None and self._weight:
            count, stamp = entry
            own = min(1.0, count * self._decay ** (self.num_requests - stamp) / self._weight)
        if self._pooled_weight > 0:
            return max(own, min(1.0, self._pooled.get(block_hash, 0.0) / self._pooled_weight))
        return own

    @property
    def weight(self) -> float:
        """The decayed count of requests observed (decayed at each observe)."""
        return self._weight

    def counts(self, block_hashes: Iterable[int], at_least: float = 0.5) -> dict[int, float]:
        """The decayed count of requests that used each of `block_hashes` (a replica's report of
        the hashes in its snapshot), those of at least `at_least` only."""
        out = {}
        n = self.num_requests
        for block_hash in block_hashes:
            entry = self._counts.get(block_hash)
            if entry is not None:
                count = entry[0] * self._decay ** (n - entry[1])
                if count >= at_least:
                    out[block_hash] = count
        return out

    def absorb(self, replica: Hashable, counts: Mapping[int, float], weight: float) -> None:
        """A replica's report (its `counts` and `weight`) replaces its previous one in the pool."""
        old_counts, old_weight = self._reports.get(replica, ({}, 0.0))
        pooled = self._pooled
        for block_hash, count in old_counts.items():
            left = pooled.get(block_hash, 0.0) - count
            if left > 1e-9:
                pooled[block_hash] = left
            else:
                pooled.pop(block_hash, None)
        for block_hash, count in counts.items():
            pooled[block_hash] = pooled.get(block_hash, 0.0) + count
        self._pooled_weight = max(0.0, self._pooled_weight - old_weight + weight)
        self._reports[replica] = (dict(counts), weight)

    def forget(self, replica: Hashable) -> None:
        """A replica left: its report leaves the pool."""
        if replica in self._reports:
            self.absorb(replica, {}, 0.0)
            del self._reports[replica]

    def horizon(self, num_pool_blocks: int) -> float:
        """Requests until the pool has taken `num_pool_blocks` new blocks at the recent rate
        (infinite before any request took one)."""
        mean_new = self._new_blocks / self._weight if self._weight else 0.0
        return num_pool_blocks / mean_new if mean_new > 0 else math.inf

    def value_s(self, victims: Iterable[int], horizon: float, recompute_s: float, holders=lambda block_hash: 1) -> float:
        """Expected recompute seconds lost by evicting `victims` from one replica; a block that
        `holders` says n replicas hold counts 1/n (the others keep serving it)."""
        total = 0.0
        for block_hash in victims:
            p = self.probability(block_hash)
            if p > 0:
                wanted = 1.0 if math.isinf(horizon) else -math.expm1(-p * horizon)
                total += wanted / max(1, holders(block_hash))
        return total * recompute_s

    def __len__(self) -> int:
        return len(self._counts)

    def _prune(self) -> None:
        n = self.num_requests
        self._counts = {
            block_hash: (count, stamp) for block_hash, (count, stamp) in self._counts.items()
            if count * self._decay ** (n - stamp) >= _PRUNE_BELOW
        }
