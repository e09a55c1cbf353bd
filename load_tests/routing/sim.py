"""The routing benchmark's simulator: the real policies and router state against N simulated
prefill replicas, in simulated time. Pure Python, no Ray, no model.

    arrival ──▶ RouterState.route (router/routing_state.py: the deployed router's own code:
                │   PrefixIndex from the replicas' last snapshots + note_routed, in-flight tokens,
                │   the policy object of router/policies.py)
                ▼
    SimReplica: FIFO queue ──▶ one prefill at a time ──▶ first token (TTFT = finish - arrival)
                BlockCache: KV blocks, prefix cached, LRU eviction
                every stats_period_s: routing stats like serving/deployments/engine_worker.py's (block-hash snapshot,
                queued prefill tokens, measured rate, running/waiting), which the routers see
                until the next ones

A replica's cache works like the engine's BlockManager: a prompt hits the leading blocks whose
chained hashes it holds (a block only if all before it hit, at most (tokens - 1) // block_size
blocks, so one token is always computed); the running prompt holds ceil(tokens / block_size)
blocks; finished full blocks become evictable, freed tail first so the head of a prefix is the
most recently used; blocks are taken least recently used first. A prompt's new blocks are
reported stored when it finishes (the engine commits per 512-token chunk: earlier by < 1 step).

Service time (CostModel, calibrated on the real engine by load_tests/routing/calibration.py):

    overhead_s + uncached / tokens_per_s + attention_pair_s * (uncached * cached + uncached * (uncached + 1) / 2)

The queued prefill tokens a replica reports are the uncached tokens it still has to compute:
the running prompt's remainder plus, for each waiting prompt, its length less what the cache
holds of it now (what the engine counts once it admits them; it admits waiting prompts as its
512-token step budget allows, so at the loads simulated here nearly all are admitted).

The oracle (`oracle_hit_tokens`) is the hit rate of a router that knows the workload in advance
and pins prefixes to replicas once: groups in order of request count (most first), each to the
replica with the most room left, where a replica's room is its capacity less one running prompt's
own blocks (ceil(prompt / block_size) - prefix blocks) less what is already pinned there. A group
gets min(its prefix blocks, that room) blocks, its leading ones; every request of the group but
the first then hits those blocks (capped like the engine's lookup); groups requested once are not
pinned. When every prefix fits (the default workload: 16 x 64 prefix blocks, 16 replicas x 252
blocks of room) this is an upper bound for any policy: each prefix must be computed once, and
suffixes never hit. When they do not, it is a good static placement, not a proof: an LRU cache
also reuses the room a running prompt leaves between prompts, so a policy can beat it slightly.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass

from load_tests.routing.metrics import PolicyRun, RoutedRequest
from load_tests.routing.workload import Workload, WorkloadRequest
from router.eviction import REPLICA_REUSE_WINDOW, REUSE_REPORT_MIN, BlockReuse
from router.index import eviction_order
from router.policies import Decision, RouteRequest, build_policy
from router.policy_params import PARAMS
from router.replica_stats import RequestRate, RoutingStats
from router.routing_state import RouterState
from serving.engine.prefill_rate import PrefillRate

__all__ = [
    "CostModel", "SimConfig", "BlockCache", "SimReplica", "simulate", "oracle_hit_tokens", "oracle_placement",
    "OracleReplayPolicy", "make_policy",
]

_FINISH, _STATS, _ARRIVAL = 0, 1, 2  # order of simultaneous events
_MIN_RATE_TOKENS = 32  # like the engine: shorter prefills say more about overhead than rate


@dataclass(frozen=True)
class CostModel:
    overhead_s: float
    tokens_per_s: float  # uncached prompt tokens
    attention_pair_s: float = 0.0  # per query-key pair of causal attention over the prompt

    def service_s(self, num_uncached_tokens: int, num_cached_tokens: int = 0) -> float:
        u = num_uncached_tokens
        pairs = u * num_cached_tokens + u * (u + 1) / 2
        return self.overhead_s + u / self.tokens_per_s + pairs * self.attention_pair_s


@dataclass(frozen=True)
class SimConfig:
    num_replicas: int = 16
    num_blocks: int = 256  # KV capacity per replica
    block_size: int = 16
    stats_period_s: float = 0.5  # routing.stats_period_s
    num_routers: int = 1  # ingress replicas; requests alternate between them
    seed: int = 0


class BlockCache:
    """One replica's KV blocks: at most one prompt running (its blocks held), the rest an LRU of
    cached full blocks by chained hash (oldest first)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.held: list[int] = []  # hashes of the cached blocks the running prompt hit
        self.num_held_blocks = 0  # every block of the running prompt
        self.version = 0  # bumped by every store or eviction
        self.evicted: list[int] = []  # in eviction order, for tests

    def num_matched_blocks(self, block_hashes: list[int], num_tokens: int) -> int:
        held = set(self.held)
        limit = min(len(block_hashes), (num_tokens - 1) // self.block_size)
        for i in range(limit):
            if block_hashes[i] not in self.lru and block_hashes[i] not in held:
                return i
        return limit

    def acquire(self, block_hashes: list[int], num_tokens: int) -> int:
        """Start a prompt: take its cached leading blocks and room for the rest; returns the hits."""
        assert not self.num_held_blocks, "one prompt at a time"
        num_needed = -(-num_tokens // self.block_size)
        assert num_needed <= self.num_blocks, f"a {num_tokens}-token prompt needs {num_needed} > {self.num_blocks} blocks"
        num_hits = self.num_matched_blocks(block_hashes, num_tokens)
        self.held = block_hashes[:num_hits]
        for block_hash in self.held:
            del self.lru[block_hash]
        self.num_held_blocks = num_needed
        while len(self.lru) + num_needed > self.num_blocks:
            block_hash, _ = self.lru.popitem(last=False)
            self.evicted.append(block_hash)
            self.version += 1
        return num_hits

    def release(self, block_hashes: list[int], num_tokens: int, retain: bool = True) -> None:
        """The prompt finished: its full blocks become cached, tail first (the head most recent)."""
        num_full = min(len(block_hashes), num_tokens // self.block_size)
        held = set(self.held)
        cold = []
        for i in reversed(range(num_full)):
            block_hash = block_hashes[i]
            if block_hash not in self.lru:  # a duplicate of a cached block is not cached twice
                if retain or block_hash in held:
                    self.lru[block_hash] = None
                else:
                    cold.append(block_hash)
        for block_hash in reversed(cold):  # the eviction end, the tail out first
            self.lru[block_hash] = None
            self.lru.move_to_end(block_hash, last=False)
        if num_full:
            self.version += 1  # new blocks, or the hits moved to the recent end
        self.held = []
        self.num_held_blocks = 0

    def hashes(self) -> list[int]:
        """Every cached hash in eviction order (the engine's free queue, then the running
        prompt's hits, which are taken last): what a worker's snapshot lists."""
        return [*self.lru, *reversed(self.held)]


@dataclass
class _Job:
    request: WorkloadRequest
    retain: bool = True
    start_s: float = 0.0
    finish_s: float = 0.0
    num_cached_tokens: int = 0


class SimReplica:
    def __init__(self, name: str, config: SimConfig, cost: CostModel) -> None:
        self.name = name
        self.cost = cost
        self.cache = BlockCache(config.num_blocks, config.block_size)
        self.queue: deque[_Job] = deque()
        self.running: _Job | None = None
        self.prefill_rate = PrefillRate()  # as the engine measures it (serving/engine/prefill_rate.py)
        self.requests = RequestRate()  # as the worker measures it
        self._num_taken = 0  # submits and finishes: with the cache's version, the snapshot's
        self.num_requests = 0  # taken, cumulative (RoutingStats.num_requests)
        self._num_computed_tokens = 0  # by finished prefills; the running one's part is added in stats
        self._snapshot: tuple[int, list[int]] = (-1, [])
        self.block_reuse = BlockReuse(REPLICA_REUSE_WINDOW)  # as the worker counts it

    def submit(self, request: WorkloadRequest, now: float, retain: bool = True) -> _Job | None:
        """Queue a request; returns the job if it started now (its finish_s is then set)."""
        self.requests.add(now)
        self.block_reuse.observe(request.block_hashes, 0)
        self._num_taken += 1
        self.num_requests += 1
        self.queue.append(_Job(request, retain))
        return self._start_next(now) if self.running is None else None

    def finish(self, now: float) -> tuple[_Job, _Job | None]:
        """The running prompt's first token; returns it and the job started next, if any."""
        job = self.running
        assert job is not None and abs(job.finish_s - now) < 1e-9, (job, now)
        self.cache.release(job.request.block_hashes, job.request.num_prompt_tokens, job.retain)
        self._num_taken += 1
        num_uncached = job.request.num_prompt_tokens - job.num_cached_tokens
        self._num_computed_tokens += num_uncached
        if num_uncached >= _MIN_RATE_TOKENS:
            self.prefill_rate.add(num_uncached, job.finish_s - job.start_s)
        self.running = None
        return job, self._start_next(now)

    def _start_next(self, now: float) -> _Job | None:
        if not self.queue:
            return None
        job = self.running = self.queue.popleft()
        request = job.request
        job.num_cached_tokens = self.cache.acquire(request.block_hashes, request.num_prompt_tokens) * self.cache.block_size
        num_uncached = request.num_prompt_tokens - job.num_cached_tokens
        job.start_s, job.finish_s = now, now + self.cost.service_s(num_uncached, job.num_cached_tokens)
        return job

    def _running_left(self, now: float) -> int:
        """The running prompt's uncached tokens not computed yet (computed at an even pace)."""
        job = self.running
        if job is None:
            return 0
        left = (job.finish_s - now) / (job.finish_s - job.start_s) if job.finish_s > job.start_s else 0.0
        return round((job.request.num_prompt_tokens - job.num_cached_tokens) * left)

    def num_computed_tokens(self, now: float) -> int:
        """Tokens computed so far: the finished prefills' and the running one's computed part."""
        job = self.running
        running = job.request.num_prompt_tokens - job.num_cached_tokens - self._running_left(now) if job else 0
        return self._num_computed_tokens + running

    def queued_prefill_tokens(self, now: float) -> int:
        queued = self._running_left(now)
        for job in self.queue:
            request = job.request
            cached = self.cache.num_matched_blocks(request.block_hashes, request.num_prompt_tokens)
            queued += request.num_prompt_tokens - cached * self.cache.block_size
        return queued

    def routing_stats(self, now: float) -> RoutingStats:
        """What a worker reports (serving/deployments/engine_worker.py `routing_stats`), the fields
        the routers read: the cached hashes in eviction order, then those of the prompts taken
        and not finished (router/index.py CachedBlockSet.take)."""
        version = self.cache.version + self._num_taken
        if self._snapshot[0] != version:
            jobs = ([self.running] if self.running is not None else []) + list(self.queue)
            self._snapshot = (version, eviction_order(self.cache.hashes(), (job.request.block_hashes for job in jobs)))
        return RoutingStats(
            kv_version=version,
            kv_hashes=self._snapshot[1],  # PrefixIndex.update copies it
            num_blocks=self.cache.num_blocks,
            wall_time_s=now,
            num_queued_prefill_tokens=self.queued_prefill_tokens(now),
            prefill_tokens_per_s=self.prefill_rate.tokens_per_s,
            num_running=int(self.running is not None),
            num_waiting=len(self.queue),
            requests_per_s=self.requests.per_s(now),
            num_computed_tokens=self.num_computed_tokens(now),
            num_requests=self.num_requests,
            block_reuse=self.block_reuse.counts(self._snapshot[1], at_least=REUSE_REPORT_MIN),
            block_reuse_weight=self.block_reuse.weight,
        )


def make_policy(name: str, params: dict | None = None, seed: int = 0):
    """build_policy with a seed for the policies that take one."""
    params = dict(params or {})
    if "seed" in PARAMS[name].model_fields:
        params.setdefault("seed", seed)
    return build_policy(name, **params)


def simulate(
    workload: Workload, policy: str, config: SimConfig, cost: CostModel, params: dict | None = None,
    *, policy_object=None,
) -> PolicyRun:
    """Every request of `workload` through `policy` (built by name, or `policy_object(seed)`,
    reported as `policy`) on `config.num_replicas` replicas."""
    rng = random.Random(config.seed)
    replicas = [SimReplica(f"replica-{i:02d}", config, cost) for i in range(config.num_replicas)]
    by_name = {replica.name: replica for replica in replicas}
    routers = [
        RouterState(policy_object(config.seed + k) if policy_object else make_policy(policy, params, seed=config.seed + k))
        for k in range(config.num_routers)
    ]
    latest = {replica.name: replica.routing_stats(0.0) for replica in replicas}  # reported at start
    events: list[tuple[float, int, int, str]] = []  # (time, kind, tie-break, replica)
    order = 0
    for replica in replicas:  # each replica's stats timer runs at its own phase
        heapq.heappush(events, (rng.uniform(0, config.stats_period_s), _STATS, order, replica.name))
        order += 1
    records: list[RoutedRequest] = []
    routed_by: dict = {}  # request id -> the router that sent it
    requests = workload.requests
    next_arrival = 0

    def started(job, replica_name: str) -> None:
        nonlocal order
        if job is not None:
            heapq.heappush(events, (job.finish_s, _FINISH, order, replica_name))
            order += 1

    while events or next_arrival < len(requests):
        arrival_s = requests[next_arrival].arrival_s if next_arrival < len(requests) else float("inf")
        if events and (events[0][0], events[0][1]) < (arrival_s, _ARRIVAL):
            now, kind, _, name = heapq.heappop(events)
            replica = by_name[name]
            if kind == _FINISH:
                job, next_job = replica.finish(now)
                request = job.request
                routed_by.pop(request.request_id).completed(request.request_id, now)  # Serve's on_request_completed
                records.append(RoutedRequest(name, request.num_prompt_tokens, job.num_cached_tokens, now - request.arrival_s))
                started(next_job, name)
            elif next_arrival < len(requests):  # stats matter only while requests still arrive
                latest[name] = replica.routing_stats(now)
                heapq.heappush(events, (now + config.stats_period_s, _STATS, order, name))
                order += 1
            continue
        request = requests[next_arrival]
        router = routers[next_arrival % len(routers)]
        next_arrival += 1
        route_request = RouteRequest(
            request.request_id, request.num_prompt_tokens, request.block_hashes, workload.spec.block_size,
            text=request.text,
        )
        decision = router.route(route_request, [(name, latest[name]) for name in by_name], arrival_s)
        routed_by[request.request_id] = router
        started(by_name[decision.chosen].submit(request, arrival_s, decision.retain), decision.chosen)

    decisions: Counter[str] = Counter()
    for router in routers:
        decisions.update(router.decisions)
    return PolicyRun(policy, list(by_name), records, dict(decisions))


def oracle_hit_tokens(
    workload: Workload, num_replicas: int, num_blocks: int, *, foresight: bool = True,
) -> tuple[int, int, dict[int, int]]:
    """(hit tokens, prompt tokens, {group: prefix blocks pinned}) of the oracle in the module
    docstring. `foresight=False`: the same static placement chosen by the groups' popularity
    (the workload's weights), not by how often each was in fact requested: the best a placement
    fixed in advance can expect. With uniform popularity the pinned groups are any, and
    the clairvoyant oracle's edge is the luck of the draw: it pins the groups that happened to
    come most often."""
    hit_tokens, prompt_tokens, pinned, _ = oracle_placement(workload, num_replicas, num_blocks, foresight=foresight)
    return hit_tokens, prompt_tokens, pinned


def oracle_placement(
    workload: Workload, num_replicas: int, num_blocks: int, *, foresight: bool = True,
) -> tuple[int, int, dict[int, int], dict[int, int]]:
    """oracle_hit_tokens, and {group: the replica it is pinned to}."""
    spec = workload.spec
    bs = spec.block_size
    num_prefix_blocks = spec.prefix_len // bs
    working_blocks = -(-spec.prompt_len // bs) - num_prefix_blocks  # one running prompt's own blocks
    room = [max(0, num_blocks - working_blocks)] * num_replicas
    counts = workload.group_counts()
    max_hit_blocks = min(num_prefix_blocks, (spec.prompt_len - 1) // bs)
    pinned: dict[int, int] = {}
    homes: dict[int, int] = {}
    # Popularity falls with the group's index (routing/workload.py): by index is by weight.
    order = sorted(range(spec.num_groups), key=lambda g: (-counts[g], g)) if foresight else range(spec.num_groups)
    for group in order:
        best = max(range(num_replicas), key=lambda r: (room[r], -r))
        num_pinned = min(num_prefix_blocks, room[best])
        if (counts[group] > 1 or not foresight) and num_pinned > 0:
            room[best] -= num_pinned
            pinned[group] = num_pinned
            homes[group] = best
    hit_tokens = sum(max(0, counts[g] - 1) * min(n, max_hit_blocks) * bs for g, n in pinned.items())
    return hit_tokens, sum(r.num_prompt_tokens for r in workload.requests), pinned, homes


class OracleReplayPolicy:
    """The oracle's placement replayed on the simulated replicas: a pinned group's requests go to
    its replica, every other request to the replica with the fewest queued tokens (ties at
    random). The oracle's figure assumes pinned blocks stay cached; this shows how much of it the
    same placement keeps once the other requests' blocks share the replicas' LRU caches."""

    name = "oracle_replay"

    def __init__(self, workload: Workload, num_replicas: int, num_blocks: int, seed: int = 0) -> None:
        _, _, _, homes = oracle_placement(workload, num_replicas, num_blocks)
        self._home_of_head = {}
        for request in workload.requests:  # a group's first block hash names it
            if request.group in homes and request.block_hashes:
                self._home_of_head[request.block_hashes[0]] = homes[request.group]
        self._rng = random.Random(seed)

    def choose(self, request, loads, index=None):
        ids = sorted((load.replica_id for load in loads), key=str)
        home = self._home_of_head.get(request.block_hashes[0]) if request.block_hashes else None
        if home is not None:
            best = ids[home]
        else:
            best = min(loads, key=lambda load: (load.num_queued_prefill_tokens, self._rng.random())).replica_id
        return Decision([best] + [replica_id for replica_id in ids if replica_id != best], "oracle_replay")
