"""Whole-workload traces for `kvrelay policy simulate --workload`: request rate, prompt and output
lengths over time, built in or read from a CSV, turned into seeded requests.

A trace is piecewise constant: segments of (start_s, requests_per_s, prompt_tokens,
output_tokens), each lasting until the next; `end_s` closes the last. Requests arrive as a Poisson
process of the segment's rate (exact across segments: exponential gaps are memoryless), and each
draws its prompt and output lengths uniformly from [0.5, 1.5] x the segment's mean (a coefficient
of variation of 0.29), all from one seeded random.Random.

Built-in traces, one hour each, minute-long segments (`builtin_trace`):

    steady    2 req/s, 256-token prompts, 64 output tokens
    ramp      0.25 -> 4 req/s over 40 minutes, then 4 req/s
    diurnal   a compressed day: 0.4 .. 3.6 req/s, prompts longer by day (128 .. 384 tokens) and
              outputs shorter (96 .. 32): the prefill:decode mix shifts with the hour
    burst     1 req/s, and every 10 minutes (from minute 5) 2 minutes of 5 req/s with 384-token prompts

CSV: a header `time_s,requests_per_s,prompt_tokens,output_tokens`, one row per segment start,
times increasing; the last row marks the end (its other cells may be empty).
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass

from router.autoscaling.trace_csv import TraceError, read_csv, trace_number

__all__ = ["Segment", "WorkloadTrace", "Request", "TraceError", "BUILTIN_TRACES", "builtin_trace",
           "read_workload", "generate_requests"]

BUILTIN_TRACES = ("steady", "ramp", "diurnal", "burst")
_COLUMNS = ("time_s", "requests_per_s", "prompt_tokens", "output_tokens")


@dataclass(frozen=True)
class Segment:
    start_s: float
    requests_per_s: float
    prompt_tokens: float  # mean per request
    output_tokens: float  # mean per request (the first comes from prefill)


@dataclass(frozen=True)
class WorkloadTrace:
    name: str
    segments: tuple[Segment, ...]
    end_s: float


@dataclass(frozen=True)
class Request:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def builtin_trace(name: str, duration_s: float = 3600.0, segment_s: float = 60.0) -> WorkloadTrace:
    if name not in BUILTIN_TRACES:
        raise TraceError(f"unknown workload {name!r} (allowed: {', '.join(BUILTIN_TRACES)})")
    segments = []
    for i in range(math.ceil(duration_s / segment_s)):
        t = i * segment_s
        phase = 2 * math.pi * t / duration_s
        if name == "steady":
            segments.append(Segment(t, 2.0, 256, 64))
        elif name == "ramp":
            segments.append(Segment(t, 0.25 + 3.75 * min(1.0, t / (duration_s * 2 / 3)), 256, 64))
        elif name == "diurnal":  # night at t = 0, noon at duration / 2
            day = (1 - math.cos(phase)) / 2  # 0 .. 1 .. 0
            segments.append(Segment(t, 0.4 + 3.2 * day, 128 + 256 * day, 96 - 64 * day))
        else:
            in_burst = 300 <= t % 600 < 420
            if in_burst:
                segments.append(Segment(t, 5.0, 384, 64))
            else:
                segments.append(Segment(t, 1.0, 256, 64))
    return WorkloadTrace(name, _merge(segments), duration_s)


def _merge(segments: list[Segment]) -> tuple[Segment, ...]:
    """Adjacent segments with the same figures as one."""
    merged: list[Segment] = []
    for seg in segments:
        if merged and (merged[-1].requests_per_s, merged[-1].prompt_tokens, merged[-1].output_tokens) == (
            seg.requests_per_s, seg.prompt_tokens, seg.output_tokens
        ):
            continue
        merged.append(seg)
    return tuple(merged)


def read_workload(path: str | os.PathLike) -> WorkloadTrace:
    header, lines = read_csv(path, "workload trace")
    if header != list(_COLUMNS):
        raise TraceError(f"{path}: the header must be {','.join(_COLUMNS)} (got {','.join(header) or 'nothing'})")
    if len(lines) < 2:
        raise TraceError(f"{path}: needs at least two rows (a segment and the row marking the end)")
    segments: list[Segment] = []
    end_s = 0.0
    for number, cells in enumerate(lines, start=2):
        last = number == len(lines) + 1
        values = {column: trace_number(path, number, column, cells.get(column, ""))
                  for column in (_COLUMNS if not last else _COLUMNS[:1])}
        time_s = values["time_s"]
        previous = segments[-1].start_s if segments else None
        if previous is not None and time_s <= previous:
            raise TraceError(f"{path}:{number}: time_s = {time_s:g} is not after {previous:g}")
        if last:
            end_s = time_s
            break
        if values["prompt_tokens"] < 1 or values["output_tokens"] < 1:
            raise TraceError(f"{path}:{number}: prompt_tokens and output_tokens must be >= 1")
        segments.append(Segment(time_s, values["requests_per_s"], values["prompt_tokens"], values["output_tokens"]))
    return WorkloadTrace(os.path.basename(os.fspath(path)), tuple(segments), end_s)


def generate_requests(trace: WorkloadTrace, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for i, seg in enumerate(trace.segments):
        end = trace.segments[i + 1].start_s if i + 1 < len(trace.segments) else trace.end_s
        if seg.requests_per_s <= 0:
            continue
        t = seg.start_s
        while True:
            t += rng.expovariate(seg.requests_per_s)
            if t >= end:
                break
            prompt = rng.randint(max(1, round(0.5 * seg.prompt_tokens)), max(1, round(1.5 * seg.prompt_tokens)))
            output = rng.randint(max(2, round(0.5 * seg.output_tokens)), max(2, round(1.5 * seg.output_tokens)))
            requests.append(Request(t, prompt, output))
    return requests
