"""`kvrelay bench serve-overhead`: what the Serve path adds to the engine, and what KV transfer costs.

Two measurements, on the same model, dtype, KV budget and one torch thread per engine:

    request path   the same N seeded random-token prompts (P tokens -> O tokens, greedy,
                   ignore_eos), one at a time, streamed, through
                     in-process     an AsyncEngine in this process (shut down before Ray starts)
                     disaggregated  HTTP /v1/completions -> Serve proxy -> OpenAIIngress
                                    -> PrefillWorker -> KVTransfer -> DecodeWorker
                     colocated      HTTP /v1/completions -> Serve proxy -> OpenAIIngress -> Worker
                   TTFT: request sent -> first streamed chunk with text (in-process: first
                   output with text); TPOT: (E2E - TTFT) / (tokens - 1), E2E ending at the last
                   token. added = p50(served) - p50(in-process).
    KV hand-off    the KV of a K-token prompt held by a real engine, moved as EngineWorker
                   moves it between two actors on this node, by both paths: the node's arena
                   (reserve -> gather into the range -> offer/claim the lease -> write_blocks
                   from the range in place) and Ray's object store (gather -> ray.put ->
                   offer/claim -> await ref -> write_blocks), each whole (gather and scatter
                   included) against a memcpy of the same bytes; fraction = memcpy time / hand-off
                   time, so 1.0 is as fast as one memcpy. The steps and what is left out:
                   load_tests/serve_overhead/kv_transfer_timing.py.

Ray is started here (`num_cpus=4`, no dashboard, its own temp dir) and shut down at the end.
Targets (printed as pass/miss, not enforced): added TTFT <= 15 ms p50, added TPOT <= 2 ms p50,
the same-node (arena) KV hand-off >= 0.5 of memcpy.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from load_tests import hardware
from load_tests.common import StepLog, Target, load_note, run_and_report
from load_tests.local_ray import RAY_NUM_CPUS, free_port, local_ray
from load_tests.roofline import resolve_dtype
from load_tests.serve_overhead.kv_transfer_timing import KV_PATHS, KVTransferResult, measure_kv_transfer

__all__ = [
    "DESCRIPTION", "add_arguments",
    "BenchParams",
    "FULL",
    "PathResult",
    "QUICK",
    "RequestTiming",
    "TARGETS",
    "format_table",
    "params_from_args",
    "run",
    "run_from_args",
    "summarize",
    "timing_from_sse",
]

DESCRIPTION = (
    "Send the same seeded random-token prompts, one at a time and streamed, to an engine in "
    "this process and over HTTP to the app (disaggregated and colocated, one torch thread "
    "per replica) on a local Ray started for the run; report the TTFT and TPOT the serving "
    "path adds (p50). Then move a prompt's exported KV through ray.put and the KVTransfer "
    "actor into a second engine's cache and compare with a memcpy of the same bytes. Unset "
    "knobs take the full (or --quick) preset."
)

MODES = ("disaggregated", "colocated")
HTTP_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class BenchParams:
    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"  # resolved before anything runs, as kvrelay's default picks on this machine
    num_prompts: int = 8
    prompt_len: int = 256
    output_len: int = 64
    num_warmup: int = 2  # requests per path before the timed ones, not recorded
    kv_tokens: int = 1024
    kv_repeats: int = 10
    kv_cache_mib: int = 256  # per engine: the in-process one, each replica, each KV actor
    seed: int = 0
    modes: tuple[str, ...] = MODES
    transport: str = "grpc"  # ray.grpc_transport (grpc) or Ray's object streams (objects), both Serve hops
    quick: bool = False


FULL = BenchParams()
QUICK = dataclasses.replace(FULL, num_prompts=4, output_len=16, kv_repeats=5, quick=True)


# ---- results ---------------------------------------------------------------------------------
@dataclass
class RequestTiming:
    ttft_s: float  # request sent -> first output (chunk) with text
    e2e_s: float  # request sent -> the last token
    num_output_tokens: int
    text: str = field(default="", repr=False)
    first_token_s: float | None = None  # in-process only: first output with a token, text or not

    @property
    def tpot_s(self) -> float | None:
        n = self.num_output_tokens
        return (self.e2e_s - self.ttft_s) / (n - 1) if n > 1 else None

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        del out["text"]
        out["tpot_s"] = self.tpot_s
        return out


def _p50_ms(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) * 1e3 if values else None


@dataclass
class PathResult:
    name: str  # "in-process", "disaggregated", "colocated"
    requests: list[RequestTiming]
    info: dict = field(default_factory=dict)
    num_text_matches: int | None = None  # served: outputs equal to the in-process ones

    @property
    def ttft_ms_p50(self) -> float | None:
        return _p50_ms([r.ttft_s for r in self.requests])

    @property
    def tpot_ms_p50(self) -> float | None:
        return _p50_ms([r.tpot_s for r in self.requests])

    @property
    def e2e_ms_p50(self) -> float | None:
        return _p50_ms([r.e2e_s for r in self.requests])

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "ttft_ms_p50": self.ttft_ms_p50,
            "tpot_ms_p50": self.tpot_ms_p50,
            "e2e_ms_p50": self.e2e_ms_p50,
            "num_text_matches": self.num_text_matches,
            "requests": [r.to_json() for r in self.requests],
            "info": self.info,
        }


# ---- summary and table (pure) ----------------------------------------------------------------
TARGETS = (
    Target("added_ttft_ms_p50", "added TTFT p50, ms (disaggregated)", "<=", 15.0),
    Target("added_tpot_ms_p50", "added TPOT p50, ms (disaggregated)", "<=", 2.0),
    Target("kv_transfer_fraction_of_memcpy", "KV hand-off (arena) / memcpy speed", ">=", 0.5),
)


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def summarize(inprocess: PathResult, served: dict[str, PathResult], kvs: dict[str, KVTransferResult]) -> dict:
    """Headline figures (None where a part did not run) and each target's verdict; `kvs`: the
    KV hand-off by path (the target is the arena's: the same-node default)."""
    disagg, coloc = served.get("disaggregated"), served.get("colocated")
    kv, store = kvs.get("arena"), kvs.get("object_store")
    summary = {
        "added_ttft_ms_p50": _minus(disagg and disagg.ttft_ms_p50, inprocess.ttft_ms_p50),
        "added_tpot_ms_p50": _minus(disagg and disagg.tpot_ms_p50, inprocess.tpot_ms_p50),
        "added_ttft_ms_p50_colocated": _minus(coloc and coloc.ttft_ms_p50, inprocess.ttft_ms_p50),
        "added_tpot_ms_p50_colocated": _minus(coloc and coloc.tpot_ms_p50, inprocess.tpot_ms_p50),
        "kv_transfer_fraction_of_memcpy": kv and kv.fraction_of_memcpy,
        "kv_transfer_ms_p50": kv and kv.transfer_ms_p50,
        "memcpy_ms_p50": kv and kv.memcpy_ms_p50,
        "kv_transfer_bytes": kv and kv.num_bytes,
        "kv_transfer_timed_steps": kv and " + ".join(kv.steps),
        "kv_object_store_fraction_of_memcpy": store and store.fraction_of_memcpy,
        "kv_object_store_ms_p50": store and store.transfer_ms_p50,
        "kv_object_store_timed_steps": store and " + ".join(store.steps),
    }
    for path in (inprocess, *served.values()):
        key = path.name.replace("-", "")
        summary[f"ttft_ms_p50_{key}"] = path.ttft_ms_p50
        summary[f"tpot_ms_p50_{key}"] = path.tpot_ms_p50
    summary["targets"] = {t.key: {"target": t.text, "met": t.met(summary[t.key])} for t in TARGETS}
    return summary


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else f"{value:{spec}}"


def format_table(
    params: BenchParams,
    paths: list[PathResult],
    kvs: dict[str, KVTransferResult],
    summary: dict,
    *,
    load_avg_1m: float | None = None,
) -> str:
    """Per-path latencies, the KV transfer's steps, then the summary against its targets."""
    p = params
    lines = [
        (
            f"workload: {p.num_prompts} prompts x {p.prompt_len} -> {p.output_len} tokens, one at a time, "
            f"streamed; {p.dtype}, 1 torch thread per engine"
        ),
        "",
        f"{'p50':<26}" + "".join(f"{path.name:>15}" for path in paths),
    ]

    def row(label: str, get) -> None:
        lines.append(f"{label:<26}" + "".join(f"{get(path):>15}" for path in paths))

    row("TTFT, ms", lambda path: _fmt(path.ttft_ms_p50, ".1f"))
    row("TPOT, ms", lambda path: _fmt(path.tpot_ms_p50, ".2f"))
    row("E2E, ms", lambda path: _fmt(path.e2e_ms_p50, ".1f"))
    row(
        "same text as in-process",
        lambda path: "-" if path.num_text_matches is None else f"{path.num_text_matches}/{len(path.requests)}",
    )
    for kv in kvs.values():
        steps = " + ".join(f"{s} {kv.step_ms_p50(s):.3f}" for s in kv.steps)
        lines += [
            "",
            f"KV hand-off through the {kv.path.replace('_', ' ')} of {kv.num_tokens} tokens "
            f"({kv.num_bytes / 2**20:.1f} MiB), p50 of {len(kv.transfer_s)}:",
            f"  whole    {kv.transfer_ms_p50:.3f} ms = {steps}",
            f"  memcpy   {kv.memcpy_ms_p50:.3f} ms: {kv.fraction_of_memcpy:.3f} of memcpy speed",
        ]
        if kv.info.get("reserve_s"):
            lines.append(f"  reserve  {statistics.median(kv.info['reserve_s']) * 1e3:.3f} ms, before the prefill (not in the hand-off)")
        if not kv.is_verified:
            lines.append("  WARNING: the importer's blocks differ from the exporter's")
    lines += ["", f"{'summary':<36}{'value':>10}{'target':>10}{'result':>8}"]
    for t in TARGETS:
        verdict = {True: "pass", False: "miss", None: "n/a"}[summary["targets"][t.key]["met"]]
        lines.append(f"{t.label:<36}{_fmt(summary[t.key], '.3f'):>10}{t.text:>10}{verdict:>8}")
    if summary["added_ttft_ms_p50_colocated"] is not None:
        lines.append(
            f"{'added TTFT / TPOT p50, colocated':<36}"
            f"{summary['added_ttft_ms_p50_colocated']:>10.1f} / {summary['added_tpot_ms_p50_colocated']:.2f} ms"
        )
    if load_note(load_avg_1m):
        lines.append(load_note(load_avg_1m))
    return "\n".join(lines)


def timing_from_sse(start: float, events: list[tuple[float, dict]]) -> RequestTiming:
    """One streamed /v1/completions response: (arrival time, parsed `data:` chunk) per event,
    `[DONE]` left out. Token counts come from the usage chunk (a chunk may carry several tokens)."""
    ttft = e2e = None
    num_tokens = None
    texts = []
    for arrived, chunk in events:
        if "error" in chunk:
            raise RuntimeError(f"the stream failed: {chunk['error']}")
        for choice in chunk.get("choices") or []:
            if choice.get("text"):
                texts.append(choice["text"])
                ttft = arrived - start if ttft is None else ttft
            e2e = arrived - start
        if chunk.get("usage"):
            num_tokens = chunk["usage"]["completion_tokens"]
    if ttft is None or num_tokens is None:
        raise RuntimeError("the stream ended without text or without a usage chunk")
    return RequestTiming(ttft, e2e, num_tokens, "".join(texts))


# ---- measurements ----------------------------------------------------------------------------
_progress = StepLog("bench")


@dataclass
class Prompts:
    timed: list[list[int]]
    warmup: list[list[int]]
    kv: list[int]

    @classmethod
    def make(cls, p: BenchParams, vocab_size: int) -> Prompts:
        import numpy as np

        # Ids from 100 up stay clear of the special tokens at the bottom of Llama-family
        # vocabularies. Every prompt is distinct, so no prefix-cache hit hides a prefill. One
        # stream per purpose: --num-prompts does not change the warm-up or KV prompts.
        def draw(purpose: int, num: int, length: int) -> list[list[int]]:
            return np.random.default_rng([p.seed, purpose]).integers(100, vocab_size, (num, length)).tolist()

        return cls(
            timed=draw(1, p.num_prompts, p.prompt_len),
            warmup=draw(2, p.num_warmup, p.prompt_len),
            kv=draw(3, 1, p.kv_tokens)[0],
        )


def _greedy(max_tokens: int):
    from serving.engine.params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def _inprocess_requests(engine, prompts: list[list[int]], output_len: int, tag: str) -> list[RequestTiming]:
    from serving.engine.contract import EngineRequest

    timings = []
    for i, prompt in enumerate(prompts):
        start = time.perf_counter()
        first_token = first_text = None
        num_tokens, texts = 0, []
        async for out in engine.generate(EngineRequest(f"{tag}-{i}", prompt_token_ids=prompt, params=_greedy(output_len))):
            now = time.perf_counter()
            completion = out.outputs[0]
            num_tokens += len(completion.token_ids)
            texts.append(completion.text)
            if first_token is None and completion.token_ids:
                first_token = now - start
            if first_text is None and completion.text:
                first_text = now - start
        if first_text is None:
            raise RuntimeError(f"in-process request {tag}-{i} produced no text")
        timings.append(RequestTiming(first_text, now - start, num_tokens, "".join(texts), first_token))
    return timings


def bench_inprocess(engine_config, prompts: Prompts, p: BenchParams) -> PathResult:
    import torch

    from serving.engine.async_engine import AsyncEngine

    saved_threads = torch.get_num_threads()
    engine = AsyncEngine(engine_config)  # sets this process's torch threads to the workers' count
    try:
        _progress(f"in-process: {p.num_warmup} warm-up + {p.num_prompts} requests")
        asyncio.run(_inprocess_requests(engine, prompts.warmup, p.output_len, "warmup"))
        timings = asyncio.run(_inprocess_requests(engine, prompts.timed, p.output_len, "timed"))
        info = {"torch_threads": torch.get_num_threads(), "engine_stats": dataclasses.asdict(engine.stats())}
    finally:
        engine.shutdown()
        torch.set_num_threads(saved_threads)
    del engine
    gc.collect()
    return PathResult("in-process", timings, info)


def serve_config(p: BenchParams, model_dir: Path, mode: str, port: int):
    """The app's ServeConfig: one replica per pool, one torch thread each."""
    from serving.config import ServeConfig

    pool = {"num_replicas": 1, "num_cpus": 0.5}
    return ServeConfig.model_validate({
        "model": str(model_dir), "engine": {"dtype": p.dtype, "kv_cache_bytes": p.kv_cache_mib * 2**20, "num_threads": 1},
        "mode": mode, "app_name": f"kvrelay-bench-{mode}", "http": {"host": "127.0.0.1", "port": port},
        "prefill": pool, "decode": pool, "worker": pool, "ray": {"grpc_transport": p.transport == "grpc"},
    })


def _http_request(client, prompt: list[int], output_len: int) -> RequestTiming:
    body = json.dumps({
        "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }).encode()
    events = []
    start = time.perf_counter()
    with client.stream("POST", "/v1/completions", content=body, headers={"content-type": "application/json"}) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"/v1/completions answered {response.status_code}: {response.text}")
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                events.append((time.perf_counter(), json.loads(data)))
    return timing_from_sse(start, events)


def bench_served(config, prompts: Prompts, p: BenchParams, reference: PathResult) -> PathResult:
    import httpx
    from ray import serve

    from cluster import launcher

    _progress(f"{config.mode}: deploying")
    start = time.monotonic()
    launcher.start(config)
    startup_s = time.monotonic() - start
    try:
        _progress(f"{config.mode}: {p.num_warmup} warm-up + {p.num_prompts} requests over HTTP")
        with httpx.Client(base_url=f"http://{config.http.host}:{config.http.port}", timeout=HTTP_TIMEOUT_S) as client:
            for prompt in prompts.warmup:
                _http_request(client, prompt, p.output_len)
            timings = [_http_request(client, prompt, p.output_len) for prompt in prompts.timed]
        pools = ["PrefillWorker", "DecodeWorker"] if config.mode == "disaggregated" else ["Worker"]
        stats = {
            name: serve.get_deployment_handle(name, app_name=config.app_name).stats.remote().result(timeout_s=60).flat()
            for name in pools
        }
    finally:
        launcher.stop(config, stop_ray=False)  # the app and its KVTransfer actor; Ray stays up
    matches = sum(r.text == ref.text for r, ref in zip(timings, reference.requests))
    return PathResult(config.mode, timings, {"startup_s": startup_s, "worker_stats": stats}, matches)


def run(p: BenchParams, *, command: str = "") -> dict:
    """Every phase; returns {"summary", "config", "raw", "hardware"} and prints the table."""
    import ray
    from ray import serve

    from serving.engine.modeling.loader import load_model_spec, resolve_model_dir

    started = time.monotonic()
    machine = hardware.machine_record(num_threads=1)  # torch threads per replica and in process
    model_dir = resolve_model_dir(p.model)
    p = dataclasses.replace(p, dtype=resolve_dtype(p.dtype, model_dir).dtype)
    prompts = Prompts.make(p, load_model_spec(model_dir).vocab_size)
    port = free_port()
    configs = {mode: serve_config(p, model_dir, mode, port) for mode in p.modes}
    reference_config = serve_config(p, model_dir, "colocated", port)
    engine_config = reference_config.engine_config(reference_config.worker)  # what every replica runs

    inprocess = bench_inprocess(engine_config, prompts, p)
    served: dict[str, PathResult] = {}
    with local_ray("bench serve-overhead", _progress, config=reference_config):  # its transport: Serve's proxy too
        for mode, config in configs.items():
            served[mode] = bench_served(config, prompts, p, inprocess)
        serve.shutdown()  # its controller's loop must not share the cores with the KV transfer
        kvs: dict[str, KVTransferResult] = {}
        for path in KV_PATHS if p.kv_repeats else ():
            _progress(f"KV hand-off ({path}): {p.kv_tokens}-token prompt, 1 warm-up + {p.kv_repeats} repeats")
            kvs[path] = measure_kv_transfer(engine_config, prompts.kv, p.kv_repeats, path)
    hardware.finish_machine_record(machine, ray_version=ray.__version__)

    paths = [inprocess, *served.values()]
    summary = summarize(inprocess, served, kvs)
    print(format_table(p, paths, kvs, summary, load_avg_1m=machine["load_avg_1m_at_start"]))
    return {
        "summary": summary,
        "config": {
            "command": command,
            "params": dataclasses.asdict(p),
            "model_dir": str(model_dir),
            "engine": engine_config.model_dump(),
            "serve": {mode: config.model_dump(mode="json") for mode, config in configs.items()},
            "ray_num_cpus": RAY_NUM_CPUS,
        },
        "raw": {
            "paths": {path.name: path.to_json() for path in paths},
            "kv_transfer": {path: kv.to_json() for path, kv in kvs.items()},
            "wall_s": time.monotonic() - started,
        },
        "hardware": machine,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="smaller preset: 4 prompts x 16 output tokens, 5 KV repeats")
    p.add_argument("--json", metavar="PATH", help="write summary, config, raw results and hardware here")
    p.add_argument("--model", help="built-in name or model directory [smollm2-135m-instruct]")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32", "float16"], help="weights and KV dtype [auto: as kvrelay picks on this machine]")
    p.add_argument(
        "--mode", action="append", choices=["disaggregated", "colocated"],
        help="served mode to measure; repeat for both [both]",
    )
    p.add_argument("--num-prompts", type=int, metavar="N", help="timed requests per path [8; quick 4]")
    p.add_argument("--prompt-len", type=int, metavar="TOKENS", help="prompt length [256]")
    p.add_argument("--output-len", type=int, metavar="TOKENS", help="output tokens per request [64; quick 16]")
    p.add_argument("--num-warmup", type=int, metavar="N", help="untimed requests per path first [2]")
    p.add_argument("--transport", choices=["grpc", "objects"],
                   help="Serve's hops (proxy -> ingress -> workers): gRPC (ray.grpc_transport) or Ray's object streams [grpc]")
    p.add_argument("--kv-tokens", type=int, metavar="TOKENS", help="prompt length of the KV transfer [1024]")
    p.add_argument("--kv-repeats", type=int, metavar="N", help="KV transfers and memcpys timed, median reported; 0 skips [10; quick 5]")
    p.add_argument("--kv-cache-mib", type=int, metavar="MIB", help="KV cache per engine [256]")
    p.add_argument("--seed", type=int, help="seed of the random prompt token ids [0]")


def params_from_args(args: argparse.Namespace) -> BenchParams:
    """The --quick or full preset, overridden by every knob given on the command line."""
    preset = QUICK if args.quick else FULL
    names = {f.name for f in dataclasses.fields(BenchParams)} - {"quick", "modes"}
    given = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    if args.mode:
        given["modes"] = tuple(m for m in MODES if m in args.mode)
    p = dataclasses.replace(preset, **given)
    for name in ("num_prompts", "prompt_len", "kv_tokens", "kv_cache_mib"):
        if getattr(p, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(p, name)}")
    for name in ("num_warmup", "kv_repeats"):
        if getattr(p, name) < 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 0, got {getattr(p, name)}")
    if p.output_len < 2:
        raise SystemExit(f"--output-len must be >= 2 (TPOT excludes the first token), got {p.output_len}")
    return p


def run_from_args(args: argparse.Namespace, argv: list[str]) -> int:
    return run_and_report(args, argv, params_from_args, run, _progress)
