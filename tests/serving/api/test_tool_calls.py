"""Tool calling without a model: plans and their 400s, the constrained output's schema, what the
template is given, and output text turned into calls, streamed piece by piece or whole."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from serving.api.generation.tool_calls import plan_tools, render_conversation, template_knows_tools, tool_prompt
from serving.api.generation.tool_parsing import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ToolCallStream,
    tool_chunk_choices,
    tool_finish_reason,
    tool_message,
)
from serving.api.protocol.wire import ChatCompletionRequest, ChatMessage
from serving.engine.errors import InvalidRequestError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def plan(parser: str = "hermes", **fields):
    return plan_tools(request(**fields), parser=parser, max_tools=8)


# ---- plans -------------------------------------------------------------------------------------
def test_plans_by_tool_choice():
    assert plan() is None
    assert plan(tools=[WEATHER]).mode == "auto"
    assert plan(tools=[WEATHER], tool_choice="none").is_shown is False
    assert plan(tool_choice="auto").is_shown is False  # no tools: nothing to show
    named = plan(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert (named.mode, named.named, named.is_constrained) == ("named", "get_time", True)


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"tool_choice": "required"}, "tool_choice", "'required' needs at least one tool in `tools`"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "'nope' is not one of the request's tools (get_weather)"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "'get_weather' is given twice; tool names must be unique"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters", "must be a JSON schema of an object (\"type\": \"object\"), got type 'array'"),
    ({"tools": [TIME] * 9}, "tools", "at most 8 tools per request, got 9"),
])
def test_bad_plans_name_the_field(fields, param, message):
    with pytest.raises(InvalidRequestError) as info:
        plan(**fields)
    assert (info.value.param, info.value.message) == (param, message)


def test_a_tool_name_outside_openai_s_pattern_is_refused_by_the_wire_model():
    with pytest.raises(ValueError, match="tools.0.function.name"):
        request(tools=[{"type": "function", "function": {"name": "has space"}}])


def test_constrained_output_schemas():
    named = plan(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.output_schema() == WEATHER["function"]["parameters"]
    no_params = plan(tools=[TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert no_params.output_schema() == {"type": "object", "properties": {}}
    required = plan(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert required.output_schema() == {
        "type": "array", "minItems": 1, "maxItems": 1,
        "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"type": "string", "enum": ["get_weather"]},
                                              "arguments": WEATHER["function"]["parameters"]},
             "required": ["name", "arguments"], "additionalProperties": False},
            {"type": "object", "properties": {"name": {"type": "string", "enum": ["get_time"]},
                                              "arguments": {"type": "object", "properties": {}}},
             "required": ["name", "arguments"], "additionalProperties": False},
        ]},
    }
    assert "maxItems" not in plan(tools=[WEATHER], tool_choice="required").output_schema()
    assert plan(tools=[WEATHER]).output_schema() is None


# ---- what the template gets --------------------------------------------------------------------
HISTORY = [
    ChatMessage(role="system", content="Be brief."),
    ChatMessage(role="user", content="Weather in Paris?"),
    ChatMessage(role="assistant", content=None, tool_calls=[
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]),
    ChatMessage(role="tool", content="18 C, sunny", tool_call_id="call_1"),
]


def test_a_template_without_tools_gets_kvrelay_s_prompt_and_the_history_written_out():
    p = plan(tools=[WEATHER])
    conversation, kwargs = render_conversation(HISTORY, p, knows_tools=False)
    assert kwargs == {}
    assert conversation == [
        {"role": "system", "content": "Be brief.\n\n" + tool_prompt(p)},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"},
        {"role": "user", "content": "<tool_response>\n18 C, sunny\n</tool_response>"},
    ]
    assert tool_prompt(p).startswith("You can call functions to answer. The functions, one JSON object each:\n<tools>\n"
                                      + json.dumps(WEATHER) + "\n</tools>\n")
    # No system message of its own: the tool prompt is one.
    alone, _ = render_conversation(HISTORY[1:2], p, knows_tools=False)
    assert alone[0] == {"role": "system", "content": tool_prompt(p)}
    # tool_choice none: the history is still written out, the tools are not shown.
    hidden, _ = render_conversation(HISTORY, plan(tools=[WEATHER], tool_choice="none"), knows_tools=False)
    assert hidden[0] == {"role": "system", "content": "Be brief."}


def test_a_template_that_knows_tools_gets_them_in_hugging_face_s_shape():
    conversation, kwargs = render_conversation(HISTORY, plan(tools=[WEATHER]), knows_tools=True)
    assert kwargs == {"tools": [WEATHER]}
    assert conversation[2:] == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"},
    ]
    assert template_knows_tools("{% if tools %}...{% endif %}") and not template_knows_tools("{{ messages }}")


@pytest.mark.parametrize(("messages", "param"), [
    ([ChatMessage(role="tool", content="x")], "messages[0].tool_call_id"),
    ([ChatMessage(role="user", content="x", tool_calls=[{"id": "c", "function": {"name": "f", "arguments": "{}"}}])], "messages[0].tool_calls"),
    ([ChatMessage(role="assistant", tool_calls=[{"id": "c", "function": {"name": "f", "arguments": "{bad"}}])],
     "messages[0].tool_calls[0].function.arguments"),
])
def test_a_malformed_history_names_the_message(messages, param):
    with pytest.raises(InvalidRequestError) as info:
        render_conversation(messages, None, knows_tools=False)
    assert info.value.param == param


# ---- output text into calls --------------------------------------------------------------------
def run(stream: ToolCallStream, text: str, piece: int) -> list:
    events = []
    for i in range(0, len(text), piece):
        events += stream.feed(text[i: i + piece])
    return events + stream.finish()


def calls_of(stream: ToolCallStream) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in stream.calls]


HERMES = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_hermes_blocks_become_whole_calls_and_text_around_them_streams():
    stream = ToolCallStream(plan(tools=[WEATHER]), "req-0")
    events = run(stream, HERMES, 1)  # a character at a time: the tag is held back, never leaked
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    assert content == "Let me check.\n"
    starts = [e for e in events if isinstance(e, CallStart)]
    assert [(s.index, s.name) for s in starts] == [(0, "get_weather")] and starts[0].id.startswith("call_")
    assert [e for e in events if isinstance(e, ArgumentsDelta)] == [ArgumentsDelta(0, '{"city": "Paris"}')]


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_streamed_and_whole_outputs_carry_the_same_calls(piece):
    text = HERMES + ' and <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    whole = ToolCallStream(plan(tools=[WEATHER, TIME]), "req-0")
    run(whole, text, len(text))
    streamed = ToolCallStream(plan(tools=[WEATHER, TIME]), "req-0")
    run(streamed, text, piece)
    assert calls_of(streamed) == calls_of(whole) == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert streamed.content == whole.content == "Let me check.\n and "


def test_hermes_blocks_that_are_not_calls_stay_text():
    text = '<tool_call>not json</tool_call><tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    stream = ToolCallStream(plan(tools=[WEATHER]), "r")
    run(stream, text, 5)
    assert stream.calls == [] and stream.content == text
    # Never closed (max_tokens): parsed if it is whole JSON, else given back as text.
    open_call = ToolCallStream(plan(tools=[WEATHER]), "r")
    run(open_call, '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}', 4)
    assert calls_of(open_call) == [("get_weather", '{"city": "Oslo"}')]
    cut = ToolCallStream(plan(tools=[WEATHER]), "r")
    run(cut, '<tool_call>{"name": "get_wea', 4)
    assert (cut.calls, cut.content) == ([], '<tool_call>{"name": "get_wea')


def test_the_json_parser_reads_a_bare_call_or_a_list_and_otherwise_text():
    one = ToolCallStream(plan("json", tools=[WEATHER]), "r")
    run(one, ' {"name": "get_weather", "parameters": {"city": "Rome"}}', 2)
    assert (calls_of(one), one.content) == ([("get_weather", '{"city": "Rome"}')], "")
    two = ToolCallStream(plan("json", tools=[WEATHER, TIME]), "r")
    run(two, '[{"name": "get_time", "arguments": "{}"}, {"name": "get_weather", "arguments": {"city": "Rome"}}]', 3)
    assert calls_of(two) == [("get_time", "{}"), ("get_weather", '{"city": "Rome"}')]
    text = ToolCallStream(plan("json", tools=[WEATHER]), "r")
    events = run(text, "It is sunny.", 2)
    assert events[0] == ContentDelta("It") and text.content == "It is sunny." and text.calls == []


def test_a_named_choice_streams_its_arguments_as_written():
    stream = ToolCallStream(plan(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}), "r")
    events = run(stream, '{"city": "Lima"}', 5)
    assert events[0] == CallStart(0, events[0].id, "get_weather")
    assert [e.text for e in events[1:]] == ['{"cit', 'y": "', 'Lima"', "}"]
    assert calls_of(stream) == [("get_weather", '{"city": "Lima"}')]


@pytest.mark.parametrize("piece", [1, 2, 5, 1000])
def test_a_required_choice_is_split_into_calls_as_it_streams(piece):
    text = '[{"name": "get_weather", "arguments": {"city": "Quito, \\"EC\\"", "x": [1, {"y": 2}]}}, {"name": "get_time", "arguments": {}}]'
    stream = ToolCallStream(plan(tools=[WEATHER, TIME], tool_choice="required"), "r")
    events = run(stream, text, piece)
    assert [(e.index, e.name) for e in events if isinstance(e, CallStart)] == [(0, "get_weather"), (1, "get_time")]
    assert calls_of(stream) == [("get_weather", '{"city": "Quito, \\"EC\\"", "x": [1, {"y": 2}]}'), ("get_time", "{}")]
    assert stream.content == ""
    # Each call's start comes before any of its arguments.
    seen: set[int] = set()
    for e in events:
        if isinstance(e, CallStart):
            seen.add(e.index)
        else:
            assert e.index in seen


def test_arguments_written_before_the_name_wait_for_it():
    stream = ToolCallStream(plan(tools=[WEATHER], tool_choice="required"), "r")
    events = run(stream, '[{"arguments": {"city": "Bern"}, "name": "get_weather"}]', 4)
    assert isinstance(events[0], CallStart) and calls_of(stream) == [("get_weather", '{"city": "Bern"}')]


# ---- OpenAI's shapes ---------------------------------------------------------------------------
def test_message_and_finish_reason():
    stream = ToolCallStream(plan(tools=[WEATHER]), "req-7-0")
    run(stream, HERMES, 1000)
    message = tool_message(stream)
    assert message["content"] == "Let me check.\n"
    assert message["tool_calls"] == [{"id": message["tool_calls"][0]["id"], "type": "function",
                                      "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert tool_finish_reason(stream, "stop") == "tool_calls"
    assert tool_finish_reason(stream, "length") == "length"  # possibly cut: the client must know
    only_call = ToolCallStream(plan(tools=[WEATHER]), "r")
    run(only_call, HERMES.split("\n", 1)[1], 1000)
    assert tool_message(only_call)["content"] is None
    text = ToolCallStream(plan(tools=[WEATHER]), "r")
    run(text, "No tools needed.", 1000)
    assert tool_message(text) == {"role": "assistant", "content": "No tools needed.", "refusal": None}
    assert tool_finish_reason(text, "stop") == "stop"


def test_stream_chunks_carry_index_id_name_then_argument_fragments():
    stream = ToolCallStream(plan(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}), "r")
    first = tool_chunk_choices(stream, SimpleNamespace(index=0, text='{"city":', logprobs=None, finish_reason=None))
    last = tool_chunk_choices(stream, SimpleNamespace(index=0, text=' "Oslo"}', logprobs=None, finish_reason="stop"))
    call_id = first[0]["delta"]["tool_calls"][0]["id"]
    assert [c["delta"] for c in first + last] == [
        {"tool_calls": [{"index": 0, "id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": ' "Oslo"}'}}]},
        {},
    ]
    assert [c["finish_reason"] for c in first + last] == [None, None, None, "tool_calls"]
