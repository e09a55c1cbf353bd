"""`kvrelay bench hostile`: does hostile input slow a normal client down?

Issue 17's check, measured instead of asserted: a normal stream's TTFT alone, then the same
stream while clients send the hostile requests of `load_tests/hostile/cases.py` as fast as they
are answered, each case from its own client, for the whole life of the stream.

    idle      round r: stream r alone                                  -> TTFT, E2E
    hostile   round r: 10 clients loop their case  ┐  until stream r   -> TTFT, E2E
                       stream r starts 50 ms later ┘  has ended           + every hostile answer

The app is the served one (`kvrelay serve`'s defaults, one replica, on a local Ray started for the
run), over real HTTP: a hostile body reaches Serve's proxy and the ingress as a client's would.
The streams are greedy random-token prompts (ignore_eos), the same prompts in both phases.
Reported: TTFT p50 and p95 per phase, their ratio (target: hostile p50 <= 2x idle p50, printed
as pass/miss, not enforced), and per case how many answers came back, their statuses against the
expected one, and their latency p50 and max. The hostile clients run on the same two cores as
the server: their own CPU (a 9 MiB chunked body, a 5,000-entry logit_bias) is part of what the
stream competes with, as on a shared host.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

from load_tests import hardware
from load_tests.common import StepLog, Target, run_and_report
from load_tests.hostile.cases import HostileCase, hostile_cases
from load_tests.local_ray import RAY_NUM_CPUS, free_port, local_ray
from load_tests.roofline import resolve_dtype

__all__ = ["DESCRIPTION", "FULL", "QUICK", "TARGETS", "BenchParams", "CaseResult", "add_arguments", "format_table", "params_from_args", "run",
           "run_from_args", "summarize"]

DESCRIPTION = (
    "Start the app (kvrelay serve's defaults, one replica) on a local Ray, time a normal "
    "stream's TTFT alone, then while ten clients loop issue 17's hostile requests (oversized "
    "and chunked bodies, nested JSON, a request's own template, fan-out, logit_bias, stop "
    "strings, unknown model, malformed JSON); report the TTFT ratio (target <= 2x) and every "
    "hostile answer's status and latency (load_tests/hostile/bench.py)."
)

HTTP_TIMEOUT_S = 300.0
STREAM_DELAY_S = 0.05  # the hostile clients are already sending when the stream starts


@dataclass(frozen=True)
class BenchParams:
    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"
    mode: str = "colocated"
    num_rounds: int = 8
    prompt_len: int = 256
    output_len: int = 32
    num_warmup: int = 2
    kv_cache_mib: int = 256
    seed: int = 0
    quick: bool = False


FULL = BenchParams()
QUICK = dataclasses.replace(FULL, num_rounds=3, output_len=16, quick=True)

TARGETS = (Target("ttft_ratio_p50", "normal stream TTFT p50 under hostile input / idle", "<=", 2.0, "x"),)


@dataclass
class CaseResult:
    name: str
    expected_status: int
    statuses: Counter = field(default_factory=Counter)
    latencies_s: list[float] = field(default_factory=list)
    num_errors: int = 0  # no HTTP answer at all (connection reset, timeout)

    @property
    def num_expected(self) -> int:
        return self.statuses[self.expected_status]

    def to_json(self) -> dict:
        lat = sorted(self.latencies_s)
        return {
            "name": self.name, "expected_status": self.expected_status,
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())}, "num_errors": self.num_errors,
            "latency_ms_p50": statistics.median(lat) * 1e3 if lat else None, "latency_ms_max": lat[-1] * 1e3 if lat else None,
        }


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def summarize(idle_ttft_s: list[float], hostile_ttft_s: list[float], cases: list[CaseResult]) -> dict:
    """Headline figures and the target's verdict (pure)."""
    idle, hostile = _pct(idle_ttft_s, 0.5), _pct(hostile_ttft_s, 0.5)
    summary = {
        "ttft_ms_p50_idle": idle and idle * 1e3,
        "ttft_ms_p95_idle": (_pct(idle_ttft_s, 0.95) or 0) * 1e3 if idle_ttft_s else None,
        "ttft_ms_p50_hostile": hostile and hostile * 1e3,
        "ttft_ms_p95_hostile": (_pct(hostile_ttft_s, 0.95) or 0) * 1e3 if hostile_ttft_s else None,
        "ttft_ratio_p50": hostile / idle if idle and hostile is not None else None,
        "num_hostile_requests": sum(sum(c.statuses.values()) + c.num_errors for c in cases),
        "num_hostile_unexpected": sum(sum(c.statuses.values()) - c.num_expected + c.num_errors for c in cases),
    }
    summary["targets"] = {t.key: {"target": t.text, "met": t.met(summary[t.key])} for t in TARGETS}
    return summary


