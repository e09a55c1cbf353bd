"""Chat templates from requests, over HTTP (serving/api/generation/chat_template.py): a request's own template is
refused unless the operator allows it, only allow-listed scalar template variables pass, and a
template renders in a thread with a time limit while the event loop serves everyone else.

    httpx ──ASGI──▶ OpenAIServer ──▶ Frontend (the tiny model's tokenizer, or a stub of it that
                                      blocks) ──▶ LocalBackend ──▶ AsyncEngine
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from serving.api.endpoints.routes import OpenAIServer
from serving.api.generation.pipeline import Frontend
from serving.config import APIConfig, ServeConfig
from serving.deployments.local_backend import LocalBackend
from tests.asgi import post
from tests.helpers import tiny_async_engine

MODEL = "tiny"
HELLO = [{"role": "user", "content": "Hello there"}]
CHAT = {"model": MODEL, "messages": HELLO, "temperature": 0, "max_tokens": 4}
BLOCK = [{"role": "user", "content": "BLOCK"}]


class _BlockingTemplate:
    """The tiny model's tokenizer, except that rendering a conversation that says BLOCK waits for
    `release` in a Python loop (as a template's own loops would run), noting whether it was
    interrupted. Its wait ends by itself after a minute, so code that renders on the event loop
    fails its test instead of hanging it."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.entered = threading.Event()
        self.release = threading.Event()
        self.interrupted = threading.Event()

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __call__(self, *args, **kwargs):
        return self.tokenizer(*args, **kwargs)

    def apply_chat_template(self, conversation, **kwargs):
        if any(m["content"] == "BLOCK" for m in conversation):
            self.entered.set()
            give_up = time.monotonic() + 60
            try:
                while not self.release.is_set() and time.monotonic() < give_up:
                    time.sleep(0.001)
            except BaseException:
                self.interrupted.set()
                raise
        return self.tokenizer.apply_chat_template(conversation, **kwargs)


class Stack:
    def __init__(self, tiny_model_dir):
        self.engine = tiny_async_engine(tiny_model_dir, max_model_len=512)
        self.tokenizer = self.engine.tokenizer
        self.backend = LocalBackend(self.engine)
        self.config = ServeConfig(model=str(tiny_model_dir), served_model_name=MODEL)
        self.app = self.app_with()

    def app_with(self, tokenizer=None, **api):
        frontend = Frontend(tokenizer or self.tokenizer, self.backend, MODEL)
        return OpenAIServer(frontend, self.config.model_copy(update={"api": APIConfig(**api)})).build_app()


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    stack = Stack(tiny_model_dir)
    yield stack
    stack.engine.shutdown()


def error_body(message: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}


def chat_ids(stack: Stack, messages: list[dict]) -> list[int]:
    text = stack.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return stack.tokenizer(text, add_special_tokens=False).input_ids


# ---- what a request may pass ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message", "param"),
    [
        ({"chat_template": "{{ 'x' * 10 }}"},
         "chat_template_kwargs.chat_template: this server does not render chat templates sent in requests; it uses the model's own",
         "chat_template_kwargs.chat_template"),
        ({"tokenize": True},
         "chat_template_kwargs.tokenize: is not a template variable this server accepts (accepted: enable_thinking, reasoning_effort, thinking)",
         "chat_template_kwargs.tokenize"),
        ({"enable_thinking": True, "messages": []},
         "chat_template_kwargs.messages: is not a template variable this server accepts (accepted: enable_thinking, reasoning_effort, thinking)",
         "chat_template_kwargs.messages"),
        ({"enable_thinking": {"nested": [1, 2]}},
         "chat_template_kwargs.enable_thinking: must be a string, number, boolean or null, got dict",
         "chat_template_kwargs.enable_thinking"),
        ({"reasoning_effort": "x" * 257},
         "chat_template_kwargs.reasoning_effort: at most 256 characters, got 257",
         "chat_template_kwargs.reasoning_effort"),
    ],
)
@pytest.mark.asyncio
async def test_template_kwargs_outside_the_allow_list_are_400s_naming_the_key(stack, kwargs, message, param):
    response = await post(stack.app, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": kwargs})

    assert response.status_code == 400
    assert response.json() == error_body(message, param, "invalid_value")


@pytest.mark.asyncio
async def test_allowed_scalar_template_variables_render(stack):
    plain = await post(stack.app, "/v1/chat/completions", CHAT)
    with_kwargs = await post(stack.app, "/v1/chat/completions", {
        **CHAT, "chat_template_kwargs": {"enable_thinking": False, "reasoning_effort": "x" * 256, "thinking": None},
    })

    assert plain.status_code == with_kwargs.status_code == 200
    assert with_kwargs.json()["usage"] == plain.json()["usage"]  # the tiny model's template ignores them
    assert with_kwargs.json()["usage"]["prompt_tokens"] == len(chat_ids(stack, HELLO))


@pytest.mark.asyncio
async def test_the_operator_can_allow_a_requests_own_template_and_the_allow_list_is_config(stack):
    app = stack.app_with(allow_request_chat_template=True, chat_template_kwargs=["style"])
    template = "{% for m in messages %}<<{{ style }}:{{ m['content'] }}>>{% endfor %}"

    own = await post(app, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"chat_template": template, "style": "terse"}})
    unlisted = await post(app, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"enable_thinking": True}})

    assert own.status_code == 200
    assert own.json()["usage"]["prompt_tokens"] == len(stack.tokenizer("<<terse:Hello there>>", add_special_tokens=False).input_ids)
    assert unlisted.status_code == 400
    assert unlisted.json() == error_body(
        "chat_template_kwargs.enable_thinking: is not a template variable this server accepts (accepted: style)",
        "chat_template_kwargs.enable_thinking", "invalid_value",
    )


