"""Request tracing with OpenTelemetry: one trace per request, a span per stage, across Ray actors.

    client ─(traceparent)─▶ ingress                      OpenAIIngress, SERVER span, the request
                             ├─ tokenize                 chat template, tokenizer, validation
                             ├─ route        [prefill]   handle call → the replica starts it
                             ├─ queue        [prefill]   engine queue: arrival → first scheduled
                             ├─ prefill      [prefill]   first scheduled → first token
                             ├─ kv_transfer  [prefill]   export + ray.put + offer (background)
                             ├─ route        [decode]
                             ├─ kv_transfer  [decode]    claim (waits for the offer) + fetch
                             ├─ queue        [decode]
                             ├─ decode       [decode]    first scheduled → last token
                             └─ detokenize               first output at the ingress → last text

Every stage is a child of the ingress span; `kvrelay.pool` says where it ran (prefill, decode,
worker, local). A prompt the decode worker computes itself (colocated, n > 1, short prompts, a
failed KV import) gets `prefill` there, and decode runs first token → last token. The ingress
span is the client's child when it sent a W3C `traceparent`, else a root. The context crosses to
the workers as a carrier dict on `WorkerRequest.trace_context` (traceparent, tracestate, and when
the ingress called the handle).

How the stages are measured:
- route: Serve does not tell the caller when a replica accepted a call, so the worker records it:
  from the ingress's wall clock at the handle call to the worker's when its method starts (Serve's
  routing, the wait for a free replica, the actor call). Across nodes it includes their clock
  offset. A call refused before any replica took it (429, 503) has no route span; the ingress
  span carries the error.
- queue / prefill / decode: from the engine's `RequestMetrics` (arrival, first scheduled, first
  token, finished), recorded when the worker's call ends; an aborted request ends them at that
  moment, with `kvrelay.aborted`.
- kv_transfer, decode side: the claim until the payload is in hand; writing it into the paged
  cache happens in the engine's first step, inside `decode`.
- detokenize runs token by token between decode steps, so its span covers the first output to
  the last delta; `kvrelay.detokenize.busy_ms` is the time actually spent detokenizing.

When is it on (read once per process, by `setup`; the spec's variables, one deviation):
- `OTEL_SDK_DISABLED=true` (any case) turns it off, whatever else is set;
- else `OTEL_TRACES_EXPORTER` (comma-separated) names the exporters: `otlp`, `console`; `none`
  alone turns it off; unknown names are logged and skipped;
- else, when `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT` is set, `otlp`;
- else off. (The spec's default exporter is `otlp`; kvrelay exports nothing unless asked.)
The OTLP exporter speaks HTTP/protobuf (`OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL` unset or
`http/protobuf`; another protocol is logged and that exporter skipped) and reads its endpoint,
headers, timeout and compression from the standard variables; the sampler (`OTEL_TRACES_SAMPLER`,
default parent-based always-on, so a client's unsampled traceparent is honoured), the batch
processor (`OTEL_BSP_*`) and the resource (`OTEL_SERVICE_NAME`, default `kvrelay`;
`OTEL_RESOURCE_ATTRIBUTES`) likewise. `serving.deployments.app.build_app` passes the builder's `OTEL_*` to
every replica.

Off, it is free: `start_request` and `continue_trace` return None and every stage site is one
`if trace is not None` (`stage(None, ...)` is a shared no-op context manager).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from serving.engine.outputs import RequestMetrics

__all__ = [
    "RequestTrace",
    "CarriedTrace",
    "setup",
    "use_provider",
    "is_enabled",
    "exporters_from_env",
    "start_request",
    "continue_trace",
    "stage",
    "otel_env",
    "flush",
    "ROUTE_START_KEY",
]

logger = logging.getLogger(__name__)

ROUTE_START_KEY = "kvrelay-route-start-ns"  # in the carrier: the ingress's time.time_ns() at the handle call
_PROPAGATOR = TraceContextTextMapPropagator()
_SUPPORTED_EXPORTERS = ("otlp", "console")

_tracer: Tracer | None = None
_provider = None  # the SDK TracerProvider this process exports through, once set up
_is_set_up = False


# ---- set-up ----------------------------------------------------------------------------------
def exporters_from_env(env: Mapping[str, str] | None = None) -> list[str]:
    """The exporters the environment asks for; [] means tracing is off (rule in the docstring)."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if not names:
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        if not (endpoint and endpoint.strip()):
            return []
        names = ["otlp"]
    if "none" in names:
        if len(names) > 1:
            logger.warning("OTEL_TRACES_EXPORTER=%s: 'none' turns tracing off", ",".join(names))
        return []
    unknown = [n for n in names if n not in _SUPPORTED_EXPORTERS]
    if unknown:
        logger.warning("OTEL_TRACES_EXPORTER: %s not supported (use %s); skipped", ", ".join(unknown), ", ".join(_SUPPORTED_EXPORTERS))
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip().lower()
    if "otlp" in names and protocol != "http/protobuf":
        logger.warning("OTLP protocol %r is not supported (kvrelay exports http/protobuf); the otlp exporter is skipped", protocol)
        names = [n for n in names if n != "otlp"]
    return [n for n in dict.fromkeys(names) if n in _SUPPORTED_EXPORTERS]


