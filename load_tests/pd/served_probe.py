"""What the served path adds to the engine on this machine, in pd-interference's pinned layouts,
for the CPU cost fit (load_tests/pd/probe.py): measured apart from any scenario the simulator is
checked against.

`kvrelay bench serve-overhead` measures the served path with unpinned replicas and one request
at a time. The scenario pins each replica to a core of its own (cpu_affinity) and has the
proxy, ingress, controller and the load client share the two cores with them. This probe
deploys the scenario's layouts on a local Ray:

    colocated      one Worker pinned to core 1
    disaggregated  prefill pinned to core 0, decode to core 1, as the scenario

and measures, per layout (pd_costs.LayoutOverhead):

    step_s, row_s      k = 1, 2, 4, 8 streams at once (chat prompts of ~160 tokens, 64 output
                       tokens, ignore_eos), `rounds` times each: the served TPOT p50 less the
                       engine's TPOT p50 of the same round replayed through pd_sim (the early
                       prompts decode beside the later ones' prefill), fitted over k as
                       step_s + row_s * k (`fit_overhead`)
    request_s          the one-stream rounds' TTFT less the engine's prefill of the prompt
                       (`request_overhead_s`)
    cpu_per_*,         the CPU seconds of every process but the engines' (/proc: proxy, ingress,
    background_cpu     controller, raylet, this client, ...) in each round and in an idle
                       interval, fitted as per second * wall + per request + per token (rounds
                       of 8 output tokens as well as 64 tell the last two apart, and a 20 s
                       Poisson chat stream at 1.2 requests/s, pd-interference's rate, weighs the
                       per-second part as the scenario runs it: `serving_cpu`)
    prefill_request_s  the prefill replica's own CPU per request beyond its engine's prefill,
                       in the Poisson stream (`prefill_replica_s`)
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

__all__ = ["LAYOUTS", "LAYOUT_CORES", "REPLICAS", "ROUNDS", "actor_of", "cpu_delta", "cpu_seconds_by_process", "fit_overhead",
           "mend_actor_names", "prefill_replica_s", "probe_served", "request_overhead_s", "serving_cpu"]

LAYOUTS = ("colocated", "disaggregated")
PROMPT_WORDS = 128  # ~160 prompt tokens with the chat template (the scenario's chat: 64-192 words)
OUTPUT_TOKENS = 64
# (requests, output tokens, Poisson rate or None: all at once)
ROUNDS = ((1, OUTPUT_TOKENS, None), (2, OUTPUT_TOKENS, None), (4, OUTPUT_TOKENS, None), (8, OUTPUT_TOKENS, None),
          (4, 8, None), (8, 8, None), (24, OUTPUT_TOKENS, 1.2))
IDLE_S = 4.0


LAYOUT_CORES = 2  # the layouts pin to cores 0 and 1; colocated leaves core 0 to the serving processes
REPLICAS = ("Worker", "PrefillWorker", "DecodeWorker")  # the engines' processes: the rest is serving work


def actor_of(title: str) -> str:
    """The actor a Ray worker's process title names. Ray retitles the process with the method it
    runs at that moment (ray::ServeReplica:app:DecodeWorker.record_routing_stats), so the
    method is dropped: "DecodeWorker". Kept, a snapshot that caught the decode replica in a
    method counted its CPU as the serving processes' (3.2 of 4.8 serving CPU-seconds in one
    2026-12-03 round), which inflated the serving CPU the fit charges to the replicas."""
    return title.removeprefix("ray::").rsplit(":", 1)[-1].split(".", 1)[0]


def cpu_seconds_by_process() -> dict[int, tuple[str, float]]:
    """{pid: (short name, CPU seconds user + system)} of every user-space process of this machine
    (kernel threads, with no command line, are left out): Ray's actors by their title
    (ray::ServeReplica:app:Worker -> "Worker", `actor_of`), this process as "client", others by command."""
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
        name = actor_of(cmdline) if cmdline.startswith("ray::") else Path(cmdline).name
        out[int(pid)] = ("client" if int(pid) == os.getpid() else name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each process name used between two snapshots (a process that started in
    between counts whole)."""
    out: dict[str, float] = {}
    for pid, (name, seconds) in after.items():
        out[name] = out.get(name, 0.0) + seconds - (before[pid][1] if pid in before else 0.0)
    return out


async def _round(base_url: str, k: int, output_tokens: int, rng: np.random.Generator, *, rate: float | None = None) -> list:
    """k requests at once, or (`rate`) a Poisson stream of k requests at that rate."""
    from load_tests.serve.client import RequestSpec, ServeClient
    from load_tests.serve.datasets import random_text

    async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
        client = ServeClient(http, model=await ServeClient.first_model(http), ignore_eos=True,
                             extra_body={"cache_salt": f"probe-{time.monotonic_ns()}"})
        specs = [RequestSpec(i, output_tokens, messages=[{"role": "user", "content": random_text(rng, PROMPT_WORDS)}])
                 for i in range(k)]
        t0 = client.clock.now()
        gaps = rng.exponential(1.0 / rate, k) if rate else np.zeros(k)

        async def send(spec, at_s: float):
            await asyncio.sleep(at_s)
            return await client.send(spec, scheduled_s=at_s, t0=t0)

        return await asyncio.gather(*(send(spec, float(at)) for spec, at in zip(specs, np.cumsum(gaps) - gaps[0])))


