"""What every `kvrelay bench` shares: its progress line on stderr, the command line it records, how
it writes its JSON report, the note on a machine that was not idle, and the targets its figures
are judged against."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["StepLog", "Target", "command_line", "load_note", "run_and_report", "write_report"]


class StepLog:
    """`progress("message")` prints `[LABEL  12.3s] message` to stderr, seconds since creation."""

    def __init__(self, label: str, *, width: int = 6):
        self.label = label
        self.width = width
        self.start = time.monotonic()

    def __call__(self, message: str) -> None:
        elapsed = time.monotonic() - self.start
        print(f"[{self.label} {elapsed:{self.width}.1f}s] {message}", file=sys.stderr, flush=True)



@dataclass(frozen=True)
class Target:
    """A figure's target: `key` in the summary, met when it is `op` `threshold` (`unit`: "x" for a ratio)."""

    key: str
    label: str
    op: str  # ">=" or "<="
    threshold: float
    unit: str = ""  # "x" for ratios between systems

    @property
    def text(self) -> str:
        return f"{self.op} {self.threshold:g}{self.unit}"

    def met(self, value: float | None) -> bool | None:
        if value is None:
            return None
        return value >= self.threshold if self.op == ">=" else value <= self.threshold

def command_line(argv: list[str]) -> str:
    """The command a report says produced it."""
    return " ".join(["kvrelay", *argv])


def write_report(path: str | Path, report: dict, *, default: Any = None) -> Path:
    """Write a report as JSON, creating its folder. A NaN or infinity (not JSON) is written as
    null, so a figure that could not be computed never loses the others."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(report), indent=2, allow_nan=False, default=default) + "\n")
    return path


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def load_note(load_avg_1m: float | None) -> str | None:
    """A line for the table when other processes shared the CPU at the start (figures are then low)."""
    if load_avg_1m is None or load_avg_1m < 0.5:
        return None
    return f"note: 1-min load average {load_avg_1m:.2f} at start: other processes shared the CPU"


def run_and_report(args: Any, argv: list[str], params_from_args: Callable[[Any], Any], run: Callable[..., dict],
                   progress: Callable[[str], None]) -> int:
    """A bench's `run_from_args` when it has nothing of its own to add: its parameters from the
    command line, its run, and its report written to --json."""
    report = run(params_from_args(args), command=command_line(argv))
    if args.json:
        progress(f"wrote {write_report(args.json, report)}")
    return 0
