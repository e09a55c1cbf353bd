"""kvrelay status / scale / policy apply against recorded dashboard answers (httpx MockTransport)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from router.policy_config import PolicyError
from serving import ops

DATA = Path(__file__).parent / "data" / "serve_applications.json"
REPO = Path(__file__).resolve().parents[2]

METRICS = """\
# HELP kvrelay_ttft_seconds time to first token
# TYPE kvrelay_ttft_seconds histogram
kvrelay_ttft_seconds_bucket{model="m",le="0.1"} 2.0
kvrelay_ttft_seconds_bucket{model="m",le="0.2"} 6.0
kvrelay_ttft_seconds_bucket{model="m",le="0.4"} 10.0
kvrelay_ttft_seconds_bucket{model="m",le="+Inf"} 10.0
kvrelay_ttft_seconds_count{model="m"} 10.0
kvrelay_num_requests_running{pool="decode",replica="a"} 3.0
kvrelay_num_requests_running{pool="decode",replica="b"} 2.0
kvrelay_num_requests_waiting{pool="prefill",replica="c"} 4.0
kvrelay_kv_cache_usage_ratio{pool="decode",replica="a"} 0.5
kvrelay_kv_cache_usage_ratio{pool="decode",replica="b"} 0.25
kvrelay_engine_kernel_info{pool="decode",replica="a",kernel_path="native",reason="loaded from the cache /c"} 1.0
kvrelay_engine_kernel_info{pool="decode",replica="b",kernel_path="native",reason="loaded from the cache /c"} 1.0
kvrelay_engine_kernel_info{pool="prefill",replica="c",kernel_path="pytorch",reason="KVRELAY_DISABLE_NATIVE=1"} 1.0
kvrelay_kv_transfer_seconds_count{pool="decode",replica="a"} 40.0
kvrelay_kv_transfer_seconds_count{pool="decode",replica="b"} 30.0
kvrelay_kv_transfer_fallbacks_total{pool="decode",replica="a",reason="error"} 2.0
kvrelay_kv_transfer_fallbacks_total{pool="decode",replica="b",reason="error"} 1.0
kvrelay_kv_transfer_fallbacks_total{pool="decode",replica="b",reason="timeout"} 4.0
kvrelay_recoveries_total{model="m",kind="decode_resumed"} 1.0
"""


def recorded() -> dict:
    return json.loads(DATA.read_text())


class FakeDashboard:
    def __init__(self, state: dict, *, token: str | None = "secret"):
        self.state = state
        self.token = token
        self.puts: list[dict] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        if self.token and request.headers.get("authorization") != f"Bearer {self.token}":
            return httpx.Response(401, text="Unauthorized: missing or invalid token")
        if request.url.path != "/api/serve/applications/":
            return httpx.Response(404)
        if request.method == "GET":
            return httpx.Response(200, json=self.state)
        self.puts.append(json.loads(request.content))
        return httpx.Response(200)

    def client(self, token: str | None = "secret") -> ops.DashboardClient:
        return ops.DashboardClient("http://dash:8265", token=token, transport=httpx.MockTransport(self.handler))


def test_status_report_lines():
    report = ops.status_report(recorded(), "kvrelay", METRICS).splitlines()
    assert report[0] == "application kvrelay: RUNNING"
    assert report[3].split() == ["prefill", "PrefillWorker", "HEALTHY", "1", "running", "[1..1]", "-", "4", "-"]
    assert report[4].split() == ["decode", "DecodeWorker", "HEALTHY", "1", "running", "[1..1]", "5", "-", "38%"]
    assert report[5].split() == ["ingress", "OpenAIIngress", "HEALTHY", "1", "running", "-", "-", "-"]
    # p50: rank 5 in (0.1, 0.2] holding counts 2..6 -> 0.1 + 0.1 * 3/4;
    # p95: rank 9.5 in (0.2, 0.4] holding counts 6..10 -> 0.2 + 0.2 * 3.5/4
    assert report[7] == "TTFT  p50    175.0 ms   p95    375.0 ms"
    # Each pool's kernel path and why, counted over its replicas: a fallback cannot hide.
    # The KVTransfer actor's or a replica's death shows: imports, recomputes by reason, recoveries.
    assert report[-5:-3] == ["", "KV hand-off  70 imported, 7 recomputed (error 3, timeout 4); recovered decode_resumed 1"]
    assert report[-3:] == [
        "",
        "kernels  decode   native x2 (loaded from the cache /c)",
        "kernels  prefill  pytorch x1 (KVRELAY_DISABLE_NATIVE=1)",
    ]


def test_status_without_metrics_says_so():
    assert ops.status_report(recorded(), "kvrelay", None).endswith(
        "(no metrics: the ingress's /metrics was not reachable; pass --url)"
    )
    with pytest.raises(ops.OpsError, match="no Serve application 'other' \\(found: kvrelay\\)"):
        ops.status_report(recorded(), "other", None)


def test_histogram_quantile():
    buckets = [(1.0, 0.0), (2.0, 10.0), (float("inf"), 10.0)]
    assert ops.histogram_quantile(0.5, buckets) == 1.5
    assert ops.histogram_quantile(0.5, [(1.0, 0.0), (float("inf"), 0.0)]) is None
    assert ops.histogram_quantile(0.99, [(1.0, 5.0), (float("inf"), 10.0)]) == 1.0  # +Inf: the last finite bound


def test_token_is_sent_and_401_explains_the_fix():
    dashboard = FakeDashboard(recorded())
    assert dashboard.client().get_applications()["applications"]["kvrelay"]["status"] == "RUNNING"
    with pytest.raises(ops.OpsError, match=r"refused the request \(401\): token authentication is on. Set RAY_AUTH_TOKEN"):
        dashboard.client(token="wrong").get_applications()


def test_token_lookup_order(tmp_path, monkeypatch):
    path = tmp_path / "token"
    path.write_text("from-file\n")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(path))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    assert ops.dashboard_token() == "from-file"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    assert ops.dashboard_token() == "from-env"


def test_scale_rewrites_only_that_pool_and_keeps_other_apps():
    state = recorded()
    other = {"name": "other", "route_prefix": "/other", "import_path": "x:y", "args": {}}
    state["applications"]["other"] = {"status": "RUNNING", "deployments": {}, "deployed_app_config": other}
    dashboard = FakeDashboard(state)
    message = ops.scale(dashboard.client(), "kvrelay", "ingress", 2)
    assert message == "kvrelay: ingress -> 2 replicas requested"
    (put,) = dashboard.puts
    apps = {app["name"]: app for app in put["applications"]}
    assert apps["other"] == other
    before = state["applications"]["kvrelay"]["deployed_app_config"]["args"]
    after = apps["kvrelay"]["args"]
    assert after["ingress"] == {**before["ingress"], "num_replicas": 2}
    assert {k: v for k, v in after.items() if k != "ingress"} == {k: v for k, v in before.items() if k != "ingress"}
    assert put["http_options"] == {"host": "127.0.0.1", "port": 8000}
    assert "autoscales" in ops.scale(dashboard.client(), "kvrelay", "decode", 2)


def test_scale_refuses_bad_counts_and_imperative_apps():
    dashboard = FakeDashboard(recorded())
    with pytest.raises(ops.OpsError, match="^ingress.num_replicas = 0: Input should be greater than or equal to 1$"):
        ops.scale(dashboard.client(), "kvrelay", "ingress", 0)
    state = recorded()
    state["applications"]["kvrelay"]["deployed_app_config"] = None
    with pytest.raises(ops.OpsError, match="deployed from Python \\(serve.run\\)"):
        ops.scale(FakeDashboard(state).client(), "kvrelay", "ingress", 2)
    assert dashboard.puts == []


def test_policy_apply_validates_first(tmp_path):
    dashboard = FakeDashboard(recorded())
    bad = tmp_path / "bad.yaml"
    bad.write_text("prefill:\n  min_replicas: 3\n  max_replicas: 1\n")
    with pytest.raises(PolicyError):
        ops.apply_policy(dashboard.client(), "kvrelay", str(bad))
    assert dashboard.puts == []
    good = REPO / "deploy/autoscaling/cluster.yaml"
    assert ops.apply_policy(dashboard.client(), "kvrelay", str(good)) == f"kvrelay: autoscaling policy {good} applied"
    assert dashboard.puts[0]["applications"][0]["args"]["autoscaling_policy"] == str(good)


def test_serve_deploy_config_is_a_valid_serve_schema():
    from ray.serve.schema import ServeDeploySchema

    from serving.config import load_config

    config = load_config(REPO / "deploy/local.yaml", env={})
    schema = ServeDeploySchema.model_validate(ops.serve_deploy_config(config))
    app = schema.applications[0]
    assert (app.name, app.import_path, app.route_prefix) == ("kvrelay", "serving.app:build_app", "/")
    assert Path(app.args["autoscaling_policy"]).is_absolute()


def test_status_reads_only_metrics_the_app_exports():
    import re

    from serving.metrics import METRICS

    exported = {spec.name for spec in METRICS}
    used = set(re.findall(r'"(kvrelay_[a-z_]+)"', Path(ops.__file__).read_text()))
    assert used and used <= exported, used - exported
