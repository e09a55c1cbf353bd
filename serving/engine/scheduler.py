"""Continuous batching with chunked prefill, a token budget per step, and preemption by recompute.

There are no prefill or decode phases. Every step the scheduler walks the running sequences
(highest priority first), giving each `min(pending tokens, budget left)` tokens — one for a
decoding sequence, a chunk for one still prefilling — then admits waiting sequences while budget,
`max_num_seqs` and free blocks last. Prefill chunks and decodes share one forward pass.

Long prompts do not hold up short ones (`long_prefill_token_threshold`, as vLLM's option of that
name; 0: off): a sequence with more than that many tokens left to prefill is "long"; it gets at
most that many tokens per step, and at most `max_long_partial_prefills` long ones prefill at once.
A waiting long prompt beyond that limit is passed over — shorter ones behind it are admitted in
its place — and admitted when a long slot frees. So a short prompt arriving during a 2k-token
prefill waits for one step, not for the whole prompt; the long one takes a few more steps.

When a running sequence cannot get a block, the lowest-priority, newest running sequence is
preempted: its blocks are freed (hashed ones stay in the prefix cache, so recompute is cheap)
and it goes back to the waiting queue with its generated tokens. No admissions happen in a step
that preempted, so a freed sequence is not immediately refilled by a newcomer.

Waiting requests are admitted in priority order (lower is more important, as vLLM), then by
arrival. With `priority_aging_s` a waiting request's priority improves by one level per that many
seconds it has waited, so more important traffic delays it but cannot starve it: the queue is
re-ordered by that aged priority at the start of each step's admissions. Aging orders admissions
only; preemption still picks the least important running sequence by the priority it came with.

A request does not wait for its first step forever (`max_queue_wait_s`; None: it does): after
each step's admissions, a fresh sequence (choice 0, nothing generated, never scheduled) that has
waited longer than that is taken out of the queue and returned in `timed_out`; the engine
finishes its request with finish_reason "queue_timeout". One that could be admitted this step
is admitted, however long it waited. Preempted sequences and ones continued from tokens generated
elsewhere have started: they wait as long as it takes.

A decoding sequence with proposed tokens (`spec_token_ids`, speculative.py) asks for 1 + k
tokens: as many of its proposals as the budget leaves room for are scheduled (the rest are
dropped), and it never counts as a long prefill. Proposals never cost another sequence its
place: when their blocks are not free, they are dropped and the sequence asks for its one token
as usual before anything is preempted.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field

from serving.engine.kv.block_manager import BlockManager
from serving.engine.request import RequestStatus, Sequence

__all__ = ["Scheduler", "SchedulerOutput"]

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, new tokens)
    preempted: list[Sequence] = field(default_factory=list)
    kv_imports: list[Sequence] = field(default_factory=list)  # write seq.pending_import first
    timed_out: list[Sequence] = field(default_factory=list)  # out of the queue: waited past max_queue_wait_s


@dataclass(eq=False)
class Scheduler:
    block_manager: BlockManager
    _: KW_ONLY
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int = 0
    max_long_partial_prefills: int = 1
    max_queue_wait_s: float | None = None
    priority_aging_s: float | None = None
    clock: Callable[[], float] = time.monotonic  # the clock of Sequence.arrival_mono_s
    sliding_window: int = 0  # every layer's window (the least); 0: none, blocks are kept to the end
    # sorted by sort_key (by aged_key from each step's admissions)
    waiting: list[Sequence] = field(default_factory=list, init=False, repr=False)
    running: list[Sequence] = field(default_factory=list, init=False, repr=False)  # sorted by sort_key
    num_preemptions: int = field(default=0, init=False)
    num_expired_imports: int = field(default=0, init=False)  # imports whose arena lease ran out first: computed instead
    num_queue_timeouts: int = field(default=0, init=False)  # requests taken out of the queue after max_queue_wait_s

    def add(self, seq: Sequence) -> None:
        seq.status = RequestStatus.WAITING if seq.num_preemptions == 0 else RequestStatus.PREEMPTED
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of the queues (it finished or was aborted); blocks are the caller's."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.sliding_window:
            self._release_passed_blocks()
        budget, num_long = self._schedule_running(out)
        if out.preempted:
            self._time_out_waiting(out)
            return out
        self._admit_waiting(out, budget, num_long)
        self._time_out_waiting(out)
        return out

    def _release_passed_blocks(self) -> None:
        """Their next queries (from num_computed_tokens on) see keys from here: the blocks before
        go back to the pool, every running sequence's before any allocates. An exported sequence
        keeps its whole prompt in one pool (the payload is every layer's block), its window in
        two (the importer takes only that: HybridBlockManager); a parent keeps its prompt until
        its children share it."""
        bm = self.block_manager
        for seq in self.running:
            if not seq.forks_pending and (bm.releases_held or not seq.hold_kv):
                bm.release_before(seq, seq.num_computed_tokens - self.sliding_window + 1)

    def _schedule_running(self, out: SchedulerOutput) -> tuple[int, int]:
        """The running sequences' next tokens, in priority order, preempting from the back where
        blocks run out; the token budget left and the number of long prefills scheduled."""
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        num_long = 0  # long prefills running this step
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            left = seq.num_tokens - seq.num_computed_tokens
            assert left > 0, f"{seq} is running with nothing to compute"
            if seq.spec_token_ids:
                assert left == 1, f"{seq} has proposed tokens but is not decoding"
                num_new = min(1 + len(seq.spec_token_ids), budget)
                del seq.spec_token_ids[num_new - 1 :]  # those the budget has no room for
            else:
                num_long += self._is_long(left)
                num_new = self._chunk(left, budget)
            while not bm.allocate(seq, seq.num_computed_tokens + num_new):
                if seq.spec_token_ids:  # no blocks for the proposals: decode one token as usual
                    seq.spec_token_ids.clear()
                    num_new = 1
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, num_new))
                budget -= num_new
                i += 1
        return budget, num_long

    def _admit_waiting(self, out: SchedulerOutput, budget: int, num_long: int) -> None:
        """Waiting sequences into the running set while the budget, the seat count and blocks allow."""
        if self.priority_aging_s is not None and len(self.waiting) > 1:
            now = self.clock()
            self.waiting.sort(key=lambda s: self.aged_key(s, now))
        j = 0  # waiting[j] is next; long prompts over the limit are passed over, not popped
        while j < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[j]
            admitted, num_left = self._admit(seq, budget, out, allow_long=num_long < self.max_long_partial_prefills)
            if admitted is None:  # long, and the long slots are taken
                j += 1
                continue
            if not admitted:
                break
            self.waiting.pop(j)
            bisect.insort(self.running, seq, key=lambda s: s.sort_key)
            seq.status = RequestStatus.RUNNING
            if seq.first_scheduled_mono_s is None:
                seq.first_scheduled_mono_s = time.monotonic()
            num_long += self._is_long(num_left)
            budget -= out.scheduled[-1][1]

    def aged_key(self, seq: Sequence, now: float) -> tuple[int, float, int]:
        """`seq.sort_key` with its priority improved by one level per `priority_aging_s` waited."""
        levels = int(max(0.0, now - seq.arrival_mono_s) // self.priority_aging_s)
        return (seq.priority - levels, seq.arrival_mono_s, seq.seq_id)

    def seconds_to_queue_timeout(self) -> float | None:
        """How long until the next waiting sequence times out (0: one has); None: none can."""
        if self.max_queue_wait_s is None:
            return None
        arrivals = [s.arrival_mono_s for s in self.waiting if _is_fresh(s)]
        if not arrivals:
            return None
        return max(0.0, min(arrivals) + self.max_queue_wait_s - self.clock())

    def _time_out_waiting(self, out: SchedulerOutput) -> None:
        if self.max_queue_wait_s is None or not self.waiting:
            return
        latest_arrival = self.clock() - self.max_queue_wait_s
        timed_out = [s for s in self.waiting if s.arrival_mono_s < latest_arrival and _is_fresh(s)]
        for seq in timed_out:
            self.waiting.remove(seq)
        out.timed_out = timed_out
        self.num_queue_timeouts += len(timed_out)

    def _is_long(self, num_left: int) -> bool:
        return 0 < self.long_prefill_token_threshold < num_left

    def _chunk(self, num_left: int, budget: int) -> int:
        """Tokens to compute this step for a sequence with `num_left` to go."""
        num_new = min(num_left, budget)
        return min(num_new, self.long_prefill_token_threshold) if self._is_long(num_new) else num_new

    def _admit(
        self, seq: Sequence, budget: int, out: SchedulerOutput, *, allow_long: bool = True
    ) -> tuple[bool | None, int]:
        """Allocate and schedule `seq`'s first chunk: (True, tokens it had left to compute); no
        blocks: False; a long prefill while `allow_long` is False: None (nothing changed)."""
        bm = self.block_manager
        payload = seq.pending_import
        if payload is not None and not payload.is_readable:
            # Its shared-memory range may be another request's by now: compute the prompt. (The
            # import is written in this same step, right after scheduling: a readable payload
            # is copied out before its range can be reused.)
            logger.warning("the KV import of %s expired before it was scheduled; computing its prompt", seq.request_id)
            seq.pending_import = payload = None
            self.num_expired_imports += 1
        if payload is not None:
            # Imported KV covers the first payload.num_tokens tokens; compute the rest.
            left = seq.num_tokens - payload.num_tokens
            if self._is_long(left) and not allow_long:
                return None, left
            num_new = self._chunk(left, budget)
            if not bm.allocate_import(seq, payload.num_tokens + num_new, payload.num_tokens):
                return False, left
            out.kv_imports.append(seq)
            seq.num_computed_tokens = payload.num_tokens
            out.scheduled.append((seq, num_new))
            return True, left
        fresh = seq.num_computed_tokens == 0
        cached = bm.lookup_prefix(seq) if fresh else []
        computed = len(cached) * bm.block_size if fresh else seq.num_computed_tokens
        left = seq.num_tokens - computed
        if self._is_long(left) and not allow_long:
            return None, left
        num_new = self._chunk(left, budget)
        if not bm.allocate(seq, computed + num_new, cached):
            return False, left
        if fresh and bm.enable_prefix_caching:
            bm.record_prefix_query(seq.num_tokens, computed)
        if seq.num_preemptions == 0 and seq.first_scheduled_mono_s is None:
            seq.num_cached_tokens = computed
        out.scheduled.append((seq, num_new))
        return True, left

    def _preempt(self, seq: Sequence) -> None:
        logger.debug("preempting %s", seq)
        self.block_manager.free(seq)
        seq.spec_token_ids.clear()  # recomputed from its known tokens; proposed again after
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)


def _is_fresh(seq: Sequence) -> bool:
    """Its request has not started: it may still be refused for waiting too long."""
    return seq.index == 0 and seq.first_scheduled_mono_s is None and seq.num_output_tokens == 0
