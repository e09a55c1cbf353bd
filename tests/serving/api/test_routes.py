"""The OpenAI-compatible API over a real in-process engine: shapes, values, errors, disconnects.

    httpx / openai SDK ──ASGI──▶ OpenAIServer ──▶ Frontend ──▶ LocalBackend ──▶ AsyncEngine

The tiny model is random, so its greedy output is deterministic gibberish only the engine can
predict: every expected text, token count and logprob comes from the same engine, asked
directly (`reference`), never from the API under test. The engine runs without prefix
caching so `usage` is exact whatever ran before.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from contextlib import aclosing

import httpx
import openai
import pytest

from serving.api.endpoints.routes import OpenAIServer
from serving.api.errors import NoWorkerError
from serving.api.generation.pipeline import Frontend
from serving.config import ServeConfig
from serving.deployments.local_backend import LocalBackend
from serving.engine import SamplingParams
from serving.engine.contract import EngineRequest
from serving.engine.errors import EngineDeadError
from serving.engine.outputs import CompletionOutput, merge_outputs
from tests.asgi import post, sse_events
from tests.helpers import tiny_async_engine

MODEL = "tiny"
MAX_MODEL_LEN = 2048  # long enough that a request a client left could not have run to its end
HELLO = [{"role": "user", "content": "Hello there"}]
CHAT = {"model": MODEL, "messages": HELLO}
FOX = "The quick brown fox"

_request_ids = itertools.count()


class Stack:
    def __init__(self, tiny_model_dir):
        self.engine = tiny_async_engine(tiny_model_dir, max_model_len=MAX_MODEL_LEN)
        self.tokenizer = self.engine.tokenizer
        self.config = ServeConfig(model=str(tiny_model_dir), served_model_name=MODEL)
        self.frontend = Frontend(self.tokenizer, LocalBackend(self.engine), self.config.model_name)
        self.app = OpenAIServer(self.frontend, self.config).build_app()

    def app_with(self, **config):
        return OpenAIServer(self.frontend, ServeConfig.model_validate({**self.config.model_dump(), **config})).build_app()


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    stack = Stack(tiny_model_dir)
    yield stack
    stack.engine.shutdown()


# ---- helpers ---------------------------------------------------------------------------------
def client(app, transport=httpx.ASGITransport, **headers) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=transport(app=app), base_url="http://test", headers=headers)


def sdk(app, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://test/v1", api_key=api_key, max_retries=0,
        http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)),
    )


async def chat(app, **body) -> dict:
    response = await post(app, "/v1/chat/completions", {**CHAT, **body})
    assert response.status_code == 200, response.text
    return response.json()


async def complete(app, **body) -> dict:
    response = await post(app, "/v1/completions", {"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


sse_data = sse_events


def chat_ids(stack: Stack, messages: list[dict]) -> list[int]:
    """The prompt ids of a conversation, from the chat template directly."""
    text = stack.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return stack.tokenizer(text, add_special_tokens=False).input_ids


async def reference(stack: Stack, prompt_ids: list[int], **params) -> list[CompletionOutput]:
    """The engine's own full output per choice for these prompt ids (no ingress involved)."""
    merged = None
    async for out in stack.engine.generate(EngineRequest(
        f"reference-{next(_request_ids)}", prompt_token_ids=prompt_ids, params=SamplingParams(**params)
    )):
        merged = merge_outputs(merged, out)
    return merged.outputs


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def error_body(message: str, param: str | None, code: str | None, type: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


async def wait_until_idle(stack: Stack, num_free_blocks: int, timeout_s: float = 10.0):
    """The engine's stats once nothing runs and `num_free_blocks` are free again (or the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = stack.engine.stats()
        if (stats.num_running == 0 and stats.num_free_blocks == num_free_blocks) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.01)


class StreamingASGITransport(httpx.AsyncBaseTransport):
    """Like httpx.ASGITransport, but the body arrives as the app sends it, and closing the
    response tells the app the client went away (`http.disconnect`), as a real server does.
    (httpx.ASGITransport runs the app to the end before returning, so a client can never
    leave a stream early through it.)"""

    def __init__(self, app):
        self.app = app

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = b"".join([part async for part in request.stream])
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": request.method, "scheme": "http", "path": request.url.path,
            "raw_path": request.url.raw_path.split(b"?")[0], "query_string": request.url.query,
            "headers": [(k.lower(), v) for k, v in request.headers.raw],
            "server": ("test", 80), "client": ("127.0.0.1", 123), "root_path": "",
        }
        messages: asyncio.Queue = asyncio.Queue()
        disconnected = asyncio.Event()
        body_sent = False

        async def receive():
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def run():
            try:
                await self.app(scope, receive, messages.put)
            except Exception as exc:  # noqa: BLE001 - re-raised in the client
                await messages.put(exc)

        task = asyncio.create_task(run())
        start = await messages.get()
        if isinstance(start, Exception):
            raise start
        return httpx.Response(
            start["status"], headers=start.get("headers", []),
            stream=_AppBody(messages, disconnected, task),
        )


class _AppBody(httpx.AsyncByteStream):
    def __init__(self, messages: asyncio.Queue, disconnected: asyncio.Event, task: asyncio.Task):
        self._messages = messages
        self._disconnected = disconnected
        self._task = task

    async def __aiter__(self):
        while True:
            message = await self._messages.get()
            if isinstance(message, Exception):
                raise message
            yield message.get("body", b"")
            if not message.get("more_body", False):
                return

    async def aclose(self):
        self._disconnected.set()
        await self._task
        while not self._messages.empty():  # what the app did after the client left must not fail
            message = self._messages.get_nowait()
            if isinstance(message, Exception):
                raise message


# ---- chat, non-streaming ---------------------------------------------------------------------
@pytest.mark.asyncio
async def test_chat_completion_has_openais_shape_and_the_engines_greedy_text(stack):
    prompt_ids = chat_ids(stack, HELLO)
    [expected] = await reference(stack, prompt_ids, temperature=0.0, max_tokens=12)

    body = await chat(stack.app, temperature=0, max_tokens=12)

    assert body["id"].startswith("chatcmpl-") and len(body["id"]) > len("chatcmpl-")
    assert isinstance(body["created"], int) and abs(body["created"] - time.time()) < 60
    assert body == {
        "id": body["id"],
        "object": "chat.completion",
        "created": body["created"],
        "model": MODEL,
        "system_fingerprint": None,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": expected.text, "refusal": None},
            "logprobs": None,
            "finish_reason": "length",
        }],
        "usage": usage(len(prompt_ids), 12),
    }
    assert expected.text == stack.tokenizer.decode(expected.token_ids, skip_special_tokens=True)
    assert len(expected.text) > 12  # real text, not a run of empty tokens


@pytest.mark.asyncio
async def test_max_completion_tokens_wins_over_max_tokens(stack):
    [expected] = await reference(stack, chat_ids(stack, HELLO), temperature=0.0, max_tokens=5)

    body = await chat(stack.app, temperature=0, max_tokens=20, max_completion_tokens=5)

    assert body["choices"][0]["message"]["content"] == expected.text
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5


@pytest.mark.asyncio
async def test_a_stop_token_finishes_with_stop_and_is_not_shown(stack):
    [unstopped] = await reference(stack, chat_ids(stack, HELLO), temperature=0.0, max_tokens=12)
    stop_token = unstopped.token_ids[4]
    position = unstopped.token_ids.index(stop_token)  # its first occurrence stops it

    body = await chat(stack.app, temperature=0, max_tokens=12, stop_token_ids=[stop_token])

    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == stack.tokenizer.decode(unstopped.token_ids[:position])
    assert body["usage"]["completion_tokens"] == position + 1  # the stop token is counted


@pytest.mark.asyncio
async def test_text_parts_and_every_role_reach_the_chat_template(stack):
    conversation = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "a joke"}]},
    ]
    joined = [*conversation[:3], {"role": "user", "content": "Tell me a joke"}]
    prompt_ids = chat_ids(stack, joined)
    [expected] = await reference(stack, prompt_ids, temperature=0.0, max_tokens=8)

    body = await chat(stack.app, messages=conversation, temperature=0, max_tokens=8)

    assert body["choices"][0]["message"]["content"] == expected.text
    assert body["usage"] == usage(len(prompt_ids), 8)
    text = stack.tokenizer.decode(prompt_ids)
    assert "Answer briefly." in text and "How can I help?" in text and "Tell me a joke" in text
    assert "You are a helpful AI assistant" not in text  # our system message replaced the default


@pytest.mark.asyncio
async def test_developer_role_is_a_system_message(stack):
    as_system = await chat(stack.app, messages=[{"role": "system", "content": "Be terse."}, *HELLO], temperature=0, max_tokens=6)
    as_developer = await chat(stack.app, messages=[{"role": "developer", "content": "Be terse."}, *HELLO], temperature=0, max_tokens=6)

    assert as_developer["choices"] == as_system["choices"]
    assert as_developer["usage"] == as_system["usage"]


# ---- chat, streaming -------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_chat_stream_deltas_add_up_to_the_non_streaming_message(stack):
    whole = await chat(stack.app, temperature=0, max_tokens=12)

    response = await post(stack.app, "/v1/chat/completions", {**CHAT, "temperature": 0, "max_tokens": 12, "stream": True})

    assert response.status_code == 200
    events = sse_data(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert {c["model"] for c in chunks} == {MODEL}
    assert all(isinstance(c["created"], int) and "usage" not in c for c in chunks)
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
    content = [c["choices"][0] for c in chunks[1:]]
    assert all(set(c["delta"]) <= {"content"} and c["index"] == 0 for c in content)
    assert "".join(c["delta"].get("content", "") for c in content) == whole["choices"][0]["message"]["content"]
    assert [c["finish_reason"] for c in content] == [None] * (len(content) - 1) + ["length"]
    assert len(content) > 1  # streamed, not sent in one piece


@pytest.mark.asyncio
async def test_chat_stream_with_include_usage_ends_with_a_usage_chunk(stack):
    prompt_ids = chat_ids(stack, HELLO)

    response = await post(stack.app, "/v1/chat/completions", {
        **CHAT, "temperature": 0, "max_tokens": 7,
        "stream": True, "stream_options": {"include_usage": True},
    })

    events = sse_data(response)
    assert events[-1] == "[DONE]"
    *chunks, last = events[:-1]
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert last == {
        "id": chunks[0]["id"], "object": "chat.completion.chunk", "created": chunks[0]["created"],
        "model": MODEL, "system_fingerprint": None, "choices": [], "usage": usage(len(prompt_ids), 7),
    }


@pytest.mark.asyncio
async def test_chat_stream_with_two_choices_opens_each_with_the_role(stack):
    [one, two] = await reference(stack, chat_ids(stack, HELLO), n=2, seed=3, temperature=1.0, max_tokens=6)

    response = await post(stack.app, "/v1/chat/completions", {
        **CHAT, "n": 2, "seed": 3, "max_tokens": 6, "stream": True,
    })

    chunks = sse_data(response)[:-1]
    assert [c["choices"][0] for c in chunks[:2]] == [
        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        for i in (0, 1)
    ]
    by_index = {0: [], 1: []}
    for c in chunks[2:]:
        by_index[c["choices"][0]["index"]].append(c["choices"][0])
    for choice, expected in zip(by_index.values(), [one, two]):
        assert "".join(c["delta"].get("content", "") for c in choice) == expected.text
        assert choice[-1]["finish_reason"] == "length"


@pytest.mark.asyncio
async def test_a_streaming_request_that_fails_validation_gets_an_http_error(stack):
    response = await post(stack.app, "/v1/chat/completions", {**CHAT, "stream": True, "temperature": 5})

    assert response.status_code == 400
    assert response.json()["error"]["param"] == "temperature"


@pytest.mark.asyncio
async def test_the_openai_sdk_reads_chat_completions_and_streams(stack):
    prompt_ids = chat_ids(stack, HELLO)
    [expected] = await reference(stack, prompt_ids, temperature=0.0, max_tokens=10)

    async with sdk(stack.app) as api:
        completion = await api.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=10)
        stream = await api.chat.completions.create(
            model=MODEL, messages=HELLO, temperature=0, max_tokens=10, stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]

    assert completion.id.startswith("chatcmpl-")
    assert completion.object == "chat.completion" and completion.model == MODEL
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content == expected.text
    assert completion.choices[0].finish_reason == "length"
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens, completion.usage.total_tokens) == (
        len(prompt_ids), 10, len(prompt_ids) + 10
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-2].choices[0].finish_reason == "length"


# ---- stop strings ----------------------------------------------------------------------------
async def greedy_hello(stack: Stack, max_tokens: int = 16) -> CompletionOutput:
    [out] = await reference(stack, chat_ids(stack, HELLO), temperature=0.0, max_tokens=max_tokens)
    return out


def tokens_to_contain(stack: Stack, token_ids: list[int], text: str) -> int:
    """How many of `token_ids` the engine must generate before their text contains `text`."""
    return next(m for m in range(1, len(token_ids) + 1) if text in stack.tokenizer.decode(token_ids[:m]))


@pytest.mark.asyncio
async def test_a_stop_string_cuts_the_text_right_before_it(stack):
    out = await greedy_hello(stack)
    stop = stack.tokenizer.decode(out.token_ids[6:7]).strip()
    cut = out.text.index(stop)
    assert cut > 0

    body = await chat(stack.app, temperature=0, max_tokens=16, stop=stop)

    assert body["choices"][0]["message"]["content"] == out.text[:cut]
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == tokens_to_contain(stack, out.token_ids, stop)


@pytest.mark.asyncio
async def test_include_stop_str_in_output_keeps_the_stop_string(stack):
    out = await greedy_hello(stack)
    stop = stack.tokenizer.decode(out.token_ids[6:7]).strip()
    end = out.text.index(stop) + len(stop)

    body = await chat(stack.app, temperature=0, max_tokens=16, stop=[stop], include_stop_str_in_output=True)

    assert body["choices"][0]["message"]["content"] == out.text[:end]
    assert body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.asyncio
async def test_a_stop_string_spanning_two_tokens_streams_nothing_of_itself(stack):
    out = await greedy_hello(stack)
    texts = [stack.tokenizer.decode([t]) for t in out.token_ids]
    k = next(k for k in range(3, len(texts) - 1) if len(texts[k]) >= 2 and len(texts[k + 1]) >= 2)
    boundary = len(stack.tokenizer.decode(out.token_ids[: k + 1]))
    stop = out.text[boundary - 2: boundary + 2]  # the last 2 chars of token k, the first 2 of k+1
    assert out.text.index(stop) == boundary - 2

    whole = await chat(stack.app, temperature=0, max_tokens=16, stop=[stop, "never appears"])
    streamed = await post(stack.app, "/v1/chat/completions", {
        **CHAT, "temperature": 0, "max_tokens": 16, "stop": stop, "stream": True,
    })

    assert whole["choices"][0]["message"]["content"] == out.text[: boundary - 2]
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert whole["usage"]["completion_tokens"] == k + 2
    content = [c["choices"][0] for c in sse_data(streamed)[1:-1]]
    assert "".join(c["delta"].get("content", "") for c in content) == out.text[: boundary - 2]
    assert content[-1]["finish_reason"] == "stop"


# ---- sampling: n, seed, logprobs -------------------------------------------------------------
@pytest.mark.asyncio
async def test_n_with_a_seed_gives_reproducible_distinct_choices(stack):
    expected = await reference(stack, chat_ids(stack, HELLO), n=2, seed=11, temperature=1.0, max_tokens=8)

    first = await chat(stack.app, n=2, seed=11, temperature=1.0, max_tokens=8)
    second = await chat(stack.app, n=2, seed=11, temperature=1.0, max_tokens=8)

    assert [c["index"] for c in first["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in first["choices"]] == [e.text for e in expected]
    assert first["choices"] == second["choices"]
    assert expected[0].text != expected[1].text
    assert first["usage"]["completion_tokens"] == 16


@pytest.mark.asyncio
async def test_chat_logprobs_carry_tokens_bytes_and_top_alternatives(stack):
    [expected] = await reference(stack, chat_ids(stack, HELLO), temperature=0.0, max_tokens=6, logprobs=3)

    body = await chat(stack.app, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3)

    content = body["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [stack.tokenizer.decode([t]) for t in expected.token_ids]
    assert [e["logprob"] for e in content] == [lp.logprob for lp in expected.logprobs]
    for entry, lp in zip(content, expected.logprobs):
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 3
        assert [(t["token"], t["logprob"]) for t in entry["top_logprobs"]] == [
            (stack.tokenizer.decode([t]), v) for t, v in lp.top
        ]
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy takes the top token
    assert "".join(e["token"] for e in content) == body["choices"][0]["message"]["content"]


@pytest.mark.asyncio
async def test_logprob_bytes_of_a_split_character_are_its_own_bytes(stack):
    """An emoji is several byte-level tokens, each decoding to U+FFFD alone; their `bytes`
    must still concatenate to the emoji's UTF-8, which is what the field is for."""
    emoji_ids = stack.tokenizer("😀", add_special_tokens=False).input_ids
    assert len(emoji_ids) > 1

    entries = []
    for token_id in emoji_ids:  # force each token in turn
        body = await chat(stack.app, temperature=0, max_tokens=1, logprobs=True, logit_bias={str(token_id): 100})
        [entry] = body["choices"][0]["logprobs"]["content"]
        assert entry["token"] == "\ufffd" == body["choices"][0]["message"]["content"]
        entries.append(entry)

    assert b"".join(bytes(e["bytes"]) for e in entries) == "😀".encode()


@pytest.mark.asyncio
async def test_chat_logprobs_without_alternatives_and_in_a_stream(stack):
    whole = await chat(stack.app, temperature=0, max_tokens=6, logprobs=True)
    response = await post(stack.app, "/v1/chat/completions", {
        **CHAT, "temperature": 0, "max_tokens": 6, "logprobs": True, "stream": True,
    })

    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == 6 and all(e["top_logprobs"] == [] for e in content)
    streamed = [e for c in sse_data(response)[1:-1] for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == content


# ---- completions -----------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_completion_of_a_string_and_of_its_token_ids(stack):
    prompt_ids = stack.tokenizer(FOX).input_ids
    [expected] = await reference(stack, prompt_ids, temperature=0.0, max_tokens=8)

    by_text = await complete(stack.app, prompt=FOX, temperature=0, max_tokens=8)
    by_ids = await complete(stack.app, prompt=prompt_ids, temperature=0, max_tokens=8)

    assert by_text["id"].startswith("cmpl-")
    assert by_text == {
        "id": by_text["id"], "object": "text_completion", "created": by_text["created"],
        "model": MODEL, "system_fingerprint": None,
        "choices": [{"index": 0, "text": expected.text, "logprobs": None, "finish_reason": "length"}],
        "usage": usage(len(prompt_ids), 8),
    }
    assert by_ids["choices"] == by_text["choices"] and by_ids["usage"] == by_text["usage"]


@pytest.mark.asyncio
async def test_completions_default_to_16_tokens(stack):
    body = await complete(stack.app, prompt=FOX, temperature=0)

    assert body["usage"]["completion_tokens"] == 16


@pytest.mark.asyncio
async def test_completion_of_two_prompts_indexes_choices_in_prompt_order(stack):
    prompts = [FOX, "Hello there"]
    ids = [stack.tokenizer(p).input_ids for p in prompts]
    expected = [(await reference(stack, p, temperature=0.0, max_tokens=6))[0].text for p in ids]

    body = await complete(stack.app, prompt=prompts, temperature=0, max_tokens=6)
    by_ids = await complete(stack.app, prompt=ids, temperature=0, max_tokens=6)

    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, expected[0]), (1, expected[1])]
    assert body["usage"] == usage(len(ids[0]) + len(ids[1]), 12)
    assert by_ids["choices"] == body["choices"]


