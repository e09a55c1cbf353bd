"""A Ray of a benchmark's own, for the commands that start servers (serve-overhead, routing).

Never one found in /tmp/ray (another user's): `address="local"`, files in a fresh temp dir that is
removed afterwards unless the run failed (an exception, or `keep_logs()` true at the end: its logs
are then kept and their place printed). The
object store is the one `kvrelay serve` gives a local Ray, so transfers are measured as served.
"""

from __future__ import annotations

import logging
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serving.config import ServeConfig

__all__ = ["local_ray", "free_port", "RAY_NUM_CPUS"]

RAY_NUM_CPUS = 4  # logical: the replicas ask for fractions; torch threads are set per replica


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def local_ray(command: str, progress: Callable[[str], None], *, start_serve: bool = False,
              keep_logs: Callable[[], bool] = lambda: False, config: ServeConfig | None = None) -> Iterator[None]:
    import ray
    from ray import serve

    from cluster.launcher import ray_init_kwargs
    from serving.config import ServeConfig

    if ray.is_initialized():
        raise SystemExit(f"kvrelay {command} starts its own Ray: run it in a fresh process")
    temp_dir = tempfile.mkdtemp(prefix="kvrelay-bench-")
    ray.init(
        address="local", num_cpus=RAY_NUM_CPUS, include_dashboard=False, log_to_driver=False,
        logging_level=logging.WARNING, _temp_dir=temp_dir, **ray_init_kwargs(config or ServeConfig()),
    )
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # no per-deploy INFO lines
    is_ok = False
    try:
        if start_serve:
            serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
        yield
        is_ok = True
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
        if is_ok and not keep_logs():
            shutil.rmtree(temp_dir, ignore_errors=True)
        else:
            progress(f"Ray's logs are kept in {temp_dir}")
