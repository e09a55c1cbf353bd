"""What a served, pinned replica adds to its engine's steps on this machine, for the CPU cost fit
(load_tests/pd_probe.py), measured apart from any scenario the simulator is checked against.

`kvrelay bench serve-overhead` measures the served path with unpinned replicas and one request
at a time: there the replica's own serving work (its event loop turning each step's outputs into
a stream, Ray's RPC threads) runs on the other core, and nothing is added to a step. The
pd-interference scenario pins each replica to one core (cpu_affinity), so that work shares the
engine's core, and grows with the streams the replica serves. This probe measures it in the
scenario's layouts:

    colocated      one Worker pinned to core 1 (core 0 left to the proxy, ingress and client)
    disaggregated  prefill pinned to core 0, decode to core 1, as the scenario

For k = 1, 2, 4, 8 streams at once (chat prompts of ~160 tokens, 64 output tokens, ignore_eos),
`rounds` times each: the served TPOT's median. The engine in-process decodes k rows at that
context in CostFit.step.decode_s(k, context); the difference, fitted over k as
`step_s + row_s * k`, is the served overhead per step and per streamed row
(pd_costs.ServeOverhead.*_step_s, *_row_s). Each round also records the CPU seconds every
process used (/proc: the replicas, the proxy, the ingress, the rest of Ray, this client). What
the processes other than the engines use, per streamed token, is the serving work that in the
scenario competes with the engines for the two cores (`serving_cpu_per_token`,
ServeOverhead.*_cpu_per_token_s): here core 0 is mostly free for it in the colocated layout,
there both cores are busy.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

__all__ = ["LAYOUTS", "REPLICAS", "STREAMS", "cpu_delta", "cpu_seconds_by_process", "fit_overhead", "probe_served",
           "serving_cpu_per_token"]

STREAMS = (1, 2, 4, 8)
LAYOUTS = ("colocated", "disaggregated")
PROMPT_WORDS = 128  # ~160 prompt tokens with the chat template (the scenario's chat: 64-192 words)
OUTPUT_TOKENS = 64


REPLICAS = ("Worker", "PrefillWorker", "DecodeWorker")  # the engines' processes: the rest is serving work


def cpu_seconds_by_process() -> dict[int, tuple[str, float]]:
    """{pid: (short name, CPU seconds user + system)} of every user-space process of this machine
    (kernel threads, with no command line, are left out): Ray's actors by their title
    (ray::ServeReplica:app:Worker -> "Worker"), this process as "client", others by command."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if not cmdline:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        name = cmdline.rsplit(":", 1)[-1] if cmdline.startswith("ray::") else Path(cmdline).name
        out[int(pid)] = ("client" if int(pid) == os.getpid() else name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each process name used between two snapshots (a process that started in
    between counts whole)."""
    out: dict[str, float] = {}
    for pid, (name, seconds) in after.items():
        out[name] = out.get(name, 0.0) + seconds - (before[pid][1] if pid in before else 0.0)
    return out


async def _round(base_url: str, k: int, rng: np.random.Generator) -> list:
    from load_tests.serve_client import RequestSpec, ServeClient
    from load_tests.serve_datasets import random_text

    async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
        client = ServeClient(http, model=await ServeClient.first_model(http), ignore_eos=True,
                             extra_body={"cache_salt": f"probe-{time.monotonic_ns()}"})
        specs = [RequestSpec(i, OUTPUT_TOKENS, messages=[{"role": "user", "content": random_text(rng, PROMPT_WORDS)}])
                 for i in range(k)]
        t0 = client.clock.now()
        return await asyncio.gather(*(client.send(spec, scheduled_s=0.0, t0=t0) for spec in specs))


def probe_served(model_dir: Path, dtype: str, *, rounds: int = 3, seed: int = 0,
                 progress: Callable[[str], None] = lambda message: None) -> dict:
    """{layout: {k: {"tpot_s": median, "context": mean prompt + half the output, "cpu_s": {...}}}}."""
    from load_tests import local_ray
    from load_tests.bench_scenario import ScenarioParams, config_url, kvrelay_config
    from load_tests.scenario_servers import kvrelay_server

    rng = np.random.default_rng([seed, 23])
    params = ScenarioParams(name="pd-interference", model=str(model_dir), dtype=dtype,
                            overrides=(("worker.num_replicas", 1), ("worker.cpu_affinity", [[1]])))
    port = local_ray.free_port()
    out: dict = {}
    with local_ray.local_ray("bench pd-sim (served probe)", progress):
        for layout in LAYOUTS:
            config = kvrelay_config(params, model_dir, layout, port, app=f"kvrelay-pd-probe-{layout}")
            out[layout] = {}
            with kvrelay_server(config, progress=progress):
                asyncio.run(_round(config_url(config), 2, rng))  # warm-up
                for k in STREAMS:
                    tpots, contexts, cpu = [], [], {}
                    for _ in range(rounds):
                        before = cpu_seconds_by_process()
                        records = asyncio.run(_round(config_url(config), k, rng))
                        after = cpu_seconds_by_process()
                        for name, seconds in cpu_delta(before, after).items():
                            cpu[name] = cpu.get(name, 0.0) + seconds
                        failed = [r.error for r in records if not r.is_success]
                        assert not failed, f"the served probe's requests failed: {failed[:2]}"
                        tpots += [r.tpot_s for r in records]
                        contexts += [r.num_prompt_tokens + OUTPUT_TOKENS / 2 for r in records]
                    out[layout][k] = {"tpot_s": statistics.median(tpots), "context": round(statistics.mean(contexts)),
                                      "num_tokens": sum(r.num_output_tokens for r in records) * rounds,
                                      "cpu_s": {name: round(s, 3) for name, s in sorted(cpu.items()) if s >= 0.01}}
                    progress(f"served probe, {layout}: {k} streams, TPOT p50 {out[layout][k]['tpot_s'] * 1e3:.1f} ms")
    return out


def serving_cpu_per_token(measured: dict) -> float:
    """CPU seconds the processes other than the engines' used per streamed token, over every
    stream count of one layout of probe_served's result (per-request work included, spread over
    the requests' 64 tokens)."""
    serving = sum(s for m in measured.values() for name, s in m["cpu_s"].items() if name not in REPLICAS)
    return serving / sum(m["num_tokens"] for m in measured.values())


def fit_overhead(measured: dict, decode_s: Callable[[int, int], float]) -> tuple[float, float, list[dict]]:
    """(step_s, row_s) >= 0 by least squares of served TPOT - decode_s(k, context) over k, and the
    points. `measured`: one layout of probe_served's result."""
    points = [{"streams": int(k), "served_s": m["tpot_s"], "engine_s": decode_s(int(k), m["context"])}
              for k, m in measured.items()]
    ks = np.array([p["streams"] for p in points], dtype=float)
    extra = np.array([p["served_s"] - p["engine_s"] for p in points])
    design = np.stack([np.ones_like(ks), ks], axis=1)
    (step_s, row_s), *_ = np.linalg.lstsq(design, extra, rcond=None)
    if row_s < 0:
        step_s, row_s = max(0.0, float(extra.mean())), 0.0
    elif step_s < 0:
        step_s, row_s = 0.0, max(0.0, float((extra * ks).sum() / (ks * ks).sum()))
    return float(step_s), float(row_s), points