@pytest.mark.asyncio
async def test_completion_choices_are_prompt_major_with_n(stack):
    prompts = [FOX, "Hello there"]
    expected = [
        out.text
        for p in prompts
        for out in await reference(stack, stack.tokenizer(p).input_ids, n=2, seed=9, temperature=1.0, max_tokens=4)
    ]

    body = await complete(stack.app, prompt=prompts, n=2, seed=9, max_tokens=4)

    assert [(c["index"], c["text"]) for c in body["choices"]] == list(enumerate(expected))
    assert body["usage"]["completion_tokens"] == 16


@pytest.mark.asyncio
async def test_completion_echo_prepends_the_prompt(stack):
    [expected] = await reference(stack, stack.tokenizer(FOX).input_ids, temperature=0.0, max_tokens=5)

    body = await complete(stack.app, prompt=FOX, temperature=0, max_tokens=5, echo=True)

    assert body["choices"][0]["text"] == FOX + expected.text


@pytest.mark.asyncio
async def test_completion_echo_of_token_ids_prepends_their_text(stack):
    prompt_ids = stack.tokenizer(FOX).input_ids
    [expected] = await reference(stack, prompt_ids, temperature=0.0, max_tokens=5)

    body = await complete(stack.app, prompt=prompt_ids, temperature=0, max_tokens=5, echo=True)

    assert body["choices"][0]["text"] == FOX + expected.text


