"""POST /v1/chat/completions: a chat request rendered through the model's chat template (with its
tools, serving/api/generation/tool_calls.py), fitted into the context window (serving/api/generation/context_budget.py),
admitted by its key's limits, and answered as chat.completion or a stream of chat.completion.chunk.
`ChatEndpoint.start` takes a request up to its deltas; /v1/responses runs through it too
(serving/api/endpoints/responses.py). The ingress's checks before it are serving/api/endpoints/routes.py's."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi.responses import Response

from serving.api.admission import limits
from serving.api.endpoints.calls import Call
from serving.api.endpoints.collect import Choices, answer
from serving.api.endpoints.context import EndpointContext
from serving.api.endpoints.http_io import chain_deltas, finite_logprob, first_delta, parse_body, sse_response
from serving.api.endpoints.responses import StartedChat
from serving.api.generation import context_budget
from serving.api.generation.chat_template import render_off_loop, template_kwargs
from serving.api.generation.pipeline import ChoiceDelta, Usage
from serving.api.generation.tool_calls import ToolPlan, plan_tools
from serving.api.generation.tool_parsing import ToolCallStream, tool_chunk_choices, tool_finish_reason, tool_message
from serving.api.protocol.field_support import CHAT_FIELDS, screen
from serving.api.protocol.prompt_scores import vllm_prompt_logprobs
from serving.api.protocol.structured import guided_param
from serving.api.protocol.wire import ChatCompletionRequest, sampling_params
from serving.api.usage import RequestAccount
from serving.engine.errors import InvalidRequestError
from serving.engine.outputs import TokenLogprob
from serving.engine.params import GuidedSpec, SamplingParams
from serving.observability import tracing

__all__ = ["ChatEndpoint"]


class ChatEndpoint:
    """The chat handler of one OpenAIServer, over its EndpointContext."""

    def __init__(self, ctx: EndpointContext):
        self.ctx = ctx

    async def __call__(self, body: dict, call: Call) -> Response:
        request = parse_body(ChatCompletionRequest, body)
        call.headers.update(screen(request, CHAT_FIELDS))
        started = await self.start(request, call)
        params, deltas = started.params, started.deltas
        base = {"id": call.request_id, "created": int(time.time()), "model": self.ctx.model_name, "system_fingerprint": None}
        want_logprobs = params.logprobs is not None
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            first = await first_delta(deltas)
            chunks = self._chat_chunks(base, first, deltas, params.n, call.account, include_usage, want_logprobs, started.tools)
            return sse_response(chunks, deltas, call.finish, call.request_id)
        choices = Choices.starting_with([""] * params.n)

        def response(usage: dict | None) -> dict:
            return self._completion(request, started, base, choices, usage)

        return await answer(deltas, choices, call, response)

    def _completion(self, request: ChatCompletionRequest, started: StartedChat, base: dict, choices: Choices, usage: dict | None) -> dict:
        """The chat.completion of what the choices hold."""
        want_logprobs = started.params.logprobs is not None
        out = []
        for i in range(started.params.n):
            message, reason = self._message(started.tools, f"{base['id']}-{i}", choices.texts[i], choices.finish[i])
            logprobs = {"content": self._chat_logprobs(choices.logprobs[i])} if want_logprobs else None
            out.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason})
        body = {**base, "object": "chat.completion", "choices": out, "usage": usage}
        if request.prompt_logprobs is not None:
            scores = next((s for s in reversed(choices.prompt_scores) if s is not None), None)
            body["prompt_logprobs"] = vllm_prompt_logprobs(self.ctx.frontend, started.prompt_ids, scores, request.prompt_logprobs)
        return body

    @staticmethod
    def _message(tools: ToolPlan | None, call_id_prefix: str, text: str, finish: str | None) -> tuple[dict, str | None]:
        """A choice's `message` and finish reason: its text, or the tool calls in it."""
        if tools is None:
            return {"role": "assistant", "content": text, "refusal": None}, finish
        calls = ToolCallStream(tools, call_id_prefix)
        calls.feed(text)
        calls.finish()
        return tool_message(calls), tool_finish_reason(calls, finish)

    async def start(self, request: ChatCompletionRequest, call: Call) -> StartedChat:
        """A chat request up to its deltas: checked, rendered and fitted into the context window,
        validated, admitted by its key's limits, generating. /v1/responses runs through here too."""
        ctx = self.ctx
        lora = await ctx.models.resolve(request.model, call.key)
        limits.check_request(request, 1, ctx.config.api)
        tools, params, guided_from = self._plan(request)
        ctx.set_deadline(call, request.timeout)
        kwargs = template_kwargs(request.chat_template_kwargs, ctx.config.api)
        info = await ctx.frontend.model_info()
        max_tokens_param = limits.max_tokens_param(request)
        budget = context_budget.budget_for(
            truncation=request.truncation, truncate_prompt_tokens=request.truncate_prompt_tokens, max_tokens=params.max_tokens,
            max_tokens_param=max_tokens_param, max_model_len=info.max_model_len, config=ctx.config.api.context_budget,
        )
        with tracing.stage(call.trace, "tokenize"):
            fitted = await self._render(request, kwargs, budget, tools)
            prompt_ids = fitted.prompt_ids
            await ctx.frontend.validate(prompt_ids, params)
            if params.guided is not None:
                await ctx.frontend.check_guided(params.guided, guided_from)
        [params] = limits.fit_max_tokens(params, [len(prompt_ids)], info.max_model_len, ctx.config.api, param=max_tokens_param)
        ctx.admit(call, [prompt_ids], [params])
        call.headers.update(fitted.headers())
        ctx.traced(call)
        usage = Usage(dropped_messages=fitted.dropped_messages, dropped_tokens=fitted.dropped_tokens)
        call.account.track(lambda: usage)
        deltas = ctx.frontend.generate(
            call.request_id, prompt_ids, params, usage, priority=call.priority, cache_salt=request.cache_salt,
            session=request.user, trace=call.trace, record=call.record, lora_name=lora, lora_path=ctx.models.path_of(lora),
        )
        deltas = ctx.watched(call, deltas, prompt_tokens=len(prompt_ids))
        return StartedChat(prompt_ids, params, deltas, tools if tools is not None and tools.is_shown else None)

    def _plan(self, request: ChatCompletionRequest) -> tuple[ToolPlan | None, SamplingParams, str | None]:
        """Its tool plan, its sampling params (a constrained tool choice's grammar in them) and the
        field its structured output came from."""
        params = sampling_params(request)
        tooling = self.ctx.config.tool_calling
        tools = plan_tools(request, parser=tooling.parser, max_tools=tooling.max_tools)
        guided_from = guided_param(request) if params.guided is not None else None
        if tools is not None and tools.is_constrained:  # required / named: the calls' own grammar
            if guided_from is not None:
                raise InvalidRequestError(guided_from, f"cannot be combined with tool_choice {tools.mode!r}, which constrains the output itself; drop one")
            params = replace(params, guided=GuidedSpec.json_schema(tools.output_schema()))
            guided_from = "tools"
        return tools, params, guided_from

    async def _render(self, request: ChatCompletionRequest, kwargs: dict, budget: context_budget.Budget,
                      tools: ToolPlan | None) -> context_budget.Fitted:
        """The messages through the chat template, fitted into the context window, off the loop."""
        ctx = self.ctx
        tool_prompt = ctx.config.tool_calling.prompt
        return await render_off_loop(
            lambda: context_budget.fit_chat(budget, request.messages, lambda messages: ctx.frontend.encode_chat(
                messages, add_generation_prompt=request.add_generation_prompt, chat_template_kwargs=kwargs,
                tools=tools, tool_prompt=tool_prompt,
            )),
            ctx.config.api.render_timeout_s,
            param="chat_template_kwargs.chat_template" if "chat_template" in kwargs else "messages",
        )

    async def _chat_chunks(
        self, base: dict, first: ChoiceDelta | None, deltas: AsyncIterator[ChoiceDelta], n: int,
        account: RequestAccount, include_usage: bool, want_logprobs: bool, tools: ToolPlan | None = None,
    ) -> AsyncIterator[dict]:
        base = {**base, "object": "chat.completion.chunk"}
        extra = {"usage": None} if include_usage else {}
        for i in range(n):
            yield {**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}], **extra}
        if tools is not None:
            calls = [ToolCallStream(tools, f"{base['id']}-{i}") for i in range(n)]
            async for delta in chain_deltas(first, deltas):
                for choice in tool_chunk_choices(calls[delta.index], delta, self._chat_logprobs if want_logprobs else None):
                    yield {**base, "choices": [choice], **extra}
            if include_usage:
                yield {**base, "choices": [], "usage": account.settle()}
            return
        async for delta in chain_deltas(first, deltas):
            choice: dict[str, Any] = {"index": delta.index, "delta": {}, "logprobs": None, "finish_reason": delta.finish_reason}
            if delta.text:
                choice["delta"] = {"content": delta.text}
            if want_logprobs and delta.logprobs:
                choice["logprobs"] = {"content": self._chat_logprobs(delta.logprobs)}
            if not delta.text and delta.finish_reason is None and choice["logprobs"] is None:
                continue  # held back by the detokenizer or a possible stop string
            yield {**base, "choices": [choice], **extra}
        if include_usage:
            yield {**base, "choices": [], "usage": account.settle()}

    def _chat_logprobs(self, logprobs: list[TokenLogprob]) -> list[dict]:
        entries = []
        for lp in logprobs:
            entry = self._token_entry(lp.token_id, lp.logprob)
            entry["top_logprobs"] = [self._token_entry(t, v) for t, v in lp.top]
            entries.append(entry)
        return entries

    def _token_entry(self, token_id: int, logprob: float) -> dict:
        text = self.ctx.frontend.token_text(token_id)
        return {"token": text, "logprob": finite_logprob(logprob), "bytes": list(self.ctx.frontend.token_bytes(token_id))}
