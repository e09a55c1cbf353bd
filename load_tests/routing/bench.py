"""`kvrelay bench routing`: prefix hit rate, TTFT and load balance of the prefill pool's routing
policy against three baselines, on a shared-prefix workload.

    policies   prefix_cost (ours, router/policies.py), round_robin, pow2 (power of two choices),
               char_prefix_tree (an approximate character prefix tree in the manner of Ray Serve
               LLM's PrefixCacheAffinityRouter)
    workload   G prefix groups x prefix_len tokens, a fresh suffix_len-token suffix per request,
               Poisson arrivals, uniform popularity unless --zipf (load_tests/routing/workload.py)
    rate       --request-rate, or --load x the pool's capacity for prompts that hit nothing
               (replicas / cold prefill time from the cost model): 0.5 by default
    metrics    prefix hit rate (cached / prompt tokens), TTFT p50/p95 (arrival -> first token),
               max/mean load (load = prompt tokens a replica computed; load_tests/routing/metrics.py)

--simulate runs the policies' own code (router/routing_state.py, as the deployed router runs it)
against simulated replicas (load_tests/routing/sim.py): 16 replicas with 256 KV blocks (4096
tokens) each, then 8, 32 and 64 with groups, requests and rate scaled alike; the service time
comes from timing the real engine here (load_tests/routing/calibration.py) unless
--rate-tokens-per-s (plus --overhead-ms) or --calibration FILE gives it. The headline (summary) is
the 16-replica run. Without --simulate it starts a local Ray with 2 PrefillWorker replicas (one
torch thread each) and sends a smaller workload through a Serve handle, once per policy
(load_tests/routing/real.py), and simulates the same workload on 2 replicas beside it.

Targets (printed as pass/miss, not enforced), ours against the oracle hit rate (the best the
replicas' cache capacity allows; routing/sim.py defines it) and against pow2:
hit rate >= 0.95 of the oracle, TTFT p50 >= 3x lower than pow2, max/mean load <= 1.3.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

from load_tests import hardware
from load_tests.common import StepLog, Target, load_note, run_and_report
from load_tests.routing.bounds import pooled_lru_hit_tokens, pooled_optimal_hit_tokens, single_home
from load_tests.routing.metrics import PolicyRun
from load_tests.routing.sim import CostModel, OracleReplayPolicy, SimConfig, oracle_hit_tokens, simulate
from load_tests.routing.sweep import (
    ONE_ROUTER,
    SWEEP_FULL,
    SWEEP_QUICK,
    Cell,
    SweepGrid,
    cells,
    format_sweep,
    run_cells,
    sim_config,
    summarize_sweep,
)
from load_tests.routing.workload import Workload, WorkloadSpec, make_workload

__all__ = [
    "DESCRIPTION", "add_arguments",
    "BenchParams", "SIM_FULL", "SIM_QUICK", "REAL_FULL", "REAL_QUICK", "POLICIES", "TARGETS",
    "policy_figures", "summarize", "format_table", "params_from_args", "run", "run_from_args",
]

DESCRIPTION = (
    "Send a shared-prefix workload (prefix groups, fresh suffixes, Poisson arrivals) to the "
    "prefill pool under each policy: ours (prefix_cost), round_robin, pow2 and an approximate "
    "character prefix tree in the manner of Ray Serve's PrefixCacheAffinityRouter. Report "
    "prefix hit rate (vs the oracle's), TTFT p50/p95 and max/mean computed tokens per "
    "replica. Real (default): 2 PrefillWorker replicas on a local Ray. --simulate: the same "
    "policy code against 16 (then 8, 32, 64) simulated replicas whose prefill time is "
    "calibrated on the real engine. Unset knobs take the preset."
)

POLICIES = ("prefix_cost", "round_robin", "pow2", "char_prefix_tree")
LABELS = {"prefix_cost": "ours (prefix_cost)"}


@dataclass(frozen=True)
class BenchParams:
    simulate: bool = True
    num_groups: int = 16
    prefix_len: int = 1024
    suffix_len: int = 64
    num_requests: int = 4000
    load: float = 0.5
    request_rate: float | None = None  # requests/s; overrides load
    zipf: float = 0.0
    num_replicas: int = 16
    sweep: tuple[int, ...] = (8, 32, 64)  # further replica counts (simulation only)
    kv_cache_tokens: int = 4096  # per replica
    block_size: int = 16
    stats_period_s: float = 0.5
    num_routers: int = 1
    router_seeds: int = 1  # with num_routers > 1 in the sweep: ours with N routers and with one, over this many seeds
    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"  # resolved before anything runs, as kvrelay's default picks on this machine
    rate_tokens_per_s: float | None = None  # skip calibration: this rate ...
    overhead_ms: float = 0.0  # ... and this per-prefill overhead
    calibration: str | None = None  # or the calibration of an earlier report
    calibration_repeats: int = 3
    ours_params: tuple[tuple[str, object], ...] = ()  # PrefixCostPolicy parameters (--param)
    seed: int = 0
    quick: bool = False
    pressure_sweep: bool = False  # the grid of load_tests/routing/sweep.py instead of the runs above
    grid: SweepGrid = SWEEP_FULL

    def policy_params(self, policy: str) -> dict:
        return dict(self.ours_params) if policy == "prefix_cost" else {}


SIM_FULL = BenchParams()
SIM_QUICK = dataclasses.replace(SIM_FULL, num_requests=800, sweep=(), calibration_repeats=1, quick=True)
REAL_FULL = dataclasses.replace(
    SIM_FULL, simulate=False, num_groups=8, prefix_len=512, suffix_len=32, num_requests=60, num_replicas=2,
    sweep=(), kv_cache_tokens=2560,
)
REAL_QUICK = dataclasses.replace(REAL_FULL, num_groups=4, num_requests=24, calibration_repeats=1, quick=True)
SWEEP_PRESET = dataclasses.replace(SIM_FULL, sweep=(), pressure_sweep=True)
SWEEP_QUICK_PRESET = dataclasses.replace(SWEEP_PRESET, grid=SWEEP_QUICK, calibration_repeats=1, quick=True)

TARGETS = (
    Target("hit_rate_fraction_of_oracle", "prefix hit rate / oracle's", ">=", 0.95),
    Target("ttft_p50_speedup_vs_pow2", "TTFT p50: pow2 / ours", ">=", 3.0, "x"),
    Target("max_over_mean_load", "max / mean load (ours)", "<=", 1.3),
)


# ---- figures (pure) --------------------------------------------------------------------------
def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def policy_figures(runs: dict[str, PolicyRun], oracle_hit_rate: float) -> dict[str, dict]:
    """Per policy: its run's figures plus the summary's three, as if it were ours."""
    pow2_p50 = runs["pow2"].ttft_ms(50) if "pow2" in runs else None
    return {
        name: {
            **run.to_json(),
            "hit_rate_fraction_of_oracle": _ratio(run.hit_rate, oracle_hit_rate),
            "ttft_p50_speedup_vs_pow2": _ratio(pow2_p50, run.ttft_ms(50)),
        }
        for name, run in runs.items()
    }


def summarize(figures: dict[str, dict], oracle_hit_rate: float, source: str) -> dict:
    ours = figures["prefix_cost"]
    summary = {
        "hit_rate_fraction_of_oracle": ours["hit_rate_fraction_of_oracle"],
        "ttft_p50_speedup_vs_pow2": ours["ttft_p50_speedup_vs_pow2"],
        "max_over_mean_load": ours["max_over_mean_load"],
        "hit_rate": ours["hit_rate"],
        "oracle_hit_rate": oracle_hit_rate,
        "ttft_ms_p50": ours["ttft_ms_p50"],
        "ttft_ms_p95": ours["ttft_ms_p95"],
        "source": source,
        "load_definition": "prompt tokens computed (not served from the prefix cache) per replica",
    }
    summary["targets"] = {t.key: {"target": t.text, "met": t.met(summary[t.key])} for t in TARGETS}
    return summary


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else f"{value:{spec}}"


def _policy_rows(figures: dict[str, dict], prefix: str = "") -> list[str]:
    lines = []
    for name, f in figures.items():
        lines.append(
            f"{prefix}{LABELS.get(name, name):<20}{f['hit_rate']:>9.3f}{_fmt(f['hit_rate_fraction_of_oracle'], '.3f'):>9}"
            f"{_fmt(f['ttft_ms_p50'], '.0f'):>10}{_fmt(f['ttft_ms_p95'], '.0f'):>10}"
            f"{_fmt(f['max_over_mean_load'], '.2f'):>10}{_fmt(f['ttft_p50_speedup_vs_pow2'], '.1f'):>9}"
        )
    return lines


HEADER = f"{'policy':<20}{'hit rate':>9}{'/oracle':>9}{'p50 ms':>10}{'p95 ms':>10}{'max/mean':>10}{'vs pow2':>9}"


def format_table(p: BenchParams, headline: dict, summary: dict, sweep: dict[int, dict] | None = None,
                 *, simulated: dict | None = None) -> str:
    """headline/sweep/simulated: {"spec", "oracle_hit_rate", "num_blocks", "figures"}."""
    spec: WorkloadSpec = headline["spec"]
    skew = f"zipf {spec.zipf_s:g}" if spec.zipf_s else "uniform"
    where = "simulated" if p.simulate else "real"
    lines = [
        f"workload: {spec.num_groups} prefixes x {spec.prefix_len} tokens + {spec.suffix_len}-token suffixes, "
        f"{spec.num_requests} requests, Poisson {spec.request_rate_per_s:.2f}/s, {skew} popularity",
        f"{where}: {headline['num_replicas']} replicas x {headline['num_blocks']} KV blocks of {spec.block_size}; "
        f"oracle hit rate {headline['oracle_hit_rate']:.3f}; TTFT = arrival -> first token; "
        "load = tokens computed per replica",
    ]
    if p.ours_params:
        lines.append("ours with " + ", ".join(f"{key}={value}" for key, value in p.ours_params))
    lines += ["", HEADER, *_policy_rows(headline["figures"])]
    if simulated:
        lines += ["", f"the same workload simulated on {simulated['num_replicas']} replicas "
                  f"(oracle {simulated['oracle_hit_rate']:.3f}):", *_policy_rows(simulated["figures"])]
    for n, part in (sweep or {}).items():
        s = part["spec"]
        lines += ["", f"{n} replicas ({s.num_groups} prefixes, {s.num_requests} requests, "
                  f"{s.request_rate_per_s:.2f}/s; oracle {part['oracle_hit_rate']:.3f}):", *_policy_rows(part["figures"])]
    lines += ["", f"{'summary (ours, ' + summary['source'] + ')':<44}{'value':>8}{'target':>10}{'result':>8}"]
    for t in TARGETS:
        verdict = {True: "pass", False: "miss", None: "n/a"}[summary["targets"][t.key]["met"]]
        lines.append(f"{t.label:<44}{_fmt(summary[t.key], '.3f'):>8}{t.text:>10}{verdict:>8}")
    return "\n".join(lines)


# ---- runs ------------------------------------------------------------------------------------
_progress = StepLog("bench")


def _cost_model(p: BenchParams) -> tuple[CostModel, dict]:
    """The cost model and how it was obtained (for the report's config)."""
    if p.rate_tokens_per_s is not None:
        cost = CostModel(p.overhead_ms / 1e3, p.rate_tokens_per_s)
        return cost, {"source": "--rate-tokens-per-s", **dataclasses.asdict(cost)}
    from load_tests.routing.calibration import Calibration, calibrate

    if p.calibration is not None:
        data = json.loads(Path(p.calibration).read_text())
        calibration = Calibration.from_json(data["config"]["calibration"] if "config" in data else data)
        return calibration.cost_model(), {"source": str(p.calibration), **calibration.to_json()}
    calibration = calibrate(
        p.model, dtype=p.dtype, prefix_len=p.prefix_len, suffix_len=p.suffix_len, repeats=p.calibration_repeats,
        seed=p.seed, progress=_progress,
    )
    return calibration.cost_model(), {"source": "measured", **calibration.to_json()}


def _spec(p: BenchParams, cost: CostModel, num_replicas: int) -> WorkloadSpec:
    """The workload for `num_replicas`: groups, requests and rate scaled from p.num_replicas."""
    scale = num_replicas / p.num_replicas
    prompt_len = p.prefix_len + p.suffix_len
    rate = p.request_rate if p.request_rate is not None else p.load * p.num_replicas / cost.service_s(prompt_len, 0)
    return WorkloadSpec(
        num_groups=max(1, round(p.num_groups * scale)), prefix_len=p.prefix_len, suffix_len=p.suffix_len,
        num_requests=max(1, round(p.num_requests * scale)), request_rate_per_s=rate * scale, zipf_s=p.zipf,
        block_size=p.block_size, seed=p.seed,
    )


def _oracle_rate(workload: Workload, num_replicas: int, num_blocks: int) -> tuple[float, list[int]]:
    hit, total, pinned = oracle_hit_tokens(workload, num_replicas, num_blocks)
    return hit / total, pinned


def simulate_all(p: BenchParams, cost: CostModel, num_replicas: int, workload: Workload | None = None) -> dict:
    workload = workload or make_workload(_spec(p, cost, num_replicas))
    num_blocks = p.kv_cache_tokens // p.block_size
    config = SimConfig(num_replicas, num_blocks, p.block_size, p.stats_period_s, p.num_routers, p.seed)
    oracle, pinned = _oracle_rate(workload, num_replicas, num_blocks)
    runs = {}
    for policy in POLICIES:
        started = time.monotonic()
        runs[policy] = simulate(workload, policy, config, cost, p.policy_params(policy))
        _progress(f"simulated {policy} on {num_replicas} replicas ({time.monotonic() - started:.1f}s)")
    return {
        "spec": workload.spec, "num_replicas": num_replicas, "num_blocks": num_blocks, "oracle_hit_rate": oracle,
        "oracle_pinned_blocks": pinned, "figures": policy_figures(runs, oracle),
    }


def _run_real(p: BenchParams, cost: CostModel, workload: Workload) -> dict:
    import numpy as np
    import torch

    from load_tests.local_ray import local_ray
    from load_tests.routing import real as routing_real
    from serving.engine.kv.cache import kv_bytes_per_token
    from serving.engine.modeling.loader import load_model_spec, resolve_model_dir

    model_dir = resolve_model_dir(p.model)
    spec = load_model_spec(model_dir)
    num_blocks = p.kv_cache_tokens // p.block_size
    kv_bytes = num_blocks * p.block_size * kv_bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, getattr(torch, p.dtype))
    warmup = np.random.default_rng([p.seed, 9]).integers(100, spec.vocab_size, (2 * p.num_replicas, 64)).tolist()
    runs, info = {}, {}
    with local_ray("bench routing", _progress, start_serve=True):
        for policy in POLICIES:
            config = routing_real.serve_config(
                model_dir, p.dtype, policy, num_replicas=p.num_replicas, kv_cache_bytes=kv_bytes,
                stats_period_s=p.stats_period_s, max_model_len=max(2048, workload.spec.prompt_len + 1),
                params=p.policy_params(policy),
            )
            runs[policy], info[policy] = routing_real.run_policy(policy, workload, config, warmup, _progress)
    oracle, pinned = _oracle_rate(workload, p.num_replicas, num_blocks)
    return {
        "spec": workload.spec, "num_replicas": p.num_replicas, "num_blocks": num_blocks, "oracle_hit_rate": oracle,
        "oracle_pinned_blocks": pinned, "figures": policy_figures(runs, oracle), "info": info,
        "model_dir": str(model_dir), "kv_cache_bytes": kv_bytes,
    }


