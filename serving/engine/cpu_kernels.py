"""Native CPU kernels, compiled on first use with the system C++ compiler and cached.

`paged_decode_attention` reads K/V straight from the paged cache through block tables;
`add_rms_norm`, `rope_cache_write` and `silu_mul` fuse the per-layer glue of a step, which is most
of a small batch's time on CPU when each is several PyTorch ops; `small_m_linear` is a bf16 GEMV
for small batches (see csrc/kernels.cpp).

The build uses `-march=native`, so it is cached per torch version and CPU instruction-set
family, in `$KVRELAY_CACHE_DIR/torch_extensions`. Without a compiler the engine falls back to
the plain PyTorch path (same results, slower) and says so once in the log.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
from pathlib import Path

import torch

from serving.engine.model_loader import cache_dir

__all__ = ["native_kernels"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_module = None
_failed = False


def _cpu_key() -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:12]


def native_kernels():
    """The compiled extension module, or None when it cannot be built here."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    if os.environ.get("KVRELAY_DISABLE_NATIVE") == "1":
        _failed = True
        return None
    with _lock:
        if _module is None and not _failed:
            try:
                from torch.utils.cpp_extension import load

                # The `ninja` wheel installs next to this interpreter, which need not be on PATH
                # (a venv used without activating it).
                bin_dir = os.path.dirname(sys.executable)
                if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
                    os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")

                # -march=native: a build is only valid on CPUs with the same instruction sets.
                build_dir = cache_dir() / "torch_extensions" / f"torch-{torch.__version__}-{_cpu_key()}"
                build_dir.mkdir(parents=True, exist_ok=True)
                source = Path(__file__).parent / "csrc" / "kernels.cpp"
                _module = load(
                    name="kvrelay_kernels",
                    sources=[str(source)],
                    extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(build_dir),
                    verbose=False,
                )
            except Exception as exc:  # no compiler, no headers: run without the kernel
                _failed = True
                logger.warning("native CPU kernels unavailable, using the PyTorch path: %s", exc)
    return _module
