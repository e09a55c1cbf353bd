"""The OpenAI-compatible HTTP API: routes, response shapes, SSE, and the error mapping.

    POST /v1/chat/completions   chat.completion / chat.completion.chunk (SSE)
    POST /v1/completions        text_completion (SSE when stream)
    POST /v1/responses          response (SSE events when stream): text in and out, on chat's
                                pipeline (serving/api/responses_api.py)
    GET  /v1/models             the served model, with its max_model_len
    POST /tokenize, /detokenize vLLM's tokenization endpoints (serving/api/tokenize_routes.py)
    GET  /v1/usage              totals for the caller's API key, or every key's for an admin key
    GET  /health                200 when every pool has a live replica; 503 when one has none, or
                                when what it reports cannot be read (the Serve controller's replica
                                states: a read that failed or did not finish, health_unknown)
    GET  /metrics               Prometheus exposition (serving/observability/metrics.py, serving/observability/export.py)

Bodies are parsed by serving/api/http_io.py, not by FastAPI, so every failure has OpenAI's error shape:
malformed JSON is a 422 with a `detail` list as FastAPI would give; a field of the wrong type or
out of range is a 400 whose `param` names it. A streaming request is answered with an HTTP error
status if it fails before its first token; after that, failures arrive as an SSE `error` event
followed by `data: [DONE]`.

Every completion response carries `x-request-id`, its `id`. A 5xx body has a generic message
naming that id and never an exception's text; the exception and its traceback are logged under it.
A request's unknown fields are named in `x-kvrelay-ignored-fields`, and a known field kvrelay does
not implement is a 400 naming it (serving/api/field_support.py). A prompt over the context window
is fitted when the request asks (`truncation`, `truncate_prompt_tokens`), and what was dropped is
in `x-kvrelay-dropped-*` and `usage.prompt_tokens_details` (serving/api/context_budget.py).

A prompt is rendered (chat template) and tokenized in a thread with a time limit, so no request
holds up the event loop, and a request's `chat_template_kwargs` reach the template only as
allow-listed scalar variables (serving/api/chat_template.py, `api:` in the config).

Each request is billed to its API key (serving/api/usage.py) when its tokens are final: answered 200,
or ended early (the client left, or it failed mid-generation) after its first token, for the
tokens it got;
with a pricing file its cost is in `usage.cost` and, unless streamed (headers leave before the
tokens are known), in the `x-kvrelay-cost` header. With tracing on (serving/observability/tracing.py) each
request is one trace: the `ingress` span covers it until its response or stream ends.

A completion has a deadline (its `timeout`, else `request_timeout_s`, bounded by its key's tier:
serving/api/deadlines.py): out of time, it is aborted and answers 408, with its partial output
when it is not streamed; a stream that had begun ends with an SSE `error` event (`timeout`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import prometheus_client
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from serving.api import context_budget, limits
from serving.api.chat_template import render_off_loop, template_kwargs
from serving.api.deadlines import Deadline, bounded, deadline_for
from serving.api.degradation import DEGRADED_HEADER, Degrader
from serving.api.errors import (
    APIError,
    AuthenticationError,
    HealthUnknownError,
    ModelNotFoundError,
    RequestTimeoutError,
    error_status,
    to_api_error,
    with_request_id,
)
from serving.api.field_support import CHAT_FIELDS, COMPLETION_FIELDS, screen
from serving.api.forwarding import Forwarder
from serving.api.http_io import chain_deltas, error_response, finite_logprob, first_delta, merge_deltas, parse_body, read_json, split_prompts, sse_response
from serving.api.keys import ANONYMOUS, KeyRing
from serving.api.openapi import openapi_document
from serving.api.pipeline import ChoiceDelta, Frontend, Usage
from serving.api.prompt_scores import echoed_logprobs, joined, legacy_top, vllm_prompt_logprobs
from serving.api.protocol import ChatCompletionRequest, CompletionRequest, sampling_params
from serving.api.rate_limits import RateLimiter, Ticket
from serving.api.responses_api import ResponsesEndpoint, StartedChat
from serving.api.structured import guided_param
from serving.api.tokenize_routes import add_tokenize_routes
from serving.api.tool_calls import ToolCallStream, ToolPlan, plan_tools, tool_chunk_choices, tool_finish_reason, tool_message
from serving.api.usage import ModelPrice, RequestAccount, UsageLedger, load_pricing
from serving.config import ServeConfig
from serving.config.access import APIKey
from serving.engine.errors import InvalidRequestError
from serving.engine.outputs import TokenLogprob
from serving.engine.params import GuidedSpec, SamplingParams
from serving.observability import tracing
from serving.observability.ingress_metrics import CLIENT_CLOSED, IngressMetrics, RequestRecord

__all__ = ["OpenAIServer", "PRIORITY_HEADER"]

PRIORITY_HEADER = "x-kvrelay-priority"  # the priority a request ran at, after its key's tier

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"  # as OpenAI's responses: the id to quote, also in every 5xx body

@dataclass
class _Call:
    """One API request at the ingress: who pays for it, and its trace."""

    request_id: str  # its response's `id`; a 5xx names it, and the log has the exception under it
    account: RequestAccount
    trace: tracing.RequestTrace | None
    record: RequestRecord  # its metrics: recorded when its response or stream ends
    key: APIKey = ANONYMOUS
    ticket: Ticket | None = None  # its hold on its key's limits, from admission to its end
    priority: int = 0  # as its key's tier allows (serving/config/access.py)
    received_at: float = 0.0  # when the ingress received it (OpenAIServer.clock): its deadline counts from here
    deadline: Deadline | None = None
    headers: dict[str, str] = field(default_factory=dict)  # of its response: ignored fields, what fitting dropped

    def finish(self, status_code: int = 200, error: str | None = None) -> None:
        """Its response is complete (built, or its stream ended): bill it, end its trace."""
        self.account.settle()
        self.release()
        if self.trace is not None:
            usage = self.account.usage
            if usage is not None:
                self.trace.set({"gen_ai.usage.input_tokens": usage.prompt_tokens, "gen_ai.usage.output_tokens": usage.completion_tokens})
            self.trace.end(status_code, error)

    def release(self) -> None:
        """Give its key's limits back what it did not use (once; a no-op before admission)."""
        if self.ticket is not None:
            usage = self.account.usage
            self.ticket.release(usage.prompt_tokens + usage.completion_tokens if usage is not None else None)


