"""Metrics of the live app on a local Ray (tiny model): exact amounts at GET /metrics across the
ingress, the prefill and the decode pools; the same values in Ray's metrics export; a real
Prometheus scraping both and answering PromQL on the TTFT histogram.

    /m   disaggregated: prefill + decode pools, KV through the KVTransfer actor
    /f   disaggregated with a KV-claim timeout so short that every import falls back

Requests are greedy with `ignore_eos`, so each generates exactly MAX_TOKENS tokens; prompt
lengths come from the chat template; KV payload sizes from the tiny model's shape; the engines'
prefix-cache counters are compared with the engines' own stats.
"""

from __future__ import annotations

import json
import math
import subprocess
import time

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from load_tests.local_ray import free_port
from serving.api.generation.pipeline import Frontend
from serving.api.protocol.wire import ChatMessage
from serving.engine.config import EngineConfig
from serving.engine.engine import LLMEngine
from serving.engine.outputs import EngineStats
from tests.helpers import REPO, TINY_KV_BYTES, require_tool, tiny_app_config, wait_until

pytestmark = pytest.mark.integration

MAX_TOKENS = 6
PROMETHEUS_HOW = "it comes with the Debian package `prometheus` (`make install` installs it where apt-get exists)"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    import ray
    from ray import serve

    from serving.deployments.app import build_app

    temp_dir = tmp_path_factory.mktemp("ray")
    ray.init(
        num_cpus=8, include_dashboard=True, dashboard_port=free_port(), logging_level="WARNING",
        _temp_dir=str(temp_dir), _metrics_export_port=free_port(),
        _system_config={"metrics_report_interval_ms": 1000},  # Ray's export catches up in ~1 s
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    apps = {
        "m": tiny_app_config(tiny_model_dir, "metrics"),
        "f": tiny_app_config(tiny_model_dir, "metricsfaults", kv_transfer={"lease_s": 1.0, "timeout_s": 1e-9}),
    }
    for prefix, config in apps.items():
        serve.run(build_app(config), name=config.app_name, route_prefix=f"/{prefix}")
    yield {
        "url": f"http://127.0.0.1:{port}", "port": port, "temp_dir": temp_dir,
        "ray_metrics_port": ray.nodes()[0]["MetricsExportPort"],
    }
    from serving.deployments import kv_transfer

    for config in apps.values():
        kv_transfer.kill_all(config.app_name)
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def prompt_ids(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_bytes=TINY_KV_BYTES))
    frontend = Frontend(engine.tokenizer, backend=None, model_name="tiny")
    return lambda content: frontend.encode_chat([ChatMessage(role="user", content=content)])


# ---- helpers ---------------------------------------------------------------------------------
Samples = dict[tuple[str, frozenset], float]


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


def scrape(url: str) -> Samples:
    response = httpx.get(url, timeout=30)
    assert response.status_code == 200, response.text
    return parse(response.text)


def settled(url: str, *, kv_imported: bool = True) -> Samples:
    """A scrape in which the workers' reports (each pool's every routing-stats period) include
    every request the ingress has answered: both pools saw as many first tokens as the clients,
    and (`kv_imported`) the prefill side has counted every export the decode side imported (it
    counts one once its offer is in, which may be after its first token)."""
    def caught_up() -> Samples | None:
        samples = scrape(url)
        ingress = value(samples, "kvrelay_ttft_seconds_count")
        pools = [value(samples, "kvrelay_queue_time_seconds_count", pool=pool) for pool in ("prefill", "decode")]
        kv = [value(samples, "kvrelay_kv_transfer_bytes_total", direction=d) for d in ("export", "import")]
        return samples if pools == [ingress, ingress] and (not kv_imported or kv[0] == kv[1]) else None

    return wait_until(caught_up, timeout_s=30)


