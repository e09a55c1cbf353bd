"""Tool calling: what the model is shown, what it may write, and how its text becomes calls.

    request.tools + tool_choice ──plan_tools()──▶ ToolPlan, or a 400 naming the field
        none       the tools are not shown; the output is text
        auto       shown; the output is free; the model's own format is parsed (config
                   `tool_calling.parser`: `hermes` <tool_call> blocks, or `json`: bare JSON calls)
        required   shown; the output is constrained to a JSON array of {"name", "arguments"}
                   objects, one per call (at most one without parallel_tool_calls)
        named      shown; the output is constrained to that function's arguments object

    messages ──render_conversation()──▶ what the chat template renders
        a template that knows tools (it mentions `tools`): `tools=` and the history's tool_calls
        and tool messages in the shape Hugging Face templates expect (arguments as objects)
        one that does not (SmolLM2's): kvrelay's tool prompt joins the system message, earlier
        calls are written back as the parser's format, tool results become user turns in
        <tool_response> tags

    output text ──ToolCallStream.feed()/finish()──▶ content deltas and tool-call deltas

A constrained output (required, named) cannot fail to parse: the grammar allows nothing else,
and a call is streamed as it is written (its name once known, then its arguments in fragments).
An `auto` output is parsed as the model wrote it: <tool_call> blocks are held back until closed
and sent as one call each; text outside them streams as content; a block that does not parse, or
names a function the request did not offer, is given back as content, so nothing the model wrote
is lost. A non-streamed response is the same stream fed at once, so both carry the same calls.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Literal

from serving.api.protocol.wire import ChatCompletionRequest, ChatMessage, NamedToolChoice, TokenizeChatRequest, ToolDefinition, message_text
from serving.engine.errors import InvalidRequestError

__all__ = [
    "ToolPlan", "ToolCallStream", "ContentDelta", "CallStart", "ArgumentsDelta", "plan_tools", "render_conversation",
    "template_knows_tools", "tool_prompt", "tool_message", "tool_finish_reason", "tool_chunk_choices",
]

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"


# ---- the plan ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolPlan:
    mode: Literal["none", "auto", "required", "named"]
    tools: tuple[ToolDefinition, ...]
    parser: Literal["hermes", "json"] = "hermes"
    named: str | None = None
    parallel: bool = True

    @property
    def is_shown(self) -> bool:
        return self.mode != "none" and bool(self.tools)

    @property
    def is_constrained(self) -> bool:
        return self.mode in ("required", "named")

    def parameters(self, name: str) -> dict:
        for tool in self.tools:
            if tool.function.name == name:
                return tool.function.parameters or {"type": "object", "properties": {}}
        raise KeyError(name)

    def output_schema(self) -> dict | None:
        """The JSON schema the output is constrained to; None for free output."""
        if self.mode == "named":
            return self.parameters(self.named)
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [t.function.name]}, "arguments": self.parameters(t.function.name)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema


def plan_tools(request: ChatCompletionRequest | TokenizeChatRequest, *, parser: Literal["hermes", "json"], max_tools: int) -> ToolPlan | None:
    """The request's tool plan (None: no tools and no choice), or a 400 naming the field."""
    tools = tuple(request.tools or ())
    choice = request.tool_choice
    if not tools and choice is None:
        return None
    if len(tools) > max_tools:
        raise InvalidRequestError("tools", f"at most {max_tools} tools per request, got {len(tools)}")
    names = [t.function.name for t in tools]
    for i, tool in enumerate(tools):
        if names.index(tool.function.name) != i:
            raise InvalidRequestError(f"tools[{i}].function.name", f"{tool.function.name!r} is given twice; tool names must be unique")
        params = tool.function.parameters
        if params is not None and params.get("type", "object") != "object":
            raise InvalidRequestError(
                f"tools[{i}].function.parameters", f"must be a JSON schema of an object (\"type\": \"object\"), got type {params.get('type')!r}",
            )
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise InvalidRequestError(
                "tool_choice.function.name", f"{choice.function.name!r} is not one of the request's tools ({', '.join(names) or 'none given'})",
            )
        return ToolPlan("named", tools, parser, named=choice.function.name, parallel=request.parallel_tool_calls)
    mode = choice or "auto"
    if mode == "required" and not tools:
        raise InvalidRequestError("tool_choice", "'required' needs at least one tool in `tools`")
    return ToolPlan(mode, tools, parser, parallel=request.parallel_tool_calls)