@pytest.mark.asyncio
async def test_completion_stream_adds_up_to_the_non_streaming_text(stack):
    whole = await complete(stack.app, prompt=FOX, temperature=0, max_tokens=8)

    response = await post(stack.app, "/v1/completions", {
        "model": MODEL, "prompt": FOX, "temperature": 0, "max_tokens": 8, "stream": True,
        "stream_options": {"include_usage": True},
    })

    events = sse_data(response)
    assert events[-1] == "[DONE]"
    *chunks, last = events[:-1]
    assert {c["object"] for c in events[:-1]} == {"text_completion"}
    assert len({c["id"] for c in events[:-1]}) == 1
    assert all(c["usage"] is None and set(c["choices"][0]) == {"index", "text", "logprobs", "finish_reason"} for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert last["choices"] == [] and last["usage"] == whole["usage"]


@pytest.mark.asyncio
async def test_completion_logprobs_have_the_legacy_shape(stack):
    [expected] = await reference(stack, stack.tokenizer(FOX).input_ids, temperature=0.0, max_tokens=6, logprobs=2)

    body = await complete(stack.app, prompt=FOX, temperature=0, max_tokens=6, logprobs=2)

    logprobs = body["choices"][0]["logprobs"]
    tokens = [stack.tokenizer.decode([t]) for t in expected.token_ids]
    assert logprobs == {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in expected.logprobs],
        "top_logprobs": [{stack.tokenizer.decode([t]): v for t, v in lp.top} for lp in expected.logprobs],
        "text_offset": [len("".join(tokens[:i])) for i in range(len(tokens))],
    }
    assert all(len(top) == 2 for top in logprobs["top_logprobs"])


