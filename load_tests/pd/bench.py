"""`kvrelay bench pd-sim`: where disaggregation pays, simulated at scale, and the simulator checked
against this machine's measured pd-interference run.

    1. cost fits (load_tests/pd/costs.py)
         cpu   this machine's engine, probed now (load_tests/pd/probe.py, ~2 min) with the
               served path's overheads and KV hand-off from --serve-overhead (a `kvrelay bench
               serve-overhead` JSON of this machine); or reused from an earlier report (--cpu-fit)
         gpu   published figures: DistServe's OPT-13B profile on A100, Vidur's A100 KV send/recv
    2. validation (--validate SCENARIO.json, cpu fit): the measured pd-interference run's four
       runs replayed through the simulator (load_tests/pd/validate.py); every figure beside the
       measured one, within 15% or not. With several --validate runs, also each figure's median
       over them against the median of their replays, with the measured spread beside it
    3. sweep (load_tests/pd/sweep.py): colocated against disaggregated goodput per replica over
       pool sizes 2-64 and four workload mixes at a tight and a loose SLO, for each fit; the
       crossover pool size

`--quick`: two mixes, pools of 2 and 8, short runs (seconds; figures indicative only), the gpu
fit alone unless --cpu-fit is given. `--json PATH` writes {summary, config, raw, hardware}; a PNG
of the crossover next to it when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from load_tests import hardware
from load_tests.common import StepLog, command_line, write_report
from load_tests.pd.costs import CostFit, gpu_fit
from load_tests.pd.params import FITS, add_arguments
from load_tests.pd.report import format_crossovers, format_split, format_sweep, format_validation, write_png
from load_tests.pd.sweep import FULL, QUICK, SweepParams, crossovers, sweep
from load_tests.pd.validate import TOLERANCE, compare, compare_median, simulate_scenario, split_rows
from load_tests.pd.workload import MIXES

__all__ = ["run", "run_from_args", "sweep_params"]

_progress = StepLog("bench pd-sim")


def _csv(text: str | None) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def _corun(value: str) -> tuple[float, dict]:
    """--corun: (seconds, the probe's record) from a pd_corun JSON file or a number of milliseconds."""
    try:
        return float(value) / 1e3, {"given_ms": float(value)}
    except ValueError:
        pass
    try:
        probe = json.loads(Path(value).read_text())
        return float(probe["corun_s"]), {**probe, "corun_ref_s": float(probe["corun_ref_s"])}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"kvrelay bench pd-sim: --corun wants milliseconds or a `python -m load_tests.pd.corun` JSON "
                         f"file; {value!r}: {exc}") from None


def _cpu_fit(args, need: bool) -> CostFit | None:
    fit = _cpu_fit_of(args, need)
    if fit is not None and args.corun is not None:
        corun_s, probe = _corun(args.corun)
        fit = dataclasses.replace(fit, corun_s=corun_s, corun_ref_s=probe.get("corun_ref_s", fit.corun_ref_s),
                                  info={**fit.info, "corun_probe": probe})
    return fit


def _cpu_fit_of(args, need: bool) -> CostFit | None:
    if args.cpu_fit:
        report = json.loads(Path(args.cpu_fit).read_text())
        return CostFit.from_json(report["config"]["fits"]["cpu"])
    if not need:
        return None
    if not args.serve_overhead:
        raise SystemExit("kvrelay bench pd-sim: the cpu fit needs --serve-overhead FILE (a `kvrelay bench serve-overhead "
                         "--json` report of this machine) or --cpu-fit FILE (an earlier pd-sim report)")
    from load_tests.pd.probe import cpu_fit
    from load_tests.roofline import resolve_dtype
    from serving.engine.modeling.loader import resolve_model_dir

    earlier = json.loads(Path(args.refit).read_text())["config"]["fits"]["cpu"] if args.refit else None
    if earlier:
        model_dir, dtype = Path(earlier["info"]["model_dir"]), earlier["info"]["dtype"]
    else:
        model_dir = resolve_model_dir(args.model)
        dtype = resolve_dtype(args.dtype, model_dir).dtype
        _progress(f"cpu fit: probing the engine ({model_dir.name}, {dtype}, 1 thread, {args.probe_repeats} repeats), "
                  "then the served path")
    return cpu_fit(model_dir, dtype, json.loads(Path(args.serve_overhead).read_text()), repeats=args.probe_repeats,
                   earlier=earlier, progress=_progress)


