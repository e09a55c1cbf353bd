"""Operating a running app through the dashboard (scale, policy apply, the deploy config) against
recorded dashboard answers (httpx MockTransport)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from cluster import dashboard
from router.autoscaling.policy import PolicyError
from tests.helpers import REPO

DATA = Path(__file__).parent / "data" / "serve_applications.json"



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

    def client(self, token: str | None = "secret") -> dashboard.DashboardClient:
        return dashboard.DashboardClient("http://dash:8265", token=token, transport=httpx.MockTransport(self.handler))


def test_token_is_sent_and_401_explains_the_fix():
    fake = FakeDashboard(recorded())
    assert fake.client().get_applications()["applications"]["kvrelay"]["status"] == "RUNNING"
    with pytest.raises(dashboard.OpsError, match=r"refused the request \(401\): token authentication is on. Set RAY_AUTH_TOKEN"):
        fake.client(token="wrong").get_applications()


def test_a_failed_put_names_the_exception_at_the_end_of_the_dashboard_traceback():
    # the dashboard's 500 when Serve's proxy cannot bind the HTTP port (recorded from Ray 2.60)
    text = ('Traceback (most recent call last):\n  File ".../ray/dashboard/optional_utils.py", line 241, in decorator\n'
            '    return await f(self, *args, **kwargs)\n' + '  File "...", line 1, in f\n    x\n' * 20 +
            "ray.exceptions.RayTaskError(RuntimeError): ray::ProxyActor.ready() (pid=1850)\n"
            "RuntimeError: Failed to bind to address '127.0.0.1:46619'.\n")

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, text=text)

    client = dashboard.DashboardClient("http://dash:8265", token="t", transport=httpx.MockTransport(handler))
    with pytest.raises(dashboard.OpsError) as info:
        client.put_applications({"applications": []})
    assert str(info.value) == ("PUT /api/serve/applications/ on the Ray dashboard failed (500): "
                               "RuntimeError: Failed to bind to address '127.0.0.1:46619'.")


def test_token_lookup_order(tmp_path, monkeypatch):
    path = tmp_path / "token"
    path.write_text("from-file\n")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(path))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    assert dashboard.dashboard_token() == "from-file"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    assert dashboard.dashboard_token() == "from-env"


def test_scale_rewrites_only_that_pool_and_keeps_other_apps():
    state = recorded()
    other = {"name": "other", "route_prefix": "/other", "import_path": "x:y", "args": {}}
    state["applications"]["other"] = {"status": "RUNNING", "deployments": {}, "deployed_app_config": other}
    fake = FakeDashboard(state)
    message = dashboard.scale(fake.client(), "kvrelay", "ingress", 2)
    assert message == "kvrelay: ingress -> 2 replicas requested"
    (put,) = fake.puts
    apps = {app["name"]: app for app in put["applications"]}
    assert apps["other"] == other
    before = state["applications"]["kvrelay"]["deployed_app_config"]["args"]
    after = apps["kvrelay"]["args"]
    assert after["ingress"] == {**before["ingress"], "num_replicas": 2}
    assert {k: v for k, v in after.items() if k != "ingress"} == {k: v for k, v in before.items() if k != "ingress"}
    assert put["http_options"] == {"host": "127.0.0.1", "port": 8000}
    assert "autoscales" in dashboard.scale(fake.client(), "kvrelay", "decode", 2)


def test_scale_refuses_bad_counts_and_imperative_apps():
    fake = FakeDashboard(recorded())
    with pytest.raises(dashboard.OpsError, match="^ingress.num_replicas = 0: Input should be greater than or equal to 1$"):
        dashboard.scale(fake.client(), "kvrelay", "ingress", 0)
    state = recorded()
    state["applications"]["kvrelay"]["deployed_app_config"] = None
    with pytest.raises(dashboard.OpsError, match="deployed from Python \\(serve.run\\)"):
        dashboard.scale(FakeDashboard(state).client(), "kvrelay", "ingress", 2)
    assert fake.puts == []


def test_an_app_of_an_older_kvrelay_is_named_as_such_and_left_alone():
    state = recorded()
    app = state["applications"]["kvrelay"]["deployed_app_config"]
    app["import_path"] = "serving.app:build_app"
    app["args"] = {"num_threads": 2}  # 0.1's layout: not this version's config
    fake = FakeDashboard(state)
    with pytest.raises(dashboard.OpsError) as info:
        dashboard.scale(fake.client(), "kvrelay", "decode", 2)
    assert str(info.value) == (
        "application 'kvrelay' runs kvrelay 0.1 (import path 'serving.app:build_app'), older than this kvrelay "
        "command: use the command of the cluster's version, or upgrade the cluster (`kvrelay serve`, `helm upgrade`)"
    )
    assert fake.puts == []


def test_policy_apply_validates_first(tmp_path):
    fake = FakeDashboard(recorded())
    bad = tmp_path / "bad.yaml"
    bad.write_text("prefill:\n  min_replicas: 3\n  max_replicas: 1\n")
    with pytest.raises(PolicyError):
        dashboard.apply_policy(fake.client(), "kvrelay", str(bad))
    assert fake.puts == []
    good = REPO / "deploy/autoscaling/cluster.yaml"
    assert dashboard.apply_policy(fake.client(), "kvrelay", str(good)) == f"kvrelay: autoscaling policy {good} applied"
    assert fake.puts[0]["applications"][0]["args"]["autoscaling_policy"] == str(good)


def test_serve_deploy_config_is_a_valid_serve_schema():
    from ray.serve.schema import ServeDeploySchema

    from serving.config import load_config

    config = load_config(REPO / "deploy/local.yaml", env={})
    schema = ServeDeploySchema.model_validate(dashboard.serve_deploy_config(config))
    app = schema.applications[0]
    assert (app.name, app.import_path, app.route_prefix) == ("kvrelay", "serving.deployments.app:build_app", "/")
    assert Path(app.args["autoscaling_policy"]).is_absolute()


def test_planner_policy_becomes_the_apps_autoscaling_policy(tmp_path):
    from serving.config import load_config

    config = load_config(REPO / "deploy/local.yaml", env={})
    planned = config.model_copy(update={"autoscaling_policy": str(REPO / "deploy/autoscaling/planner.yaml")})
    assert dashboard.serve_deploy_config(planned)["applications"][0]["autoscaling_policy"] == {
        "policy_function": "router.autoscaling.plan_serve:plan_policy"}
    assert "autoscaling_policy" not in dashboard.serve_deploy_config(config)["applications"][0]

    fake = FakeDashboard(recorded())
    dashboard.apply_policy(fake.client(), "kvrelay", str(REPO / "deploy/autoscaling/planner.yaml"))
    assert fake.puts[-1]["applications"][0]["autoscaling_policy"]["policy_function"].endswith(":plan_policy")
    dashboard.apply_policy(fake.client(), "kvrelay", str(REPO / "deploy/autoscaling/cluster.yaml"))
    assert "autoscaling_policy" not in fake.puts[-1]["applications"][0]
