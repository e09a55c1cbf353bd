"""The machine a benchmark ran on (no torch import, so clients without it can use it).

Every benchmark's JSON carries `machine_record()`: the machine kind behind the same name has been
an AMD EPYC with AVX-512 BF16, an Intel Xeon with AMX and an AMD EPYC with AVX2 only, and where
the time goes differs between them by several times (../shared/PEERS.md). So each result says
which CPU and which matrix instructions it had:

    {"cpu_model": "AMD EPYC ...", "isa": {"avx2": true, "avx512f": false, ..., "amx_int8": false},
     "num_cores": 2,           # os.cpu_count(): the machine's logical CPUs
     "nproc": 2,               # the CPUs this process may run on (what `nproc` prints)
     "num_threads": 2,         # the compute threads the benchmark used; None: it does not say
     "python": ..., "platform": ..., "torch_version": ... or None,
     "load_avg_1m_at_start": 0.1, "load_avg_1m_at_end": 0.9}   # the end one: finish_machine_record

The ISA flags come from the first `flags` line of /proc/cpuinfo (the kernel's names, which are
what `lscpu` shows); a flag the kernel does not list is False, as is every flag off Linux.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path

__all__ = ["ISA_FLAGS", "cpu_flags", "cpu_model", "finish_machine_record", "isa_features", "machine_record"]

CPUINFO = Path("/proc/cpuinfo")
# The instructions that decide a GEMM's speed here: AVX2 (fp32 FMA), AVX-512, its bf16 dot
# products (Zen 4, Cooper Lake), fp16 arithmetic and the AMX tile units (Sapphire Rapids on).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "amx_int8")


def _cpuinfo() -> str:
    try:
        return CPUINFO.read_text()
    except OSError:
        return ""


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name from /proc/cpuinfo (or the text given), else what `platform` knows."""
    for line in (_cpuinfo() if cpuinfo is None else cpuinfo).splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The first CPU's feature flags (`flags` on x86, `Features` on Arm); empty if none listed."""
    for line in (_cpuinfo() if cpuinfo is None else cpuinfo).splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def isa_features(flags: frozenset[str] | set[str]) -> dict[str, bool]:
    """{flag: present} for every flag of ISA_FLAGS, in that order."""
    return {name: name in flags for name in ISA_FLAGS}


def _nproc() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_record(*, num_threads: int | None = None, **extra) -> dict:
    """The machine now, for a benchmark's JSON; `extra` keys (versions, pinning) are added as given."""
    return {
        "cpu_model": cpu_model(),
        "isa": isa_features(cpu_flags()),
        "num_cores": os.cpu_count(),
        "nproc": _nproc(),
        "num_threads": num_threads,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_version": _version("torch"),
        "load_avg_1m_at_start": os.getloadavg()[0],
        **extra,
    }


def finish_machine_record(record: dict, **extra) -> dict:
    """Add the load average at the end of the run (and `extra`) to a machine_record; returns it."""
    record.update(load_avg_1m_at_end=os.getloadavg()[0], **extra)
    return record
