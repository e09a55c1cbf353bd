"""Driving the OpenAI API in-process, as the API tests do: the app over a tiny engine, an httpx
client on its ASGI transport, one POST, and an SSE body's events.

    engine ──LocalBackend──▶ Frontend ──▶ OpenAIServer ──build_app()──▶ app ◀── asgi_client / post
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import httpx

__all__ = ["BASE_URL", "asgi_client", "local_app", "local_server", "post", "sse_events"]

BASE_URL = "http://test"


def local_server(engine, config, model: str, *server_args, **server_kwargs):
    """The OpenAIServer of `config` over an in-process engine (its tokenizer, a LocalBackend),
    serving it as `model`; `server_args` follow `config` (a price table)."""
    from serving.api.endpoints.routes import OpenAIServer
    from serving.api.generation.pipeline import Frontend
    from serving.deployments.local_backend import LocalBackend

    return OpenAIServer(Frontend(engine.tokenizer, LocalBackend(engine), model), config, *server_args, **server_kwargs)


def local_app(engine, config, model: str, *server_args, **server_kwargs):
    """`local_server`'s ASGI app."""
    return local_server(engine, config, model, *server_args, **server_kwargs).build_app()


def asgi_client(app, **headers) -> httpx.AsyncClient:
    """An httpx client that calls `app` in-process, with `headers` on every request."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE_URL, headers=headers)


async def post(app, path: str, body, *, model: str | None = None, key: str | None = None, **headers) -> httpx.Response:
    """One POST of `body` to `app`: a dict goes as JSON (with `"model": model` first when given),
    str or bytes as the raw body with a JSON content type; `key` as a bearer token."""
    if key:
        headers["authorization"] = f"Bearer {key}"
    async with asgi_client(app, **headers) as client:
        if isinstance(body, (str, bytes)):
            return await client.post(path, content=body, headers={"content-type": "application/json"})
        return await client.post(path, json=body if model is None else {"model": model, **body})


def sse_events(source: httpx.Response | str | Iterable[str]) -> list:
    """The `data:` payloads of an SSE stream, JSON-decoded, the closing "[DONE]" kept as is.
    `source`: a response (its content type checked), the body's text, or its lines. A line that
    is neither data nor an `event:` name fails the test."""
    if isinstance(source, httpx.Response):
        assert source.headers["content-type"].startswith("text/event-stream"), source.headers["content-type"]
        source = source.text
    lines = source.split("\n") if isinstance(source, str) else source
    events = []
    for line in lines:
        if not line or line.startswith("event: "):
            continue
        assert line.startswith("data: "), line
        payload = line.removeprefix("data: ")
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
