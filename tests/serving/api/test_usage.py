"""Usage and cost: the pricing file, each response's cost, and the per-key totals of /v1/usage.

    httpx ─ASGI─▶ OpenAIServer (pricing, api keys) ─▶ Frontend ─▶ LocalBackend ─▶ AsyncEngine

Prompts are token ids and EOS is ignored, so every request has an exact number of tokens and
every cost below is written out by hand: 0.15 per million input tokens, 0.60 per million output.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from decimal import Decimal

import httpx
import pytest

from serving.api.admission.keys import KeyRing
from serving.api.endpoints.routes import OpenAIServer
from serving.api.errors import NoWorkerError
from serving.api.generation.pipeline import Frontend, Usage
from serving.api.protocol.wire import ChatMessage
from serving.api.usage import (
    ModelPrice,
    RequestAccount,
    UsageLedger,
    format_cost,
    load_pricing,
    request_cost,
)
from serving.config import ConfigError, ServeConfig, load_config
from serving.deployments.local_backend import LocalBackend
from serving.engine import EngineDeadError
from tests.asgi import local_server, sse_events
from tests.helpers import single_tokens

MODEL = "tiny"
PRICE = ModelPrice(input_per_million=Decimal("0.15"), output_per_million=Decimal("0.60"))
PRICING_YAML = f"models:\n  {MODEL}:\n    input_per_million: 0.15\n    output_per_million: 0.60\n    currency: USD\n"
TEN = list(range(100, 110))  # a prompt of exactly 10 tokens
# 10 prompt tokens and 4 completion tokens: 10 × 0.15 / 1e6 + 4 × 0.60 / 1e6 = 0.0000039
REQUEST = {"model": MODEL, "prompt": TEN, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
ALICE, BOB, ADMIN = "sk-alice-0123456789", "sk-bob-9876543210ab", "sk-admin-00000000001"


def server(engine, tiny_model_dir, price: ModelPrice | None = PRICE, **config) -> OpenAIServer:
    cfg = ServeConfig(model=str(tiny_model_dir), served_model_name=MODEL, **config)
    return local_server(engine, cfg, MODEL, price)


async def call(app, method: str, path: str, body: dict | None = None, key: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        return await client.request(method, path, json=body, headers=headers)


def sse(response: httpx.Response) -> list:
    """The stream's JSON events, without the closing [DONE]."""
    return [event for event in sse_events(response) if event != "[DONE]"]


# ---- the pricing file and the formula --------------------------------------------------------
def test_the_cost_is_exact_decimal_arithmetic():
    assert request_cost(PRICE, 10, 4) == Decimal("0.0000039")
    assert request_cost(PRICE, 1_000_000, 1_000_000) == Decimal("0.75")
    assert request_cost(PRICE, 0, 0) == 0
    assert [format_cost(c) for c in (Decimal("0.0000039"), Decimal("12.50"), Decimal("0E-7"), Decimal(3))] == ["0.0000039", "12.5", "0", "3"]


def test_the_sample_pricing_file_prices_the_default_model():
    price = load_pricing("deploy/pricing.yaml").price_for("smollm2-135m-instruct")
    assert price == ModelPrice(input_per_million=Decimal("0.05"), output_per_million=Decimal("0.20"), currency="USD")


@pytest.mark.parametrize("text, message", [
    ("models:\n  tiny: {input_per_million: 1, output_per_million: 2, discount: 3}\n",
     "{path}: invalid configuration\n  models.tiny.discount = 3: unknown key; remove it or fix its spelling"),
    ("models:\n  tiny: {input_per_million: -1, output_per_million: 2}\n",
     "{path}: invalid configuration\n  models.tiny.input_per_million = -1: Input should be greater than or equal to 0"),
    ("models:\n  tiny: {input_per_million: 1, output_per_million: 2, currency: usd}\n",
     "{path}: invalid configuration\n  models.tiny.currency = 'usd': String should match pattern '^[A-Z]{{3}}$'"),
    ("models:\n  tiny: {input_per_million: 1}\n",
     "{path}: invalid configuration\n  models.tiny.output_per_million: Field required"),
    ("models: {}\n", "{path}: invalid configuration\n  models: Dictionary should have at least 1 item after validation, not 0"),
    ("- tiny\n", "{path}: the top level must be a mapping with `models:`, got list"),
])
def test_a_bad_pricing_file_names_the_file_the_field_and_the_value(tmp_path, text, message):
    path = tmp_path / "pricing.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_pricing(path)
    assert str(info.value) == message.format(path=path)


