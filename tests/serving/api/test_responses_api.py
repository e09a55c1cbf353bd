"""POST /v1/responses (serving/api/endpoints/responses.py) through the official openai SDK and over raw
HTTP: the response object and the streamed events in OpenAI's shapes, carrying the engine's own
greedy text, and the 400s for what kvrelay does not implement."""

from __future__ import annotations

import json
from contextlib import aclosing

import httpx
import openai
import pytest

from serving.api.endpoints.routes import OpenAIServer
from serving.api.generation.pipeline import Frontend
from serving.config import ServeConfig
from serving.deployments.local_backend import LocalBackend
from serving.engine import SamplingParams
from serving.engine.contract import EngineRequest
from serving.engine.errors import EngineDeadError
from serving.engine.outputs import merge_outputs
from tests.asgi import local_app
from tests.asgi import post as asgi_post

MODEL = "tiny"
INSTRUCTIONS = "Answer in one word."
QUESTION = "Hello there"


@pytest.fixture(scope="module")
def app(engine, tiny_model_dir):
    config = ServeConfig(model=str(tiny_model_dir), served_model_name=MODEL)
    return local_app(engine, config, MODEL)


def sdk(app) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://test/v1", api_key="unused", max_retries=0,
        http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)),
    )


async def post(app, body: dict) -> httpx.Response:
    return await asgi_post(app, "/v1/responses", body, model=MODEL)


def prompt_ids(engine, messages: list[dict]) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return engine.tokenizer(text, add_special_tokens=False).input_ids


async def greedy(engine, ids: list[int], max_tokens: int, name: str):
    merged = None
    async for out in engine.generate(EngineRequest(name, prompt_token_ids=ids, params=SamplingParams(temperature=0.0, max_tokens=max_tokens))):
        merged = merge_outputs(merged, out)
    return merged.outputs[0]


def typed_events(response: httpx.Response) -> list[dict]:
    """Each SSE event's data, after checking its `event:` line names its type."""
    assert response.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in response.text.split("\n\n"):
        if block:
            event_line, data_line = block.split("\n")
            data = json.loads(data_line.removeprefix("data: "))
            assert event_line == f"event: {data['type']}"
            events.append(data)
    return events


@pytest.mark.asyncio
async def test_the_sdk_reads_a_response_with_the_engines_greedy_text(app, engine):
    ids = prompt_ids(engine, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}])
    expected = await greedy(engine, ids, 8, "responses-ref-1")

    async with sdk(app) as api:
        response = await api.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=8, temperature=0)

    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == expected.text
    [message] = response.output
    assert (message.type, message.role, message.status, message.id) == ("message", "assistant", "incomplete", "msg_" + response.id[5:])
    assert [(part.type, part.text, part.annotations) for part in message.content] == [("output_text", expected.text, [])]
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (len(ids), 8, len(ids) + 8)
    assert response.usage.input_tokens_details.cached_tokens == 0
    assert (response.instructions, response.max_output_tokens, response.temperature, response.truncation) == (INSTRUCTIONS, 8, 0.0, "disabled")


@pytest.mark.asyncio
async def test_message_items_with_text_parts_are_the_conversation(app, engine):
    conversation = [
        {"role": "user", "content": [{"type": "input_text", "text": "Hi. "}, {"type": "input_text", "text": "Who are you?"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "A model."}]},
        {"type": "message", "role": "user", "content": "Say more"},
    ]
    ids = prompt_ids(engine, [{"role": "user", "content": "Hi. Who are you?"}, {"role": "assistant", "content": "A model."},
                              {"role": "user", "content": "Say more"}])
    expected = await greedy(engine, ids, 5, "responses-ref-2")

    async with sdk(app) as api:
        response = await api.responses.create(model=MODEL, input=conversation, max_output_tokens=5, temperature=0)

    assert response.output_text == expected.text
    assert response.usage.input_tokens == len(ids)


