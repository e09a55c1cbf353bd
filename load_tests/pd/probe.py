"""The CPU cost fit of the prefill/decode simulator, measured on this machine: engine steps timed
one by one (`probe_steps`), the step-time model fitted to them (pd_costs.fit_step_cost), the
served path's overheads (`overhead_of`) and the KV hand-off (`handoff_of`).

The served path's overheads are measured by load_tests/pd/served_probe.py (the scenario's pinned
layouts); the KV hand-off comes from a `kvrelay bench serve-overhead` report of this machine.

One in-process LLMEngine as a served replica runs it: one torch thread, the serving engine
defaults (512-token step budget, long prompts 256 tokens a step, one long prompt at a time),
prefix caching off (every prompt computed), detokenizing off (the ingress does that). Each step
is timed whole (`engine.step()`: schedule, forward, sample, outputs), and its shape read from
the scheduler's output before the step runs:

    decode      b prompts of 128 tokens, then 12 decode steps (b = 1, 2, 4, 8, 16); the same
                with 1024-token prompts at b = 1, 4 (chunked prefill, long-context decode)
    mixed       4 rows decoding while a 1200-token prompt arrives (256-token chunks beside the
                rows), then a 160-token prompt (one chunk beside them); 2 rows beside a
                2304-token prompt (chunks after up to 2048 computed tokens); 4 rows beside a
                3870-token prompt (pd-interference's burst: chunks after up to 3840 computed
                tokens, the last of 30)
    prefill     single prompts of 16, 64, 256, 512, 2304 and 3870 tokens
    long        2 prompts of 3584 tokens, then 12 decode steps: a row decoding at 3.6k tokens of
                context beside the other's chunks, then both alone

Every scenario runs `repeats` times with fresh random prompts; the scheduler is deterministic,
so step i has the same shape each time, and its time is the median over the repeats (a step
another process delayed does not pull the fit). The fit's points, residuals and the machine
(lscpu model, ISA flags) go into the fit's `info`.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from load_tests import hardware
from load_tests.pd.costs import (
    CostFit,
    HandoffCost,
    LayoutOverhead,
    ServeOverhead,
    StepPoint,
    StepShape,
    chunk_pairs,
    fit_step_cost,
)
from load_tests.pd.probe_engine import PROBE_ENGINE, probe_engine
from load_tests.roofline import torch_threads

__all__ = ["SCENARIOS", "cpu_fit", "handoff_of", "overhead_of", "probe_steps", "step_shape"]

# scenario name -> list of (arrive after step k, prompt length, max_tokens)
SCENARIOS: dict[str, list[tuple[int, int, int]]] = {
    **{f"decode-b{b}": [(0, 128, 13)] * b for b in (1, 2, 4, 8, 16)},
    **{f"decode-long-b{b}": [(0, 1024, 13)] * b for b in (1, 4)},
    "mixed": [(0, 128, 60)] * 4 + [(3, 1200, 1), (12, 160, 1)],
    "mixed-long": [(0, 128, 30)] * 2 + [(2, 2304, 1)],
    "mixed-3870": [(0, 128, 40)] * 4 + [(2, 3870, 1)],
    "decode-3584-b2": [(0, 3584, 13)] * 2,
    **{f"prefill-{n}": [(0, n, 1)] for n in (16, 64, 256, 512, 2304, 3870)},
}


def step_shape(scheduled) -> StepShape:
    """The shape of a step from the scheduler's (sequence, new tokens) list, before it runs."""
    tokens = rows = pairs = context = prefix = 0
    for seq, num_new in scheduled:
        tokens += num_new
        if seq.num_computed_tokens < seq.num_prompt_tokens:  # a prompt chunk
            pairs += chunk_pairs(num_new, seq.num_computed_tokens)
            prefix += seq.num_computed_tokens
            rows += seq.num_computed_tokens + num_new >= seq.num_prompt_tokens
        else:  # a decoding row: reads its computed tokens and itself
            rows += 1
            context += seq.num_computed_tokens + num_new
    return StepShape(tokens, rows, pairs, context, prefix)


