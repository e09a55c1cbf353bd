"""The load generator of `kvrelay bench serve`: sends a dataset's requests on a schedule.

    schedule      requests without their own arrival time get `arrival_times(rate, burstiness)`
                  in dataset order; requests with one (chat-burst's long prompts) keep it; all
                  are sent in time order
    concurrency   at most `max_concurrency` requests in flight (None: no cap); a request past
                  its arrival time waits for a slot, so `sent_s` may be later than `scheduled_s`
                  (TTFT counts from `sent_s`, the moment the client sent it)
    multi-turn    a session's turn is held until the previous turn's answer is in, without a slot

duration_s = from the start to the moment the last response ended, on the client's clock.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time

from load_tests.serve.client import RequestRecord, RequestSpec, ServeClient
from load_tests.serve.datasets import arrival_times

__all__ = ["Progress", "run_load", "schedule"]


class Progress:
    """One stderr line, rewritten at most every 0.2 s: done/total, failures, elapsed seconds."""

    def __init__(self, total: int, label: str, *, is_enabled: bool = True) -> None:
        self.total, self.label, self.is_enabled = total, label, is_enabled
        self.num_done = self.num_failed = 0
        self._started = self._shown = time.monotonic()

    def update(self, record: RequestRecord) -> None:
        self.num_done += 1
        self.num_failed += not record.is_success
        now = time.monotonic()
        if self.is_enabled and (now - self._shown >= 0.2 or self.num_done == self.total):
            self._shown = now
            width = 30
            filled = width * self.num_done // max(1, self.total)
            print(
                f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.num_done}/{self.total}"
                f" failed {self.num_failed}  {now - self._started:6.1f} s",
                end="\n" if self.num_done == self.total else "", file=sys.stderr, flush=True,
            )


def schedule(specs: list[RequestSpec], request_rate: float, burstiness: float, *, seed: int) -> list[tuple[float, RequestSpec]]:
    """(arrival time, spec) in time order; ties keep dataset order."""
    free = [s for s in specs if s.arrival_s is None]
    times = iter(arrival_times(len(free), request_rate, burstiness, seed=seed))
    timed = [(s.arrival_s if s.arrival_s is not None else next(times), s) for s in specs]
    return sorted(timed, key=lambda pair: pair[0])  # sorted() is stable


async def run_load(
    client: ServeClient,
    specs: list[RequestSpec],
    *,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    progress: Progress | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send every spec; returns the records (in request_id order) and duration_s."""
    clock = client.clock
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    previous_turn: dict[int, asyncio.Event] = {}

    async def one(spec: RequestSpec, at: float, after: asyncio.Event | None, done: asyncio.Event | None) -> RequestRecord:
        try:
            if after is not None:
                await after.wait()
            if slots is None:
                record = await client.send(spec, scheduled_s=at, t0=t0)
            else:
                async with slots:
                    record = await client.send(spec, scheduled_s=at, t0=t0)
        finally:
            if done is not None:
                done.set()  # a failed turn still releases the next one (sent without its answer)
        if progress is not None:
            progress.update(record)
        return record

    t0 = clock.now()
    tasks = []
    try:
        for at, spec in schedule(specs, request_rate, burstiness, seed=seed):
            wait_s = t0 + at - clock.now()
            if wait_s > 0:
                await clock.sleep(wait_s)
            after = done = None
            if spec.session_id is not None:
                after, done = previous_turn.get(spec.session_id), asyncio.Event()
                previous_turn[spec.session_id] = done
            tasks.append(asyncio.create_task(one(spec, at, after, done)))
        records = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    duration_s = clock.now() - t0
    return sorted(records, key=lambda r: r.request_id), duration_s
