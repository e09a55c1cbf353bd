"""Three Ray nodes on one machine (head, prefill node, decode node), the app pinned by role.

    head      2 CPUs    Serve controller, proxy, OpenAIIngress ×2 apps, the colocated Worker
    prefill   1 CPU     kvrelay_prefill: 1   PrefillWorker + its node's KVTransfer actor
    decode    1 CPU     kvrelay_decode: 1    DecodeWorker (claims the KV across nodes)

Each node is its own raylet with its own object store, so a KV payload the prefill node put is
fetched by the decode node through Ray's object transfer, as between machines.
"""

from __future__ import annotations

import httpx
import pytest

from cluster.roles import ROLE_LABEL, node_resources
from serving.deployments.messages import WorkerStats
from serving.engine.modeling.cpu_kernels import build_dir, kernel_status
from tests.cluster.multinode import MAX_TOKENS, three_node_cluster

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    # The nodes' replicas load the native kernels this process builds (or finds) in the cache
    # they share: no replica builds them on its first request.
    kernel_status()
    with three_node_cluster(tiny_model_dir) as info:
        yield info


def stats(app: str, deployment: str) -> WorkerStats:
    from ray import serve

    return serve.get_deployment_handle(deployment, app_name=app).stats.remote().result(timeout_s=30)


def kv_actor(app: str, node_id: str):
    import ray

    from serving.deployments import kv_transfer

    return ray.get_actor(kv_transfer.actor_name(app, node_id), namespace=kv_transfer.NAMESPACE)


def test_nodes_advertise_their_roles(cluster):
    import ray

    by_id = {node["NodeID"]: node for node in ray.nodes() if node["Alive"]}
    for role, node_id in cluster["node_ids"].items():
        assert by_id[node_id]["Labels"][ROLE_LABEL] == role
        for resource, amount in node_resources(role).items():
            assert by_id[node_id]["Resources"][resource] == amount
    assert "kvrelay_prefill" not in by_id[cluster["node_ids"]["decode"]]["Resources"]


def test_replicas_land_on_their_pools_nodes(cluster):
    assert stats("multi", "PrefillWorker").node_id == cluster["node_ids"]["prefill"]
    assert stats("multi", "DecodeWorker").node_id == cluster["node_ids"]["decode"]


def test_replicas_run_the_kernel_path_of_this_machine(cluster):
    """No replica falls back silently: each runs the path this process has, and says so."""
    here = kernel_status()
    for app, deployment in (("multi", "PrefillWorker"), ("multi", "DecodeWorker"), ("coloc", "Worker")):
        replica = stats(app, deployment)
        assert replica.engine.kernel_path == here.path.value, (deployment, replica.engine.kernel_reason)
        if here.path.value == "native":
            assert replica.engine.kernel_reason == f"loaded from the cache {build_dir()}"


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
    assert after.counters.num_kv_imports == before.counters.num_kv_imports + 1
    assert after.counters.num_kv_fallbacks == before.counters.num_kv_fallbacks == 0
    assert after.node_id == decode_node
    # The KV waited in the prefill node's KVTransfer actor; the decode node never had one.
    held = ray.get(kv_actor("multi", prefill_node).stats.remote(), timeout=30)
    assert held.node_id == prefill_node
    assert (held.num_offered, held.num_claimed, held.num_held) == (1, 1, 0)
    with pytest.raises(ValueError):
        kv_actor("multi", decode_node)