def _run_scenario(engine, plan: list[tuple[int, int, int]], draw: Callable[[int], list[int]]) -> list[tuple[StepShape, float]]:
    from serving.engine import SamplingParams

    shapes: list[tuple[StepShape, float]] = []
    captured: list = []
    schedule = engine.scheduler.schedule

    def capture():
        out = schedule()
        captured.append(step_shape(out.scheduled))
        return out

    engine.scheduler.schedule = capture
    try:
        pending = sorted(enumerate(plan), key=lambda item: item[1][0])
        step = 0
        while pending or engine.has_unfinished_requests():
            while pending and pending[0][1][0] <= step:
                i, (_, length, max_tokens) = pending.pop(0)
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
                engine.add_request(f"probe-{id(plan)}-{i}-{time.monotonic_ns()}", prompt_token_ids=draw(length), params=params)
            captured.clear()
            started = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - started
            if captured and captured[0].num_tokens:
                shapes.append((captured[0], elapsed))
            step += 1
    finally:
        engine.scheduler.schedule = schedule
    return shapes


def probe_steps(model_dir: Path, dtype: str, *, repeats: int = 3, seed: int = 0, scenarios: tuple[str, ...] = tuple(SCENARIOS),
                progress: Callable[[str], None] = lambda message: None) -> list[StepPoint]:
    """The steps of `scenarios`, each the median of `repeats` runs (module docstring)."""
    import numpy as np

    with torch_threads(1):
        engine = probe_engine(model_dir, dtype)
        rng = np.random.default_rng([seed, 19])

        def draw(length: int) -> list[int]:
            return rng.integers(100, engine.vocab_size, length).tolist()

        _run_scenario(engine, SCENARIOS["decode-b4"], draw)  # warm-up: kernels, allocator
        points: list[StepPoint] = []
        for name in scenarios:
            plan = SCENARIOS[name]
            runs = [_run_scenario(engine, plan, draw) for _ in range(repeats)]
            shapes = [shape for shape, _ in runs[0]]
            for run in runs[1:]:
                assert [shape for shape, _ in run] == shapes, f"{name}: the steps differ between repeats"
            for i, shape in enumerate(shapes):
                points.append(StepPoint(shape, statistics.median(run[i][1] for run in runs)))
            progress(f"probe {name}: {len(shapes)} steps, median step {statistics.median(p.seconds for p in points[-len(shapes):]) * 1e3:.1f} ms")
    return points


def handoff_of(report: dict) -> tuple[HandoffCost, dict]:
    """The KV hand-off from a `kvrelay bench serve-overhead` JSON: its arena hand-off p50 of
    kv_tokens, taken as proportional to the tokens (fixed_s = 0: one size was measured)."""
    s = report["summary"]
    kv_tokens = report["config"]["params"]["kv_tokens"]
    seconds = s["kv_transfer_ms_p50"] * 1e-3
    handoff = HandoffCost(0.0, s["kv_transfer_bytes"] / kv_tokens, s["kv_transfer_bytes"] / seconds)
    return handoff, {"kv_tokens": kv_tokens, "kv_transfer_ms_p50": s["kv_transfer_ms_p50"],
                     "kv_transfer_bytes": s["kv_transfer_bytes"]}


def overhead_of(served: dict, fit: CostFit) -> tuple[ServeOverhead, dict]:
    """The served path's overheads per layout from a probe_served result (pd/served_probe.py).
    `fit`: the engine's costs (steps, hand-off, co-run, engine limits; its overhead unused). The
    per-step overhead comes last: each round is replayed through pd_sim with every other
    overhead of its layout, on the probe's layout (one worker and a spare core; one prefill and
    one decode replica), and step_s + row_s is what the served TPOT has beyond the replay's."""
    from load_tests.pd.served_probe import LAYOUT_CORES, fit_overhead, prefill_replica_s, request_overhead_s, serving_cpu
    from load_tests.pd.sim import SimRequest, simulate

    layouts, info = {}, {}
    for layout, measured in served.items():
        per_request, per_token, per_second = serving_cpu(measured)
        # The one-stream TTFT beyond the engine's prefill includes the prefill replica's own work,
        # which pd_sim charges to that replica's core: the rest is latency on other processes.
        own = prefill_replica_s(measured, fit.step.prefill_s)
        rest = LayoutOverhead(max(0.0, request_overhead_s(measured, fit.step.prefill_s) - own), 0.0, 0.0,
                              per_request, per_token, per_second, own)
        engine = dataclasses.replace(fit, overhead=ServeOverhead(**{layout: rest}))

        def engine_tpot_s(prompt_tokens: list[int], output_tokens: int, engine=engine, layout=layout) -> list[float]:
            requests = [SimRequest(i, 0.0, tokens, output_tokens) for i, tokens in enumerate(prompt_tokens)]
            num_prefill = int(layout == "disaggregated")
            run = simulate(requests, engine, layout, num_prefill=num_prefill, num_decode=1, router="least_loaded",
                           spare_cores=LAYOUT_CORES - num_prefill - 1)
            return [r.tpot_s for r in run.results]

        step_s, row_s, points = fit_overhead(measured, engine_tpot_s)
        layouts[layout] = dataclasses.replace(rest, step_s=step_s, row_s=row_s)
        info[layout] = {"tpot_points": points}
    return ServeOverhead(**layouts), info


