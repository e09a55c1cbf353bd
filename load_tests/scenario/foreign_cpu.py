"""CPU that processes outside a benchmark take from this machine while it runs, from /proc.

On a shared machine a measurement's cores are not its own: another session's job that does not
take the CPU lock (`flock /tmp/kvrelay-cpu.lock`) slows every step of the scenario, and
pd-interference's load sits where 10-20% slower steps tip the layouts into another regime
(docs/benchmarks.md, issue 19 part 4). So the machine's other load is measured beside the
scenario and the simulator's replay takes it as more background load on the same cores
(load_tests/pd/sim.py `foreign_cpu`), as it does the serving processes'.

    python -m load_tests.scenario.foreign_cpu sample OUT.jsonl [--period 5]
        every period: {"t": unix time, "foreign_cores": CPU-s / s of the processes that are not
        the benchmark's, "top": {command: CPU-s}} (the benchmark's: Ray's processes, this
        sampler, `kvrelay bench`)
    python -m load_tests.scenario.foreign_cpu annotate SCENARIO.json SAMPLES.jsonl LABEL=START,END ...
        writes each run's mean foreign cores over [START, END] (unix times) into the scenario
        JSON under "foreign_cpu", which pd_validate passes to the replay (for runs measured
        before the scenario recorded it itself)

`kvrelay bench scenario pd-interference` records it itself (`ForeignSampler` around each run,
1 s samples): its JSON's "foreign_cpu" holds each run's mean cores and the top commands.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

__all__ = ["BENCHMARK_MARKERS", "ForeignSampler", "is_benchmark", "mean_cores", "sample"]

BENCHMARK_MARKERS = ("ray::", "raylet", "gcs_server", "kvrelay bench", "ray/dashboard", "ray/_private", "log_monitor",
                     "monitor.py", "runtime_env", "foreign_cpu")


def is_benchmark(cmdline: str) -> bool:
    """Whether a process (by its command line) is the benchmark's own: its servers, its client."""
    return any(marker in cmdline for marker in BENCHMARK_MARKERS)


def _snapshot() -> dict[int, tuple[str, float]]:
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(pid)] = (cmdline, (int(fields[11]) + int(fields[12])) / tick)
    return out


def _foreign_seconds(previous: dict[int, tuple[str, float]], current: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each foreign command used between two snapshots (a new process counts whole)."""
    used_by: dict[str, float] = {}
    for pid, (cmdline, seconds) in current.items():
        used = seconds - (previous[pid][1] if pid in previous else 0.0)
        if used > 0 and cmdline and pid != os.getpid() and not is_benchmark(cmdline):
            used_by[cmdline[:120]] = used_by.get(cmdline[:120], 0.0) + used
    return used_by


class ForeignSampler:
    """`with ForeignSampler() as s: ...` then `s.cores`: the mean cores foreign processes used
    meanwhile, sampled every `period_s` on a thread (a process that lived less than a period
    between two samples is missed), and `s.top`, CPU seconds by command."""

    def __init__(self, period_s: float = 1.0) -> None:
        self.period_s = period_s
        self.cores = 0.0
        self.top: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="foreign-cpu", daemon=True)

    def __enter__(self) -> ForeignSampler:
        self._started = time.monotonic()
        self._previous = _snapshot()
        self._thread.start()
        return self

    def _take(self) -> None:
        current = _snapshot()
        for command, used in _foreign_seconds(self._previous, current).items():
            self.top[command] = self.top.get(command, 0.0) + used
        self._previous = current

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self._take()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._take()
        wall = time.monotonic() - self._started
        self.cores = sum(self.top.values()) / wall if wall > 0 else 0.0


def sample(out_path: str, period_s: float = 5.0) -> None:
    previous, previous_t = _snapshot(), time.time()
    while True:
        time.sleep(period_s)
        current, now = _snapshot(), time.time()
        top = {command: round(used, 3) for command, used in _foreign_seconds(previous, current).items()}
        with open(out_path, "a") as fh:
            fh.write(json.dumps({"t": now, "foreign_cores": sum(top.values()) / (now - previous_t), "top": top}) + "\n")
        previous, previous_t = current, now


def mean_cores(samples: list[dict], start: float, end: float) -> float:
    """The mean foreign cores over [start, end]: each sample covers the period before its time,
    weighted by its overlap with the window."""
    total = weight = 0.0
    for before, after in zip(samples, samples[1:]):
        overlap = min(end, after["t"]) - max(start, before["t"])
        if overlap > 0:
            total += after["foreign_cores"] * overlap
            weight += overlap
    return total / weight if weight else 0.0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m load_tests.scenario.foreign_cpu")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sample")
    s.add_argument("out")
    s.add_argument("--period", type=float, default=5.0)
    a = sub.add_parser("annotate")
    a.add_argument("scenario")
    a.add_argument("samples")
    a.add_argument("windows", nargs="+", metavar="LABEL=START,END")
    args = parser.parse_args(argv)
    if args.command == "sample":
        sample(args.out, args.period)
        return 0
    samples = [json.loads(line) for line in Path(args.samples).read_text().splitlines() if line.strip()]
    report = json.loads(Path(args.scenario).read_text())
    cores = {}
    for window in args.windows:
        label, span = window.split("=")
        start, end = (float(x) for x in span.split(","))
        cores[label] = round(mean_cores(samples, start, end), 3)
    report["foreign_cpu"] = {"cores": cores, "source": f"load_tests/scenario/foreign_cpu.py samples {Path(args.samples).name}, "
                             "each run's window from its progress log"}
    Path(args.scenario).write_text(json.dumps(report, indent=1))
    print(json.dumps(report["foreign_cpu"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