@pytest.mark.asyncio
async def test_completion_stream_keeps_the_logprobs_of_held_back_tokens(stack):
    """A token holding part of a character streams no text until the character completes; its
    logprobs must still arrive, as they do without streaming."""
    part = stack.tokenizer("😀", add_special_tokens=False).input_ids[0]
    body = {"model": MODEL, "prompt": FOX, "temperature": 0, "max_tokens": 4, "logprobs": 1, "logit_bias": {str(part): 100}}

    whole = await post(stack.app, "/v1/completions", body)
    streamed = await post(stack.app, "/v1/completions", {**body, "stream": True})

    expected = whole.json()["choices"][0]["logprobs"]
    assert expected["tokens"] == ["\ufffd"] * 4
    chunks = [c["choices"][0]["logprobs"] for c in sse_data(streamed)[:-1]]
    assert {key: [v for lp in chunks for v in lp[key]] for key in expected} == expected


@pytest.mark.asyncio
async def test_chat_stream_keeps_the_logprobs_of_held_back_tokens(stack):
    part = stack.tokenizer("😀", add_special_tokens=False).input_ids[0]
    body = {**CHAT, "temperature": 0, "max_tokens": 4, "logprobs": True, "logit_bias": {str(part): 100}}

    whole = await post(stack.app, "/v1/chat/completions", body)
    streamed = await post(stack.app, "/v1/chat/completions", {**body, "stream": True})

    expected = whole.json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in expected] == ["\ufffd"] * 4
    assert [e for c in sse_data(streamed)[1:-1] for e in c["choices"][0]["logprobs"]["content"]] == expected


@pytest.mark.asyncio
async def test_completion_echo_with_logprobs_offsets_into_the_echoed_text(stack):
    body = await complete(stack.app, prompt=FOX, temperature=0, max_tokens=5, logprobs=0, echo=True)

    choice = body["choices"][0]
    offsets, tokens = choice["logprobs"]["text_offset"], choice["logprobs"]["tokens"]
    assert offsets[:5] == [0, 3, 9, 15, len(FOX)]  # the prompt's 4 tokens, then the completion's
    assert [choice["text"][o: o + len(t)] for o, t in zip(offsets, tokens)] == tokens
    assert choice["text"] == "".join(tokens) and choice["text"].startswith(FOX)


