"""Tool calling, after generation: a choice's output text becomes content and tool calls, and
those become OpenAI's shapes. What the model was shown and asked to write is
serving/api/generation/tool_calls.py (the ToolPlan).

    output text ──ToolCallStream.feed()/finish()──▶ content deltas and tool-call deltas
                ──tool_chunk_choices()──▶ chat.completion.chunk choices (streamed)
                ──tool_message(), tool_finish_reason()──▶ a chat.completion choice (not streamed)

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

from serving.api.generation.tool_calls import CLOSE_TAG, OPEN_TAG, ToolPlan

__all__ = [
    "ToolCallStream", "ContentDelta", "CallStart", "ArgumentsDelta", "tool_message", "tool_finish_reason", "tool_chunk_choices",
]


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