@pytest.mark.asyncio
async def test_streamed_events_are_openais_in_order_with_sequence_numbers(app, engine):
    ids = prompt_ids(engine, [{"role": "user", "content": QUESTION}])
    expected = await greedy(engine, ids, 6, "responses-ref-3")

    response = await post(app, {"input": QUESTION, "max_output_tokens": 6, "temperature": 0, "stream": True})

    assert response.status_code == 200
    events = typed_events(response)
    types = [e["type"] for e in events]
    num_deltas = types.count("response.output_text.delta")
    assert types == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * num_deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.incomplete",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == expected.text
    item_id = events[2]["item"]["id"]
    assert events[2]["item"] == {"id": item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
    part = {"type": "output_text", "text": expected.text, "annotations": [], "logprobs": []}
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    assert events[-4] == {"type": "response.output_text.done", "sequence_number": len(events) - 4, **where, "text": expected.text, "logprobs": []}
    assert events[-3] == {"type": "response.content_part.done", "sequence_number": len(events) - 3, **where, "part": part}
    assert events[-2]["item"] == {"id": item_id, "type": "message", "role": "assistant", "status": "incomplete", "content": [part]}
    final = events[-1]["response"]
    assert (final["status"], final["incomplete_details"], final["output"]) == ("incomplete", {"reason": "max_output_tokens"}, [events[-2]["item"]])
    assert final["usage"] == {
        "input_tokens": len(ids), "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 6,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": len(ids) + 6,
    }
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []


@pytest.mark.asyncio
async def test_the_sdks_stream_helper_gets_a_completed_response(app, engine):
    ids = prompt_ids(engine, [{"role": "user", "content": QUESTION}])
    unstopped = await greedy(engine, ids, 8, "responses-ref-4")
    stop_token = unstopped.token_ids[3]  # a stop token (vLLM's extension) ends it: status completed
    stopped_at = unstopped.token_ids.index(stop_token)
    expected = engine.tokenizer.decode(unstopped.token_ids[:stopped_at], skip_special_tokens=True)

    async with sdk(app) as api:
        async with api.responses.stream(
            model=MODEL, input=QUESTION, max_output_tokens=8, temperature=0, extra_body={"stop_token_ids": [stop_token]},
        ) as stream:
            deltas = [event.delta async for event in stream if event.type == "response.output_text.delta"]
            final = await stream.get_final_response()
        streamed = await api.responses.create(model=MODEL, input=QUESTION, max_output_tokens=8, temperature=0, stream=True)
        types = [event.type async for event in streamed]

    assert "".join(deltas) == expected == final.output_text
    assert final.status == "completed" and final.incomplete_details is None
    assert final.usage.output_tokens == stopped_at + 1
    assert types[0] == "response.created" and types[-1] == "response.incomplete"


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools",
         "tools: tools are not supported in /v1/responses; /v1/chat/completions takes them"),
        ({"previous_response_id": "resp_1"}, "previous_response_id",
         "previous_response_id: kvrelay stores no responses: send the whole conversation as `input`"),
        ({"store": True}, "store", "store: storing is not supported: kvrelay keeps no completions (send false, or leave it out)"),
        ({"text": {"format": {"type": "json_object"}}}, "text",
         "text: only plain text output is supported in /v1/responses (JSON output: /v1/chat/completions `response_format`)"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input[0].content[0].type",
         "input[0].content[0].type: only text parts (input_text, output_text) are supported, got 'input_image'"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input[0].type",
         "input[0].type: only message items are supported here, got 'function_call_output'"),
        ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens: must be >= 1, got 0"),  # (+ a hint where 0 is allowed)
        ({"max_output_tokens": 5000}, "max_output_tokens", None),
    ],
)
@pytest.mark.asyncio
async def test_what_kvrelay_does_not_implement_is_a_400_naming_the_field(app, body, param, message):
    response = await post(app, {"input": QUESTION, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    if message is not None and param == "max_output_tokens":
        assert error["message"].startswith(message)
    elif message is not None:
        assert error["message"] == message
    assert "max_tokens" not in error["message"].replace("max_output_tokens", "")


@pytest.mark.asyncio
async def test_accepted_no_ops_and_unknown_fields_are_named_in_the_header(app):
    response = await post(app, {
        "input": QUESTION, "max_output_tokens": 1, "store": False, "tool_choice": "auto", "metadata": {"k": "v"},
        "reasoning": None, "foo": 1,
    })
    assert response.status_code == 200, response.text
    assert response.headers["x-kvrelay-ignored-fields"] == "metadata,foo"
    assert response.json()["metadata"] == {"k": "v"}


class _CrashingBackend:
    """The engine's LocalBackend, except that every stream breaks after its first output."""

    def __init__(self, backend: LocalBackend):
        self.backend = backend

    async def model_info(self):
        return await self.backend.model_info()

    async def generate(self, request):
        async with aclosing(self.backend.generate(request)) as outputs:
            async for out in outputs:
                yield out
                raise EngineDeadError("simulated crash")


@pytest.mark.asyncio
async def test_a_failure_after_the_first_event_is_a_response_failed_event(engine, tiny_model_dir):
    config = ServeConfig(model=str(tiny_model_dir), served_model_name=MODEL)
    app = OpenAIServer(Frontend(engine.tokenizer, _CrashingBackend(LocalBackend(engine)), MODEL), config).build_app()

    response = await post(app, {"input": QUESTION, "max_output_tokens": 20, "stream": True, "extra": 1})

    assert response.status_code == 200 and response.headers["x-kvrelay-ignored-fields"] == "extra"
    events = typed_events(response)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    failed = events[-1]
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {
        "code": "engine_dead",
        "message": f"The engine serving this request stopped; retry once it has recovered. (request id: {response.headers['x-request-id']})",
    }
    assert failed["response"]["id"] == response.headers["x-request-id"]
    assert not response.text.rstrip().endswith("[DONE]")
