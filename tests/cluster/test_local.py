"""`kvrelay cluster up | down`: the node command lines, the state file, and stopping exactly the
recorded processes (checked on plain processes, then once on a real three-node Ray)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from cluster import local
from cluster.local import MARKER_ENV, ClusterError, ClusterState, NodeProcess
from tests.helpers import wait_until


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_ray_start_commands():
    head = local.ray_start_command(
        "head", ray_bin="ray", temp_dir="/t/head", num_cpus=2, object_store_bytes=2**29, agent_port=5,
        port=1, dashboard_port=2, client_port=3,
    )
    assert head == [
        "ray", "start", "--block", "--head", "--port", "1", "--include-dashboard", "true",
        "--dashboard-host", "127.0.0.1", "--dashboard-port", "2", "--ray-client-server-port", "3",
        "--node-ip-address", "127.0.0.1", "--num-cpus", "2", "--object-store-memory", "536870912",
        "--temp-dir", "/t/head", "--dashboard-agent-listen-port", "5", "--min-worker-port", "0",
        "--max-worker-port", "0", "--disable-usage-stats", "--labels", "kvrelay.io/role=head",
    ]
    prefill = local.ray_start_command(
        "prefill", ray_bin="ray", temp_dir="/t/p", num_cpus=1, object_store_bytes=2**28, agent_port=6,
        head_address="10.0.0.1:6379",
    )
    assert prefill == [
        "ray", "start", "--block", "--address", "10.0.0.1:6379", "--node-ip-address", "127.0.0.1",
        "--num-cpus", "1", "--object-store-memory", "268435456", "--temp-dir", "/t/p",
        "--dashboard-agent-listen-port", "6", "--min-worker-port", "0", "--max-worker-port", "0",
        "--disable-usage-stats", "--labels", "kvrelay.io/role=prefill", "--resources", '{"kvrelay_prefill":1.0}',
    ]


def test_state_round_trip_and_a_damaged_file(cache_dir):
    state = ClusterState(
        name="dev", marker="m", address="10.0.0.1:6379", dashboard_url="http://127.0.0.1:8265",
        base_dir="/tmp/x", nodes=[NodeProcess("head", 12, "/tmp/x/head", "/tmp/x/head.log")],
    )
    assert ClusterState.from_json(state.to_json()) == state
    assert local.load_state("dev") is None
    local.state_path("dev").parent.mkdir(parents=True)
    local.state_path("dev").write_text("{not json")
    with pytest.raises(ClusterError, match="not a kvrelay cluster state file"):
        local.load_state("dev")


def _spawn_session(script: str, marker: str) -> int:
    """`sh -c script` as the leader of a new session, with the cluster marker in its env."""
    env = {**os.environ, MARKER_ENV: marker}
    return os.posix_spawn("/bin/sh", ["/bin/sh", "-c", script], env, setsid=True)


def test_down_stops_only_the_marked_processes_of_recorded_sessions(tmp_path):
    marker = "test-" + os.urandom(4).hex()
    # In the session: a marked child (a worker that took its own process group, as Ray's do),
    # and one without the marker; outside it, a marked process: only the first two are ours.
    worker = f"{sys.executable} -c 'import os, time; os.setpgid(0, 0); time.sleep(60)'"
    leader = _spawn_session(
        f"{worker} & echo $! > {tmp_path}/worker; env -u {MARKER_ENV} sleep 61 & echo $! > {tmp_path}/unmarked; wait",
        marker,
    )
    other = _spawn_session("exec sleep 62", marker)
    try:
        wait_until(lambda: (tmp_path / "unmarked").exists() and len(local.session_members(leader, marker)) == 2, timeout_s=10, interval_s=0.05)
        unmarked = int((tmp_path / "unmarked").read_text())
        worker_pid = int((tmp_path / "worker").read_text())
        assert sorted(local.session_members(leader, marker)) == sorted([leader, worker_pid])
        wait_until(lambda: os.getpgid(worker_pid) == worker_pid, timeout_s=10, interval_s=0.05)  # its own process group, as Ray's workers
        state = ClusterState(name="t", marker=marker, base_dir=str(tmp_path / "base"), nodes=[NodeProcess("head", leader, "", "")])
        (tmp_path / "base").mkdir()
        local.state_path("t").parent.mkdir(parents=True)
        local.state_path("t").write_text(state.to_json())

        assert local.down("t", grace_s=5.0) == state
        assert local.session_members(leader, marker) == []
        os.kill(unmarked, 0)  # still running
        os.kill(other, 0)
        assert not local.state_path("t").exists() and not (tmp_path / "base").exists()
        with pytest.raises(ClusterError, match="no cluster named 't' was started here"):
            local.down("t")
    finally:
        for pid in (other, leader, locals().get("unmarked"), locals().get("worker_pid")):
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for pid in (leader, other):
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


@pytest.mark.integration
def test_up_and_down_a_real_cluster():
    state = local.up(1, 1, name="it", num_cpus=1, head_num_cpus=1, object_store_bytes=100 * 2**20)
    try:
        assert [node.role for node in state.nodes] == ["head", "prefill", "decode"]
        assert local.load_state("it") == state
        with pytest.raises(ClusterError, match="cluster 'it' is already up"):
            local.up(0, 0, name="it")
        # A driver joining by address, with the environment the printed `kvrelay serve` line sets
        # (in this process Ray read its auth mode at import).
        probe = (
            f"import json, ray; ray.init(address={state.address!r}, logging_level='ERROR'); "
            "print(json.dumps(sorted((n['Labels']['kvrelay.io/role'], n['Resources'].get('kvrelay_prefill', 0), "
            "n['Resources'].get('kvrelay_decode', 0)) for n in ray.nodes() if n['Alive'])))"
        )
        done = subprocess.run(
            [sys.executable, "-c", probe], env={**os.environ, "RAY_AUTH_MODE": state.auth_mode},
            capture_output=True, text=True, timeout=120, check=False,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        roles = [tuple(row) for row in json.loads(done.stdout.strip().splitlines()[-1])]
        assert roles == [("decode", 0, 1.0), ("head", 0, 0), ("prefill", 1.0, 0)]
        assert all(local.session_members(node.pid, state.marker) for node in state.nodes)
    finally:
        local.down("it")
    assert not any(local.session_members(node.pid, state.marker) for node in state.nodes)
    assert not os.path.exists(state.base_dir) and local.load_state("it") is None


def test_up_report_names_the_address_and_the_serve_line():
    state = ClusterState(
        name="b", marker="m", address="10.0.0.1:6379", dashboard_url="http://127.0.0.1:8266", base_dir="/tmp/kc",
        nodes=[NodeProcess("head", 1, "", ""), NodeProcess("prefill", 2, "", ""), NodeProcess("prefill", 3, "", ""), NodeProcess("decode", 4, "", "")],
    )
    assert local.up_report(state).splitlines() == [
        "kvrelay cluster: 'b' is up: head + 2 prefill + 1 decode nodes",
        "  Ray address     10.0.0.1:6379",
        "  Ray dashboard   http://127.0.0.1:8266",
        "  logs            /tmp/kc",
        (
            "  serve on it:    RAY_AUTH_MODE=token kvrelay serve --set ray.address=10.0.0.1:6379 "
            "--set prefill.resources.kvrelay_prefill=0.01 --set decode.resources.kvrelay_decode=0.01"
        ),
        "  status:         kvrelay status --dashboard http://127.0.0.1:8266",
        "  stop it:        kvrelay cluster down --name b",
    ]