def _to_json(part: dict) -> dict:
    return {**part, "spec": dataclasses.asdict(part["spec"])}


def run(p: BenchParams, *, command: str = "") -> dict:
    """Calibrate (unless told the rate), run, print the table; returns {summary, config, raw, hardware}."""
    started = time.monotonic()
    machine = hardware.machine_record(num_threads=1)  # torch threads per prefill replica
    if p.dtype == "auto":
        from load_tests.roofline import resolve_dtype
        from serving.engine.modeling.loader import resolve_model_dir

        p = dataclasses.replace(p, dtype=resolve_dtype(p.dtype, resolve_model_dir(p.model)).dtype)
    cost, calibration = _cost_model(p)
    if p.pressure_sweep:
        return _run_sweep(p, cost, calibration, machine, started, command)
    sweep: dict[int, dict] = {}
    simulated = None
    if p.simulate:
        headline = simulate_all(p, cost, p.num_replicas)
        for n in p.sweep:
            sweep[n] = simulate_all(p, cost, n)
        source = f"simulation, {p.num_replicas} replicas"
    else:
        workload = make_workload(_spec(p, cost, p.num_replicas))
        headline = _run_real(p, cost, workload)
        simulated = simulate_all(p, cost, p.num_replicas, workload)
        source = f"real, {p.num_replicas} replicas"
        import ray

        machine["ray_version"] = ray.__version__
    hardware.finish_machine_record(machine)
    summary = summarize(headline["figures"], headline["oracle_hit_rate"], source)
    print(format_table(p, headline, summary, sweep, simulated=simulated))
    if load_note(machine["load_avg_1m_at_start"]) and not p.simulate:
        print(load_note(machine["load_avg_1m_at_start"]))
    raw = {"simulation" if p.simulate else "real": {str(p.num_replicas): _to_json(headline)}}
    if p.simulate:
        raw["simulation"].update({str(n): _to_json(part) for n, part in sweep.items()})
    else:
        raw["simulation"] = {str(p.num_replicas): _to_json(simulated)}
    raw["wall_s"] = time.monotonic() - started
    return {
        "summary": summary,
        "config": {"command": command, "params": dataclasses.asdict(p), "calibration": calibration,
                   "cost_model": dataclasses.asdict(cost)},
        "raw": raw,
        "hardware": machine,
    }