# ---- what the template renders -----------------------------------------------------------------
def template_knows_tools(template: str | None) -> bool:
    """Whether a chat template renders `tools` itself (Hugging Face templates that support tool
    calling read a variable of that name)."""
    return template is not None and "tools" in template


def tool_prompt(plan: ToolPlan) -> str:
    """kvrelay's description of the tools and of the calling format, for templates without one."""
    listed = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in plan.tools)
    if plan.parser == "json":
        how = ('To call a function, answer with only a JSON object holding its "name" and its "arguments", '
               'for example {"name": "function_name", "arguments": {"argument": "value"}}; for several calls, '
               'a JSON array of such objects.')
    else:
        how = ('To call a function, write a JSON object holding its "name" and its "arguments" between '
               f'{OPEN_TAG} and {CLOSE_TAG}, one block per call, for example:\n'
               f'{OPEN_TAG}\n{{"name": "function_name", "arguments": {{"argument": "value"}}}}\n{CLOSE_TAG}')
    return f"You can call functions to answer. The functions, one JSON object each:\n<tools>\n{listed}\n</tools>\n{how}"


def _arguments(message: ChatMessage, i: int, j: int) -> dict:
    text = message.tool_calls[j].function.arguments
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"messages[{i}].tool_calls[{j}].function.arguments", f"is not JSON: {exc.msg}") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"messages[{i}].tool_calls[{j}].function.arguments", "must be a JSON object")
    return value


def _check_history(messages: list[ChatMessage]) -> None:
    for i, m in enumerate(messages):
        if m.tool_calls and m.role != "assistant":
            raise InvalidRequestError(f"messages[{i}].tool_calls", f"only assistant messages carry tool calls, this one is {m.role!r}")
        if m.role == "tool" and not m.tool_call_id:
            raise InvalidRequestError(f"messages[{i}].tool_call_id", "a tool message must name the call it answers (tool_call_id)")


def render_conversation(messages: list[ChatMessage], plan: ToolPlan | None, *, knows_tools: bool) -> tuple[list[dict], dict]:
    """(conversation, extra template kwargs) for `apply_chat_template`."""
    _check_history(messages)
    show = plan is not None and plan.is_shown
    conversation = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        text = message_text(m, i)
        if knows_tools:
            entry: dict = {"role": role, "content": text}
            if m.tool_calls:
                entry["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _arguments(m, i, j)}}
                    for j, c in enumerate(m.tool_calls)
                ]
            if m.role == "tool":
                entry["tool_call_id"] = m.tool_call_id
            conversation.append(entry)
            continue
        if m.tool_calls:
            calls = [{"name": c.function.name, "arguments": _arguments(m, i, j)} for j, c in enumerate(m.tool_calls)]
            text = (text + "\n" if text else "") + _written(calls, plan.parser if plan else "hermes")
        if m.role == "tool":
            role, text = "user", f"<tool_response>\n{text}\n</tool_response>"
        conversation.append({"role": role, "content": text})
    if not show:
        return conversation, {}
    if knows_tools:
        return conversation, {"tools": [t.model_dump(exclude_none=True) for t in plan.tools]}
    prompt = tool_prompt(plan)
    if conversation and conversation[0]["role"] == "system":
        conversation[0] = {"role": "system", "content": f"{conversation[0]['content']}\n\n{prompt}"}
    else:
        conversation.insert(0, {"role": "system", "content": prompt})
    return conversation, {}


def _written(calls: list[dict], parser: str) -> str:
    """Earlier calls as the model is asked to write them."""
    if parser == "json":
        return json.dumps(calls[0] if len(calls) == 1 else calls, ensure_ascii=False)
    return "\n".join(f"{OPEN_TAG}\n{json.dumps(c, ensure_ascii=False)}\n{CLOSE_TAG}" for c in calls)


# ---- from text to calls ------------------------------------------------------------------------
@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


Event = ContentDelta | CallStart | ArgumentsDelta


@dataclass
class _Call:
    name: str
    arguments: str = ""


