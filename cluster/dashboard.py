"""Operating a running app through the Ray dashboard's Serve REST API, with Ray's token
authentication: deploy it declaratively, scale a pool, switch its autoscaling policy, wait for it.

`kvrelay serve` deploys the app declaratively (PUT /api/serve/applications/ with
`serving.deployments.app:build_app` and the whole ServeConfig as its args), so the dashboard knows the
config, and `scale` / `apply_policy` are a read-modify-write of it. Serve then rolls the app to
the new config: every deployment receives the whole config, so each rolls its replicas (a rolling
update; with one replica per pool there is a short window where a pool restarts).

Token authentication: a local `ray.init()` turns it on, and the dashboard answers 401 without
`authorization: Bearer <token>`. The token is read like Ray does: $RAY_AUTH_TOKEN, the file at
$RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError

__all__ = [
    "APP_IMPORT_PATH",
    "DashboardClient",
    "OpsError",
    "apply_policy",
    "dashboard_token",
    "pool_deployments",
    "scale",
    "serve_deploy_config",
    "wait_until_running",
]

APP_IMPORT_PATH = "serving.deployments.app:build_app"
# Where older kvrelay versions had build_app: their apps' configs are not this version's.
OLDER_IMPORT_PATHS = {"serving.app:build_app": "0.1"}
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
            raise OpsError(f"{method} {path} on the Ray dashboard failed ({response.status_code}): {_reason(response.text)}")
        return response


def _reason(text: str, limit: int = 500) -> str:
    """A dashboard error's reason: for a traceback, its last line (the exception: a 500 from a
    proxy that could not bind its port ends in "RuntimeError: Failed to bind to address ..."),
    not its first 500 characters, which are the frames above it."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Traceback"):
        return lines[-1][:limit]
    return text[:limit]


def serve_deploy_config(config) -> dict:
    """The declarative Serve config (`serve deploy` schema) for a ServeConfig."""
    args = config.model_dump(mode="json")
    for field in ("autoscaling_policy", "pricing"):  # read by the controller, from its own cwd
        if args.get(field):
            args[field] = str(Path(args[field]).resolve())
    app = {"name": config.app_name, "route_prefix": "/", "import_path": APP_IMPORT_PATH, "args": args}
    if config.autoscaling_policy:
        _set_app_policy(app, config.autoscaling_policy)
    return {"http_options": {"host": config.http.host, "port": config.http.port}, "applications": [app]}


def _set_app_policy(app: dict, policy_path: str) -> None:
    """The application's own autoscaling policy: the planner's joint plan under `mode: planner`
    (router/autoscaling/plan_serve.py), none otherwise (each pool's deployment policy)."""
    from router.autoscaling.plan_serve import app_autoscaling_policy
    from router.autoscaling.policy import load_policy

    app_policy = app_autoscaling_policy(load_policy(policy_path))
    if app_policy is None:
        app.pop("autoscaling_policy", None)
    else:
        app["autoscaling_policy"] = app_policy


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
    if target.get("import_path") in OLDER_IMPORT_PATHS:
        raise OpsError(
            f"application {app_name!r} runs kvrelay {OLDER_IMPORT_PATHS[target['import_path']]} (import path "
            f"{target['import_path']!r}), older than this kvrelay command: use the command of the cluster's version, "
            "or upgrade the cluster (`kvrelay serve`, `helm upgrade`)"
        )
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
    from router.autoscaling.policy import load_policy

    load_policy(policy_path)  # refuse a bad file before touching the live app
    whole, app = _deployed_config(client, app_name)
    args = dict(app.get("args") or {})
    args["autoscaling_policy"] = str(Path(policy_path).resolve())
    app["args"] = args
    _set_app_policy(app, policy_path)
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
