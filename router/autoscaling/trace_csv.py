"""The one reader of the autoscaling CSV traces (`kvrelay policy simulate`'s metric traces,
router/autoscaling/simulator.py, and the planner's workload traces, router/autoscaling/workload.py)
and their one error, TraceError, whose message names the file, line, column and value."""

from __future__ import annotations

import csv
import math
import os

__all__ = ["TraceError", "read_csv", "trace_number"]


class TraceError(ValueError):
    """A trace file is invalid; the message names the file, line, column and value."""


def read_csv(path: str | os.PathLike, what: str) -> tuple[list[str], list[dict[str, str]]]:
    """The header (names stripped) and the rows, each {column: cell stripped} (line 2 is rows[0])."""
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            header = [name.strip() for name in reader.fieldnames or []]
            lines = list(reader)
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the {what} ({exc.strerror})") from exc
    rows = [{name.strip(): (value or "").strip() for name, value in raw.items() if name is not None} for raw in lines]
    return header, rows


def trace_number(path: str | os.PathLike, line: int, column: str, cell: str) -> float:
    """A cell as a finite number >= 0."""
    try:
        value = float(cell)
    except ValueError:
        raise TraceError(f"{path}:{line}: {column} = {cell!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise TraceError(f"{path}:{line}: {column} = {cell!r} (allowed: a finite number >= 0)")
    return value
