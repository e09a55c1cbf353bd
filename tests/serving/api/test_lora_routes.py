"""LoRA adapters through the OpenAI API (vLLM's shapes): an adapter's name as `model` (or
`base:adapter`), /v1/models listing adapters with their parent, unknown ones 404 naming what is
served. The expected texts come from the engine asked directly with the same adapter."""

from __future__ import annotations

import httpx
import pytest

from serving.config import ServeConfig
from serving.engine import LLMEngine, SamplingParams
from serving.engine.async_engine import AsyncEngine
from tests.asgi import local_app, local_server
from tests.helpers import tiny_engine_config

pytest.importorskip("peft")
pytestmark = pytest.mark.asyncio

MODEL = "tiny"
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    from tests.serving.engine.test_lora import make_adapter

    path = tmp_path_factory.mktemp("lora") / "sql"
    make_adapter(tiny_model_dir, path, 8, 16, ["q_proj", "v_proj", "down_proj"], False, seed=11)
    engine_config = tiny_engine_config(tiny_model_dir, num_threads=1, lora={"adapters": {"sql": str(path)}})
    engine = AsyncEngine(engine_config)
    config = ServeConfig(model=str(tiny_model_dir), served_model_name=MODEL,
                         engine={"lora": {"adapters": {"sql": str(path)}}})
    app = local_app(engine, config, MODEL)
    reference = LLMEngine(engine_config)
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


# ---- adapters loaded and unloaded at run time (POST /v1/load_lora_adapter, vLLM's) ----------------
ADMIN, USER = "admin-secret-key", "user-secret-key"


@pytest.fixture(scope="module")
def runtime(tmp_path_factory, tiny_model_dir):
    from tests.serving.engine.test_lora import make_adapter

    root = tmp_path_factory.mktemp("runtime-lora")
    make_adapter(tiny_model_dir, root / "late", 4, 8, ["q_proj", "o_proj", "up_proj"], False, seed=12)
    lora = {"adapters": {}, "allow_runtime_updates": True}
    engine = AsyncEngine(tiny_engine_config(tiny_model_dir, num_threads=1, lora=lora))
    config = ServeConfig(model=str(tiny_model_dir), served_model_name=MODEL, engine={"lora": lora},
                         api_keys=[USER], admin_api_keys=[ADMIN])
    app = local_app(engine, config, MODEL)
    reference = LLMEngine(tiny_engine_config(tiny_model_dir, num_threads=1, lora={"adapters": {"late": str(root / "late")}}))
    yield app, reference, root
    engine.shutdown()


def client(app, key: str | None = ADMIN) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", headers=headers)


async def test_an_adapter_loaded_at_run_time_serves_while_other_requests_run_and_unloads(runtime):
    import asyncio

    app, reference, root = runtime
    async with client(app) as admin, client(app, USER) as user:
        long_body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 300, "temperature": 0, "ignore_eos": True}
        running = asyncio.create_task(user.post("/v1/completions", json=long_body))
        await asyncio.sleep(0.05)
        body = {"model": "late", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        assert (await user.post("/v1/completions", json=body)).status_code == 404  # not loaded yet
        loaded = await admin.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(root / "late")})
        assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'late' added successfully.")
        answer = await user.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == expected_text(reference, "late")
        assert [m["id"] for m in (await user.get("/v1/models")).json()["data"]] == [MODEL, "late"]
        again = await admin.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(root / "late")})
        assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
        unloaded = await admin.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
        assert (unloaded.status_code, unloaded.text) == (200, "Success: LoRA adapter 'late' removed successfully.")
        assert (await user.post("/v1/completions", json=body)).status_code == 404
        gone = await admin.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
        assert (gone.status_code, gone.json()["error"]["code"]) == (404, "lora_adapter_not_found")
        finished = await running  # the base model's request ran through all of it
        assert finished.status_code == 200 and finished.json()["usage"]["completion_tokens"] == 300
        # loaded again under the same name: served again, the same text
        assert (await admin.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(root / "late")})).status_code == 200
        assert (await user.post("/v1/completions", json=body)).json()["choices"][0]["text"] == expected_text(reference, "late")
        assert (await admin.post("/v1/unload_lora_adapter", json={"lora_name": "late"})).status_code == 200


@pytest.mark.parametrize(
    "key, body, status, param, says",
    [
        (USER, {"lora_name": "x", "lora_path": "/tmp"}, 403, None, "needs an admin key"),
        (None, {"lora_name": "x", "lora_path": "/tmp"}, 401, None, "Missing API key"),
        (ADMIN, {"lora_path": "/tmp"}, 400, "lora_name", "must be a non-empty string"),
        (ADMIN, {"lora_name": "x", "lora_path": ""}, 400, "lora_path", "must be a non-empty string"),
        (ADMIN, {"lora_name": "x", "lora_path": 7}, 400, "lora_path", "must be a non-empty string"),
        (ADMIN, {"lora_name": MODEL, "lora_path": "/tmp"}, 400, "lora_name", "base model's name"),
        (ADMIN, {"lora_name": "a:b", "lora_path": "/tmp"}, 400, "lora_name", "holds ':'"),
        (ADMIN, {"lora_name": "x", "lora_path": "/nonexistent/adapter"}, 400, "lora_path",
         "/nonexistent/adapter/adapter_config.json not found"),
    ],
)
async def test_a_bad_load_is_refused_naming_the_field(runtime, key, body, status, param, says):
    app, _, _ = runtime
    async with client(app, key) as c:
        response = await c.post("/v1/load_lora_adapter", json=body)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["param"] == param and says in error["message"]
    async with client(app) as admin:  # nothing was registered
        assert [m["id"] for m in (await admin.get("/v1/models")).json()["data"]] == [MODEL]


