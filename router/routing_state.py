"""What one router knows of a pool, and how it turns that into a decision. No Ray: the Serve
adapter (router/request_router.py) and the routing benchmark's simulator (load_tests/routing/sim.py)
both drive this, so the simulator makes exactly the decisions a deployed router would.

    replica routing stats (newest per replica) ──▶ RouterState.route(request, candidates, now)
        kv_hashes snapshot ──▶ PrefixIndex.update      (older or repeated versions ignored)
        load figures       ──▶ ReplicaLoad             (load_from_stats)
            + what this router sent the replica after its stats were taken (prefill tokens,
              KV blocks, requests)
        policy.choose(request, loads, index) ──▶ Decision
        then: count the chosen replica's uncached tokens as in flight, note_routed its hashes

A router counts what it sent since a replica's last stats because stats lag (one stats period,
0.5 s by default): without it a burst of requests would all see the same stale queue and pile
onto one replica. That holds for every policy: prefix_cost weighs the prefill tokens, least_kv
the KV blocks and sequences (a decode pool's burst is the requests of one stats period).
Entries older than the stats they are covered by are dropped; entries older than
INFLIGHT_HORIZON_S are dropped even if no stats arrive (a replica whose stats stopped).

Stats lag the other way too: a snapshot taken while a request ran counts it as queued (its
prefill tokens) or running (its sequence and blocks) until the next one, though it completed in
between. So the router also counts what it saw complete (`completed`: Serve's
on_request_completed, when a prefill's first token or a stream's end reaches it): a request still
unreported leaves the sent count, one the stats already cover is taken off them until stats taken
after its completion arrive. Without this, with requests shorter than a stats period, the replica
that has just answered a prefix looks busy with that answer, and the next request of the prefix
goes to compute it on another (seen live: a third of the hits lost on two vLLM prefill replicas).

The same holds for the blocks a routed prompt will leave cached: a snapshot shows them only once
the engine has computed them, which for a prompt queued behind a long prefill is several
snapshots later. Until then each new snapshot would erase them from the index, and the next
request of that prefix would go to compute it a second time elsewhere (issue 19: at a tight
cache, 6% of requests did). So `PendingBlocks` keeps each routed prompt's hashes and lays them
over every newer snapshot of its replica (PrefixIndex.note_routed) until a snapshot taken after
twice its estimated TTFT arrives: the prompt should be in it by then, and if it is not, the
engine has evicted it since.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable, Iterable, Sequence

from router.index import PrefixIndex
from router.replica_stats import RoutingStats
from router.route_types import Decision, ReplicaLoad, RouteRequest

__all__ = ["RouterState", "InflightTokens", "PendingBlocks", "load_from_stats", "INFLIGHT_HORIZON_S"]

INFLIGHT_HORIZON_S = 30.0  # forget routed-token accounting older than this even without stats


def load_from_stats(replica_id: Hashable, stats: RoutingStats | None) -> ReplicaLoad:
    """A replica's load figures from its routing stats (all zero before its first report)."""
    stats = stats or RoutingStats()
    return ReplicaLoad(
        replica_id=replica_id,
        num_queued_prefill_tokens=stats.num_queued_prefill_tokens,
        prefill_tokens_per_s=stats.prefill_tokens_per_s,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_free_blocks=stats.num_free_blocks,
        num_blocks=stats.num_blocks,
        kv_usage=stats.kv_usage,
        requests_per_s=stats.requests_per_s,
        num_computed_tokens=stats.num_computed_tokens,
        num_requests=stats.num_requests,
        lora_resident=frozenset(stats.lora_resident),
        lora_load_s=stats.lora_load_s,
        lora_slots_free=stats.lora_slots_free,
    )


