"""What one request may ask for, over HTTP (serving/api/admission/limits.py): prompts, n, logprobs, logit_bias,
stop strings and ids, the default max_tokens and the request's total, each refused with a 400 that
names the field and the limit; each limit is the config's (`api:`).

    httpx ──ASGI──▶ OpenAIServer ──▶ Frontend ──▶ LocalBackend ──▶ AsyncEngine (tiny model)
"""

from __future__ import annotations

import pytest

from serving.api.endpoints.routes import OpenAIServer
from serving.api.generation.pipeline import Frontend
from serving.config import APIConfig, ServeConfig
from serving.deployments.local_backend import LocalBackend
from tests.asgi import post
from tests.helpers import tiny_async_engine

MODEL = "tiny"
MAX_MODEL_LEN = 256
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "temperature": 0, "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": [1, 2, 3], "temperature": 0, "max_tokens": 2}


class Stack:
    def __init__(self, tiny_model_dir):
        self.engine = tiny_async_engine(tiny_model_dir, max_model_len=MAX_MODEL_LEN)
        self.tokenizer = self.engine.tokenizer
        self.config = ServeConfig(model=str(tiny_model_dir), served_model_name=MODEL)
        self.frontend = Frontend(self.tokenizer, LocalBackend(self.engine), MODEL)
        self.app = self.app_with()

    def app_with(self, **api):
        return OpenAIServer(self.frontend, self.config.model_copy(update={"api": APIConfig(**api)})).build_app()


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    stack = Stack(tiny_model_dir)
    yield stack
    stack.engine.shutdown()


def invalid(message: str, param: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": "invalid_value"}}


# ---- the defaults ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "body", "message", "param"),
    [
        ("/v1/completions", {**COMPLETION, "prompt": [[5]] * 65}, "prompt: at most 64 prompts per request, got 65", "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": ["a"] * 65}, "prompt: at most 64 prompts per request, got 65", "prompt"),
        ("/v1/completions", {**COMPLETION, "n": 17}, "n: at most 16 choices per prompt, got 17", "n"),
        ("/v1/chat/completions", {**CHAT, "n": 128}, "n: at most 16 choices per prompt, got 128", "n"),
        ("/v1/chat/completions", {**CHAT, "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias: at most 1024 entries, got 1025", "logit_bias"),
        ("/v1/completions", {**COMPLETION, "stop": ["a", "b" * 257]}, "stop: stop[1] has 257 characters; the limit is 256", "stop"),
        ("/v1/chat/completions", {**CHAT, "stop": "s" * 300}, "stop: the stop string has 300 characters; the limit is 256", "stop"),
        ("/v1/chat/completions", {**CHAT, "stop": [str(i) for i in range(17)]}, "stop: at most 16 stop strings, got 17", "stop"),
        ("/v1/chat/completions", {**CHAT, "stop_token_ids": list(range(65))}, "stop_token_ids: at most 64 token ids, got 65", "stop_token_ids"),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs: must be in [0, 20], got 21", "top_logprobs"),
        ("/v1/completions", {**COMPLETION, "logprobs": 21}, "logprobs: must be <= 20, got 21", "logprobs"),
    ],
)
@pytest.mark.asyncio
async def test_default_limits_are_400s_naming_the_field_and_the_limit(stack, path, body, message, param):
    response = await post(stack.app, path, body)

    assert response.status_code == 400
    assert response.json() == invalid(message, param)


@pytest.mark.asyncio
async def test_requests_at_the_default_limits_are_served(stack):
    response = await post(stack.app, "/v1/completions", {
        **COMPLETION, "prompt": [[5]] * 4, "n": 16, "max_tokens": 1, "stop": ["x" * 256] * 16, "stop_token_ids": list(range(64)),
        "logit_bias": {str(i): 0.5 for i in range(1024)}, "logprobs": 20,
    })

    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 64 and response.json()["usage"]["completion_tokens"] == 64


