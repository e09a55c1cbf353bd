"""Unknown versus unsupported fields (serving/api/protocol/field_support.py): unknown ones are accepted and
named in `x-kvrelay-ignored-fields`, known ones kvrelay does not implement are a 400 naming them,
and the tables cover every field the installed openai SDK can send."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params

from serving.api.endpoints.responses import ResponsesRequest
from serving.api.protocol.field_support import CHAT_FIELDS, COMPLETION_FIELDS, MAX_HEADER_CHARS, RESPONSES_FIELDS, NoOp, screen
from serving.api.protocol.wire import ChatCompletionRequest, CompletionRequest
from serving.config import ServeConfig
from tests.asgi import local_app
from tests.asgi import post as asgi_post

MODEL = "tiny"
HELLO = [{"role": "user", "content": "Hello there"}]
# Implemented elsewhere in issue 18 (structured outputs, tool calling): not this table's to decide.
BEING_IMPLEMENTED = {"response_format", "tools", "tool_choice", "parallel_tool_calls"}
README = Path(__file__).parents[3] / "README.md"


@pytest.fixture(scope="module")
def app(engine, tiny_model_dir):
    config = ServeConfig(model=str(tiny_model_dir), served_model_name=MODEL)
    return local_app(engine, config, MODEL)


post = functools.partial(asgi_post, model=MODEL)  # every body names the served model


# ---- the tables ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("params", "model", "table", "theirs"),
    [
        (chat_create_params.CompletionCreateParamsBase, ChatCompletionRequest, CHAT_FIELDS, BEING_IMPLEMENTED),
        (completion_create_params.CompletionCreateParamsBase, CompletionRequest, COMPLETION_FIELDS, set()),
        (response_create_params.ResponseCreateParamsBase, ResponsesRequest, RESPONSES_FIELDS, set()),
    ],
)
def test_every_field_the_openai_sdk_sends_is_implemented_or_in_the_table(params, model, table, theirs):
    sdk_fields = set(params.__annotations__)
    undecided = sdk_fields - set(model.model_fields) - set(table) - theirs
    assert undecided == set(), "decide each: a wire-model field, Unsupported or NoOp (serving/api/protocol/field_support.py)"
    assert set(table) - sdk_fields == set()  # no entry for a field OpenAI does not have
    assert set(table) & set(model.model_fields) == set()


def test_readmes_api_section_lists_every_field_of_the_tables():
    text = README.read_text()
    section = text[text.index("#### Request fields"):text.index("#### Input limits")]
    for table in (CHAT_FIELDS, COMPLETION_FIELDS, RESPONSES_FIELDS):
        for name, rule in table.items():
            rows = [line for line in section.splitlines() if re.search(rf"`{name}`", line)]
            kind = "no-op" if isinstance(rule, NoOp) else "400"
            assert any(kind in row for row in rows), f"{name} ({kind}) is not in README's request field tables"


def test_the_header_is_bounded_and_names_only_printable_keys():
    many = {f"field_{i:03d}": i for i in range(100)}
    request = ChatCompletionRequest.model_validate({"messages": HELLO, "bad\nkey": 1, **many})
    value = screen(request, CHAT_FIELDS)["x-kvrelay-ignored-fields"]
    assert len(value) <= MAX_HEADER_CHARS
    names = value.split(",")
    assert names[:2] == ["field_000", "field_001"] and "bad\nkey" not in value
    assert names[-1] == f"+{101 - (len(names) - 1)} more"


# ---- over HTTP -------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_unknown_fields_are_answered_and_named_top_level_first(app):
    response = await post(app, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi", "weight": 2}], "max_tokens": 1, "foo": 1, "bar": None,
        "metadata": {"a": "b"}, "verbosity": None, "stream_options": None,
    })
    assert response.status_code == 200, response.text
    # metadata is a no-op (named when set); verbosity is a no-op sent as null (not named)
    assert response.headers["x-kvrelay-ignored-fields"] == "foo,bar,metadata,messages[0].weight"


@pytest.mark.asyncio
async def test_a_request_with_nothing_ignored_has_no_header(app):
    response = await post(app, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "best_of": 1})
    assert response.status_code == 200
    assert "x-kvrelay-ignored-fields" not in response.headers


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "mp3"}}, "audio",
         "audio: audio output is not supported: the served models write text"),
        ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities", 'modalities: only ["text"] is supported'),
        ("/v1/chat/completions", {"store": True}, "store",
         "store: storing is not supported: kvrelay keeps no completions (send false, or leave it out)"),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions",
         "functions: the deprecated `functions` is not supported; send `tools`"),
        ("/v1/chat/completions", {"prediction": {"type": "content", "content": "x"}}, "prediction",
         "prediction: predicted outputs are not supported"),
        ("/v1/chat/completions", {"service_tier": "flex"}, "service_tier", None),
        ("/v1/chat/completions", {"web_search_options": {}}, "web_search_options", "web_search_options: web search is not supported"),
        ("/v1/completions", {"best_of": 3}, "best_of", "best_of: best_of is not supported (nor by vLLM's v1 engine); send n and choose"),
    ],
)
@pytest.mark.asyncio
async def test_a_known_field_kvrelay_does_not_implement_is_a_400_naming_it(app, path, body, param, message):
    base = {"messages": HELLO} if path == "/v1/chat/completions" else {"prompt": "Hi"}
    response = await post(app, path, {**base, "max_tokens": 1, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, "unsupported_parameter", "invalid_request_error")
    if message is not None:
        assert error["message"] == message


@pytest.mark.asyncio
async def test_values_that_ask_nothing_of_the_server_are_accepted(app):
    response = await post(app, "/v1/chat/completions", {
        "messages": HELLO, "max_tokens": 1, "store": False, "modalities": ["text"], "service_tier": "auto",
        "audio": None, "functions": None, "function_call": "none",
    })
    assert response.status_code == 200, response.text
    assert "x-kvrelay-ignored-fields" not in response.headers
