"""AsyncEngine: concurrent streams, validation errors, cancellation frees blocks, a dead loop fails fast."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import random
import threading
import time

import pytest

from serving.engine import EngineConfig, EngineDeadError, InvalidRequestError, LLMEngine, RequestFailedError, SamplingParams
from serving.engine.async_engine import AsyncEngine
from serving.engine.contract import EngineRequest
from serving.engine.sampling.sampler import Sampler
from tests.helpers import tiny_engine_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture()
def async_engine(tiny_model_dir):
    engine = AsyncEngine(tiny_engine_config(tiny_model_dir))
    yield engine
    engine.shutdown()


async def collect(engine: AsyncEngine, request_id: str, prompt: list[int], params=GREEDY) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(EngineRequest(request_id, params=params, prompt_token_ids=prompt)):
        tokens += out.outputs[0].token_ids
    return tokens


def test_concurrent_streams_match_the_sync_engine(async_engine, tiny_model_dir):
    prompts = [[5, 6, 7, 8], list(range(100, 160)), [9] * 20]
    expected = [
        o.outputs[0].token_ids
        for o in LLMEngine(async_engine.engine.config).generate(prompts, GREEDY)
    ]

    async def main():
        return await asyncio.gather(*(collect(async_engine, f"r{i}", p) for i, p in enumerate(prompts)))

    assert asyncio.run(main()) == expected
    stats = async_engine.stats()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks


def test_a_refused_request_raises_before_any_output(async_engine):
    async def main():
        async for _ in async_engine.generate(EngineRequest("bad", params=SamplingParams(), prompt_token_ids=[1, 10**9])):
            pass

    with pytest.raises(InvalidRequestError) as info:
        asyncio.run(main())
    assert info.value.param == "prompt_token_ids"


def test_leaving_the_stream_aborts_and_frees_blocks(async_engine):
    long = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)

    async def main():
        got = 0
        async for out in async_engine.generate(EngineRequest("gone", params=long, prompt_token_ids=list(range(50, 90)))):
            got += len(out.outputs[0].token_ids)
            if got >= 3:
                break
        # the abort is processed by the step thread; wait for it without polling the engine
        for _ in range(200):
            await asyncio.sleep(0.01)
            s = async_engine.stats()
            if s.num_running == 0 and s.num_free_blocks == s.num_blocks:
                return got, s
        return got, async_engine.stats()

    got, stats = asyncio.run(main())
    # a slow reader gets several tokens in one output (the stream coalesces), so 3 or a few more
    assert 3 <= got <= stats.num_generated_tokens
    # the engine stopped the request: it did not generate the 500 tokens asked for
    assert stats.num_generated_tokens < 500
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks


def test_export_through_the_async_api(async_engine):
    async def main():
        params = SamplingParams(temperature=0.0, max_tokens=1)
        async for _ in async_engine.generate(EngineRequest("p", params=params, prompt_token_ids=list(range(10, 50)), hold_kv=True)):
            pass
        return await async_engine.export_kv("p")

    payload = asyncio.run(main())
    assert payload.num_tokens == 40 and payload.num_blocks == 3


def test_export_is_handed_over_while_the_step_thread_is_busy(async_engine):
    """On a prefill worker the step thread is often in a long prompt's chunk when a short prompt's
    export is asked for: the payload, read out when that prompt finished, comes at once; the
    blocks are released when the thread is free again."""
    gate = threading.Event()

    async def main():
        params = SamplingParams(temperature=0.0, max_tokens=1)
        async for _ in async_engine.generate(EngineRequest("p", params=params, prompt_token_ids=list(range(10, 50)), hold_kv=True)):
            pass
        busy = asyncio.ensure_future(async_engine._call(lambda engine: gate.wait(30)))  # the "long step"
        await asyncio.sleep(0.05)
        payload = await asyncio.wait_for(async_engine.export_kv("p"), timeout=5)
        held_while_busy = async_engine.engine.stats().num_held_exports
        gate.set()
        await busy
        stats = await async_engine._call(lambda engine: engine.stats())  # after the queued release
        return payload, held_while_busy, stats

    payload, held_while_busy, stats = asyncio.run(main())
    assert payload.num_tokens == 40 and payload.num_blocks == 3
    assert held_while_busy == 1
    assert stats.num_held_exports == 0 and stats.num_free_blocks == stats.num_blocks


def test_dead_step_loop_fails_streams_and_new_requests(async_engine):
    def boom(*args, **kwargs):
        raise RuntimeError("simulated kernel failure")

    async_engine.engine.runner.execute = boom

    async def main():
        return await collect(async_engine, "x", [1, 2, 3])

    with pytest.raises(EngineDeadError, match="simulated kernel failure"):
        asyncio.run(main())
    assert not async_engine.is_alive
    with pytest.raises(EngineDeadError):
        asyncio.run(main())


def test_held_exports_stall_without_spinning_and_release_resumes(tiny_model_dir):
    """A request waiting for blocks pinned by an unclaimed export waits on the inbox (no busy
    loop), and runs as soon as the export is released."""
    # 12 blocks of 16 tokens; the held export pins 10 of them, the next request needs 4.
    engine = AsyncEngine(
        EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_bytes=12 * 16 * 512)
    )
    try:
        async def main():
            hold = SamplingParams(temperature=0.0, max_tokens=1)
            async for _ in engine.generate(EngineRequest("held", params=hold, prompt_token_ids=list(range(10, 170)), hold_kv=True)):
                pass
            steps = []
            real_step = engine.engine.step
            engine.engine.step = lambda: steps.append(1) or real_step()
            waiter = asyncio.ensure_future(collect(engine, "next", list(range(200, 250))))
            await asyncio.sleep(0.3)
            stalled = engine.engine.is_stalled and not waiter.done()
            steps_while_stalled = len(steps)
            await engine.release_kv("held")
            return stalled, steps_while_stalled, await asyncio.wait_for(waiter, 30)

        stalled, steps_while_stalled, tokens = asyncio.run(main())
        assert stalled
        assert steps_while_stalled == 1  # one step found nothing to run; then it waited
        assert len(tokens) == 12
    finally:
        engine.shutdown()


def test_a_request_stalled_behind_held_exports_still_times_out_in_the_queue(tiny_model_dir):
    """The step thread waits on its inbox while held exports pin the blocks, but no longer than
    the next waiting request's max_queue_wait_s: that request ends with queue_timeout (no
    command needed to wake the loop), and the export is still there to be released."""
    engine = AsyncEngine(EngineConfig(
        model=str(tiny_model_dir), dtype="float32", kv_cache_bytes=12 * 16 * 512, max_queue_wait_s=0.05,
    ))
    try:
        async def main():
            hold = SamplingParams(temperature=0.0, max_tokens=1)
            async for _ in engine.generate(EngineRequest("held", params=hold, prompt_token_ids=list(range(10, 170)), hold_kv=True)):
                pass
            outputs = [out async for out in engine.generate(EngineRequest("next", params=GREEDY, prompt_token_ids=list(range(200, 250))))]
            released = await engine.release_kv("held")
            return outputs, released

        outputs, released = asyncio.run(asyncio.wait_for(main(), 60))  # a hang guard, not a measurement
        assert [(c.token_ids, c.finish_reason) for out in outputs for c in out.outputs] == [([], "queue_timeout")]
        assert released
        stats = engine.stats()
        assert stats.num_queue_timeouts == 1 and stats.num_free_blocks == stats.num_blocks
    finally:
        engine.shutdown()


# ---- callers that go away, requests that fail alone, a loop that dies ------------------------
PROMPT = list(range(20, 60))


def test_commands_cancelled_at_random_moments_never_stop_the_engine(async_engine):
    """Every kind of engine command (generate, abort, release_kv, export, a KV import) is cancelled
    at random moments while the step thread runs, thousands of times: the engine keeps serving,
    greedy output is unchanged, and every block comes back."""
    rng = random.Random(14)
    short = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    hold = SamplingParams(temperature=0.0, max_tokens=1)
    expected = LLMEngine(async_engine.engine.config).generate([PROMPT], GREEDY)[0].outputs[0].token_ids

    async def held(request_id: str) -> None:
        async for _ in async_engine.generate(EngineRequest(request_id, params=hold, prompt_token_ids=PROMPT, hold_kv=True)):
            pass

    async def do_generate(i):
        async for _ in async_engine.generate(EngineRequest(f"g{i}", params=short, prompt_token_ids=PROMPT[: 8 + i % 30])):
            pass

    async def do_abort(i):
        await async_engine.abort(f"g{i - 1}")

    async def do_release(i):  # as a prefill worker does: the release is queued whatever happens
        try:
            await held(f"r{i}")
            await async_engine.release_kv(f"r{i}")
        finally:
            async_engine.release_kv_soon(f"r{i}")

    async def do_export(i):
        try:
            await held(f"e{i}")
            await async_engine.export_kv(f"e{i}")
        finally:
            async_engine.release_kv_soon(f"e{i}")

    async def do_import(i, payload):
        async for _ in async_engine.generate(EngineRequest(f"i{i}", params=short, prompt_token_ids=PROMPT + [7], kv_payload=payload)):
            pass

    async def main():
        await held("source")
        payload = await async_engine.export_kv("source")
        kinds = [do_generate, do_abort, do_release, do_export, lambda i: do_import(i, payload)]
        num_cancelled = 0
        for round_ in range(800):
            tasks = [asyncio.ensure_future(kinds[k](round_ * 10 + k)) for k in range(len(kinds))]
            await asyncio.sleep(rng.random() * 0.003)
            for task in tasks:
                if rng.random() < 0.9 and task.cancel():
                    num_cancelled += 1
            await asyncio.gather(*tasks, return_exceptions=True)
        # Every abort and release queued so far runs before this call's own command.
        stats = await async_engine._call(lambda engine: engine.stats())
        tokens = await collect(async_engine, "after", PROMPT)
        return num_cancelled, stats, tokens

    num_cancelled, stats, tokens = asyncio.run(main())
    assert num_cancelled >= 1500
    assert async_engine.is_alive
    assert (stats.num_running, stats.num_waiting, stats.num_held_exports) == (0, 0, 0)
    assert stats.num_free_blocks == stats.num_blocks
    assert tokens == expected


def test_a_cancelled_generate_does_not_leave_its_request_running(async_engine):
    """The add is queued when the caller is cancelled: the request must be aborted, not run to
    max_tokens for nobody."""
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    gate = threading.Event()

    async def main():
        busy = asyncio.ensure_future(async_engine._call(lambda engine: gate.wait(30)))
        await asyncio.sleep(0.05)
        orphan = asyncio.ensure_future(collect(async_engine, "orphan", PROMPT, long))
        await asyncio.sleep(0.05)
        orphan.cancel()  # while its add waits behind the busy call
        gate.set()
        await busy
        await asyncio.gather(orphan, return_exceptions=True)
        return await async_engine._call(lambda engine: engine.stats())

    stats = asyncio.run(main())
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_free_blocks == stats.num_blocks
    assert stats.num_generated_tokens < 400


class _FailingSampler(Sampler):
    """The engine's sampler, failing on every batch with a row that `is_bad`."""

    def __init__(self, real: Sampler, is_bad):
        self.__dict__.update(real.__dict__)
        self.is_bad = is_bad

    def __call__(self, logits, rows):
        if any(self.is_bad(row) for row in rows):
            raise RuntimeError("simulated sampling failure")
        return super().__call__(logits, rows)


