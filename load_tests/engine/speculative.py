"""`kvrelay bench engine --speculative`: what n-gram speculative decoding does, where it should help and where it must not hurt.

Two engines of the same model and config in one process, one without speculation and one with
`speculative: {method: ngram, ...}` (adaptive, as configured by default: its step costs measured at
start-up, speculative.py), run the same three scenarios, interleaved (off on off on ...) `--repeats`
times, greedy:

    grounded     one request asking for a given text back word for word (what prompt lookup is
                 for: summarise, edit, quote or rewrite a given text)
    chat         one free-form chat request with little to copy
    throughput   `--num-requests` (64) requests at once, a mix of both kinds, `--output-len` tokens
                 each: generated tokens / wall time from the first add to the last token

    decode tok/s   (output tokens - 1) / (last token - first token), the engine's own clock:
                   the prompt's prefill is not in it (single streams)
    speedup        median on / median off (throughput: the ratio of median tok/s)
    acceptance     accepted / proposed tokens, and tokens kept per verifying step (1 = no gain)

The single streams must give the same tokens with speculation on and off (greedy speculation is
lossless): checked, and a mismatch is reported (`identical: false`), not hidden. In the batch a
verify row is computed as a row of a chunk rather than alone, which moves logits by ~1e-6 and can
flip a near-tie: the number of requests with identical tokens is reported. On a random-weight model
the output does not copy the text, so proposals are mostly rejected: that run measures what
speculation costs when it guesses wrong. The CPU model and ISA are in the JSON's `machine`; the
`summary` has speculative_speedup_grounded, speculative_speedup_chat, speculative_throughput_ratio
and speculative_acceptance_rate (over all three scenarios), and the per-scenario figures.

`--spec-method draft` proposes with a draft model instead (spec_draft.py; `--draft-model`,
default the model itself). The model as its own draft is right nearly always, so it gives the
upper bound on acceptance and the cost of running a draft as large as the model: a lower bound
on what a real, smaller draft with the same tokenizer would win.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
from dataclasses import dataclass

from load_tests import hardware
from load_tests.common import StepLog, load_note, run_and_report

__all__ = [
    "CHAT_PROMPTS", "FULL", "GROUNDED_ASKS", "QUICK", "TEXT", "SpeculativeParams", "batch_prompts", "chat_ids", "format_table",
    "params_from_args", "prompt_ids", "run", "run_from_args",
]

# The text the prompt asks the model to repeat (written for this benchmark; the chat prompt is 215 tokens).
TEXT = (
    "The lighthouse on the northern cape was built in 1871 from granite quarried two miles inland. "
    "Its keeper, a retired ship's carpenter named Elias Brand, kept a logbook of every vessel that "
    "passed, the direction of the wind at dawn and dusk, and the number of gulls nesting on the "
    "lower gallery. In the winter of 1883 a storm tore the lantern's copper roof away; Brand and his "
    "daughter kept the lamp burning behind a screen of sailcloth for eleven nights until a supply "
    "boat could land. The logbook records that no ship was lost on the cape that winter. The "
    "station was automated in 1952, and the keeper's cottage is now a small museum that displays "
    "the logbook, the repaired lantern and a model of the supply boat, the Margaret Hale."
)


# Free-form chat: answers written from scratch, little in the prompt to copy.
CHAT_PROMPTS = (
    "Write a short poem about the first snow of winter in a mountain village.",
    "What are three good habits for staying focused while studying? Explain each briefly.",
    "Tell me a short story about a cat who wants to become a sailor.",
    "Explain how a bicycle stays upright when it is moving, in simple words.",
)
# Grounded: asks for a given text back, edited a little or not at all.
GROUNDED_ASKS = (
    "Repeat the following text exactly, word for word, and nothing else.",
    "Copy the following text, but write every number in words. Change nothing else.",
)


@dataclass(frozen=True)
class SpeculativeParams:
    model: str = "smollm2-135m-instruct"
    output_len: int = 128  # single-stream output tokens
    batch_output_len: int = 64  # output tokens of each throughput request
    num_requests: int = 64  # throughput requests, all at once
    repeats: int = 3
    threads: int = 2
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    kv_cache_mib: int = 1024  # 64 requests x ~280 tokens of SmolLM2 (23 KiB a token in bf16) without preemption
    dtype: str = "auto"
    spec_method: str = "ngram"  # or "draft" (spec_draft.py)
    draft_model: str | None = None  # spec_method draft: the draft model; None: the model itself (its own draft)
    # Adaptive speculation's step costs; None: measured at start-up (speculative.py). Tests pin them.
    verify_row_cost: float | None = None
    max_batch_rows: int | None = None
    quick: bool = False


FULL = SpeculativeParams()
QUICK = dataclasses.replace(FULL, output_len=64, batch_output_len=32, num_requests=16, repeats=2, quick=True)

_progress = StepLog("bench speculative")


@dataclass
class StreamRun:
    num_output_tokens: int
    decode_s: float  # first token -> last token
    proposed: int  # speculation's counts over this run (0 without it)
    accepted: int
    verify_steps: int

    @property
    def decode_tokens_per_s(self) -> float:
        return (self.num_output_tokens - 1) / self.decode_s


def chat_ids(tokenizer, content: str) -> list[int]:
    """`content` as one user turn of the model's chat template (plain text where there is none)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer(content).input_ids


