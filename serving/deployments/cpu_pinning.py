"""Pinning a worker replica's process to cores (a pool's `cpu_affinity`, serving/config/).

On a small machine, a prefill replica and a decode replica that float over the same cores slow
each other down as much as a colocated engine would: the point of disaggregation is lost. Pinning
each to cores of its own keeps a long prefill off the decode replica's core.

`sched_setaffinity` acts on one thread, and threads inherit the mask only when they start, so the
whole process is pinned by setting every thread listed in /proc/self/task (Ray's threads already
run when the replica's constructor does); threads started later (the engine's loop, torch's pool)
inherit it.
"""

from __future__ import annotations

import logging
import os

__all__ = ["cores_for_rank", "pin_process"]

logger = logging.getLogger(__name__)


def cores_for_rank(cpu_affinity: list[list[int]], rank: int) -> set[int] | None:
    """The cores of the replica of `rank` on its node (Serve's local rank): cpu_affinity[rank %
    len]; None when the pool pins nothing."""
    if not cpu_affinity:
        return None
    return set(cpu_affinity[rank % len(cpu_affinity)])


def pin_process(cores: set[int], *, what: str = "replica") -> None:
    """Pin every thread of this process to `cores`; ValueError when a core is not available here.

    The mask may be wider than the one this process inherited (a benchmark can start Ray on one
    core and pin replicas to the others); the kernel refuses only cores outside the machine or
    the container's cpuset.
    """
    tids = sorted(int(tid) for tid in os.listdir("/proc/self/task"))
    try:
        os.sched_setaffinity(0, cores)  # this thread first: an impossible mask fails here, unchanged
    except OSError as exc:
        raise ValueError(
            f"cpu_affinity: {what} asks for cores {sorted(cores)}, which this node cannot give "
            f"({exc.strerror}; it has {os.cpu_count()} CPUs); fix the pool's cpu_affinity for this node"
        ) from None
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    logger.info("%s pinned to cores %s", what, sorted(cores))