def _failing_rows(engine: LLMEngine, bad_seed: int) -> None:
    """Make the sampler fail on every row whose request has seed `bad_seed`."""
    engine.output_processor.sampler = _FailingSampler(engine.output_processor.sampler, lambda row: row.params.seed == bad_seed)


def test_a_request_that_fails_in_the_step_fails_alone(async_engine):
    _failing_rows(async_engine.engine, bad_seed=666)
    bad = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, seed=666)
    prompts = [[5, 6, 7, 8], list(range(100, 160))]
    expected = [o.outputs[0].token_ids for o in LLMEngine(async_engine.engine.config).generate(prompts, GREEDY)]

    async def main():
        good = [collect(async_engine, f"ok{i}", p) for i, p in enumerate(prompts)]
        return await asyncio.gather(*good, collect(async_engine, "bad", [9] * 20, bad), return_exceptions=True)

    *good, failure = asyncio.run(main())
    assert good == expected
    assert isinstance(failure, RequestFailedError)
    assert str(failure) == (
        "request bad failed in the engine's sampling: RuntimeError: simulated sampling failure; "
        "no other request was affected"
    )
    stats = async_engine.stats()
    assert async_engine.is_alive
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks


def test_a_request_whose_kv_import_fails_fails_alone(async_engine):
    engine = async_engine.engine
    real_write = engine.kv.write_import

    def write_import(seq):
        if seq.request_id == "bad-import":
            raise ValueError("simulated payload mismatch")
        real_write(seq)

    engine.kv.write_import = write_import

    async def main():
        hold = SamplingParams(temperature=0.0, max_tokens=1)
        async for _ in async_engine.generate(EngineRequest("src", params=hold, prompt_token_ids=PROMPT, hold_kv=True)):
            pass
        payload = await async_engine.export_kv("src")
        bad = collect_import(async_engine, "bad-import", payload)
        good = collect_import(async_engine, "good-import", payload)
        return await asyncio.gather(bad, good, return_exceptions=True)

    failure, tokens = asyncio.run(main())
    assert isinstance(failure, RequestFailedError) and failure.stage == "KV import"
    assert tokens == LLMEngine(engine.config).generate([PROMPT + [7]], GREEDY)[0].outputs[0].token_ids
    stats = async_engine.stats()
    assert async_engine.is_alive and stats.num_free_blocks == stats.num_blocks


