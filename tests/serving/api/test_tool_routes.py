"""Tool calling over HTTP, read by the official `openai` SDK: a backend that answers with a
scripted text (the tiny random model would not write a call) shows what the ingress makes of
the model's own format, streamed and not, and what prompt the model was given."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from serving.api.endpoints.routes import OpenAIServer
from serving.api.generation.pipeline import Frontend
from serving.config import ServeConfig
from serving.deployments.local_backend import LocalBackend
from serving.engine.outputs import CompletionOutput, RequestOutput
from tests.asgi import local_app
from tests.helpers import streamed_tool_calls

MODEL = "tiny"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SAID = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ASK = [{"role": "user", "content": "Weather in Paris?"}]


class Scripted(LocalBackend):
    """Answers every request with `text`'s tokens, one per output, then EOS; keeps the prompts."""

    def __init__(self, engine, text: str):
        super().__init__(engine)
        self.ids = engine.tokenizer(text, add_special_tokens=False).input_ids + [engine.tokenizer.eos_token_id]
        self.prompts: list[list[int]] = []

    async def generate(self, request):
        self.prompts.append(request.prompt_token_ids)
        for k, token_id in enumerate(self.ids):
            last = k == len(self.ids) - 1
            yield RequestOutput(
                request.request_id, [CompletionOutput(0, "", [token_id], None, "stop" if last else None)],
                last, len(request.prompt_token_ids), 0,
            )


def client_for(engine, tiny_model_dir, text: str = SAID, **config) -> tuple[openai.AsyncOpenAI, Scripted]:
    backend = Scripted(engine, text)
    cfg = ServeConfig(model=str(tiny_model_dir), served_model_name=MODEL, **config)
    app = OpenAIServer(Frontend(engine.tokenizer, backend, MODEL), cfg).build_app()
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0), backend


@pytest.mark.asyncio
async def test_auto_calls_come_back_in_openai_s_shape_streamed_and_not(engine, tiny_model_dir):
    client, backend = client_for(engine, tiny_model_dir)
    response = await client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check.\n"
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == ("function", "get_weather", {"city": "Paris"})
    assert call.id.startswith("call_") and len(call.id) == 29

    stream = await client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], stream=True)
    content, calls, reasons = "", {}, []
    async for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = part.id or entry["id"]
            entry["name"] += (part.function.name or "") if part.function else ""
            entry["arguments"] += (part.function.arguments or "") if part.function else ""
        reasons.append(chunk.choices[0].finish_reason)
    assert content == "Let me check.\n"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(call.function.name, call.function.arguments)]
    assert calls[0]["id"].startswith("call_")
    assert [r for r in reasons if r] == ["tool_calls"]
    # The model was shown the tool, in kvrelay's prompt (SmolLM2's template renders no tools),
    # and /tokenize given the same tools counts the same prompt.
    prompt = engine.tokenizer.decode(backend.prompts[0])
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in prompt
    root = client.with_options(base_url="http://test")
    tokenized = await root.post("/tokenize", body={"model": MODEL, "messages": ASK, "tools": [WEATHER]}, cast_to=httpx.Response)
    assert tokenized.json()["tokens"] == backend.prompts[0]


@pytest.mark.asyncio
async def test_a_conversation_with_calls_and_tool_results_is_rendered_and_answered(engine, tiny_model_dir):
    client, backend = client_for(engine, tiny_model_dir, text="It is 18 C and sunny in Paris.")
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    response = await client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER])
    assert response.choices[0].message.content == "It is 18 C and sunny in Paris."
    assert response.choices[0].message.tool_calls is None and response.choices[0].finish_reason == "stop"
    prompt = engine.tokenizer.decode(backend.prompts[0])
    assert prompt.endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.asyncio
async def test_tool_choice_none_leaves_the_text_alone_and_shows_no_tools(engine, tiny_model_dir):
    client, backend = client_for(engine, tiny_model_dir)
    response = await client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none")
    assert (response.choices[0].message.content, response.choices[0].message.tool_calls) == (SAID, None)
    assert response.choices[0].finish_reason == "stop"
    assert "<tools>" not in engine.tokenizer.decode(backend.prompts[0])


@pytest.mark.asyncio
async def test_bad_tool_requests_get_400s_naming_the_field(engine, tiny_model_dir):
    client, _ = client_for(engine, tiny_model_dir)
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert info.value.body["param"] == "tool_choice.function.name"
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "tool", "content": "x"}])
    assert info.value.body["param"] == "messages[0].tool_call_id"


def engine_client(engine, tiny_model_dir) -> openai.AsyncOpenAI:
    cfg = ServeConfig(model=str(tiny_model_dir), served_model_name=MODEL)
    app = local_app(engine, cfg, MODEL)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0)


TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


async def _streamed_calls(stream) -> tuple[list[tuple[str, str]], list[str]]:
    return streamed_tool_calls([chunk async for chunk in stream])


@pytest.mark.asyncio
@pytest.mark.parametrize("choice", ["named", "required", "required-single"])
async def test_forced_calls_from_a_random_model_are_valid_and_stream_the_same(engine, tiny_model_dir, choice):
    """The tiny random model writes nothing sensible: only constrained decoding makes these calls."""
    import jsonschema

    client = engine_client(engine, tiny_model_dir)
    tool_choice = {"type": "function", "function": {"name": "get_time"}} if choice == "named" else "required"
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice, temperature=0, max_tokens=200,
                  parallel_tool_calls=choice != "required-single")
    whole = await client.chat.completions.create(**kwargs)
    choice0 = whole.choices[0]
    assert choice0.finish_reason == "tool_calls" and choice0.message.content is None
    schemas = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}
    for call in choice0.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    if choice == "named":
        assert [c.function.name for c in choice0.message.tool_calls] == ["get_time"]
    if choice == "required-single":
        assert len(choice0.message.tool_calls) == 1
    streamed, reasons = await _streamed_calls(await client.chat.completions.create(**kwargs, stream=True))
    assert streamed == [(c.function.name, c.function.arguments) for c in choice0.message.tool_calls]
    assert reasons == ["tool_calls"]


@pytest.mark.asyncio
async def test_a_forced_choice_and_a_response_format_together_are_a_400(engine, tiny_model_dir):
    client = engine_client(engine, tiny_model_dir)
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                             response_format={"type": "json_object"})
    assert info.value.body["param"] == "response_format"
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "strin"}}}}}
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL, messages=ASK, tools=[bad], tool_choice="required")
    assert info.value.body["param"] == "tools"
