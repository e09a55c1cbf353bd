"""POST /tokenize and /detokenize (serving/api/endpoints/tokenize.py) in vLLM's shapes, with the
completion routes' auth, tier model allow-list, body limit and error shapes; and /v1/models'
max_model_len."""

from __future__ import annotations

import time

import httpx
import pytest

from serving.api.endpoints.routes import OpenAIServer
from serving.config import ServeConfig
from tests.asgi import local_server, post

MODEL = "tiny"
FOX = "The quick brown fox"
FOX_IDS = [504, 2365, 6354, 16438]
HI = [{"role": "user", "content": "Hi"}]
GOLD, FREE = "sk-gold-0123456789ab", "sk-free-0123456789ab"


def build(engine, tiny_model_dir, **config) -> OpenAIServer:
    cfg = ServeConfig(model=str(tiny_model_dir), served_model_name=MODEL, **config)
    return local_server(engine, cfg, MODEL)


@pytest.fixture(scope="module")
def app(engine, tiny_model_dir):
    return build(engine, tiny_model_dir).build_app()


def error(message: str, param: str | None, code: str, type: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@pytest.mark.asyncio
async def test_tokenize_a_prompt(app, engine):
    plain = await post(app, "/tokenize", {"model": MODEL, "prompt": FOX})
    with_strs = await post(app, "/tokenize", {"prompt": FOX, "return_token_strs": True, "add_special_tokens": False})

    max_model_len = engine.engine.max_model_len
    assert plain.status_code == 200
    assert plain.json() == {"count": 4, "max_model_len": max_model_len, "tokens": FOX_IDS, "token_strs": None}
    assert with_strs.json() == {"count": 4, "max_model_len": max_model_len, "tokens": FOX_IDS,
                                "token_strs": ["The", "Ġquick", "Ġbrown", "Ġfox"]}


@pytest.mark.asyncio
async def test_tokenize_chat_messages_as_a_chat_completion_renders_them(app, engine):
    tokenizer = engine.tokenizer
    text = tokenizer.apply_chat_template(HI, add_generation_prompt=True, tokenize=False)
    expected = tokenizer(text, add_special_tokens=False).input_ids
    without_prompt = tokenizer(tokenizer.apply_chat_template(HI, add_generation_prompt=False, tokenize=False), add_special_tokens=False).input_ids

    response = await post(app, "/tokenize", {"model": MODEL, "messages": HI})
    bare = await post(app, "/tokenize", {"messages": HI, "add_generation_prompt": False})
    chat = await post(app, "/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 1})

    assert response.json()["tokens"] == expected and response.json()["count"] == len(expected)
    assert response.json()["count"] == chat.json()["usage"]["prompt_tokens"]
    assert bare.json()["tokens"] == without_prompt and len(without_prompt) < len(expected)


@pytest.mark.asyncio
async def test_detokenize(app):
    response = await post(app, "/detokenize", {"model": MODEL, "tokens": FOX_IDS})

    assert response.status_code == 200 and response.json() == {"prompt": FOX}
    assert (await post(app, "/detokenize", {"tokens": []})).json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("path", "body", "expected"),
    [
        ("/detokenize", {"tokens": [504, 49152]}, error("tokens: tokens[1] = 49152 is not in the vocabulary (0..49151)", "tokens", "invalid_value")),
        ("/detokenize", {"tokens": [-1]}, error("tokens: tokens[0] = -1 is not in the vocabulary (0..49151)", "tokens", "invalid_value")),
        ("/detokenize", {"tokens": ["a"]},
         error("tokens[0]: Input should be a valid integer, unable to parse string as an integer (got 'a')", "tokens[0]", "invalid_value")),
        ("/detokenize", {}, error("tokens: Field required", "tokens", "invalid_value")),
        ("/tokenize", {}, error("prompt: Field required", "prompt", "invalid_value")),
        ("/tokenize", {"prompt": 5}, error("prompt: Input should be a valid string (got 5)", "prompt", "invalid_value")),
        ("/tokenize", {"messages": []}, error("messages: List should have at least 1 item after validation, not 0", "messages", "invalid_value")),
        ("/tokenize", {"messages": HI, "chat_template_kwargs": {"tokenize": True}},
         error("chat_template_kwargs.tokenize: is not a template variable this server accepts (accepted: enable_thinking, "
               "reasoning_effort, thinking)", "chat_template_kwargs.tokenize", "invalid_value")),
        ("/tokenize", {"model": "gpt-4", "prompt": FOX}, error("The model 'gpt-4' does not exist. Available models: tiny.", "model", "model_not_found")),
        ("/detokenize", {"model": "gpt-4", "tokens": [1]}, error("The model 'gpt-4' does not exist. Available models: tiny.", "model", "model_not_found")),
    ],
)
@pytest.mark.asyncio
async def test_bad_bodies_are_4xx_naming_the_field(app, path, body, expected):
    response = await post(app, path, body)

    assert response.status_code == (404 if expected["error"]["code"] == "model_not_found" else 400)
    assert response.json() == expected


@pytest.mark.asyncio
async def test_malformed_and_oversized_bodies(engine, tiny_model_dir):
    app = build(engine, tiny_model_dir, max_request_body_bytes=1024).build_app()

    malformed = await post(app, "/tokenize", b"{not json")
    oversized = await post(app, "/tokenize", {"prompt": "x" * 2000})

    assert malformed.status_code == 422 and malformed.json()["error"]["code"] == "invalid_json"
    assert oversized.status_code == 413
    assert oversized.json() == error(f"The request body has {len(oversized.request.content)} bytes; the limit is 1024.", None, "request_too_large")


@pytest.mark.asyncio
async def test_keys_and_their_tiers_models_apply(engine, tiny_model_dir):
    app = build(
        engine, tiny_model_dir, tiers={"free": {"models": ["another"]}, "gold": {}},
        api_keys=[{"key": GOLD, "name": "gold-team", "tier": "gold"}, {"key": FREE, "name": "free-team", "tier": "free"}],
    ).build_app()

    missing = await post(app, "/tokenize", {"prompt": FOX})
    wrong = await post(app, "/detokenize", {"tokens": FOX_IDS}, key="sk-wrong")
    outside_tier = await post(app, "/tokenize", {"prompt": FOX}, key=FREE)
    allowed = await post(app, "/detokenize", {"tokens": FOX_IDS}, key=GOLD)

    assert missing.status_code == wrong.status_code == 401
    assert missing.json() == error("Missing API key: send 'Authorization: Bearer <key>'.", None, "invalid_api_key")
    assert wrong.json() == error("Incorrect API key provided.", None, "invalid_api_key")
    assert outside_tier.status_code == 404
    assert outside_tier.json() == error("The model 'tiny' does not exist or you do not have access to it.", "model", "model_not_found")
    assert allowed.status_code == 200 and allowed.json() == {"prompt": FOX}


@pytest.mark.asyncio
async def test_a_chat_that_renders_too_long_is_refused_like_a_chat_completion(engine, tiny_model_dir, monkeypatch):
    srv = build(engine, tiny_model_dir, api={"render_timeout_s": 0.05})
    monkeypatch.setattr(srv.frontend, "encode_chat", lambda *args, **kwargs: time.sleep(1) or [1])

    response = await post(srv.build_app(), "/tokenize", {"messages": HI})

    assert response.status_code == 400
    assert response.json() == error(
        "messages: rendering the prompt took longer than the server's limit of 0.05 s; shorten it", "messages", "render_timeout",
    )


@pytest.mark.asyncio
async def test_models_carry_max_model_len(app, engine):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        listed = (await c.get("/v1/models")).json()["data"]
        card = (await c.get(f"/v1/models/{MODEL}")).json()

    assert [m["max_model_len"] for m in listed] == [card["max_model_len"]] == [engine.engine.max_model_len]