def is_enabled() -> bool:
    """Whether this process records spans (after `setup` or `use_provider`)."""
    return _tracer is not None


def setup(role: str, env: Mapping[str, str] | None = None) -> bool:
    """Build this process's tracer from the environment, once; returns whether tracing is on.
    `role` (ingress, prefill, decode, worker) becomes the resource attribute `kvrelay.role`."""
    global _is_set_up
    if _is_set_up:
        return _tracer is not None
    _is_set_up = True
    exporters = exporters_from_env(env)
    if not exporters:
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    resource = Resource.create({"kvrelay.role": role})
    if resource.attributes.get(SERVICE_NAME, "").startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "kvrelay"}))
    provider = TracerProvider(resource=resource)
    for name in exporters:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        else:
            exporter = ConsoleSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))
    use_provider(provider)
    logger.info("tracing on (%s) for %s", ", ".join(exporters), role)
    return True


def use_provider(provider) -> None:
    """Record through `provider` (an SDK TracerProvider; tests pass one with an in-memory
    exporter), or stop recording with None. The global OTel provider is left alone."""
    global _tracer, _provider, _is_set_up
    _provider = provider
    _tracer = provider.get_tracer("kvrelay") if provider is not None else None
    _is_set_up = provider is not None


def flush(timeout_ms: int = 5000) -> None:
    """Export what is buffered (a replica shutting down); nothing when off."""
    if _provider is not None:
        _provider.force_flush(timeout_ms)


def otel_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The `OTEL_*` variables of this process, for replicas' runtime_env (they may start on nodes
    whose environment lacks them)."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if k.startswith("OTEL_")}


# ---- spans -----------------------------------------------------------------------------------
class _Spans:
    """Spans that are children of one parent context."""

    def __init__(self, tracer: Tracer, parent: Context, attributes: dict[str, Any]):
        self._tracer = tracer
        self._parent = parent
        self._attributes = attributes

    def start(self, name: str, attributes: dict[str, Any] | None = None, start_ns: int | None = None) -> Span:
        return self._tracer.start_span(
            name, context=self._parent, attributes={**self._attributes, **(attributes or {})}, start_time=start_ns,
        )

    def record(self, name: str, start_ns: int, end_ns: int, attributes: dict[str, Any] | None = None, *, error: str | None = None) -> None:
        """A stage measured after the fact."""
        span = self.start(name, attributes, start_ns)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(max(end_ns, start_ns))

    @contextlib.contextmanager
    def stage(self, name: str, attributes: dict[str, Any] | None = None) -> Iterator[Span]:
        """A stage around a block of code; an exception marks it failed and propagates."""
        span = self.start(name, attributes)
        try:
            yield span
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            span.end()