@pytest.mark.asyncio
async def test_the_openai_sdk_reads_completions(stack):
    whole = await complete(stack.app, prompt=FOX, temperature=0, max_tokens=8)

    async with sdk(stack.app) as api:
        completion = await api.completions.create(model=MODEL, prompt=FOX, temperature=0, max_tokens=8)
        stream = await api.completions.create(model=MODEL, prompt=FOX, temperature=0, max_tokens=8, stream=True)
        chunks = [chunk async for chunk in stream]

    assert completion.choices[0].text == whole["choices"][0]["text"]
    assert completion.usage.completion_tokens == 8
    assert "".join(c.choices[0].text for c in chunks) == whole["choices"][0]["text"]


# ---- errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        ({**CHAT, "temperature": 5}, "temperature: must be in [0.0, 2.0], got 5.0", "temperature"),
        ({**CHAT, "top_p": 0}, "top_p: must be in (0.0, 1.0], got 0.0", "top_p"),
        ({**CHAT, "n": 0}, "n: must be >= 1, got 0", "n"),
        ({**CHAT, "max_tokens": 0}, "max_tokens: must be >= 1, got 0 (0 scores the prompt without generating: with prompt_logprobs)", "max_tokens"),
        ({**CHAT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs: is not available with stream", "prompt_logprobs"),
        ({**CHAT, "logit_bias": {"hello": 5}}, "logit_bias: keys must be token ids, got 'hello'", "logit_bias"),
        ({**CHAT, "logit_bias": {"49152": 5}}, "logit_bias: token id 49152 is not in the vocabulary (0..49151)", "logit_bias"),
        ({**CHAT, "top_logprobs": 2}, "top_logprobs: requires logprobs to be true", "top_logprobs"),
        ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs: must be in [0, 20], got 21", "top_logprobs"),
        ({**CHAT, "stop": [str(i) for i in range(17)]}, "stop: at most 16 stop strings, got 17", "stop"),
        ({**CHAT, "stop_token_ids": [49152]}, "stop_token_ids: token id 49152 is not in the vocabulary (0..49151)", "stop_token_ids"),
        (
            {**CHAT, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
            ]}]},
            "messages[0].content[1]: only text content parts are supported, got type 'image_url'",
            "messages[0].content[1]",
        ),
        ({"model": MODEL}, "messages: Field required", "messages"),
        ({**CHAT, "messages": []}, "messages: List should have at least 1 item after validation, not 0", "messages"),
        ({**CHAT, "messages": [{"role": "robot", "content": "x"}]},
         "messages[0].role: Input should be 'system', 'developer', 'user', 'assistant' or 'tool' (got 'robot')", "messages[0].role"),
        ({**CHAT, "temperature": "hot"}, "temperature: Input should be a valid number, unable to parse string as a number (got 'hot')", "temperature"),
    ],
)
@pytest.mark.asyncio
async def test_invalid_chat_requests_are_400s_naming_the_field(stack, body, message, param):
    response = await post(stack.app, "/v1/chat/completions", body)

    assert response.status_code == 400
    assert response.json() == error_body(message, param, "invalid_value")


@pytest.mark.parametrize(
    ("body", "message", "param", "code"),
    [
        ({"prompt": FOX, "suffix": "!"}, "suffix: is not supported by this server", "suffix", "invalid_value"),
        ({"prompt": FOX, "max_tokens": 0},
         "max_tokens: must be >= 1, got 0 (0 scores the prompt without generating: with prompt_logprobs or echo)", "max_tokens", "invalid_value"),
        ({"prompt": FOX, "prompt_logprobs": 1, "stream": True},
         "prompt_logprobs: is not available with stream; stream echo with logprobs instead", "prompt_logprobs", "invalid_value"),
        ({"prompt": FOX, "prompt_logprobs": 21}, "prompt_logprobs: must be <= 20, got 21", "prompt_logprobs", "invalid_value"),
        ({"prompt": FOX, "prompt_logprobs": -1}, "prompt_logprobs: must be >= 0, got -1", "prompt_logprobs", "invalid_value"),
        ({"prompt": FOX, "logprobs": 21}, "logprobs: must be <= 20, got 21", "logprobs", "invalid_value"),
        ({"prompt": ""}, "prompt: must not be empty", "prompt", "invalid_value"),
        ({"prompt": []}, "prompt: must not be empty", "prompt", "invalid_value"),
        ({"prompt": [5, 49152]}, "prompt: token id 49152 is not in the vocabulary (0..49151)", "prompt", "invalid_value"),
    ],
)
@pytest.mark.asyncio
async def test_invalid_completion_requests_are_400s_naming_the_field(stack, body, message, param, code):
    response = await post(stack.app, "/v1/completions", {"model": MODEL, **body})

    assert response.status_code == 400
    assert response.json() == error_body(message, param, code)


@pytest.mark.asyncio
async def test_an_unknown_model_is_a_404(stack):
    response = await post(stack.app, "/v1/chat/completions", {**CHAT, "model": "gpt-5"})
    async with client(stack.app) as c:
        card = await c.get("/v1/models/gpt-5")

    assert response.status_code == 404 and card.status_code == 404
    assert response.json() == card.json() == error_body(
        "The model 'gpt-5' does not exist. Available models: tiny.", "model", "model_not_found"
    )


@pytest.mark.asyncio
async def test_a_prompt_longer_than_the_context_window_is_refused(stack):
    long_message = [{"role": "user", "content": "word " * MAX_MODEL_LEN}]
    long_chat = await post(stack.app, "/v1/chat/completions", {**CHAT, "messages": long_message})
    long_prompt = await post(stack.app, "/v1/completions", {"model": MODEL, "prompt": list(range(1000, 3100))})
    num_chat_tokens = len(chat_ids(stack, long_message))
    assert num_chat_tokens > MAX_MODEL_LEN

    assert long_chat.status_code == long_prompt.status_code == 400
    assert long_chat.json() == error_body(
        f"the prompt has {num_chat_tokens} tokens but the context window is {MAX_MODEL_LEN} (shorten the prompt)",
        "messages", "context_length_exceeded",
    )
    assert long_prompt.json() == error_body(
        f"the prompt has 2100 tokens but the context window is {MAX_MODEL_LEN} (shorten the prompt)",
        "prompt", "context_length_exceeded",
    )