async def test_a_malformed_body_is_422_and_an_unsupported_adapter_400(runtime, tmp_path, tiny_model_dir):
    import json

    app, _, root = runtime
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                         "target_modules": ["q_proj"], "use_dora": True}))
    async with client(app) as c:
        malformed = await c.post("/v1/load_lora_adapter", content=b"{not json", headers={"content-type": "application/json"})
        assert (malformed.status_code, malformed.json()["error"]["code"]) == (422, "invalid_json")  # as every route
        dora = await c.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)})
        assert dora.status_code == 400 and "use_dora is true; not supported" in dora.json()["error"]["message"]
        assert "bad" not in [m["id"] for m in (await c.get("/v1/models")).json()["data"]]


async def test_without_allow_runtime_updates_the_endpoints_answer_403_naming_the_setting(served):
    app, _, path = served
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        for route, body in (("load", {"lora_name": "y", "lora_path": path}), ("unload", {"lora_name": "sql"})):
            response = await c.post(f"/v1/{route}_lora_adapter", json=body)
            assert response.status_code == 403
            assert "engine.lora.allow_runtime_updates" in response.json()["error"]["message"]
        assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == [MODEL, "sql"]


async def test_several_ingress_replicas_share_runtime_adapters_through_the_registry(tiny_model_dir, tmp_path):
    """Two ingress servers over one engine and one AdapterRegistry (its handle faked): a load
    answered by one serves on the other from the next request; an unload on one reaches the
    other at its next refresh; the same name loaded on both at once is taken once."""
    from serving.deployments.adapter_registry import AdapterRegistry, AdapterSync
    from tests.serving.engine.test_lora import make_adapter

    make_adapter(tiny_model_dir, tmp_path / "late", 4, 8, ["q_proj", "o_proj"], False, seed=13)

    class Remote:  # a Serve handle's `.remote(...)` over the registry in this process
        def __init__(self, target):
            self.target = target

        def __getattr__(self, method):
            async def call(*args):
                return getattr(self.target, method)(*args)

            return type("Method", (), {"remote": staticmethod(call)})

    registry = Remote(AdapterRegistry())
    lora = {"adapters": {}, "allow_runtime_updates": True}
    engine = AsyncEngine(tiny_engine_config(tiny_model_dir, num_threads=1, lora=lora))
    config = ServeConfig(model=str(tiny_model_dir), served_model_name=MODEL, engine={"lora": lora},
                         ingress={"num_replicas": 2})
    servers = [local_server(engine, config, MODEL) for _ in range(2)]
    for server in servers:
        server.adapter_sync = AdapterSync(registry, server.runtime_adapters, interval_s=60.0)
    apps = [server.build_app() for server in servers]
    body = {"model": "late", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    try:
        async with client(apps[0], None) as a, client(apps[1], None) as b:
            loaded = await a.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(tmp_path / "late")})
            assert loaded.status_code == 200, loaded.text
            assert servers[1].runtime_adapters == {}  # not refreshed yet...
            answer = await b.post("/v1/completions", json=body)  # ...until a request names it
            assert answer.status_code == 200, answer.text
            assert [m["id"] for m in (await b.get("/v1/models")).json()["data"]] == [MODEL, "late"]
            again = await b.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": "/elsewhere"})
            assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
            assert (await b.post("/v1/unload_lora_adapter", json={"lora_name": "late"})).status_code == 200
            assert "late" in servers[0].runtime_adapters  # a's copy, until its next refresh
            assert await servers[0].adapter_sync.refresh()
            assert (await a.post("/v1/completions", json=body)).status_code == 404
    finally:
        engine.shutdown()


def test_pools_that_disagree_on_adapters_are_refused_naming_both(tiny_model_dir):
    """A decode pool must continue a prefill pool's KV with the same adapter."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="prefill.engine.lora = .*but decode.engine.lora = None"):
        ServeConfig(model=str(tiny_model_dir), prefill={"engine": {"lora": {"adapters": {"a": "/x"}}}})


async def test_an_adapter_of_the_serve_config_is_not_unloaded_at_run_time(served, tiny_model_dir):
    _, _, path = served
    lora = {"adapters": {"sql": path}, "allow_runtime_updates": True}
    engine = AsyncEngine(tiny_engine_config(tiny_model_dir, num_threads=1, lora=lora))
    config = ServeConfig(model=str(tiny_model_dir), served_model_name=MODEL, engine={"lora": lora})
    app = local_app(engine, config, MODEL)
    try:
        async with client(app, None) as c:
            response = await c.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
            assert (response.status_code, response.json()["error"]["param"]) == (400, "lora_name")
            assert "listed in engine.lora.adapters" in response.json()["error"]["message"]
            assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == [MODEL, "sql"]
    finally:
        engine.shutdown()


def test_adapter_paths_are_spelled_alike_everywhere_and_names_are_checked(tiny_model_dir):
    """The ingress and the engines hash an adapter's blocks with its path: "/a/b/" is "/a/b"."""
    from pydantic import ValidationError

    config = ServeConfig(model=str(tiny_model_dir), engine={"lora": {"adapters": {"sql": "/adapters//sql/"}}})
    assert config.lora.adapters == {"sql": "/adapters/sql"}
    for bad in ("", "base:sql"):
        with pytest.raises(ValidationError, match="must be non-empty and hold no ':'"):
            ServeConfig(model=str(tiny_model_dir), engine={"lora": {"adapters": {bad: "/adapters/sql"}}})
