"""Hostile requests against one app while a normal stream runs beside it: each gets its 4xx, the
stream's tokens are exactly those it gets alone, and the engine ends with every block free.
(How much the stream's TTFT moves is a benchmark's question, not a test's: `kvrelay bench hostile`.)"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from load_tests.hostile.cases import hostile_cases
from serving.config import ServeConfig
from tests.asgi import local_app

MODEL = "tiny"
STREAM = {"model": MODEL, "prompt": list(range(100, 120)), "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
MAX_BODY_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def served(engine, tiny_model_dir):
    config = ServeConfig(model=str(tiny_model_dir), served_model_name=MODEL, max_request_body_bytes=MAX_BODY_BYTES)
    return engine, local_app(engine, config, MODEL)


def _text(events: str) -> str:
    chunks = [json.loads(line[6:]) for line in events.split("\n\n") if line.startswith("data: {")]
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


@pytest.mark.asyncio
async def test_hostile_requests_get_their_4xx_while_a_normal_stream_runs_unharmed(served):
    engine, app = served
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
        alone = _text((await client.post("/v1/completions", json=STREAM)).text)

        async def stream_beside():
            return _text((await client.post("/v1/completions", json=STREAM)).text)

        beside = asyncio.create_task(stream_beside())
        answers = [(case.name, await case.send(client), case.status, case.names) for case in hostile_cases(MODEL, MAX_BODY_BYTES)]
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
