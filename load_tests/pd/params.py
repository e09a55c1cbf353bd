"""The arguments of `kvrelay bench pd-sim` (load_tests/pd/bench.py), apart so that the CLI's
parser builds without importing numpy or the simulator."""

from __future__ import annotations

import argparse

__all__ = ["DESCRIPTION", "FITS", "MIX_NAMES", "add_arguments"]

DESCRIPTION = (
    "A discrete-event simulator of prefill and decode pools (load_tests/pd/sim.py) with step costs fitted "
    "to this machine's engine (probed now, or --cpu-fit) and to published GPU figures (DistServe's OPT-13B "
    "profile on A100): colocated against disaggregated goodput per replica over pool sizes and workload "
    "mixes at a tight and a loose SLO, and the crossover pool size. --validate replays a measured "
    "pd-interference run with the cpu fit and reports each figure's error (load_tests/pd/bench.py)."
)

FITS = ("cpu", "gpu")
MIX_NAMES = ("chat", "chat-bursts", "long-prompt", "long-output")  # load_tests/pd/workload.py MIXES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="2 mixes, pools of 2 and 8, short runs; gpu fit alone unless --cpu-fit")
    p.add_argument("--json", metavar="PATH", help="write summary, config (the fits), raw cells and hardware; a PNG next to it")
    p.add_argument("--fits", metavar="A,B", help=f"cost fits to sweep [{','.join(FITS)}; quick: gpu, and cpu with --cpu-fit]")
    p.add_argument("--cpu-fit", metavar="FILE", help="reuse the cpu fit of an earlier pd-sim --json report (no probe)")
    p.add_argument("--serve-overhead", metavar="FILE",
                   help="a `kvrelay bench serve-overhead` JSON of this machine: the cpu fit's KV hand-off")
    p.add_argument("--refit", metavar="FILE",
                   help="fit the cpu fit again from the probes of an earlier pd-sim report (no engine, no Ray)")
    p.add_argument("--corun", metavar="FILE|MS",
                   help="the cpu fit's co-run term (CostFit.corun_s): a `python -m load_tests.pd.corun` JSON of this "
                   "machine, or milliseconds; without it a probed fit measures it and a reused one keeps its own")
    p.add_argument("--validate", metavar="SCENARIO_JSON", action="append", default=[],
                   help="a `kvrelay bench scenario pd-interference` JSON of this machine to replay with the cpu fit; repeatable")
    p.add_argument("--no-sweep", action="store_true", help="fits and validation only")
    p.add_argument("--mixes", metavar="A,B", help=f"workload mixes [{','.join(MIX_NAMES)}]")
    p.add_argument("--pool-sizes", metavar="N,N", help="replicas per pool [2,4,8,16,32,64; quick 2,8]")
    p.add_argument("--probe-repeats", type=int, default=3, metavar="N", help="timed runs per probe scenario [%(default)s]")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model the cpu fit probes [%(default)s]")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32", "float16"], default="auto",
                   help="the cpu fit's dtype [%(default)s: as kvrelay picks on this machine]")
    p.add_argument("--seed", type=int, default=0, help="workload seed [%(default)s]")
