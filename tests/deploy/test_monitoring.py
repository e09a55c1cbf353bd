"""deploy/grafana and deploy/prometheus: the dashboard and the alert rules load, every PromQL
expression they hold parses (promtool) and names only metrics the app exports
(serving/observability/metrics.py), the rules render with custom thresholds and fire at exactly those
thresholds (`promtool test rules`), and the committed rules are the defaults' rendering.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from serving.observability.metrics import METRICS, series_names
from tests.helpers import REPO, require_tool

DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "kvrelay-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "kvrelay-alerts.yaml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
PROMTOOL_HOW = "it comes with the Debian package `prometheus` (`make install` installs it where apt-get exists)"

# PromQL words that are not metric names.
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset", "inf", "nan"}


def exported_series() -> set[str]:
    return {name for spec in METRICS for name in series_names(spec)}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, labels, keywords left out)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = re.findall(r"(?<![\w$.:])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])(?!\s*\()", expr)
    return {n for n in names if n.lower() not in _KEYWORDS}


def dashboard_exprs() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", ())]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):  # label_values(<series selector>, label)
            selector = re.fullmatch(r"label_values\((.*),\s*\w+\)", query["query"]).group(1)
            exprs.append((f"${variable['name']}", selector))
    return exprs


def grafana_to_promql(expr: str) -> str:
    """A dashboard query as Prometheus sees it once Grafana has filled in its variables."""
    return expr.replace("$__rate_interval", "1m").replace("$job", ".*").replace("$model", ".*")


def alert_exprs(text: str) -> list[tuple[str, str]]:
    return [(r["alert"], r["expr"]) for g in yaml.safe_load(text)["groups"] for r in g["rules"]]


def render_alerts():
    spec = importlib.util.spec_from_file_location("render_alerts", DEPLOY / "prometheus" / "render_alerts.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    binary = require_tool("promtool", PROMTOOL_HOW)
    result = subprocess.run([binary, *args], check=False, capture_output=True, text=True, cwd=cwd, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


# ---- the metric names ------------------------------------------------------------------------
def test_metric_names_finds_selectors_only():
    expr = 'sum by (pool, le) (rate(kvrelay_a_bucket{job=~"$job",x="by(y)"}[$__rate_interval])) / on(pool) kvrelay_b > 0.5 and kvrelay_c offset 5m'
    assert metric_names(expr) == {"kvrelay_a_bucket", "kvrelay_b", "kvrelay_c"}


def test_every_dashboard_query_names_an_exported_metric():
    exported = exported_series()
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    used = set()
    for title, expr in exprs:
        names = metric_names(expr)
        assert names, (title, expr)
        assert names <= exported, f"{title}: {sorted(names - exported)} not exported by serving/observability/metrics.py"
        used |= names
    # every metric the app exports has a place on the dashboard
    assert {spec.name for spec in METRICS} <= {n.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum") for n in used}


def test_the_dashboard_has_the_panels_operators_need():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "kvrelay" and dashboard["schemaVersion"] >= 36
    titles = " | ".join(p["title"] for p in dashboard["panels"]).lower()
    for wanted in ("ttft p50 / p95", "tokens/s", "latency p50 / p95", "queue depth", "kv cache usage",
                   "replicas per pool", "prefix cache hit rate", "error rate", "autoscaler decisions"):
        assert wanted in titles, wanted
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]


def test_every_dashboard_query_parses(tmp_path):
    """promtool checks PromQL in rule files: each query becomes a recording rule."""
    rules = [{"record": f"kvrelay:dashboard:q{i}", "expr": grafana_to_promql(expr)} for i, (_, expr) in enumerate(dashboard_exprs())]
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    assert f"SUCCESS: {len(rules)} rules found" in promtool("check", "rules", str(path)).stdout


# ---- the alert rules -------------------------------------------------------------------------
def test_the_alert_rules_check_and_name_exported_metrics():
    assert "SUCCESS: 5 rules found" in promtool("check", "rules", str(ALERTS)).stdout
    exported = exported_series()
    alerts = alert_exprs(ALERTS.read_text())
    assert [a for a, _ in alerts] == [
        "KVRelayTTFTHigh", "KVRelayStreamTokensPerSecondLow", "KVRelayErrorRateHigh", "KVRelayKVCacheFull", "KVRelayQueueDeep",
    ]
    for name, expr in alerts:
        assert metric_names(expr) and metric_names(expr) <= exported, (name, expr)


def test_the_committed_rules_are_the_defaults_rendering():
    assert ALERTS.read_text() == render_alerts().render(), "re-run: python deploy/prometheus/render_alerts.py -o deploy/prometheus/kvrelay-alerts.yaml"


def test_the_prometheus_config_checks_with_the_rules():
    assert "SUCCESS" in promtool("check", "config", str(PROMETHEUS_CONFIG)).stdout


def test_rendering_with_custom_thresholds(tmp_path):
    module = render_alerts()
    thresholds = module.Thresholds(
        ttft_p95_s=1.5, min_stream_tokens_per_s=25, max_error_ratio=0.002, max_kv_cache_usage=0.8,
        max_queue_depth=4, window="2m", for_="1m", selector='job="ray"',
    )
    text = module.render(thresholds)
    path = tmp_path / "alerts.yaml"
    path.write_text(text)
    assert "SUCCESS: 5 rules found" in promtool("check", "rules", str(path)).stdout
    exprs = dict(alert_exprs(text))
    assert exprs["KVRelayTTFTHigh"] == 'histogram_quantile(0.95, sum by (model, le) (rate(kvrelay_ttft_seconds_bucket{job="ray"}[2m]))) > 1.5'
    assert exprs["KVRelayStreamTokensPerSecondLow"].endswith("< 25")
    assert exprs["KVRelayErrorRateHigh"].startswith('sum by (model) (rate(kvrelay_requests_total{status=~"5..|429",job="ray"}[2m]))')
    assert exprs["KVRelayErrorRateHigh"].endswith("> 0.002")
    assert exprs["KVRelayKVCacheFull"] == 'max by (model, pool) (kvrelay_kv_cache_usage_ratio{job="ray"}) > 0.8'
    assert exprs["KVRelayQueueDeep"] == 'avg by (model, pool) (kvrelay_num_requests_waiting{job="ray"}) > 4'
    assert all(r["for"] == "1m" for g in yaml.safe_load(text)["groups"] for r in g["rules"])
    with pytest.raises(ValueError, match="max_error_ratio"):
        module.Thresholds(max_error_ratio=1.5)


def test_the_cli_writes_the_rules(tmp_path):
    out = tmp_path / "a.yaml"
    assert render_alerts().main(["--ttft-p95-s", "3", "--for", "10m", "-o", str(out)]) == 0
    rules = {r["alert"]: r for g in yaml.safe_load(out.read_text())["groups"] for r in g["rules"]}
    assert rules["KVRelayTTFTHigh"]["expr"].endswith("> 3") and rules["KVRelayTTFTHigh"]["for"] == "10m"


def test_the_alerts_fire_at_their_thresholds(tmp_path):
    """`promtool test rules` on synthetic series: each alert fires just past its threshold and
    stays quiet just under it (thresholds custom, so nothing passes by the defaults' luck)."""
    module = render_alerts()
    thresholds = module.Thresholds(ttft_p95_s=1.0, min_stream_tokens_per_s=20, max_error_ratio=0.05,
                                   max_kv_cache_usage=0.9, max_queue_depth=8, window="5m", for_="2m")
    (tmp_path / "alerts.yaml").write_text(module.render(thresholds))
    m = 'model="tiny"'
    series = [
        # TTFT: "bad" has every request at 2.5 s (> 1 s); "good" at 0.5 s.
        *[{"series": f'kvrelay_ttft_seconds_bucket{{model="bad",le="{le}"}}', "values": f"0+{n}x20"}
          for le, n in (("0.5", 0), ("1.0", 0), ("2.5", 10), ("+Inf", 10))],
        *[{"series": f'kvrelay_ttft_seconds_bucket{{model="good",le="{le}"}}', "values": f"0+{n}x20"}
          for le, n in (("0.5", 10), ("1.0", 10), ("2.5", 10), ("+Inf", 10))],
        # TPOT 0.1 s: 10 tokens/s < 20
        *[{"series": f'kvrelay_tpot_seconds_bucket{{{m},le="{le}"}}', "values": f"0+{n}x20"} for le, n in (("0.05", 0), ("0.1", 10), ("+Inf", 10))],
        # errors: 1 in 10 requests is a 503 (10% > 5%)
        {"series": f'kvrelay_requests_total{{{m},status="200",finish_reason="stop"}}', "values": "0+9x20"},
        {"series": f'kvrelay_requests_total{{{m},status="503",finish_reason="error"}}', "values": "0+1x20"},
        {"series": f'kvrelay_kv_cache_usage_ratio{{{m},pool="decode",replica="a"}}', "values": "0.95x20"},
        {"series": f'kvrelay_kv_cache_usage_ratio{{{m},pool="prefill",replica="b"}}', "values": "0.85x20"},
        {"series": f'kvrelay_num_requests_waiting{{{m},pool="prefill",replica="b"}}', "values": "12x20"},
        {"series": f'kvrelay_num_requests_waiting{{{m},pool="decode",replica="a"}}', "values": "4x20"},
    ]
    common = {"severity": "warning", "service": "kvrelay"}

    def fired(name: str, labels: dict, summary: str, threshold: str, severity: str = "warning") -> dict:
        return {"eval_time": "10m", "alertname": name, "exp_alerts": [{
            "exp_labels": {**common, "severity": severity, **labels},
            "exp_annotations": {"summary": summary, "threshold": threshold},
        }]}

    tests = {
        "rule_files": ["alerts.yaml"],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": series,
            "alert_rule_test": [
                # p95 interpolated in the (1.0, 2.5] bucket: 1.0 + 0.95 x 1.5
                fired("KVRelayTTFTHigh", {"model": "bad"}, "TTFT p95 of bad is 2.425s (SLO 1s)", "1"),
                # 1 / (0.05 + 0.95 x 0.05)
                fired("KVRelayStreamTokensPerSecondLow", {"model": "tiny"}, "The slowest 5% of tiny streams get 10.3 tokens/s (SLO 20)", "20"),
                fired("KVRelayErrorRateHigh", {"model": "tiny"}, "10% of tiny requests fail with 5xx or 429 (SLO 0.05)", "0.05", severity="critical"),
                fired("KVRelayKVCacheFull", {"model": "tiny", "pool": "decode"}, "A decode replica's KV cache is 95% full (SLO 0.9)", "0.9"),
                fired("KVRelayQueueDeep", {"model": "tiny", "pool": "prefill"}, "prefill replicas have 12.0 waiting sequences each (SLO 8)", "8"),
                {"eval_time": "1m", "alertname": "KVRelayKVCacheFull", "exp_alerts": []},  # pending: for 2m
            ],
        }],
    }
    (tmp_path / "alerts_test.yaml").write_text(yaml.safe_dump(tests))
    assert "SUCCESS" in promtool("test", "rules", "alerts_test.yaml", cwd=tmp_path).stdout