# ---- off the event loop, with a time limit -------------------------------------------------------
@pytest.mark.asyncio
async def test_a_slow_template_does_not_hold_up_other_requests(stack):
    tokenizer = _BlockingTemplate(stack.tokenizer)
    app = stack.app_with(tokenizer, render_timeout_s=600)

    blocked = asyncio.create_task(post(app, "/v1/chat/completions", {**CHAT, "messages": BLOCK}))
    assert await asyncio.to_thread(tokenizer.entered.wait, 60)
    other = await post(app, "/v1/chat/completions", CHAT)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        health = await c.get("/health")
    was_still_rendering = not blocked.done()
    tokenizer.release.set()
    response = await blocked

    assert was_still_rendering
    assert other.status_code == health.status_code == response.status_code == 200
    assert response.json()["usage"]["prompt_tokens"] == len(chat_ids(stack, BLOCK))
    assert not tokenizer.interrupted.is_set()


@pytest.mark.asyncio
async def test_a_template_past_the_time_limit_is_a_400_and_is_interrupted(stack):
    tokenizer = _BlockingTemplate(stack.tokenizer)
    app = stack.app_with(tokenizer, render_timeout_s=0.05)

    response = await post(app, "/v1/chat/completions", {**CHAT, "messages": BLOCK})
    interrupted = await asyncio.to_thread(tokenizer.interrupted.wait, 60)
    after = await post(app, "/v1/chat/completions", CHAT)

    assert response.status_code == 400
    assert response.json() == error_body(
        "messages: rendering the prompt took longer than the server's limit of 0.05 s; shorten it", "messages", "render_timeout",
    )
    assert interrupted and not tokenizer.release.is_set()  # stopped, not finished
    assert after.status_code == 200


@pytest.mark.asyncio
async def test_a_requests_own_template_past_the_limit_is_named(stack):
    app = stack.app_with(allow_request_chat_template=True, render_timeout_s=0.05)
    endless = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"

    response = await post(app, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"chat_template": endless}})
    renders = [t for t in threading.enumerate() if t.name == "kvrelay-render"]
    for thread in renders:
        await asyncio.to_thread(thread.join, 60)

    assert renders and not any(t.is_alive() for t in renders)  # Jinja's loops were interrupted
    assert response.status_code == 400
    assert response.json() == error_body(
        "chat_template_kwargs.chat_template: rendering the prompt took longer than the server's limit of 0.05 s; shorten it",
        "chat_template_kwargs.chat_template", "render_timeout",
    )