# ---- each limit is the config's ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("api", "path", "body", "message", "param"),
    [
        ({"max_prompts_per_request": 2}, "/v1/completions", {**COMPLETION, "prompt": ["a", "b", "c"]},
         "prompt: at most 2 prompts per request, got 3", "prompt"),
        ({"max_n": 2}, "/v1/chat/completions", {**CHAT, "n": 3}, "n: at most 2 choices per prompt, got 3", "n"),
        ({"max_logprobs": 5}, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 6},
         "top_logprobs: must be in [0, 5], got 6", "top_logprobs"),
        ({"max_logprobs": 5}, "/v1/completions", {**COMPLETION, "logprobs": 6}, "logprobs: must be <= 5, got 6", "logprobs"),
        ({"max_logprobs": 5}, "/v1/chat/completions", {**CHAT, "prompt_logprobs": 6}, "prompt_logprobs: must be <= 5, got 6", "prompt_logprobs"),
        ({"max_logit_bias_entries": 1}, "/v1/completions", {**COMPLETION, "logit_bias": {"1": 1, "2": 1}},
         "logit_bias: at most 1 entries, got 2", "logit_bias"),
        ({"max_stop_strings": 2}, "/v1/completions", {**COMPLETION, "stop": ["a", "b", "c"]}, "stop: at most 2 stop strings, got 3", "stop"),
        ({"max_stop_string_chars": 3}, "/v1/completions", {**COMPLETION, "stop": "abcd"}, "stop: the stop string has 4 characters; the limit is 3", "stop"),
        ({"max_stop_token_ids": 1}, "/v1/completions", {**COMPLETION, "stop_token_ids": [1, 2]},
         "stop_token_ids: at most 1 token ids, got 2", "stop_token_ids"),
        ({"max_output_tokens_per_request": 300}, "/v1/completions", {**COMPLETION, "prompt": [[5], [6], [7], [8]], "n": 2, "max_tokens": 40},
         "max_tokens: 4 prompt(s) x n 2 x max_tokens 40 = 320 tokens to generate, over the limit of 300 per request; lower max_tokens or n", "max_tokens"),
        ({"max_output_tokens_per_request": 100}, "/v1/chat/completions", {**CHAT, "n": 2, "max_tokens": 1, "max_completion_tokens": 51},
         "max_completion_tokens: 1 prompt(s) x n 2 x max_tokens 51 = 102 tokens to generate, over the limit of 100 per request; "
         "lower max_tokens or n", "max_completion_tokens"),
        ({"max_output_tokens_per_request": 100, "default_max_tokens": 60}, "/v1/chat/completions", {**CHAT, "n": 2, "max_tokens": None},
         "max_tokens: 1 prompt(s) x n 2 x max_tokens 60 = 120 tokens to generate, over the limit of 100 per request; lower max_tokens or n", "max_tokens"),
    ],
)
@pytest.mark.asyncio
async def test_each_limit_is_a_config_value(stack, api, path, body, message, param):
    response = await post(stack.app_with(**api), path, body)

    assert response.status_code == 400
    assert response.json() == invalid(message, param)


@pytest.mark.asyncio
async def test_the_total_counts_the_room_left_when_it_is_below_the_default_max_tokens(stack):
    app = stack.app_with(max_output_tokens_per_request=2 * (MAX_MODEL_LEN - 250) + 1)

    response = await post(app, "/v1/completions", {**COMPLETION, "prompt": [[5] * 250, [6] * 250], "max_tokens": None, "ignore_eos": True})

    assert response.status_code == 200, response.text
    assert [c["finish_reason"] for c in response.json()["choices"]] == ["length", "length"]
    assert response.json()["usage"]["completion_tokens"] == 2 * (MAX_MODEL_LEN - 250)


# ---- max_tokens left out -----------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_chat_without_max_tokens_generates_at_most_default_max_tokens(stack):
    app = stack.app_with(default_max_tokens=5)

    response = await post(app, "/v1/chat/completions", {**CHAT, "max_tokens": None, "ignore_eos": True})
    completion = await post(app, "/v1/completions", {**COMPLETION, "max_tokens": None, "ignore_eos": True})

    assert response.status_code == completion.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == completion.json()["usage"]["completion_tokens"] == 5
    assert response.json()["choices"][0]["finish_reason"] == completion.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.asyncio
async def test_without_a_default_a_request_may_fill_the_context_window(stack):
    app = stack.app_with(default_max_tokens=None)
    prompt = [5] * (MAX_MODEL_LEN - 7)

    response = await post(app, "/v1/completions", {**COMPLETION, "prompt": prompt, "max_tokens": None, "ignore_eos": True})

    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 7
