"""What a second busy engine costs a decode step on this machine: CostFit.corun_s of the CPU fit.

pd-interference runs its replicas one per core. The step probe (pd/probe.py) times one engine
alone, but in the scenario the other core is busy with a replica's steps too, and on one CPU both
stream their weights through the same memory and last-level cache. This probe runs two engines
(one torch thread each, pinned to cores 0 and 1, `rows` decode rows of CONTEXT tokens): core 0's
steps all along, core 1's only in every other phase. Phases alternate, `cycles` times `phase_s`
each way, so the machine's drift (a shared VM's neighbours) falls on both alike; corun_s is core
0's median step while core 1 steps less its median while core 1 waits, the mean over `rows`, and
corun_ref_s the mean step alone (how often a decode step reads the weights: pd_sim scales corun_s
by it for the step the other core runs).
Measured on the AMD EPYC of 2026-12-02: +3.7 ms at 1 row (15.6 ms alone), +2.6 ms at 4 rows
(24.3 ms alone): about the same whatever the rows, as the weights' one read per step is.

    python -m load_tests.pd.corun [--model M] [--rows 1,4] [--cycles 8] [--phase-s 3]   prints the probe's JSON
    python -m load_tests.pd.corun --worker CORE ROWS MODEL_DIR DTYPE DIR                 (one engine; internal)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["probe_corun"]

CONTEXT = 256  # tokens per row: the chat rows of pd-interference
MAX_NEW = 7000  # within the 8k context: the rows never finish during the probe


def _worker(core: int, rows: int, model_dir: Path, dtype: str, directory: Path) -> None:
    """One engine pinned to `core`: fill `rows` rows, say it is ready, then step while the phase
    lets it (core 0 always, core 1 while `both` exists), recording core 0's steps by phase."""
    os.sched_setaffinity(0, {core})
    import numpy as np
    import torch

    from load_tests.pd.probe_engine import PROBE_ENGINE, probe_engine
    from serving.engine import SamplingParams

    torch.set_num_threads(1)
    engine = probe_engine(model_dir, dtype)
    rng = np.random.default_rng(core)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, detokenize=False)
    for i in range(rows):
        engine.add_request(f"corun-{core}-{i}", prompt_token_ids=rng.integers(100, engine.vocab_size, CONTEXT).tolist(), params=params)
    for _ in range(-(-rows * CONTEXT // PROBE_ENGINE["max_num_batched_tokens"]) + 20):  # the prompts, then warm decode
        engine.step()
    (directory / f"ready-{core}").touch()
    both, stop = directory / "both", directory / "stop"
    steps: dict[str, list[float]] = {"alone": [], "together": []}
    while not stop.exists():
        together = both.exists()
        if core != 0 and not together:
            time.sleep(0.002)
            continue
        started = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - started
        if core == 0 and together == both.exists():  # the phase did not change during the step
            steps["together" if together else "alone"].append(elapsed)
    if core == 0:
        (directory / "steps.json").write_text(json.dumps(steps))


def _measure(model_dir: Path, dtype: str, rows: int, cycles: int, phase_s: float) -> dict[str, float]:
    """Core 0's median step alone and beside core 1's, over alternating phases."""
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        procs = [subprocess.Popen([sys.executable, "-m", "load_tests.pd.corun", "--worker", str(core), str(rows),
                                  str(model_dir), dtype, name])
                 for core in (0, 1)]
        try:
            while not all((directory / f"ready-{core}").exists() for core in (0, 1)):
                if any(p.poll() is not None for p in procs):
                    raise RuntimeError("pd_corun: an engine failed before its steps (its stderr is above)")
                time.sleep(0.05)
            for _ in range(cycles):
                time.sleep(phase_s)
                (directory / "both").touch()
                time.sleep(phase_s)
                (directory / "both").unlink()
        finally:
            (directory / "stop").touch()
            codes = [p.wait() for p in procs]
        if any(codes):
            raise RuntimeError("pd_corun: an engine failed while stepping (its stderr is above)")
        steps = json.loads((directory / "steps.json").read_text())
        return {"alone_s": statistics.median(steps["alone"]), "together_s": statistics.median(steps["together"]),
                "steps": {phase: len(times) for phase, times in steps.items()}}


def probe_corun(model_dir: Path, dtype: str, rows: tuple[int, ...] = (1, 4), cycles: int = 8, phase_s: float = 3.0,
                progress=lambda message: None) -> dict:
    """{"corun_s", "corun_ref_s", "by_rows": {rows: {"alone_s", "together_s", "steps"}}} of `model_dir`
    in `dtype` (module docstring). 0 on fewer than two cores: no other replica's core."""
    if not {0, 1} <= os.sched_getaffinity(0):
        return {"corun_s": 0.0, "skipped": "cores 0 and 1 are not both this process's: no other replica's core"}
    by_rows = {}
    for n in rows:
        progress(f"co-run probe: {n} decode rows, {cycles} x {phase_s:g} s alone and beside a second engine")
        by_rows[n] = _measure(model_dir, dtype, n, cycles, phase_s)
    extra = statistics.mean(r["together_s"] - r["alone_s"] for r in by_rows.values())
    return {"corun_s": max(0.0, extra), "corun_ref_s": statistics.mean(r["alone_s"] for r in by_rows.values()),
            "by_rows": by_rows, "context": CONTEXT, "cycles": cycles, "phase_s": phase_s}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m load_tests.pd.corun", description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", nargs=5, metavar=("CORE", "ROWS", "MODEL_DIR", "DTYPE", "DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model to probe [%(default)s]")
    parser.add_argument("--rows", default="1,4", help="decode rows per step, comma-separated [1,4]")
    parser.add_argument("--cycles", type=int, default=8, help="alone/together phase pairs [8]")
    parser.add_argument("--phase-s", type=float, default=3.0, help="seconds per phase [3]")
    args = parser.parse_args(argv)
    if args.worker:
        core, rows, model_dir, dtype, directory = args.worker
        _worker(int(core), int(rows), Path(model_dir), dtype, Path(directory))
        return
    from load_tests.roofline import resolve_dtype
    from serving.engine.modeling.loader import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    print(json.dumps(probe_corun(model_dir, resolve_dtype("auto", model_dir).dtype, tuple(int(n) for n in args.rows.split(",")),
                                 args.cycles, args.phase_s, progress=lambda m: print(m, file=sys.stderr)), indent=1))


if __name__ == "__main__":
    main()
