"""Per-key limits on a local Ray, across two ingress replicas: the app deploys its LimitsExchange,
and once the replicas have traded, a key that used its minute is refused whichever replica the
proxy picks."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.helpers import served_app, tiny_app_config

pytestmark = pytest.mark.integration

KEY = "sk-limits-integration-01"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = {"model": "tiny", "prompt": [100, 101, 102], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def app_url(tmp_path_factory, tiny_model_dir):
    config = tiny_app_config(
        tiny_model_dir, "limits", mode="colocated", worker={"num_cpus": 0.1},
        ingress={"num_replicas": 2, "num_cpus": 0.1, "limits_sync_interval_s": 0.2},
        api_keys=[{"key": KEY, "name": "team", "tier": "small"}], tiers={"small": {"requests_per_minute": 3}},
    )
    with served_app(config, tmp_path_factory.mktemp("ray")) as url:
        yield url


def test_a_key_s_minute_is_shared_by_both_ingress_replicas(app_url):
    from ray import serve

    app = serve.status().applications["limits"]
    assert app.deployments["OpenAIIngress"].replica_states.get("RUNNING") == 2
    assert app.deployments["LimitsExchange"].replica_states.get("RUNNING") == 1
    with httpx.Client(timeout=60) as client:
        statuses = [client.post(f"{app_url}/v1/completions", json=BODY, headers=AUTH).status_code for _ in range(3)]
        assert statuses == [200, 200, 200]

        # Three requests over two replicas: one of them served at most one, and alone it would
        # still have room. After a few trades (interval 0.2 s) each has taken the others' share.
        time.sleep(2.0)
        answers = [client.post(f"{app_url}/v1/completions", json=BODY, headers=AUTH) for _ in range(6)]
    assert [a.status_code for a in answers] == [429] * 6
    refused = answers[-1]
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(refused.headers["retry-after"]) >= 1 and refused.headers["x-ratelimit-limit-requests"] == "3"
