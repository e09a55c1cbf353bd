"""Node roles: which nodes run which pool, as Ray custom resources (and labels, for people).

    node role   Ray resource (per node)   label                      runs
    ---------   -----------------------   ------------------------   ---------------------------------
    head        -                         kvrelay.io/role=head       GCS, dashboard, Serve controller,
                                                                     proxy, OpenAIIngress
    prefill     kvrelay_prefill: 1        kvrelay.io/role=prefill    PrefillWorker replicas + KVTransfer
    decode      kvrelay_decode: 1         kvrelay.io/role=decode     DecodeWorker replicas + KVTransfer

A pool is pinned to its role by asking, per replica, for a sliver of the role's resource
(`REPLICA_SHARE`, 0.01: up to 100 replicas per node; CPUs and GPUs still bound the real count).
The names are the same everywhere: `ray start --resources` on bare machines, `kvrelay cluster up`,
and the KubeRay worker groups' `rayStartParams` in the Helm chart.

Resources rather than label selectors: Ray 2.60 does schedule actors by `label_selector` (Serve
passes it through `ray_actor_options`), but custom resources also work on older clusters and
KubeRay, and they are what the chart sets. Nodes carry the label too, so the dashboard and
`ray.nodes()` show each node's role. The colocated `worker` pool is not pinned: it does both halves.
"""

from __future__ import annotations

import json
from typing import Literal

from serving.config import ServeConfig

__all__ = [
    "REPLICA_SHARE",
    "ROLES",
    "ROLE_LABEL",
    "ROLE_RESOURCES",
    "Role",
    "node_labels",
    "node_resources",
    "pin_overrides",
    "pin_pools",
    "ray_start_args",
]

Role = Literal["head", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("head", "prefill", "decode")
# The pool a role serves -> the resource its nodes advertise. The Helm chart uses these names.
ROLE_RESOURCES: dict[str, str] = {"prefill": "kvrelay_prefill", "decode": "kvrelay_decode"}
ROLE_LABEL = "kvrelay.io/role"
REPLICA_SHARE = 0.01  # of a node's 1.0 per replica


def node_resources(role: Role) -> dict[str, float]:
    """The custom resources a node of this role advertises (`ray start --resources`)."""
    _check_role(role)
    return {ROLE_RESOURCES[role]: 1.0} if role in ROLE_RESOURCES else {}


def node_labels(role: Role) -> dict[str, str]:
    """The labels a node of this role carries (`ray start --labels`)."""
    _check_role(role)
    return {ROLE_LABEL: role}


def ray_start_args(role: Role) -> list[str]:
    """The role's part of a `ray start` command line."""
    args = ["--labels", ",".join(f"{key}={value}" for key, value in node_labels(role).items())]
    resources = node_resources(role)
    if resources:
        args += ["--resources", json.dumps(resources, separators=(",", ":"))]
    return args


def pin_pools(config: ServeConfig) -> ServeConfig:
    """A copy of `config` whose prefill and decode pools ask for their role's resource (other
    resources a pool asks for are kept)."""
    updates = {}
    for pool_name, resource in ROLE_RESOURCES.items():
        pool = config.pools[pool_name]
        updates[pool_name] = pool.model_copy(update={"resources": {**pool.resources, resource: REPLICA_SHARE}})
    return config.model_copy(update=updates)


def pin_overrides() -> list[str]:
    """The same as `pin_pools`, as `kvrelay serve --set` arguments."""
    return [f"{pool}.resources.{resource}={REPLICA_SHARE}" for pool, resource in ROLE_RESOURCES.items()]


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"unknown node role {role!r}; one of {', '.join(ROLES)}")
