"""Scheduler decisions on hand-built sequences (no model): budgets, chunking, preemption order."""

from __future__ import annotations

from serving.engine.kv.block_manager import BlockManager
from serving.engine.params import SamplingParams
from serving.engine.request import RequestStatus, Sequence
from serving.engine.scheduler import Scheduler


def seq(name: str, num_tokens: int, *, arrival: float, priority: int = 0) -> Sequence:
    return Sequence(name, 0, list(range(1, num_tokens + 1)), SamplingParams(), max_tokens=100,
                    arrival_mono_s=arrival, priority=priority)


def run_step(sched: Scheduler) -> dict[str, int]:
    """Schedule one step and pretend the model ran it (every finished prompt samples a token)."""
    out = sched.schedule()
    for s, n in out.scheduled:
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.append_token(7)
    return {s.request_id: n for s, n in out.scheduled}


def test_token_budget_chunks_prefill_and_mixes_decodes():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    sched.add(seq("a", 6, arrival=0))
    sched.add(seq("b", 9, arrival=1))
    assert run_step(sched) == {"a": 6, "b": 4}  # b gets the rest of the budget as a chunk
    assert run_step(sched) == {"a": 1, "b": 5}  # a decodes, b finishes its prompt
    assert run_step(sched) == {"a": 1, "b": 1}


def test_max_num_seqs_limits_admission():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        sched.add(seq(f"r{i}", 3, arrival=i))
    assert run_step(sched) == {"r0": 3, "r1": 3}
    assert [s.request_id for s in sched.waiting] == ["r2"]


def test_preemption_takes_the_newest_and_requeues_it_first_in_line():
    bm = BlockManager(4, 4)  # 16 token slots
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    old, new = seq("old", 7, arrival=0), seq("new", 7, arrival=1)
    sched.add(old)
    sched.add(new)
    assert run_step(sched) == {"old": 7, "new": 7}  # 2 + 2 blocks: the cache is full
    assert run_step(sched) == {"old": 1, "new": 1}  # the 8th tokens still fit
    # old needs a third block for its 9th token: the newest running sequence gives its blocks up
    out = sched.schedule()
    assert [s.request_id for s in out.preempted] == ["new"]
    assert [(s.request_id, n) for s, n in out.scheduled] == [("old", 1)]
    assert new.status == RequestStatus.PREEMPTED and new.block_ids == [] and new.num_computed_tokens == 0
    assert new.output_token_ids == [7, 7]  # generated tokens survive and are recomputed
    assert sched.waiting == [new]
    assert bm.num_free_blocks == 1


def test_priority_orders_the_waiting_queue_then_arrival():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=1, max_num_batched_tokens=100)
    sched.add(seq("late-urgent", 2, arrival=5, priority=-1))
    sched.add(seq("early", 2, arrival=1))
    sched.add(seq("earliest", 2, arrival=0))
    assert [s.request_id for s in sched.waiting] == ["late-urgent", "earliest", "early"]


def test_no_admission_when_blocks_run_out_and_nothing_is_lost():
    sched = Scheduler(BlockManager(2, 4), max_num_seqs=8, max_num_batched_tokens=100)
    sched.add(seq("a", 8, arrival=0))
    sched.add(seq("b", 4, arrival=1))
    assert run_step(sched) == {"a": 8}
    assert [s.request_id for s in sched.waiting] == ["b"]


def test_long_prefill_is_capped_and_short_prompts_pass_a_second_long_one():
    """threshold 4, budget 10: a long prompt gets 4 tokens a step; a second long one waits for
    the first to finish its prompt while a short one that arrived after it is admitted at once."""
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10,
                      long_prefill_token_threshold=4, max_long_partial_prefills=1)
    sched.add(seq("long1", 12, arrival=0))
    sched.add(seq("long2", 12, arrival=1))
    sched.add(seq("short", 3, arrival=2))
    assert run_step(sched) == {"long1": 4, "short": 3}  # long2 passed over; short fits whole
    assert [s.request_id for s in sched.waiting] == ["long2"]
    assert run_step(sched) == {"long1": 4, "short": 1}
    # long1 has 4 left, no longer long: its last chunk and long2's first share the step
    assert run_step(sched) == {"long1": 4, "short": 1, "long2": 4}
    assert run_step(sched) == {"long1": 1, "short": 1, "long2": 4}
    assert run_step(sched) == {"long1": 1, "short": 1, "long2": 4}
    assert run_step(sched) == {"long1": 1, "short": 1, "long2": 1}


def test_a_prompt_at_the_threshold_is_not_long_and_two_long_slots_admit_two():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=20,
                      long_prefill_token_threshold=5, max_long_partial_prefills=2)
    sched.add(seq("a", 5, arrival=0))  # exactly the threshold: whole
    sched.add(seq("b", 11, arrival=1))
    sched.add(seq("c", 11, arrival=2))
    sched.add(seq("d", 11, arrival=3))  # a third long one waits
    assert run_step(sched) == {"a": 5, "b": 5, "c": 5}
    assert [s.request_id for s in sched.waiting] == ["d"]


