"""Which OpenAI request fields kvrelay implements, per endpoint, and what it does with the others.

    body ─parse_body─▶ wire model ─screen(request, TABLE)─┬─▶ 400 unsupported_parameter naming a known
                                                          │   field that asks for what kvrelay cannot do
                                                          └─▶ x-kvrelay-ignored-fields: the unknown fields,
                                                              and the known ones it accepts without effect

A field of a wire model (serving/api/protocol/wire.py, serving/api/endpoints/responses.py) is implemented. Any
other field lands in the model's extras and is looked up in its endpoint's table below:

    Unsupported(reason, accepts)  refused with a 400 naming it, unless its value asks nothing of the
                                  server (`accepts`: null always; per field e.g. store false,
                                  modalities ["text"], service_tier "auto")
    NoOp(reason)                  accepted without effect, for the reason given; named in the header
                                  when set (not null)
    (not in the table)            unknown: accepted, as OpenAI accepts them, and named in the header

Where the line is drawn (as vLLM draws it): a field that would change what the model writes, or
what the server keeps, and that kvrelay does not do, is refused, so a client never takes a 200 for
what it asked; a field that only labels, routes or bills a request at OpenAI is a no-op here.
Unknown fields nested in known objects are named by path (`messages[0].foo`).

The header is bounded: names of at most 64 characters of [A-Za-z0-9_-] per key, at most
MAX_HEADER_CHARS characters in all; what is left out (past the bound, or a key with other
characters) is counted in a last entry `+N more`. README's API section has these tables for
readers; tests/serving/api/test_field_support.py checks that they cover every field the installed
openai SDK sends.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from serving.api.errors import APIError

__all__ = [
    "IGNORED_FIELDS_HEADER",
    "MAX_HEADER_CHARS",
    "Unsupported",
    "NoOp",
    "CHAT_FIELDS",
    "COMPLETION_FIELDS",
    "RESPONSES_FIELDS",
    "screen",
    "ignored_fields",
]

IGNORED_FIELDS_HEADER = "x-kvrelay-ignored-fields"
MAX_HEADER_CHARS = 512
_KEY = re.compile(r"[A-Za-z0-9_\-]{1,64}")


def _null(value: Any) -> bool:
    return value is None


def _null_or(*allowed: Any) -> Callable[[Any], bool]:
    # `type(...) is` so that False never passes for 0 and 1 never for True
    return lambda value: value is None or any(type(value) is type(a) and value == a for a in allowed)


@dataclass(frozen=True)
class Unsupported:
    reason: str  # the message after "field: "; says what to send instead where there is something
    accepts: Callable[[Any], bool] = _null


@dataclass(frozen=True)
class NoOp:
    reason: str


Rule = Unsupported | NoOp

_NO_STORE = Unsupported("storing is not supported: kvrelay keeps no completions (send false, or leave it out)", _null_or(False))
_SERVICE_TIER = Unsupported(
    "service tiers are not supported: a request's priority comes from its API key's tier and its `priority` "
    "(send auto or default, or leave it out)",
    _null_or("auto", "default"),
)
_MODERATION = Unsupported("moderation is not supported")
_PROMPT_CACHE = NoOp("prefix caching is automatic and the router prefix-aware; nothing to key or retain")
_SAFETY_ID = NoOp("OpenAI's abuse-monitoring id; kvrelay identifies requests by API key (and `user` for routing)")
_REASONING = NoOp(
    "the served models take no reasoning effort; a chat template that reads one gets it as "
    "chat_template_kwargs.reasoning_effort"
)

CHAT_FIELDS: dict[str, Rule] = {
    "audio": Unsupported("audio output is not supported: the served models write text"),
    "modalities": Unsupported('only ["text"] is supported', _null_or(["text"])),
    "functions": Unsupported("the deprecated `functions` is not supported; send `tools`", _null_or([])),
    "function_call": Unsupported("the deprecated `function_call` is not supported; send `tool_choice`", _null_or("none")),
    "prediction": Unsupported("predicted outputs are not supported"),
    "web_search_options": Unsupported("web search is not supported"),
    "store": _NO_STORE,
    "moderation": _MODERATION,
    "service_tier": _SERVICE_TIER,
    "metadata": NoOp("OpenAI keeps it with stored completions; kvrelay stores none"),
    "prompt_cache_key": _PROMPT_CACHE,
    "prompt_cache_options": _PROMPT_CACHE,
    "prompt_cache_retention": _PROMPT_CACHE,
    "safety_identifier": _SAFETY_ID,
    "reasoning_effort": _REASONING,
    "verbosity": NoOp("the served models take no verbosity setting"),
}

COMPLETION_FIELDS: dict[str, Rule] = {
    "best_of": Unsupported("best_of is not supported (nor by vLLM's v1 engine); send n and choose", _null_or(1)),
}

_NO_STORED_RESPONSES = "kvrelay stores no responses: send the whole conversation as `input`"
RESPONSES_FIELDS: dict[str, Rule] = {
    "tools": Unsupported("tools are not supported in /v1/responses; /v1/chat/completions takes them", _null_or([])),
    "tool_choice": Unsupported("only none and auto (with no tools) are supported in /v1/responses", _null_or("none", "auto")),
    "parallel_tool_calls": NoOp("no tools run in /v1/responses"),
    "max_tool_calls": NoOp("no tools run in /v1/responses"),
    "previous_response_id": Unsupported(_NO_STORED_RESPONSES),
    "conversation": Unsupported(_NO_STORED_RESPONSES),
    "store": _NO_STORE,
    "background": Unsupported("background responses are not supported", _null_or(False)),
    "background_options": Unsupported("background responses are not supported"),
    "include": Unsupported("no additional output data can be included", _null_or([])),
    "prompt": Unsupported("stored prompt templates are not supported; send `instructions` and `input`"),
    "text": Unsupported(
        "only plain text output is supported in /v1/responses (JSON output: /v1/chat/completions `response_format`)",
        lambda value: value is None or (isinstance(value, dict) and value.get("format") in (None, {"type": "text"})),
    ),
    "top_logprobs": Unsupported("logprobs are not supported in /v1/responses; /v1/chat/completions has them", _null_or(0)),
    "context_management": Unsupported("server-side context management is not supported; see `truncation`", _null_or([])),
    "moderation": _MODERATION,
    "access_programs": Unsupported("access programs are not supported"),
    "image": Unsupported("image options are not supported: the served models write text"),
    "service_tier": _SERVICE_TIER,
    "metadata": NoOp("echoed in the response; kvrelay stores none"),
    "prompt_cache_key": _PROMPT_CACHE,
    "prompt_cache_options": _PROMPT_CACHE,
    "prompt_cache_retention": _PROMPT_CACHE,
    "safety_identifier": _SAFETY_ID,
    "reasoning": _REASONING,
    "stream_options": NoOp("its one option, include_obfuscation, pads events; kvrelay sends no padding"),
}


def screen(request: BaseModel, table: Mapping[str, Rule]) -> dict[str, str]:
    """Refuse the first known field the server cannot honour (an APIError 400 naming it); else the
    response headers that name what was ignored (none when nothing was)."""
    extra = request.model_extra or {}
    for key, value in extra.items():
        rule = table.get(key)
        if isinstance(rule, Unsupported) and not rule.accepts(value):
            raise APIError(400, f"{key}: {rule.reason}", param=key, code="unsupported_parameter")
    names = ignored_fields(request, table)
    return {IGNORED_FIELDS_HEADER: _header_value(names)} if names else {}


def ignored_fields(request: BaseModel, table: Mapping[str, Rule]) -> list[str | None]:
    """The request's ignored fields, top level first, in body order: each a path, or None for a
    key that cannot go in a header."""
    names: list[str | None] = []
    for key, value in (request.model_extra or {}).items():
        rule = table.get(key)
        if rule is None or (isinstance(rule, NoOp) and value is not None):
            names.append(key if _KEY.fullmatch(key) else None)
    for name in type(request).model_fields:
        names.extend(_nested(getattr(request, name), name))
    return names


def _nested(value: Any, path: str) -> Iterator[str | None]:
    if isinstance(value, BaseModel):
        for key in value.model_extra or {}:
            yield f"{path}.{key}" if _KEY.fullmatch(key) else None
        for name in type(value).model_fields:
            yield from _nested(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, BaseModel):
                yield from _nested(item, f"{path}[{i}]")


def _header_value(names: list[str | None]) -> str:
    shown: list[str] = []
    size = 0
    for name in names:
        if name is None:
            continue
        if size + len(name) + 1 > MAX_HEADER_CHARS - len(",+999999 more"):
            break
        shown.append(name)
        size += len(name) + 1
    left = len(names) - len(shown)
    return ",".join(shown + ([f"+{left} more"] if left else []))
