"""Tracing: the env-var rule, the stage tree in process (in-memory exporter), an OTLP/HTTP export
to a local receiver, and (integration) the full tree across Ray replicas.

    in process:   httpx ─ASGI─▶ OpenAIServer ─▶ Frontend ─▶ LocalBackend      InMemorySpanExporter
    on Ray:       httpx ─HTTP─▶ Serve proxy ─▶ OpenAIIngress ─▶ PrefillWorker ─KV─▶ DecodeWorker
                  every replica exports OTLP/HTTP to a receiver in this process (OTLPReceiver)
"""

from __future__ import annotations

import gzip
import http.server
import threading
import time
import zlib

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from load_tests.local_ray import free_port
from serving.api.endpoints.routes import OpenAIServer
from serving.api.generation.pipeline import Frontend
from serving.config import ServeConfig
from serving.deployments.local_backend import LocalBackend
from serving.engine.outputs import RequestMetrics
from serving.observability import tracing
from tests.asgi import post
from tests.helpers import tiny_app_config, tiny_async_engine, wait_until

MODEL = "tiny"
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
# Greedy, a fixed number of tokens whatever the random model says (EOS ignored).
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
ENGINE_STAGES = ("queue", "prefill", "decode")


# ---- the env-var rule ------------------------------------------------------------------------
@pytest.mark.parametrize("env, exporters", [
    ({}, []),
    ({"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"}, []),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, ["otlp"]),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, ["otlp"]),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "  "}, []),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "console"}, ["console"]),
    ({"OTEL_TRACES_EXPORTER": "OTLP, console,otlp"}, ["otlp", "console"]),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, []),
    ({"OTEL_TRACES_EXPORTER": "otlp,none"}, []),
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, []),
    ({"OTEL_TRACES_EXPORTER": "zipkin,console"}, ["console"]),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "TRUE"}, []),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}, []),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "false"}, ["otlp"]),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, []),
    ({"OTEL_TRACES_EXPORTER": "otlp,console", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}, ["console"]),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
      "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}, ["otlp"]),
])
def test_which_exporters_the_environment_asks_for(env, exporters):
    assert tracing.exporters_from_env(env) == exporters


