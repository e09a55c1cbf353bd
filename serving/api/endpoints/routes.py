"""The OpenAI-compatible HTTP API: its routes, and what every request passes before its endpoint
(authentication, its key's limits and priority, its body read, the error mapping and headers).

    POST /v1/chat/completions   chat.completion / chat.completion.chunk (SSE): serving/api/endpoints/chat.py
    POST /v1/completions        text_completion (SSE when stream): serving/api/endpoints/completions.py
    POST /v1/responses          response (SSE events when stream): text in and out, on chat's
                                pipeline (serving/api/endpoints/responses.py)
    GET  /v1/models             the served model, with its max_model_len
    POST /tokenize, /detokenize vLLM's tokenization endpoints (serving/api/endpoints/tokenize.py)
    GET  /v1/usage              totals for the caller's API key, or every key's for an admin key
    GET  /health                200 when every pool has a live replica; 503 when one has none, or
                                when what it reports cannot be read (the Serve controller's replica
                                states: a read that failed or did not finish, health_unknown)
    GET  /metrics               Prometheus exposition (serving/observability/metrics.py, serving/observability/export.py)

Bodies are parsed by serving/api/endpoints/http_io.py, not by FastAPI, so every failure has OpenAI's error shape:
malformed JSON is a 422 with a `detail` list as FastAPI would give; a field of the wrong type or
out of range is a 400 whose `param` names it. A streaming request is answered with an HTTP error
status if it fails before its first token; after that, failures arrive as an SSE `error` event
followed by `data: [DONE]`.

Every completion response carries `x-request-id`, its `id`. A 5xx body has a generic message
naming that id and never an exception's text; the exception and its traceback are logged under it.
A request's unknown fields are named in `x-kvrelay-ignored-fields`, and a known field kvrelay does
not implement is a 400 naming it (serving/api/protocol/field_support.py). A prompt over the context window
is fitted when the request asks (`truncation`, `truncate_prompt_tokens`), and what was dropped is
in `x-kvrelay-dropped-*` and `usage.prompt_tokens_details` (serving/api/generation/context_budget.py).

A prompt is rendered (chat template) and tokenized in a thread with a time limit, so no request
holds up the event loop, and a request's `chat_template_kwargs` reach the template only as
allow-listed scalar variables (serving/api/generation/chat_template.py, `api:` in the config).

Each request is billed to its API key (serving/api/usage.py) when its tokens are final: answered 200,
or ended early (the client left, or it failed mid-generation) after its first token, for the
tokens it got;
with a pricing file its cost is in `usage.cost` and, unless streamed (headers leave before the
tokens are known), in the `x-kvrelay-cost` header. With tracing on (serving/observability/tracing.py) each
request is one trace: the `ingress` span covers it until its response or stream ends.

A completion has a deadline (its `timeout`, else `request_timeout_s`, bounded by its key's tier:
serving/api/admission/deadlines.py): out of time, it is aborted and answers 408, with its partial output
when it is not streamed; a stream that had begun ends with an SSE `error` event (`timeout`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import PurePosixPath

import prometheus_client
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from serving.api.endpoints.calls import Call
from serving.api.endpoints.chat import ChatEndpoint
from serving.api.endpoints.completions import CompletionsEndpoint
from serving.api.admission.degradation import DEGRADED_HEADER, Degrader
from serving.api.errors import (
    APIError,
    AuthenticationError,
    HealthUnknownError,
    ModelNotFoundError,
    to_api_error,
    with_request_id,
)
from serving.api.admission.forwarding import Forwarder
from serving.api.endpoints.http_io import error_response, read_json
from serving.api.admission.keys import ANONYMOUS, KeyRing
from serving.api.protocol.openapi import openapi_document
from serving.api.generation.pipeline import Frontend
from serving.api.admission.rate_limits import RateLimiter
from serving.api.endpoints.responses import ResponsesEndpoint
from serving.api.endpoints.tokenize import add_tokenize_routes
from serving.api.usage import ModelPrice, RequestAccount, UsageLedger, load_pricing
from serving.config import ServeConfig
from serving.config.access import APIKey
from serving.engine.errors import InvalidRequestError
from serving.engine.params import SamplingParams
from serving.observability import tracing
from serving.observability.ingress_metrics import CLIENT_CLOSED, IngressMetrics

__all__ = ["OpenAIServer", "PRIORITY_HEADER"]

PRIORITY_HEADER = "x-kvrelay-priority"  # the priority a request ran at, after its key's tier

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"  # as OpenAI's responses: the id to quote, also in every 5xx body


class OpenAIServer:
    """`price`: the served model's prices; default: from `config.pricing` (the deployment
    passes them parsed, so replicas need not read the file). `fallback`: the transport to the
    degradation fallback's app (serving/api/admission/forwarding.py), None without one."""

    def __init__(self, frontend: Frontend, config: ServeConfig, price: ModelPrice | None = None,
                 fallback: Forwarder | None = None):
        self.frontend = frontend
        self.config = config
        self.model_name = config.model_name
        # LoRA adapters (EngineConfig.lora): a request names one as its `model`, or base:adapter
        lora = config.lora  # the pools agree on it (HANDOFF_KEYS)
        self.static_adapters: dict[str, str] = dict(lora.adapters) if lora is not None else {}
        # those loaded at run time (POST /v1/load_lora_adapter); with several ingress replicas, a
        # copy of the app's AdapterRegistry kept by `adapter_sync` (serving/deployments/adapter_registry.py)
        self.runtime_adapters: dict[str, str] = {}
        self.adapter_sync = None
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
        self.clock = time.monotonic  # of request deadlines (serving/api/admission/deadlines.py)
        self.chat = ChatEndpoint(self)  # serving/api/endpoints/chat.py
        self.completions = CompletionsEndpoint(self)  # serving/api/endpoints/completions.py
        self.responses = ResponsesEndpoint(self.chat.start, self.model_name, config.api.context_budget)

    # ---- the ASGI app ------------------------------------------------------------------------
    def build_app(self) -> FastAPI:
        app = FastAPI(title="kvrelay", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(APIError)
        async def _api_error(request: Request, exc: APIError):
            return error_response(exc)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await self._guard(request, self.degrader.wrap(request, self.chat), "chatcmpl-")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._guard(request, self.degrader.wrap(request, self.completions), "cmpl-")

        @app.post("/v1/responses")
        async def responses(request: Request):
            return await self._guard(request, self.degrader.wrap(request, self.responses), "resp_")

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request):
            return await self._adapter_update(request, load=True)

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request):
            return await self._adapter_update(request, load=False)

        @app.get("/v1/models")
        async def models(request: Request):
            key = self.authenticate(request)
            base = [await self._model_card()] if self._may_use(key, self.model_name) else []
            return {"object": "list", "data": base + [self._adapter_card(name) for name in sorted(self.adapters)
                                                        if self._may_use(key, name)]}

        @app.get("/v1/models/{model:path}")
        async def model(model: str, request: Request):
            lora = await self.resolve_model(model, self.authenticate(request))
            return await self._model_card() if lora is None else self._adapter_card(lora)

        add_tokenize_routes(app, self)

        @app.get("/v1/usage")
        async def usage(request: Request):
            return self._usage_report(self.authenticate(request))

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
        record = self.metrics.start(trace)
        request_id = f"{id_prefix}{uuid.uuid4().hex}"
        call: Call | None = None
        key: APIKey | None = None
        try:
            key = self.authenticate(request)
            self.limiter.check(key)  # a key out of room is refused before its body is read
            body = await read_json(request, self.config.max_request_body_bytes)
            call = Call(request_id, RequestAccount(self.usage, key.name, self.price), trace, record, key, received_at=received_at)
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

    def _call_headers(self, call: Call) -> dict[str, str]:
        """Its key's `x-ratelimit-*` headers and the priority it ran at (after its tier's)."""
        return {**self.limiter.headers(call.key), PRIORITY_HEADER: str(call.priority)}

    def authenticate(self, request: Request) -> APIKey:
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

    def _tier_priority(self, body: dict, call: Call) -> dict:
        """The body with the priority its key's tier allows: the tier's default when it sets none;
        one more important than the tier's highest is clamped to it, or refused; then less
        important by the tier's offset if it does not stream. (Its estimated cost is added at
        admission, once its prompt is tokenized: `admit`.)"""
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

    @property
    def adapters(self) -> dict[str, str]:
        """Every LoRA adapter served: name -> PEFT path (the config's, then those loaded at run time)."""
        return {**self.runtime_adapters, **self.static_adapters}

    async def resolve_model(self, model: str | None, key: APIKey) -> str | None:
        """check_model; a name it does not know is looked up once more in the AdapterRegistry
        where there is one (another ingress replica may have just loaded it)."""
        try:
            return self.check_model(model, key)
        except ModelNotFoundError:
            if self.adapter_sync is None or not await self.adapter_sync.refresh():
                raise
            return self.check_model(model, key)

    def check_model(self, model: str | None, key: APIKey) -> str | None:
        """The LoRA adapter a request's `model` names (the adapter, or `base:adapter`), None for the
        base model. A model this app does not serve, or one the key's tier may not use: 404, as
        OpenAI answers both (it does not say which models exist to a key that may not use them).
        A tier's `models` lists adapters by name."""
        lora = None
        if model is not None and model != self.model_name:
            base, _, adapter = model.partition(":")
            lora = model if model in self.adapters else adapter if base == self.model_name and adapter in self.adapters else None
            if lora is None:
                served = [m for m in [self.model_name, *sorted(self.adapters)] if self._may_use(key, m)]
                raise ModelNotFoundError(model, served)
        if not self._may_use(key, lora or self.model_name):
            raise ModelNotFoundError(model or self.model_name, [])
        return lora

    async def _adapter_update(self, request: Request, *, load: bool) -> Response:
        """vLLM's runtime LoRA endpoints. Load: {"lora_name", "lora_path"}; the workers read and
        check the adapter (one replica per pool) before its name is served; every replica
        registers it from the first request that names it (the request carries its path).
        Unload: {"lora_name"}; new requests for it get 404 at once, running ones finish. Plain-text
        answers, as vLLM's."""
        try:
            key = self.authenticate(request)
            lora = self.config.lora
            if lora is None or not lora.allow_runtime_updates:
                raise APIError(403, "Adapters are not loaded or unloaded at run time here: set "
                               "engine.lora.allow_runtime_updates: true in the serve config.",
                               type="permission_error", code="runtime_lora_updates_disabled")
            if self._keys and not key.is_admin:
                raise APIError(403, "Loading and unloading LoRA adapters needs an admin key (admin_api_keys).",
                               type="permission_error", code="admin_key_required")
            body = await read_json(request, self.config.max_request_body_bytes)
            name = _adapter_field(body, "lora_name")
            if not load:
                if name in self.static_adapters:
                    raise InvalidRequestError("lora_name", f"adapter {name!r} is listed in engine.lora.adapters; "
                                              "remove it from the serve config instead")
                if self.adapter_sync is not None:
                    await self.adapter_sync.refresh()
                if name not in self.runtime_adapters:
                    raise APIError(404, f"The lora adapter {name!r} cannot be found.", param="lora_name",
                                   code="lora_adapter_not_found")
                if self.adapter_sync is not None:
                    await self.adapter_sync.unload(name)
                self.runtime_adapters.pop(name, None)
                logger.info("LoRA adapter %r unloaded", name)
                return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
            path = str(PurePosixPath(_adapter_field(body, "lora_path")))  # as the engines spell it
            if name == self.model_name or ":" in name:
                raise InvalidRequestError("lora_name", f"{name!r} cannot name an adapter: it is the base model's "
                                          "name or holds ':' (base:adapter is how requests name adapters)")
            if self.adapter_sync is not None:
                await self.adapter_sync.refresh()
            if name in self.adapters:
                raise InvalidRequestError("lora_name", f"adapter {name!r} is already loaded (from "
                                          f"{self.adapters[name]}); unload it first")
            await self.frontend.backend.check_adapter(name, path)
            if name in self.adapters:  # another load of the name finished while this one was checked
                raise InvalidRequestError("lora_name", f"adapter {name!r} is already loaded (from "
                                          f"{self.adapters[name]}); unload it first")
            if self.adapter_sync is not None:
                taken = await self.adapter_sync.load(name, path)
                if taken is not None:  # another replica loaded the name meanwhile
                    raise InvalidRequestError("lora_name", f"adapter {name!r} is already loaded (from {taken}); "
                                              "unload it first")
            self.runtime_adapters[name] = path
            logger.info("LoRA adapter %r loaded from %s", name, path)
            return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")
        except Exception as exc:  # noqa: BLE001 - every failure is an HTTP answer
            error = to_api_error(exc)
            if error.status >= 500:
                logger.exception("%s failed", request.url.path)
            return error_response(error)

    def _adapter_card(self, name: str) -> dict:
        """A LoRA adapter in /v1/models, as vLLM lists one: its base model as parent."""
        return {"id": name, "object": "model", "created": self._created, "owned_by": "kvrelay",
                "root": self.adapters[name], "parent": self.model_name}

    def admit(self, call: Call, prompt_ids: list[list[int]], params: list[SamplingParams]) -> None:
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


def _adapter_field(body: dict, name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value.strip() or len(value) > 4096:
        raise InvalidRequestError(name, f"must be a non-empty string (at most 4096 characters); got {value!r:.80}")
    return value.strip()
