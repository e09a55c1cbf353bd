"""What a bench reads from, and does to, a live kvrelay app on the Ray this process is connected to.

    list_replicas(app)        every replica actor of the app, by deployment: Serve names them
                              `SERVE_REPLICA::<app>#<deployment>#<id>` in namespace "serve"
                              (ray.util.list_named_actors: no dashboard needed)
    replica_stats(replica)    a worker replica's `stats()` (serving/deployments/engine_worker.py: pid, num_free_blocks,
                              num_blocks, num_held_exports, counters), plus what its engine holds
                              right now (`live_*`, read on the replica: stats() is the snapshot
                              after the engine's latest step); an ingress gives its pid only
    kv_transfer_stats(app)    each node's KVTransfer actor's `stats()` (num_held, bytes_held, ...)
    kv_transfer_held(app)     which requests' KV each one holds, and the seconds left on each lease
                              (read on the actor, to name what a leak belongs to)
    replica_states(app)       Serve's replica states per deployment (RUNNING, STARTING, ...)
    process_rss(app)          RSS and anonymous RSS of every replica process of the app, found by
                              the title Ray gives it (`ray::ServeReplica:<app>:<deployment>`)
    kill_replica(replica)     ray.kill, no restart: Serve's controller replaces the replica
    kill_kv_transfer(app)     ray.kill with restart: Ray restarts the actor, empty

A replica's stats are read by running a function on its actor (`__ray_call__`, Ray's developer
API), which reaches the deployment's instance through Serve's replica wrapper: Serve's handles
route a call to any one replica, and the soak needs every one. The attribute path is Serve's
internals (ray 2.60); a Ray that moves it makes `replica_stats` raise ProbeError, saying so.

Every function blocks (GCS and actor round trips): call them from a thread, not an event loop.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import ray

from serving.deployments import kv_transfer

__all__ = [
    "DEPLOYMENTS", "ProbeError", "Replica", "kill_kv_transfer", "kill_replica", "kv_transfer_handle",
    "kv_transfer_held", "kv_transfer_stats", "list_replicas", "process_rss", "replica_states", "replica_stats",
]

SERVE_NAMESPACE = "serve"
REPLICA_PREFIX = "SERVE_REPLICA::"
DEPLOYMENTS = ("OpenAIIngress", "PrefillWorker", "DecodeWorker", "Worker")


class ProbeError(RuntimeError):
    """The app could not be read the way this module expects (the message says what failed)."""


@dataclass(frozen=True)
class Replica:
    deployment: str
    replica_id: str  # Serve's unique id of the replica
    actor_name: str

    def handle(self):
        return ray.get_actor(self.actor_name, namespace=SERVE_NAMESPACE)


def parse_replica_name(name: str, app: str) -> Replica | None:
    """The Replica a named actor is, if it is one of `app`'s replicas."""
    if not name.startswith(f"{REPLICA_PREFIX}{app}#"):
        return None
    parts = name[len(REPLICA_PREFIX):].split("#")
    if len(parts) != 3:
        return None
    return Replica(parts[1], parts[2], name)


def list_replicas(app: str) -> list[Replica]:
    """The app's live replica actors (a killed one drops out once Ray knows it is dead)."""
    names = ray.util.list_named_actors(all_namespaces=True)
    replicas = [parse_replica_name(n["name"], app) for n in names if n["namespace"] == SERVE_NAMESPACE]
    return sorted((r for r in replicas if r is not None), key=lambda r: (r.deployment, r.replica_id))


def _read_on_replica(replica_actor) -> dict:
    """Runs inside the replica's process (via __ray_call__)."""
    import os as _os

    impl = getattr(replica_actor, "_replica_impl", None)
    wrapper = getattr(impl, "_user_callable_wrapper", None)
    if wrapper is None:
        return {"error": "no user callable wrapper on the replica actor (Serve internals moved?)"}
    deployment = wrapper.user_callable
    if deployment is None:
        return {"pid": _os.getpid(), "ready": False}
    out: dict = {"pid": _os.getpid(), "ready": True}
    worker = getattr(deployment, "worker", None)
    if worker is None:
        return out  # the ingress
    stats = deployment.stats()  # a WorkerStats, flattened for the report
    out.update(stats.flat())
    engine = getattr(getattr(worker, "engine", None), "engine", None)  # AsyncEngine.engine: the LLMEngine
    block_manager = getattr(engine, "block_manager", None)
    if block_manager is not None:
        # Read off the step thread: exact while the engine is idle, which is when the soak reads it.
        out["live_num_free_blocks"] = block_manager.num_free_blocks
        out["live_num_held_exports"] = len(engine.held_kv)
    out["is_engine_alive"] = bool(getattr(worker.engine, "is_alive", True))
    return out