@pytest.mark.asyncio
async def test_max_tokens_past_the_context_window_is_refused(stack):
    num_prompt = len(chat_ids(stack, HELLO))

    response = await post(stack.app, "/v1/chat/completions", {**CHAT, "max_tokens": MAX_MODEL_LEN})

    assert response.status_code == 400
    assert response.json() == error_body(
        f"prompt ({num_prompt} tokens) + max_tokens ({MAX_MODEL_LEN}) exceeds the context window of "
        f"{MAX_MODEL_LEN} tokens (lower max_tokens to at most {MAX_MODEL_LEN - num_prompt})",
        "max_tokens", "context_length_exceeded",
    )


@pytest.mark.asyncio
async def test_the_openai_sdk_raises_its_own_errors(stack):
    async with sdk(stack.app) as api:
        with pytest.raises(openai.BadRequestError) as bad:
            await api.chat.completions.create(model=MODEL, messages=HELLO, temperature=5)
        with pytest.raises(openai.NotFoundError) as missing:
            await api.chat.completions.create(model="gpt-5", messages=HELLO)

    assert bad.value.status_code == 400 and bad.value.param == "temperature" and bad.value.code == "invalid_value"
    assert missing.value.code == "model_not_found"


@pytest.mark.asyncio
async def test_malformed_json_is_a_422_with_a_detail_list(stack):
    response = await post(stack.app, "/v1/chat/completions", '{"model": "tiny", "messages": [')

    assert response.status_code == 422
    body = response.json()
    assert body["error"]["code"] == "invalid_json" and body["error"]["type"] == "invalid_request_error"
    assert [(d["type"], d["loc"], d["msg"]) for d in body["detail"]] == [("json_invalid", ["body", 31], "JSON decode error")]


@pytest.mark.asyncio
async def test_a_json_array_body_is_a_422(stack):
    response = await post(stack.app, "/v1/chat/completions", "[1, 2]")

    assert response.status_code == 422
    assert response.json()["error"] == {
        "message": "The request body must be a JSON object, got list.",
        "type": "invalid_request_error", "param": None, "code": "invalid_json",
    }


@pytest.mark.asyncio
async def test_a_body_over_the_limit_is_a_413(stack):
    app = stack.app_with(max_request_body_bytes=1024)
    raw = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 2000}]}).encode()

    response = await post(app, "/v1/chat/completions", raw)

    assert response.status_code == 413
    assert response.json() == error_body(f"The request body has {len(raw)} bytes; the limit is 1024.", None, "request_too_large")


async def asgi_post(app, path: str, chunks: list[bytes], headers: dict[str, str]) -> tuple[int, dict, int]:
    """POST `chunks` straight through ASGI (no client to fix the headers up): the status, the JSON
    body, and how many body messages the app asked for."""
    received = 0
    sent: list[dict] = []

    async def receive():
        nonlocal received
        received += 1
        if received > len(chunks):
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": chunks[received - 1], "more_body": received < len(chunks)}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(k.encode(), v.encode()) for k, v in {"content-type": "application/json", **headers}.items()],
        "server": ("test", 80), "client": ("127.0.0.1", 123),
    }
    await app(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body), received


@pytest.mark.asyncio
async def test_a_content_length_over_the_limit_is_a_413_before_the_body_is_read(stack):
    app = stack.app_with(max_request_body_bytes=1024)

    status, body, received = await asgi_post(app, "/v1/chat/completions", [b"{" * 512] * 4, {"content-length": "2048"})

    assert status == 413 and received == 0
    assert body == error_body("The request body has 2048 bytes; the limit is 1024.", None, "request_too_large")


@pytest.mark.asyncio
async def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit(stack):
    app = stack.app_with(max_request_body_bytes=1024)

    status, body, received = await asgi_post(app, "/v1/chat/completions", [b" " * 512] * 10, {})

    assert status == 413 and received == 3  # 1536 bytes read of 5120
    assert body == error_body("The request body has more than 1024 bytes, the limit.", None, "request_too_large")


@pytest.mark.parametrize("value", ["12abc", "-5", "", "1e3"])
@pytest.mark.asyncio
async def test_a_malformed_content_length_is_a_400(stack, value):
    status, body, received = await asgi_post(stack.app, "/v1/chat/completions", [json.dumps(CHAT).encode()], {"content-length": value})

    assert status == 400 and received == 0
    assert body == error_body(f"The Content-Length header must be a number of bytes, got {value!r}.", None, "invalid_content_length")


@pytest.mark.parametrize("nesting", ["[" * 100_000, '{"a":' * 100_000, '{"messages": ' + "[" * 5000 + "]" * 5000 + "}"])
@pytest.mark.asyncio
async def test_json_nested_too_deeply_to_parse_is_a_400(stack, nesting):
    response = await post(stack.app, "/v1/chat/completions", nesting)

    assert response.status_code == 400
    assert response.json() == error_body("The request body nests arrays or objects too deeply to parse.", None, "invalid_json")


@pytest.mark.asyncio
async def test_unknown_fields_are_accepted_and_ignored(stack, caplog):
    plain = await chat(stack.app, temperature=0, max_tokens=5)

    with caplog.at_level(logging.DEBUG, logger="serving.api.endpoints.http_io"):
        extra = await chat(stack.app, temperature=0, max_tokens=5, foo=1, service_tier="auto", metadata={"a": "b"})

    assert extra["choices"] == plain["choices"] and extra["usage"] == plain["usage"]
    assert [r.getMessage() for r in caplog.records if r.name == "serving.api.endpoints.http_io"] == [
        "request fields ignored: foo, metadata, service_tier",
    ]


