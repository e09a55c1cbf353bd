"""Which of the engine's CPU kernel paths this session's tests ran, and which went untested here.

A kernel test of a path this CPU lacks skips (the packed bf16 kernels need AVX512-BF16); that is
legitimate on such a CPU, but the log must say that the path went untested. A test asks for its
path through `native_kernels_or_skip`, which records the path as ran or as untested (with why);
tests/conftest.py prints the tally as one line of the terminal summary:

    kernel paths: ran ['native']; untested on this CPU: ['packed-bf16' (this CPU has no AVX512-BF16)]
"""

from __future__ import annotations

import pytest

__all__ = ["KERNEL_PATHS", "native_kernels_or_skip", "record", "summary_line"]

KERNEL_PATHS = {
    "native": "the native CPU kernels (serving/engine/modeling/csrc), AVX2 and up",
    "packed-bf16": "packed_linear and lora_segmented_packed, which need AVX512-BF16",
}
_ran: set[str] = set()
_untested: dict[str, str] = {}  # path -> why it was not available here


def record(path: str, why_untested: str | None = None) -> None:
    """Note that a test ran `path`, or (with `why_untested`) that it could not."""
    assert path in KERNEL_PATHS, path
    if why_untested is None:
        _ran.add(path)
    else:
        _untested.setdefault(path, why_untested)


def native_kernels_or_skip(packed: bool = False):
    """The loaded native kernels module, for a test of the native path (and of the packed bf16
    kernels with `packed`); skips, recording the path as untested, where this machine lacks it."""
    from serving.engine.modeling.cpu_kernels import kernel_status, native_kernels

    kernels = native_kernels()
    if kernels is None:
        record("native", str(kernel_status()))
        pytest.skip(f"kernel path 'native' untested here: no native kernels ({kernel_status()})")
    record("native")
    if packed:
        if not kernels.has_packed_linear():
            record("packed-bf16", "this CPU has no AVX512-BF16")
            pytest.skip("kernel path 'packed-bf16' untested here: packed_linear needs AVX512-BF16")
        record("packed-bf16")
    return kernels


def summary_line(ran: set[str] | None = None, untested: dict[str, str] | None = None) -> str | None:
    """The summary's line, or None when no test asked for a kernel path."""
    ran = _ran if ran is None else ran
    untested = _untested if untested is None else untested
    if not ran and not untested:
        return None
    missing = ", ".join(f"{path!r} ({why})" for path, why in sorted(untested.items()) if path not in ran)
    return f"kernel paths: ran {sorted(ran)}; untested on this CPU: [{missing}]"