def test_a_pricing_file_without_the_served_model_is_refused(tmp_path, engine, tiny_model_dir):
    path = tmp_path / "pricing.yaml"
    path.write_text("models:\n  b: {input_per_million: 1, output_per_million: 2}\n  a: {input_per_million: 1, output_per_million: 2}\n")
    with pytest.raises(ConfigError) as info:
        server(engine, tiny_model_dir, price=None, pricing=str(path))
    assert str(info.value) == f"{path}: no price for the served model 'tiny' (the file prices a, b); add it under `models:`"
    with pytest.raises(ConfigError, match="cannot read the pricing file"):
        load_pricing(tmp_path / "missing.yaml")


def test_the_config_names_the_pricing_file_relative_to_itself_and_takes_admin_keys_from_env(tmp_path):
    (tmp_path / "c.yaml").write_text("pricing: prices/p.yaml\n")
    config = load_config(tmp_path / "c.yaml", env={"KVRELAY_ADMIN_API_KEYS": "a1, a2", "KVRELAY_API_KEYS": "k1"})
    assert config.pricing == str(tmp_path / "prices/p.yaml")
    ring = KeyRing(config.keys)
    assert [(ring.check(k).hint, ring.check(k).is_admin) for k in ("a1", "a2", "k1")] == [("...", True), ("...", True), ("...", False)]
    with pytest.raises(ConfigError, match=r"admin_api_keys\[1\] is empty"):
        load_config(env={"KVRELAY_ADMIN_API_KEYS": "[a, '']"})


def test_build_app_reads_the_pricing_file_and_hands_the_ingress_its_prices(tmp_path):
    from serving.deployments.app import build_app

    path = tmp_path / "pricing.yaml"
    path.write_text(PRICING_YAML)
    app = build_app(ServeConfig(served_model_name=MODEL, pricing=str(path)))
    assert app._bound_deployment.init_kwargs["price"] == {"input_per_million": "0.15", "output_per_million": "0.6", "currency": "USD"}
    path.write_text("models: {other: {input_per_million: 1, output_per_million: 1}}\n")
    with pytest.raises(ConfigError, match="no price for the served model 'tiny'"):
        build_app(ServeConfig(served_model_name=MODEL, pricing=str(path)))


def test_an_account_bills_once_and_the_ledger_adds_up():
    ledger = UsageLedger()
    usage = Usage(prompt_tokens=10, completion_tokens=4, cached_tokens=3)
    account = RequestAccount(ledger, "k", PRICE)
    assert account.settle() is None and account.headers() == {}  # nothing tracked: nothing billed
    account.track(lambda: usage)
    first = account.settle()
    assert first == {
        "prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14, "prompt_tokens_details": {"cached_tokens": 3},
        "cost": 3.9e-06, "currency": "USD",
    }
    assert account.settle() == first and ledger.totals("k").num_requests == 1
    assert account.headers() == {"x-kvrelay-cost": "0.0000039", "x-kvrelay-cost-currency": "USD"}
    RequestAccount(ledger, "k", PRICE).track(lambda: usage)  # tracked but never settled: not billed
    totals = ledger.totals("k")
    assert (totals.num_requests, totals.prompt_tokens, totals.completion_tokens, totals.cached_tokens, totals.cost) == (1, 10, 4, 3, Decimal("0.0000039"))


# ---- responses -------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_response_carries_its_cost_in_the_header_and_in_usage(engine, tiny_model_dir):
    app = server(engine, tiny_model_dir).build_app()
    response = await call(app, "POST", "/v1/completions", REQUEST)
    assert response.status_code == 200, response.text
    assert response.headers["x-kvrelay-cost"] == "0.0000039"
    assert response.headers["x-kvrelay-cost-currency"] == "USD"
    assert response.json()["usage"] == {
        "prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14, "prompt_tokens_details": {"cached_tokens": 0},
        "cost": 3.9e-06, "currency": "USD",
    }


@pytest.mark.asyncio
async def test_a_chat_completion_is_priced_on_its_templated_prompt(engine, tiny_model_dir):
    app = server(engine, tiny_model_dir).build_app()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    response = await call(app, "POST", "/v1/chat/completions", body)
    usage = response.json()["usage"]
    expected = (usage["prompt_tokens"] * Decimal("0.15") + 4 * Decimal("0.60")) / 10**6
    assert usage["completion_tokens"] == 4 and usage["prompt_tokens"] > 4
    assert response.headers["x-kvrelay-cost"] == format_cost(expected)
    assert usage["cost"] == float(expected)


@pytest.mark.asyncio
async def test_two_prompts_are_one_request_priced_on_both(engine, tiny_model_dir):
    app = server(engine, tiny_model_dir).build_app()
    response = await call(app, "POST", "/v1/completions", {**REQUEST, "prompt": [TEN, TEN[:6]]})
    # 16 prompt tokens, 8 completion tokens: 16 × 0.15 / 1e6 + 8 × 0.60 / 1e6 = 0.0000072
    assert response.headers["x-kvrelay-cost"] == "0.0000072"
    assert response.json()["usage"]["cost"] == 7.2e-06