def format_table(p: BenchParams, cases: list[CaseResult], summary: dict, machine: dict) -> str:
    isa = ", ".join(name for name, present in (machine.get("isa") or {}).items() if present) or "no listed ISA"
    lines = [
        f"CPU: {machine.get('cpu_model')} ({isa}); {machine.get('num_cores')} cores",
        f"normal stream: {p.prompt_len} random tokens -> {p.output_len}, greedy, {p.num_rounds} rounds per phase, {p.mode}",
        "",
        f"{'hostile case':36} {'answers':>8} {'as expected':>12} {'p50 ms':>9} {'max ms':>9}",
    ]
    for c in cases:
        j = c.to_json()
        answers = sum(c.statuses.values()) + c.num_errors
        p50 = "-" if j["latency_ms_p50"] is None else f"{j['latency_ms_p50']:.1f}"
        mx = "-" if j["latency_ms_max"] is None else f"{j['latency_ms_max']:.1f}"
        lines.append(f"{c.name:36} {answers:>8} {c.num_expected:>5} x {c.expected_status:<4} {p50:>9} {mx:>9}")
    s = summary
    lines += [
        "",
        f"normal stream TTFT p50 / p95: idle {s['ttft_ms_p50_idle']:.1f} / {s['ttft_ms_p95_idle']:.1f} ms, "
        f"under hostile input {s['ttft_ms_p50_hostile']:.1f} / {s['ttft_ms_p95_hostile']:.1f} ms",
    ]
    for t in TARGETS:
        value, met = s[t.key], s["targets"][t.key]["met"]
        lines.append(f"{t.label}: {value:.2f}{t.unit} (target {t.text}: {'pass' if met else 'miss'})")
    lines.append(f"hostile answers not as expected: {s['num_hostile_unexpected']} of {s['num_hostile_requests']}")
    return "\n".join(lines)


# ---- measurement -----------------------------------------------------------------------------
_progress = StepLog("bench")


async def _stream_ttft(client, prompt: list[int], output_len: int) -> float:
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    ttft = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"the normal stream got {response.status_code}: {response.text[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the normal stream failed: {chunk['error']}")
            if ttft is None and any(c.get("text") for c in chunk.get("choices") or []):
                ttft = time.perf_counter() - start
    if ttft is None:
        raise RuntimeError("the normal stream ended without text")
    return ttft


async def _hostile_client(client, case: HostileCase, result: CaseResult, stop: asyncio.Event) -> None:
    import httpx

    while not stop.is_set():
        start = time.perf_counter()
        try:
            response = await case.send(client)
        except httpx.HTTPError:
            result.num_errors += 1
            continue
        result.latencies_s.append(time.perf_counter() - start)
        result.statuses[response.status_code] += 1


async def _measure(base_url: str, p: BenchParams, prompts: list[list[int]], warmup: list[list[int]], model: str,
                   max_body_bytes: int) -> tuple[list[float], list[float], list[CaseResult]]:
    import httpx

    cases = hostile_cases(model, max_body_bytes)
    results = [CaseResult(c.name, c.status) for c in cases]
    limits = httpx.Limits(max_connections=len(cases) + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=HTTP_TIMEOUT_S, limits=limits) as client:
        for prompt in warmup:
            await _stream_ttft(client, prompt, p.output_len)
        _progress(f"idle: {p.num_rounds} streams, one at a time")
        idle = [await _stream_ttft(client, prompt, p.output_len) for prompt in prompts]
        _progress(f"hostile: {p.num_rounds} streams, each beside {len(cases)} hostile clients")
        hostile = []
        for prompt in prompts:
            stop = asyncio.Event()
            senders = [asyncio.create_task(_hostile_client(client, c, r, stop)) for c, r in zip(cases, results)]
            await asyncio.sleep(STREAM_DELAY_S)
            try:
                hostile.append(await _stream_ttft(client, prompt, p.output_len))
            finally:
                stop.set()
                await asyncio.gather(*senders)
    return idle, hostile, results


