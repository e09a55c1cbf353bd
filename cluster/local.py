"""`kvrelay cluster up | down`: a multi-node Ray cluster on this machine, for development.

    kvrelay cluster up --prefill-nodes 1 --decode-nodes 1
        ray start --head --block ...            session A   GCS, dashboard          role head
        ray start --block --address HEAD ...    session B   raylet, object store    role prefill
        ray start --block --address HEAD ...    session C   raylet, object store    role decode
        state: $KVRELAY_CACHE_DIR/cluster/<name>.json   (pids, address, dashboard, temp dirs)
    kvrelay cluster down
        SIGTERM to every process of sessions C, B, A; SIGKILL what is left after `grace_s`

Every node is a separate raylet with its own object store, temp dir and ports, so KV handed from
a prefill node to a decode node crosses nodes as it would between machines. Ray gives every node
the machine's address (it resolves 127.0.0.1 to it), so nodes differ by port, not by address.

Stopping exactly what was started: each `ray start --block` runs in a session of its own, and
everything it spawns (GCS, raylet, dashboard, agents, workers - which take process groups of their
own but keep the session) stays in it. Every process also inherits `KVRELAY_DEV_CLUSTER=<id>`: a
process is signalled only when it is in a recorded session *and* carries this cluster's id, so a
recycled pid never takes down anyone else's process. `ray stop` is never used: it stops every Ray
on the machine.

Token authentication (Ray's default for local clusters) stays on: the nodes get
`RAY_AUTH_MODE=token` and the token at `~/.ray/auth_token` (created with `ray get-auth-token
--generate` when there is none), which `kvrelay serve --set ray.address=...` then finds too.
`RAY_AUTH_MODE` set in the environment is respected. A driver that joins by address must say
`RAY_AUTH_MODE=token` itself (Ray turns token auth on by itself only for `address="auto"`), so the
printed `kvrelay serve` line carries it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cluster.roles import Role, ray_start_args

__all__ = [
    "MARKER_ENV",
    "ClusterError",
    "ClusterState",
    "NodeProcess",
    "down",
    "load_state",
    "ray_start_command",
    "session_members",
    "state_path",
    "up",
    "up_report",
]

logger = logging.getLogger(__name__)

MARKER_ENV = "KVRELAY_DEV_CLUSTER"
READY_LINE = "Ray runtime started"  # what `ray start` prints once its node has joined


class ClusterError(RuntimeError):
    """The dev cluster cannot be started or stopped; the message says why and what to do."""


@dataclass(frozen=True)
class NodeProcess:
    role: Role
    pid: int  # `ray start --block`, the leader of the node's session
    temp_dir: str
    log_path: str


@dataclass
class ClusterState:
    name: str
    marker: str  # the KVRELAY_DEV_CLUSTER value every process of this cluster inherits
    address: str = ""  # the head's GCS, host:port
    dashboard_url: str = ""
    base_dir: str = ""  # holds every node's temp dir and log; removed by `down`
    auth_mode: str = "token"  # the nodes' RAY_AUTH_MODE; drivers joining by address must set it too
    nodes: list[NodeProcess] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ClusterState:
        data = json.loads(text)
        data["nodes"] = [NodeProcess(**node) for node in data.get("nodes", [])]
        return cls(**data)


def state_path(name: str) -> Path:
    base = Path(os.environ.get("KVRELAY_CACHE_DIR") or Path.home() / ".cache" / "kvrelay")
    return base / "cluster" / f"{name}.json"


def load_state(name: str) -> ClusterState | None:
    path = state_path(name)
    try:
        return ClusterState.from_json(path.read_text())
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as exc:
        raise ClusterError(f"{path}: not a kvrelay cluster state file ({exc}); remove it by hand") from exc


def ray_start_command(
    role: Role, *, ray_bin: str, temp_dir: str, num_cpus: int, object_store_bytes: int,
    agent_port: int, head_address: str | None = None, port: int | None = None,
    dashboard_port: int | None = None, client_port: int | None = None,
) -> list[str]:
    """One node's `ray start --block` command line (head: `port`, `dashboard_port`, `client_port`;
    others: `head_address`)."""
    command = [ray_bin, "start", "--block"]
    if role == "head":
        assert port and dashboard_port and client_port, "a head needs its GCS, dashboard and client ports"
        command += [
            "--head", "--port", str(port), "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
            "--dashboard-port", str(dashboard_port), "--ray-client-server-port", str(client_port),
        ]
    else:
        assert head_address, "a worker node needs the head's address"
        command += ["--address", head_address]
    command += [
        "--node-ip-address", "127.0.0.1", "--num-cpus", str(num_cpus),
        "--object-store-memory", str(object_store_bytes), "--temp-dir", temp_dir,
        "--dashboard-agent-listen-port", str(agent_port), "--min-worker-port", "0", "--max-worker-port", "0",
        "--disable-usage-stats", *ray_start_args(role),
    ]
    return command


def up(
    num_prefill_nodes: int, num_decode_nodes: int, *, name: str = "dev", num_cpus: int = 2,
    head_num_cpus: int = 2, object_store_bytes: int = 512 * 2**20, timeout_s: float = 120.0,
) -> ClusterState:
    """Start a head and the role nodes; returns the recorded state (also in `state_path(name)`)."""
    if num_prefill_nodes < 0 or num_decode_nodes < 0:
        raise ClusterError("node counts must be >= 0")
    existing = load_state(name)
    if existing is not None:
        if any(session_members(node.pid, existing.marker) for node in existing.nodes):
            raise ClusterError(
                f"cluster {name!r} is already up (head at {existing.address}); `kvrelay cluster down"
                f"{_name_flag(name)}` first, or pick another --name"
            )
        _remove(existing)  # its processes are gone: a stale record
    ray_bin = _ray_bin()
    env = _node_env()
    state = ClusterState(
        name=name, marker=env[MARKER_ENV], base_dir=tempfile.mkdtemp(prefix="kvrelay-cluster-"),
        auth_mode=env["RAY_AUTH_MODE"],
    )
    path = state_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        port, dashboard_port = _free_port(), _free_port()
        head = _spawn(state, "head", 0, env, ray_bin, {
            "num_cpus": head_num_cpus, "port": port, "dashboard_port": dashboard_port, "client_port": _free_port(),
        }, object_store_bytes)
        state.address = f"{_node_ip()}:{port}"
        state.dashboard_url = f"http://127.0.0.1:{dashboard_port}"
        path.write_text(state.to_json())
        _wait_ready(head, timeout_s)
        roles: list[tuple[Role, int]] = [("prefill", i) for i in range(num_prefill_nodes)] + [
            ("decode", i) for i in range(num_decode_nodes)
        ]
        workers = []
        for role, index in roles:
            workers.append(_spawn(state, role, index, env, ray_bin, {"num_cpus": num_cpus, "head_address": state.address}, object_store_bytes))
            path.write_text(state.to_json())  # recorded at once, so `down` finds a half-started cluster
        for node in workers:
            _wait_ready(node, timeout_s)
    except BaseException:
        _stop(state, grace_s=5.0)
        _remove(state)
        raise
    return state


def down(name: str = "dev", *, grace_s: float = 5.0) -> ClusterState:
    """Stop every process of the recorded cluster, remove its temp dirs and its state file."""
    state = load_state(name)
    if state is None:
        raise ClusterError(f"no cluster named {name!r} was started here ({state_path(name)} does not exist)")
    _stop(state, grace_s=grace_s)
    _remove(state)
    return state


def session_members(session_id: int, marker: str) -> list[int]:
    """Live processes in session `session_id` whose environment carries this cluster's marker."""
    wanted = f"{MARKER_ENV}={marker}".encode()
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            # After the command: state, ppid, pgrp, session, ...
            if fields[0] == b"Z" or int(fields[3]) != session_id:
                continue
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if wanted not in f.read().split(b"\0"):
                    continue
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile, or not ours to read
        members.append(int(entry.name))
    return members


