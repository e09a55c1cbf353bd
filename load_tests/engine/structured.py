"""`kvrelay bench engine --structured`: what structured outputs cost a batch.

Two batches of the same N requests (seeded random P-token prompts, O output tokens each, greedy),
run one after the other in one engine, `--repeats` times each, interleaved (A B A B ...):

    unconstrained      every request free
    half constrained   every other request constrained by BENCH_SCHEMA (a JSON schema)

BENCH_SCHEMA asks for at least 64 order objects, more than O tokens hold, so a constrained
request runs to O tokens as a free one does (finish_reason "length"; checked): both batches
generate exactly N x O tokens and their output tokens/s compare the same work. What the half
constrained batch pays: each step, a bitmask per constrained row (xgrammar), the float32 copy and
mask in the sampler that an all-greedy batch skips, and a matcher advance per constrained token.
The schema is compiled once before the timed runs (its compile time is reported), as a served
schema is compiled once and cached.

Figure: median output tokens/s of each batch, and half constrained / unconstrained (target
>= 0.8, printed as pass/miss, not enforced).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from dataclasses import dataclass

from load_tests import hardware
from load_tests.common import StepLog, load_note, run_and_report

__all__ = ["BENCH_SCHEMA", "FULL", "QUICK", "StructuredParams", "TARGET_RATIO", "format_table", "run", "run_from_args"]

TARGET_RATIO = 0.8

BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "customer": {"type": "string", "maxLength": 40},
        "orders": {
            "type": "array", "minItems": 64,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1},
                    "sku": {"type": "string", "maxLength": 16},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                    "status": {"enum": ["new", "paid", "shipped", "returned"]},
                    "note": {"type": ["string", "null"], "maxLength": 40},
                },
                "required": ["id", "sku", "qty", "status"],
            },
        },
    },
    "required": ["customer", "orders"],
}


@dataclass(frozen=True)
class StructuredParams:
    model: str = "smollm2-135m-instruct"
    num_requests: int = 32
    prompt_len: int = 128
    output_len: int = 128
    repeats: int = 3
    threads: int = 2
    kv_cache_mib: int = 1024
    max_num_batched_tokens: int = 512
    dtype: str = "auto"
    seed: int = 0
    quick: bool = False


FULL = StructuredParams()
QUICK = dataclasses.replace(FULL, num_requests=16, output_len=64, repeats=2, quick=True)

_progress = StepLog("bench structured")


@dataclass
class BatchRun:
    num_output_tokens: int
    elapsed_s: float
    finish_reasons: dict[str, int]

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s


def _timed(engine, prompts: list[list[int]], params: list) -> BatchRun:
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    reasons: dict[str, int] = {}
    for out in outputs:
        reasons[out.outputs[0].finish_reason] = reasons.get(out.outputs[0].finish_reason, 0) + 1
    return BatchRun(sum(len(o.outputs[0].token_ids) for o in outputs), elapsed, reasons)


def run(p: StructuredParams, *, command: str = "") -> dict:
    import torch

    from serving.engine import EngineConfig, LLMEngine, SamplingParams
    from serving.engine.modeling.loader import resolve_model_dir
    from serving.engine.params import GuidedSpec

    saved_threads = torch.get_num_threads()
    torch.set_num_threads(p.threads)
    try:
        machine = hardware.machine_record(num_threads=p.threads)
        config = EngineConfig(
            model=str(resolve_model_dir(p.model)), dtype=p.dtype, kv_cache_bytes=p.kv_cache_mib * 2**20,
            max_num_seqs=max(64, p.num_requests), max_num_batched_tokens=p.max_num_batched_tokens, num_threads=p.threads,
        )
        engine = LLMEngine(config)
        gen = torch.Generator().manual_seed(p.seed)
        prompts = torch.randint(100, engine.vocab_size, (p.num_requests, p.prompt_len), generator=gen).tolist()
        spec = GuidedSpec.json_schema(BENCH_SCHEMA)
        _progress("compiling the schema (once, as a served schema is)")
        start = time.perf_counter()
        engine.grammars.compile(spec)
        compile_s = time.perf_counter() - start
        free = SamplingParams(temperature=0.0, max_tokens=p.output_len, ignore_eos=True)
        constrained = SamplingParams(temperature=0.0, max_tokens=p.output_len, guided=spec)
        batches = {
            "unconstrained": [free] * p.num_requests,
            "half_constrained": [constrained if i % 2 == 0 else free for i in range(p.num_requests)],
        }
        _progress("warm-up")
        for params in batches.values():
            engine.generate(prompts[:4], params[:4])
        runs: dict[str, list[BatchRun]] = {name: [] for name in batches}
        for repeat in range(p.repeats):
            for name, params in batches.items():
                _progress(f"{name} ({p.num_requests} x {p.prompt_len} -> {p.output_len}), run {repeat + 1}/{p.repeats}")
                runs[name].append(_timed(engine, prompts, params))
        dtype = engine.config.dtype
    finally:
        torch.set_num_threads(saved_threads)
    hardware.finish_machine_record(machine, dtype=dtype)
    expected_tokens = p.num_requests * p.output_len
    for name, batch_runs in runs.items():  # equal work, or the ratio compares nothing
        assert all(r.num_output_tokens == expected_tokens for r in batch_runs), f"{name}: not every request ran to {p.output_len} tokens"
    tps = {name: statistics.median(r.output_tokens_per_s for r in batch_runs) for name, batch_runs in runs.items()}
    ratio = tps["half_constrained"] / tps["unconstrained"]
    summary = {
        "unconstrained_tokens_per_s": tps["unconstrained"],
        "half_constrained_tokens_per_s": tps["half_constrained"],
        "ratio": ratio,
        "target_ratio": TARGET_RATIO,
        "met": ratio >= TARGET_RATIO,
        "schema_compile_ms": compile_s * 1e3,
    }
    print(format_table(p, summary, machine))
    return {
        "summary": summary,
        "results": {
            "command": command,
            "params": dataclasses.asdict(p),
            "machine": machine,
            "runs": {name: [{**dataclasses.asdict(r), "output_tokens_per_s": r.output_tokens_per_s} for r in rs] for name, rs in runs.items()},
        },
    }


def format_table(p: StructuredParams, summary: dict, machine: dict) -> str:
    isa = ", ".join(name for name, present in machine["isa"].items() if present) or "none of " + ", ".join(machine["isa"])
    lines = [
        f"structured outputs: {p.num_requests} requests x {p.prompt_len} -> {p.output_len} tokens, greedy, {p.threads} threads, "
        f"median of {p.repeats} ({machine['cpu_model']}; {isa}; dtype {machine.get('dtype')})",
        f"  unconstrained        {summary['unconstrained_tokens_per_s']:9.1f} output tok/s",
        f"  half constrained     {summary['half_constrained_tokens_per_s']:9.1f} output tok/s",
        f"  ratio                {summary['ratio']:9.3f}   target >= {TARGET_RATIO}: {'pass' if summary['met'] else 'MISS'}",
        f"  schema compile       {summary['schema_compile_ms']:9.1f} ms (once, before the timed runs)",
    ]
    note = load_note(machine.get("load_avg_1m_at_start"))
    if note:
        lines.append(note)
    return "\n".join(lines)


def params_from_args(args: argparse.Namespace) -> StructuredParams:
    """The --quick or full preset, overridden by the knobs `bench engine` shares with it."""
    preset = QUICK if args.quick else FULL
    names = {f.name for f in dataclasses.fields(StructuredParams)} - {"quick"}
    given = {name: getattr(args, name) for name in names if getattr(args, name, None) not in (None, False)}
    p = dataclasses.replace(preset, **given)
    for name in ("num_requests", "prompt_len", "output_len", "repeats", "threads", "kv_cache_mib", "max_num_batched_tokens"):
        if getattr(p, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(p, name)}")
    if p.num_requests < 2:
        raise SystemExit("--num-requests must be >= 2 with --structured (half of them are constrained)")
    return p


def run_from_args(args: argparse.Namespace, argv: list[str]) -> int:
    return run_and_report(args, argv, params_from_args, run, _progress)