@pytest.mark.asyncio
async def test_api_keys_guard_the_api_but_not_health(stack):
    app = stack.app_with(api_keys=["k1"])
    good = {**CHAT, "temperature": 0, "max_tokens": 3}

    missing = await post(app, "/v1/chat/completions", good)
    wrong = await post(app, "/v1/chat/completions", good, authorization="Bearer k2")
    right = await post(app, "/v1/chat/completions", good, authorization="Bearer k1")
    async with client(app) as c:
        health = await c.get("/health")
        models = await c.get("/v1/models")
    async with sdk(app, api_key="k1") as api:
        via_sdk = await api.chat.completions.create(**good)
    async with sdk(app, api_key="k2") as api:
        with pytest.raises(openai.AuthenticationError):
            await api.chat.completions.create(**good)

    assert missing.status_code == wrong.status_code == models.status_code == 401
    assert missing.json() == error_body("Missing API key: send 'Authorization: Bearer <key>'.", None, "invalid_api_key")
    assert wrong.json() == error_body("Incorrect API key provided.", None, "invalid_api_key")
    assert right.status_code == 200 and health.status_code == 200
    assert via_sdk.choices[0].message.content == right.json()["choices"][0]["message"]["content"]


# ---- concurrency and disconnects -------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_bad_request_among_good_ones_disturbs_none_of_them(stack):
    good = [
        {"messages": HELLO, "temperature": 0, "max_tokens": 10},
        {"messages": [{"role": "user", "content": "Count to ten"}], "temperature": 0, "max_tokens": 8},
        {"messages": HELLO, "n": 2, "seed": 5, "max_tokens": 6},
    ]
    solo = [await chat(stack.app, **body) for body in good]

    *together, bad = await asyncio.gather(
        *(chat(stack.app, **body) for body in good),
        post(stack.app, "/v1/chat/completions", {**CHAT, "max_tokens": MAX_MODEL_LEN}),
    )

    assert bad.status_code == 400 and bad.json()["error"]["code"] == "context_length_exceeded"
    assert [r["choices"] for r in together] == [r["choices"] for r in solo]
    assert [r["usage"] for r in together] == [r["usage"] for r in solo]


async def _take_data(lines, count: int) -> list[str]:
    """The first `count` SSE `data:` lines."""
    taken = []
    async for line in lines:
        if line.startswith("data: "):
            taken.append(line)
            if len(taken) == count:
                break
    return taken


