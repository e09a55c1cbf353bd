"""Native CPU kernels, compiled on first use with the system C++ compiler and cached.

`paged_decode_attention` reads K/V straight from the paged cache through block tables;
`add_rms_norm`, `rope_cache_write` and `silu_mul` fuse the per-layer glue of a step, which is most
of a small batch's time on CPU when each is several PyTorch ops; `small_m_linear` is a
few-row matrix product in bf16 or fp32 (see csrc/kernels.cpp, and linear_choice.py for when it runs).

The build uses `-march=native`, so it is cached per torch version and CPU instruction-set
family, in `$KVRELAY_CACHE_DIR/torch_extensions/torch-<version>-<cpu key>/`.

Which path runs is never silent. `kernel_status()` says `native` or `pytorch` and why, and the
engine puts it in its start-up log line, its stats and so in `kvrelay status`:

    native    loaded from the cache | built in N s
    pytorch   KVRELAY_DISABLE_NATIVE=1 | the build failed: <error> | the device is not a CPU

Several processes may build into one empty cache at once (replicas starting together on a fresh
machine). They queue on an `flock` beside the build directory, so one builds and the others load
its result. The kernel drops an `flock` when its holder dies, so a build killed half-way leaves no
lock behind; the next holder also removes the lock file torch's own builder leaves in that case
(torch would wait on it forever), and ninja finishes what the dead build started.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import hashlib
import logging
import os
import platform
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from serving.engine.modeling.loader import cache_dir

__all__ = ["DISABLE_ENV", "KernelPath", "KernelStatus", "build_dir", "kernel_status", "native_kernels"]

logger = logging.getLogger(__name__)

DISABLE_ENV = "KVRELAY_DISABLE_NATIVE"
_NAME = "kvrelay_kernels"
_SOURCE = Path(__file__).parent / "csrc" / "kernels.cpp"


class KernelPath(str, enum.Enum):
    NATIVE = "native"
    PYTORCH = "pytorch"


@dataclass(frozen=True)
class KernelStatus:
    path: KernelPath
    reason: str  # why this path: how the native module was had, or why it was not

    def __str__(self) -> str:
        return f"{self.path.value} ({self.reason})"


_lock = threading.Lock()
_module = None
_status: KernelStatus | None = None


def _cpu_key() -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:12]


def build_dir() -> Path:
    """Where this torch version's build for this CPU's instruction sets lives."""
    return cache_dir() / "torch_extensions" / f"torch-{torch.__version__}-{_cpu_key()}"


@contextlib.contextmanager
def _ninja_on_path():
    """The `ninja` wheel installs next to this interpreter, which need not be on PATH (a venv used
    without activating it); PATH is put back afterwards."""
    saved = os.environ.get("PATH")
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in (saved or "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + (saved or "")
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = saved


def _build_or_load() -> tuple[object, str]:
    from torch.utils.cpp_extension import load

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with _ninja_on_path(), open(directory.parent / f"{directory.name}.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)  # released by close, or by the kernel if we die
        try:
            # Holding the flock, nobody else builds here: a baton file torch left is from a
            # build that died, and torch's `load` would wait for it to vanish forever.
            (directory / "lock").unlink(missing_ok=True)
            cached = (directory / f"{_NAME}.so").exists()
            started = time.monotonic()
            module = load(
                name=_NAME,
                sources=[str(_SOURCE)],
                # -march=native: a build is only valid on CPUs with the same instruction sets.
                # -fno-associative-math: sums in the order written. Under -ffast-math alone, GCC
                # reassociated a 1x1 and a 2x4 dot tile's sums differently on one Xeon with AMX
                # (2026-12-02), and the scoring path's logprobs too, so a row alone differed in its
                # last bit from the same row among others (batch invariance; a function attribute on
                # the tile fixed the tiles but not the scoring path).
                extra_cflags=["-O3", "-march=native", "-ffast-math", "-fno-associative-math", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                verbose=False,
            )
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
    if cached:
        return module, f"loaded from the cache {directory}"
    return module, f"built in {time.monotonic() - started:.0f} s into {directory}"


def kernel_status() -> KernelStatus:
    """Which kernel path this process runs on the CPU, and why (builds or loads the first time)."""
    native_kernels()
    assert _status is not None
    return _status


def native_kernels():
    """The compiled extension module, or None when the PyTorch path runs (kernel_status says why)."""
    global _module, _status
    if _status is not None:
        return _module
    with _lock:
        if _status is not None:
            return _module
        if os.environ.get(DISABLE_ENV) == "1":
            status = KernelStatus(KernelPath.PYTORCH, f"{DISABLE_ENV}=1")
        else:
            try:
                _module, reason = _build_or_load()
                status = KernelStatus(KernelPath.NATIVE, reason)
            except Exception as exc:  # no compiler, no headers: run without the kernels
                first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                status = KernelStatus(KernelPath.PYTORCH, f"the native build failed: {first_line}")
                logger.warning("native CPU kernels unavailable, using the PyTorch path: %s", exc)
        _status = status
    return _module
