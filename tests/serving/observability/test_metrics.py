"""Metrics without Ray: the definitions, exact amounts after known requests through the API over a
real in-process engine, the recorders under a controlled clock, and what GET /metrics shows of
the routers and workers (serving/observability/metrics.py, serving/observability/export.py).

Every expected amount is known in advance: greedy requests with `ignore_eos` generate exactly
`max_tokens` tokens, prompt lengths come from the chat template, and the recorders' latencies
come from a clock the test sets.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from types import SimpleNamespace

import httpx
import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.replica_stats import RoutingStats
from serving.api.endpoints.routes import OpenAIServer
from serving.api.errors import QueueFullError, error_status
from serving.api.generation.pipeline import ChoiceDelta, Frontend
from serving.config import ServeConfig
from serving.deployments.local_backend import LocalBackend
from serving.engine.outputs import EngineStats, RequestMetrics
from serving.observability.export import PoolView, RoutersCollector
from serving.observability.ingress_metrics import IngressMetrics
from serving.observability.metrics import METRICS, series_names
from serving.observability.worker_metrics import WorkerRecorder
from tests.helpers import REPO, tiny_async_engine

MODEL = "tiny"
MAX_TOKENS = 5
README = REPO / "README.md"


# ---- helpers ---------------------------------------------------------------------------------
Samples = dict[tuple[str, frozenset], float]


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 when there are none)."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


def registry_samples(registry) -> Samples:
    return parse(prometheus_client.generate_latest(registry).decode())


class Clock:
    def __init__(self, *times: float):
        self.times = list(times)

    def monotonic(self) -> float:
        return self.times.pop(0)


def delta(index: int, token_ids: list[int], finish_reason: str | None = None) -> ChoiceDelta:
    return ChoiceDelta(index, "x" * len(token_ids), token_ids, None, finish_reason)


async def stream(*deltas: ChoiceDelta, error: BaseException | None = None, hang: bool = False, closed: list | None = None):
    try:
        for d in deltas:
            yield d
        if error is not None:
            raise error
        if hang:
            await asyncio.sleep(3600)
    finally:
        if closed is not None:
            closed.append(True)


# ---- definitions -----------------------------------------------------------------------------
def test_every_metric_is_defined_once_with_units_labels_and_buckets():
    assert len({spec.name for spec in METRICS}) == len(METRICS)
    for spec in METRICS:
        assert re.fullmatch(r"kvrelay_[a-z0-9_]+", spec.name), spec.name
        assert spec.description and spec.labels, spec.name
        assert spec.name.endswith("_total") == (spec.kind == "counter"), spec.name
        if spec.kind == "histogram":
            assert spec.name.endswith(("_seconds", "_tokens")) and list(spec.buckets) == sorted(set(spec.buckets)), spec.name
        else:
            assert not spec.buckets
    assert series_names(next(s for s in METRICS if s.name == "kvrelay_ttft_seconds")) == (
        "kvrelay_ttft_seconds_bucket", "kvrelay_ttft_seconds_sum", "kvrelay_ttft_seconds_count",
    )


def test_the_readme_lists_every_metric_with_its_type_and_labels():
    text = README.read_text()
    section = text[text.index("## Metrics"):]
    for spec in METRICS:
        row = next((line for line in section.splitlines() if line.startswith(f"| `{spec.name}`")), None)
        assert row is not None, f"README's Metrics table has no row for {spec.name}"
        assert spec.kind in row, row
        for label in spec.labels:
            assert label in row, (spec.name, label)


# ---- the API over a real engine: exact amounts -----------------------------------------------
@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    engine = tiny_async_engine(tiny_model_dir)
    config = ServeConfig(model=str(tiny_model_dir), served_model_name=MODEL)
    frontend = Frontend(engine.tokenizer, LocalBackend(engine), MODEL)
    server = OpenAIServer(frontend, config)
    yield SimpleNamespace(engine=engine, frontend=frontend, server=server, app=server.build_app(), config=config)
    engine.shutdown()


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def scrape(app) -> Samples:
    async with client(app) as c:
        response = await c.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse(response.text)


def prompt_len(stack, content: str) -> int:
    from serving.api.protocol.wire import ChatMessage

    return len(stack.frontend.encode_chat([ChatMessage(role="user", content=content)]))


@pytest.mark.asyncio
async def test_counters_and_histograms_move_by_exact_amounts_after_known_requests(stack):
    prompts = ["Hello there", "Tell me about caches.", "Count to three, slowly."]
    before = await scrape(stack.app)
    async with client(stack.app) as c:
        for i, content in enumerate(prompts):
            body = {
                "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "stream": i == 2,
            }
            response = await c.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
        response = await c.post("/v1/completions", json={
            "model": MODEL, "prompt": ["one two", "three four five"], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True,
        })
        assert response.status_code == 200, response.text
        completion_prompt_tokens = response.json()["usage"]["prompt_tokens"]
    after = await scrape(stack.app)

    def moved(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    n = len(prompts) + 1  # HTTP requests; the last one has two prompts (two choices)
    assert moved("kvrelay_requests_total", model=MODEL, status="200", finish_reason="length") == n
    assert moved("kvrelay_requests_total") == n
    assert moved("kvrelay_generation_tokens_total", model=MODEL) == (len(prompts) + 2) * MAX_TOKENS
    assert moved("kvrelay_prompt_tokens_total") == sum(prompt_len(stack, p) for p in prompts) + completion_prompt_tokens
    for histogram in ("kvrelay_ttft_seconds", "kvrelay_tpot_seconds", "kvrelay_e2e_request_latency_seconds"):
        assert moved(f"{histogram}_count", model=MODEL) == n, histogram
        assert moved(f"{histogram}_bucket", model=MODEL, le="+Inf") == n, histogram
        assert moved(f"{histogram}_sum") > 0
    # One gap per token after each choice's first, however the engine's outputs were merged into
    # chunks: MAX_TOKENS - 1 per choice (the two-prompt request has two choices).
    assert moved("kvrelay_inter_token_latency_seconds_count") == (len(prompts) + 2) * (MAX_TOKENS - 1)


@pytest.mark.asyncio
async def test_rejected_requests_count_by_status_and_move_nothing_else(stack):
    before = await scrape(stack.app)
    async with client(stack.app) as c:
        bad = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1}
        assert (await c.post("/v1/chat/completions", json=bad)).status_code == 400
        assert (await c.post("/v1/chat/completions", json={"model": "other", "messages": [{"role": "user", "content": "hi"}]})).status_code == 404
        assert (await c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})).status_code == 422
    locked = stack.server.__class__(stack.frontend, ServeConfig.model_validate({**stack.config.model_dump(), "api_keys": ["k"]}))
    async with client(locked.build_app()) as c:
        assert (await c.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})).status_code == 401
    after = await scrape(stack.app)
    for status in ("400", "404", "422"):
        assert value(after, "kvrelay_requests_total", status=status, finish_reason="none") - value(
            before, "kvrelay_requests_total", status=status, finish_reason="none") == 1
    assert value(registry_samples(locked.metrics.registry), "kvrelay_requests_total", status="401", finish_reason="none") == 1
    for name in ("kvrelay_prompt_tokens_total", "kvrelay_generation_tokens_total", "kvrelay_ttft_seconds_count"):
        assert value(after, name) == value(before, name), name


# ---- the ingress recorder under a controlled clock -------------------------------------------
@pytest.mark.asyncio
async def test_request_latencies_are_the_clients_view(monkeypatch):
    metrics = IngressMetrics(MODEL, use_ray=False)
    # start 10.0; tokens at 10.5, 10.6 (two in one chunk), 10.8; the stream ends at 10.9
    monkeypatch.setattr("serving.observability.ingress_metrics.time", Clock(10.0, 10.5, 10.6, 10.8, 10.9))
    record = metrics.start()
    deltas = stream(delta(0, [1]), delta(0, [2, 3]), delta(0, [4], "stop"))
    assert [d.token_ids async for d in metrics.track(record, deltas, prompt_tokens=7, status_of=error_status)] == [[1], [2, 3], [4]]
    s = registry_samples(metrics.registry)
    assert value(s, "kvrelay_requests_total", model=MODEL, status="200", finish_reason="stop") == 1
    assert value(s, "kvrelay_prompt_tokens_total") == 7
    assert value(s, "kvrelay_generation_tokens_total") == 4
    assert value(s, "kvrelay_ttft_seconds_count") == 1 and value(s, "kvrelay_ttft_seconds_sum") == pytest.approx(0.5)
    assert value(s, "kvrelay_e2e_request_latency_seconds_sum") == pytest.approx(0.9)
    assert value(s, "kvrelay_tpot_seconds_sum") == pytest.approx((10.9 - 10.5) / 3)  # 4 tokens: 3 after the first
    # one gap per token after the first: the chunk of two shares its 0.1 s gap (a slow reader merged them)
    assert value(s, "kvrelay_inter_token_latency_seconds_count") == 3
    assert value(s, "kvrelay_inter_token_latency_seconds_sum") == pytest.approx(0.05 + 0.05 + 0.2)
    assert value(s, "kvrelay_inter_token_latency_seconds_bucket", le="0.05") == 2
    assert value(s, "kvrelay_inter_token_latency_seconds_bucket", le="0.1") == 2
    assert value(s, "kvrelay_ttft_seconds_bucket", le="0.5") == 1 and value(s, "kvrelay_ttft_seconds_bucket", le="0.4") == 0


@pytest.mark.asyncio
async def test_a_client_that_leaves_is_a_499_abort_with_its_ttft_only(monkeypatch):
    metrics = IngressMetrics(MODEL, use_ray=False)
    monkeypatch.setattr("serving.observability.ingress_metrics.time", Clock(1.0, 1.25, 1.5, 9.0))
    record = metrics.start()
    closed: list = []
    tracked = metrics.track(record, stream(delta(0, [1]), delta(0, [2]), hang=True, closed=closed), prompt_tokens=3, status_of=error_status)
    await anext(tracked)
    await anext(tracked)
    await tracked.aclose()
    assert closed == [True]  # closing the tracker closed the stream (that is what aborts it)
    record.finish(500)  # later finishes are no-ops
    s = registry_samples(metrics.registry)
    assert value(s, "kvrelay_requests_total") == 1
    assert value(s, "kvrelay_requests_total", status="499", finish_reason="abort") == 1
    assert value(s, "kvrelay_ttft_seconds_sum") == pytest.approx(0.25)
    assert value(s, "kvrelay_generation_tokens_total") == 2 and value(s, "kvrelay_prompt_tokens_total") == 3
    for name in ("kvrelay_e2e_request_latency_seconds_count", "kvrelay_tpot_seconds_count", "kvrelay_inter_token_latency_seconds_count"):
        assert value(s, name) == 0, name


@pytest.mark.asyncio
async def test_a_failure_while_generating_counts_once_with_its_status():
    metrics = IngressMetrics(MODEL, use_ray=False)
    record = metrics.start()
    with pytest.raises(QueueFullError):
        async for _ in metrics.track(record, stream(error=QueueFullError("decode")), prompt_tokens=4, status_of=error_status):
            pass
    record.finish(429, "none")  # what the API's error path does next: no second count
    s = registry_samples(metrics.registry)
    assert value(s, "kvrelay_requests_total") == 1
    assert value(s, "kvrelay_requests_total", status="429", finish_reason="error") == 1
    assert value(s, "kvrelay_ttft_seconds_count") == 0


@pytest.mark.asyncio
async def test_a_held_refusal_counts_once_whatever_degradation_decides():
    """serving/api/admission/degradation.py holds a refused request's record until it knows who answers."""
    metrics = IngressMetrics(MODEL, use_ray=False)
    kept, forgotten, shed = metrics.start(), metrics.start(), metrics.start()
    for record in (kept, forgotten, shed):
        record.hold()
        with pytest.raises(QueueFullError):
            async for _ in metrics.track(record, stream(error=QueueFullError("decode")), prompt_tokens=4, status_of=error_status):
                pass
    assert value(registry_samples(metrics.registry), "kvrelay_requests_total") == 0
    kept.release()  # not degraded (or the fallback unreachable): counted as it was
    kept.finish(429, "none")
    forgotten.release(keep=False)  # the fallback answered, and counts it
    shed.release(keep=False)
    shed.finish(503, "none")  # shed: the API's error path counts the 503
    s = registry_samples(metrics.registry)
    assert value(s, "kvrelay_requests_total") == 2
    assert value(s, "kvrelay_requests_total", status="429", finish_reason="error") == 1
    assert value(s, "kvrelay_requests_total", status="503", finish_reason="none") == 1
    metrics.degraded("saturated", "small", "served")
    assert value(registry_samples(metrics.registry), "kvrelay_degraded_requests_total", model=MODEL, reason="saturated",
                 target="small", outcome="served") == 1


