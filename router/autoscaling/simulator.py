"""`kvrelay policy simulate`: replay a metric trace through one pool's autoscaling decision.

A trace is a CSV file: `time_s` (seconds, increasing) and any of these columns:

    queued_prefill_tokens   the pool's total; each simulated replica gets an even share
    num_seqs                the pool's total (running + waiting); shared the same way
    kv_utilization          per replica, as it is (no model of how it moves with the count)
    ttft_p95_ms             per replica, as it is
    tpot_p95_ms             per replica, as it is
    age_s                   optional: how old the newest sample is at time_s (default 0)

An empty cell is a missing sample. Every row is one decision (`router.autoscaling.decide.decide`) on
the count chosen at the previous row, starting from min_replicas; new replicas take load at once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from router.autoscaling.decide import SIGNALS, Observation, ReplicaSignals, ScaleState, decide, signal_name
from router.autoscaling.policy import PoolPolicy
from router.autoscaling.trace_csv import TraceError, read_csv, trace_number

__all__ = ["TraceError", "TraceRow", "SimStep", "read_trace", "simulate", "POOL_TOTALS"]

POOL_TOTALS = ("num_queued_prefill_tokens", "num_seqs")  # signals whose columns are the pool's total
_COLUMNS = ("time_s", *map(signal_name, SIGNALS), "age_s")  # as users know them (SIGNAL_NAMES)


@dataclass(frozen=True)
class TraceRow:
    time_s: float
    values: dict[str, float | None]  # signal -> value (pool total or per replica, see above)
    age_s: float = 0.0


@dataclass(frozen=True)
class SimStep:
    time_s: float
    num_replicas: int
    reason: str


def read_trace(path: str | os.PathLike, required: tuple[str, ...] = ()) -> list[TraceRow]:
    """Parse a trace; `required` signals must have a column (their cells may still be empty)."""
    header, lines = read_csv(path, "trace")
    unknown = [name for name in header if name not in _COLUMNS]
    if unknown:
        raise TraceError(f"{path}: unknown column {unknown[0]!r} (allowed: {', '.join(_COLUMNS)})")
    for name in ("time_s", *map(signal_name, required)):
        if name not in header:
            raise TraceError(f"{path}: no {name} column (the policy needs it; columns: {', '.join(header)})")
    rows: list[TraceRow] = []
    for number, cells in enumerate(lines, start=2):  # line 1 is the header
        values = {name: trace_number(path, number, name, cell) if cell else None for name, cell in cells.items()}
        time_s = values.pop("time_s")
        if time_s is None:
            raise TraceError(f"{path}:{number}: time_s is empty")
        if rows and time_s <= rows[-1].time_s:
            raise TraceError(f"{path}:{number}: time_s = {time_s:g} is not after {rows[-1].time_s:g}")
        age_s = values.pop("age_s", None) or 0.0
        rows.append(TraceRow(time_s, {s: values.get(signal_name(s)) for s in SIGNALS}, age_s))
    return rows


def simulate(policy: PoolPolicy, rows: list[TraceRow]) -> list[SimStep]:
    num_replicas = policy.min_replicas
    state = ScaleState()
    steps = []
    for row in rows:
        shares = {
            s: (v / num_replicas if s in POOL_TOTALS and v is not None else v) for s, v in row.values.items()
        }
        replica = ReplicaSignals(updated_at_s=row.time_s - row.age_s, **shares)
        observation = Observation(num_replicas, (replica,) * num_replicas)
        num_replicas, state, reason = decide(policy, observation, state, row.time_s)
        steps.append(SimStep(row.time_s, num_replicas, reason))
    return steps
