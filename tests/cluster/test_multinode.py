"""Three Ray nodes on one machine (head, prefill node, decode node), the app pinned by role.

    head      2 CPUs    Serve controller, proxy, OpenAIIngress ×2 apps, the colocated Worker
    prefill   1 CPU     kvrelay_prefill: 1   PrefillWorker + its node's KVTransfer actor
    decode    1 CPU     kvrelay_decode: 1    DecodeWorker (claims the KV across nodes)

Each node is its own raylet with its own object store, so a KV payload the prefill node put is
fetched by the decode node through Ray's object transfer, as between machines.
"""

from __future__ import annotations

import os

import httpx
import pytest

from cluster.roles import ROLE_LABEL, node_labels, node_resources, pin_pools
from load_tests.local_ray import free_port
from serving.config import ServeConfig

pytestmark = pytest.mark.integration

KV_BYTES = 16 * 2**20
MAX_TOKENS = 24
OBJECT_STORE_BYTES = 128 * 2**20



def app_config(model_dir, name: str, **overrides) -> ServeConfig:
    small = {"num_cpus": 0.1, "num_threads": 1}
    base = {
        "model": str(model_dir), "served_model_name": "tiny", "dtype": "float32", "kv_cache_bytes": KV_BYTES,
        "app_name": name, "prefill": small, "decode": small, "worker": small, "ingress": {"num_cpus": 0.05},
    }
    base.update(overrides)
    return ServeConfig.model_validate(base)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from serving import kv_transfer_actor
    from serving.app import build_app

    # The PyTorch path, not the native kernels: a kernel build on the first request (a fresh cache,
    # or one another process is rebuilding) would take longer than the request's timeout, and
    # this test is about placement and the KV hand-off. The nodes inherit this environment.
    previous = os.environ.get("KVRELAY_DISABLE_NATIVE")
    os.environ["KVRELAY_DISABLE_NATIVE"] = "1"
    sim = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "labels": node_labels("head"), "object_store_memory": OBJECT_STORE_BYTES,
        "include_dashboard": False, "temp_dir": str(tmp_path_factory.mktemp("ray")),
    })
    node_ids = {"head": sim.head_node.node_id}
    for role in ("prefill", "decode"):
        node = sim.add_node(
            num_cpus=1, resources=node_resources(role), labels=node_labels(role),
            object_store_memory=OBJECT_STORE_BYTES,
        )
        node_ids[role] = node.node_id
    try:
        ray.init(address=sim.address, logging_level="WARNING")
        port = free_port()
        # One machine: the nodes share its address, so only the head's proxy can bind the port.
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        apps = {
            "multi": pin_pools(app_config(tiny_model_dir, "multi")),
            "coloc": app_config(tiny_model_dir, "coloc", mode="colocated"),
        }
        for name, config in apps.items():
            serve.run(build_app(config), name=name, route_prefix=f"/{name}")
        yield {"url": f"http://127.0.0.1:{port}", "node_ids": node_ids}
        for name in apps:
            kv_transfer_actor.kill_all(name)
        serve.shutdown()
    finally:
        ray.shutdown()
        sim.shutdown()
        if previous is None:
            os.environ.pop("KVRELAY_DISABLE_NATIVE", None)
        else:
            os.environ["KVRELAY_DISABLE_NATIVE"] = previous


def stats(app: str, deployment: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle(deployment, app_name=app).stats.remote().result(timeout_s=30)


def kv_actor(app: str, node_id: str):
    import ray

    from serving import kv_transfer_actor

    return ray.get_actor(kv_transfer_actor.actor_name(app, node_id), namespace=kv_transfer_actor.NAMESPACE)


def test_nodes_advertise_their_roles(cluster):
    import ray

    by_id = {node["NodeID"]: node for node in ray.nodes() if node["Alive"]}
    for role, node_id in cluster["node_ids"].items():
        assert by_id[node_id]["Labels"][ROLE_LABEL] == role
        for resource, amount in node_resources(role).items():
            assert by_id[node_id]["Resources"][resource] == amount
    assert "kvrelay_prefill" not in by_id[cluster["node_ids"]["decode"]]["Resources"]


def test_replicas_land_on_their_pools_nodes(cluster):
    assert stats("multi", "PrefillWorker")["node_id"] == cluster["node_ids"]["prefill"]
    assert stats("multi", "DecodeWorker")["node_id"] == cluster["node_ids"]["decode"]


def test_chat_crosses_nodes_and_equals_colocated(cluster):
    import ray

    prefill_node, decode_node = cluster["node_ids"]["prefill"], cluster["node_ids"]["decode"]
    before = stats("multi", "DecodeWorker")
    request = {"messages": [{"role": "user", "content": "Tell me about the ocean."}], "temperature": 0, "max_tokens": MAX_TOKENS}
    texts = {}
    for app in ("multi", "coloc"):
        with httpx.Client(base_url=f"{cluster['url']}/{app}", timeout=120) as client:
            response = client.post("/v1/chat/completions", json=request)
        body = response.json()
        assert response.status_code == 200, body
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
        texts[app] = body["choices"][0]["message"]["content"]
    assert texts["multi"] == texts["coloc"]

    after = stats("multi", "DecodeWorker")
    assert after["num_kv_imports"] == before["num_kv_imports"] + 1
    assert after["num_kv_fallbacks"] == before["num_kv_fallbacks"] == 0
    assert after["node_id"] == decode_node
    # The KV waited in the prefill node's KVTransfer actor; the decode node never had one.
    held = ray.get(kv_actor("multi", prefill_node).stats.remote(), timeout=30)
    assert held["node_id"] == prefill_node
    assert (held["num_offered"], held["num_claimed"], held["num_held"]) == (1, 1, 0)
    with pytest.raises(ValueError):
        kv_actor("multi", decode_node)
