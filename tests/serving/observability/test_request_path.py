"""A request's path at the ingress (serving/observability/request_path.py): the prefix check of a
hand-built prediction against a hand-built engine hit, the TTFT split on a fake clock, what the
ingress records of both (exact amounts), and, in process over a real engine, a split that sums to
the TTFT the ingress measured, on /metrics and on the request's span."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from serving.observability import request_path
from serving.observability.ingress_metrics import IngressMetrics
from serving.observability.request_path import (
    PATHS,
    Admission,
    Prediction,
    PrefixCheck,
    check_prefix,
    record_prediction,
    split_between,
)
from tests.helpers import tiny_engine_config


def admission(held: int, pending: int | None = None, *, replica: str = "r1", offset: float = 0.0, imported: bool = False) -> Admission:
    return Admission(replica, held, held if pending is None else pending, offset, imported)


# ---- the prefix check ------------------------------------------------------------------------
@pytest.mark.parametrize("predicted, cached, seen, logprobs, outcome, reason", [
    (32, 32, admission(32), False, "exact", "match"),
    (0, 0, admission(0), False, "exact", "match"),
    (32, 32, admission(0, replica="r2"), False, "exact", "match"),  # found it where it ran: no miss
    # a miss: the engine found fewer
    (48, 16, admission(48), False, "miss", "evicted_in_queue"),  # held on arrival, evicted in the queue
    (48, 16, admission(16, 48), False, "miss", "in_flight"),  # another request was computing it
    (48, 16, admission(16, 32), False, "miss", "stale"),  # not there when it arrived
    (48, 0, admission(0), False, "miss", "stale"),
    (48, 0, admission(48), True, "miss", "prompt_logprobs"),  # the engine looks nothing up for them
    (48, 16, admission(48, replica="r2"), False, "miss", "reassigned"),  # Serve ran it elsewhere
    (48, 16, None, False, "miss", "unknown"),
    # a surprise: the engine found more than the router's view showed
    (16, 48, admission(48), False, "surprise", "unseen"),
    (0, 32, admission(32, replica="r2"), False, "surprise", "reassigned"),
])
def test_the_check_of_a_hand_built_prediction(predicted, cached, seen, logprobs, outcome, reason):
    check = check_prefix("prefill", Prediction("prefix_cost", "r1", predicted), seen,
                         num_prompt_tokens=60, num_cached_tokens=cached, needs_prompt_logprobs=logprobs)
    assert (check.outcome, check.reason) == (outcome, reason)
    assert (check.num_predicted_tokens, check.num_cached_tokens, check.error_tokens) == (predicted, cached, abs(predicted - cached))


# ---- the split -------------------------------------------------------------------------------
def test_split_between_clamps_each_boundary_and_sums_exactly():
    assert split_between([1.0, 1.25, 1.75, 2.0]) == [0.25, 0.5, 0.25]
    # a boundary before its predecessor (another node's clock): that gap is 0, the next absorbs it
    assert split_between([1.0, 0.5, 1.75, 2.0]) == [0.0, 0.75, 0.25]
    # a boundary after the last: clamped to it
    assert split_between([1.0, 1.25, 2.5, 2.0]) == [0.25, 0.75, 0.0]


def output(*, arrival: float, scheduled: float, first_token: float, num_prompt: int = 60, num_cached: int = 0) -> RequestOutput:
    return RequestOutput("req", [CompletionOutput(0, "", [7], None)], False, num_prompt, num_cached,
                         RequestMetrics(arrival, scheduled, first_token))


@pytest.fixture
def fixed_offset(monkeypatch):
    """This process's wall-minus-monotonic offset, fixed at 500.0 s: a worker's engine times move
    by (its offset - 500.0)."""
    monkeypatch.setattr(request_path, "clock_offset_s", lambda: 500.0)


def test_a_disaggregated_split_on_a_fake_clock(fixed_offset):
    """The prefill worker's clock runs 100 s behind the ingress's (offset 600 against 500): its
    engine times move onto the ingress's clock, and the boundaries split the TTFT:
        received 1000.0 → scheduled 1000.25 → first token 1000.75 → back 1000.8125
        → decode placed 1000.875 → first token out 1000.9375."""
    path = request_path.RequestPath("req")
    path.computed("prefill", output(arrival=900.125, scheduled=900.25, first_token=900.75), admission(0, offset=600.0), 1000.8125)
    path.placed(1000.875)
    assert (path.scheduled_at, path.engine_first_token_at) == (1000.25, 1000.75)
    split = path.split(1000.0, 1000.9375)
    assert split == {"queue": 0.25, "prefill": 0.5, "delivery": 0.125, "handoff": 0.0625}
    assert sum(split.values()) == 0.9375
    # The decode worker (its own offset) imported the KV: arrival 1001.0, its first token 1001.0625,
    # the second token out at the ingress at 1001.125.
    first = output(arrival=901.0, scheduled=901.03125, first_token=901.0625)
    path.decode_started(first, admission(0, offset=600.0, imported=True))
    assert path.decode_split(1001.125) == {"kv_transfer": 0.125, "first_decode_step": 0.0625, "delivery": 0.0625}


def test_a_colocated_split_has_no_handoff_and_only_the_first_computation_counts(fixed_offset):
    path = request_path.RequestPath("req")
    path.computed("worker", output(arrival=2.0, scheduled=2.5, first_token=3.0), admission(0, offset=500.0), 3.25)
    # a resumed request computes its prompt again on another replica: the first computation stays
    path.computed("worker", output(arrival=5.0, scheduled=5.5, first_token=6.0), admission(0, offset=500.0), 6.25)
    assert path.split(1.0, 3.5) == {"queue": 1.5, "prefill": 0.5, "delivery": 0.5}
    assert path.decode_split(4.0) is None
    assert request_path.RequestPath("other").split(1.0, 3.5) is None  # no engine times: no split


def test_a_router_prediction_reaches_only_a_followed_request():
    before = len(PATHS)
    path = PATHS.open("followed")
    try:
        record_prediction("followed", "prefill", Prediction("prefix_cost", "r1", 32))
        record_prediction("followed", "prefill", Prediction("prefix_cost", "r2", 16))  # Serve asked again: the last counts
        record_prediction("nobody-follows-this", "prefill", Prediction("prefix_cost", "r1", 32))
        assert path.predictions == {"prefill": Prediction("prefix_cost", "r2", 16)}
        assert PATHS.find("nobody-follows-this") is None
    finally:
        PATHS.close("followed")
    assert len(PATHS) == before


# ---- what the ingress records ----------------------------------------------------------------
def samples(metrics: IngressMetrics) -> dict[tuple[str, frozenset], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in metrics.registry.collect() for s in family.samples
    }


def value(found, name: str, **labels: str) -> float:
    wanted = set(labels.items())
    return sum(v for (n, ls), v in found.items() if n == name and wanted <= ls)


def test_the_ingress_records_each_check_and_the_split_of_its_request(fixed_offset):
    metrics = IngressMetrics("m", use_ray=False)
    before = len(PATHS)
    record = metrics.start()
    record.start = 1000.0
    path = record.follow("req")
    record_prediction("req", "prefill", Prediction("prefix_cost", "r1", 48))
    path.computed("prefill", output(arrival=900.125, scheduled=900.25, first_token=900.75, num_cached=16),
                  admission(16, 48, offset=600.0), 1000.8125)
    path.placed(1000.875)
    record.first_token_at = 1000.9375
    record.tokens_by_choice = {0: 1}
    record.finish(200, "stop")
    assert len(PATHS) == before  # its path is closed with it

    found = samples(metrics)
    labels = {"model": "m", "pool": "prefill"}
    assert value(found, "kvrelay_prefix_tokens_total", kind="prompt", **labels) == 60
    assert value(found, "kvrelay_prefix_tokens_total", kind="predicted", **labels) == 48
    assert value(found, "kvrelay_prefix_tokens_total", kind="cached", **labels) == 16
    assert value(found, "kvrelay_prefix_predictions_total", outcome="miss", reason="in_flight", **labels) == 1
    assert value(found, "kvrelay_prefix_predictions_total") == 1
    assert value(found, "kvrelay_prefix_prediction_error_tokens_sum", outcome="miss", **labels) == 32
    assert value(found, "kvrelay_prefix_prediction_error_tokens_bucket", outcome="miss", le="32.0", **labels) == 1
    assert value(found, "kvrelay_prefix_prediction_error_tokens_bucket", outcome="miss", le="16.0", **labels) == 0
    split = {c: value(found, "kvrelay_ttft_split_seconds_sum", component=c, **labels) for c in ("queue", "prefill", "handoff", "delivery")}
    assert split == {"queue": 0.25, "prefill": 0.5, "handoff": 0.0625, "delivery": 0.125}
    assert value(found, "kvrelay_ttft_seconds_sum") == sum(split.values()) == 0.9375
    assert value(found, "kvrelay_decode_start_seconds_count") == 0  # no decode import seen


def test_an_exact_prediction_has_no_error_observation():
    metrics = IngressMetrics("m", use_ray=False)
    record = metrics.start()
    path = record.follow("req-exact")
    path.predicted("worker", Prediction("prefix_cost", "r1", 32))
    path.computed("worker", output(arrival=1.0, scheduled=1.0, first_token=1.5, num_cached=32), admission(32), 2.0)
    record.finish(200, "length")
    found = samples(metrics)
    assert value(found, "kvrelay_prefix_predictions_total", model="m", pool="worker", outcome="exact", reason="match") == 1
    assert value(found, "kvrelay_prefix_prediction_error_tokens_count") == 0
    assert value(found, "kvrelay_prefix_tokens_total", kind="predicted") == value(found, "kvrelay_prefix_tokens_total", kind="cached") == 32
    assert value(found, "kvrelay_ttft_split_seconds_count") == 0  # no first token reached the client


def test_a_check_is_a_plain_value():
    check = PrefixCheck("decode", 40, 32, 16, "miss", "stale", "r1")
    assert check.error_tokens == 16


# ---- in process, over a real engine ----------------------------------------------------------
@pytest.fixture(scope="module")
def app(tiny_model_dir):
    from serving.api.endpoints.routes import OpenAIServer
    from serving.api.generation.pipeline import Frontend
    from serving.config import ServeConfig
    from serving.deployments.local_backend import LocalBackend
    from serving.engine.async_engine import AsyncEngine

    engine = AsyncEngine(tiny_engine_config(tiny_model_dir, num_threads=1))
    server = OpenAIServer(Frontend(engine.tokenizer, LocalBackend(engine), "tiny"), ServeConfig(model=str(tiny_model_dir), served_model_name="tiny"))
    yield server.build_app()
    engine.shutdown()


@pytest.mark.asyncio
async def test_the_split_of_a_real_request_sums_to_its_ttft_on_metrics_and_span(app):
    import httpx
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from serving.observability import tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Where does the time go?"}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            before = parse((await client.get("/metrics")).text)
            for stream in (False, True):
                response = await client.post("/v1/chat/completions", json={**body, "stream": stream})
                assert response.status_code == 200, response.text
            after = parse((await client.get("/metrics")).text)
    finally:
        tracing.use_provider(None)
        provider.shutdown()

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("kvrelay_ttft_seconds_count") == 2
    components = {c: moved("kvrelay_ttft_split_seconds_sum", model="tiny", pool="local", component=c) for c in ("queue", "prefill", "delivery")}
    assert all(seconds > 0 for seconds in components.values()), components
    assert moved("kvrelay_ttft_split_seconds_count", component="handoff") == 0  # one engine: no hand-off
    assert sum(components.values()) == pytest.approx(moved("kvrelay_ttft_seconds_sum"), abs=1e-9)
    assert moved("kvrelay_prefix_predictions_total") == 0  # no router: nothing predicted

    ingresses = [span for span in exporter.get_finished_spans() if span.name == "ingress"]
    assert len(ingresses) == 2
    for span in ingresses:
        a = span.attributes
        assert a["kvrelay.ttft.pool"] == "local"
        parts = [a[f"kvrelay.ttft.{c}_ms"] for c in ("queue", "prefill", "delivery")]
        assert sum(parts) == pytest.approx(a["kvrelay.ttft_ms"], abs=1e-6)
        assert "kvrelay.ttft.handoff_ms" not in a and "kvrelay.prefix.outcome" not in a


def parse(text: str) -> dict[tuple[str, frozenset], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }
