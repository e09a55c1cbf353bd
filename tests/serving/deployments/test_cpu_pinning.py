"""A pool's cpu_affinity: config validation, the core set per replica rank, and pinning a process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from serving.config import ConfigError, PoolConfig, load_config
from serving.deployments.cpu_pinning import cores_for_rank, pin_process


def test_cores_by_local_rank_wrap_around():
    assert cores_for_rank([], 3) is None
    assert cores_for_rank([[0], [1]], 0) == {0}
    assert cores_for_rank([[0], [1]], 1) == {1}
    assert cores_for_rank([[0], [1]], 2) == {0}
    assert cores_for_rank([[0, 1]], 5) == {0, 1}


@pytest.mark.parametrize("bad", [[[]], [[-1]], [[0], []]])
def test_empty_or_negative_core_sets_are_refused(bad):
    with pytest.raises(ValueError, match=r"cpu_affinity\[\d\] = .*non-empty list of core numbers >= 0"):
        PoolConfig(cpu_affinity=bad)


def test_cpu_affinity_from_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("prefill: {cpu_affinity: [[0]]}\ndecode: {cpu_affinity: [[1]]}\n")
    config = load_config(path, env={})
    assert config.prefill.cpu_affinity == [[0]]
    assert config.decode.cpu_affinity == [[1]]
    path.write_text("decode: {cpu_affinity: [[]]}\n")
    with pytest.raises(ConfigError, match="cpu_affinity"):
        load_config(path, env={})


def test_unavailable_core_is_named_and_nothing_changes():
    missing = os.cpu_count()  # cores are numbered from 0
    before = os.sched_getaffinity(0)
    with pytest.raises(ValueError, match=rf"decode replica asks for cores \[{missing}\], which this node cannot give"):
        pin_process({missing}, what="decode replica")
    assert os.sched_getaffinity(0) == before


def test_a_replica_may_widen_the_mask_it_inherited():
    """Ray started on core {first} (a benchmark keeps it off the decode core): a replica
    pinned to {last} still gets it."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    script = (
        "import os\n"
        "from serving.deployments.cpu_pinning import pin_process\n"
        f"os.sched_setaffinity(0, {{{cores[0]}}})\n"
        f"pin_process({{{cores[-1]}}})\n"
        "print(sorted(os.sched_getaffinity(0)))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str([cores[-1]])


def test_pin_reaches_threads_started_before_and_after():
    """In a child process (pinning this one would pin the test run): a thread that already runs
    and one started afterwards both end on core {first}."""
    first = min(os.sched_getaffinity(0))
    script = textwrap.dedent(f"""
        import os, threading
        from serving.deployments.cpu_pinning import pin_process
        masks, go = {{}}, threading.Event()
        def record(name):
            go.wait()
            masks[name] = os.sched_getaffinity(0)  # this thread's own mask
        before = threading.Thread(target=record, args=("before",)); before.start()
        pin_process({{{first}}})
        after = threading.Thread(target=record, args=("after",)); after.start()
        go.set(); before.join(); after.join()
        masks["main"] = os.sched_getaffinity(0)
        print(sorted((k, sorted(v)) for k, v in masks.items()))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str([("after", [first]), ("before", [first]), ("main", [first])])
