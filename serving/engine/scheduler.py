"""Continuous batching with chunked prefill, a token budget per step, and preemption by recompute.

There are no prefill or decode phases. Every step the scheduler walks the running sequences
(highest priority first), giving each `min(pending tokens, budget left)` tokens — one for a
decoding sequence, a chunk for one still prefilling — then admits waiting sequences while budget,
`max_num_seqs` and free blocks last. Prefill chunks and decodes share one forward pass.

When a running sequence cannot get a block, the lowest-priority, newest running sequence is
preempted: its blocks are freed (hashed ones stay in the prefix cache, so recompute is cheap)
and it goes back to the waiting queue with its generated tokens. No admissions happen in a step
that preempted, so a freed sequence is not immediately refilled by a newcomer.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field

from serving.engine.block_manager import BlockManager
from serving.engine.request import RequestStatus, Sequence

__all__ = ["Scheduler", "SchedulerOutput"]

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, new tokens)
    preempted: list[Sequence] = field(default_factory=list)
    kv_imports: list[Sequence] = field(default_factory=list)  # write seq.pending_import first

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []  # sorted by sort_key
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

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
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            assert num_new > 0, f"{seq} is running with nothing to compute"
            while not bm.allocate(seq, seq.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, num_new))
                budget -= num_new
                i += 1

        if out.preempted:
            return out

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq, budget, out):
                break
            self.waiting.pop(0)
            bisect.insort(self.running, seq, key=lambda s: s.sort_key)
            seq.status = RequestStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            budget -= out.scheduled[-1][1]
        return out

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> bool:
        bm = self.block_manager
        payload = seq.pending_import
        if payload is not None:
            # Imported KV covers the first payload.num_tokens tokens; compute the rest.
            num_new = min(seq.num_tokens - payload.num_tokens, budget)
            if not bm.allocate(seq, payload.num_tokens + num_new):
                return False
            out.kv_imports.append(seq)
            seq.num_computed_tokens = payload.num_tokens
            out.scheduled.append((seq, num_new))
            return True
        fresh = seq.num_computed_tokens == 0
        cached = bm.lookup_prefix(seq) if fresh else []
        computed = len(cached) * bm.block_size if fresh else seq.num_computed_tokens
        num_new = min(seq.num_tokens - computed, budget)
        if not bm.allocate(seq, computed + num_new, cached):
            return False
        if fresh and bm.enable_prefix_caching:
            bm.record_prefix_query(seq.num_tokens, computed)
        if seq.num_preemptions == 0 and seq.first_scheduled_time is None:
            seq.num_cached_tokens = computed
        out.scheduled.append((seq, num_new))
        return True

    def _preempt(self, seq: Sequence) -> None:
        logger.debug("preempting %s", seq)
        self.block_manager.free(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)