# ---- the workers -----------------------------------------------------------------------------
def engine_stats(**counts) -> EngineStats:
    base = {
        "num_running": 0, "num_waiting": 0, "num_blocks": 10, "num_free_blocks": 10, "kv_usage": 0.0,
        "num_preemptions": 0, "prefix_cache_query_tokens": 0, "prefix_cache_hit_tokens": 0,
        "num_computed_tokens": 0, "num_generated_tokens": 0, "num_held_exports": 0,
    }
    return EngineStats(**{**base, **counts})


def test_worker_metrics_record_exact_times_bytes_and_engine_deltas():
    wm = WorkerRecorder(MODEL, "decode", "r1", use_ray=False)
    wm.first_token(RequestMetrics(1.0, first_scheduled_mono_s=1.25, first_token_mono_s=2.0), computed_prompt=True)
    wm.first_token(RequestMetrics(1.0, first_scheduled_mono_s=1.5, first_token_mono_s=1.75), computed_prompt=False)
    wm.first_token(RequestMetrics(1.0, first_scheduled_mono_s=1.5), computed_prompt=True)  # aborted before a token
    assert wm.kv_import_s == 0.0  # before any import
    wm.kv_imported(0.25, 1000)
    assert wm.kv_import_s == 0.25  # the first import is the average
    wm.kv_exported(400)
    wm.kv_fallback("timeout")
    wm.refresh(engine_stats(prefix_cache_query_tokens=100, prefix_cache_hit_tokens=32, num_preemptions=1, num_running=2, num_waiting=3, kv_usage=0.5,
                            decode_steps=10, decode_step_rows=25, decode_step_s=0.5))
    wm.refresh(engine_stats(prefix_cache_query_tokens=150, prefix_cache_hit_tokens=48, num_preemptions=1, num_running=1, num_waiting=0, kv_usage=0.25,
                            decode_steps=14, decode_step_rows=33, decode_step_s=0.75))
    s = registry_samples(wm.instruments.registry)
    mine = {"model": MODEL, "pool": "decode", "replica": "r1"}
    assert value(s, "kvrelay_queue_time_seconds_count", **mine) == 2
    assert value(s, "kvrelay_queue_time_seconds_sum") == pytest.approx(0.25 + 0.5)
    assert value(s, "kvrelay_prefill_time_seconds_count") == 1 and value(s, "kvrelay_prefill_time_seconds_sum") == pytest.approx(0.75)
    assert value(s, "kvrelay_kv_transfer_seconds_count") == 1 and value(s, "kvrelay_kv_transfer_seconds_sum") == pytest.approx(0.25)
    assert value(s, "kvrelay_kv_transfer_bytes_total", direction="import") == 1000
    assert value(s, "kvrelay_kv_transfer_bytes_total", direction="export") == 400
    assert value(s, "kvrelay_kv_transfer_fallbacks_total", reason="timeout", **mine) == 1
    assert value(s, "kvrelay_prefix_cache_queried_tokens_total", **mine) == 150
    assert value(s, "kvrelay_prefix_cache_hit_tokens_total") == 48
    assert value(s, "kvrelay_preemptions_total") == 1
    assert (value(s, "kvrelay_decode_steps_total"), value(s, "kvrelay_decode_step_sequences_total"),
            value(s, "kvrelay_decode_step_seconds_total")) == (14, 33, 0.75)
    assert (value(s, "kvrelay_num_requests_running"), value(s, "kvrelay_num_requests_waiting")) == (1, 0)
    assert value(s, "kvrelay_kv_cache_usage_ratio", **mine) == 0.25


