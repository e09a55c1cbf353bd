"""POST /v1/responses: OpenAI's Responses API for text in and text out, served by the chat pipeline.

    ResponsesRequest ──chat_request()──▶ ChatCompletionRequest ──start_chat──▶ deltas ──▶ `response`
      instructions        → a system message, first                  (ChatEndpoint.start:        or its
      input: a string     → a user message                            model check, limits, deadline,  SSE
             or items     → messages (role + text parts)              template, context budget,       events
      max_output_tokens   → max_tokens                                validation, rate limits,
      truncation, temperature, top_p, user                            metrics: exactly chat's)
      vLLM's seed, stop, stop_token_ids; kvrelay's priority, timeout

Auth, the priority a key's tier allows and graceful degradation come from the route's guard, as for
chat. An error before generation that names a chat field names the Responses field instead
(`max_tokens` → `max_output_tokens`, `messages` → `input`). What the API has and kvrelay does not
do (tools, stored responses, `text.format` other than text, ...) is a 400 naming the field
(serving/api/protocol/field_support.py RESPONSES_FIELDS); an input item other than a message, or a content
part other than text, is a 400 naming `input[i]...`.

The response: `status` "completed", or "incomplete" with `incomplete_details.reason`
"max_output_tokens" when the output was cut at max_output_tokens (or at the context window);
`output` is one assistant message with one `output_text` part; `usage` has input_tokens (with
`input_tokens_details.cached_tokens`, and what fitting the context dropped:
serving/api/generation/context_budget.py), output_tokens and total_tokens. Streamed, OpenAI's events, each
`event: <type>` + `data: {..., "type", "sequence_number"}`, numbered from 0:

    response.created, response.in_progress        the response, status in_progress, no output yet
    response.output_item.added                    the message, status in_progress, no content yet
    response.content_part.added                   its output_text part, empty
    response.output_text.delta ...                the text as it is generated
    response.output_text.done, response.content_part.done, response.output_item.done
    response.completed | response.incomplete      the whole response, with usage

A failure before the first event is an HTTP status, as on chat; after it, a `response.failed` event
(status failed, `error` {code, message} as a 5xx body would say it, a timeout's code "timeout") ends
the stream. No `data: [DONE]` follows (OpenAI sends none here). Past its deadline unstreamed, the
408's `partial` is the response so far, status "incomplete", `incomplete_details.reason` "timeout".
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from serving.api.endpoints.http_io import chain_deltas, first_delta, parse_body, sse_response
from serving.api.errors import APIError, RequestTimeoutError, to_api_error
from serving.api.generation.pipeline import ChoiceDelta
from serving.api.generation.tool_calls import ToolPlan
from serving.api.protocol.field_support import RESPONSES_FIELDS, screen
from serving.api.protocol.wire import ChatCompletionRequest, with_example
from serving.config import ContextBudgetConfig
from serving.engine.errors import InvalidRequestError
from serving.engine.params import SamplingParams

__all__ = ["ResponsesRequest", "ResponsesEndpoint", "StartedChat", "StartChat"]


@dataclass
class StartedChat:
    """A chat request as ChatEndpoint.start hands it back, generating: its prompt ids (as
    fitted into the context window), its params (max_tokens resolved) and its deltas."""

    prompt_ids: list[int]
    params: SamplingParams
    deltas: AsyncIterator[ChoiceDelta]
    tools: ToolPlan | None = None  # shown to the model: its output is parsed for calls


# What the handler is given to run a chat: ChatEndpoint.start (serving/api/endpoints/chat.py).
StartChat = Callable[[ChatCompletionRequest, Any], Awaitable[StartedChat]]

_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text")
_RENAMED = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens", "messages": "input"}
_RENAMED_WORDS = re.compile(r"\bmax_(?:completion_)?tokens\b")


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class InputPart(_Lenient):
    type: str
    text: str | None = None


class InputItem(_Lenient):
    type: str | None = None  # "message" when left out, as OpenAI's easy input messages
    role: str | None = None
    content: str | list[InputPart] | None = None


class ResponsesRequest(_Lenient):
    model_config = with_example({"input": "Say hello.", "max_output_tokens": 8})
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    # vLLM's and kvrelay's extensions, as on chat
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    priority: int = 0
    cache_salt: str | None = None
    timeout: float | None = Field(None, gt=0, allow_inf_nan=False)

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request this one is, or an InvalidRequestError naming the input that is not text."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        elif not self.input:
            raise InvalidRequestError("input", "must hold at least one message")
        for i, item in enumerate(self.input if isinstance(self.input, list) else []):
            messages.append({"role": _role(item, i), "content": _text(item, i)})
        return ChatCompletionRequest(
            model=self.model, messages=messages, max_tokens=self.max_output_tokens, temperature=self.temperature,
            top_p=self.top_p, truncation=self.truncation, user=self.user, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, priority=self.priority, cache_salt=self.cache_salt, timeout=self.timeout,
        )


def _role(item: InputItem, i: int) -> str:
    if item.type not in (None, "message"):
        raise InvalidRequestError(f"input[{i}].type", f"only message items are supported here, got {item.type!r}")
    if item.role not in _ROLES:
        raise InvalidRequestError(f"input[{i}].role", f"must be one of {', '.join(_ROLES)}, got {item.role!r}")
    return item.role


def _text(item: InputItem, i: int) -> str:
    if item.content is None:
        raise InvalidRequestError(f"input[{i}].content", "is required")
    if isinstance(item.content, str):
        return item.content
    texts = []
    for j, part in enumerate(item.content):
        if part.type not in _TEXT_PARTS or part.text is None:
            raise InvalidRequestError(
                f"input[{i}].content[{j}].type", f"only text parts ({', '.join(_TEXT_PARTS)}) are supported, got {part.type!r}",
            )
        texts.append(part.text)
    return "".join(texts)


class ResponsesEndpoint:
    """The /v1/responses handler: `(body, call) -> Response`, as the chat and completion handlers."""

    def __init__(self, start_chat: StartChat, model_name: str, budget: ContextBudgetConfig):
        self.start_chat = start_chat
        self.model_name = model_name
        self.budget = budget

    async def __call__(self, body: dict, call) -> Response:
        request = parse_body(ResponsesRequest, body)
        call.headers.update(screen(request, RESPONSES_FIELDS))
        try:
            started = await self.start_chat(request.chat_request(), call)
        except Exception as exc:
            error = to_api_error(exc)
            if error.status >= 500 or error.param not in _RENAMED:
                raise
            raise APIError(
                error.status, _RENAMED_WORDS.sub("max_output_tokens", error.message), type=error.type,
                param=_RENAMED[error.param], code=error.code, headers=error.headers,
            ) from exc
        params, deltas = started.params, started.deltas
        shape = _Shape(request, call.request_id, self.model_name, params, request.truncation or self.budget.truncation)
        if request.stream:
            first = await first_delta(deltas)
            return sse_response(
                shape.events(first, deltas, call.account), deltas, call.finish, call.request_id,
                typed_events=True, failure_event=shape.failed,
            )
        try:
            async for delta in deltas:
                shape.add(delta)
        except RequestTimeoutError as exc:
            usage = call.account.settle_if_generated()
            if usage is not None:
                exc.partial = shape.response("incomplete", [shape.message("incomplete")], usage, reason="timeout")
            raise
        usage = call.account.settle()
        return JSONResponse(shape.response(shape.status, [shape.message(shape.status)], usage), headers=call.account.headers())


class _Shape:
    """One response's text so far and its JSON shapes."""

    def __init__(self, request: ResponsesRequest, response_id: str, model_name: str, params: SamplingParams, truncation: str):
        self.request = request
        self.id = response_id
        self.message_id = "msg_" + response_id.removeprefix("resp_")
        self.model_name = model_name
        self.params = params
        self.truncation = truncation
        self.created_at = int(time.time())
        self.text = ""
        self.finish_reason: str | None = None
        self._sequence = itertools.count()

    def add(self, delta: ChoiceDelta) -> None:
        self.text += delta.text
        self.finish_reason = delta.finish_reason or self.finish_reason

    @property
    def status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    def part(self) -> dict:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}

    def message(self, status: str, content: list[dict] | None = None) -> dict:
        return {
            "id": self.message_id, "type": "message", "role": "assistant", "status": status,
            "content": [self.part()] if content is None else content,
        }

    def response(self, status: str, output: list[dict], usage: dict | None, *, reason: str | None = None,
                 error: dict | None = None) -> dict:
        extra = self.request.model_extra or {}
        if status == "incomplete" and reason is None:
            reason = "max_output_tokens"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "completed_at": int(time.time()) if status == "completed" else None,
            "error": error, "incomplete_details": {"reason": reason} if reason is not None else None,
            "instructions": self.request.instructions, "max_output_tokens": self.request.max_output_tokens,
            "max_tool_calls": None, "metadata": extra.get("metadata") or {}, "model": self.model_name,
            "output": output, "parallel_tool_calls": extra.get("parallel_tool_calls", True),
            "previous_response_id": None, "reasoning": None, "service_tier": "default", "store": False,
            "temperature": self.params.temperature, "text": {"format": {"type": "text"}},
            "tool_choice": extra.get("tool_choice") or "auto", "tools": [], "top_logprobs": 0,
            "top_p": self.params.top_p, "truncation": self.truncation, "usage": _usage(usage), "user": self.request.user,
        }

    def event(self, type: str, **fields) -> dict:
        return {"type": type, "sequence_number": next(self._sequence), **fields}

    async def events(self, first: ChoiceDelta | None, deltas: AsyncIterator[ChoiceDelta], account) -> AsyncIterator[dict]:
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        yield self.event("response.created", response=self.response("in_progress", [], None))
        yield self.event("response.in_progress", response=self.response("in_progress", [], None))
        yield self.event("response.output_item.added", output_index=0, item=self.message("in_progress", []))
        yield self.event("response.content_part.added", **where, part=self.part())
        async for delta in chain_deltas(first, deltas):
            self.add(delta)
            if delta.text:
                yield self.event("response.output_text.delta", **where, delta=delta.text, logprobs=[])
        status = self.status
        yield self.event("response.output_text.done", **where, text=self.text, logprobs=[])
        yield self.event("response.content_part.done", **where, part=self.part())
        item = self.message(status)
        yield self.event("response.output_item.done", output_index=0, item=item)
        yield self.event(f"response.{status}", response=self.response(status, [item], account.settle()))

    def failed(self, error_body: dict) -> dict:
        """The event a failure after the first event becomes (sse_response's failure_event)."""
        error = error_body["error"]
        response = self.response(
            "failed", [self.message("incomplete")], None, error={"code": error["code"] or error["type"], "message": error["message"]},
        )
        return self.event("response.failed", response=response)


def _usage(usage: dict | None) -> dict | None:
    """Chat's usage object in the Responses API's names (cost and currency kept when priced)."""
    if usage is None:
        return None
    shaped = {
        "input_tokens": usage["prompt_tokens"], "input_tokens_details": dict(usage["prompt_tokens_details"]),
        "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }
    return shaped | {k: usage[k] for k in ("cost", "currency") if k in usage}