def mend_actor_names(served: dict) -> dict:
    """A probe_served result taken before `actor_of` (2026-12-03), mended: each snapshot's CPU by
    actor (a replica caught in a method, "DecodeWorker.record_routing_stats", merged into
    "DecodeWorker"), and the serving CPU less what such a replica's entry had added to it."""
    def mend(entry: dict) -> dict:
        cpu: dict[str, float] = {}
        misnamed = 0.0
        for name, seconds in entry["cpu_s"].items():
            actor = actor_of(name)
            cpu[actor] = round(cpu.get(actor, 0.0) + seconds, 3)
            if actor != name and actor in REPLICAS:
                misnamed += seconds
        return {**entry, "cpu_s": cpu, "serving_cpu_s": entry["serving_cpu_s"] - misnamed}

    return {layout: {**probe, "idle": mend(probe["idle"]), "rounds": [mend(r) for r in probe["rounds"]]}
            for layout, probe in served.items()}


def _serving(cpu: dict[str, float]) -> float:
    return sum(seconds for name, seconds in cpu.items() if name not in REPLICAS)


def probe_served(model_dir: Path, dtype: str, *, rounds: int = 3, seed: int = 0,
                 progress: Callable[[str], None] = lambda message: None) -> dict:
    """{layout: {"idle": {wall_s, serving_cpu_s, cpu_s}, "rounds": [{streams, output_tokens, wall_s,
    serving_cpu_s, cpu_s, tpot_s, ttft_s, prompt_tokens}]}} (lists: one value per request)."""
    from load_tests import local_ray
    from load_tests.scenario.bench import ScenarioParams, config_url, kvrelay_config
    from load_tests.scenario.servers import kvrelay_server

    rng = np.random.default_rng([seed, 23])
    params = ScenarioParams(name="pd-interference", model=str(model_dir), dtype=dtype,
                            overrides=(("worker.num_replicas", 1), ("worker.cpu_affinity", [[1]])))
    port = local_ray.free_port()
    out: dict = {}
    with local_ray.local_ray("bench pd-sim (served probe)", progress):
        for layout in LAYOUTS:
            config = kvrelay_config(params, model_dir, layout, port, app=f"kvrelay-pd-probe-{layout}")
            url = config_url(config)
            with kvrelay_server(config, progress=progress):
                asyncio.run(_round(url, 2, 8, rng))  # warm-up
                before, started = cpu_seconds_by_process(), time.monotonic()
                time.sleep(IDLE_S)
                cpu = cpu_delta(before, cpu_seconds_by_process())
                idle = {"wall_s": time.monotonic() - started, "serving_cpu_s": _serving(cpu), "cpu_s": _rounded(cpu)}
                runs = []
                for k, output_tokens, rate in ROUNDS:
                    for _ in range(rounds if rate is None else 1):
                        before, started = cpu_seconds_by_process(), time.monotonic()
                        records = asyncio.run(_round(url, k, output_tokens, rng, rate=rate))
                        wall_s = time.monotonic() - started
                        cpu = cpu_delta(before, cpu_seconds_by_process())
                        failed = [r.error for r in records if not r.is_success]
                        assert not failed, f"the served probe's requests failed: {failed[:2]}"
                        runs.append({"streams": k, "output_tokens": output_tokens, "rate": rate, "wall_s": wall_s,
                                     "serving_cpu_s": _serving(cpu), "cpu_s": _rounded(cpu),
                                     "tpot_s": [r.tpot_s for r in records], "ttft_s": [r.ttft_s for r in records],
                                     "prompt_tokens": [r.num_prompt_tokens for r in records]})
                    tpot = statistics.median(runs[-1]["tpot_s"])
                    shape = f"{k} at once" if rate is None else f"{k} at {rate:g}/s"
                    progress(f"served probe, {layout}: {shape} x {output_tokens} tokens, TPOT p50 {tpot * 1e3:.1f} ms, "
                             f"serving CPU {runs[-1]['serving_cpu_s'] / runs[-1]['wall_s']:.2f} cores")
            out[layout] = {"idle": idle, "rounds": runs}
    return out


def _rounded(cpu: dict[str, float]) -> dict[str, float]:
    return {name: round(seconds, 3) for name, seconds in sorted(cpu.items()) if seconds >= 0.01}


