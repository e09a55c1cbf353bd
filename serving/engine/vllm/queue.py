"""vLLM's waiting queue as one replica sees it: the prefill it owes, and max_queue_wait_s.

vLLM says what it found cached, and when it scheduled a request, only with the request's first
output, and keeps no queue deadline. So, from a request's hand-over to its first output:

    add(request)        its prompt tokens, less what the worker expects cached, count as queued
                        prefill (EngineStats.num_queued_prefill_tokens); its (priority, arrival)
                        is its place in vLLM's queue order
    until_started(...)  past its deadline with no output, a request still in vLLM's waiting queue
                        (its place among those without output, against vLLM's num_waiting) is
                        aborted there: None, and the caller ends it with queue_timeout
    first_output(...)   no longer queued; vLLM's timestamps give the TTFT's queue and prefill
                        parts and the prefill rate, as kvrelay's engine measures them
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

from serving.engine.outputs import RequestMetrics
from serving.engine.prefill_rate import PrefillRate
from serving.engine.vllm.stats import VLLMStats

__all__ = ["QueueWatch"]

logger = logging.getLogger(__name__)

# A prefill computing fewer tokens than this says more about overhead than rate (as engine_step.py)
_MIN_RATE_TOKENS = 32


class QueueWatch:
    def __init__(self, llm, stats: VLLMStats):
        self._llm, self._stats = llm, stats
        self.prefilling: dict[str, int] = {}  # requests before their first output -> prompt tokens
        # the same requests -> (priority, arrival number): vLLM's waiting queue is in that order, so
        # its length says which have not started (_still_waiting)
        self._order: dict[str, tuple[int, int]] = {}
        self._num_in_vllm = 0  # requests handed to vLLM and not ended here
        self._arrivals = itertools.count()
        self.num_queue_timeouts = 0
        self.prefill_rate = PrefillRate()  # recent prefills' prompt tokens/s (vLLM's timestamps)

    def add(self, request_id: str, priority: int, num_prefill_tokens: int) -> None:
        self.prefilling[request_id] = num_prefill_tokens
        self._order[request_id] = (priority, next(self._arrivals))
        self._num_in_vllm += 1

    def remove(self, request_id: str) -> None:
        self.prefilling.pop(request_id, None)
        self._order.pop(request_id, None)
        self._num_in_vllm -= 1

    def first_output(self, request_id: str, out, metrics: RequestMetrics, num_prompt_tokens: int) -> None:
        """A request's first output: its prompt is no longer queued for prefill; when vLLM's own
        timestamps came with it (its EngineCore's monotonic clock, the node's), the TTFT's queue
        and prefill parts, and the prefill rate, as kvrelay's engine measures them."""
        self.prefilling.pop(request_id, None)
        self._order.pop(request_id, None)
        stamps = getattr(out, "metrics", None)
        if stamps is None or not stamps.scheduled_ts:
            return
        metrics.first_scheduled_mono_s = stamps.scheduled_ts
        computed = num_prompt_tokens - (out.num_cached_tokens or 0)
        seconds = stamps.first_token_ts - stamps.scheduled_ts
        if computed >= _MIN_RATE_TOKENS:
            self.prefill_rate.add(computed, seconds)

    async def until_started(self, stream, request_id: str, deadline: float | None):
        """vLLM's outputs of `request_id`; with a `deadline` (monotonic), a None instead of them
        when it passes with the request still in vLLM's waiting queue (it is aborted there first).
        A request that has started is never dropped: only the first output is waited for so."""
        outputs = aiter(stream)
        if deadline is not None:
            first = asyncio.ensure_future(anext(outputs))
            try:
                while True:
                    done, _ = await asyncio.wait({first}, timeout=max(deadline - time.monotonic(), 0.0))
                    if done:
                        break
                    waiting = self._still_waiting(request_id)
                    if waiting is False:
                        await first
                        break
                    if waiting:
                        await self._llm.abort(request_id)
                        first.cancel()
                        await asyncio.gather(first, return_exceptions=True)
                        yield None
                        return
                    deadline = time.monotonic() + 0.1  # the stats do not count it yet: look again
            except BaseException:
                first.cancel()
                raise
            try:
                out = first.result()
            except StopAsyncIteration:
                return
            yield out
        async for out in outputs:
            yield out

    def _still_waiting(self, request_id: str) -> bool | None:
        """Whether a request without output is still in vLLM's waiting queue (None: the latest
        scheduler stats do not count every request handed to vLLM yet, so they cannot say). vLLM's
        queue takes requests by (priority, arrival), so of those without output the last
        `num_waiting` in that order are the ones waiting; requests preempted back into the queue
        count there too, which can only make one look waiting."""
        mine = self._order.get(request_id)
        if mine is None:
            return False
        if self._stats.num_running + self._stats.num_waiting < self._num_in_vllm:
            return None
        order = sorted(self._order.values())
        return order.index(mine) >= len(order) - self._stats.num_waiting