@dataclass
class ToolCallStream:
    """One choice's output text in, content and tool-call deltas out (see the module docstring).
    `calls` and `content` hold what was sent so far."""

    plan: ToolPlan
    id_prefix: str  # call ids are `call_` + a digest of this and the call's index
    calls: list[_Call] = field(default_factory=list)
    content: str = ""
    _buffer: str = ""
    _scanner: _ArrayScanner | None = None
    _is_json: bool | None = None  # auto with the json parser: does the output start as JSON?

    def __post_init__(self) -> None:
        if self.plan.mode == "required":
            self._scanner = _ArrayScanner()

    def feed(self, text: str) -> list[Event]:
        if not text:
            return []
        if self.plan.mode == "named":
            events: list[Event] = [] if self.calls else [self._start(self.plan.named)]
            return events + [self._args(0, text)]
        if self.plan.mode == "required":
            return self._scanned(self._scanner.feed(text))
        if self.plan.mode == "none" or not self.plan.tools:
            return [self._content(text)]
        self._buffer += text
        return self._json_feed() if self.plan.parser == "json" else self._hermes_feed(final=False)

    def finish(self) -> list[Event]:
        """Whatever was held back; call once, when the output has ended."""
        if self.plan.mode == "named":
            return [] if self.calls else [self._start(self.plan.named), self._args(0, "{}")]
        if self.plan.mode == "required" or self.plan.mode == "none" or not self.plan.tools:
            return []
        if self.plan.parser == "json":
            text, self._buffer = self._buffer, ""
            if not text:
                return []
            calls = _parse_calls(text, self.plan)
            return self._whole_calls(calls) if calls else [self._content(text)]
        return self._hermes_feed(final=True)

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    # -- auto, hermes: <tool_call>{...}</tool_call> blocks
    def _hermes_feed(self, *, final: bool) -> list[Event]:
        events: list[Event] = []
        while self._buffer:
            start = self._buffer.find(OPEN_TAG)
            if start < 0:
                keep = 0 if final else _partial_suffix(self._buffer, OPEN_TAG)
                cut = len(self._buffer) - keep
                if cut:
                    events.append(self._content(self._buffer[:cut]))
                self._buffer = self._buffer[cut:]
                break
            if start:
                events.append(self._content(self._buffer[:start]))
                self._buffer = self._buffer[start:]
            end = self._buffer.find(CLOSE_TAG)
            if end < 0:
                if final:  # never closed: parse what is there, else give it back as text
                    calls = _parse_calls(self._buffer[len(OPEN_TAG):], self.plan)
                    events += self._whole_calls(calls) if calls else [self._content(self._buffer)]
                    self._buffer = ""
                break
            block = self._buffer[: end + len(CLOSE_TAG)]
            self._buffer = self._buffer[end + len(CLOSE_TAG):]
            calls = _parse_calls(block[len(OPEN_TAG): -len(CLOSE_TAG)], self.plan)
            events += self._whole_calls(calls) if calls else [self._content(block)]
        return events

    # -- auto, json: the whole output is a call (or a list of calls), or it is text
    def _json_feed(self) -> list[Event]:
        if self._is_json is None:
            stripped = self._buffer.lstrip()
            if not stripped:
                return []
            self._is_json = stripped[0] in "{["
        if self._is_json:
            return []  # held until the end: only a whole output parses
        text, self._buffer = self._buffer, ""
        return [self._content(text)]

    def _whole_calls(self, calls: list[tuple[str, str]]) -> list[Event]:
        events: list[Event] = []
        for name, arguments in calls:
            events.append(self._start(name))
            events.append(self._args(len(self.calls) - 1, arguments))
        return events

    def _scanned(self, found: list[tuple[str, int, str]]) -> list[Event]:
        events: list[Event] = []
        for kind, index, text in found:
            events.append(self._start(text) if kind == "name" else self._args(index, text))
        return events

    def _start(self, name: str) -> CallStart:
        self.calls.append(_Call(name))
        return CallStart(len(self.calls) - 1, _call_id(self, len(self.calls) - 1), name)

    def _args(self, index: int, text: str) -> ArgumentsDelta:
        self.calls[index].arguments += text
        return ArgumentsDelta(index, text)

    def _content(self, text: str) -> ContentDelta:
        self.content += text
        return ContentDelta(text)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held back: the tag may follow)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _parse_calls(text: str, plan: ToolPlan) -> list[tuple[str, str]]:
    """[(name, arguments JSON)] of a JSON call or list of calls naming the request's tools; [] if
    it is not one (the caller keeps it as text)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    items = value if isinstance(value, list) else [value]
    names = {t.function.name for t in plan.tools}
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return []
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return []
        if not isinstance(arguments, dict):
            return []
        calls.append((item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls


class _ArrayScanner:
    """Follows a streamed JSON array of {"name": ..., "arguments": {...}} objects (what a
    `required` choice is constrained to) character by character, and says as soon as it can:
    ("name", i, name) when call i's name is complete, ("args", i, text) for each new piece of
    its arguments. Arguments written before the name are held until the name is known."""

    def __init__(self) -> None:
        self.buf = ""
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.string_start = 0
        self.element = -1
        self.key: str | None = None  # the depth-2 key whose value is being read
        self.pending_key: str | None = None
        self.expect_key = False
        self.named: dict[int, bool] = {}
        self.args: dict[int, list[int]] = {}  # element -> [start, end or -1, sent up to]

    def feed(self, text: str) -> list[tuple[str, int, str]]:
        out: list[tuple[str, int, str]] = []
        start = len(self.buf)
        self.buf += text
        for i in range(start, len(self.buf)):
            c = self.buf[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    self._string_done(json.loads(self.buf[self.string_start: i + 1]), out)
                continue
            if c == '"':
                self.in_string, self.string_start = True, i
            elif c in "{[":
                self.depth += 1
                if self.depth == 2 and c == "{":
                    self.element += 1
                    self.expect_key, self.key = True, None
                elif self.depth == 3 and self.key == "arguments" and self.element not in self.args:
                    self.args[self.element] = [i, -1, i]
            elif c in "}]":
                if self.depth == 3 and self.key == "arguments" and self.element in self.args:
                    self.args[self.element][1] = i + 1
                self.depth -= 1
            elif c == ":" and self.depth == 2:
                self.key, self.expect_key = self.pending_key, False
            elif c == "," and self.depth == 2:
                self.key, self.expect_key = None, True
        for element, span in self.args.items():
            if not self.named.get(element):
                continue
            end = span[1] if span[1] >= 0 else len(self.buf)
            if end > span[2]:
                out.append(("args", element, self.buf[span[2]:end]))
                span[2] = end
        return out

    def _string_done(self, value: str, out: list) -> None:
        if self.depth != 2:
            return
        if self.expect_key:
            self.pending_key = value
        elif self.key == "name" and not self.named.get(self.element):
            self.named[self.element] = True
            out.append(("name", self.element, value))


# ---- into OpenAI's shapes ----------------------------------------------------------------------
def tool_message(stream: ToolCallStream) -> dict:
    """A non-streamed choice's `message`: content (null when it is only calls) and `tool_calls`."""
    message: dict = {"role": "assistant", "content": stream.content if stream.content.strip() or not stream.calls else None, "refusal": None}
    if stream.calls:
        message["tool_calls"] = [
            {"id": _call_id(stream, i), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(stream.calls)
        ]
    return message


def tool_finish_reason(stream: ToolCallStream, reason: str | None) -> str | None:
    """`tool_calls` when the output ended by itself with calls; `length` stays `length`: a call
    cut by max_tokens may be incomplete, and the client must know."""
    return "tool_calls" if stream.calls and reason == "stop" else reason


def _call_id(stream: ToolCallStream, index: int) -> str:
    digest = hashlib.sha256(f"{stream.id_prefix}:{index}".encode()).hexdigest()[:24]
    return f"call_{digest}"


def tool_chunk_choices(stream: ToolCallStream, delta, logprobs_of=None) -> list[dict]:
    """The `choices[0]` of each chunk one output delta becomes (`delta`: a ChoiceDelta; its
    logprobs, when asked, ride on its first chunk)."""
    events = stream.feed(delta.text)
    if delta.finish_reason is not None:
        events += stream.finish()
    choices = []
    for event in events:
        if isinstance(event, ContentDelta):
            body: dict = {"content": event.text}
        elif isinstance(event, CallStart):
            body = {"tool_calls": [{"index": event.index, "id": event.id, "type": "function", "function": {"name": event.name, "arguments": ""}}]}
        else:
            body = {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
        choices.append({"index": delta.index, "delta": body, "logprobs": None, "finish_reason": None})
    if logprobs_of is not None and delta.logprobs:
        if not choices:
            choices.append({"index": delta.index, "delta": {}, "logprobs": None, "finish_reason": None})
        choices[0]["logprobs"] = {"content": logprobs_of(delta.logprobs)}
    if delta.finish_reason is not None:
        choices.append({"index": delta.index, "delta": {}, "logprobs": None, "finish_reason": tool_finish_reason(stream, delta.finish_reason)})
    return choices