def scrape_until(url: str, name: str, labels: dict, expected: float, before: Samples | None = None, timeout_s: float = 60.0) -> Samples:
    """The first scrape of `url` where `name{labels}` has moved by `expected` since `before`."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(url)
        moved = value(samples, name, **labels) - (value(before, name, **labels) if before else 0)
        if moved == expected:
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"{name}{labels} moved by {moved}, not {expected}, within {timeout_s}s")
        time.sleep(0.25)


def chat(base: str, content: str, *, stream: bool = False) -> None:
    body = {
        "model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
        "temperature": 0, "ignore_eos": True, "stream": stream,
    }
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    if not stream:
        assert response.json()["usage"]["completion_tokens"] == MAX_TOKENS


def engine_stats(app: str, deployment: str) -> EngineStats:
    from ray import serve

    return serve.get_deployment_handle(deployment, app_name=app).stats.remote().result(timeout_s=30).engine


def payload_bytes(num_prompt_tokens: int) -> int:
    """The tiny model's KV for a prompt: K and V x 2 layers x 2 KV heads x 16 dims, float32,
    in whole 16-token blocks."""
    return 2 * 2 * -(-num_prompt_tokens // 16) * 2 * 16 * 16 * 4


# ---- exact amounts at GET /metrics -----------------------------------------------------------
def test_metrics_move_by_exact_amounts_across_ingress_prefill_and_decode(cluster, prompt_ids):
    base = cluster["url"] + "/m"
    chat(base, "Warm up: the routers and the workers' reports exist from here on.")
    prompts = ["Tell me about the ocean.", "What is a KV cache?", "Name three primes."]
    before = settled(base + "/metrics")
    stats_before = {d: engine_stats("metrics", d) for d in ("PrefillWorker", "DecodeWorker")}
    for i, content in enumerate(prompts):
        chat(base, content, stream=i == 1)
    chat(base, prompts[0])  # the same prompt again: its full blocks are prefix-cache hits
    n = len(prompts) + 1
    lengths = [len(prompt_ids(p)) for p in [*prompts, prompts[0]]]

    def moved(samples, name, **labels):
        return value(samples, name, **labels) - value(before, name, **labels)

    # Workers report with their routing stats (every 0.5 s): wait until both pools' reports
    # cover every request, then everything before their first tokens shows too.
    after = settled(base + "/metrics")
    exported = sum(map(payload_bytes, lengths))
    stats_after = {d: engine_stats("metrics", d) for d in ("PrefillWorker", "DecodeWorker")}

    def d(name, **labels):
        return moved(after, name, **labels)

    # the ingress, as the client saw it
    assert d("kvrelay_requests_total", model="tiny", status="200", finish_reason="length") == n
    assert d("kvrelay_requests_total") == n
    assert d("kvrelay_prompt_tokens_total") == sum(lengths)
    assert d("kvrelay_generation_tokens_total") == n * MAX_TOKENS
    for histogram in ("kvrelay_ttft_seconds", "kvrelay_tpot_seconds", "kvrelay_e2e_request_latency_seconds"):
        assert d(f"{histogram}_count") == n, histogram
    assert d("kvrelay_inter_token_latency_seconds_count") == n * (MAX_TOKENS - 1)
    # routing: one prefill and one decode decision per request
    assert d("kvrelay_routing_decisions_total", pool="prefill", policy="prefix_cost") == n
    assert d("kvrelay_routing_decisions_total", pool="decode", policy="least_kv") == n
    # prefill pool: it computed every prompt and exported its KV
    prefill = {"model": "tiny", "pool": "prefill"}
    assert d("kvrelay_queue_time_seconds_count", **prefill) == n
    assert d("kvrelay_prefill_time_seconds_count", **prefill) == n
    assert d("kvrelay_kv_transfer_bytes_total", direction="export", **prefill) == exported
    # decode pool: it imported every prompt's KV, computed none
    decode = {"model": "tiny", "pool": "decode"}
    assert d("kvrelay_prefill_time_seconds_count", **decode) == 0
    assert d("kvrelay_kv_transfer_seconds_count", **decode) == n
    assert d("kvrelay_kv_transfer_bytes_total", direction="import", **decode) == exported
    assert d("kvrelay_kv_transfer_fallbacks_total") == 0
    # engine counters: the engines' own counts, and a hit for the repeated prompt
    for pool, deployment in (("prefill", "PrefillWorker"), ("decode", "DecodeWorker")):
        for metric, field in (("kvrelay_prefix_cache_queried_tokens_total", "prefix_cache_query_tokens"),
                              ("kvrelay_prefix_cache_hit_tokens_total", "prefix_cache_hit_tokens"),
                              ("kvrelay_preemptions_total", "num_preemptions")):
            assert d(metric, pool=pool) == getattr(stats_after[deployment], field) - getattr(stats_before[deployment], field), (metric, pool)
    assert d("kvrelay_prefix_cache_hit_tokens_total", pool="prefill") >= 16
    # gauges: one replica per pool, idle now. `after` may hold a report taken while the last
    # request was still decoding (its queue time counts when it is scheduled); the next report,
    # within a routing-stats period, shows the pools idle.
    for pool in ("prefill", "decode"):
        idle = scrape_until(base + "/metrics", "kvrelay_num_requests_running", {"pool": pool}, 0, timeout_s=10)
        assert value(idle, "kvrelay_num_requests_waiting", pool=pool) == 0
        assert 0 <= value(idle, "kvrelay_kv_cache_usage_ratio", pool=pool) <= 1
    # the controller's view (refreshed every 5 s)
    view = scrape_until(base + "/metrics", "kvrelay_replicas", {"pool": "decode", "state": "RUNNING"}, 1)
    for pool in ("prefill", "decode"):
        assert value(view, "kvrelay_replicas", model="tiny", pool=pool, state="RUNNING") == 1
        assert value(view, "kvrelay_replicas", pool=pool) == 1
        assert value(view, "kvrelay_desired_replicas", model="tiny", pool=pool) == 1


def test_a_kv_claim_that_times_out_counts_a_fallback_and_a_prefill_on_decode(cluster):
    base = cluster["url"] + "/f"
    chat(base, "Warm up.")
    before = settled(base + "/metrics", kv_imported=False)
    chat(base, "Recompute me.")

    def moved(samples, name, **labels):
        return value(samples, name, **labels) - value(before, name, **labels)

    after = settled(base + "/metrics", kv_imported=False)
    assert moved(after, "kvrelay_kv_transfer_fallbacks_total", pool="decode", reason="timeout") == 1
    assert moved(after, "kvrelay_kv_transfer_seconds_count") == 0
    assert moved(after, "kvrelay_kv_transfer_bytes_total", direction="import") == 0
    assert moved(after, "kvrelay_prefill_time_seconds_count", pool="decode") == 1  # recomputed there
    assert moved(after, "kvrelay_prefill_time_seconds_count", pool="prefill") == 1


# ---- Ray's export ----------------------------------------------------------------------------
def test_rays_export_carries_the_same_metrics_with_rays_prefix(cluster):
    """Every replica records through ray.util.metrics too; Ray's agent exports `ray_<name>`."""
    app = cluster["url"] + "/m"
    chat(app, "Counted twice: here and in Ray.")
    ours = scrape(app + "/metrics")
    ray_url = f"http://127.0.0.1:{cluster['ray_metrics_port']}/metrics"
    checks = {  # Ray's series of one app's replicas carry their model, pool, replica labels
        "kvrelay_generation_tokens_total": {},
        "kvrelay_ttft_seconds_count": {},
        "kvrelay_queue_time_seconds_count": {"pool": "decode"},
        "kvrelay_kv_transfer_bytes_total": {"direction": "import"},
    }

    def caught_up():
        now = scrape(app + "/metrics")
        ray = scrape(ray_url)
        # Both apps serve "tiny" through one Ray: compare the app's replicas by their replica label,
        # and the ingress totals of both apps with both /metrics.
        both = scrape(cluster["url"] + "/f/metrics")
        got = {
            name: (value(ray, f"ray_{name}"), value(now, name) + value(both, name))
            for name in ("kvrelay_generation_tokens_total", "kvrelay_ttft_seconds_count")
        }
        for name, labels in list(checks.items())[2:]:
            replicas = {dict(ls)["replica"] for (n, ls) in now if n == name and set(labels.items()) <= ls}
            got[name] = (
                sum(value(ray, "ray_" + name, replica=r, **labels) for r in replicas),
                value(now, name, **labels),
            )
        return got if all(a == b for a, b in got.values()) else None

    got = wait_until(caught_up, timeout_s=30, interval_s=1.0)
    assert got["kvrelay_generation_tokens_total"][0] >= value(ours, "kvrelay_generation_tokens_total") > 0
    text = httpx.get(ray_url, timeout=30).text
    assert "# TYPE ray_kvrelay_ttft_seconds histogram" in text
    assert "ray_kvrelay_routing_decisions_total{" in text