class InflightTokens:
    """What this router sent each replica lately: each request's prefill tokens and KV blocks,
    when it was sent and, once the router saw it, when it completed. Against a replica's stats
    (taken at some time) that is what the stats lack (sent after them, not completed) less what
    they still count (sent before them, completed since)."""

    def __init__(self, horizon_s: float = INFLIGHT_HORIZON_S) -> None:
        self.horizon_s = horizon_s
        # per replica: [sent at, tokens, blocks, key, completed at or None], by send time
        self._sent: dict[Hashable, deque[list]] = {}
        self._by_key: dict[Hashable, list] = {}  # key -> its entry, until it completes

    def add(self, replica_id: Hashable, now: float, num_tokens: int, num_blocks: int = 0, key: Hashable = None) -> None:
        entry = [now, num_tokens, num_blocks, key, None]
        self._sent.setdefault(replica_id, deque()).append(entry)
        if key is not None:
            self._by_key[key] = entry

    def done(self, key: Hashable, now: float) -> None:
        """The request sent as `key` completed at `now` (nothing for a key never sent, done, or
        past the horizon)."""
        entry = self._by_key.pop(key, None)
        if entry is not None:
            entry[4] = now

    def unreported(self, replica_id: Hashable, stats_time: float, now: float) -> int:
        """Tokens the replica's stats (taken at `stats_time`) lack, net (class docstring)."""
        return self.unreported_load(replica_id, stats_time, now)[0]

    def unreported_load(self, replica_id: Hashable, stats_time: float, now: float) -> tuple[int, int, int, int]:
        """What the replica's stats (taken at `stats_time`) lack of this router's requests:
        (tokens, blocks, requests) still to run, net: sent after the stats and not completed, less
        those the stats count that completed since (negative: the stats overcount); and the
        tokens of completed requests the stats' counters of computed tokens do not show. Entries
        older than the horizon, or that no stats can count any more, are forgotten.

            sent after the stats, running      queue +          load: in the queue
            sent after the stats, completed    -                load +
            sent before, completed since       queue -          load + (its stats' queue lost it)
            sent before, running               -                in the stats' queue
        """
        sent = self._sent.get(replica_id)
        if not sent:
            return 0, 0, 0, 0
        horizon = now - self.horizon_s
        kept: deque[list] = deque()
        tokens = blocks = requests = done_tokens = 0
        for entry in sent:
            sent_at, num_tokens, num_blocks, key, done_at = entry
            if sent_at <= horizon or (done_at is not None and done_at <= stats_time):
                self._by_key.pop(key, None)
                continue
            kept.append(entry)
            if done_at is not None:
                done_tokens += num_tokens
            if sent_at > stats_time and done_at is None:  # the stats lack it
                sign = 1
            elif sent_at <= stats_time and done_at is not None:  # the stats count it, gone since
                sign = -1
            else:  # counted and running, or sent and done since: the stats' queue is right about it
                continue
            tokens += sign * num_tokens
            blocks += sign * num_blocks
            requests += sign
        self._sent[replica_id] = kept
        return tokens, blocks, requests, done_tokens

    def remove(self, replica_id: Hashable) -> None:
        for entry in self._sent.pop(replica_id, ()):
            self._by_key.pop(entry[3], None)


class PendingBlocks:
    """Routed prompts' hashes per replica, until a snapshot that should show them arrives."""

    def __init__(self, horizon_s: float = INFLIGHT_HORIZON_S) -> None:
        self.horizon_s = horizon_s
        self._routed: dict[Hashable, deque[tuple[float, Sequence[int]]]] = {}  # (settled by, hashes)

    def add(self, replica_id: Hashable, settled_by: float, block_hashes: Sequence[int]) -> None:
        self._routed.setdefault(replica_id, deque()).append((settled_by, block_hashes))

    def unsettled(self, replica_id: Hashable, stats_time: float, now: float) -> list[Sequence[int]]:
        """The hashes of the prompts a snapshot taken at `stats_time` may not show yet, oldest
        first; the others are forgotten."""
        routed = self._routed.get(replica_id)
        if not routed:
            return []
        kept = deque(entry for entry in routed if entry[0] > max(stats_time, now - self.horizon_s))
        self._routed[replica_id] = kept
        return [hashes for _, hashes in kept]

    def remove(self, replica_id: Hashable) -> None:
        self._routed.pop(replica_id, None)