def logged_problems(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.asyncio
async def test_leaving_a_chat_stream_aborts_the_request_and_frees_its_blocks(stack, caplog):
    before = await wait_until_idle(stack, stack.engine.stats().num_blocks)
    baseline = before.num_free_blocks
    max_tokens = MAX_MODEL_LEN - 64
    body = {**CHAT, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}

    async with (
        client(stack.app, transport=StreamingASGITransport) as c,
        c.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        received = await _take_data(response.aiter_lines(), 2)
        in_use = stack.engine.stats()

    stats = await wait_until_idle(stack, baseline)
    assert response.status_code == 200 and len(received) == 2
    assert in_use.num_running == 1 and in_use.num_free_blocks < baseline
    assert stats.num_running == 0 and stats.num_free_blocks == baseline
    assert stats.num_generated_tokens - before.num_generated_tokens < max_tokens  # it never ran to its end
    assert logged_problems(caplog) == []


@pytest.mark.asyncio
async def test_leaving_a_two_prompt_completion_stream_aborts_both(stack, caplog):
    before = await wait_until_idle(stack, stack.engine.stats().num_blocks)
    baseline = before.num_free_blocks
    max_tokens = MAX_MODEL_LEN - 64
    body = {"model": MODEL, "prompt": [FOX, "Hello there"], "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}

    async with (
        client(stack.app, transport=StreamingASGITransport) as c,
        c.stream("POST", "/v1/completions", json=body) as response,
    ):
        received = await _take_data(response.aiter_lines(), 2)
        in_use = stack.engine.stats()

    stats = await wait_until_idle(stack, baseline)
    assert response.status_code == 200 and len(received) == 2
    assert in_use.num_running >= 1 and in_use.num_free_blocks < baseline
    assert stats.num_running == 0 and stats.num_free_blocks == baseline
    assert stats.num_generated_tokens - before.num_generated_tokens < max_tokens  # neither ran to its end
    assert logged_problems(caplog) == []


@pytest.mark.asyncio
async def test_a_stop_string_ends_the_engines_request_too(stack, caplog):
    out = await greedy_hello(stack)
    stop = stack.tokenizer.decode(out.token_ids[6:7]).strip()
    before = await wait_until_idle(stack, stack.engine.stats().num_blocks)
    max_tokens = MAX_MODEL_LEN - 64

    body = await chat(stack.app, temperature=0, max_tokens=max_tokens, ignore_eos=True, stop=stop)

    stats = await wait_until_idle(stack, before.num_free_blocks)
    assert body["choices"][0]["finish_reason"] == "stop"
    assert stats.num_running == 0 and stats.num_free_blocks == before.num_free_blocks
    assert stats.num_generated_tokens - before.num_generated_tokens < max_tokens
    assert logged_problems(caplog) == []


@pytest.mark.asyncio
async def test_a_stream_read_to_the_end_through_a_real_streaming_transport(stack):
    whole = await chat(stack.app, temperature=0, max_tokens=8)

    body = {**CHAT, "temperature": 0, "max_tokens": 8, "stream": True}
    async with (
        client(stack.app, transport=StreamingASGITransport) as c,
        c.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        data = [line.removeprefix("data: ") async for line in response.aiter_lines() if line]

    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == whole["choices"][0]["message"]["content"]


# ---- failures of the backend -----------------------------------------------------------------
class _CrashingBackend:
    """The module's LocalBackend, except that every stream breaks after its first output and the
    pool reports no live replica."""

    def __init__(self, backend: LocalBackend):
        self.backend = backend

    async def model_info(self):
        return await self.backend.model_info()

    async def generate(self, request):
        async with aclosing(self.backend.generate(request)) as outputs:
            async for out in outputs:
                yield out
                raise EngineDeadError("simulated crash")

    async def health(self):
        raise NoWorkerError("engine", "simulated crash")


def crashing_app(stack: Stack):
    frontend = Frontend(stack.tokenizer, _CrashingBackend(stack.frontend.backend), MODEL)
    return OpenAIServer(frontend, stack.config).build_app()


def dead(request_id: str) -> dict:
    """The body of a request the crashing backend failed: no exception text, its request id."""
    return error_body(
        f"The engine serving this request stopped; retry once it has recovered. (request id: {request_id})",
        None, "engine_dead", type="service_unavailable_error",
    )


@pytest.mark.asyncio
async def test_a_failure_after_the_first_token_is_an_sse_error_event(stack):
    before = await wait_until_idle(stack, stack.engine.stats().num_blocks)

    response = await post(crashing_app(stack), "/v1/chat/completions", {**CHAT, "max_tokens": 50, "ignore_eos": True, "stream": True})

    assert response.status_code == 200
    events = sse_data(response)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-2:] == [dead(events[0]["id"]), "[DONE]"]
    assert events[0]["id"].startswith("chatcmpl-") and response.headers["x-request-id"] == events[0]["id"]
    assert all("choices" in e and e["choices"][0]["finish_reason"] is None for e in events[:-2])
    stats = await wait_until_idle(stack, before.num_free_blocks)
    assert stats.num_running == 0 and stats.num_free_blocks == before.num_free_blocks


@pytest.mark.asyncio
async def test_a_failure_without_streaming_is_a_503_and_health_says_so(stack):
    app = crashing_app(stack)

    response = await post(app, "/v1/chat/completions", {**CHAT, "max_tokens": 50})
    async with client(app) as c:
        health = await c.get("/health")

    request_id = response.headers["x-request-id"]
    assert request_id.startswith("chatcmpl-")
    assert response.status_code == 503 and response.json() == dead(request_id)
    assert health.status_code == 503
    assert health.json() == error_body(
        "No engine replica is alive to serve this request: simulated crash; retry once the pool has recovered.",
        None, "no_worker", type="service_unavailable_error",
    )


class _FailingBackend:
    """The module's LocalBackend, except that a generate and the health check raise an exception
    whose text must not reach a client."""

    def __init__(self, backend: LocalBackend):
        self.backend = backend

    async def model_info(self):
        return await self.backend.model_info()

    async def generate(self, request):
        raise RuntimeError("secret: /opt/models/weights.safetensors")
        yield  # an async generator, as a backend's generate is

    async def health(self):
        raise RuntimeError("secret: controller at 10.0.0.7:6379")


@pytest.mark.asyncio
async def test_an_unexpected_error_is_a_generic_500_naming_the_request_id_the_log_has(stack, caplog):
    app = OpenAIServer(Frontend(stack.tokenizer, _FailingBackend(stack.frontend.backend), MODEL), stack.config).build_app()

    with caplog.at_level(logging.ERROR, logger="serving.api.endpoints.routes"):
        chat_response = await post(app, "/v1/chat/completions", {**CHAT, "max_tokens": 5})
        completion = await post(app, "/v1/completions", {"model": MODEL, "prompt": FOX, "max_tokens": 5, "stream": True})

    ids = [chat_response.headers["x-request-id"], completion.headers["x-request-id"]]
    assert ids[0].startswith("chatcmpl-") and ids[1].startswith("cmpl-")
    for response, request_id in zip((chat_response, completion), ids):
        assert response.status_code == 500 and "secret" not in response.text
        assert response.json() == error_body(
            f"The server had an error while processing this request. (request id: {request_id})", None, None, type="internal_error",
        )
    logged = [r for r in caplog.records if r.name == "serving.api.endpoints.routes"]
    assert [r.getMessage() for r in logged] == [f"request {i} failed (500 internal_error)" for i in ids]
    assert all(str(r.exc_info[1]) == "secret: /opt/models/weights.safetensors" for r in logged)  # with its traceback


@pytest.mark.asyncio
async def test_a_health_check_that_fails_unexpectedly_is_a_503_without_its_text(stack, caplog):
    app = OpenAIServer(Frontend(stack.tokenizer, _FailingBackend(stack.frontend.backend), MODEL), stack.config).build_app()

    with caplog.at_level(logging.ERROR, logger="serving.api.endpoints.routes"):
        async with client(app) as c:
            health = await c.get("/health")

    [record] = [r for r in caplog.records if r.name == "serving.api.endpoints.routes"]
    check_id = record.getMessage().removeprefix("health check ").removesuffix(" failed")
    assert check_id.startswith("health-") and str(record.exc_info[1]) == "secret: controller at 10.0.0.7:6379"
    assert health.status_code == 503
    assert health.json() == error_body(
        f"The pools' health is unknown: reading it failed. (request id: {check_id})", None, "health_unknown",
        type="service_unavailable_error",
    )


# ---- models and health -----------------------------------------------------------------------
@pytest.mark.asyncio
async def test_an_unknown_route_or_method_answers_in_openais_error_shape(stack):
    """Not FastAPI's {"detail": "Not Found"}: OpenAI's body, as OpenAI answers an unknown URL."""
    async with client(stack.app) as c:
        unknown = await c.post("/v1/chat/complete", json={"model": MODEL})
        missing = await c.get("/v2/models")
        wrong_method = await c.get("/v1/chat/completions")

    assert (unknown.status_code, unknown.json()) == (404, {"error": {
        "message": "Invalid URL (POST /v1/chat/complete)", "type": "invalid_request_error", "param": None, "code": None,
    }})
    assert (missing.status_code, missing.json()) == (404, {"error": {
        "message": "Invalid URL (GET /v2/models)", "type": "invalid_request_error", "param": None, "code": None,
    }})
    assert (wrong_method.status_code, wrong_method.json()) == (405, {"error": {
        "message": "Method not allowed (GET /v1/chat/completions); this path takes POST", "type": "invalid_request_error",
        "param": None, "code": None,
    }})
    assert wrong_method.headers["allow"] == "POST"


@pytest.mark.asyncio
async def test_models_lists_the_served_name_and_health_is_ok(stack):
    async with client(stack.app) as c:
        models = await c.get("/v1/models")
        card = await c.get(f"/v1/models/{MODEL}")
        health = await c.get("/health")
    async with sdk(stack.app) as api:
        listed = [m.id async for m in api.models.list()]

    assert models.status_code == card.status_code == health.status_code == 200
    created = card.json()["created"]
    assert isinstance(created, int)
    assert models.json() == {"object": "list", "data": [
        {"id": MODEL, "object": "model", "created": created, "owned_by": "kvrelay", "max_model_len": MAX_MODEL_LEN},
    ]}
    assert card.json() == models.json()["data"][0]
    assert health.json() == {"status": "ok", "pools": {"engine": {"RUNNING": 1}}}
    assert listed == [MODEL]
