"""References for the pressure sweep's hit rates besides the static oracle (routing/sim.py): what
one cache as large as the whole pool would hit, with LRU eviction and with offline-optimal
eviction. Neither routes anything: they say how much of a policy's distance to the oracle is
routing and how much is the engines' eviction.

    pooled LRU     one LRU cache of replicas x blocks, the requests in arrival order, each
                   request's full blocks made the most recent after it (tail first, as the
                   engine frees them). What a router would reach if its replicas behaved as one
                   cache: no block held twice, no room kept for running prompts, no queue. Not a
                   bound: routing can beat it (a replica kept for cold prompts shields the
                   others' prefixes), and the load target leaves little room to.
    pooled optimal the same cache, but every eviction takes the block whose next use is
                   furthest ahead, blocks never used again first (Belady's MIN, which may also
                   decline to keep a request's own blocks). The blocks of one prefix are next
                   used together, so it evicts a prefix tail first and what it keeps of a
                   prefix is its head: a request hits every block it finds. An upper bound for
                   any router over replicas whose blocks add up to at most the pool's (each
                   replica's cached blocks are part of the union, and MIN hits at least as
                   many blocks as any eviction on the same request order), up to the order in
                   which queues start the requests, which differs from arrival by a few
                   requests.

    single home    the most hits any router can reach over any caches: each group's first request
                   computes its prefix and every later one hits all of it. It is reached only by
                   computing each prefix once, so on one replica, which then computes every
                   request of that group: the heaviest group's tokens over the pool's mean are
                   the least max/mean load of any placement that reaches it. Where the tree's
                   hit rate is this maximum (the ample cells, whenever it never copies a
                   prefix), matching it takes that load: in g16-z1.2-r16-c4 364 of the 1,000
                   requests are of one group, 4.84x the mean, so "hit rate >= the tree's" and
                   "max/mean load <= 1.3" cannot both hold there (routing/sweep.py reports such
                   cells). It relies on the sweep's workloads: groups share no prefix block and
                   every suffix is its request's own (routing/workload.py).

Hits are counted like the engine's: the leading blocks held, at most (tokens - 1) // block_size.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict

from load_tests.routing.workload import Workload

__all__ = ["pooled_lru_hit_tokens", "pooled_optimal_hit_tokens", "single_home"]


def _num_hits(held, block_hashes: list[int], num_tokens: int, block_size: int) -> int:
    limit = min(len(block_hashes), (num_tokens - 1) // block_size)
    for i in range(limit):
        if block_hashes[i] not in held:
            return i
    return limit


def pooled_lru_hit_tokens(workload: Workload, num_blocks: int) -> int:
    """Hit tokens of one LRU cache of `num_blocks` blocks (module docstring)."""
    bs = workload.spec.block_size
    lru: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for request in workload.requests:
        hashes = request.block_hashes
        hits += _num_hits(lru, hashes, request.num_prompt_tokens, bs) * bs
        for block_hash in reversed(hashes[: request.num_prompt_tokens // bs]):
            lru.pop(block_hash, None)
            lru[block_hash] = None
        while len(lru) > num_blocks:
            lru.popitem(last=False)
    return hits


def pooled_optimal_hit_tokens(workload: Workload, num_blocks: int) -> int:
    """Hit tokens of one cache of `num_blocks` blocks with Belady's MIN eviction (module docstring)."""
    bs = workload.spec.block_size
    requests = workload.requests
    full = [request.block_hashes[: request.num_prompt_tokens // bs] for request in requests]
    # next_use[i][j]: the index of the next request after i that uses block j of request i.
    later: dict[int, float] = {}
    next_use: list[list[float]] = [[]] * len(requests)
    for i in range(len(requests) - 1, -1, -1):
        next_use[i] = [later.get(block_hash, math.inf) for block_hash in full[i]]
        for block_hash in full[i]:
            later[block_hash] = i
    cached: dict[int, float] = {}  # hash -> next use
    furthest: list[tuple[float, int, int]] = []  # (-next use, -position in its prompt, hash), lazily pruned
    hits = 0
    for i, request in enumerate(requests):
        hits += _num_hits(cached, request.block_hashes, request.num_prompt_tokens, bs) * bs
        for position, (block_hash, use) in enumerate(zip(full[i], next_use[i])):
            cached[block_hash] = use
            heapq.heappush(furthest, (-use, -position, block_hash))
        while len(cached) > num_blocks:
            neg_use, _, block_hash = heapq.heappop(furthest)
            if cached.get(block_hash) == -neg_use:  # else a stale entry: the block was used since
                del cached[block_hash]
    return hits


def single_home(workload: Workload, num_replicas: int) -> tuple[float, float]:
    """(hit rate, load floor) of the single home (module docstring): the most hits any router can
    reach on `workload`, and the least max/mean computed-token load of a placement that does."""
    spec = workload.spec
    bs = spec.block_size
    hit = min(spec.prefix_len // bs, (spec.prompt_len - 1) // bs) * bs  # what a later request of a group finds
    counts = [n for n in workload.group_counts() if n]
    group_tokens = [n * spec.prompt_len - (n - 1) * hit for n in counts]  # a group's tokens on its one replica
    hit_rate = sum((n - 1) * hit for n in counts) / (len(workload.requests) * spec.prompt_len)
    mean = sum(group_tokens) / num_replicas
    return hit_rate, max(1.0, max(group_tokens) / mean)
