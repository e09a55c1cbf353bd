"""Per-key limits on a local Ray, across two ingress replicas: the app deploys its LimitsExchange,
and once the replicas have traded, a key that used its minute is refused whichever replica the
proxy picks. The same app shares LoRA adapters loaded at run time through its AdapterRegistry."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.helpers import TINY_ENGINE, served_app, tiny_app_config, wait_until

pytestmark = pytest.mark.integration

KEY = "sk-limits-integration-01"
ADMIN = {"Authorization": "Bearer sk-limits-integration-admin"}
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = {"model": "tiny", "prompt": [100, 101, 102], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def app_url(tmp_path_factory, tiny_model_dir):
    config = tiny_app_config(
        tiny_model_dir, "limits", mode="colocated", worker={"num_cpus": 0.1},
        ingress={"num_replicas": 2, "num_cpus": 0.1, "limits_sync_interval_s": 0.2},
        api_keys=[{"key": KEY, "name": "team", "tier": "small"}], tiers={"small": {"requests_per_minute": 3}},
        admin_api_keys=[{"key": ADMIN["Authorization"].split()[1], "name": "ops"}],
        engine={**TINY_ENGINE, "num_threads": 1, "lora": {"allow_runtime_updates": True}},
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


def test_a_lora_adapter_loaded_on_one_ingress_replica_serves_on_both(app_url, tmp_path, tiny_model_dir):
    pytest.importorskip("peft")
    from ray import serve

    from tests.serving.engine.test_lora import make_adapter

    make_adapter(tiny_model_dir, tmp_path / "late", 4, 8, ["q_proj", "down_proj"], False, seed=14)
    assert serve.status().applications["limits"].deployments["AdapterRegistry"].replica_states.get("RUNNING") == 1
    body = {"model": "late", "prompt": [100, 101, 102], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=60, headers=ADMIN) as client:
        loaded = client.post(f"{app_url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(tmp_path / "late")})
        assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'late' added successfully."), loaded.text
        # the proxy spreads the requests over both replicas; every one runs the adapter
        answers = [client.post(f"{app_url}/v1/completions", json=body) for _ in range(6)]
        assert [a.status_code for a in answers] == [200] * 6, answers[-1].text
        assert len({a.json()["choices"][0]["text"] for a in answers}) == 1
        assert client.post(f"{app_url}/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
        # the other replica's copy refreshes every 0.2 s: both soon refuse the adapter
        wait_until(lambda: [client.post(f"{app_url}/v1/completions", json=body).status_code for _ in range(6)] == [404] * 6,
                   10, "both ingress replicas to refuse the unloaded adapter", interval_s=0.2)
