"""The ingress merges the outputs that reached it while it was busy (bounded), and only those."""

from __future__ import annotations

import asyncio

import pytest

from serving.api.generation.coalescing import coalesced
from serving.engine.outputs import CompletionOutput, RequestOutput


def _out(*tokens: int, finish: str | None = None, index: int = 0) -> RequestOutput:
    return RequestOutput("r", [CompletionOutput(index, "", list(tokens), None, finish)], finish is not None, 4, 0)


def _tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [[t for c in o.outputs for t in c.token_ids] for o in outs]


class _Source:
    """An async stream of outputs; `gate` (when given) holds each item until it is set."""

    def __init__(self, items: list, gate: asyncio.Queue | None = None):
        self.items = items
        self.gate = gate
        self.closed = False

    async def stream(self):
        try:
            for item in self.items:
                if self.gate is not None:
                    await self.gate.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.closed = True


@pytest.mark.asyncio
async def test_outputs_waiting_behind_the_first_are_merged_up_to_the_bound():
    source = _Source([_out(1), _out(2), _out(3), _out(4), _out(5, 6), _out(7, finish="length")])
    outs = [o async for o in coalesced(source.stream(), max_tokens=3)]
    # All six were queued before the reader woke: 1+2+3 reach the bound, 4 then 5,6 (3 tokens),
    # then 7 alone.
    assert _tokens(outs) == [[1, 2, 3], [4, 5, 6], [7]]
    assert [o.finished for o in outs] == [False, False, True]
    assert outs[-1].outputs[0].finish_reason == "length"
    assert source.closed


@pytest.mark.asyncio
async def test_a_reader_that_keeps_up_gets_every_output_alone_and_unchanged():
    gate: asyncio.Queue = asyncio.Queue()
    items = [_out(1), _out(2), _out(3, finish="stop")]
    source = _Source(items, gate)
    stream = coalesced(source.stream(), max_tokens=16)
    seen = []
    for _ in items:
        gate.put_nowait(None)
        seen.append(await anext(stream))
    assert seen == items  # the same objects: nothing copied when nothing is merged
    with pytest.raises(StopAsyncIteration):
        await anext(stream)


@pytest.mark.asyncio
async def test_merging_copies_and_leaves_the_sources_outputs_unchanged():
    first, second = _out(1), _out(2)
    outs = [o async for o in coalesced(_Source([first, second, _out(3, finish="stop")]).stream(), max_tokens=16)]
    assert _tokens(outs) == [[1, 2, 3]]
    assert first.outputs[0].token_ids == [1] and second.outputs[0].token_ids == [2]


@pytest.mark.asyncio
async def test_an_error_comes_after_the_outputs_that_arrived_before_it():
    source = _Source([_out(1), _out(2), RuntimeError("replica died")])
    stream = coalesced(source.stream(), max_tokens=16)
    assert _tokens([await anext(stream)]) == [[1, 2]]
    with pytest.raises(RuntimeError, match="replica died"):
        await anext(stream)
    assert source.closed


@pytest.mark.asyncio
async def test_closing_early_ends_the_source_stream():
    gate: asyncio.Queue = asyncio.Queue()
    source = _Source([_out(1), _out(2), _out(3, finish="stop")], gate)
    stream = coalesced(source.stream(), max_tokens=16)
    gate.put_nowait(None)
    assert _tokens([await anext(stream)]) == [[1]]
    await stream.aclose()  # the source waits at its gate: closing must end it (which aborts)
    assert source.closed


@pytest.mark.asyncio
async def test_choices_are_merged_per_index():
    items = [_out(1, index=0), _out(9, index=1), _out(2, index=0, finish="stop")]
    items[-1].finished = False
    outs = [o async for o in coalesced(_Source(items).stream(), max_tokens=16)]
    assert [(c.index, c.token_ids, c.finish_reason) for c in outs[0].outputs] == [(0, [1, 2], "stop"), (1, [9], None)]