@pytest.mark.asyncio
async def test_a_stream_has_its_cost_in_the_final_usage_chunk_not_in_a_header(engine, tiny_model_dir):
    app = server(engine, tiny_model_dir).build_app()
    response = await call(app, "POST", "/v1/completions", {**REQUEST, "stream": True, "stream_options": {"include_usage": True}})
    assert response.status_code == 200
    assert "x-kvrelay-cost" not in response.headers
    chunks = sse(response)
    assert [c["usage"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["usage"]["cost"] == 3.9e-06 and chunks[-1]["usage"]["currency"] == "USD"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    last = sse(await call(app, "POST", "/v1/chat/completions", chat))[-1]
    assert last["usage"]["cost"] == float((last["usage"]["prompt_tokens"] * Decimal("0.15") + 4 * Decimal("0.60")) / 10**6)


@pytest.mark.asyncio
async def test_without_pricing_usage_has_no_cost(engine, tiny_model_dir):
    app = server(engine, tiny_model_dir, price=None).build_app()
    response = await call(app, "POST", "/v1/completions", REQUEST)
    assert "x-kvrelay-cost" not in response.headers
    assert response.json()["usage"] == {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14, "prompt_tokens_details": {"cached_tokens": 0}}
    report = (await call(app, "GET", "/v1/usage")).json()
    assert report["data"] == [{
        "object": "usage.api_key", "api_key": "anonymous", "name": "anonymous", "num_model_requests": 1, "input_tokens": 10,
        "output_tokens": 4, "input_cached_tokens": 0, "total_tokens": 14, "cost": None, "currency": None,
    }]


# ---- per-key totals --------------------------------------------------------------------------
def totals(num_requests: int, prompt_tokens: int, completion_tokens: int, cost: float) -> dict:
    return {
        "num_model_requests": num_requests, "input_tokens": prompt_tokens, "output_tokens": completion_tokens,
        "input_cached_tokens": 0, "total_tokens": prompt_tokens + completion_tokens, "cost": cost, "currency": "USD",
    }


@pytest.mark.asyncio
async def test_each_key_sees_its_own_totals_and_an_admin_key_sees_all(engine, tiny_model_dir):
    app = server(engine, tiny_model_dir, api_keys=[{"key": ALICE, "name": "alice"}, {"key": BOB, "name": "bob"}],
                 admin_api_keys=[{"key": ADMIN, "name": "admin"}]).build_app()
    assert (await call(app, "POST", "/v1/completions", REQUEST, key=ALICE)).status_code == 200
    # A stream nobody asked usage of still counts, when it ends.
    assert (await call(app, "POST", "/v1/completions", {**REQUEST, "stream": True}, key=ALICE)).status_code == 200
    assert (await call(app, "POST", "/v1/completions", {**REQUEST, "prompt": TEN[:6]}, key=BOB)).status_code == 200
    # Refused requests do not count.
    assert (await call(app, "POST", "/v1/completions", {**REQUEST, "temperature": -1}, key=BOB)).status_code == 400
    assert (await call(app, "POST", "/v1/completions", {**REQUEST, "model": "other"}, key=BOB)).status_code == 404

    alice = (await call(app, "GET", "/v1/usage", key=ALICE)).json()
    # Alice: 2 × (10 in, 4 out) = 20 × 0.15 / 1e6 + 8 × 0.60 / 1e6 = 0.0000078
    assert alice == {
        "object": "list", "scope": "key",
        "data": [{"object": "usage.api_key", "api_key": "sk-...6789", "name": "alice", **totals(2, 20, 8, 7.8e-06)}],
        "total": totals(2, 20, 8, 7.8e-06),
    }
    # Bob: 6 × 0.15 / 1e6 + 4 × 0.60 / 1e6 = 0.0000033
    bob = (await call(app, "GET", "/v1/usage", key=BOB)).json()
    assert bob["data"] == [{"object": "usage.api_key", "api_key": "sk-...10ab", "name": "bob", **totals(1, 6, 4, 3.3e-06)}]

    admin = (await call(app, "GET", "/v1/usage", key=ADMIN)).json()
    assert admin["scope"] == "all"
    assert admin["data"] == [
        {"object": "usage.api_key", "api_key": "sk-...0001", "name": "admin", **totals(0, 0, 0, 0.0)},
        {"object": "usage.api_key", "api_key": "sk-...6789", "name": "alice", **totals(2, 20, 8, 7.8e-06)},
        {"object": "usage.api_key", "api_key": "sk-...10ab", "name": "bob", **totals(1, 6, 4, 3.3e-06)},
    ]
    assert admin["total"] == totals(3, 26, 12, 0.0000111)  # 26 × 0.15 + 12 × 0.60 = 11.1 per million

    # An admin key is an API key too; its requests are its own.
    assert (await call(app, "POST", "/v1/completions", REQUEST, key=ADMIN)).status_code == 200
    assert (await call(app, "GET", "/v1/usage", key=ADMIN)).json()["total"] == totals(4, 36, 16, 0.000015)


@pytest.mark.asyncio
async def test_usage_without_a_valid_key_is_a_401_in_openais_shape(engine, tiny_model_dir):
    app = server(engine, tiny_model_dir, api_keys=[ALICE]).build_app()
    missing = await call(app, "GET", "/v1/usage")
    assert missing.status_code == 401
    assert missing.json() == {"error": {
        "message": "Missing API key: send 'Authorization: Bearer <key>'.", "type": "invalid_request_error",
        "param": None, "code": "invalid_api_key",
    }}
    wrong = await call(app, "GET", "/v1/usage", key="sk-wrong")
    assert (wrong.status_code, wrong.json()["error"]["code"]) == (401, "invalid_api_key")


@pytest.mark.asyncio
async def test_without_api_keys_everything_is_anonymous(engine, tiny_model_dir):
    app = server(engine, tiny_model_dir).build_app()
    await call(app, "POST", "/v1/completions", REQUEST)
    await call(app, "POST", "/v1/completions", REQUEST, key="anything")
    report = (await call(app, "GET", "/v1/usage", key="whatever")).json()
    assert report["scope"] == "key"
    assert report["data"] == [{"object": "usage.api_key", "api_key": "anonymous", "name": "anonymous", **totals(2, 20, 8, 7.8e-06)}]


# ---- requests that end early -------------------------------------------------------------------
class _StopsAfter(LocalBackend):
    """The engine's tokens, one per output, until `count` have been delivered; then it fails
    (`fail`) or waits for a client that will leave (`reached` is set)."""

    def __init__(self, engine, count: int, fail: Exception | None = None):
        super().__init__(engine)
        self.count = count
        self.fail = fail
        self.reached = asyncio.Event()

    async def generate(self, request):
        delivered = 0
        async with aclosing(super().generate(request)) as outputs:
            async for merged in outputs:
                # An output per token: the engine merges those a busy reader has not taken yet.
                for out in single_tokens(merged):
                    if delivered == self.count:
                        break
                    yield out
                    delivered += 1
                if delivered == self.count:
                    break
        if self.fail is not None:
            raise self.fail
        self.reached.set()
        await asyncio.Event().wait()  # the client leaves while we wait


def early_server(backend, engine, tiny_model_dir) -> OpenAIServer:
    cfg = ServeConfig(model=str(tiny_model_dir), served_model_name=MODEL)
    return OpenAIServer(Frontend(engine.tokenizer, backend, MODEL), cfg, PRICE)


@pytest.mark.asyncio
async def test_a_request_that_fails_mid_generation_is_billed_for_its_tokens(engine, tiny_model_dir):
    backend = _StopsAfter(engine, 3, fail=EngineDeadError("simulated"))
    srv = early_server(backend, engine, tiny_model_dir)
    response = await call(srv.build_app(), "POST", "/v1/completions", {**REQUEST, "max_tokens": 50})
    assert response.status_code == 503
    # 10 × 0.15 / 1e6 + 3 × 0.60 / 1e6 = 0.0000033
    assert srv.usage.totals("anonymous").to_dict("USD") == totals(1, 10, 3, 3.3e-06)


@pytest.mark.asyncio
async def test_a_request_refused_before_its_first_token_is_not_billed(engine, tiny_model_dir):
    backend = _StopsAfter(engine, 0, fail=NoWorkerError("decode", "no replicas"))
    srv = early_server(backend, engine, tiny_model_dir)
    response = await call(srv.build_app(), "POST", "/v1/completions", REQUEST)
    assert response.status_code == 503
    assert srv.usage.totals("anonymous").to_dict("USD") == totals(0, 0, 0, 0.0)


@pytest.mark.asyncio
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {**REQUEST, "max_tokens": 50}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "temperature": 0, "ignore_eos": True}),
])
async def test_a_non_streamed_request_the_client_abandons_is_billed_for_its_tokens(engine, tiny_model_dir, path, body):
    backend = _StopsAfter(engine, 2)
    srv = early_server(backend, engine, tiny_model_dir)
    client = asyncio.ensure_future(call(srv.build_app(), "POST", path, body))
    await asyncio.wait_for(backend.reached.wait(), 30)
    client.cancel()  # the client goes away before the response
    with pytest.raises(asyncio.CancelledError):
        await client
    billed = srv.usage.totals("anonymous").to_dict("USD")
    prompt_tokens = 10 if path == "/v1/completions" else len(srv.frontend.encode_chat([ChatMessage(role="user", content="hi")]))
    assert (billed["num_model_requests"], billed["input_tokens"], billed["output_tokens"]) == (1, prompt_tokens, 2)
