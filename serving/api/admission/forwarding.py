"""Forwarding an OpenAI request to another kvrelay app's ingress, the Ray-free half: the forwarded
request and the response's start, running an ASGI app on a forwarded request (the fallback's
side), the headers passed on, and relaying the answer to the client (the primary's side). The
transport, a Serve handle to the other app's ingress, is serving/deployments/fallback.py.

    primary app's OpenAIIngress                    fallback app's OpenAIIngress (same Ray cluster)
    ───────────────────────────                    ───────────────────────────────────────────────
    FallbackClient.open(ForwardedRequest)
      route path, client headers, body with   ──handle.forward, streamed──▶  serve_forwarded(its app)
      `model` set to the fallback's name                                    the FastAPI app of its HTTP
                                                                            routes: auth, validation,
                                                                            chat template, tokenizer,
                                                                            generation, billing, metrics
    relay(): the client's HTTP response  ◀── ResponseStart(status, headers), body bytes ◀── ASGI send()

Why the fallback's ingress with the client's OpenAI body, and not its workers through a Frontend of
ours: a fallback model may have another tokenizer, chat template, context window, vocabulary and
price. Its ingress knows all of them and answers exactly as over HTTP (the same errors, its own
`model` in every body and chunk, its own usage ledger and metrics), so the primary needs nothing of
its config but two names, and the apps can be upgraded apart. Running its ASGI app, rather than a
second entry point beside the routes, leaves no second copy of the OpenAI pipeline to drift.
This is Ray Serve LLM's shape too: its ingress hands OpenAI requests to model servers by handle.

A forwarded request is marked in its ASGI scope (not a header, which a client could send) and is
never degraded again, so two apps that fall back on each other cannot bounce a request. Closing
the relay (the client left) cancels the handle call; the fallback replica then cancels its ASGI
app as Serve's proxy does on a disconnect, which aborts the generation and frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from fastapi.responses import StreamingResponse

from serving.api.errors import APIError, with_request_id

__all__ = [
    "FORWARDED_SCOPE_KEY",
    "FallbackUnavailable",
    "Forwarder",
    "ForwardedRequest",
    "ResponseStart",
    "forward_headers",
    "relay",
    "serve_forwarded",
]

logger = logging.getLogger(__name__)

FORWARDED_SCOPE_KEY = "kvrelay.forwarded_from"  # ASGI scope key: the primary's model name
# Not forwarded: the connection's own (the body is re-encoded, the fallback is no HTTP peer).
_HOP_BY_HOP = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade", "expect"})
# Not relayed back: set again by the server that answers the client.
_NOT_RELAYED = frozenset({"connection", "keep-alive", "transfer-encoding", "date", "server"})


@dataclass(frozen=True)
class ForwardedRequest:
    """What crosses to the fallback app's ingress: one HTTP request, as its routes would get it."""

    path: str  # the route, e.g. /v1/chat/completions
    headers: tuple[tuple[str, str], ...]
    body: bytes
    origin: str  # the primary's model name (the fallback's logs; marks the scope as forwarded)


@dataclass(frozen=True)
class ResponseStart:
    """The first item of a forwarded response; body chunks (bytes) follow."""

    status: int
    headers: tuple[tuple[str, str], ...]


class FallbackUnavailable(Exception):
    """The fallback app could not take the request (missing, no running ingress, its handle call
    failed before answering); the caller answers with the primary's error."""


# ---- the fallback's side -----------------------------------------------------------------------

class Forwarder(Protocol):
    """Opens a forwarded request at another app's ingress (serving/deployments/fallback.py)."""

    async def open(self, request: ForwardedRequest) -> tuple[ResponseStart, AsyncIterator[bytes]]:
        """The other app's status line and headers, and its body to come; raises
        FallbackUnavailable when it cannot be reached."""
        ...

_DONE = object()


async def serve_forwarded(app, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
    """Run `request` through the ASGI `app` (an ingress's FastAPI app) and yield its response:
    a ResponseStart, then body chunks. Closed early, it disconnects the app and cancels it."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": request.path, "raw_path": request.path.encode(), "root_path": "",
        "query_string": b"", "client": None, "server": None,
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers],
        FORWARDED_SCOPE_KEY: request.origin,
    }
    messages: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    is_body_read = False

    async def receive() -> dict:
        nonlocal is_body_read
        if not is_body_read:
            is_body_read = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()  # a StreamingResponse listens for the client leaving
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            messages.put_nowait(_DONE)

    task = asyncio.create_task(run())
    is_complete = False
    try:
        while True:
            message = await messages.get()
            if message is _DONE:
                break
            if message["type"] == "http.response.start":
                headers = tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", []))
                yield ResponseStart(message["status"], headers)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    is_complete = True
                    break
    finally:
        disconnected.set()
        if not is_complete:
            task.cancel()  # what Serve does to a replica's HTTP call when its client leaves
        await asyncio.gather(task, return_exceptions=True)
    error = None if task.cancelled() else task.exception()
    if error is not None:
        if not is_complete:
            raise error
        logger.warning("forwarded request from %r: the app failed after answering: %r", request.origin, error)


def forward_headers(headers: Iterable[tuple[str, str]], trace_carrier: dict[str, str] | None) -> tuple[tuple[str, str], ...]:
    """The client's headers as the fallback gets them (its Authorization included: the fallback
    authenticates and bills the same key). With tracing, the primary's ingress span becomes the
    parent of the fallback's."""
    carrier = trace_carrier or {}
    dropped = _HOP_BY_HOP | {k.lower() for k in carrier}
    kept = tuple((k, v) for k, v in headers if k.lower() not in dropped)
    return kept + tuple(carrier.items())


def relay(
    start: ResponseStart, chunks: AsyncIterator[bytes], *, extra_headers: dict[str, str],
    on_close: Callable[[int, str | None], None], request_id: str,
) -> StreamingResponse:
    """The fallback's response, passed through byte for byte (with its Content-Length when it
    has one). `on_close(status, error)` runs once the body has ended, however it ended. If the
    fallback's stream breaks off, an SSE response ends with an `error` event and `[DONE]`, as
    a stream of our own would."""
    headers = {k: v for k, v in start.headers if k.lower() not in _NOT_RELAYED}
    headers.update(extra_headers)
    is_sse = headers.get("content-type", "").startswith("text/event-stream")

    async def body():
        error = None
        try:
            async for chunk in chunks:
                yield chunk
        except asyncio.CancelledError:
            error = "the client disconnected"
            raise
        except Exception as exc:
            error = f"the fallback's response broke off: {type(exc).__name__}: {exc}"
            logger.warning("request %s: %s", request_id, error, exc_info=exc)
            if is_sse:  # the exception's text is for the log (errors.py)
                broken = with_request_id(APIError(
                    503, "The fallback's response broke off.", type="service_unavailable_error", code="no_worker",
                ), request_id)
                yield f"data: {json.dumps(broken.body())}\n\ndata: [DONE]\n\n".encode()
        finally:
            await chunks.aclose()
            on_close(start.status, error)

    return StreamingResponse(body(), status_code=start.status, headers=headers)
