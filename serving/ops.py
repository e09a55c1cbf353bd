"""Operating a running app: the Ray dashboard's Serve REST API, with Ray's token authentication.

    kvrelay status                 pools, replicas and their states (dashboard), plus queue depth,
                                   KV usage and TTFT/TPOT p50/p95 per pool, KV hand-offs imported
                                   and recomputed, recoveries (the ingress's /metrics)
    kvrelay scale POOL N           set a pool's replica count in the live app
    kvrelay policy apply FILE      switch the live app to an autoscaling policy file

`kvrelay serve` deploys the app declaratively (PUT /api/serve/applications/ with
`serving.app:build_app` and the whole ServeConfig as its args), so the dashboard knows the
config, and `scale` / `policy apply` are a read-modify-write of it. Serve then rolls the app to
the new config: every deployment receives the whole config, so each rolls its replicas (a rolling
update; with one replica per pool there is a short window where a pool restarts).

Token authentication: a local `ray.init()` turns it on, and the dashboard answers 401 without
`authorization: Bearer <token>`. The token is read like Ray does: $RAY_AUTH_TOKEN, the file at
$RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token.
"""

from __future__ import annotations

import math
import os
import re
import time
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError

__all__ = [
    "DashboardClient",
    "OpsError",
    "dashboard_token",
    "serve_deploy_config",
    "pool_deployments",
    "status_report",
    "scale",
    "apply_policy",
    "parse_metrics",
    "histogram_quantile",
]

APP_IMPORT_PATH = "serving.app:build_app"
POOLS = {"prefill": "PrefillWorker", "decode": "DecodeWorker", "worker": "Worker", "ingress": "OpenAIIngress"}


class OpsError(RuntimeError):
    """An operation failed; the message says what to do."""


def dashboard_token() -> str | None:
    token = os.environ.get("RAY_AUTH_TOKEN")
    if token:
        return token.strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


