"""Structured outputs over HTTP (serving/api/protocol/structured.py): every way to ask for one, on both
endpoints, through the openai SDK and httpx, against the tiny random model, whose output is valid
only because of the mask; and every way to ask wrongly, each a 400 naming the field.

    httpx / openai SDK ──ASGI──▶ OpenAIServer ──▶ Frontend (compiles at the edge) ──▶ LocalBackend ──▶ AsyncEngine
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from serving.config import ServeConfig
from serving.engine.contract import EngineRequest
from serving.engine.params import GuidedSpec, SamplingParams
from serving.engine.sampling.grammar import compiler_for
from tests.asgi import local_app
from tests.asgi import post as asgi_post

MODEL = "tiny"
HELLO = [{"role": "user", "content": "Describe someone."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)
    pet: Literal["cat", "dog", "none"]


@pytest.fixture(scope="module")
def app(engine):
    config = ServeConfig(model="unused", served_model_name=MODEL)
    return local_app(engine, config, MODEL)


post = functools.partial(asgi_post, model=MODEL)  # every body names the served model


async def chat(app, **body) -> dict:
    response = await post(app, "/v1/chat/completions", {"messages": HELLO, **body})
    assert response.status_code == 200, response.text
    return response.json()


async def complete(app, **body) -> dict:
    response = await post(app, "/v1/completions", {"prompt": "Answer:", **body})
    assert response.status_code == 200, response.text
    return response.json()


def sdk(app) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://test/v1", api_key="unused", max_retries=0,
        http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)),
    )


def json_schema_format(schema=SCHEMA) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


# ---- asking for one ------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_the_openai_sdk_gets_schema_valid_json_sampled_100_times_out_of_100(app):
    client = sdk(app)
    responses = await asyncio.gather(*[
        client.chat.completions.create(
            model=MODEL, messages=HELLO, response_format=json_schema_format(), temperature=1.0, seed=seed, n=10, max_tokens=64,
        )
        for seed in range(10)
    ])
    contents = [choice.message.content for r in responses for choice in r.choices]
    assert [choice.finish_reason for r in responses for choice in r.choices] == ["stop"] * 100
    for content in contents:
        jsonschema.validate(json.loads(content), SCHEMA)
    assert len(set(contents)) > 90  # sampled


@pytest.mark.asyncio
async def test_the_openai_sdks_parse_with_a_pydantic_model(app):
    completion = await sdk(app).chat.completions.parse(model=MODEL, messages=HELLO, response_format=Person, temperature=0, max_tokens=64)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and completion.choices[0].finish_reason == "stop"
    assert Person.model_validate_json(completion.choices[0].message.content) == person


@pytest.mark.asyncio
async def test_json_object_mode_answers_with_the_engines_json_object(app, engine):
    body = await chat(app, response_format={"type": "json_object"}, temperature=0, max_tokens=12)
    content = body["choices"][0]["message"]["content"]
    prompt_ids = engine.tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=False)
    reference = [o async for o in engine.generate(EngineRequest(
        "reference-json-object", prompt_token_ids=engine.tokenizer(prompt_ids, add_special_tokens=False).input_ids,
        params=SamplingParams(temperature=0, max_tokens=12, guided=GuidedSpec("json_object")),
    ))]
    assert content == "".join(o.outputs[0].text for o in reference)
    assert content.startswith("{")


@pytest.mark.parametrize("field", [
    {"structured_outputs": {"json": SCHEMA}},
    {"structured_outputs": {"json": json.dumps(SCHEMA)}},
    {"guided_json": SCHEMA},
    {"guided_json": json.dumps(SCHEMA)},
    {"response_format": json_schema_format()},
])
@pytest.mark.asyncio
async def test_every_way_to_send_a_schema_on_completions_gives_the_same_document(app, field):
    body = await complete(app, temperature=1.0, seed=3, max_tokens=64, **field)
    reference = await complete(app, temperature=1.0, seed=3, max_tokens=64, guided_json=SCHEMA)
    text = body["choices"][0]["text"]
    assert text == reference["choices"][0]["text"] and body["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("field, value, check", [
    ("regex", r"[a-f]{4}-[0-9]{2}", lambda text: re.fullmatch(r"[a-f]{4}-[0-9]{2}", text)),
    ("choice", ["red", "green", "light blue"], lambda text: text in ("red", "green", "light blue")),
    ("grammar", 'root ::= "(" digit ")" | "(" digit "+" digit ")"\ndigit ::= [0-9]', lambda text: re.fullmatch(r"\([0-9](\+[0-9])?\)", text)),
])
@pytest.mark.asyncio
async def test_regex_choice_and_grammar_hold_for_every_sampled_choice(app, field, value, check):
    for body in (
        await chat(app, structured_outputs={field: value}, temperature=1.0, seed=5, n=8, max_tokens=32),
        await complete(app, **{f"guided_{field}": value}, temperature=1.0, seed=5, n=8, max_tokens=32),
    ):
        choices = body["choices"]
        texts = [c["message"]["content"] if "message" in c else c["text"] for c in choices]
        assert all(check(t) for t in texts), texts
        assert [c["finish_reason"] for c in choices] == ["stop"] * 8


@pytest.mark.asyncio
async def test_a_streamed_structured_output_adds_up_to_the_non_streamed_one(app):
    request = {"messages": HELLO, "response_format": json_schema_format(), "temperature": 1.0, "seed": 9, "max_tokens": 64}
    whole = (await chat(app, **{k: v for k, v in request.items() if k != "messages"}))["choices"][0]["message"]["content"]
    stream = await sdk(app).chat.completions.create(model=MODEL, stream=True, **request)
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.asyncio
async def test_max_tokens_cuts_the_json_and_says_length(app):
    whole = (await chat(app, response_format=json_schema_format(), temperature=0, max_tokens=64))["choices"][0]
    cut = (await chat(app, response_format=json_schema_format(), temperature=0, max_tokens=5))["choices"][0]
    assert whole["finish_reason"] == "stop" and cut["finish_reason"] == "length"
    assert whole["message"]["content"].startswith(cut["message"]["content"])
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut["message"]["content"])


@pytest.mark.asyncio
async def test_response_format_text_asks_for_nothing(app):
    free = await chat(app, temperature=0, max_tokens=8)
    text = await chat(app, response_format={"type": "text"}, temperature=0, max_tokens=8)
    assert text["choices"][0]["message"]["content"] == free["choices"][0]["message"]["content"]


@pytest.mark.asyncio
async def test_the_edge_compiles_a_schema_once_and_the_engine_uses_it(app, engine):
    schema = {"type": "object", "properties": {"once": {"type": "boolean"}}, "required": ["once"]}
    compiler = compiler_for(engine.tokenizer, engine.engine.vocab_size, tuple(engine.engine.eos_token_ids))
    before = compiler.num_compiled
    for seed in range(3):
        body = await chat(app, response_format=json_schema_format(schema), temperature=1.0, seed=seed, max_tokens=16)
        assert json.loads(body["choices"][0]["message"]["content"]) in ({"once": True}, {"once": False})
    assert compiler.num_compiled == before + 1


# ---- asking wrongly ------------------------------------------------------------------------
@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/chat/completions", {"response_format": json_schema_format({"type": "strin"})},
     "response_format.json_schema.schema", 'cannot be compiled: Unsupported type "strin"'),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "is required with response_format type json_schema"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}},
     "response_format.type", "Input should be 'text', 'json_object' or 'json_schema' (got 'xml')"),
    ("/v1/completions", {"structured_outputs": {"regex": "a("}},
     "structured_outputs.regex", "cannot be compiled: Regex parsing error at position 3: The parenthesis is not closed."),
    ("/v1/completions", {"guided_grammar": "root ::= foo"},
     "guided_grammar", 'cannot be compiled: EBNF parser error at line 1, column 10: Rule "foo" is not defined'),
    ("/v1/completions", {"guided_json": "{not json"},
     "guided_json", "the JSON schema is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    ("/v1/completions", {"guided_json": [1, 2]},
     "guided_json", "a JSON schema is an object or a boolean, got list"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}},
     "response_format.json_schema.schema", "a JSON schema is an object or a boolean, got str"),
    ("/v1/completions", {"structured_outputs": {"json": 5}},
     "structured_outputs.json", "a JSON schema is an object or a boolean, got int"),
    ("/v1/completions", {"guided_choice": []},
     "guided_choice", "choice is a JSON array of one or more non-empty strings"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
     "guided_regex", "only one structured output may be set, got response_format and guided_regex; keep one"),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "a+", "choice": ["a"]}},
     "structured_outputs.choice", "only one structured output may be set, got structured_outputs.regex and structured_outputs.choice; keep one"),
    ("/v1/chat/completions", {"guided_json": SCHEMA, "min_tokens": 3},
     "min_tokens", "cannot be combined with a structured output (the grammar decides where it ends); drop min_tokens"),
])
@pytest.mark.asyncio
async def test_a_wrong_structured_output_is_a_400_naming_the_field(app, path, body, param, message):
    base = {"messages": HELLO} if path == "/v1/chat/completions" else {"prompt": "x"}
    response = await post(app, path, {**base, **body})
    assert response.status_code == 400
    assert response.json() == {"error": {"message": f"{param}: {message}", "type": "invalid_request_error", "param": param, "code": "invalid_value"}}