def test_worker_metrics_export_speculative_decoding_counts_by_proposer():
    wm = WorkerRecorder(MODEL, "decode", "r1", use_ray=False)
    wm.refresh(engine_stats())  # speculation off: no series
    assert not [n for n, _ in registry_samples(wm.instruments.registry) if n.startswith("kvrelay_spec_decode")]
    spec = {"spec_method": "ngram"}
    wm.refresh(engine_stats(**spec, spec_proposed_tokens=40, spec_accepted_tokens=10, spec_verify_steps=10))
    wm.refresh(engine_stats(**spec, spec_proposed_tokens=100, spec_accepted_tokens=30, spec_verify_steps=20))
    s = registry_samples(wm.instruments.registry)
    mine = {"model": MODEL, "pool": "decode", "replica": "r1", "proposer": "ngram"}
    assert value(s, "kvrelay_spec_decode_proposed_tokens_total", **mine) == 100
    assert value(s, "kvrelay_spec_decode_accepted_tokens_total", **mine) == 30
    assert value(s, "kvrelay_spec_decode_verify_steps_total", **mine) == 20
    assert value(s, "kvrelay_spec_decode_acceptance_ratio", **mine) == pytest.approx(0.3)
    assert value(s, "kvrelay_spec_decode_tokens_per_step", **mine) == pytest.approx(2.5)  # (30 + 20) / 20


