"""Which kernel path runs, and why, is never silent; builds into one empty cache are safe together."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest

from serving.engine.modeling import cpu_kernels
from serving.engine.modeling.cpu_kernels import DISABLE_ENV, KernelPath, KernelStatus, build_dir, kernel_status
from tests.helpers import REPO
from tests.kernel_paths import native_kernels_or_skip


@pytest.fixture
def fresh_process(monkeypatch):
    """cpu_kernels as a new process finds it (nothing loaded, nothing decided); put back after."""
    monkeypatch.setattr(cpu_kernels, "_module", None)
    monkeypatch.setattr(cpu_kernels, "_status", None)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    return monkeypatch


def test_disabled_by_the_environment_says_so(fresh_process):
    fresh_process.setenv(DISABLE_ENV, "1")
    assert cpu_kernels.native_kernels() is None
    assert kernel_status() == KernelStatus(KernelPath.PYTORCH, "KVRELAY_DISABLE_NATIVE=1")
    assert str(kernel_status()) == "pytorch (KVRELAY_DISABLE_NATIVE=1)"


def test_a_failed_build_says_why(fresh_process, caplog):
    def no_compiler():
        raise RuntimeError("Error building extension 'kvrelay_kernels': c++: not found\nninja: build stopped")

    fresh_process.setattr(cpu_kernels, "_build_or_load", no_compiler)
    with caplog.at_level(logging.WARNING, logger="serving.engine.modeling.cpu_kernels"):
        assert cpu_kernels.native_kernels() is None
    assert kernel_status() == KernelStatus(
        KernelPath.PYTORCH, "the native build failed: Error building extension 'kvrelay_kernels': c++: not found",
    )
    assert "native CPU kernels unavailable, using the PyTorch path" in caplog.text


def test_ci_machines_run_the_native_kernels():
    """CI has a compiler: the native path must be what its tests exercise, not a fallback."""
    if not os.environ.get("CI"):
        pytest.skip("only CI promises a C++ compiler")
    assert kernel_status().path is KernelPath.NATIVE, kernel_status().reason


def test_the_engine_reports_its_kernel_path(fresh_process, tiny_model_dir, caplog):
    from serving.engine import EngineConfig, LLMEngine

    fresh_process.setenv(DISABLE_ENV, "1")
    with caplog.at_level(logging.INFO, logger="serving.engine.setup"):
        engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_bytes=2**20))
    stats = engine.stats()
    assert (stats.kernel_path, stats.kernel_reason) == ("pytorch", "KVRELAY_DISABLE_NATIVE=1")
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded ")]
    assert line.endswith("; kernels: pytorch (KVRELAY_DISABLE_NATIVE=1); deterministic: off: the native CPU kernels "
                         "are not loaded (kvrelay status says why)"), line
    assert stats.deterministic == "off: the native CPU kernels are not loaded (kvrelay status says why)"


_BUILD = """
import json, os, sys, time
from pathlib import Path
go = Path(sys.argv[1])
while not go.exists():
    time.sleep(0.01)
from serving.engine.modeling.cpu_kernels import kernel_status
status = kernel_status()
print(json.dumps({"path": status.path.value, "reason": status.reason}))
"""


@pytest.mark.slow
def test_replicas_building_into_one_empty_cache_at_once_all_get_the_kernels(tmp_path, monkeypatch):
    """Three processes start building together into an empty cache that also holds the lock file
    of a build that died half-way (torch waits on such a file forever): all get the native kernels,
    one builds and the others load its build."""
    native_kernels_or_skip()
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(cache))
    target = build_dir()
    target.mkdir(parents=True)
    (target / "lock").touch()  # what torch's FileBaton leaves when its builder is killed

    go = tmp_path / "go"
    env = {**os.environ, "KVRELAY_CACHE_DIR": str(cache)}
    env.pop(DISABLE_ENV, None)
    procs = [
        subprocess.Popen([sys.executable, "-c", _BUILD, str(go)], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    time.sleep(1.0)  # all three waiting at the start line
    go.touch()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))

    assert [r["path"] for r in results] == ["native"] * 3
    built = [r["reason"] for r in results if r["reason"].startswith("built in ")]
    assert len(built) == 1 and built[0].endswith(f" s into {target}"), results
    assert sorted(r["reason"] for r in results if r["reason"] not in built) == [f"loaded from the cache {target}"] * 2
    assert not (target / "lock").exists()


def test_native_kernels_let_other_python_threads_run():
    """A kernel runs without the GIL: while one thread is inside one long small_m_linear call,
    another keeps running Python. With the GIL held through the call, no bytecode of the other
    thread could run between the call's start and its end."""
    import threading

    import torch

    kernels = native_kernels_or_skip()
    x, w = torch.randn(64, 2048), torch.randn(8192, 2048)
    kernels.small_m_linear(x, w, None)  # the first call's setup is not a call's own time
    for _ in range(8):  # rows until one call takes long enough to tell, whatever the CPU
        started = time.perf_counter()
        kernels.small_m_linear(x, w, None)
        if time.perf_counter() - started > 0.1:
            break
        x = torch.cat([x, x])
    span: list[float] = []
    done = threading.Event()

    def call():
        span.append(time.perf_counter())
        kernels.small_m_linear(x, w, None)
        span.append(time.perf_counter())
        done.set()

    ticks: list[float] = []
    thread = threading.Thread(target=call)
    thread.start()
    while not done.is_set():
        ticks.append(time.perf_counter())
        time.sleep(0)
    thread.join()
    start, end = span
    margin = 0.01  # the few bytecodes between a timestamp and the call, and a GIL switch interval (5 ms)
    assert end - start > 4 * margin, "the call was too short to tell"
    inside = [t for t in ticks if start + margin < t < end - margin]
    assert len(inside) > 10