class OpenAIServer:
    """`price`: the served model's prices; default: from `config.pricing` (the deployment
    passes them parsed, so replicas need not read the file). `fallback`: the transport to the
    degradation fallback's app (serving/api/forwarding.py), None without one."""

    def __init__(self, frontend: Frontend, config: ServeConfig, price: ModelPrice | None = None,
                 fallback: Forwarder | None = None):
        self.frontend = frontend
        self.config = config
        self.model_name = config.model_name
        self._keys = KeyRing(config.keys)
        self._hints = {key.name: key.hint for key in config.keys} | {ANONYMOUS.name: ANONYMOUS.hint}
        self.limiter = RateLimiter(config.tiers)
        if price is None and config.pricing:
            price = load_pricing(config.pricing).price_for(self.model_name, config.pricing)
        self.price = price
        self.usage = UsageLedger()
        self._created = int(time.time())
        self.metrics = IngressMetrics(self.model_name)
        self.degrader = Degrader(config.degradation, self.model_name, self.metrics, fallback=fallback)
        self.clock = time.monotonic  # of request deadlines (serving/api/deadlines.py)
        self.responses = ResponsesEndpoint(self._start_chat, self.model_name, config.api.context_budget)

    # ---- the ASGI app ------------------------------------------------------------------------
    def build_app(self) -> FastAPI:
        app = FastAPI(title="kvrelay", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(APIError)
        async def _api_error(request: Request, exc: APIError):
            return error_response(exc)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await self._guard(request, self.degrader.wrap(request, self.chat_completions), "chatcmpl-")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._guard(request, self.degrader.wrap(request, self.completions), "cmpl-")

        @app.post("/v1/responses")
        async def responses(request: Request):
            return await self._guard(request, self.degrader.wrap(request, self.responses), "resp_")

        @app.get("/v1/models")
        async def models(request: Request):
            key = self._authenticate(request)
            allowed = self._may_use(key, self.model_name)
            return {"object": "list", "data": [await self._model_card()] if allowed else []}

        @app.get("/v1/models/{model:path}")
        async def model(model: str, request: Request):
            self._check_model(model, self._authenticate(request))
            return await self._model_card()

        add_tokenize_routes(app, self)

        @app.get("/v1/usage")
        async def usage(request: Request):
            return self._usage_report(self._authenticate(request))

        @app.get("/metrics")
        async def metrics():
            # The 0.0.4 text format: what every Prometheus (and Ray's agent) reads.
            body = prometheus_client.generate_latest(self.metrics.registry)
            return Response(body, media_type=CONTENT_TYPE_PLAIN_0_0_4)

        @app.get("/openapi.json")
        async def openapi():
            return openapi_document(self.model_name, has_keys=bool(self._keys))

        @app.get("/health")
        async def health():
            try:
                pools = await self.frontend.backend.health()
            except APIError as exc:  # a pool down, or its state unreadable: written for clients
                return error_response(exc)
            except Exception:
                check_id = f"health-{uuid.uuid4().hex}"
                logger.exception("health check %s failed", check_id)
                return error_response(with_request_id(HealthUnknownError("reading it failed"), check_id))
            return {"status": "ok", "pools": pools}

        return app

    async def _guard(self, request: Request, handler, id_prefix: str) -> Response:
        received_at = self.clock()
        trace = tracing.start_request(request.headers, {"http.request.method": request.method, "url.path": request.url.path})
        record = self.metrics.start()
        request_id = f"{id_prefix}{uuid.uuid4().hex}"
        call: _Call | None = None
        key: APIKey | None = None
        try:
            key = self._authenticate(request)
            self.limiter.check(key)  # a key out of room is refused before its body is read
            body = await read_json(request, self.config.max_request_body_bytes)
            call = _Call(request_id, RequestAccount(self.usage, key.name, self.price), trace, record, key, received_at=received_at)
            body = self._tier_priority(body, call)
            response = await handler(body, call)
        except asyncio.CancelledError:
            if call is not None:
                call.account.settle_if_generated()  # the client left: it pays for what it got
                call.release()
            record.finish(CLIENT_CLOSED, "abort")
            if trace is not None:
                trace.end(499, "the client disconnected")
            raise
        except Exception as exc:
            error = to_api_error(exc)
            if call is not None:
                call.account.settle_if_generated()  # failed mid-generation: the tokens so far
                call.release()
            record.finish(error.status, "none")  # a no-op if it failed while generating
            if error.status >= 500:
                logger.exception("request %s failed (%d %s)", request_id, error.status, error.code or error.type)
            if trace is not None:
                trace.set({"error.type": error.code or error.type})
                trace.end(error.status, f"{type(exc).__name__}: {exc}" if error.status >= 500 else None)
            response = error_response(with_request_id(error, request_id))
            response.headers[REQUEST_ID_HEADER] = request_id
            if key is not None:
                response.headers.update(self.limiter.headers(key))
            return response
        if not isinstance(response, StreamingResponse):
            call.finish(response.status_code)  # a stream finishes when its body ends
        response.headers.update(self._call_headers(call))
        if DEGRADED_HEADER not in response.headers:  # a fallback's answer has its own
            response.headers.update(call.headers)
        response.headers.setdefault(REQUEST_ID_HEADER, request_id)  # a fallback's answer keeps its own
        return response

    def _call_headers(self, call: _Call) -> dict[str, str]:
        """Its key's `x-ratelimit-*` headers and the priority it ran at (after its tier's)."""
        return {**self.limiter.headers(call.key), PRIORITY_HEADER: str(call.priority)}

    def _authenticate(self, request: Request) -> APIKey:
        """The caller's API key; ANONYMOUS when no keys are configured."""
        if not self._keys:
            return ANONYMOUS
        header = request.headers.get("authorization", "")
        scheme, _, presented = header.partition(" ")
        presented = presented.strip()
        if scheme.lower() != "bearer" or not presented:
            raise AuthenticationError("Missing API key: send 'Authorization: Bearer <key>'.")
        key = self._keys.check(presented)
        if key is None:
            raise AuthenticationError("Incorrect API key provided.")
        return key

    def _tier_priority(self, body: dict, call: _Call) -> dict:
        """The body with the priority its key's tier allows: the tier's default when it sets none;
        one more important than the tier's highest is clamped to it, or refused; then less
        important by the tier's offset if it does not stream. (Its estimated cost is added at
        admission, once its prompt is tokenized: `_admit`.)"""
        tier = self.config.tiers[call.key.tier]
        asked = body.get("priority")
        if asked is None:
            call.priority = tier.priority
        elif type(asked) is not int:
            return body  # not a number: the handler's validation names the field
        elif asked < tier.highest_priority:
            if tier.priority_over_limit == "refuse":
                raise APIError(
                    400, f"priority = {asked} is more important than the key's tier {call.key.tier!r} allows "
                    f"(at most {tier.highest_priority}; lower is more important); send {tier.highest_priority} "
                    "or more", param="priority", code="priority_not_allowed",
                )
            call.priority = tier.highest_priority
        else:
            call.priority = asked
        if body.get("stream") is not True:
            call.priority += tier.non_stream_priority_offset  # request type: batch yields to streams
        # Rewritten only where it changed (the degradation policy and a fallback app read it).
        return body if call.priority == (0 if asked is None else asked) else {**body, "priority": call.priority}

    def _usage_report(self, key: APIKey) -> dict:
        """This replica's totals: the caller's key, or every key for an admin key."""
        names = sorted(set(self.usage.keys()) | {key.name}) if key.is_admin else [key.name]
        currency = self.price.currency if self.price is not None else None
        return {
            "object": "list",
            "scope": "all" if key.is_admin else "key",
            "data": [
                {"object": "usage.api_key", "api_key": self._hints.get(n, "..."), "name": n, **self.usage.totals(n).to_dict(currency)}
                for n in names
            ],
            "total": self.usage.sum(names).to_dict(currency),
        }

    def _may_use(self, key: APIKey, model: str) -> bool:
        allowed = self.config.tiers[key.tier].models
        return allowed is None or model in allowed

    def _check_model(self, model: str | None, key: APIKey) -> None:
        """A model this app does not serve, or one the key's tier may not use: 404, as OpenAI
        answers both (it does not say which models exist to a key that may not use them)."""
        if model is not None and model != self.model_name:
            raise ModelNotFoundError(model, [self.model_name] if self._may_use(key, self.model_name) else [])
        if not self._may_use(key, self.model_name):
            raise ModelNotFoundError(model or self.model_name, [])

    def _admit(self, call: _Call, prompt_ids: list[list[int]], params: list[SamplingParams]) -> None:
        """Take the request's tokens (its prompts and all it may generate, max_tokens resolved per
        prompt) from its key's limits, and make it less important by that estimated cost where its
        tier says so."""
        num_tokens = sum(len(ids) + p.n * p.max_tokens for ids, p in zip(prompt_ids, params, strict=True))
        call.ticket = self.limiter.admit(call.key, num_tokens)
        tier = self.config.tiers[call.key.tier]
        if tier.priority_cost_step_tokens is not None:  # estimated cost: a long request yields to short ones
            call.priority += min(tier.max_cost_priority_levels, num_tokens // tier.priority_cost_step_tokens)

    async def _model_card(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": self._created, "owned_by": "kvrelay"}
        try:
            card["max_model_len"] = (await self.frontend.model_info()).max_model_len  # as vLLM's cards
        except APIError as exc:  # no live replica to ask (a request would get this 503): listed without it
            logger.warning("the model card of %s has no max_model_len: %s", self.model_name, exc.message)
        return card

    # ---- chat --------------------------------------------------------------------------------
    async def chat_completions(self, body: dict, call: _Call) -> Response:
        request = parse_body(ChatCompletionRequest, body)
        call.headers.update(screen(request, CHAT_FIELDS))
        started = await self._start_chat(request, call)
        params, deltas, prompt_ids, tools = started.params, started.deltas, started.prompt_ids, started.tools
        request_id = call.request_id
        created = int(time.time())
        base = {"id": request_id, "created": created, "model": self.model_name, "system_fingerprint": None}
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
                body["prompt_logprobs"] = vllm_prompt_logprobs(self.frontend, prompt_ids, prompt_scores, request.prompt_logprobs)
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
            _with_partial(exc, call.account, response)
            raise
        return JSONResponse(response(call.account.settle()), headers=call.account.headers())

    async def _start_chat(self, request: ChatCompletionRequest, call: _Call) -> StartedChat:
        """A chat request up to its deltas: checked, rendered and fitted into the context window,
        validated, admitted by its key's limits, generating. /v1/responses runs through here too."""
        self._check_model(request.model, call.key)
        limits.check_request(request, 1, self.config.api)
        params = sampling_params(request)
        tooling = self.config.tool_calling
        tools = plan_tools(request, parser=tooling.parser, max_tools=tooling.max_tools)
        guided_from = guided_param(request) if params.guided is not None else None
        if tools is not None and tools.is_constrained:  # required / named: the calls' own grammar
            if guided_from is not None:
                raise InvalidRequestError(guided_from, f"cannot be combined with tool_choice {tools.mode!r}, which constrains the output itself; drop one")
            params = replace(params, guided=GuidedSpec.json_schema(tools.output_schema()))
            guided_from = "tools"
        call.deadline = deadline_for(request.timeout, self.config, call.key.tier, call.received_at, self.clock)
        kwargs = template_kwargs(request.chat_template_kwargs, self.config.api)
        info = await self.frontend.model_info()
        max_tokens_param = limits.max_tokens_param(request)
        budget = context_budget.budget_for(
            truncation=request.truncation, truncate_prompt_tokens=request.truncate_prompt_tokens, max_tokens=params.max_tokens,
            max_tokens_param=max_tokens_param, max_model_len=info.max_model_len, config=self.config.api.context_budget,
        )
        with tracing.stage(call.trace, "tokenize"):
            fitted = await render_off_loop(
                lambda: context_budget.fit_chat(budget, request.messages, lambda messages: self.frontend.encode_chat(
                    messages, add_generation_prompt=request.add_generation_prompt, chat_template_kwargs=kwargs,
                    tools=tools, tool_prompt=tooling.prompt,
                )),
                self.config.api.render_timeout_s,
                param="chat_template_kwargs.chat_template" if "chat_template" in kwargs else "messages",
            )
            prompt_ids = fitted.prompt_ids
            await self.frontend.validate(prompt_ids, params)
            if params.guided is not None:
                await self.frontend.check_guided(params.guided, guided_from)
        [params] = limits.fit_max_tokens(params, [len(prompt_ids)], info.max_model_len, self.config.api, param=max_tokens_param)
        self._admit(call, [prompt_ids], [params])
        call.headers.update(fitted.headers())
        if call.trace is not None:
            call.trace.set({"kvrelay.request_id": call.request_id, "gen_ai.request.model": self.model_name})
        usage = Usage(dropped_messages=fitted.dropped_messages, dropped_tokens=fitted.dropped_tokens)
        call.account.track(lambda: usage)
        deltas = self.frontend.generate(
            call.request_id, prompt_ids, params, usage, priority=call.priority, cache_salt=request.cache_salt,
            session=request.user, trace=call.trace,
        )
        deltas = bounded(deltas, call.deadline)
        deltas = self.metrics.track(call.record, deltas, prompt_tokens=len(prompt_ids), status_of=error_status)
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
        text = self.frontend.token_text(token_id)
        return {"token": text, "logprob": finite_logprob(logprob), "bytes": list(self.frontend.token_bytes(token_id))}

    # ---- completions -------------------------------------------------------------------------
    async def completions(self, body: dict, call: _Call) -> Response:
        request = parse_body(CompletionRequest, body)
        call.headers.update(screen(request, COMPLETION_FIELDS))
        self._check_model(request.model, call.key)
        call.deadline = deadline_for(request.timeout, self.config, call.key.tier, call.received_at, self.clock)
        prompts = split_prompts(request.prompt)
        limits.check_request(request, len(prompts), self.config.api)
        params = sampling_params(request)
        with tracing.stage(call.trace, "tokenize"):
            if any(isinstance(p, str) for p in prompts):  # token ids need no tokenizer
                prompt_ids = await render_off_loop(
                    lambda: [self.frontend.encode_prompt(p) for p in prompts], self.config.api.render_timeout_s, param="prompt",
                )
            else:
                prompt_ids = [self.frontend.encode_prompt(p) for p in prompts]
            info = await self.frontend.model_info()
            budget = context_budget.budget_for(
                truncation="disabled", truncate_prompt_tokens=request.truncate_prompt_tokens, max_tokens=params.max_tokens,
                max_tokens_param="max_tokens", max_model_len=info.max_model_len, config=self.config.api.context_budget,
            )
            fitted = [context_budget.fit_prompt(budget, ids) for ids in prompt_ids]
            prompt_ids = [f.prompt_ids for f in fitted]
            for ids in prompt_ids:
                await self.frontend.validate(ids, params, prompt_param="prompt")
            if params.guided is not None:
                await self.frontend.check_guided(params.guided, guided_param(request))
        per_prompt = limits.fit_max_tokens(params, [len(ids) for ids in prompt_ids], info.max_model_len, self.config.api, param="max_tokens")
        self._admit(call, prompt_ids, per_prompt)
        request_id = call.request_id
        if call.trace is not None:
            call.trace.set({"kvrelay.request_id": request_id, "gen_ai.request.model": self.model_name})
        created = int(time.time())
        usages = [Usage(dropped_tokens=f.dropped_tokens) for f in fitted]
        if budget.is_fitting:
            call.headers[context_budget.DROPPED_TOKENS_HEADER] = str(sum(f.dropped_tokens for f in fitted))
        streams = [
            self.frontend.generate(
                f"{request_id}-{i}", ids, per_prompt[i], usages[i], priority=call.priority,
                cache_salt=request.cache_salt, index_offset=i * params.n, session=request.user, trace=call.trace,
            )
            for i, ids in enumerate(prompt_ids)
        ]
        deltas = bounded(streams[0] if len(streams) == 1 else merge_deltas(streams), call.deadline)
        deltas = self.metrics.track(call.record, deltas, prompt_tokens=sum(map(len, prompt_ids)), status_of=error_status)
        base = {"id": request_id, "object": "text_completion", "created": created, "model": self.model_name, "system_fingerprint": None}
        num_choices = params.n * len(prompts)
        want_logprobs = params.logprobs is not None
        # echo: each choice's text starts with its prompt, and its logprobs with the prompt's tokens
        # (a prompt cut by truncate_prompt_tokens echoes what the model was given)
        prompt_texts = [
            p if isinstance(p, str) and not f.dropped_tokens else self.frontend.tokenizer.decode(ids)
            for p, ids, f in zip(prompts, prompt_ids, fitted)
        ] if request.echo else []

        def total_usage() -> Usage:
            total = Usage()
            for u in usages:
                total.add(u)
            return total

        call.account.track(total_usage)

        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            first = await first_delta(deltas)

            async def chunks():
                extra = {"usage": None} if include_usage else {}
                offsets = [0] * num_choices
                echoed = [not request.echo] * num_choices
                async for delta in chain_deltas(first, deltas):
                    lp = None
                    text = delta.text
                    if not echoed[delta.index]:  # the choice's first delta: its prompt goes first
                        echoed[delta.index] = True
                        i = delta.index // params.n
                        text = prompt_texts[i] + text
                        if want_logprobs:
                            lp = echoed_logprobs(self.frontend, prompt_ids[i], delta.prompt_logprobs, params.logprobs)
                            offsets[delta.index] = len(prompt_texts[i])
                    if want_logprobs and delta.logprobs:
                        generated = self._completion_logprobs(delta.logprobs, offsets[delta.index])
                        offsets[delta.index] = generated["text_offset"][-1] + len(generated["tokens"][-1])
                        lp = generated if lp is None else joined(lp, generated)
                    if not text and delta.finish_reason is None and lp is None:
                        continue  # held back by the detokenizer or a possible stop string
                    yield {**base, "choices": [{"index": delta.index, "text": text, "logprobs": lp, "finish_reason": delta.finish_reason}], **extra}
                if include_usage:
                    yield {**base, "choices": [], "usage": call.account.settle()}

            return sse_response(chunks(), deltas, call.finish, request_id)

        echoed = [prompt_texts[i // params.n] if request.echo else "" for i in range(num_choices)]
        texts = list(echoed)
        finish: list[str | None] = [None] * num_choices
        logprobs: list[list[TokenLogprob]] = [[] for _ in range(num_choices)]
        prompt_scores: list[list[TokenLogprob] | None] = [None] * num_choices

        def choice_logprobs(i: int) -> dict:
            generated = self._completion_logprobs(logprobs[i], len(echoed[i]))
            if not request.echo:
                return generated
            return joined(echoed_logprobs(self.frontend, prompt_ids[i // params.n], prompt_scores[i], params.logprobs), generated)

        def response(usage: dict | None) -> dict:
            choices = [
                {
                    "index": i,
                    "text": texts[i],
                    "logprobs": choice_logprobs(i) if want_logprobs else None,
                    "finish_reason": finish[i],
                }
                for i in range(num_choices)
            ]
            if request.prompt_logprobs is not None:
                for i, choice in enumerate(choices):
                    choice["prompt_logprobs"] = vllm_prompt_logprobs(
                        self.frontend, prompt_ids[i // params.n], prompt_scores[i], request.prompt_logprobs,
                    )
            return {**base, "choices": choices, "usage": usage}

        try:
            async for delta in deltas:
                if delta.prompt_logprobs is not None:
                    prompt_scores[delta.index] = delta.prompt_logprobs
                texts[delta.index] += delta.text
                finish[delta.index] = delta.finish_reason or finish[delta.index]
                if delta.logprobs:
                    logprobs[delta.index] += delta.logprobs
        except RequestTimeoutError as exc:
            _with_partial(exc, call.account, response)
            raise
        return JSONResponse(response(call.account.settle()), headers=call.account.headers())

    def _completion_logprobs(self, logprobs: list[TokenLogprob], offset: int) -> dict:
        tokens, token_logprobs, top, text_offset = [], [], [], []
        for lp in logprobs:
            text = self.frontend.token_text(lp.token_id)
            tokens.append(text)
            token_logprobs.append(finite_logprob(lp.logprob))
            top.append(legacy_top(self.frontend, lp, len(lp.top)))
            text_offset.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": text_offset}


def _with_partial(exc: RequestTimeoutError, account: RequestAccount, response) -> None:
    """A non-streamed request out of time: bill what it got and hand it back in the 408's
    `partial` (the response it would have been); nothing if it got no token."""
    usage = account.settle_if_generated()
    if usage is not None:
        exc.partial = response(usage)
