"""Request deadlines: how long a completion may take, counted from when the ingress received it,
and what a request whose time runs out gets.

    request_timeout_s                 (ServeConfig; default 600, null: none)  the server's default
    tiers.<tier>.max_timeout_s        (null: request_timeout_s bounds it)     the most a key may ask for
    "timeout": seconds > 0            (request body: /v1/chat/completions, /v1/completions, /v1/responses)

    limit    = the key's tier's max_timeout_s, else request_timeout_s, else none
    timeout  = the body's `timeout` (over the limit: 400 naming `timeout` and the limit),
               else request_timeout_s capped by the tier's max_timeout_s (either alone when the
               other is null; neither: no deadline)

So a tier may grant longer timeouts than the server's default (a max_timeout_s above it) to
requests that ask, and a shorter one to every request of its keys (below it).

The deadline bounds every wait for the request's next piece of output (`Deadline.bound`), its
first token's included; the time before that (reading and tokenizing the body) counts against
it but is not interrupted. When it passes, the wait is cancelled: the cancellation unwinds the
request's streams exactly as a client that disconnects does, so the backend stream is closed
and the request is aborted on every stage it runs on (the engine frees its blocks; ServeBackend
cancels its handle calls and releases KV nobody claimed). RequestTimeoutError (408, type and
code `timeout`, serving/api/errors.py) takes its place:

    not streamed, nothing generated    408 {"error": {...}}
    not streamed, tokens generated     408 {"error": {...}, "partial": {...}}: the chat.completion or
                                       text_completion it would have been, with what it got (text
                                       so far; finish_reason null where a choice had not finished)
                                       and its `usage`
    streamed, before its first token   408 {"error": {...}}: nothing had been sent
    streamed, after it                 the chunks so far, then data: {"error": {...}}, data: [DONE]

Like a stream its client left, it is billed for the tokens it got (none: not billed), and its
metrics record status 408.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from serving.api.errors import APIError, RequestTimeoutError
from serving.config import ServeConfig

__all__ = ["Deadline", "timeout_for", "deadline_for", "bounded"]

T = TypeVar("T")


@dataclass(frozen=True)
class Deadline:
    timeout_s: float
    expires_at: float  # on `clock`
    clock: Callable[[], float] = time.monotonic

    def remaining_s(self) -> float:
        return self.expires_at - self.clock()

    async def bound(self, items: AsyncGenerator[T, None]) -> AsyncIterator[T]:
        """`items`, each wait for the next one bounded by the time left; when it runs out, the
        wait is cancelled (so `items` unwinds as if its client had left) and RequestTimeoutError
        is raised. Closing this closes `items`."""
        try:
            while True:
                remaining = self.remaining_s()
                if remaining <= 0:
                    raise RequestTimeoutError(self.timeout_s)
                timer = asyncio.timeout(remaining)
                try:
                    async with timer:
                        item = await anext(items)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    if not timer.expired():
                        raise  # the items' own
                    raise RequestTimeoutError(self.timeout_s) from None
                yield item
        finally:
            await items.aclose()


def timeout_for(asked_s: float | None, *, default_s: float | None, tier: str, tier_max_s: float | None) -> float | None:
    """A request's timeout in seconds (None: no deadline), or a 400 naming `timeout` and its limit."""
    if asked_s is not None:
        if tier_max_s is not None and asked_s > tier_max_s:
            raise _too_long(asked_s, f"the key's tier {tier!r} allows (max_timeout_s = {tier_max_s:g} s)", tier_max_s)
        if tier_max_s is None and default_s is not None and asked_s > default_s:
            raise _too_long(asked_s, f"this server allows (request_timeout_s = {default_s:g} s)", default_s)
        return asked_s
    if default_s is None or tier_max_s is None:
        return default_s if tier_max_s is None else tier_max_s
    return min(default_s, tier_max_s)


def deadline_for(asked_s: float | None, config: ServeConfig, tier: str, received_at: float, clock: Callable[[], float]) -> Deadline | None:
    """The deadline of a request of a key of `tier` received at `received_at` (on `clock`)."""
    timeout_s = timeout_for(asked_s, default_s=config.request_timeout_s, tier=tier, tier_max_s=config.tiers[tier].max_timeout_s)
    return None if timeout_s is None else Deadline(timeout_s, received_at + timeout_s, clock)


def bounded(items: AsyncGenerator[T, None], deadline: Deadline | None) -> AsyncGenerator[T, None]:
    return items if deadline is None else deadline.bound(items)


def _too_long(asked_s: float, allowed: str, limit_s: float) -> APIError:
    return APIError(
        400, f"timeout = {asked_s:g} s is longer than {allowed}; send {limit_s:g} or less, or leave it out",
        param="timeout", code="timeout_not_allowed",
    )