def sweep_params(args) -> SweepParams:
    params = dataclasses.replace(QUICK if args.quick else FULL, seed=args.seed)
    if args.mixes:
        unknown = sorted(set(_csv(args.mixes)) - set(MIXES))
        if unknown:
            raise SystemExit(f"kvrelay bench pd-sim: --mixes: unknown {', '.join(unknown)}; choose from {', '.join(MIXES)}")
        params = dataclasses.replace(params, mixes=tuple(_csv(args.mixes)))
    if args.pool_sizes:
        try:
            sizes = tuple(int(x) for x in _csv(args.pool_sizes))
        except ValueError:
            raise SystemExit(f"kvrelay bench pd-sim: --pool-sizes wants integers, got {args.pool_sizes!r}") from None
        if not sizes or min(sizes) < 2:
            raise SystemExit("kvrelay bench pd-sim: --pool-sizes: a disaggregated pool needs at least 2 replicas")
        params = dataclasses.replace(params, pool_sizes=sizes)
    return params


def run(args, *, command: str = "") -> dict:
    started = time.monotonic()
    machine = hardware.machine_record(num_threads=1)
    fit_names = _csv(args.fits) or (["gpu", "cpu"] if not args.quick or args.cpu_fit else ["gpu"])
    unknown = sorted(set(fit_names) - set(FITS))
    if unknown:
        raise SystemExit(f"kvrelay bench pd-sim: --fits: unknown {', '.join(unknown)}; choose from {', '.join(FITS)}")
    params = sweep_params(args)
    cpu = _cpu_fit(args, need="cpu" in fit_names or bool(args.validate))
    fits = {"gpu": gpu_fit(), **({"cpu": cpu} if cpu else {})}
    summary: dict = {}
    raw: dict = {}
    if args.validate:
        summary["validation"], raw["validation_simulated"] = [], []
        for path in args.validate:
            measured = json.loads(Path(path).read_text())
            simulated = simulate_scenario(measured, cpu)
            rows = compare(measured["summary"], simulated)
            judged = [r for r in rows if r["within"] is not None]
            summary["validation"].append({"scenario": str(path), "tolerance": TOLERANCE, "rows": rows,
                                          "num_within": sum(r["within"] for r in judged), "num_judged": len(judged)})
            raw["validation_simulated"].append(simulated)
            print(f"{path}:")
            print(format_validation(rows))
            print(f"within {TOLERANCE:.0%}: {summary['validation'][-1]['num_within']} of {len(judged)}\n")
            split = split_rows(measured, simulated)
            if split:  # for information: where the mean TTFT goes, measured at the ingress and replayed
                summary["validation"][-1]["ttft_split_ms"] = split
                print("mean TTFT, ms, split (measured at the ingress; replayed):")
                print(format_split(split) + "\n")
        if len(args.validate) > 1:  # judged on each figure's median over the runs, the spread beside it
            rows = compare_median([json.loads(Path(p).read_text())["summary"] for p in args.validate],
                                  raw["validation_simulated"])
            judged = [r for r in rows if r["within"] is not None]
            summary["validation_median"] = {"scenarios": [str(p) for p in args.validate], "tolerance": TOLERANCE,
                                            "rows": rows, "num_within": sum(r["within"] for r in judged),
                                            "num_judged": len(judged)}
            print(f"median of {len(args.validate)} runs (spread: (max - min) / median of the measured runs):")
            print(format_validation(rows))
            print(f"within {TOLERANCE:.0%}: {summary['validation_median']['num_within']} of {len(judged)}\n")
    if not args.no_sweep:
        found = []
        for name in fit_names:
            _progress(f"sweep, {name} fit: mixes {', '.join(params.mixes)}; pools {params.pool_sizes}")
            found += sweep(fits[name], params, progress=_progress)
        summary["crossovers"] = crossovers(found)
        raw["cells"] = [c.to_json() for c in found]
        print(format_sweep(raw["cells"]))
        print()
        print(format_crossovers(summary["crossovers"]))
    hardware.finish_machine_record(machine)
    return {
        "summary": summary,
        "config": {"command": command, "sweep": dataclasses.asdict(params), "fits": {k: f.to_json() for k, f in fits.items()},
                   "mixes": {name: dataclasses.asdict(MIXES[name]) for name in params.mixes}},
        "raw": {**raw, "wall_s": time.monotonic() - started},
        "hardware": machine,
    }


def run_from_args(args: argparse.Namespace, argv: list[str]) -> int:
    report = run(args, command=command_line(argv))
    if args.json:
        path = write_report(args.json, report)
        _progress(f"wrote {path}")
        if report["raw"].get("cells"):
            png = write_png(str(path.with_suffix(".png")), report["raw"]["cells"])
            if png:
                _progress(f"wrote {png}")
    return 0


if __name__ == "__main__":  # python -m load_tests.pd.bench ...
    parser = argparse.ArgumentParser(prog="kvrelay bench pd-sim")
    add_arguments(parser)
    sys.exit(run_from_args(parser.parse_args(), sys.argv[1:]))