def test_replicas_get_the_otel_variables_only():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_BSP_SCHEDULE_DELAY": "100", "PATH": "/bin", "KVRELAY_MODE": "x"}
    assert tracing.otel_env(env) == {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_BSP_SCHEDULE_DELAY": "100"}


def test_setup_without_otel_variables_leaves_tracing_off():
    tracing.use_provider(None)
    try:
        assert tracing.setup("ingress", env={}) is False
        assert not tracing.is_enabled()
        assert tracing.start_request({"traceparent": TRACEPARENT}) is None
        assert tracing.continue_trace({"traceparent": TRACEPARENT}, "decode") is None
        assert tracing.stage(None, "tokenize") is tracing.stage(None, "detokenize")  # one shared no-op
    finally:
        tracing.use_provider(None)


# ---- in process ------------------------------------------------------------------------------
class Stack:
    def __init__(self, tiny_model_dir):
        self.engine = tiny_async_engine(tiny_model_dir)
        config = ServeConfig(model=str(tiny_model_dir), served_model_name=MODEL)
        self.backend = SpyBackend(LocalBackend(self.engine))
        self.app = OpenAIServer(Frontend(self.engine.tokenizer, self.backend, MODEL), config).build_app()


class SpyBackend:
    """LocalBackend, remembering the WorkerRequests it was given."""

    def __init__(self, inner: LocalBackend):
        self.inner = inner
        self.requests = []

    async def model_info(self):
        return await self.inner.model_info()

    def generate(self, request):
        self.requests.append(request)
        return self.inner.generate(request)

    async def health(self):
        return await self.inner.health()


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    stack = Stack(tiny_model_dir)
    yield stack
    stack.engine.shutdown()


@pytest.fixture
def exporter():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    yield exporter
    tracing.use_provider(None)
    provider.shutdown()


def by_name(spans) -> dict[str, list]:
    named: dict[str, list] = {}
    for span in spans:
        named.setdefault(span.name, []).append(span)
    return named


def assert_within(outer, inner, slack_ns: int = 2_000_000):
    """`inner` lies inside `outer` (up to the monotonic→wall clock conversion's jitter)."""
    assert outer.start_time - slack_ns <= inner.start_time <= inner.end_time <= outer.end_time + slack_ns, (outer.name, inner.name)


@pytest.mark.asyncio
async def test_a_chat_completion_is_one_trace_under_the_clients_span(stack, exporter):
    response = await post(stack.app, "/v1/chat/completions", CHAT, traceparent=TRACEPARENT)
    assert response.status_code == 200, response.text

    spans = by_name(exporter.get_finished_spans())
    assert sorted(spans) == ["decode", "detokenize", "ingress", "prefill", "queue", "tokenize"]
    assert all(len(group) == 1 for group in spans.values())
    (ingress,) = spans["ingress"]
    # The client's traceparent is honoured: its trace id, its span as the ingress span's parent.
    assert format(ingress.context.trace_id, "032x") == CLIENT_TRACE_ID
    assert format(ingress.parent.span_id, "016x") == CLIENT_SPAN_ID and ingress.parent.is_remote
    assert ingress.kind.name == "SERVER"
    for name in ("tokenize", *ENGINE_STAGES, "detokenize"):
        (span,) = spans[name]
        assert span.context.trace_id == ingress.context.trace_id
        assert span.parent.span_id == ingress.context.span_id, name
        assert_within(ingress, span)
    for name in ENGINE_STAGES:
        assert spans[name][0].attributes["kvrelay.pool"] == "local"
        assert spans[name][0].attributes["kvrelay.request_id"] == response.json()["id"]
    # The stages follow each other: tokenize, then the engine's queue → prefill → decode.
    tokenize, queue, prefill, decode = (spans[n][0] for n in ("tokenize", *ENGINE_STAGES))
    assert tokenize.end_time <= queue.start_time + 1_000_000  # clock conversion jitter
    assert queue.end_time == prefill.start_time and prefill.end_time == decode.start_time
    body = response.json()
    assert ingress.attributes["kvrelay.request_id"] == body["id"]
    assert ingress.attributes["http.response.status_code"] == 200
    assert ingress.attributes["gen_ai.usage.input_tokens"] == body["usage"]["prompt_tokens"]
    assert ingress.attributes["gen_ai.usage.output_tokens"] == body["usage"]["completion_tokens"] == 5
    assert spans["detokenize"][0].attributes["kvrelay.detokenize.num_tokens"] == 5
    # What crossed to the backend is the ingress span's context.
    carrier = stack.backend.requests[-1].trace_context
    assert carrier["traceparent"] == f"00-{CLIENT_TRACE_ID}-{format(ingress.context.span_id, '016x')}-01"


@pytest.mark.asyncio
async def test_a_stream_without_traceparent_is_a_root_trace_ended_with_the_stream(stack, exporter):
    body = {k: v for k, v in CHAT.items() if k != "messages"}
    response = await post(stack.app, "/v1/completions", {**body, "prompt": "The fox", "stream": True})
    assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
    spans = by_name(exporter.get_finished_spans())
    (ingress,) = spans["ingress"]
    assert ingress.parent is None
    assert {s.parent.span_id for n in ("tokenize", *ENGINE_STAGES, "detokenize") for s in spans[n]} == {ingress.context.span_id}
    # The ingress span ends after the last token was detokenized, not when the headers left.
    assert spans["detokenize"][0].end_time <= ingress.end_time
    assert ingress.attributes["gen_ai.usage.output_tokens"] == 5


@pytest.mark.asyncio
async def test_an_unsampled_client_trace_records_nothing(stack, exporter):
    response = await post(stack.app, "/v1/chat/completions", CHAT, traceparent=f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-00")
    assert response.status_code == 200
    assert exporter.get_finished_spans() == ()


@pytest.mark.asyncio
async def test_a_refused_request_is_an_ingress_span_with_its_status(stack, exporter):
    response = await post(stack.app, "/v1/chat/completions", {**CHAT, "model": "other"})
    assert response.status_code == 404
    (ingress,) = exporter.get_finished_spans()
    assert ingress.name == "ingress"
    assert ingress.attributes["http.response.status_code"] == 404
    assert ingress.attributes["error.type"] == "model_not_found"


@pytest.mark.asyncio
async def test_a_failing_stage_is_marked(stack, exporter):
    response = await post(stack.app, "/v1/chat/completions", {**CHAT, "max_tokens": 10**6})
    assert response.status_code == 400
    spans = by_name(exporter.get_finished_spans())
    assert sorted(spans) == ["ingress", "tokenize"]
    assert spans["tokenize"][0].status.status_code.name == "ERROR"
    assert spans["ingress"][0].attributes["error.type"] == "context_length_exceeded"


@pytest.mark.asyncio
async def test_tracing_off_sends_no_context_to_the_workers(stack):
    tracing.use_provider(None)
    response = await post(stack.app, "/v1/chat/completions", CHAT, traceparent=TRACEPARENT)
    assert response.status_code == 200
    assert stack.backend.requests[-1].trace_context is None


def test_a_worker_continues_the_carried_context(exporter):
    provider_tracer = tracing._tracer
    trace = tracing.RequestTrace(provider_tracer, provider_tracer.start_span("ingress"))
    sent = time.time_ns()
    carrier = {**trace.carrier(), tracing.ROUTE_START_KEY: str(sent)}
    worker = tracing.continue_trace(carrier, "decode")
    worker.route_done()
    # Engine timestamps are monotonic: queue 1 s, prefill 0.5 s, decode 2 s, ending now.
    now = time.monotonic()
    worker.engine_stages(RequestMetrics(now - 3.5, now - 2.5, now - 2.0, now), prefill=True, decode=True)
    trace.end()
    spans = by_name(exporter.get_finished_spans())
    ingress = spans["ingress"][0]
    for name in ("route", *ENGINE_STAGES):
        (span,) = spans[name]
        assert span.parent.span_id == ingress.context.span_id and span.parent.is_remote
        assert span.attributes["kvrelay.pool"] == "decode"
    assert spans["route"][0].start_time == sent
    durations_ms = [round((spans[n][0].end_time - spans[n][0].start_time) / 1e6) for n in ENGINE_STAGES]
    assert durations_ms == [1000, 500, 2000]


def test_an_imported_prompt_has_no_prefill_and_an_aborted_request_says_so(exporter):
    worker = tracing.continue_trace(tracing.RequestTrace(tracing._tracer, tracing._tracer.start_span("ingress")).carrier(), "decode")
    now = time.monotonic()
    worker.engine_stages(RequestMetrics(now - 2.0, now - 1.0, now - 0.5, None), prefill=False, decode=True, aborted=True)
    spans = by_name(exporter.get_finished_spans())
    assert sorted(spans) == ["decode", "queue"]  # no route: the carrier had no route start
    assert round((spans["decode"][0].end_time - spans["decode"][0].start_time) / 1e9) == 1  # first scheduled → now
    assert spans["decode"][0].attributes["kvrelay.aborted"] is True


# ---- OTLP/HTTP -------------------------------------------------------------------------------
class OTLPReceiver:
    """A local OTLP/HTTP trace receiver: decodes each ExportTraceServiceRequest into plain spans."""

    def __init__(self):
        self.spans: list[dict] = []
        self.paths: list[str] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                encoding = self.headers.get("Content-Encoding")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                receiver.add(self.path, self.headers.get("Content-Type"), body)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def add(self, path: str, content_type: str, body: bytes) -> None:
        assert content_type == "application/x-protobuf", content_type
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        decoded = []
        for resource_spans in request.resource_spans:
            resource = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    decoded.append({
                        "name": span.name, "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                        "parent_span_id": span.parent_span_id.hex(), "start": span.start_time_unix_nano,
                        "end": span.end_time_unix_nano, "resource": resource, "scope": scope_spans.scope.name,
                        "attributes": {kv.key: _any_value(kv.value) for kv in span.attributes},
                    })
        with self._lock:
            self.paths.append(path)
            self.spans += decoded

    def trace(self, trace_id: str) -> list[dict]:
        with self._lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _any_value(value):
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


@pytest.fixture
def receiver():
    receiver = OTLPReceiver()
    yield receiver
    receiver.close()


@pytest.mark.asyncio
async def test_an_otlp_http_export_reaches_a_local_receiver_and_decodes(stack, receiver, monkeypatch):
    """setup() from the environment alone, as a replica does, exporting through the real
    OTLP/HTTP exporter and batch processor."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    tracing.use_provider(None)
    try:
        assert tracing.setup("ingress") is True
        response = await post(stack.app, "/v1/chat/completions", CHAT, traceparent=TRACEPARENT)
        assert response.status_code == 200
        tracing.flush()
        spans = wait_until(lambda: len(receiver.trace(CLIENT_TRACE_ID)) >= 6 and receiver.trace(CLIENT_TRACE_ID))
    finally:
        provider = tracing._provider
        tracing.use_provider(None)
        provider.shutdown()
    assert set(receiver.paths) == {"/v1/traces"}
    named = {s["name"]: s for s in spans}
    assert sorted(named) == ["decode", "detokenize", "ingress", "prefill", "queue", "tokenize"]
    ingress = named["ingress"]
    assert ingress["parent_span_id"] == CLIENT_SPAN_ID
    assert all(s["parent_span_id"] == ingress["span_id"] for s in spans if s is not ingress)
    assert ingress["resource"]["service.name"] == "kvrelay" and ingress["resource"]["kvrelay.role"] == "ingress"
    assert ingress["scope"] == "kvrelay"
    assert ingress["attributes"]["kvrelay.request_id"] == response.json()["id"]
    assert ingress["attributes"]["http.response.status_code"] == 200
    assert ingress["start"] <= named["tokenize"]["start"] and named["detokenize"]["end"] <= ingress["end"]


# ---- on Ray: every stage, every replica ------------------------------------------------------

@pytest.fixture(scope="module")
def traced_app(tmp_path_factory, tiny_model_dir):
    """A disaggregated app whose replicas export to a receiver in this process. The OTEL_*
    variables are set after Ray started, so replicas see them only through build_app's
    runtime_env, not by inheriting the raylet's environment."""
    import ray
    from ray import serve

    from serving.deployments import kv_transfer
    from serving.deployments.app import build_app

    receiver = OTLPReceiver()
    ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING", _temp_dir=str(tmp_path_factory.mktemp("ray")))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = tiny_app_config(tiny_model_dir, "traced", served_model_name=MODEL)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        env.setenv("OTEL_SERVICE_NAME", "kvrelay-test")
        app = build_app(config)
    serve.run(app, name="traced", route_prefix="/traced")
    yield f"http://127.0.0.1:{port}/traced", receiver
    kv_transfer.kill_all("traced")
    serve.shutdown()
    ray.shutdown()
    receiver.close()


@pytest.mark.integration
def test_the_full_stage_tree_across_replicas(traced_app):
    url, receiver = traced_app
    response = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers={"traceparent": TRACEPARENT}, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 5

    expected = ["decode", "detokenize", "ingress", "kv_transfer", "kv_transfer", "prefill", "queue", "queue", "route", "route", "tokenize"]
    spans = wait_until(lambda: sorted(s["name"] for s in receiver.trace(CLIENT_TRACE_ID)) == expected and receiver.trace(CLIENT_TRACE_ID))

    (ingress,) = [s for s in spans if s["name"] == "ingress"]
    assert ingress["parent_span_id"] == CLIENT_SPAN_ID  # the client's span, in the client's trace
    assert all(s["trace_id"] == CLIENT_TRACE_ID for s in spans)
    assert all(s["parent_span_id"] == ingress["span_id"] for s in spans if s is not ingress)

    def where(s):
        return s["resource"]["kvrelay.role"], s["attributes"].get("kvrelay.pool"), s["attributes"].get("kvrelay.kv.side")

    placed = sorted((s["name"], *where(s)) for s in spans)
    assert placed == sorted([
        ("ingress", "ingress", None, None),
        ("tokenize", "ingress", None, None),
        ("route", "prefill", "prefill", None),
        ("queue", "prefill", "prefill", None),
        ("prefill", "prefill", "prefill", None),
        ("kv_transfer", "prefill", "prefill", "export"),
        ("route", "decode", "decode", None),
        ("kv_transfer", "decode", "decode", "import"),
        ("queue", "decode", "decode", None),
        ("decode", "decode", "decode", None),
        ("detokenize", "ingress", None, None),
    ])
    assert {s["resource"]["service.name"] for s in spans} == {"kvrelay-test"}
    request_id = response.json()["id"]
    assert {s["attributes"]["kvrelay.request_id"] for s in spans if s["name"] != "tokenize"} == {request_id}
    (imported,) = [s for s in spans if where(s)[2] == "import"]
    assert imported["attributes"]["kvrelay.kv.imported"] is True
    assert imported["attributes"]["kvrelay.kv.bytes"] > 0

    # One clock on one node: the stages follow each other inside the ingress span.
    def span(name, pool=None):
        (s,) = [s for s in spans if s["name"] == name and (pool is None or s["attributes"].get("kvrelay.pool") == pool)]
        return s

    slack = 2_000_000
    order = [span("tokenize"), span("route", "prefill"), span("queue", "prefill"), span("prefill"), span("decode")]
    for before, after in zip(order, order[1:]):
        assert before["end"] <= after["start"] + slack, (before["name"], after["name"])
    assert span("route", "prefill")["end"] <= span("route", "decode")["start"] + slack
    assert span("kv_transfer", "prefill")["start"] >= span("prefill")["end"] - slack
    for s in spans:
        assert ingress["start"] - slack <= s["start"] <= s["end"] <= ingress["end"] + slack or s["name"] == "kv_transfer", s["name"]
