"""`kvrelay bench serve`: latency, throughput and goodput of any OpenAI-compatible server.

The same async client measures kvrelay and its peers (vLLM, SGLang, ...): point --base-url at
the server. Per request rate (`--request-rate 1,2,4`; `inf` sends everything at once):

    dataset      random | shared-prefix | multi-turn | chat-burst (load_tests/serve/datasets.py)
    arrivals     gamma gaps with mean 1/rate and shape --burstiness (1: Poisson), or all at once
                 under --max-concurrency (load_tests/serve/load.py)
    client       streamed /v1/chat/completions (or /v1/completions), usage for exact token
                 counts (load_tests/serve/client.py: the definitions of TTFT, TPOT, ITL, E2E)
    figures      TTFT, TPOT, ITL, E2E (mean, p50, p90, p95, p99), request and token throughput,
                 goodput under --slo ttft_ms=...,tpot_ms=...,e2e_ms=... (load_tests/serve/metrics.py)
    output       a table on stdout, --json PATH ({summary, config, raw, hardware}) and a PNG report
                 (latency CDFs, TTFT and TPOT over time, throughput against rate;
                 load_tests/serve/report.py) next to the JSON or at --png PATH

Each rate runs with a fresh client (multi-turn histories start empty) and the same seeded dataset.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from load_tests import hardware
from load_tests.common import command_line, write_report
from load_tests.serve.client import (
    RequestRecord,
    RequestSpec,
    ServeClient,
    ServeClientError,
)
from load_tests.serve.datasets import (
    chat_burst,
    multi_turn,
    parse_length,
    random_dataset,
    shared_prefix,
)
from load_tests.serve.load import Progress, run_load
from load_tests.serve.metrics import parse_slo, summarize_records
from load_tests.serve.params import BenchParams, add_arguments, params_from_args

__all__ = [
    "BenchParams", "RateRun", "add_arguments", "build_specs", "format_table", "params_from_args", "run",
    "run_from_args", "run_rates",
]


@dataclass
class RateRun:
    request_rate: float
    records: list[RequestRecord]
    duration_s: float
    summary: dict

    def to_json(self) -> dict:
        return {"request_rate": _rate_json(self.request_rate), "duration_s": self.duration_s,
                "records": [r.to_json() for r in self.records]}


def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def build_specs(p: BenchParams, request_rate: float) -> list[RequestSpec]:
    output_len = parse_length(p.output_len)
    if p.dataset == "random":
        return random_dataset(p.num_prompts, parse_length(p.input_len), output_len, seed=p.seed,
                              token_ids_vocab=p.token_ids_vocab if p.endpoint == "completions" else None)
    if p.dataset == "shared-prefix":
        return shared_prefix(p.num_prompts, p.num_groups, p.prefix_len, p.suffix_len, output_len, seed=p.seed)
    if p.dataset == "multi-turn":
        return multi_turn(p.num_sessions, p.num_turns, parse_length(p.input_len), output_len, seed=p.seed)
    assert p.dataset == "chat-burst", p.dataset
    return chat_burst(
        p.num_prompts, parse_length(p.input_len), output_len, request_rate=request_rate,
        burst_every_s=p.burst_every_s, burst_size=p.burst_size, burst_len=p.burst_len,
        burst_output_len=p.burst_output_len, seed=p.seed,
    )


async def run_rates(
    p: BenchParams, *, transport: httpx.AsyncBaseTransport | None = None, clock=None,
) -> tuple[str, list[RateRun]]:
    """Every request rate in turn against one server: (model, runs); `transport` and `clock` are
    for tests."""
    slo = parse_slo(p.slo)
    headers = {"Authorization": f"Bearer {p.api_key}"} if p.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)  # never a hidden cap
    async with httpx.AsyncClient(base_url=p.base_url, headers=headers, timeout=p.timeout_s, limits=limits,
                                 transport=transport) as http:
        model = p.model or await ServeClient.first_model(http)
        runs = []
        for rate in p.request_rates:
            client = ServeClient(http, model=model, endpoint=p.endpoint, clock=clock, temperature=p.temperature,
                                 ignore_eos=p.ignore_eos, extra_body=json.loads(p.extra_body) if p.extra_body else None)
            specs = build_specs(p, rate)
            label = f"rate {_rate_json(rate)}/s" + (f", concurrency {p.max_concurrency}" if p.max_concurrency else "")
            progress = Progress(len(specs), f"[bench serve] {label}", is_enabled=p.is_progress_shown)
            records, duration_s = await run_load(
                client, specs, request_rate=rate, burstiness=p.burstiness, max_concurrency=p.max_concurrency,
                seed=p.seed, progress=progress,
            )
            summary = summarize_records(records, duration_s, slo)
            runs.append(RateRun(rate, records, duration_s, {"request_rate": _rate_json(rate), **summary}))
    return model, runs


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else f"{value:{spec}}"


def format_table(p: BenchParams, model: str, runs: list[RateRun]) -> str:
    lines = [
        f"server {p.base_url} ({p.endpoint}), model {model}, dataset {p.dataset}, burstiness {p.burstiness:g}"
        + (f", max concurrency {p.max_concurrency}" if p.max_concurrency else ""),
        "",
        f"{'request rate, /s':<24}" + "".join(f"{_rate_json(r.request_rate):>12}" for r in runs),
    ]

    def row(label: str, get) -> None:
        lines.append(f"{label:<24}" + "".join(f"{get(r.summary):>12}" for r in runs))

    row("completed / failed", lambda s: f"{s['num_completed']}/{s['num_failed']}")
    row("duration, s", lambda s: _fmt(s["duration_s"], ".2f"))
    row("requests/s", lambda s: _fmt(s["request_throughput"], ".2f"))
    row("output tokens/s", lambda s: _fmt(s["output_throughput"], ".1f"))
    row("total tokens/s", lambda s: _fmt(s["total_token_throughput"], ".1f"))
    slo = runs[0].summary["slo"] if runs else {}
    if slo:
        row("goodput/s (SLO below)", lambda s: _fmt(s["goodput"], ".2f"))
        row("requests meeting SLO", lambda s: f"{s['num_slo_met']}/{s['num_requests']}")
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        for stat in ("mean", "p50", "p90", "p95", "p99"):
            row(f"{metric.split('_')[0].upper()} {stat}, ms", lambda s, m=metric, st=stat: _fmt(s[m][st], ".2f"))
    sources = sorted({src for r in runs for src in r.summary["token_count_sources"]})
    if slo:
        lines.append("SLO: " + ", ".join(f"{key} <= {bound:g}" for key, bound in slo.items()))
    lines.append(f"output tokens counted by: {', '.join(sources) or '-'} (load_tests/serve/client.py)")
    return "\n".join(lines)


def run(p: BenchParams, *, command: str = "", transport=None, clock=None) -> tuple[dict, list[RateRun]]:
    """Every rate; prints the table; returns the JSON report and the runs (for the PNG)."""
    started = time.monotonic()
    machine = hardware.machine_record(httpx_version=httpx.__version__)  # the client's machine
    model, runs = asyncio.run(run_rates(p, transport=transport, clock=clock))
    print(format_table(p, model, runs))
    hardware.finish_machine_record(machine)
    params = {**dataclasses.asdict(p), "request_rates": [_rate_json(r) for r in p.request_rates]}
    if params["api_key"]:
        params["api_key"] = "(set, not recorded)"
    report = {
        "summary": {"runs": [r.summary for r in runs]},
        "config": {"command": command, "model": model, "params": params},
        "raw": {"runs": [r.to_json() for r in runs], "wall_s": time.monotonic() - started},
        "hardware": machine,
    }
    return report, runs


def _without_api_key(argv: list[str]) -> list[str]:
    out = []
    for prev, arg in zip(["", *argv], argv):
        if prev == "--api-key":
            arg = "***"
        elif arg.startswith("--api-key="):
            arg = "--api-key=***"
        out.append(arg)
    return out


def run_from_args(args: argparse.Namespace, argv: list[str]) -> int:
    p = params_from_args(args)
    png = None
    if not args.no_png and (args.png or args.json):
        if importlib.util.find_spec("matplotlib") is None:
            print("[bench serve] matplotlib is not installed: no PNG report", file=sys.stderr)
        else:
            png = args.png or str(Path(args.json).with_suffix(".png"))
    command = command_line(_without_api_key(argv))
    try:
        report, runs = run(p, command=command)
    except ServeClientError as exc:
        print(f"kvrelay bench serve: {exc}", file=sys.stderr)
        return 2
    report["config"]["png"] = png
    if args.json:  # before the PNG: a plotting failure must not lose the figures
        print(f"[bench serve] wrote {write_report(args.json, report)}", file=sys.stderr)
    if png:
        from load_tests.serve.report import write_png

        Path(png).parent.mkdir(parents=True, exist_ok=True)
        write_png(png, runs, title=f"{p.dataset} against {p.base_url}, model {report['config']['model']}")
        print(f"[bench serve] wrote {png}", file=sys.stderr)
    return 0