class RequestTrace(_Spans):
    """The ingress's side of one request: its SERVER span and the stages run at the ingress."""

    def __init__(self, tracer: Tracer, span: Span):
        super().__init__(tracer, set_span_in_context(span, Context()), {})
        self.span = span
        self._is_ended = False

    def set(self, attributes: dict[str, Any]) -> None:
        if not self._is_ended:  # a record held for degradation finishes after its span
            self.span.set_attributes(attributes)

    def carrier(self) -> dict[str, str]:
        """What rides on WorkerRequest.trace_context: this span's W3C context."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=self._parent)
        return carrier

    def end(self, status_code: int = 200, error: str | None = None) -> None:
        """Idempotent: a streamed response ends it when its body ends."""
        if self._is_ended:
            return
        self._is_ended = True
        self.span.set_attribute("http.response.status_code", status_code)
        if error is not None or status_code >= 500:
            self.span.set_status(Status(StatusCode.ERROR, error or str(status_code)))
        self.span.end()


class CarriedTrace(_Spans):
    """A worker's (or the LocalBackend's) spans for a request whose context came in a carrier."""

    def __init__(self, tracer: Tracer, carrier: Mapping[str, str], pool: str, request_id: str):
        attributes = {"kvrelay.pool": pool, "kvrelay.request_id": request_id}
        super().__init__(tracer, _PROPAGATOR.extract(carrier, context=Context()), attributes)
        self._route_start_ns = carrier.get(ROUTE_START_KEY)

    def route_done(self) -> None:
        """The call reached this replica: the route span ends now (it began at the ingress)."""
        if self._route_start_ns is not None:
            self.record("route", int(self._route_start_ns), time.time_ns())

    def engine_stages(self, metrics: RequestMetrics | None, *, prefill: bool, decode: bool, aborted: bool = False) -> None:
        """queue, then prefill and/or decode, from the engine's timestamps (monotonic clock)."""
        if metrics is None:
            return
        now_mono, now_ns = time.monotonic(), time.time_ns()

        def wall_ns(t: float) -> int:
            return now_ns - int((now_mono - t) * 1e9)

        extra = {"kvrelay.aborted": True} if aborted else None
        end = metrics.finished_mono_s or now_mono
        scheduled = metrics.first_scheduled_mono_s
        self.record("queue", wall_ns(metrics.arrival_mono_s), wall_ns(scheduled if scheduled is not None else end), extra)
        if scheduled is None:
            return
        first_token = metrics.first_token_mono_s
        if prefill:
            self.record("prefill", wall_ns(scheduled), wall_ns(first_token if first_token is not None else end), extra)
        if decode:
            start = (first_token if prefill else scheduled)
            if start is not None:
                self.record("decode", wall_ns(start), wall_ns(end), extra)


def start_request(headers: Mapping[str, str], attributes: dict[str, Any] | None = None) -> RequestTrace | None:
    """The ingress span of a new request, the child of the client's `traceparent` if it sent
    one; None when tracing is off."""
    if _tracer is None:
        return None
    parent = _PROPAGATOR.extract(headers, context=Context())
    span = _tracer.start_span("ingress", context=parent, kind=SpanKind.SERVER, attributes=attributes)
    return RequestTrace(_tracer, span)


def continue_trace(carrier: Mapping[str, str] | None, pool: str, request_id: str = "") -> CarriedTrace | None:
    """The worker side of a request's trace; None when it carries none or tracing is off here."""
    if carrier is None or _tracer is None:
        return None
    return CarriedTrace(_tracer, carrier, pool, request_id)


_NOOP = contextlib.nullcontext()


def stage(trace: _Spans | None, name: str, attributes: dict[str, Any] | None = None):
    """`with stage(trace, "tokenize"):` — a span when tracing, a shared no-op when not."""
    return _NOOP if trace is None else trace.stage(name, attributes)
