"""The three-node cluster's set-up (tests/cluster/multinode.py) fails at each of its steps in
turn: what the steps before did is undone and the test process is left as it was. A module of
its own, so no other Ray runs in this process meanwhile."""

from __future__ import annotations

import pytest

from tests.cluster.multinode import STEPS, three_node_cluster
from tests.helpers import process_state, state_changes

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("failing", STEPS)
def test_a_failing_step_leaves_nothing_behind(failing, tiny_model_dir, monkeypatch):
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    def boom(*args, **kwargs):
        raise RuntimeError(f"injected failure at {failing}")

    owner, name = {
        "head": (Cluster, "__init__"), "nodes": (Cluster, "add_node"), "connect": (ray, "init"),
        "serve": (serve, "start"), "deploy": (serve, "run"),
    }[failing]
    before = process_state()
    with monkeypatch.context() as patch:
        patch.setattr(owner, name, boom)
        with pytest.raises(RuntimeError, match=f"injected failure at {failing}"):
            with three_node_cluster(tiny_model_dir, apps=("coloc",)):
                pytest.fail("the cluster came up although a step failed")
    assert state_changes(before, process_state()) == []
    assert not ray.is_initialized()