class DashboardClient:
    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 30.0, transport=None):
        self.url = url.rstrip("/")
        self.token = token if token is not None else dashboard_token()
        headers = {"authorization": f"Bearer {self.token}"} if self.token else {}
        self._client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s, transport=transport)

    def close(self) -> None:
        self._client.close()

    def get_applications(self) -> dict:
        return self._request("GET", "/api/serve/applications/").json()

    def put_applications(self, config: dict) -> None:
        self._request("PUT", "/api/serve/applications/", json=config)

    def _request(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise OpsError(f"cannot reach the Ray dashboard at {self.url} ({exc}); is the app running? "
                           "Pass --dashboard URL") from exc
        if response.status_code == 401:
            raise OpsError(
                f"the Ray dashboard at {self.url} refused the request (401): token authentication is on. "
                "Set RAY_AUTH_TOKEN (see `ray get-auth-token`) or RAY_AUTH_TOKEN_PATH, or run this on the "
                "head node where ~/.ray/auth_token exists."
            )
        if response.status_code >= 400:
            raise OpsError(f"{method} {path} on the Ray dashboard failed ({response.status_code}): {response.text[:500]}")
        return response


def serve_deploy_config(config) -> dict:
    """The declarative Serve config (`serve deploy` schema) for a ServeConfig."""
    args = config.model_dump(mode="json")
    for field in ("autoscaling_policy", "pricing"):  # read by the controller, from its own cwd
        if args.get(field):
            args[field] = str(Path(args[field]).resolve())
    return {
        "http_options": {"host": config.http.host, "port": config.http.port},
        "applications": [
            {"name": config.app_name, "route_prefix": "/", "import_path": APP_IMPORT_PATH, "args": args}
        ],
    }


def _deployed_config(client: DashboardClient, app_name: str) -> tuple[dict, dict]:
    """(the whole deploy config to PUT back, this app's entry in it)."""
    state = client.get_applications()
    apps = state.get("applications") or {}
    if app_name not in apps:
        raise OpsError(f"no Serve application {app_name!r} on this cluster (found: {', '.join(apps) or 'none'})")
    configs = []
    target = None
    for name, app in apps.items():
        deployed = app.get("deployed_app_config")
        if deployed is None:
            raise OpsError(
                f"application {name!r} was deployed from Python (serve.run), so the dashboard does not know "
                "its config and cannot change it; start it with `kvrelay serve` or `serve deploy`"
            )
        configs.append(deployed)
        if name == app_name:
            target = deployed
    if target.get("import_path") != APP_IMPORT_PATH:
        raise OpsError(f"application {app_name!r} is not a kvrelay app (import path {target.get('import_path')!r})")
    http = (state.get("http_options") or {})
    whole = {"applications": configs}
    if http:
        whole["http_options"] = {k: http[k] for k in ("host", "port") if k in http}
    return whole, target


def scale(client: DashboardClient, app_name: str, pool: str, num_replicas: int) -> str:
    from serving.config import ServeConfig

    if pool not in ("prefill", "decode", "worker", "ingress"):
        raise OpsError(f"unknown pool {pool!r}; choose prefill, decode, worker or ingress")
    whole, app = _deployed_config(client, app_name)
    args = dict(app.get("args") or {})
    section = dict(args.get(pool) or {})
    section["num_replicas"] = num_replicas
    args[pool] = section
    try:
        ServeConfig.model_validate(args)
    except ValidationError as exc:
        raise OpsError(f"{pool}.num_replicas = {num_replicas}: {exc.errors()[0]['msg']}") from exc
    app["args"] = args
    client.put_applications(whole)
    note = ""
    if args.get("autoscaling_policy") and pool != "ingress":
        note = " (this pool autoscales if the policy names it: its min/max bound the count, not this value)"
    return f"{app_name}: {pool} -> {num_replicas} replicas requested{note}"


def apply_policy(client: DashboardClient, app_name: str, policy_path: str) -> str:
    from router.policy_config import load_policy

    load_policy(policy_path)  # refuse a bad file before touching the live app
    whole, app = _deployed_config(client, app_name)
    args = dict(app.get("args") or {})
    args["autoscaling_policy"] = str(Path(policy_path).resolve())
    app["args"] = args
    client.put_applications(whole)
    return f"{app_name}: autoscaling policy {args['autoscaling_policy']} applied"


def pool_deployments(state: dict, app_name: str) -> dict[str, dict]:
    """Per pool: deployment status and replica counts by state, from GET /api/serve/applications/."""
    app = (state.get("applications") or {}).get(app_name)
    if app is None:
        raise OpsError(f"no Serve application {app_name!r} (found: {', '.join(state.get('applications') or {}) or 'none'})")
    pools = {}
    for pool, deployment_name in POOLS.items():
        deployment = (app.get("deployments") or {}).get(deployment_name)
        if deployment is None:
            continue
        states: dict[str, int] = {}
        for replica in deployment.get("replicas") or []:
            states[replica.get("state", "UNKNOWN")] = states.get(replica.get("state", "UNKNOWN"), 0) + 1
        config = deployment.get("deployment_config") or {}
        autoscaling = config.get("autoscaling_config")
        pools[pool] = {
            "deployment": deployment_name,
            "status": deployment.get("status"),
            "replicas": states,
            "target": deployment.get("target_num_replicas", config.get("num_replicas")),
            "autoscaling": None if not autoscaling else (autoscaling.get("min_replicas"), autoscaling.get("max_replicas")),
        }
    return {"app_status": app.get("status"), "pools": pools}


# ---- metrics (Prometheus text from the ingress's /metrics) -------------------------------------
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match:
            labels = dict(_LABEL.findall(match.group(3) or ""))
            samples.append((match.group(1), labels, float(match.group(4))))
    return samples


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) buckets."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] == 0:
        return None
    rank = q * buckets[-1][1]
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def _sum_by(samples, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric, labels, value in samples:
        if metric == name:
            key = labels.get(label, "")
            out[key] = out.get(key, 0.0) + value
    return out


def _quantiles(samples, name: str, label: str | None = None) -> dict[str, tuple[float | None, float | None]]:
    groups: dict[str, dict[float, float]] = {}
    for metric, labels, value in samples:
        if metric == f"{name}_bucket":
            key = labels.get(label, "") if label else ""
            bound = float(labels.get("le", "inf").replace("+Inf", "inf"))
            groups.setdefault(key, {})
            groups[key][bound] = groups[key].get(bound, 0.0) + value
    return {
        key: (histogram_quantile(0.5, list(b.items())), histogram_quantile(0.95, list(b.items())))
        for key, b in groups.items()
    }


def status_report(state: dict, app_name: str, metrics_text: str | None) -> str:
    info = pool_deployments(state, app_name)
    lines = [f"application {app_name}: {info['app_status']}", ""]
    samples = parse_metrics(metrics_text) if metrics_text else []
    running = _sum_by(samples, "kvrelay_num_requests_running", "pool")
    waiting = _sum_by(samples, "kvrelay_num_requests_waiting", "pool")
    kv = _sum_by(samples, "kvrelay_kv_cache_usage_ratio", "pool")
    kv_count = {k: v for k, v in ((p, sum(1 for m, l, _ in samples if m == "kvrelay_kv_cache_usage_ratio" and l.get("pool") == p)) for p in kv)}
    header = f"{'pool':<8} {'deployment':<14} {'status':<10} {'replicas':<22} {'running':>7} {'waiting':>7} {'kv use':>7}"
    lines.append(header)
    for pool, p in info["pools"].items():
        replicas = ", ".join(f"{n} {s.lower()}" for s, n in sorted(p["replicas"].items())) or "none"
        if p["autoscaling"]:
            replicas += f" [{p['autoscaling'][0]}..{p['autoscaling'][1]}]"
        kv_use = f"{kv[pool] / kv_count[pool]:.0%}" if pool in kv and kv_count.get(pool) else "-"
        lines.append(
            f"{pool:<8} {p['deployment']:<14} {str(p['status']):<10} {replicas:<22} "
            f"{_fmt(running.get(pool)):>7} {_fmt(waiting.get(pool)):>7} {kv_use:>7}"
        )
    if samples:
        lines.append("")
        for label, name in (("TTFT", "kvrelay_ttft_seconds"), ("TPOT", "kvrelay_tpot_seconds"), ("E2E", "kvrelay_e2e_request_latency_seconds")):
            q = _quantiles(samples, name).get("")
            if q and q[0] is not None:
                lines.append(f"{label:<5} p50 {q[0] * 1000:8.1f} ms   p95 {q[1] * 1000:8.1f} ms")
    else:
        lines += ["", "(no metrics: the ingress's /metrics was not reachable; pass --url)"]
    handoff = _handoff_line(samples)
    if handoff:
        lines += ["", handoff]
    kernels: dict[tuple[str, str, str], int] = {}
    for metric, labels, value in samples:
        if metric == "kvrelay_engine_kernel_info" and value == 1:
            key = (labels.get("pool", ""), labels.get("kernel_path", ""), labels.get("reason", ""))
            kernels[key] = kernels.get(key, 0) + 1
    if kernels:
        lines.append("")
        for (pool, path, reason), count in sorted(kernels.items()):
            lines.append(f"kernels  {pool:<8} {path} x{count} ({reason})")
    return "\n".join(lines)


def _handoff_line(samples) -> str | None:
    """KV hand-offs imported and recomputed (by reason), and requests that survived a replica's
    death: what to look at when the KVTransfer actor or a replica died."""
    transfers = "kvrelay_kv_transfer_seconds"  # a histogram of the successful imports
    imported = sum(v for m, _, v in samples if m == f"{transfers}_count")
    fallbacks = _sum_by(samples, "kvrelay_kv_transfer_fallbacks_total", "reason")
    recovered = _sum_by(samples, "kvrelay_recoveries_total", "kind")
    if not imported and not fallbacks and not recovered:
        return None
    line = f"KV hand-off  {imported:g} imported, {sum(fallbacks.values()):g} recomputed"
    if fallbacks:
        line += " (" + ", ".join(f"{reason} {n:g}" for reason, n in sorted(fallbacks.items())) + ")"
    if recovered:
        line += "; recovered " + ", ".join(f"{kind} {n:g}" for kind, n in sorted(recovered.items()))
    return line


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def fetch_metrics(api_url: str, *, timeout_s: float = 10.0) -> str | None:
    try:
        response = httpx.get(api_url.rstrip("/") + "/metrics", timeout=timeout_s)
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None


def wait_until_running(client: DashboardClient, app_name: str, *, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        apps = client.get_applications().get("applications") or {}
        app = apps.get(app_name)
        last = app and app.get("status")
        if last == "RUNNING":
            return
        if last in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise OpsError(f"application {app_name!r} is {last}: {app.get('message', '')[:2000]}")
        time.sleep(0.5)
    raise OpsError(f"application {app_name!r} not running after {timeout_s:.0f}s (last status {last})")
