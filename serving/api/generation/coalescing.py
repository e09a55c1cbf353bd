"""Coalescing a backend's stream under load: outputs that queue up while the ingress handles one
are merged into the next, so a busy ingress sends fewer, larger SSE events instead of falling
behind (`ingress.max_merged_tokens` bounds a merge; serving/api/generation/pipeline.py reads
every backend stream through here).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from serving.engine.outputs import RequestOutput, merge_outputs

__all__ = ["coalesced"]


async def coalesced(stream: AsyncIterator[RequestOutput], max_tokens: int) -> AsyncIterator[RequestOutput]:
    """`stream` read ahead: each output comes with those that arrived behind it while the last
    one was being handled merged in, up to `max_tokens` tokens (like a stream interval that is
    only paid under load). An output that finds nothing queued goes on at once, so the first
    token is never held back. Closing this closes `stream`, which aborts the request."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump():
        try:
            async for out in stream:
                queue.put_nowait(out)
            queue.put_nowait(end)
        except Exception as exc:  # noqa: BLE001 - raised to the reader, after what came before it
            queue.put_nowait(exc)

    task = asyncio.create_task(pump())
    try:
        item = await queue.get()
        while item is not end:
            if isinstance(item, BaseException):
                raise item
            out, item = item, None
            copied = False  # merge into a copy: the first output may be someone else's object
            while not out.finished and not queue.empty():
                nxt = queue.get_nowait()
                if nxt is end or isinstance(nxt, BaseException) or _num_tokens(out) + _num_tokens(nxt) > max_tokens:
                    item = nxt
                    break
                out = merge_outputs(out if copied else merge_outputs(None, out), nxt)
                copied = True
            yield out
            if item is None:
                item = await queue.get()
    finally:
        # A pump still inside the stream owns it; cancelling the pump ends the stream.
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await stream.aclose()


def _num_tokens(out: RequestOutput) -> int:
    return sum(len(c.token_ids) for c in out.outputs)
