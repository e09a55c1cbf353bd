"""The hostile requests of issue 17, as one list that the hostile-input test and `kvrelay bench
hostile` both send: each is a way one client tried to stall or exhaust a replica, with the 4xx it
must get and the error's `param` or `code` that names what was refused.

    case                              status   names
    Content-Length over the limit     413      request_too_large   (refused before reading)
    a chunked body over the limit     413      request_too_large   (reading stops at the limit)
    JSON nested 20,000 deep           400      invalid_json        (not a RecursionError 500)
    a request's own chat template     400      chat_template_kwargs.chat_template
    n far over the cap                400      n
    thousands of prompts              400      prompt
    a huge logit_bias                 400      logit_bias
    hundreds of stop strings          400      stop
    an unknown model                  404      model
    malformed JSON                    422      -

Each `send` takes any `httpx.AsyncClient` (over ASGI in tests, over TCP in the benchmark) whose
base URL is the app.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

__all__ = ["HostileCase", "hostile_cases"]

# A template that would run for 10^18 iterations: only refusing it (or the render time limit) stops it.
NESTED_LOOPS_TEMPLATE = "{% for i in range(10**9) %}{% for j in range(10**9) %}x{% endfor %}{% endfor %}"


@dataclass(frozen=True)
class HostileCase:
    name: str
    send: Callable[[object], Awaitable[object]]  # httpx.AsyncClient -> httpx.Response
    status: int
    names: str | None  # the error's param or code that names the refused thing; None: not checked


async def _chunks(num_bytes: int, chunk_bytes: int = 64 * 1024) -> AsyncIterator[bytes]:
    """A body of `num_bytes` spaces sent chunked: no Content-Length to refuse it by."""
    for _ in range(num_bytes // chunk_bytes):
        yield b" " * chunk_bytes


def hostile_cases(model: str, max_body_bytes: int) -> list[HostileCase]:
    """The cases against an app serving `model` whose `max_request_body_bytes` is `max_body_bytes`."""
    json_type = {"content-type": "application/json"}
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    over = max_body_bytes + 64 * 1024
    return [
        HostileCase("content-length over the limit", lambda c: c.post(
            "/v1/completions", content=b"{" + b" " * over + b"}", headers=json_type), 413, "request_too_large"),
        HostileCase("chunked body over the limit", lambda c: c.post(
            "/v1/completions", content=_chunks(over + over // 2), headers=json_type), 413, "request_too_large"),
        HostileCase("deeply nested JSON", lambda c: c.post(
            "/v1/completions", content=b"[" * 20000 + b"]" * 20000, headers=json_type), 400, "invalid_json"),
        HostileCase("a request's own chat template", lambda c: c.post("/v1/chat/completions", json={
            **chat, "chat_template_kwargs": {"chat_template": NESTED_LOOPS_TEMPLATE}}), 400, "chat_template_kwargs.chat_template"),
        HostileCase("n far over the cap", lambda c: c.post(
            "/v1/completions", json={"model": model, "prompt": "x", "n": 128}), 400, "n"),
        HostileCase("thousands of prompts", lambda c: c.post(
            "/v1/completions", json={"model": model, "prompt": [[1]] * 5000}), 400, "prompt"),
        HostileCase("a huge logit_bias", lambda c: c.post("/v1/completions", json={
            "model": model, "prompt": "x", "logit_bias": {str(i): 1 for i in range(5000)}}), 400, "logit_bias"),
        HostileCase("hundreds of stop strings", lambda c: c.post(
            "/v1/completions", json={"model": model, "prompt": "x", "stop": ["s"] * 500}), 400, "stop"),
        HostileCase("an unknown model", lambda c: c.post(
            "/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404, "model"),
        HostileCase("malformed JSON", lambda c: c.post(
            "/v1/completions", content=b"{not json", headers=json_type), 422, None),
    ]
