"""The three-node cluster of test_multinode.py, as a context manager that undoes what it did.

    head      2 CPUs    Serve controller, proxy, OpenAIIngress ×2 apps, the colocated Worker
    prefill   1 CPU     kvrelay_prefill: 1   PrefillWorker + its node's KVTransfer actor
    decode    1 CPU     kvrelay_decode: 1    DecodeWorker (claims the KV across nodes)

    step      does                                   undone by
    head      Cluster(head)  (+ RAY_TMPDIR, patched)  sim.shutdown (+ RAY_TMPDIR restored)
    nodes     add_node x2                            sim.shutdown
    connect   ray.init(address)                      ray.shutdown
    serve     serve.start                            serve.shutdown
    deploy    serve.run per app                      kv_transfer.kill_all per app

Each undo is registered the moment its step has happened, so a step that fails leaves the process
as it found it (test_multinode.py makes each step fail in turn to show it).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from cluster.roles import node_labels, node_resources, pin_pools
from load_tests.local_ray import free_port
from tests.helpers import tiny_app_config

__all__ = ["MAX_TOKENS", "STEPS", "three_node_cluster"]

MAX_TOKENS = 24
OBJECT_STORE_BYTES = 128 * 2**20


STEPS = ("head", "nodes", "connect", "serve", "deploy")


@contextmanager
def three_node_cluster(model_dir: Path, *, apps: tuple[str, ...] = ("multi", "coloc")):
    """Start the cluster, yield its URL and node ids, and undo every step taken, also when a later
    step fails: each step registers its undo on the stack as soon as it has happened.

    Its temp root is a new directory under the session's (tests/conftest.py): short, because Ray's
    socket paths live under it and AF_UNIX paths stop at 107 bytes."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from serving.deployments import kv_transfer
    from serving.deployments.app import build_app

    with pytest.MonkeyPatch.context() as mp, ExitStack() as undo:
        temp_root = Path(tempfile.mkdtemp(prefix="mn-", dir=os.environ.get("RAY_TMPDIR")))
        undo.callback(shutil.rmtree, temp_root, ignore_errors=True)
        # Ray writes the address file under its default temp root whatever `temp_dir` says: give
        # that one, too, a directory of this cluster's own.
        (temp_root / "default" / "ray").mkdir(parents=True)
        mp.setenv("RAY_TMPDIR", str(temp_root / "default"))
        sim = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 2, "labels": node_labels("head"), "object_store_memory": OBJECT_STORE_BYTES,
            "include_dashboard": False, "temp_dir": str(temp_root / "ray"),
        })
        undo.callback(sim.shutdown)
        node_ids = {"head": sim.head_node.node_id}
        for role in ("prefill", "decode"):
            node = sim.add_node(
                num_cpus=1, resources=node_resources(role), labels=node_labels(role),
                object_store_memory=OBJECT_STORE_BYTES,
            )
            node_ids[role] = node.node_id
        ray.init(address=sim.address, logging_level="WARNING")
        undo.callback(ray.shutdown)
        port = free_port()
        # One machine: the nodes share its address, so only the head's proxy can bind the port.
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        undo.callback(serve.shutdown)
        configs = {
            "multi": pin_pools(tiny_app_config(model_dir, "multi")),
            "coloc": tiny_app_config(model_dir, "coloc", mode="colocated"),
        }
        for name in apps:
            undo.callback(kv_transfer.kill_all, name)  # detached: Serve's shutdown leaves them
            serve.run(build_app(configs[name]), name=name, route_prefix=f"/{name}")
        yield {"url": f"http://127.0.0.1:{port}", "node_ids": node_ids}


