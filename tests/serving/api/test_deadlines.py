"""An engine's queue limit over HTTP: a request an engine's queue held past its max_queue_wait_s
gets 503 queue_timeout with Retry-After, never a late answer."""

from __future__ import annotations

import httpx
import pytest

from serving.api.pipeline import Frontend
from serving.api.routes import OpenAIServer
from serving.cli.status import parse_metrics
from serving.config import ServeConfig
from serving.deployments.local_backend import LocalBackend
from serving.engine import EngineConfig, SamplingParams
from serving.engine.async_engine import AsyncEngine

MODEL = "tiny"


def server(engine, tiny_model_dir, backend, **config) -> tuple[OpenAIServer, None]:
    cfg = ServeConfig.model_validate({"model": str(tiny_model_dir), "served_model_name": MODEL, **config})
    return OpenAIServer(Frontend(engine.tokenizer, backend, MODEL), cfg), None


async def post(app, path: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        return await client.post(path, json=body)


async def get(app, path: str) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        return await client.get(path)


async def requests_by_status(app) -> dict[str, float]:
    samples = parse_metrics((await get(app, "/metrics")).text)
    return {labels["status"]: value for name, labels, value in samples if name == "kvrelay_requests_total" and value}


# ---- max_queue_wait_s --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_engine(tiny_model_dir):
    """12 blocks of 16 tokens; a held export of 160 tokens pins 10 of them, so a 50-token prompt
    (4 blocks) waits in the queue until the export is released: past its 50 ms, for certain."""
    engine = AsyncEngine(EngineConfig(
        model=str(tiny_model_dir), dtype="float32", kv_cache_bytes=12 * 16 * 512, enable_prefix_caching=False,
        num_threads=1, max_queue_wait_s=0.05,
    ))
    yield engine
    engine.shutdown()


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_held_in_an_engine_queue_past_max_queue_wait_s_gets_503_with_retry_after(small_engine, tiny_model_dir, stream):
    srv, _ = server(small_engine, tiny_model_dir, LocalBackend(small_engine))
    app = srv.build_app()
    hold = SamplingParams(temperature=0.0, max_tokens=1)
    async for _ in small_engine.generate("held", params=hold, prompt_token_ids=list(range(10, 170)), hold_kv=True):
        pass
    try:
        response = await post(app, "/v1/completions", {"model": MODEL, "prompt": list(range(200, 250)), "max_tokens": 4, "stream": stream})
    finally:
        assert await small_engine.release_kv("held")

    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert response.json() == {"error": {
        "message": "The request waited longer than the engine's queue limit (max_queue_wait_s) without starting; "
        "the pool is overloaded. Retry after 1 s.",
        "type": "service_unavailable_error", "param": None, "code": "queue_timeout",
    }}
    assert srv.usage.totals("anonymous").num_requests == 0
    assert await requests_by_status(app) == {"503": 1.0}
    stats = small_engine.stats()
    assert stats.num_waiting == 0 and stats.num_free_blocks == stats.num_blocks
