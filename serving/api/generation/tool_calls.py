"""Tool calling, before generation: what the model is shown and what it may write. How its text
becomes calls is serving/api/generation/tool_parsing.py.

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

    output text ──ToolCallStream (tool_parsing.py)──▶ content deltas and tool-call deltas
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from serving.api.protocol.wire import ChatCompletionRequest, ChatMessage, NamedToolChoice, TokenizeChatRequest, ToolDefinition, message_text
from serving.engine.errors import InvalidRequestError

__all__ = ["CLOSE_TAG", "OPEN_TAG", "ToolPlan", "plan_tools", "render_conversation", "template_knows_tools", "tool_prompt"]

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
