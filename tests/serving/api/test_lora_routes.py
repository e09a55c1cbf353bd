"""LoRA adapters through the OpenAI API (vLLM's shapes): an adapter's name as `model` (or
`base:adapter`), /v1/models listing adapters with their parent, unknown ones 404 naming what is
served. The expected texts come from the engine asked directly with the same adapter."""

from __future__ import annotations

import httpx
import pytest

from serving.api.pipeline import Frontend
from serving.api.routes import OpenAIServer
from serving.config import ServeConfig
from serving.deployments.local_backend import LocalBackend
from serving.engine import EngineConfig, LLMEngine, SamplingParams
from serving.engine.async_engine import AsyncEngine

pytest.importorskip("peft")
pytestmark = pytest.mark.asyncio

MODEL = "tiny"
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    from tests.serving.engine.test_lora import make_adapter

    path = tmp_path_factory.mktemp("lora") / "sql"
    make_adapter(tiny_model_dir, path, 8, 16, ["q_proj", "v_proj", "down_proj"], False, seed=11)
    engine_config = dict(model=str(tiny_model_dir), dtype="float32", kv_cache_bytes=4 * 2**20, num_threads=1,
                         lora={"adapters": {"sql": str(path)}})
    engine = AsyncEngine(EngineConfig(**engine_config))
    config = ServeConfig(model=str(tiny_model_dir), served_model_name=MODEL,
                         engine={"lora": {"adapters": {"sql": str(path)}}})
    app = OpenAIServer(Frontend(engine.tokenizer, LocalBackend(engine), MODEL), config).build_app()
    reference = LLMEngine(EngineConfig(**engine_config))
    yield app, reference, str(path)
    engine.shutdown()


def expected_text(reference: LLMEngine, lora: str | None) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference.add_request(f"ref-{lora}", params=params, prompt_token_ids=PROMPT, lora_name=lora)
    tokens: list[int] = []
    while reference.has_unfinished_requests():
        for out in reference.step():
            tokens += out.outputs[0].token_ids
    return reference.tokenizer.decode(tokens)


async def complete(app, model: str) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        return await c.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 12,
                                                     "temperature": 0, "ignore_eos": True})


async def test_the_adapter_named_as_model_or_base_colon_adapter_runs_it(served):
    app, reference, _ = served
    with_adapter, base = expected_text(reference, "sql"), expected_text(reference, None)
    assert with_adapter != base
    for model, expected in (("sql", with_adapter), (f"{MODEL}:sql", with_adapter), (MODEL, base)):
        response = await complete(app, model)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected, model


async def test_models_lists_adapters_with_their_parent(served):
    app, _, path = served
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        listed = (await c.get("/v1/models")).json()["data"]
        one = (await c.get("/v1/models/sql")).json()
    assert [m["id"] for m in listed] == [MODEL, "sql"]
    assert (listed[1]["parent"], listed[1]["root"], one["id"], one["parent"]) == (MODEL, path, "sql", MODEL)


@pytest.mark.parametrize("model", ["nope", f"{MODEL}:nope", "other:sql"])
async def test_an_unknown_adapter_is_a_404_naming_what_is_served(served, model):
    app, _, _ = served
    response = await complete(app, model)
    assert response.status_code == 404
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert "tiny, sql" in error["message"]