async def collect_import(engine: AsyncEngine, request_id: str, payload) -> list[int]:
    tokens: list[int] = []
    """Import a payload and continue its prompt by one token (an import must leave one to compute)."""
    async for out in engine.generate(EngineRequest(request_id, params=GREEDY, prompt_token_ids=payload.token_ids + [7], kv_payload=payload)):
        tokens += out.outputs[0].token_ids
    return tokens


class _TwoAtOnce:
    """The inbox, handing the idle step loop its first command only once a second is queued, so
    two requests' adds are handled before the first step (one row failing alone is its own
    request's fault: Sampler.sample_each)."""

    def __init__(self, real):
        self.real = real
        self.held = True

    def get(self, timeout=None):
        while self.held and self.real.qsize() < 2:
            time.sleep(0.005)
        self.held = False
        return self.real.get(timeout=timeout)

    def get_nowait(self):
        if self.held:  # not even between the commands of one wake-up
            raise queue.Empty
        return self.real.get_nowait()

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_a_failure_of_every_row_has_no_culprit_and_stops_the_engine(async_engine):
    async_engine.engine.output_processor.sampler = _FailingSampler(async_engine.engine.output_processor.sampler, lambda row: True)  # NaN logits, say
    real = async_engine._inbox
    async_engine._inbox = _TwoAtOnce(real)
    real.put(("wake",))  # the idle loop leaves its wait on the real inbox and comes back to this one
    while real.qsize():
        time.sleep(0.005)

    async def main():
        return await asyncio.gather(collect(async_engine, "a", [1, 2, 3]), collect(async_engine, "b", [4, 5, 6]), return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert not async_engine.is_alive


def _kernel_failure(*args, **kwargs):
    raise RuntimeError("simulated kernel failure")


class _RacingInbox:
    """The inbox, with the loop made to die and drain it between a caller's check of the engine's
    state and its put: the window of the race."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.real = engine._inbox
        self.raced = False

    def put(self, command):
        if not self.raced and command is not None and command[0] == "call":
            self.raced = True
            self.engine.engine.runner.execute = _kernel_failure
            self.real.put(("call", lambda engine: engine.add_request("victim", prompt_token_ids=[1, 2, 3], params=GREEDY), concurrent.futures.Future()))
            self.engine._thread.join(10)
            assert self.engine._error is not None
        self.real.put(command)

    def get(self):
        return self.real.get()

    def get_nowait(self):
        return self.real.get_nowait()


def test_a_call_queued_as_the_loop_dies_is_answered(async_engine):
    async_engine._inbox = _RacingInbox(async_engine)

    async def main():
        return await asyncio.wait_for(async_engine._call(lambda engine: engine.stats()), timeout=10)

    with pytest.raises(EngineDeadError, match="simulated kernel failure"):
        asyncio.run(main())


def test_stats_are_current_after_a_release_on_an_idle_engine(async_engine):
    """A release with nothing else to run frees blocks without a step: the snapshot says so."""
    async def main():
        hold = SamplingParams(temperature=0.0, max_tokens=1)
        async for _ in async_engine.generate(EngineRequest("held", params=hold, prompt_token_ids=PROMPT, hold_kv=True)):
            pass
        held = async_engine.stats()
        await async_engine.release_kv("held")
        return held, async_engine.stats()

    held, released = asyncio.run(main())
    assert held.num_held_exports == 1 and held.num_free_blocks == held.num_blocks - 3
    assert released.num_held_exports == 0 and released.num_free_blocks == released.num_blocks


def test_a_reader_slower_than_the_steps_gets_the_queued_outputs_merged(async_engine):
    """A caller that sleeps through several steps gets one output with every token since its
    last read (not a backlog of one-token items), and the tokens are exactly the engine's."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt = [5, 6, 7, 8]
    expected = LLMEngine(async_engine.engine.config).generate([prompt], params)[0].outputs[0].token_ids

    async def main():
        sizes, tokens = [], []
        async for out in async_engine.generate(EngineRequest("slow", params=params, prompt_token_ids=prompt)):
            sizes.append(len(out.outputs[0].token_ids))
            tokens += out.outputs[0].token_ids
            if len(sizes) == 1:
                # Hold the reader until every later step's output waits in its queue (the
                # first item may itself hold more than one token on a loaded machine).
                queue = async_engine._streams["slow"][1]
                for _ in range(3000):
                    if queue.qsize() == 24 - sizes[0]:
                        break
                    await asyncio.sleep(0.01)
        return sizes, tokens

    sizes, tokens = asyncio.run(main())
    assert tokens == expected
    assert len(sizes) == 2 and sum(sizes) == 24  # everything after the first read came as one


def test_coalescing_stops_at_an_error_and_raises_it_after_the_merged_output():
    from serving.engine.async_engine import _coalesce
    from serving.engine.outputs import CompletionOutput, RequestOutput

    def out(token: int, finished: bool = False) -> RequestOutput:
        return RequestOutput("r", [CompletionOutput(0, f"t{token}", [token])], finished, 4, 0)

    async def main():
        stream: asyncio.Queue = asyncio.Queue()
        for item in (out(2), out(3), RuntimeError("engine died"), out(9)):
            stream.put_nowait(item)
        merged, error = _coalesce(out(1), stream)
        return merged, error, stream.qsize()

    merged, error, left = asyncio.run(main())
    assert merged.outputs[0].token_ids == [1, 2, 3] and merged.outputs[0].text == "t1t2t3"
    assert isinstance(error, RuntimeError) and left == 1

    async def finished_first():
        stream: asyncio.Queue = asyncio.Queue()
        stream.put_nowait(out(5))
        merged, error = _coalesce(out(4, finished=True), stream)
        return merged, error, stream.qsize()

    merged, error, left = asyncio.run(finished_first())
    assert merged.outputs[0].token_ids == [4] and merged.finished and error is None and left == 1


def test_decode_steps_back_to_back_are_counted_with_their_periods(async_engine):
    """One request of 12 tokens: a prefill step (the first token), then 11 decode steps. Each
    decode step's period ends when the next step starts, so the last one, after which the loop
    waits for work, is not counted: 10 steps of one sequence. The periods lie within the run that
    made them: the wait between two runs is no step's period."""
    started = time.perf_counter()
    assert len(asyncio.run(collect(async_engine, "one", [5, 6, 7, 8]))) == 12
    first_wall = time.perf_counter() - started
    first = async_engine.stats()
    assert (first.decode_steps, first.decode_step_rows) == (10, 10)
    assert 0 < first.decode_step_s <= first_wall
    time.sleep(0.5)
    started = time.perf_counter()
    assert len(asyncio.run(collect(async_engine, "two", [9] * 20))) == 12
    second_wall = time.perf_counter() - started
    second = async_engine.stats()
    assert (second.decode_steps, second.decode_step_rows) == (20, 20)
    assert 0 < second.decode_step_s - first.decode_step_s <= second_wall
