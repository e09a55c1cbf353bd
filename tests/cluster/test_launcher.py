"""`kvrelay serve`'s local Ray sizing."""

from __future__ import annotations

from cluster.launcher import ray_init_kwargs, required_cpus
from serving.config import ServeConfig, load_config
from tests.helpers import REPO


def test_required_cpus_counts_fixed_pools_and_autoscaled_maxima():
    assert required_cpus(ServeConfig()) == 0.5 + 0.5 + 0.1
    assert required_cpus(ServeConfig(mode="colocated", worker={"num_cpus": 1, "num_replicas": 2})) == 2.1
    policy = str(REPO / "deploy/autoscaling/cluster.yaml")
    cluster = load_config(REPO / "deploy/local.yaml", overrides={"mode": "disaggregated", "autoscaling_policy": policy}, env={})
    assert required_cpus(cluster) == 0.5 * 8 + 0.5 * 8 + 0.1


def test_object_store_settings(monkeypatch):
    # setenv first: monkeypatch then restores the variable's original state at teardown, even
    # though ray_init_kwargs sets it behind its back (a leaked "1" made every later test's Ray
    # preallocate its whole default object store, and its raylet time out at start-up).
    monkeypatch.setenv("RAY_preallocate_plasma_memory", "0")
    monkeypatch.delenv("RAY_preallocate_plasma_memory")
    assert ray_init_kwargs(ServeConfig()) == {"object_store_memory": 2 * 2**30}
    import os

    assert os.environ["RAY_preallocate_plasma_memory"] == "1"
    monkeypatch.delenv("RAY_preallocate_plasma_memory")
    assert ray_init_kwargs(ServeConfig(ray={"object_store_bytes": None, "preallocate_object_store": False})) == {}
    assert "RAY_preallocate_plasma_memory" not in os.environ


def test_grpc_transport_sets_the_proxy_env(monkeypatch):
    import os

    for key in ("RAY_SERVE_PROXY_USE_GRPC", "RAY_preallocate_plasma_memory"):  # restored at teardown (see above)
        monkeypatch.setenv(key, "unset")
    ray_init_kwargs(ServeConfig())
    assert os.environ["RAY_SERVE_PROXY_USE_GRPC"] == "1"
    ray_init_kwargs(ServeConfig(ray={"grpc_transport": False}))
    assert os.environ["RAY_SERVE_PROXY_USE_GRPC"] == "0"


def test_a_proxy_gets_30_s_to_start_and_any_response_size_unless_the_environment_says(monkeypatch):
    import os

    for key in ("RAY_SERVE_PROXY_USE_GRPC", "RAY_preallocate_plasma_memory"):  # restored at teardown
        monkeypatch.setenv(key, "unset")
    for key in ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"):
        monkeypatch.delenv(key, raising=False)
    ray_init_kwargs(ServeConfig())
    assert os.environ["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "30"
    assert os.environ["RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"] == str(2**31 - 1)
    monkeypatch.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "90")
    monkeypatch.setenv("RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH", str(2**26))
    ray_init_kwargs(ServeConfig())
    assert os.environ["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "90"
    assert os.environ["RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"] == str(2**26)