def test_threshold_off_keeps_fcfs_chunking():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    sched.add(seq("long1", 12, arrival=0))
    sched.add(seq("short", 3, arrival=1))
    assert run_step(sched) == {"long1": 10}
    assert run_step(sched) == {"long1": 2, "short": 3}


# ---- max_queue_wait_s --------------------------------------------------------------------------
class Clock:
    """The scheduler's clock, moved by hand."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_fresh_request_waiting_past_max_queue_wait_s_is_timed_out_after_admissions():
    clock = Clock()
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=1, max_num_batched_tokens=100, max_queue_wait_s=5.0, clock=clock)
    for name, arrival in (("a", 0.0), ("b", 1.0), ("c", 4.0)):
        sched.add(seq(name, 3, arrival=arrival))
    assert sched.seconds_to_queue_timeout() == 5.0
    clock.now = 5.5  # a waited 5.5 s, but it is admitted in this step: it runs
    out = sched.schedule()
    assert [s.request_id for s, _ in out.scheduled] == ["a"] and out.timed_out == []
    assert sched.seconds_to_queue_timeout() == 0.5  # b's 5 s end at 6.0
    clock.now = 6.0  # b waited exactly 5 s: not more
    assert sched.schedule().timed_out == []
    clock.now = 6.5
    out = sched.schedule()
    assert [s.request_id for s in out.timed_out] == ["b"]
    assert [s.request_id for s in sched.waiting] == ["c"] and sched.num_queue_timeouts == 1
    assert sched.seconds_to_queue_timeout() == 2.5  # c's end at 9.0
    assert [s.request_id for s, _ in out.scheduled] == ["a"]  # the running one is untouched


def test_a_request_that_has_started_waits_as_long_as_it_takes():
    """Preempted sequences and ones continued from tokens generated elsewhere (a decode worker's
    KV import) are not refused for waiting: they have started."""
    clock = Clock()
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100, max_queue_wait_s=1.0, clock=clock)
    old, new = seq("old", 7, arrival=0), seq("new", 7, arrival=0.5)
    sched.add(old)
    sched.add(new)
    run_step(sched)
    run_step(sched)
    continued = seq("continued", 3, arrival=0.5)
    continued.append_token(9)  # its first token came from a prefill worker
    sched.add(continued)
    clock.now = 100.0
    out = sched.schedule()
    assert [s.request_id for s in out.preempted] == ["new"]  # as in the preemption test above
    assert out.timed_out == [] and sched.num_queue_timeouts == 0
    assert [s.request_id for s in sched.waiting] == ["new", "continued"]
    assert sched.seconds_to_queue_timeout() is None


def test_without_max_queue_wait_s_requests_wait_forever():
    clock = Clock()
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=1, max_num_batched_tokens=100, clock=clock)
    sched.add(seq("a", 3, arrival=0))
    sched.add(seq("b", 3, arrival=0))
    clock.now = 1e9
    assert sched.schedule().timed_out == [] and sched.seconds_to_queue_timeout() is None


# ---- priority_aging_s --------------------------------------------------------------------------
def test_aging_lets_a_long_waiting_request_pass_more_important_newcomers():
    clock = Clock()
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=1, max_num_batched_tokens=100, priority_aging_s=10.0, clock=clock)
    sched.add(seq("running", 2, arrival=0))
    assert run_step(sched) == {"running": 2}  # holds the only slot
    sched.add(seq("batch", 2, arrival=0, priority=2))
    sched.add(seq("urgent", 2, arrival=25, priority=0))
    clock.now = 25.0  # batch waited 25 s: 2 levels (2 - 2 = 0), equal to urgent's, and it came first
    assert [s.request_id for s in sorted(sched.waiting, key=lambda s: sched.aged_key(s, clock.now))] == ["batch", "urgent"]
    sched.remove(sched.running[0])
    assert run_step(sched) == {"batch": 2}
    assert [s.request_id for s in sched.waiting] == ["urgent"]


def test_aging_counts_whole_periods_only():
    clock = Clock()
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=1, max_num_batched_tokens=100, priority_aging_s=10.0, clock=clock)
    batch, urgent = seq("batch", 2, arrival=0, priority=2), seq("urgent", 2, arrival=15, priority=0)
    sched.add(batch)
    sched.add(urgent)
    clock.now = 19.9  # batch has aged one level (2 - 1 = 1): urgent (0) still goes first
    assert sched.aged_key(batch, clock.now) == (1, 0, batch.seq_id)
    assert run_step(sched) == {"urgent": 2}


def test_without_aging_priority_is_strict_however_long_a_request_waits():
    clock = Clock()
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=1, max_num_batched_tokens=100, clock=clock)
    sched.add(seq("batch", 2, arrival=0, priority=2))
    sched.add(seq("urgent", 2, arrival=1000, priority=0))
    clock.now = 1000.0
    assert run_step(sched) == {"urgent": 2}
