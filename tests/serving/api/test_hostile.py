"""Hostile requests against one app while a normal stream runs beside it: each gets its 4xx, the
stream's tokens are exactly those it gets alone, and the engine ends with every block free.
(How much the stream's TTFT moves is a benchmark's question, not a test's.)"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from serving.api.pipeline import Frontend
from serving.api.routes import OpenAIServer
from serving.config import ServeConfig
from serving.deployments.local_backend import LocalBackend

MODEL = "tiny"
STREAM = {"model": MODEL, "prompt": list(range(100, 120)), "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def served(engine, tiny_model_dir):
    config = ServeConfig(model=str(tiny_model_dir), served_model_name=MODEL, max_request_body_bytes=64 * 1024)
    return engine, OpenAIServer(Frontend(engine.tokenizer, LocalBackend(engine), MODEL), config).build_app()


def _text(events: str) -> str:
    chunks = [json.loads(line[6:]) for line in events.split("\n\n") if line.startswith("data: {")]
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


async def _chunked(size: int):
    for _ in range(size // 4096):
        yield b" " * 4096


HOSTILE = [  # (name, how to send it, status, error param or code)
    ("content-length over the limit", lambda c: c.post("/v1/completions", content=b"{" + b" " * (70 * 1024) + b"}",
                                                        headers={"content-type": "application/json"}), 413, "request_too_large"),
    ("chunked body over the limit", lambda c: c.post("/v1/completions", content=_chunked(1024 * 1024),
                                                     headers={"content-type": "application/json"}), 413, "request_too_large"),
    ("deeply nested JSON", lambda c: c.post("/v1/completions", content=b"[" * 20000 + b"]" * 20000,
                                            headers={"content-type": "application/json"}), 400, "invalid_json"),
    ("a request's own chat template", lambda c: c.post("/v1/chat/completions", json={
        **CHAT, "chat_template_kwargs": {"chat_template": "{% for i in range(10**9) %}{% for j in range(10**9) %}x{% endfor %}{% endfor %}"}}),
     400, "chat_template_kwargs.chat_template"),
    ("n far over the cap", lambda c: c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 128}), 400, "n"),
    ("thousands of prompts", lambda c: c.post("/v1/completions", json={"model": MODEL, "prompt": [[1]] * 5000}), 400, "prompt"),
    ("a huge logit_bias", lambda c: c.post("/v1/completions", json={
        "model": MODEL, "prompt": "x", "logit_bias": {str(i): 1 for i in range(5000)}}), 400, "logit_bias"),
    ("hundreds of stop strings", lambda c: c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stop": ["s"] * 500}), 400, "stop"),
    ("an unknown model", lambda c: c.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404, "model"),
    ("malformed JSON", lambda c: c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 422, None),
]


@pytest.mark.asyncio
async def test_hostile_requests_get_their_4xx_while_a_normal_stream_runs_unharmed(served):
    engine, app = served
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
        alone = _text((await client.post("/v1/completions", json=STREAM)).text)

        async def stream_beside():
            return _text((await client.post("/v1/completions", json=STREAM)).text)

        beside = asyncio.create_task(stream_beside())
        answers = [(name, await send(client), status, field) for name, send, status, field in HOSTILE]
        assert await beside == alone
    for name, response, status, field in answers:
        assert response.status_code == status, (name, response.text[:300])
        error = response.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"}, name
        if field is not None:
            assert field in (error["param"], error["code"]), (name, error)
    for _ in range(200):  # the stream's abort-free end releases its blocks on the next step
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks:
            break
        await asyncio.sleep(0.05)
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (0, 0, stats.num_blocks)