# ---- a real Prometheus -----------------------------------------------------------------------
def prometheus_config(cluster) -> dict:
    """deploy/prometheus/prometheus.yml, pointed at this Ray's service-discovery file, plus a job
    for the /m ingress's GET /metrics."""
    config = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config.pop("rule_files", None)
    (ray_job,) = [job for job in config["scrape_configs"] if job["job_name"] == "ray"]
    discovery = wait_until(lambda: next(cluster["temp_dir"].glob("**/prom_metrics_service_discovery.json"), None), timeout_s=30)
    ray_job["file_sd_configs"] = [{"files": [str(discovery)], "refresh_interval": "1s"}]
    config["scrape_configs"].append({
        "job_name": "kvrelay", "metrics_path": "/m/metrics",
        "static_configs": [{"targets": [f"127.0.0.1:{cluster['port']}"]}],
    })
    return config


def test_prometheus_scrapes_the_app_and_answers_the_ttft_histogram(cluster, tmp_path):
    binary = require_tool("prometheus", PROMETHEUS_HOW)
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(prometheus_config(cluster)))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [binary, f"--config.file={config_path}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    api = f"http://127.0.0.1:{port}/api/v1"

    def query(expr: str) -> list:
        try:
            body = httpx.get(f"{api}/query", params={"query": expr}, timeout=10).json()
        except (httpx.TransportError, ValueError):  # not up yet
            return []
        assert body["status"] == "success", body
        return body["data"]["result"]

    try:
        wait_until(lambda: len(query('up{job=~"kvrelay|ray"} == 1')) >= 2, timeout_s=60)

        def scraped_ttft_count() -> float:
            expected = value(scrape(cluster["url"] + "/m/metrics"), "kvrelay_ttft_seconds_count")
            wait_until(lambda: any(float(r["value"][1]) == expected for r in query('kvrelay_ttft_seconds_count{job="kvrelay"}')), timeout_s=30)
            return expected

        # increase() counts nothing for a series' first sample: on a fresh app the histogram's
        # series appear with the first request, so Prometheus must have scraped them before the
        # requests it is asked about (else the quantile of all-zero increases is NaN).
        chat(cluster["url"] + "/m", "Prometheus zero.")
        before = scraped_ttft_count()
        for content in ("Prometheus one.", "Prometheus two.", "Prometheus three."):
            chat(cluster["url"] + "/m", content)
        assert scraped_ttft_count() == before + 3

        def p95_seconds() -> float | None:
            result = query('histogram_quantile(0.95, sum by (le) (increase(kvrelay_ttft_seconds_bucket{job="kvrelay"}[1m])))')
            seconds = float(result[0]["value"][1]) if result else math.nan
            return None if math.isnan(seconds) else seconds

        seconds = wait_until(p95_seconds, timeout_s=30)
        assert 0 < seconds < 80
        # Every dashboard query runs on the ingress's series; the TTFT and token panels have data.
        dashboard = json.loads((REPO / "deploy/grafana/kvrelay-dashboard.json").read_text())
        results = {}
        for panel in dashboard["panels"]:
            for target in panel.get("targets", ()):
                expr = target["expr"].replace("$__rate_interval", "1m").replace("$job", "kvrelay").replace("$model", ".*")
                results[(panel["title"], target["legendFormat"])] = query(expr)
        assert results[("TTFT p50 / p95", "p95")] and results[("Tokens/s", "generated")]
        assert results[("Replicas per pool", "{{pool}} running")]
        # Ray's export, renamed by the shipped relabelling: the same histogram, every replica.
        ray_series = wait_until(lambda: query('sum(kvrelay_ttft_seconds_count{job="ray"})'), timeout_s=60)
        assert float(ray_series[0]["value"][1]) >= 3
        assert query('count({__name__=~"ray_kvrelay_.*"})') == []
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    assert "level=error" not in (tmp_path / "prometheus.log").read_text()


def test_rays_service_discovery_file_lists_its_metrics_export(cluster):
    discovery = next(cluster["temp_dir"].glob("**/prom_metrics_service_discovery.json"))
    targets = json.loads(discovery.read_text())[0]["targets"]
    assert any(t.endswith(f":{cluster['ray_metrics_port']}") for t in targets)