def replica_stats(replica: Replica, *, timeout_s: float = 30.0) -> dict:
    """{"pid", "ready", ...stats()...}; raises ProbeError if the replica cannot be read."""
    try:
        out = ray.get(replica.handle().__ray_call__.remote(_read_on_replica), timeout=timeout_s)
    except (ValueError, ray.exceptions.RayError) as exc:  # ValueError: no such actor (any more)
        raise ProbeError(f"could not read {replica.actor_name}: {type(exc).__name__}: {exc}") from exc
    if "error" in out:
        raise ProbeError(f"{replica.actor_name}: {out['error']}")
    return out


def _kv_transfer_actors(app: str):
    """(name, handle) of each live node's KVTransfer actor that exists."""
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        name = kv_transfer.actor_name(app, node["NodeID"])
        try:
            yield name, ray.get_actor(name, namespace=kv_transfer.NAMESPACE)
        except ValueError:
            continue  # none on this node


def _ask(name: str, ref, timeout_s: float):
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.RayError as exc:
        raise ProbeError(f"could not read {name}: {type(exc).__name__}: {exc}") from exc


def kv_transfer_stats(app: str, *, timeout_s: float = 30.0) -> dict[str, dict]:
    """actor name -> its stats(), for each node's KVTransfer actor that exists."""
    return {name: dataclasses.asdict(_ask(name, actor.stats.remote(), timeout_s)) for name, actor in _kv_transfer_actors(app)}


def _held_on_actor(actor) -> dict:
    """Runs inside the KVTransfer actor (via __ray_call__)."""
    import time as _time

    now = _time.monotonic()
    return {request_id: {"num_bytes": entry[1], "lease_left_s": entry[2] - now}
            for request_id, entry in getattr(actor, "_held", {}).items()}


def kv_transfer_held(app: str, *, timeout_s: float = 30.0) -> dict[str, dict]:
    """actor name -> {request id: {"num_bytes", "lease_left_s"}} of the KV it holds."""
    return {name: _ask(name, actor.__ray_call__.remote(_held_on_actor), timeout_s) for name, actor in _kv_transfer_actors(app)}


def kv_transfer_handle(app: str, node_id: str | None = None):
    node_id = node_id or ray.get_runtime_context().get_node_id()
    return ray.get_actor(kv_transfer.actor_name(app, node_id), namespace=kv_transfer.NAMESPACE)


def replica_states(app: str) -> dict[str, dict[str, int]]:
    from ray import serve

    application = serve.status().applications.get(app)
    if application is None:
        return {}
    return {name: {str(state): n for state, n in d.replica_states.items()} for name, d in application.deployments.items()}


def process_rss(app: str) -> dict[int, tuple[str, int, int]]:
    """pid -> (deployment, RSS bytes, anonymous RSS bytes) of the app's replica processes.

    Anonymous RSS leaves out file-backed and shared pages: the model's weights mapped from disk
    and the object store's shared memory that a decode replica touches when it imports KV."""
    import psutil

    title = f"ray::ServeReplica:{app}:"
    out = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if not cmdline or not cmdline[0].startswith(title):
            continue
        try:
            memory = proc.memory_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        deployment = cmdline[0][len(title):].split()[0].split(".")[0]
        out[proc.info["pid"]] = (deployment, memory.rss, memory.rss - memory.shared)
    return out


def kill_replica(replica: Replica) -> None:
    """Kill the replica's process now (as a crash would); Serve starts a replacement."""
    ray.kill(replica.handle(), no_restart=True)


def kill_kv_transfer(app: str, node_id: str | None = None) -> str:
    """Kill this node's KVTransfer actor; Ray restarts it (max_restarts=-1). Returns its name."""
    actor = kv_transfer_handle(app, node_id)
    ray.kill(actor, no_restart=False)
    return kv_transfer.actor_name(app, node_id or ray.get_runtime_context().get_node_id())

