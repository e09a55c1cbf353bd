"""The API's `speculative` field (kvrelay's): `false` keeps a request out of speculative decoding
where the engine has it on; the output is the same either way (greedy)."""

from __future__ import annotations

import httpx
import pytest

from serving.api.protocol.wire import ChatCompletionRequest, sampling_params
from serving.config import ServeConfig
from tests.asgi import local_app
from tests.helpers import tiny_async_engine

MODEL = "tiny"
# Greedy over three biased tokens: the tiny model falls into loops prompt lookup predicts.
BODY = {
    "model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 40, "temperature": 0,
    "ignore_eos": True, "logit_bias": {"1000": 100, "2000": 100, "3000": 100},
}


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    engine = tiny_async_engine(tiny_model_dir, speculative={"num_speculative_tokens": 4, "verify_row_cost": 0.1, "max_batch_rows": 64})
    config = ServeConfig(model=str(tiny_model_dir), served_model_name=MODEL)
    app = local_app(engine, config, MODEL)
    yield engine, app
    engine.shutdown()


async def chat(app, body: dict) -> dict:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_sampling_params_carry_the_field():
    assert sampling_params(ChatCompletionRequest.model_validate(BODY)).speculative is True
    assert sampling_params(ChatCompletionRequest.model_validate({**BODY, "speculative": False})).speculative is False


@pytest.mark.asyncio
async def test_speculative_false_opts_a_request_out(stack):
    engine, app = stack
    stats = engine.stats
    opted_out = await chat(app, {**BODY, "speculative": False})
    assert stats().spec_proposed_tokens == 0
    default = await chat(app, BODY)
    assert stats().spec_accepted_tokens > 0
    assert default["choices"][0]["message"]["content"] == opted_out["choices"][0]["message"]["content"]
    assert default["usage"]["completion_tokens"] == opted_out["usage"]["completion_tokens"] == 40