def serve_config(p: BenchParams, model_dir, port: int):
    """`kvrelay serve`'s defaults, one replica per pool, on `port`."""
    from serving.config import ServeConfig

    pool = {"num_replicas": 1}
    return ServeConfig.model_validate({
        "model": str(model_dir), "engine": {"dtype": p.dtype, "kv_cache_bytes": p.kv_cache_mib * 2**20},
        "mode": p.mode, "app_name": "kvrelay-bench-hostile", "http": {"host": "127.0.0.1", "port": port},
        "prefill": pool, "decode": pool, "worker": pool,
    })


def run(p: BenchParams, *, command: str = "") -> dict:
    import numpy as np
    import ray

    from cluster import launcher
    from serving.engine.modeling.loader import load_model_spec, resolve_model_dir

    started = time.monotonic()
    machine = hardware.machine_record(num_threads=1)
    model_dir = resolve_model_dir(p.model)
    p = dataclasses.replace(p, dtype=resolve_dtype(p.dtype, model_dir).dtype)
    vocab_size = load_model_spec(model_dir).vocab_size
    rng = np.random.default_rng(p.seed)
    prompts = rng.integers(100, vocab_size, (p.num_rounds, p.prompt_len)).tolist()
    warmup = rng.integers(100, vocab_size, (p.num_warmup, p.prompt_len)).tolist()
    config = serve_config(p, model_dir, free_port())
    with local_ray("bench hostile", _progress):
        _progress(f"{p.mode}: deploying")
        launcher.start(config)
        try:
            idle, hostile, cases = asyncio.run(_measure(
                f"http://{config.http.host}:{config.http.port}", p, prompts, warmup, config.model_name,
                config.max_request_body_bytes,
            ))
        finally:
            launcher.stop(config, stop_ray=False)
    hardware.finish_machine_record(machine, ray_version=ray.__version__)
    summary = summarize(idle, hostile, cases)
    print(format_table(p, cases, summary, machine))
    return {
        "summary": summary,
        "config": {"command": command, "params": dataclasses.asdict(p), "serve": config.model_dump(mode="json"), "ray_num_cpus": RAY_NUM_CPUS},
        "raw": {"ttft_s_idle": idle, "ttft_s_hostile": hostile, "cases": [c.to_json() for c in cases], "wall_s": time.monotonic() - started},
        "hardware": machine,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="smaller preset: 3 rounds x 16 output tokens")
    p.add_argument("--json", metavar="PATH", help="write summary, config, raw results and hardware here")
    p.add_argument("--model", help="built-in name or model directory [smollm2-135m-instruct]")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32", "float16"], help="weights and KV dtype [auto]")
    p.add_argument("--mode", choices=["colocated", "disaggregated"], help="served mode [colocated]")
    p.add_argument("--num-rounds", type=int, metavar="N", help="normal streams per phase [8; quick 3]")
    p.add_argument("--prompt-len", type=int, metavar="TOKENS", help="normal stream's prompt length [256]")
    p.add_argument("--output-len", type=int, metavar="TOKENS", help="normal stream's output tokens [32; quick 16]")
    p.add_argument("--num-warmup", type=int, metavar="N", help="untimed streams first [2]")
    p.add_argument("--kv-cache-mib", type=int, metavar="MIB", help="KV cache per replica [256]")
    p.add_argument("--seed", type=int, help="seed of the random prompt token ids [0]")


def params_from_args(args: argparse.Namespace) -> BenchParams:
    preset = QUICK if args.quick else FULL
    names = {f.name for f in dataclasses.fields(BenchParams)} - {"quick"}
    given = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    p = dataclasses.replace(preset, **given)
    for name in ("num_rounds", "prompt_len", "output_len", "kv_cache_mib"):
        if getattr(p, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(p, name)}")
    if p.num_warmup < 0:
        raise SystemExit(f"--num-warmup must be >= 0, got {p.num_warmup}")
    return p


def run_from_args(args: argparse.Namespace, argv: list[str]) -> int:
    return run_and_report(args, argv, params_from_args, run, _progress)
