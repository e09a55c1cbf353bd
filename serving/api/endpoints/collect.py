"""A non-streamed completion: its deltas collected per choice, then answered in one body.

    deltas ──Choices.add──▶ per choice: text, finish reason, logprobs, prompt scores
           ──answer(deltas, choices, call, response)──▶ 200 + the body response(usage) builds
                                                       408 + the same body as `partial` when the
                                                       request ran out of time after a token

Chat (chat.py) and completions (completions.py) shape the body; collecting it is the same.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from serving.api.endpoints.calls import Call, with_partial
from serving.api.errors import RequestTimeoutError
from serving.api.generation.pipeline import ChoiceDelta
from serving.engine.outputs import TokenLogprob

__all__ = ["Choices", "answer"]


@dataclass
class Choices:
    """Each choice's output so far, by choice index."""

    texts: list[str]
    finish: list[str | None]
    logprobs: list[list[TokenLogprob]]
    prompt_scores: list[list[TokenLogprob] | None]  # the engine's prompt logprobs, when asked for

    @classmethod
    def starting_with(cls, texts: list[str]) -> Choices:
        """One choice per text, which its output follows (a completion's echoed prompt, or "")."""
        num = len(texts)
        return cls(list(texts), [None] * num, [[] for _ in range(num)], [None] * num)

    def add(self, delta: ChoiceDelta) -> None:
        i = delta.index
        if delta.prompt_logprobs is not None:
            self.prompt_scores[i] = delta.prompt_logprobs
        self.texts[i] += delta.text
        self.finish[i] = delta.finish_reason or self.finish[i]
        if delta.logprobs:
            self.logprobs[i] += delta.logprobs


async def answer(deltas: AsyncIterator[ChoiceDelta], choices: Choices, call: Call,
                 response: Callable[[dict | None], dict]) -> JSONResponse:
    """Collect every delta into `choices`, then answer `response(usage)`, billed. Out of time, the
    RequestTimeoutError carries what it got (`with_partial`) and is raised on."""
    try:
        async for delta in deltas:
            choices.add(delta)
    except RequestTimeoutError as exc:
        with_partial(exc, call.account, response)
        raise
    return JSONResponse(response(call.account.settle()), headers=call.account.headers())