def fake_router(deployment_name: str, policy: str, reasons: dict[str, int], replicas: dict) -> SimpleNamespace:
    """The RouterView of a request router: its replicas' newest routing stats on the wire (None:
    not reported yet)."""
    def replica_metrics():
        for replica_id, wire in replicas.items():
            stats = RoutingStats.from_wire(wire)
            if stats is not None:
                yield replica_id, stats.metrics

    return SimpleNamespace(deployment_name=deployment_name, policy_name=policy, decision_counts=lambda: dict(reasons),
                           replica_metrics=replica_metrics)


def test_metrics_endpoint_shows_routing_decisions_and_every_workers_last_report():
    a, b = WorkerRecorder(MODEL, "prefill", "a", use_ray=False), WorkerRecorder(MODEL, "prefill", "b", use_ray=False)
    c = WorkerRecorder(MODEL, "decode", "c", use_ray=False)
    for wm, queued in ((a, 1.0), (b, 2.0), (c, 4.0)):
        wm.first_token(RequestMetrics(0.0, first_scheduled_mono_s=queued, first_token_mono_s=queued + 1), computed_prompt=True)
    wire = {name: RoutingStats(metrics=tuple(wm.snapshot())).to_wire() for name, wm in (("a", a), ("b", b), ("c", c))}
    routers = [
        fake_router("PrefillWorker", "prefix_cost", {"prefix_hit": 3, "least_cost": 2}, {"a": wire["a"], "b": wire["b"]}),
        # a second handle to the same pool: its decisions add up, its replicas are not shown twice
        fake_router("PrefillWorker", "prefix_cost", {"prefix_hit": 1}, {"a": wire["a"], "new": {}}),
        fake_router("DecodeWorker", "least_kv", {"least_kv": 4}, {"c": wire["c"]}),
    ]
    metrics = IngressMetrics(MODEL, use_ray=False)
    metrics.registry.register(RoutersCollector(lambda: routers))
    s = registry_samples(metrics.registry)  # parses: one family per name, valid exposition
    assert value(s, "kvrelay_routing_decisions_total", pool="prefill", policy="prefix_cost", reason="prefix_hit") == 4
    assert value(s, "kvrelay_routing_decisions_total", pool="prefill", reason="least_cost") == 2
    assert value(s, "kvrelay_routing_decisions_total", pool="decode", policy="least_kv", reason="least_kv") == 4
    assert value(s, "kvrelay_queue_time_seconds_count", pool="prefill") == 2
    assert value(s, "kvrelay_queue_time_seconds_sum", pool="prefill") == 3.0
    assert value(s, "kvrelay_queue_time_seconds_sum", pool="decode", replica="c") == 4.0
    assert Counter(dict(ls)["replica"] for (n, ls) in s if n == "kvrelay_queue_time_seconds_count") == {"a": 1, "b": 1, "c": 1}


