"""`kvrelay serve`: start (or join) Ray, deploy the app, print where it is, run until stopped.

Stops exactly what it started: the app, its KVTransfer actors, and Ray itself only if this
process started it.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import sys
import threading
import time

from serving.config import ServeConfig

__all__ = ["serve_forever", "start", "stop", "required_cpus", "ray_init_kwargs", "dashboard_url"]

logger = logging.getLogger(__name__)


def required_cpus(config: ServeConfig) -> float:
    """Ray logical CPUs for every replica the app may run (autoscaled pools at their maximum)."""
    from router.autoscaling.policy import load_policy

    policy = load_policy(config.autoscaling_policy) if config.autoscaling_policy else None
    names = ["worker"] if config.mode == "colocated" else ["prefill", "decode"]
    workers = 0.0
    for name in names:
        pool = config.pools[name]
        pool_policy = policy.pool(name) if policy is not None else None
        replicas = pool_policy.max_replicas if pool_policy is not None else pool.num_replicas
        workers += pool.num_cpus * replicas
    return workers + config.ingress.num_cpus * config.ingress.num_replicas


# Serve's controller kills a proxy not ready within RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S (Ray's
# default: 5 s) and `serve.start` then fails on the dead proxy. A proxy's start (a new process and
# its imports) takes longer than that on a busy two-core machine, so a Ray kvrelay starts waits
# this long; a value in the environment wins.
PROXY_READY_CHECK_TIMEOUT_S = 30
# On the gRPC transport Serve's proxy reads each of the ingress's responses as one gRPC message, at
# most RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH of its own environment (Ray's default: 4 MiB, so
# a non-streamed completion with logprobs over 4 MiB was a 500). Responses come from kvrelay's own
# ingress: the proxy takes any gRPC can carry. A replica's bound, on the requests it takes, is
# its app's (serving/deployments/app.py, in its runtime env).
PROXY_MAX_RESPONSE_BYTES = 2**31 - 1


def ray_init_kwargs(config: ServeConfig) -> dict:
    """Object-store and Serve-proxy settings (transport, ready-check time, response size) for a
    Ray this process starts (the raylet reads the env at start, and the processes it starts
    inherit it)."""
    if config.ray.preallocate_object_store:
        os.environ["RAY_preallocate_plasma_memory"] = "1"
    # Serve's proxy reaches the ingress over gRPC (ray.grpc_transport; the ingress's handles to
    # the workers: serving/deployments/replicas.py).
    os.environ["RAY_SERVE_PROXY_USE_GRPC"] = "1" if config.ray.grpc_transport else "0"
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", str(PROXY_READY_CHECK_TIMEOUT_S))
    os.environ.setdefault("RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH", str(PROXY_MAX_RESPONSE_BYTES))
    return {"object_store_memory": config.ray.object_store_bytes} if config.ray.object_store_bytes else {}


_PICK_ANOTHER_PORT = "pick another port with KVRELAY_HTTP__PORT=... or http.port in the config file."


def _check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise SystemExit(
                f"kvrelay: {host}:{port} is already in use ({exc.strerror}). Is kvrelay already "
                f"running? Stop it, or {_PICK_ANOTHER_PORT}"
            ) from None


def start(config: ServeConfig, *, declarative: bool = False) -> bool:
    """Deploy the app and wait until it runs; returns whether this call started Ray.

    `declarative` deploys through the Ray dashboard's REST API (the `serve deploy` way), so the
    dashboard holds the config and `kvrelay scale` / `kvrelay policy apply` can change it later;
    otherwise `serve.run` from this process (tests, benchmarks).
    """
    import ray
    from ray import serve

    from serving.deployments.app import build_app

    started_ray = False
    context = None
    if not ray.is_initialized():
        if config.ray.address:
            context = ray.init(address=config.ray.address, logging_level=logging.WARNING)
        else:
            _check_port_free(config.http.host, config.http.port)
            num_cpus = config.ray.num_cpus or max(os.cpu_count() or 1, math.ceil(required_cpus(config)))
            context = ray.init(
                num_cpus=num_cpus, include_dashboard=True, dashboard_host=config.ray.dashboard_host,
                dashboard_port=config.ray.dashboard_port, logging_level=logging.WARNING,
                **ray_init_kwargs(config),
            )
            started_ray = True
    if declarative:
        from cluster.dashboard import DashboardClient, OpsError, serve_deploy_config, wait_until_running

        dashboard = dashboard_url(context)
        client = DashboardClient(dashboard)
        try:
            try:
                client.put_applications(serve_deploy_config(config))
            except OpsError as exc:
                if "Failed to bind to address" not in str(exc):
                    raise
                # free when checked at start (_check_port_free), taken before Serve's proxy bound it
                raise OpsError(f"{config.http.host}:{config.http.port} is in use by another process (taken while "
                               f"Ray started). Stop it, or {_PICK_ANOTHER_PORT}") from exc
            wait_until_running(client, config.app_name)
        finally:
            client.close()
        return started_ray
    serve.start(http_options={"host": config.http.host, "port": config.http.port})
    serve.run(build_app(config), name=config.app_name, route_prefix="/", blocking=False)
    return started_ray


def dashboard_url(context=None) -> str:
    import ray

    url = None
    if context is not None:
        url = getattr(context, "dashboard_url", None)
    if not url:
        url = ray._private.worker.global_worker.node.address_info.get("webui_url")
    if not url:
        raise RuntimeError("this Ray cluster has no dashboard; start it with the dashboard to operate kvrelay")
    return url if url.startswith("http") else f"http://{url}"


def stop(config: ServeConfig, *, stop_ray: bool) -> None:
    import ray
    from ray import serve

    from serving.deployments import kv_transfer

    try:
        serve.delete(config.app_name)
        kv_transfer.kill_all(config.app_name)
        if stop_ray:
            serve.shutdown()
    finally:
        if stop_ray:
            ray.shutdown()


def serve_forever(config: ServeConfig) -> int:
    from cluster.dashboard import OpsError

    t0 = time.monotonic()
    print(f"kvrelay: starting {config.mode} serving of {config.model} ...", flush=True)
    try:
        started_ray = start(config, declarative=True)
    except OpsError as exc:  # the deploy was refused: say why, not a traceback (a Ray started here ends with us)
        print(f"kvrelay serve: {exc}", file=sys.stderr, flush=True)
        return 1
    host = "127.0.0.1" if config.http.host in ("0.0.0.0", "::") else config.http.host
    dashboard = dashboard_url()
    print(
        f"kvrelay: ready in {time.monotonic() - t0:.1f}s\n"
        f"  OpenAI API      http://{host}:{config.http.port}/v1   (model: {config.model_name})\n"
        f"  health          http://{host}:{config.http.port}/health\n"
        f"  metrics         http://{host}:{config.http.port}/metrics   (Prometheus; see README 'Metrics')\n"
        f"  Ray dashboard   {dashboard}\n"
        f"  try:  kvrelay chat \"Hello!\" --url http://{host}:{config.http.port}\n"
        "Press Ctrl-C to stop.",
        flush=True,
    )
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    stopped.wait()
    print("kvrelay: stopping ...", flush=True)
    stop(config, stop_ray=started_ray)
    return 0
