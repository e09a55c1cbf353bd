"""load_tests/peers/configs.py: the configuration table, the environment each gets, and which
configuration a peer is compared in."""

from __future__ import annotations

import pytest

from load_tests.peers.configs import (
    PEER_CONFIGS,
    applies,
    best_config,
    env_overrides,
    environment,
    label,
    parse_peer_configs,
)

DEFAULT, ALL_CORES, ALL_CORES_GRPC = PEER_CONFIGS


def test_table_and_labels():
    assert [(c.name, dict(c.env)) for c in PEER_CONFIGS] == [
        ("default", {}), ("all-cores", {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}),
        ("all-cores-grpc", {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "RAY_SERVE_PROXY_USE_GRPC": "1"})]
    assert label("vllm-cpu", ALL_CORES) == "vllm-cpu[all-cores]"
    assert label("ray-serve-llm-pd", "default") == "ray-serve-llm-pd[default]"


def test_parse_keeps_table_order_and_names_unknown_ones():
    assert parse_peer_configs(None) == PEER_CONFIGS
    assert parse_peer_configs("") == PEER_CONFIGS
    assert parse_peer_configs("all-cores, default") == (DEFAULT, ALL_CORES)
    assert parse_peer_configs("all-cores") == (ALL_CORES,)
    with pytest.raises(ValueError, match="--peer-configs: unknown fast, slow; choose from default, all-cores, all-cores-grpc"):
        parse_peer_configs("default,slow,fast")
    with pytest.raises(ValueError, match="unknown \\(empty\\)"):
        parse_peer_configs(" , ")


def test_default_is_vllms_default_whatever_the_caller_exported():
    base = {"PATH": "/bin", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    assert environment(DEFAULT, base) == {"PATH": "/bin", "VLLM_CPU_KVCACHE_SPACE": "2"}
    assert environment(ALL_CORES, base) == {"PATH": "/bin", "VLLM_CPU_KVCACHE_SPACE": "2",
                                            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert env_overrides(DEFAULT) == {"RAY_SERVE_PROXY_USE_GRPC": None, "VLLM_CPU_NUM_OF_RESERVED_CPU": None}
    assert env_overrides(ALL_CORES) == {"RAY_SERVE_PROXY_USE_GRPC": None, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    # a harness that started kvrelay's Ray set RAY_SERVE_PROXY_USE_GRPC in its own env: a peer's
    # default must not inherit it
    assert environment(ALL_CORES, {"RAY_SERVE_PROXY_USE_GRPC": "1"}) == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def test_the_serve_proxy_configuration_runs_only_behind_ray_serves_proxy():
    assert [c.name for c in PEER_CONFIGS if applies(c, "ray-serve-llm")] == ["default", "all-cores", "all-cores-grpc"]
    assert [c.name for c in PEER_CONFIGS if applies(c, "ray-serve-llm-pd")] == ["default", "all-cores", "all-cores-grpc"]
    for system in ("vllm", "vllm-cpu", "kvrelay-vllm-colocated"):
        assert [c.name for c in PEER_CONFIGS if applies(c, system)] == ["default", "all-cores"]


def test_best_config_is_the_highest_throughput_that_ran():
    assert best_config({"default": 180.0, "all-cores": 260.5}) == "all-cores"
    assert best_config({"default": 180.0, "all-cores": None}) == "default"  # failed: never best
    assert best_config({"default": 200.0, "all-cores": 200.0}) == "default"  # a tie: the first listed
    assert best_config({"default": None, "all-cores": None}) is None
    assert best_config({}) is None
    # every request failed (Ray Serve LLM P/D on CPU): 0 tok/s served nothing, so it is no best either
    assert best_config({"default": 0.0, "all-cores": 0.0}) is None
    assert best_config({"default": 0.0, "all-cores": 35.0}) == "all-cores"