@pytest.mark.asyncio
async def test_pool_view_sets_replicas_by_state_and_the_desired_count():
    metrics = IngressMetrics(MODEL, use_ray=False)
    status = {"PrefillWorker": ({"RUNNING": 2, "STARTING": 1}, 3), "DecodeWorker": ({"RUNNING": 1}, 1), "Other": ({}, 9)}
    view = PoolView(metrics, "app", {"prefill": "PrefillWorker", "decode": "DecodeWorker"}, fetch=lambda app: status)
    await view.refresh()
    s = registry_samples(metrics.registry)
    assert value(s, "kvrelay_replicas", model=MODEL, pool="prefill", state="RUNNING") == 2
    assert value(s, "kvrelay_replicas", pool="prefill", state="STARTING") == 1
    assert value(s, "kvrelay_replicas", pool="prefill", state="STOPPING") == 0
    assert value(s, "kvrelay_desired_replicas", pool="prefill") == 3
    assert value(s, "kvrelay_desired_replicas", pool="decode") == 1
    assert value(s, "kvrelay_desired_replicas") == 4
    status["PrefillWorker"] = ({"RUNNING": 3}, 3)
    await view.refresh()
    s = registry_samples(metrics.registry)
    assert value(s, "kvrelay_replicas", pool="prefill", state="STARTING") == 0
    assert value(s, "kvrelay_replicas", pool="prefill", state="RUNNING") == 3