# ---- helpers ---------------------------------------------------------------------------------
def _name_flag(name: str) -> str:
    return "" if name == "dev" else f" --name {name}"


def _ray_bin() -> str:
    beside = Path(sys.executable).parent / "ray"  # the venv's, matching this Ray
    found = str(beside) if beside.exists() else shutil.which("ray")
    if not found:
        raise ClusterError("the `ray` command was not found (install ray[serve] in this environment)")
    return found


def _node_env() -> dict[str, str]:
    from serving.config import ENV_PREFIX, NON_CONFIG_ENV

    # KVRELAY_* config overrides stay with the shell: the app's config comes from the driver
    # (`kvrelay serve` sends it whole), and the Serve controller on the head would apply them again.
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX) or k in NON_CONFIG_ENV - {MARKER_ENV}}
    env[MARKER_ENV] = uuid.uuid4().hex
    if "RAY_AUTH_MODE" not in env:
        # Ray only turns token auth on for a head by itself; joining nodes need it said.
        env["RAY_AUTH_MODE"] = "token"
    if env["RAY_AUTH_MODE"] == "token" and not _has_token(env):
        try:
            subprocess.run([_ray_bin(), "get-auth-token", "--generate"], env=env, check=True, capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as exc:
            raise ClusterError(f"could not create a Ray auth token with `ray get-auth-token --generate`: {exc}") from exc
    return env


def _has_token(env: dict[str, str]) -> bool:
    if env.get("RAY_AUTH_TOKEN"):
        return True
    path = env.get("RAY_AUTH_TOKEN_PATH")
    return Path(path).is_file() if path else (Path.home() / ".ray" / "auth_token").is_file()


def _spawn(state: ClusterState, role: Role, index: int, env, ray_bin: str, args: dict, object_store_bytes: int) -> NodeProcess:
    label = role if role == "head" else f"{role}-{index}"
    temp_dir = os.path.join(state.base_dir, label)  # short: Ray's socket paths live under it
    os.makedirs(temp_dir)
    log_path = os.path.join(state.base_dir, f"{label}.log")
    command = ray_start_command(
        role, ray_bin=ray_bin, temp_dir=temp_dir, object_store_bytes=object_store_bytes,
        agent_port=_free_port(), **args,
    )
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        # posix_spawn, not Popen: the node outlives this process, and no Popen object is left
        # to warn about a child still running.
        pid = os.posix_spawn(
            command[0], command, env, setsid=True,
            file_actions=[(os.POSIX_SPAWN_DUP2, fd, 1), (os.POSIX_SPAWN_DUP2, fd, 2),
                          (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)],
        )
    finally:
        os.close(fd)
    node = NodeProcess(role=role, pid=pid, temp_dir=temp_dir, log_path=log_path)
    state.nodes.append(node)
    logger.info("started %s node: pid %d, log %s", label, pid, log_path)
    return node


def _wait_ready(node: NodeProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = Path(node.log_path).read_text(errors="replace")
        if READY_LINE in text:
            return
        if not _alive(node.pid):
            raise ClusterError(f"the {node.role} node exited while starting; its log ({node.log_path}) ends:\n{_tail(text)}")
        time.sleep(0.2)
    raise ClusterError(f"the {node.role} node did not start within {timeout_s:.0f}s; its log ({node.log_path}) ends:\n{_tail(text)}")


def _stop(state: ClusterState, *, grace_s: float) -> None:
    # Worker nodes first, so they do not spend the grace period reconnecting to a gone head.
    sessions = [node.pid for node in reversed(state.nodes)]
    for sid in sessions:
        for pid in session_members(sid, state.marker):
            _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        _reap(state)
        if not any(session_members(sid, state.marker) for sid in sessions):
            return
        time.sleep(0.2)
    # `ray start --block` leaves the GCS and idle workers running after a SIGTERM.
    for sid in sessions:
        for pid in session_members(sid, state.marker):
            _signal(pid, signal.SIGKILL)
    time.sleep(0.2)
    _reap(state)


def _remove(state: ClusterState) -> None:
    if state.base_dir:
        shutil.rmtree(state.base_dir, ignore_errors=True)
    state_path(state.name).unlink(missing_ok=True)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _reap(state: ClusterState) -> None:
    """Collect the exit status of the nodes this process spawned itself (`up` then `down` in
    one process, as in the tests); elsewhere they are init's children."""
    for node in state.nodes:
        try:
            os.waitpid(node.pid, os.WNOHANG)
        except ChildProcessError:
            pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def _tail(text: str, num_lines: int = 15) -> str:
    return "\n".join(text.splitlines()[-num_lines:])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _node_ip() -> str:
    from ray.util import get_node_ip_address

    return get_node_ip_address()


def up_report(state: ClusterState) -> str:
    """What `kvrelay cluster up` prints: where the cluster is and how to serve on it."""
    from cluster.roles import pin_overrides

    counts = {role: sum(node.role == role for node in state.nodes) for role in ("prefill", "decode")}
    pins = " ".join(f"--set {item}" for item in pin_overrides())
    return "\n".join([
        f"kvrelay cluster: {state.name!r} is up: head + {counts['prefill']} prefill + {counts['decode']} decode nodes",
        f"  Ray address     {state.address}",
        f"  Ray dashboard   {state.dashboard_url}",
        f"  logs            {state.base_dir}",
        f"  serve on it:    RAY_AUTH_MODE={state.auth_mode} kvrelay serve --set ray.address={state.address} {pins}",
        f"  status:         kvrelay status --dashboard {state.dashboard_url}",
        f"  stop it:        kvrelay cluster down{_name_flag(state.name)}",
    ])
