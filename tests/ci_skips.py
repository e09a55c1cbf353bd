"""Which skips CI accepts, and the bookkeeping tests/conftest.py does with them.

CI (`CI` set) must run every test; a skip there hides a test that no one then runs. So under CI
a skip fails the run unless its reason matches an entry of `ALLOWED_SKIPS`, each with why the
skip is legitimate on a CI machine. Outside CI skips are only reported.

    test or module skipped --> reason --> matches ALLOWED_SKIPS? --yes--> listed as allowed
                                                                 --no---> under CI: exit status 1,
                                                                          each one named
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

__all__ = ["ALLOWED_SKIPS", "AllowedSkip", "Skip", "SkipGate", "skip_of", "unexpected"]


@dataclass(frozen=True)
class AllowedSkip:
    reason: str  # a regular expression searched in the skip's reason
    why: str  # why CI may skip it


ALLOWED_SKIPS = [
    AllowedSkip(r"^needs CUDA$", "CI machines have no GPU (load_tests/gpu_check.sh runs the gpu tests on one)"),
    AllowedSkip(r"the optional Gemma 3 270M checkpoint is not installed",
                "a third-party checkpoint under the Gemma terms, installed only by `make gemma3`, never by `make test`"),
    AllowedSkip(r"AVX512-BF16", "a CPU feature: the kernel paths line of the summary names what went untested on this CPU"),
    AllowedSkip(r"^needs 2 cores$", "a one-core machine cannot pin two engines apart"),
    AllowedSkip(r"^the probe pins engines to cores 0 and 1$", "a machine whose affinity mask leaves out core 0 or 1"),
]


@dataclass(frozen=True)
class Skip:
    nodeid: str
    reason: str


def skip_of(report) -> Skip | None:
    """The skip a test or collection report records, or None (not skipped, or an xfail)."""
    if not report.skipped or hasattr(report, "wasxfail"):
        return None
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return Skip(report.nodeid, reason.removeprefix("Skipped: "))


def unexpected(skips: list[Skip], allowed: list[AllowedSkip] = ALLOWED_SKIPS) -> list[Skip]:
    """The skips no entry of `allowed` accepts."""
    return [s for s in skips if not any(re.search(a.reason, s.reason) for a in allowed)]


class SkipGate:
    """The pytest plugin (tests/conftest.py registers it): notes every skip, of a test or of a
    whole module; under CI (`ci`) a skip no entry of `allowed` accepts fails a session that
    passed, and the summary names each one on a FAILED line (what `make test` repeats last)."""

    def __init__(self, ci: bool, allowed: list[AllowedSkip] = ALLOWED_SKIPS):
        self.ci = ci
        self.allowed = allowed
        self.skips: list[Skip] = []

    def _note(self, report) -> None:
        skip = skip_of(report)
        if skip is not None and skip not in self.skips:
            self.skips.append(skip)

    def pytest_runtest_logreport(self, report) -> None:
        self._note(report)

    def pytest_collectreport(self, report) -> None:
        self._note(report)

    def pytest_sessionfinish(self, session) -> None:
        passed = session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
        if self.ci and passed and unexpected(self.skips, self.allowed):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        refused = unexpected(self.skips, self.allowed) if self.ci else []
        if not refused:
            return
        terminalreporter.section("skips CI does not allow (tests/ci_skips.py lists those it does)", sep="=", red=True)
        for skip in refused:
            terminalreporter.write_line(f"FAILED {skip.nodeid} - skipped under CI: {skip.reason}")