def cpu_fit(model_dir: Path, dtype: str, serve_overhead: dict, *, repeats: int = 3, earlier: dict | None = None,
            kv_cache_bytes: int = 512 * 2**20, progress: Callable[[str], None] = lambda message: None) -> CostFit:
    """This machine's fit: probed steps and the served probe, measured now, or taken from
    `earlier` (an earlier cpu fit's JSON: its points and served probe, fitted again), and the KV
    hand-off of a serve-overhead report of this machine."""
    import torch

    from load_tests.pd.served_probe import mend_actor_names, probe_served
    from serving.engine.kv.cache import kv_bytes_per_token
    from serving.engine.modeling.loader import load_model_spec

    machine = hardware.machine_record(num_threads=1)
    if earlier:
        if any("num_prefix" not in p for p in earlier["info"]["points"]):
            raise SystemExit("kvrelay bench pd-sim --refit: that fit's steps were probed before the prefix term (their "
                             "chunks' computed tokens were not recorded); probe again (without --refit)")
        points = [StepPoint(StepShape(p["num_tokens"], p["num_rows"], p["num_pairs"], p["num_context"], p["num_prefix"]),
                            p["seconds"]) for p in earlier["info"]["points"]]
        served = mend_actor_names(earlier["info"]["served_probe"])
        machine = earlier["info"]["machine"]
    else:
        points = probe_steps(model_dir, dtype, repeats=repeats, progress=progress)
    step, quality = fit_step_cost(points)
    if not earlier:
        served = probe_served(model_dir, dtype, progress=progress)
    handoff, handoff_info = handoff_of(serve_overhead)
    if earlier:
        corun = earlier["info"].get("corun_probe", {"corun_s": earlier.get("corun_s", 0.0),
                                                    "corun_ref_s": earlier.get("corun_ref_s", CostFit.corun_ref_s)})
    else:
        from load_tests.pd.corun import probe_corun

        corun = probe_corun(model_dir, dtype, progress=progress)
    if earlier:  # its KV capacity as it was: a refit needs no model files (the fit's model dir was another machine's cache)
        kv_capacity_tokens = earlier["kv_capacity_tokens"]
    else:
        spec = load_model_spec(model_dir)
        kv_capacity_tokens = kv_cache_bytes // kv_bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                                                  getattr(torch, dtype))
        hardware.finish_machine_record(machine)
    engine = CostFit(name="cpu", step=step, handoff=handoff, **PROBE_ENGINE, kv_capacity_tokens=kv_capacity_tokens,
                     corun_s=corun["corun_s"], corun_ref_s=corun.get("corun_ref_s", CostFit.corun_ref_s))
    overhead, served_info = overhead_of(served, engine)
    return dataclasses.replace(
        engine, overhead=overhead,
        source=f"this machine: {machine['cpu_model']}, {dtype}, 1 torch thread; steps probed in-process "
        "(load_tests/pd/probe.py), the served path's overheads in pd-interference's pinned layouts "
        "(load_tests/pd/served_probe.py), the KV hand-off from a kvrelay bench serve-overhead report",
        assumptions=("a served replica's overhead is step_s + row_s x sampled rows, fitted over 1-8 streams at once against "
                     "the same rounds replayed through pd_sim",
                     "the other serving processes' CPU is taken evenly from the busy replicas' cores",
                     "the KV hand-off time is proportional to the prompt's tokens",
                     "a step that starts while another replica's core is mid-step takes corun_s longer (load_tests/pd/corun.py)"),
        info={"fit_quality": quality, "machine": machine, "model_dir": str(model_dir), "dtype": dtype,
              "load_avg_1m": os.getloadavg()[0], "handoff": handoff_info, "served_probe": served,
              "served_fit": served_info, "corun_probe": corun,
              "points": [{**vars(p.shape), "seconds": p.seconds, "model_s": step.shape_s(p.shape)} for p in points]},
    )
