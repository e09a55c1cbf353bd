"""Node roles: the resources and labels each role's nodes carry, and pools pinned to them."""

from __future__ import annotations

import pytest

from cluster.roles import (
    node_labels,
    node_resources,
    pin_overrides,
    pin_pools,
    ray_start_args,
)
from serving.config import ServeConfig, load_config


def test_role_resources_and_labels():
    assert node_resources("head") == {}
    assert node_resources("prefill") == {"kvrelay_prefill": 1.0}
    assert node_resources("decode") == {"kvrelay_decode": 1.0}
    assert node_labels("decode") == {"kvrelay.io/role": "decode"}
    with pytest.raises(ValueError, match="unknown node role 'gpu'; one of head, prefill, decode"):
        node_resources("gpu")


def test_ray_start_args():
    assert ray_start_args("head") == ["--labels", "kvrelay.io/role=head"]
    assert ray_start_args("prefill") == ["--labels", "kvrelay.io/role=prefill", "--resources", '{"kvrelay_prefill":1.0}']


def test_pin_pools_keeps_other_resources_and_leaves_worker_unpinned():
    config = ServeConfig.model_validate({"prefill": {"resources": {"accel": 1}, "num_replicas": 2}})
    pinned = pin_pools(config)
    assert pinned.prefill.resources == {"accel": 1, "kvrelay_prefill": 0.01}
    assert pinned.prefill.num_replicas == 2
    assert pinned.decode.resources == {"kvrelay_decode": 0.01}
    assert pinned.worker.resources == {}
    assert config.prefill.resources == {"accel": 1}  # the original is untouched


def test_pin_overrides_are_the_same_as_pin_pools():
    overrides = dict(item.split("=") for item in pin_overrides())
    assert overrides == {"prefill.resources.kvrelay_prefill": "0.01", "decode.resources.kvrelay_decode": "0.01"}
    config = load_config(overrides={key: float(value) for key, value in overrides.items()}, env={})
    assert config == pin_pools(ServeConfig())
