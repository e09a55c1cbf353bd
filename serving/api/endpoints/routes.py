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
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter
                                vLLM's runtime LoRA endpoints (serving/api/endpoints/adapters.py)
    anything else               404 (405 for a known path with another method) in OpenAI's error shape

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

import prometheus_client
from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import Response, StreamingResponse
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.api.admission.degradation import DEGRADED_HEADER, Degrader
from serving.api.admission.forwarding import Forwarder
from serving.api.admission.keys import ANONYMOUS, KeyRing
from serving.api.admission.rate_limits import RateLimiter
from serving.api.endpoints.adapters import AdapterUpdates
from serving.api.endpoints.calls import Call
from serving.api.endpoints.chat import ChatEndpoint
from serving.api.endpoints.completions import CompletionsEndpoint
from serving.api.endpoints.context import EndpointContext
from serving.api.endpoints.http_io import error_response, read_json
from serving.api.endpoints.models import ModelCatalog
from serving.api.endpoints.responses import ResponsesEndpoint
from serving.api.endpoints.tokenize import add_tokenize_routes
from serving.api.errors import APIError, AuthenticationError, HealthUnknownError, to_api_error, with_request_id
from serving.api.generation.pipeline import Frontend
from serving.api.protocol.openapi import openapi_document
from serving.api.usage import ModelPrice, RequestAccount, UsageLedger, load_pricing
from serving.config import ServeConfig
from serving.config.access import APIKey
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
        self.models = ModelCatalog(config, frontend)  # the base model and its LoRA adapters
        self._keys = KeyRing(config.keys)
        self._hints = {key.name: key.hint for key in config.keys} | {ANONYMOUS.name: ANONYMOUS.hint}
        self.limiter = RateLimiter(config.tiers)
        if price is None and config.pricing:
            price = load_pricing(config.pricing).price_for(self.model_name, config.pricing)
        self.price = price
        self.usage = UsageLedger()
        self.metrics = IngressMetrics(self.model_name)
        self.degrader = Degrader(config.degradation, self.model_name, self.metrics, fallback=fallback)
        self.clock = time.monotonic  # of request deadlines (serving/api/admission/deadlines.py)

    # The runtime adapters' names and their sync with the other ingress replicas (set by the
    # ingress deployment, serving/deployments/replicas.py): the catalogue's.
    @property
    def runtime_adapters(self) -> dict[str, str]:
        return self.models.runtime_adapters

    @property
    def adapter_sync(self):
        return self.models.adapter_sync

    @adapter_sync.setter
    def adapter_sync(self, sync) -> None:
        self.models.adapter_sync = sync

    # ---- the ASGI app ------------------------------------------------------------------------
    def build_app(self) -> FastAPI:
        app = FastAPI(title="kvrelay", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(APIError)
        async def _api_error(request: Request, exc: APIError):
            return error_response(exc)

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(request: Request, exc: StarletteHTTPException):
            return _routing_error(request, exc) if exc.status_code in (404, 405) else await http_exception_handler(request, exc)

        ctx = EndpointContext(self.model_name, self.config, self.frontend, self.models, self.metrics, self.admit, self.clock)
        self._completion_routes(app, ctx)
        self._model_routes(app)
        add_tokenize_routes(app, ctx, self.authenticate)
        self._operator_routes(app)
        return app

    def _completion_routes(self, app: FastAPI, ctx: EndpointContext) -> None:
        chat = ChatEndpoint(ctx)  # serving/api/endpoints/chat.py
        completions = CompletionsEndpoint(ctx)  # serving/api/endpoints/completions.py
        responses = ResponsesEndpoint(chat.start, self.model_name, self.config.api.context_budget)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await self._guard(request, self.degrader.wrap(request, chat), "chatcmpl-")

        @app.post("/v1/completions")
        async def text_completions(request: Request):
            return await self._guard(request, self.degrader.wrap(request, completions), "cmpl-")

        @app.post("/v1/responses")
        async def responses_route(request: Request):
            return await self._guard(request, self.degrader.wrap(request, responses), "resp_")

    def _model_routes(self, app: FastAPI) -> None:
        adapter_updates = AdapterUpdates(self.models, self.frontend.backend, self.config, self.authenticate, has_keys=bool(self._keys))

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request):
            return await adapter_updates(request, load=True)

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request):
            return await adapter_updates(request, load=False)

        @app.get("/v1/models")
        async def models(request: Request):
            return await self.models.listing(self.authenticate(request))

        @app.get("/v1/models/{model:path}")
        async def model(model: str, request: Request):
            return await self.models.card(model, self.authenticate(request))

    def _operator_routes(self, app: FastAPI) -> None:
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

    def admit(self, call: Call, prompt_ids: list[list[int]], params: list[SamplingParams]) -> None:
        """Take the request's tokens (its prompts and all it may generate, max_tokens resolved per
        prompt) from its key's limits, and make it less important by that estimated cost where its
        tier says so."""
        num_tokens = sum(len(ids) + p.n * p.max_tokens for ids, p in zip(prompt_ids, params, strict=True))
        call.ticket = self.limiter.admit(call.key, num_tokens)
        tier = self.config.tiers[call.key.tier]
        if tier.priority_cost_step_tokens is not None:  # estimated cost: a long request yields to short ones
            call.priority += min(tier.max_cost_priority_levels, num_tokens // tier.priority_cost_step_tokens)


def _routing_error(request: Request, exc: StarletteHTTPException) -> Response:
    """No route for the path (404), or not with this method (405, with `Allow`): in OpenAI's error
    shape, as OpenAI answers an unknown URL, not FastAPI's {"detail": "Not Found"}."""
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        return error_response(APIError(404, f"Invalid URL ({where})"))
    allowed = (exc.headers or {}).get("allow") or (exc.headers or {}).get("Allow")
    message = f"Method not allowed ({where})" + (f"; this path takes {allowed}" if allowed else "")
    return error_response(APIError(405, message, headers=dict(exc.headers or {})))