def _simulate_cell(p: BenchParams, cost: CostModel, cell: Cell) -> dict:
    prompt_len = p.prefix_len + p.suffix_len
    spec = WorkloadSpec(
        num_groups=cell.num_groups, prefix_len=p.prefix_len, suffix_len=p.suffix_len, num_requests=cell.num_requests,
        request_rate_per_s=p.load * cell.num_replicas / cost.service_s(prompt_len, 0), zipf_s=cell.zipf,
        block_size=p.block_size, seed=p.seed,
    )
    workload = make_workload(spec)
    config = sim_config(cell, block_size=p.block_size, stats_period_s=p.stats_period_s, num_routers=p.num_routers, seed=p.seed)
    oracle, _ = _oracle_rate(workload, cell.num_replicas, config.num_blocks)
    total = sum(request.num_prompt_tokens for request in workload.requests)
    prior_hit, _, _ = oracle_hit_tokens(workload, cell.num_replicas, config.num_blocks, foresight=False)
    pool_blocks = cell.num_replicas * config.num_blocks
    references = {
        "prior_oracle_hit_rate": prior_hit / total,
        "pooled_lru_hit_rate": pooled_lru_hit_tokens(workload, pool_blocks) / total,
        "pooled_optimal_hit_rate": pooled_optimal_hit_tokens(workload, pool_blocks) / total,
    }
    references["single_home_hit_rate"], references["single_home_load_floor"] = single_home(workload, cell.num_replicas)
    runs = {policy: simulate(workload, policy, config, cost, p.policy_params(policy)) for policy in POLICIES}
    runs[OracleReplayPolicy.name] = simulate(
        workload, OracleReplayPolicy.name, config, cost,
        policy_object=lambda seed: OracleReplayPolicy(workload, cell.num_replicas, config.num_blocks, seed),
    )
    several = {}
    if p.num_routers > 1:  # ours once more with one router: what several must stay close to
        ours = p.policy_params("prefix_cost")
        one = dataclasses.replace(config, num_routers=1)
        runs[ONE_ROUTER] = dataclasses.replace(simulate(workload, "prefix_cost", one, cost, ours), policy=ONE_ROUTER)
        # A run's hit rate moves by a few percent with the stats timers' phases alone (the
        # seed), as much as the routers' number does under pressure: several seeds of each,
        # compared by their means (routing/sweep.py).
        hits_one, hits_several = [runs[ONE_ROUTER].hit_rate], [runs["prefix_cost"].hit_rate]
        for k in range(1, p.router_seeds):
            seeded = dataclasses.replace(config, seed=p.seed + k)
            hits_several.append(simulate(workload, "prefix_cost", seeded, cost, ours).hit_rate)
            hits_one.append(simulate(workload, "prefix_cost", dataclasses.replace(seeded, num_routers=1), cost, ours).hit_rate)
        several = {"router_seeds": p.router_seeds, "one_router_hit_rates": hits_one, "several_routers_hit_rates": hits_several}
    figures = policy_figures(runs, oracle)
    for f in figures.values():  # per-replica detail: the main runs have it; here it would be most of the file
        del f["computed_tokens_by_replica"], f["requests_by_replica"]
    return {"request_rate_per_s": spec.request_rate_per_s, "oracle_hit_rate": oracle, **references, **several, "figures": figures}


