"""POST /v1/chat/completions: a chat request rendered through the model's chat template (with its
tools, serving/api/generation/tool_calls.py), fitted into the context window (serving/api/generation/context_budget.py),
admitted by its key's limits, and answered as chat.completion or a stream of chat.completion.chunk.
`ChatEndpoint.start` takes a request up to its deltas; /v1/responses runs through it too
(serving/api/endpoints/responses.py). The ingress's checks before it are serving/api/endpoints/routes.py's."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse, Response

from serving.api.admission import limits
from serving.api.admission.deadlines import bounded, deadline_for
from serving.api.endpoints.calls import Call, with_partial
from serving.api.endpoints.http_io import chain_deltas, finite_logprob, first_delta, parse_body, sse_response
from serving.api.endpoints.responses import StartedChat
from serving.api.errors import RequestTimeoutError, error_status
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
from serving.engine.params import GuidedSpec
from serving.observability import tracing

if TYPE_CHECKING:
    from serving.api.endpoints.routes import OpenAIServer

__all__ = ["ChatEndpoint"]


class ChatEndpoint:
    """The chat handler of one OpenAIServer (its frontend, config, limits and metrics)."""

    def __init__(self, server: OpenAIServer):
        self.server = server

    async def __call__(self, body: dict, call: Call) -> Response:
        request = parse_body(ChatCompletionRequest, body)
        call.headers.update(screen(request, CHAT_FIELDS))
        started = await self.start(request, call)
        params, deltas, prompt_ids, tools = started.params, started.deltas, started.prompt_ids, started.tools
        request_id = call.request_id
        created = int(time.time())
        base = {"id": request_id, "created": created, "model": self.server.model_name, "system_fingerprint": None}
        want_logprobs = params.logprobs is not None
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            first = await first_delta(deltas)
            chunks = self._chat_chunks(base, first, deltas, params.n, call.account, include_usage, want_logprobs, tools)
            return sse_response(chunks, deltas, call.finish, request_id)

        texts = [""] * params.n
        finish: list[str | None] = [None] * params.n
        logprobs: list[list] = [[] for _ in range(params.n)]
        prompt_scores = None  # vLLM's prompt_logprobs, when asked for

        def message(i: int) -> tuple[dict, str | None]:
            if tools is None:
                return {"role": "assistant", "content": texts[i], "refusal": None}, finish[i]
            calls = ToolCallStream(tools, f"{request_id}-{i}")
            calls.feed(texts[i])
            calls.finish()
            return tool_message(calls), tool_finish_reason(calls, finish[i])

        def response(usage: dict | None) -> dict:
            choices = []
            for i in range(params.n):
                msg, reason = message(i)
                choices.append({
                    "index": i, "message": msg, "logprobs": {"content": logprobs[i]} if want_logprobs else None, "finish_reason": reason,
                })
            body = {**base, "object": "chat.completion", "choices": choices, "usage": usage}
            if request.prompt_logprobs is not None:
                body["prompt_logprobs"] = vllm_prompt_logprobs(self.server.frontend, prompt_ids, prompt_scores, request.prompt_logprobs)
            return body

        try:
            async for delta in deltas:
                if delta.prompt_logprobs is not None:
                    prompt_scores = delta.prompt_logprobs
                texts[delta.index] += delta.text
                finish[delta.index] = delta.finish_reason or finish[delta.index]
                if want_logprobs and delta.logprobs:
                    logprobs[delta.index] += self._chat_logprobs(delta.logprobs)
        except RequestTimeoutError as exc:
            with_partial(exc, call.account, response)
            raise
        return JSONResponse(response(call.account.settle()), headers=call.account.headers())

    async def start(self, request: ChatCompletionRequest, call: Call) -> StartedChat:
        """A chat request up to its deltas: checked, rendered and fitted into the context window,
        validated, admitted by its key's limits, generating. /v1/responses runs through here too."""
        lora = await self.server.resolve_model(request.model, call.key)
        limits.check_request(request, 1, self.server.config.api)
        params = sampling_params(request)
        tooling = self.server.config.tool_calling
        tools = plan_tools(request, parser=tooling.parser, max_tools=tooling.max_tools)
        guided_from = guided_param(request) if params.guided is not None else None
        if tools is not None and tools.is_constrained:  # required / named: the calls' own grammar
            if guided_from is not None:
                raise InvalidRequestError(guided_from, f"cannot be combined with tool_choice {tools.mode!r}, which constrains the output itself; drop one")
            params = replace(params, guided=GuidedSpec.json_schema(tools.output_schema()))
            guided_from = "tools"
        call.deadline = deadline_for(request.timeout, self.server.config, call.key.tier, call.received_at, self.server.clock)
        kwargs = template_kwargs(request.chat_template_kwargs, self.server.config.api)
        info = await self.server.frontend.model_info()
        max_tokens_param = limits.max_tokens_param(request)
        budget = context_budget.budget_for(
            truncation=request.truncation, truncate_prompt_tokens=request.truncate_prompt_tokens, max_tokens=params.max_tokens,
            max_tokens_param=max_tokens_param, max_model_len=info.max_model_len, config=self.server.config.api.context_budget,
        )
        with tracing.stage(call.trace, "tokenize"):
            fitted = await render_off_loop(
                lambda: context_budget.fit_chat(budget, request.messages, lambda messages: self.server.frontend.encode_chat(
                    messages, add_generation_prompt=request.add_generation_prompt, chat_template_kwargs=kwargs,
                    tools=tools, tool_prompt=tooling.prompt,
                )),
                self.server.config.api.render_timeout_s,
                param="chat_template_kwargs.chat_template" if "chat_template" in kwargs else "messages",
            )
            prompt_ids = fitted.prompt_ids
            await self.server.frontend.validate(prompt_ids, params)
            if params.guided is not None:
                await self.server.frontend.check_guided(params.guided, guided_from)
        [params] = limits.fit_max_tokens(params, [len(prompt_ids)], info.max_model_len, self.server.config.api, param=max_tokens_param)
        self.server.admit(call, [prompt_ids], [params])
        call.headers.update(fitted.headers())
        if call.trace is not None:
            call.trace.set({"kvrelay.request_id": call.request_id, "gen_ai.request.model": self.server.model_name})
        usage = Usage(dropped_messages=fitted.dropped_messages, dropped_tokens=fitted.dropped_tokens)
        call.account.track(lambda: usage)
        deltas = self.server.frontend.generate(
            call.request_id, prompt_ids, params, usage, priority=call.priority, cache_salt=request.cache_salt,
            session=request.user, trace=call.trace, record=call.record, lora_name=lora, lora_path=self.server.adapters.get(lora),
        )
        deltas = bounded(deltas, call.deadline)
        deltas = self.server.metrics.track(call.record, deltas, prompt_tokens=len(prompt_ids), status_of=error_status)
        return StartedChat(prompt_ids, params, deltas, tools if tools is not None and tools.is_shown else None)

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
        text = self.server.frontend.token_text(token_id)
        return {"token": text, "logprob": finite_logprob(logprob), "bytes": list(self.server.frontend.token_bytes(token_id))}
