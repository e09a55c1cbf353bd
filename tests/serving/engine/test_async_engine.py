"""AsyncEngine: concurrent streams, validation errors, cancellation frees blocks, a dead loop fails fast."""

from __future__ import annotations

import asyncio
import threading

import pytest

from serving.engine import EngineConfig, EngineDeadError, InvalidRequestError, LLMEngine, SamplingParams
from serving.engine.async_engine import AsyncEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture()
def async_engine(tiny_model_dir):
    engine = AsyncEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_bytes=4 * 2**20))
    yield engine
    engine.shutdown()


async def collect(engine: AsyncEngine, request_id: str, prompt: list[int], params=GREEDY) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(request_id, params=params, prompt_token_ids=prompt):
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


def test_validation_error_raises_before_any_output(async_engine):
    async def main():
        async for _ in async_engine.generate("bad", params=SamplingParams(top_p=2.0), prompt_token_ids=[1, 2]):
            pass

    with pytest.raises(InvalidRequestError) as info:
        asyncio.run(main())
    assert info.value.param == "top_p"


def test_leaving_the_stream_aborts_and_frees_blocks(async_engine):
    long = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)

    async def main():
        got = 0
        async for out in async_engine.generate("gone", params=long, prompt_token_ids=list(range(50, 90))):
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
    assert got == 3
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks


def test_export_through_the_async_api(async_engine):
    async def main():
        params = SamplingParams(temperature=0.0, max_tokens=1)
        async for out in async_engine.generate("p", params=params, prompt_token_ids=list(range(10, 50)), hold_kv=True):
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
        async for _ in async_engine.generate("p", params=params, prompt_token_ids=list(range(10, 50)), hold_kv=True):
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
            async for _ in engine.generate("held", params=hold, prompt_token_ids=list(range(10, 170)), hold_kv=True):
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