def _run_sweep(p: BenchParams, cost: CostModel, calibration: dict, machine: dict, started: float, command: str) -> dict:
    grid_cells = cells(p.grid, prefix_len=p.prefix_len, suffix_len=p.suffix_len, block_size=p.block_size)
    records = run_cells(grid_cells, lambda cell: _simulate_cell(p, cost, cell), _progress)
    hardware.finish_machine_record(machine)
    summary = {**summarize_sweep(records), "source": f"simulation, pressure sweep, {p.num_routers} router(s)"}
    print(format_sweep(records, summary, cost))
    return {
        "summary": summary,
        "config": {"command": command, "params": dataclasses.asdict(p), "calibration": calibration,
                   "cost_model": dataclasses.asdict(cost)},
        "raw": {"cells": records, "wall_s": time.monotonic() - started},
        "hardware": machine,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--simulate", action="store_true", help="simulated replicas instead of a real pool (seconds, no Ray)")
    p.add_argument(
        "--pressure-sweep", action="store_true",
        help="with --simulate: every policy over a grid of prefix groups (16-256), Zipf skew (0-1.2), replicas (8-64) "
        "and cache sizes (ample to a quarter of the working set); summary: ours' worst cell against the oracle and the "
        "tree (load_tests/routing/sweep.py; ~minutes, --quick a smaller grid)",
    )
    p.add_argument("--quick", action="store_true", help="smaller preset (simulate: 800 requests, no sweep; real: 4 prefixes, 24 requests)")
    p.add_argument("--json", metavar="PATH", help="write summary, config (with the calibration), raw results and hardware here")
    p.add_argument("--grid-groups", metavar="N,N,...", help="--pressure-sweep: prefix groups [16,64,256]")
    p.add_argument("--grid-zipf", metavar="S,S,...", help="--pressure-sweep: Zipf skews [0,0.6,1.2; quick 0,1.2]")
    p.add_argument("--grid-replicas", metavar="N,N,...", help="--pressure-sweep: replica counts [8,16,64; quick 8,16]")
    p.add_argument("--grid-cache", metavar="R,R,...",
                   help="--pressure-sweep: pool KV / working set, the first one 'ample' [4,1,0.5,0.25; quick 4,0.5,0.25]")
    p.add_argument("--grid-requests-per-group", type=int, metavar="N",
                   help="--pressure-sweep: requests per prefix group, at least --grid-min-requests [12; quick 8]")
    p.add_argument("--grid-min-requests", type=int, metavar="N", help="--pressure-sweep: requests per cell at least [2000; quick 1000]")
    p.add_argument("--num-groups", type=int, metavar="N", help="prefix groups [simulate 16; real 8]")
    p.add_argument("--prefix-len", type=int, metavar="TOKENS", help="shared prefix length [simulate 1024; real 512]")
    p.add_argument("--suffix-len", type=int, metavar="TOKENS", help="fresh tokens after the prefix [simulate 64; real 32]")
    p.add_argument("--num-requests", type=int, metavar="N", help="requests per policy [simulate 4000; real 60]")
    p.add_argument("--load", type=float, metavar="FRACTION", help="arrival rate as a fraction of the pool's capacity for uncached prompts [0.5]")
    p.add_argument("--request-rate", type=float, metavar="PER_S", help="arrival rate in requests/s (overrides --load)")
    p.add_argument("--zipf", type=float, metavar="S", help="group popularity ~ 1/(rank^S) [0: uniform]")
    p.add_argument("--num-replicas", type=int, metavar="N", help="prefill replicas [simulate 16; real 2]")
    p.add_argument("--sweep", metavar="N,N,...", help="further simulated replica counts, or 'none' [8,32,64; quick none]")
    p.add_argument("--kv-cache-tokens", type=int, metavar="TOKENS", help="KV cache per replica [simulate 4096; real 2560]")
    p.add_argument("--stats-period-s", type=float, metavar="S", help="routing stats period [0.5]")
    p.add_argument("--num-routers", type=int, metavar="N", help="simulated routers (ingress replicas), requests alternate [1]")
    p.add_argument("--router-seeds", type=int, metavar="N",
                   help="--pressure-sweep with --num-routers: compare ours with N routers and with one over N seeds [1]")
    p.add_argument("--model", help="model to calibrate on and serve [smollm2-135m-instruct]")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32", "float16"], help="weights and KV dtype [auto: as kvrelay picks on this machine]")
    p.add_argument("--rate-tokens-per-s", type=float, metavar="TOKENS", help="simulated prefill rate; skips the calibration")
    p.add_argument("--overhead-ms", type=float, metavar="MS", help="simulated per-prefill overhead with --rate-tokens-per-s [0]")
    p.add_argument("--calibration", metavar="FILE", help="reuse the calibration of an earlier --json report")
    p.add_argument("--calibration-repeats", type=int, metavar="N", help="timed prefills per prompt shape [3; quick 1]")
    p.add_argument(
        "--param", metavar="KEY=VALUE", action="append",
        help="a parameter of ours (PrefixCostPolicy, router/policies.py), YAML value; repeatable, e.g. --param max_load_ratio=null",
    )
    p.add_argument("--seed", type=int, help="seed of the workload and the policies [0]")


def params_from_args(args: argparse.Namespace) -> BenchParams:
    """The preset (--simulate or real, --quick or full), overridden by every knob given."""
    if getattr(args, "pressure_sweep", False):
        if not args.simulate:
            raise SystemExit("--pressure-sweep runs simulated replicas only: add --simulate")
        preset = SWEEP_QUICK_PRESET if args.quick else SWEEP_PRESET
    elif args.simulate:
        preset = SIM_QUICK if args.quick else SIM_FULL
    else:
        preset = REAL_QUICK if args.quick else REAL_FULL
    names = {f.name for f in dataclasses.fields(BenchParams)} - {"simulate", "quick", "sweep", "ours_params", "pressure_sweep", "grid"}
    given = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    if getattr(args, "sweep", None) is not None:
        given["sweep"] = tuple(int(n) for n in args.sweep.split(",") if n.strip()) if args.sweep != "none" else ()
    if getattr(args, "param", None):
        given["ours_params"] = tuple(_key_value(item) for item in args.param)
    grid = _grid_from_args(args, preset.grid)
    if grid != preset.grid:
        if not preset.pressure_sweep:
            raise SystemExit("--grid-* options shape the --pressure-sweep grid: add --simulate --pressure-sweep")
        given["grid"] = grid
    p = dataclasses.replace(preset, **given)
    for name in ("num_groups", "num_requests", "num_replicas", "suffix_len", "num_routers", "block_size", "router_seeds"):
        if getattr(p, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(p, name)}")
    if p.prefix_len < 0:
        raise SystemExit(f"--prefix-len must be >= 0, got {p.prefix_len}")
    if p.load <= 0 or (p.request_rate is not None and p.request_rate <= 0):
        raise SystemExit("--load and --request-rate must be > 0")
    if p.rate_tokens_per_s is not None and p.rate_tokens_per_s <= 0:
        raise SystemExit(f"--rate-tokens-per-s must be > 0, got {p.rate_tokens_per_s}")
    prompt_blocks = -(-(p.prefix_len + p.suffix_len) // p.block_size)
    if p.kv_cache_tokens // p.block_size < prompt_blocks:
        raise SystemExit(f"--kv-cache-tokens {p.kv_cache_tokens} cannot hold one {p.prefix_len + p.suffix_len}-token prompt")
    if any(n < 1 for n in p.sweep):
        raise SystemExit(f"--sweep wants replica counts >= 1, got {p.sweep}")
    from router.policies import build_policy

    try:
        build_policy("prefix_cost", **dict(p.ours_params))
    except ValueError as exc:
        raise SystemExit(f"--param: {exc}") from None
    return p


def _grid_from_args(args: argparse.Namespace, grid: SweepGrid) -> SweepGrid:
    def numbers(option: str, text: str | None, kind):
        if text is None:
            return None
        try:
            values = tuple(kind(item) for item in text.split(",") if item.strip())
        except ValueError:
            raise SystemExit(f"--{option} wants comma-separated numbers, got {text!r}") from None
        if not values or any(value < 0 or (kind is int and value < 1) for value in values):
            raise SystemExit(f"--{option} wants {'counts >= 1' if kind is int else 'values >= 0'}, got {text!r}")
        return values

    given = {
        "num_groups": numbers("grid-groups", getattr(args, "grid_groups", None), int),
        "zipf": numbers("grid-zipf", getattr(args, "grid_zipf", None), float),
        "num_replicas": numbers("grid-replicas", getattr(args, "grid_replicas", None), int),
        "cache_ratios": numbers("grid-cache", getattr(args, "grid_cache", None), float),
        "requests_per_group": getattr(args, "grid_requests_per_group", None),
        "min_requests": getattr(args, "grid_min_requests", None),
    }
    if any(ratio <= 0 for ratio in given["cache_ratios"] or ()):
        raise SystemExit(f"--grid-cache wants ratios > 0, got {args.grid_cache!r}")
    for name in ("requests_per_group", "min_requests"):
        if given[name] is not None and given[name] < 1:
            raise SystemExit(f"--grid-{name.replace('_', '-')} must be >= 1, got {given[name]}")
    return dataclasses.replace(grid, **{name: value for name, value in given.items() if value is not None})


def _key_value(item: str) -> tuple[str, object]:
    import yaml

    key, sep, value = item.partition("=")
    if not sep or not key:
        raise SystemExit(f"--param wants KEY=VALUE, got {item!r}")
    return key, yaml.safe_load(value)


def run_from_args(args: argparse.Namespace, argv: list[str]) -> int:
    return run_and_report(args, argv, params_from_args, run, _progress)