class RouterState:
    """One router's policy, prefix index, in-flight accounting and decision counts."""

    def __init__(self, policy) -> None:
        self.policy = policy
        self.index = PrefixIndex()
        self.inflight = InflightTokens()
        self.pending = PendingBlocks()
        self.decisions: Counter[str] = Counter()  # by reason, for metrics
        self._reuse_seen: dict[Hashable, tuple[int, float]] = {}  # replica -> the stats its reuse report came with

    def route(
        self,
        request: RouteRequest,
        candidates: Sequence[tuple[Hashable, RoutingStats | None]],
        now: float,
        *,
        known_replicas: Iterable[Hashable] = (),
        key: Hashable = None,
    ) -> Decision:
        """Choose among `candidates` (replica id, its newest routing stats or None) at wall time
        `now`. Index entries of replicas neither known nor candidates are dropped. `key` names the
        request for `completed` (its id by default)."""
        assert candidates, "route() needs at least one candidate"
        present = {*known_replicas, *(replica_id for replica_id, _ in candidates)}
        self.index.retain(present)
        for gone in [replica_id for replica_id in self._reuse_seen if replica_id not in present]:
            self._forget_reuse(gone)
        loads = [self.load(replica_id, stats, now) for replica_id, stats in candidates]
        self.policy._now = now
        decision = self.policy.choose(request, loads, self.index)
        decision.num_predicted_tokens = self.predicted_tokens(decision.chosen, request)
        self.decisions[decision.reason] += 1
        self.inflight.add(decision.chosen, now, max(0, request.num_prompt_tokens - decision.num_matched_tokens),
                          request.num_blocks_needed, key=request.request_id if key is None else key)
        if request.block_hashes:
            self.index.note_routed(decision.chosen, request.block_hashes)
            ttft_s = decision.estimated_ttft_s.get(decision.chosen, 0.0)
            self.pending.add(decision.chosen, now + 2 * ttft_s, request.block_hashes)
        return decision

    def completed(self, key: Hashable, now: float) -> None:
        """A request this router sent (as `key`) has completed at wall time `now`: its prefill is
        done, or its stream is over (module docstring). Its blocks stay laid over the snapshots
        until one shows them."""
        self.inflight.done(key, now)

    def load(self, replica_id: Hashable, stats: RoutingStats | None, now: float) -> ReplicaLoad:
        """Feed the index from the stats' snapshot; the load figures plus what this router sent
        the replica since (its prefill tokens, KV blocks and requests)."""
        if stats is not None and stats.kv_hashes is not None:
            if self.index.update(replica_id, stats.kv_version, stats.kv_hashes, epoch=stats.epoch, num_blocks=stats.num_blocks):
                for block_hashes in self.pending.unsettled(replica_id, stats.wall_time_s, now):
                    self.index.note_routed(replica_id, block_hashes)
        if stats is not None and stats.block_reuse is not None and self._reuse_seen.get(replica_id) != (stats.epoch, stats.wall_time_s):
            reuse = getattr(self.policy, "reuse", None)  # the prefill policy's (router/eviction.py)
            if reuse is not None:
                reuse.absorb(replica_id, stats.block_reuse, stats.block_reuse_weight)
            self._reuse_seen[replica_id] = (stats.epoch, stats.wall_time_s)
        load = load_from_stats(replica_id, stats)
        tokens, blocks, sequences, done = self.inflight.unreported_load(replica_id, stats.wall_time_s if stats is not None else 0.0, now)
        load.num_queued_prefill_tokens = max(0, load.num_queued_prefill_tokens + tokens)
        # (what completed since is taken off, down to nothing: never below what the stats hold)
        load.unreported_blocks = max(blocks, load.num_free_blocks - load.num_blocks)
        load.unreported_sequences = max(sequences, -(load.num_running + load.num_waiting))
        load.unreported_done_tokens = done
        return load

    def predicted_tokens(self, replica_id: Hashable, request: RouteRequest) -> int:
        """The prompt tokens the replica should find cached, per the index: its leading blocks
        there, at most those before the prompt's last token (an engine always computes that one,
        to sample from it)."""
        max_blocks = (request.num_prompt_tokens - 1) // request.block_size
        if max_blocks <= 0:
            return 0
        return min(self.index.num_matched_blocks(replica_id, request.block_hashes), max_blocks) * request.block_size

    def cached_prefix_everywhere(self, block_hashes) -> int:
        """The leading blocks of a prompt that every replica of the pool holds (per the index):
        what a request finds cached wherever a policy that ignores prefixes sends it."""
        return min((self.index.num_matched_blocks(replica, block_hashes) for replica in self.index.replicas), default=0)

    def remove(self, replica_id: Hashable) -> None:
        """A replica died or left: forget what this router knew of it."""
        self.index.remove(replica_id)
        self.inflight.remove(replica_id)
        self.pending.remove(replica_id)
        self._forget_reuse(replica_id)

    def _forget_reuse(self, replica_id: Hashable) -> None:
        self._reuse_seen.pop(replica_id, None)
        reuse = getattr(self.policy, "reuse", None)
        if reuse is not None:
            reuse.forget(replica_id)