# ---- the autoscaler (runs in the Serve controller) -------------------------------------------
def test_the_autoscaler_counts_the_decisions_that_change_a_pool(monkeypatch):
    from collections import namedtuple

    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    from router.autoscaling.decide import prefill_policy, serve_autoscaling_config
    from router.autoscaling.policy import parse_policy

    recorded: list[tuple[str, str]] = []
    monkeypatch.setattr("router.autoscaling.decide.record_autoscaler_decision", lambda pool, action: recorded.append((pool, action)))
    point = namedtuple("Point", "timestamp value")
    policy = parse_policy({"prefill": {"max_replicas": 4, "upscale_delay_s": 0, "targets": {"ttft_p95_ms": None, "queued_prefill_tokens_per_replica": 100}}})
    config = AutoscalingConfig(**serve_autoscaling_config("prefill", policy))

    def decide(queued: float, target: int, now: float) -> int:
        ctx = AutoscalingContext(
            deployment_id=None, deployment_name="PrefillWorker", app_name="kvrelay", current_num_replicas=target,
            target_num_replicas=target, running_replicas=["r1"], total_num_requests=0.0, total_queued_requests=0.0,
            aggregated_metrics=None, raw_metrics=lambda: {"num_queued_prefill_tokens": {"r1": [point(now - 1, queued)]}},
            capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4, policy_state={},
            last_scale_up_time=None, last_scale_down_time=None, current_time=now, config=config,
        )
        return prefill_policy(ctx)[0]

    assert decide(queued=250, target=1, now=100.0) == 3  # up: 1 -> 3
    assert decide(queued=250, target=3, now=101.0) == 3  # hold: not counted
    assert decide(queued=0, target=9, now=102.0) == 4  # clamp to max_replicas
    assert recorded == [("prefill", "up"), ("prefill", "clamp")]


def test_the_recent_kv_import_time_weighs_the_newest_import_by_a_fifth():
    wm = WorkerRecorder(MODEL, "decode", "r1", use_ray=False)
    for seconds in (0.5, 1.0, 0.0):
        wm.kv_imported(seconds, 10)
    assert wm.kv_import_s == 0.8 * (0.8 * 0.5 + 0.2 * 1.0)  # 0.48
    assert wm.counters.kv_import_seconds == 1.5  # the total is kept apart


def test_a_failed_hand_off_counts_its_wait_in_the_recent_hand_off_time():
    wm = WorkerRecorder(MODEL, "decode", "r1", use_ray=False)
    wm.kv_fallback("released")  # the client left: not a hand-off's time
    assert wm.kv_import_s == 0.0
    wm.kv_fallback("timeout", 10.0)  # the claim waited out its timeout
    assert wm.kv_import_s == 10.0
    wm.kv_imported(0.0, 10)
    assert wm.kv_import_s == 8.0 and wm.counters.num_kv_fallbacks == 2
