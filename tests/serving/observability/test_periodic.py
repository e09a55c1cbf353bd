"""PeriodicTask: ticks on the period, survives a failing tick, and ends when stopped."""

import asyncio

import pytest

from serving.observability.periodic import PeriodicTask


async def _until(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.001)


@pytest.mark.asyncio
@pytest.mark.parametrize("wait_first", [False, True])
async def test_ticks_go_on_after_a_failing_tick_and_stop_cancels(wait_first, caplog):
    ticks = []

    async def tick():
        ticks.append(len(ticks))
        if len(ticks) == 1:
            raise RuntimeError("controller away")

    task = PeriodicTask(tick, 0.001, what="reading the pools", wait_first=wait_first)
    task.start()
    task.start()  # a second start does nothing
    await _until(lambda: len(ticks) >= 3)
    assert task.is_running
    task.stop()
    await asyncio.sleep(0.01)
    count = len(ticks)
    await asyncio.sleep(0.01)
    assert len(ticks) == count
    assert not task.is_running
    assert "reading the pools failed (controller away); trying again in 0.001 s" in caplog.text


def test_start_without_a_running_loop_raises():
    with pytest.raises(RuntimeError):
        PeriodicTask(lambda: asyncio.sleep(0), 1.0, what="x").start()
