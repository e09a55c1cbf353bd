"""`kvrelay bench engine --speculative`: what n-gram speculative decoding does to a single stream.

One request at a time, greedy, on an input-grounded task (the chat prompt gives a text and asks
for it back word for word: what prompt lookup is for), decoded by two engines of the same model
in one process, one without speculation and one with `speculative: {method: ngram, ...}`,
interleaved (off on off on ...) `--repeats` times:

    decode tok/s   (output tokens - 1) / (last token - first token), the engine's own clock:
                   the prompt's prefill is not in it
    speedup        median on / median off
    acceptance     accepted / proposed tokens, and tokens kept per verifying step (1 = no gain)

Both engines must give the same tokens (greedy speculation is lossless): checked, and a
mismatch is reported (`identical: false`), not hidden. On a random-weight model the output does
not copy the text, so proposals are mostly rejected: that run measures what speculation costs
when it guesses wrong. The CPU model and ISA are in the JSON's `machine`.

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

__all__ = ["FULL", "QUICK", "TEXT", "SpeculativeParams", "format_table", "params_from_args", "run", "run_from_args"]

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


@dataclass(frozen=True)
class SpeculativeParams:
    model: str = "smollm2-135m-instruct"
    output_len: int = 128
    repeats: int = 3
    threads: int = 2
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    kv_cache_mib: int = 256
    dtype: str = "auto"
    spec_method: str = "ngram"  # or "draft" (spec_draft.py)
    draft_model: str | None = None  # spec_method draft: the draft model; None: the model itself (its own draft)
    quick: bool = False


FULL = SpeculativeParams()
QUICK = dataclasses.replace(FULL, output_len=64, repeats=2, quick=True)

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


def prompt_ids(tokenizer) -> list[int]:
    """The chat prompt asking for TEXT back word for word (plain text where there is no template)."""
    ask = f"Repeat the following text exactly, word for word, and nothing else.\n\n{TEXT}"
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer(ask).input_ids


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
        len(tokens), m.finished_time - m.first_token_time,
        after.spec_proposed_tokens - before.spec_proposed_tokens,
        after.spec_accepted_tokens - before.spec_accepted_tokens,
        after.spec_verify_steps - before.spec_verify_steps,
    )


def run(p: SpeculativeParams, *, command: str = "") -> dict:
    import torch

    from serving.engine import EngineConfig, LLMEngine
    from serving.engine.model_loader import resolve_model_dir

    saved_threads = torch.get_num_threads()
    torch.set_num_threads(p.threads)
    try:
        machine = hardware.machine_record(num_threads=p.threads)
        base = {"model": str(resolve_model_dir(p.model)), "dtype": p.dtype, "kv_cache_bytes": p.kv_cache_mib * 2**20,
                "num_threads": p.threads, "enable_prefix_caching": False}
        spec = {"method": p.spec_method, "num_speculative_tokens": p.num_speculative_tokens}
        if p.spec_method == "draft":
            spec["draft_model"] = str(resolve_model_dir(p.draft_model or p.model))
        else:
            spec.update(prompt_lookup_min=p.prompt_lookup_min, prompt_lookup_max=p.prompt_lookup_max)
        off = LLMEngine(EngineConfig(**base))
        # The same dtype for both: "auto" is measured at start-up and may resolve differently twice.
        base["dtype"] = off.config.dtype
        engines = {"off": off, "on": LLMEngine(EngineConfig(**base, speculative=spec))}
        off = None
        prompt = prompt_ids(engines["off"].tokenizer)
        _progress(f"warm-up ({len(prompt)}-token prompt)")
        for name, engine in engines.items():
            _stream(engine, f"warmup-{name}", prompt, 8)
        runs: dict[str, list[StreamRun]] = {name: [] for name in engines}
        outputs: dict[str, list[int]] = {}
        for repeat in range(p.repeats):
            for name, engine in engines.items():
                _progress(f"speculation {name}: 1 x {len(prompt)} -> {p.output_len}, run {repeat + 1}/{p.repeats}")
                outputs[name], one = _stream(engine, f"{name}-{repeat}", prompt, p.output_len)
                runs[name].append(one)
        dtype = engines["off"].config.dtype
        text = engines["off"].tokenizer.decode(outputs["off"], skip_special_tokens=True)
    finally:
        torch.set_num_threads(saved_threads)
        engines = off = None
        gc.collect()
    hardware.finish_machine_record(machine, dtype=dtype)
    tps = {name: statistics.median(r.decode_tokens_per_s for r in rs) for name, rs in runs.items()}
    on = runs["on"]
    proposed, accepted, steps = (sum(getattr(r, f) for r in on) for f in ("proposed", "accepted", "verify_steps"))
    summary = {
        "model": p.model,
        "prompt_tokens": len(prompt),
        "output_tokens": len(outputs["off"]),
        "off_decode_tokens_per_s": tps["off"],
        "on_decode_tokens_per_s": tps["on"],
        "speedup": tps["on"] / tps["off"],
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "tokens_per_verify_step": (accepted + steps) / steps if steps else 0.0,
        "identical": outputs["on"] == outputs["off"],
        "output_copies_text": text.strip()[:80] in TEXT,
    }
    print(format_table(p, summary, machine))
    return {
        "summary": summary,
        "results": {
            "command": command,
            "params": dataclasses.asdict(p),
            "machine": machine,
            "output_text": text,
            "runs": {name: [{**dataclasses.asdict(r), "decode_tokens_per_s": r.decode_tokens_per_s} for r in rs]
                     for name, rs in runs.items()},
        },
    }


def format_table(p: SpeculativeParams, summary: dict, machine: dict) -> str:
    isa = ", ".join(name for name, present in machine["isa"].items() if present) or "none of " + ", ".join(machine["isa"])
    method = (
        f"draft {p.draft_model or p.model}, k={p.num_speculative_tokens}" if p.spec_method == "draft"
        else f"ngram, k={p.num_speculative_tokens}, n={p.prompt_lookup_min}..{p.prompt_lookup_max}"
    )
    lines = [
        f"speculative decoding ({method}): "
        f"{p.model}, 1 x {summary['prompt_tokens']} -> {summary['output_tokens']} tokens, greedy, repeat-the-text task, "
        f"{p.threads} threads, median of {p.repeats} ({machine['cpu_model']}; {isa}; dtype {machine.get('dtype')})",
        f"  speculation off      {summary['off_decode_tokens_per_s']:9.1f} decode tok/s",
        f"  speculation on       {summary['on_decode_tokens_per_s']:9.1f} decode tok/s",
        f"  speedup              {summary['speedup']:9.3f}",
        f"  acceptance           {summary['acceptance_rate']:9.3f}   tokens per verifying step {summary['tokens_per_verify_step']:.2f}",
        f"  same tokens          {'yes' if summary['identical'] else 'NO'}   output copies the text: "
        f"{'yes' if summary['output_copies_text'] else 'no'}",
    ]
    note = load_note(machine.get("load_avg_1m_at_start"))
    if note:
        lines.append(note)
    return "\n".join(lines)


def params_from_args(args: argparse.Namespace) -> SpeculativeParams:
    """The --quick or full preset, overridden by the knobs `bench engine` shares with it."""
    preset = QUICK if args.quick else FULL
    names = {f.name for f in dataclasses.fields(SpeculativeParams)} - {"quick", "output_len"}  # --single-output-len
    given = {name: getattr(args, name) for name in names if getattr(args, name, None) not in (None, False)}
    if getattr(args, "single_output_len", None):
        given["output_len"] = args.single_output_len
    p = dataclasses.replace(preset, **given)
    for name in ("output_len", "repeats", "threads", "kv_cache_mib", "num_speculative_tokens"):
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