def fit_overhead(layout: dict, engine_tpot_s: Callable[[list[int], int], list[float]]) -> tuple[float, float, list[dict]]:
    """(step_s, row_s) >= 0 by least squares of served TPOT p50 - engine TPOT p50 over the stream
    counts k of the rounds of OUTPUT_TOKENS tokens, and the points. `layout`: one layout of
    probe_served's result; `engine_tpot_s(prompt_tokens, output_tokens)`: the TPOTs of a round's
    requests, all sent at once, as the engine alone serves them (pd_probe.overhead_of: the round
    replayed through pd_sim without the served step overhead). A round of k prompts at once is
    not k rows decoding: the first prompts decode beside the later ones' prefill chunks (three
    160-token prompts a 512-token step), and that interference is the engine's, which the
    simulator models. Taken against k rows' decode step instead, it was fitted as served overhead
    (colocated row_s 1.0 ms, 2026-12-03) and the replay charged it twice: colocated TPOT 38-79%
    high."""
    by_k: dict[int, list[dict]] = {}
    for run in layout["rounds"]:
        if run["output_tokens"] == OUTPUT_TOKENS and run.get("rate") is None:
            by_k.setdefault(run["streams"], []).append(run)
    points = []
    for k, runs in sorted(by_k.items()):
        engine = [t for run in runs for t in engine_tpot_s(run["prompt_tokens"], OUTPUT_TOKENS)]
        points.append({"streams": k, "served_s": statistics.median(t for run in runs for t in run["tpot_s"]),
                       "engine_s": statistics.median(engine)})
    ks = np.array([p["streams"] for p in points], dtype=float)
    extra = np.array([p["served_s"] - p["engine_s"] for p in points])
    step_s, row_s = _nonnegative_lstsq(np.stack([np.ones_like(ks), ks], axis=1), extra)
    return step_s, row_s, points


def request_overhead_s(layout: dict, prefill_s: Callable[[int], float]) -> float:
    """The served first token's delay beyond the engine's prefill: the median over the one-stream
    rounds of TTFT - prefill_s(prompt tokens), at least 0."""
    extra = [ttft - prefill_s(tokens) for run in layout["rounds"] if run["streams"] == 1 and run.get("rate") is None
             for ttft, tokens in zip(run["ttft_s"], run["prompt_tokens"])]
    return max(0.0, statistics.median(extra))


def prefill_replica_s(layout: dict, prefill_s: Callable[[int], float]) -> float:
    """The disaggregated prefill replica's own CPU seconds per request beyond its engine steps,
    at least 0: over the Poisson rounds (the scenario's regime: a prompt is prefilled alone, so
    its engine cost is prefill_s(prompt tokens)), its CPU less its idle rate x the round's wall
    time less the engine's prefills, per request. Every probe prompt has ~160 tokens, so a cost
    per request and one per prompt token cannot be told apart here; it is taken per request.
    0 for a layout without a PrefillWorker."""
    idle = layout["idle"]
    idle_rate = idle["cpu_s"].get("PrefillWorker", 0.0) / idle["wall_s"]
    rounds = [r for r in layout["rounds"] if r.get("rate") is not None and "PrefillWorker" in r["cpu_s"]]
    if not rounds:
        return 0.0
    extra = sum(r["cpu_s"]["PrefillWorker"] - idle_rate * r["wall_s"] - sum(prefill_s(t) for t in r["prompt_tokens"])
                for r in rounds)
    return max(0.0, extra / sum(r["streams"] for r in rounds))


def serving_cpu(layout: dict) -> tuple[float, float, float]:
    """(per request, per token, per second) CPU seconds of the processes other than the engines',
    by least squares >= 0 over the idle interval and every round:
    serving CPU = per_second * wall + per_request * streams + per_token * streams * tokens."""
    rows = [(layout["idle"]["wall_s"], 0.0, 0.0, layout["idle"]["serving_cpu_s"])]
    rows += [(r["wall_s"], r["streams"], r["streams"] * r["output_tokens"], r["serving_cpu_s"]) for r in layout["rounds"]]
    data = np.array(rows)
    per_second, per_request, per_token = _nonnegative_lstsq(data[:, [0, 1, 2]], data[:, 3])
    return per_request, per_token, per_second


def _nonnegative_lstsq(design: np.ndarray, target: np.ndarray) -> list[float]:
    """Least squares with every coefficient >= 0: the best fit over the subsets of columns whose
    coefficients all come out >= 0 (the empty subset: all 0)."""
    import itertools

    n = design.shape[1]
    best = (float((target**2).sum()), [0.0] * n)
    for size in range(1, n + 1):
        for columns in itertools.combinations(range(n), size):
            coef, *_ = np.linalg.lstsq(design[:, columns], target, rcond=None)
            if (coef < 0).any():
                continue
            residual = float(((design[:, columns] @ coef - target) ** 2).sum())
            if residual < best[0] - 1e-15:
                full = [0.0] * n
                for column, value in zip(columns, coef.tolist()):
                    full[column] = value
                best = (residual, full)
    return best[1]