def prompt_ids(tokenizer, ask: str = GROUNDED_ASKS[0]) -> list[int]:
    """The chat prompt asking for TEXT back (plain text where there is no template)."""
    return chat_ids(tokenizer, f"{ask}\n\n{TEXT}")


def batch_prompts(tokenizer, num_requests: int) -> list[list[int]]:
    """The throughput mix: grounded and chat requests alternating, each kind cycling its prompts."""
    grounded = [prompt_ids(tokenizer, ask) for ask in GROUNDED_ASKS]
    chat = [chat_ids(tokenizer, content) for content in CHAT_PROMPTS]
    return [grounded[i // 2 % len(grounded)] if i % 2 == 0 else chat[i // 2 % len(chat)] for i in range(num_requests)]


@dataclass
class BatchRun:
    num_output_tokens: int
    wall_s: float  # first request added -> last token
    proposed: int
    accepted: int
    verify_steps: int

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s


def _batch(engine, run_id: str, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], BatchRun]:
    import time

    from serving.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    before = engine.stats()
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{run_id}-{i}", params=params, prompt_token_ids=prompt)
    tokens: dict[str, list[int]] = {f"{run_id}-{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].token_ids if out.outputs else []
    wall_s = time.perf_counter() - started
    after = engine.stats()
    outputs = list(tokens.values())
    return outputs, BatchRun(
        sum(len(t) for t in outputs), wall_s,
        after.spec_proposed_tokens - before.spec_proposed_tokens,
        after.spec_accepted_tokens - before.spec_accepted_tokens,
        after.spec_verify_steps - before.spec_verify_steps,
    )


def _acceptance(runs) -> dict:
    proposed, accepted, steps = (sum(getattr(r, f) for r in runs) for f in ("proposed", "accepted", "verify_steps"))
    return {"proposed": proposed, "accepted": accepted, "verify_steps": steps,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "tokens_per_verify_step": (accepted + steps) / steps if steps else 0.0}


def _stream(engine, request_id: str, prompt: list[int], max_tokens: int) -> tuple[list[int], StreamRun]:
    from serving.engine import SamplingParams

    before = engine.stats()
    engine.add_request(request_id, params=SamplingParams(temperature=0.0, max_tokens=max_tokens), prompt_token_ids=prompt)
    tokens: list[int] = []
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.outputs[0].token_ids if out.outputs else []
            final = out
    after = engine.stats()
    m = final.metrics
    return tokens, StreamRun(
        len(tokens), m.finished_mono_s - m.first_token_mono_s,
        after.spec_proposed_tokens - before.spec_proposed_tokens,
        after.spec_accepted_tokens - before.spec_accepted_tokens,
        after.spec_verify_steps - before.spec_verify_steps,
    )


def run(p: SpeculativeParams, *, command: str = "") -> dict:
    import torch

    from serving.engine import EngineConfig, LLMEngine
    from serving.engine.modeling.loader import resolve_model_dir

    saved_threads = torch.get_num_threads()
    torch.set_num_threads(p.threads)
    try:
        machine = hardware.machine_record(num_threads=p.threads)
        base = {"model": str(resolve_model_dir(p.model)), "dtype": p.dtype, "kv_cache_bytes": p.kv_cache_mib * 2**20,
                "num_threads": p.threads, "enable_prefix_caching": False}
        spec = {"method": p.spec_method, "num_speculative_tokens": p.num_speculative_tokens,
                "verify_row_cost": p.verify_row_cost, "max_batch_rows": p.max_batch_rows}
        if p.spec_method == "draft":
            spec["draft_model"] = str(resolve_model_dir(p.draft_model or p.model))
        else:
            spec.update(prompt_lookup_min=p.prompt_lookup_min, prompt_lookup_max=p.prompt_lookup_max)
        off = LLMEngine(EngineConfig(**base))
        # The same dtype for both: "auto" is measured at start-up and may resolve differently twice.
        base["dtype"] = off.config.dtype
        engines = {"off": off, "on": LLMEngine(EngineConfig(**base, speculative=spec))}
        off = None
        tokenizer = engines["off"].tokenizer
        streams = {"grounded": prompt_ids(tokenizer), "chat": chat_ids(tokenizer, CHAT_PROMPTS[0])}
        mix = batch_prompts(tokenizer, p.num_requests)
        _progress(f"warm-up ({len(streams['grounded'])}-token prompt)")
        for name, engine in engines.items():
            _stream(engine, f"warmup-{name}", streams["grounded"], 8)
        runs: dict[str, dict[str, list]] = {scenario: {name: [] for name in engines} for scenario in (*streams, "throughput")}
        outputs: dict[str, dict[str, list]] = {scenario: {} for scenario in runs}
        for repeat in range(p.repeats):
            for scenario, prompt in streams.items():
                for name, engine in engines.items():
                    _progress(f"{scenario}, speculation {name}: 1 x {len(prompt)} -> {p.output_len}, run {repeat + 1}/{p.repeats}")
                    outputs[scenario][name], one = _stream(engine, f"{scenario}-{name}-{repeat}", prompt, p.output_len)
                    runs[scenario][name].append(one)
            for name, engine in engines.items():
                _progress(f"throughput, speculation {name}: {p.num_requests} requests -> {p.batch_output_len}, "
                          f"run {repeat + 1}/{p.repeats}")
                outputs["throughput"][name], one = _batch(engine, f"batch-{name}-{repeat}", mix, p.batch_output_len)
                runs["throughput"][name].append(one)
        dtype = engines["off"].config.dtype
        on_stats = engines["on"].stats()
        texts = {scenario: tokenizer.decode(outputs[scenario]["off"], skip_special_tokens=True) for scenario in streams}
    finally:
        torch.set_num_threads(saved_threads)
        engines = off = None
        gc.collect()
    hardware.finish_machine_record(machine, dtype=dtype)
    summary = {"model": p.model, "spec_max_batch_rows": on_stats.spec_max_batch_rows,
               "spec_single_row_cost": on_stats.spec_single_row_cost}
    for scenario in streams:
        tps = {name: statistics.median(r.decode_tokens_per_s for r in rs) for name, rs in runs[scenario].items()}
        acceptance = _acceptance(runs[scenario]["on"])
        summary[scenario] = {
            "prompt_tokens": len(streams[scenario]),
            "output_tokens": len(outputs[scenario]["off"]),
            "off_decode_tokens_per_s": tps["off"],
            "on_decode_tokens_per_s": tps["on"],
            "speedup": tps["on"] / tps["off"],
            "acceptance_rate": acceptance["acceptance_rate"],
            "tokens_per_verify_step": acceptance["tokens_per_verify_step"],
            "identical": outputs[scenario]["on"] == outputs[scenario]["off"],
        }
    summary["grounded"]["output_copies_text"] = texts["grounded"].strip()[:80] in TEXT
    tps = {name: statistics.median(r.tokens_per_s for r in rs) for name, rs in runs["throughput"].items()}
    acceptance = _acceptance(runs["throughput"]["on"])
    summary["throughput"] = {
        "num_requests": p.num_requests,
        "output_tokens": runs["throughput"]["off"][0].num_output_tokens,
        "off_tokens_per_s": tps["off"],
        "on_tokens_per_s": tps["on"],
        "ratio": tps["on"] / tps["off"],
        "acceptance_rate": acceptance["acceptance_rate"],
        "tokens_per_verify_step": acceptance["tokens_per_verify_step"],
        "num_identical": sum(a == b for a, b in zip(outputs["throughput"]["on"], outputs["throughput"]["off"])),
    }
    overall = _acceptance([r for scenario in runs.values() for r in scenario["on"]])
    summary.update({
        "speculative_speedup_grounded": summary["grounded"]["speedup"],
        "speculative_speedup_chat": summary["chat"]["speedup"],
        "speculative_throughput_ratio": summary["throughput"]["ratio"],
        "speculative_acceptance_rate": overall["acceptance_rate"],
    })
    print(format_table(p, summary, machine))
    return {
        "summary": summary,
        "results": {
            "command": command,
            "params": dataclasses.asdict(p),
            "machine": machine,
            "output_text": texts,
            "runs": {scenario: {name: [{**dataclasses.asdict(r), **_rate(r)} for r in rs] for name, rs in by_name.items()}
                     for scenario, by_name in runs.items()},
        },
    }


def _rate(r) -> dict:
    if isinstance(r, StreamRun):
        return {"decode_tokens_per_s": r.decode_tokens_per_s}
    return {"tokens_per_s": r.tokens_per_s}


def format_table(p: SpeculativeParams, summary: dict, machine: dict) -> str:
    isa = ", ".join(name for name, present in machine["isa"].items() if present) or "none of " + ", ".join(machine["isa"])
    method = (
        f"draft {p.draft_model or p.model}, adaptive, k<={p.num_speculative_tokens}" if p.spec_method == "draft"
        else f"ngram, adaptive, k<={p.num_speculative_tokens}, n={p.prompt_lookup_min}..{p.prompt_lookup_max}"
    )
    g, c, t = summary["grounded"], summary["chat"], summary["throughput"]
    lines = [
        f"speculative decoding ({method}): "
        f"{p.model}, greedy, {p.threads} threads, median of {p.repeats} ({machine['cpu_model']}; {isa}; "
        f"dtype {machine.get('dtype')}; knee {summary['spec_max_batch_rows']} rows, "
        f"verify row {summary['spec_single_row_cost']:.2f} of a step)",
        "  scenario                        off          on    speedup  acceptance  tokens/verify  same tokens",
    ]
    for name, s in (("grounded", g), ("chat", c)):
        lines.append(
            f"  {name:<9} 1 x {s['prompt_tokens']:>3} -> {s['output_tokens']:<4} {s['off_decode_tokens_per_s']:9.1f}  "
            f"{s['on_decode_tokens_per_s']:9.1f}  {s['speedup']:8.3f}  {s['acceptance_rate']:10.3f}  "
            f"{s['tokens_per_verify_step']:13.2f}  {'yes' if s['identical'] else 'NO'}"
        )
    lines.append(
        f"  throughput {t['num_requests']:>4} x -> {p.batch_output_len:<4} {t['off_tokens_per_s']:9.1f}  {t['on_tokens_per_s']:9.1f}  "
        f"{t['ratio']:8.3f}  {t['acceptance_rate']:10.3f}  {t['tokens_per_verify_step']:13.2f}  "
        f"{t['num_identical']}/{t['num_requests']}"
    )
    lines.append(f"  (single streams: decode tok/s; throughput: generated tok/s; grounded output copies the text: "
                 f"{'yes' if g.get('output_copies_text') else 'no'}; acceptance over all: {summary['speculative_acceptance_rate']:.3f})")
    note = load_note(machine.get("load_avg_1m_at_start"))
    if note:
        lines.append(note)
    return "\n".join(lines)


def params_from_args(args: argparse.Namespace) -> SpeculativeParams:
    """The --quick or full preset, overridden by the knobs `bench engine` shares with it."""
    preset = QUICK if args.quick else FULL
    names = {f.name for f in dataclasses.fields(SpeculativeParams)} - {"quick", "output_len", "batch_output_len"}
    given = {name: getattr(args, name) for name in names if getattr(args, name, None) not in (None, False)}
    if getattr(args, "single_output_len", None):
        given["output_len"] = args.single_output_len
    if getattr(args, "output_len", None):
        given["batch_output_len"] = args.output_len
    p = dataclasses.replace(preset, **given)
    for name in ("output_len", "batch_output_len", "num_requests", "repeats", "threads", "kv_cache_mib", "num_speculative_tokens"):
        if getattr(p, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(p, name)}")
    if p.spec_method not in ("ngram", "draft"):
        raise SystemExit(f"--spec-method must be ngram or draft, got {p.spec_method!r}")
    if p.draft_model and p.spec_method != "draft":
        raise SystemExit("--draft-model needs --spec-method draft")
    if p.output_len < 2:
        raise SystemExit("--single-output-len must be >= 2 with --speculative (the first token is excluded)")
    return p


def run_from_args(args: argparse.Namespace, argv: list[str]) -> int:
    return run_and_report(args, argv, params_from_args, run, _progress)
