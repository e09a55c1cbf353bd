"""CallerWatch: requests of a caller that died are aborted; a live caller's never are."""

from __future__ import annotations

import asyncio

import pytest

from serving.deployments.caller_watch import Caller, CallerWatch
from tests.helpers import await_until

LIVE, DEAD = Caller("SERVE_REPLICA::app#OpenAIIngress#live", "serve"), Caller("SERVE_REPLICA::app#OpenAIIngress#dead", "serve")


@pytest.mark.asyncio
async def test_only_the_requests_of_a_dead_caller_are_aborted_and_each_once():
    aborted: list[str] = []
    checked: list[Caller] = []

    async def abort(request_id: str) -> None:
        aborted.append(request_id)

    def is_alive(caller: Caller) -> bool:
        checked.append(caller)
        return caller == LIVE

    watch = CallerWatch(abort, period_s=0.01, is_alive=is_alive)
    with watch.watch(LIVE, "a"), watch.watch(DEAD, "b"), watch.watch(DEAD, "c"), watch.watch(None, "d"):
        await await_until(lambda: len(aborted) == 2 and checked.count(LIVE) >= 3, 5, "the dead caller's requests aborted")
    assert sorted(aborted) == ["b", "c"] and watch.num_aborted == 2
    assert checked.count(DEAD) == 1  # forgotten once its requests are aborted
    await await_until(lambda: watch._task.done(), 5, "the watch loop to end")  # nothing left to watch
    assert watch._requests == {}


@pytest.mark.asyncio
async def test_a_failed_liveness_check_assumes_the_caller_alive():
    aborted: list[str] = []

    async def abort(request_id: str) -> None:
        aborted.append(request_id)

    def is_alive(caller: Caller) -> bool:
        raise ConnectionError("the GCS is away")

    watch = CallerWatch(abort, period_s=0.01, is_alive=is_alive)
    with watch.watch(DEAD, "a"):
        await asyncio.sleep(0.1)
    assert aborted == []
