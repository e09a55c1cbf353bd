"""Suffix decoding vs prompt lookup vs none on repeated similar requests (serving/engine/spec/suffix.py).

    .venv/bin/python -m load_tests.engine.spec_suffix [--json PATH] [--output-len 96] [--repeats 2]
    .venv/bin/python -m load_tests.engine.spec_suffix --cost      # the proposer alone, no model

The workload is an agent's: the same structured request five times in a row with small changes
(a SQL query for another city, threshold and year), greedy, one at a time. Three engines of the
same model and dtype decode the sequence: speculation off, `ngram` (prompt lookup, sees only the
request) and `suffix` (also sees the outputs of the requests before it). Each repeat starts the
suffix proposer empty, so only requests 2..5 can be predicted from earlier ones and a repeat never
learns from the one before. Reported per engine: decode tok/s of request 1 and of requests 2..5
(output tokens - 1 over first -> last token, the engine's clock, summed over the requests; median
over repeats), acceptance, and whether every engine gave the same tokens (greedy speculation is
lossless: a mismatch is reported, not hidden).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

from load_tests import hardware
from load_tests.common import StepLog, write_report
from load_tests.engine.speculative import _stream

__all__ = ["VARIANTS", "proposer_cost", "run"]

# (city, minimum items, year): the small changes between the five requests.
VARIANTS = [("Lisbon", 3, 2021), ("Oslo", 5, 2022), ("Nairobi", 2, 2023), ("Quito", 4, 2024), ("Hanoi", 6, 2025)]
ASK = (
    "Tables: customers(id, name, email, city) and orders(id, customer_id, num_items, created_at). "
    "Write one SQL query that returns the name and email of every customer in {city} who placed an "
    "order with more than {items} items in {year}, newest order first. Answer with the query only."
)

_progress = StepLog("bench spec suffix")


def prompts(tokenizer) -> list[list[int]]:
    out = []
    for city, items, year in VARIANTS:
        ask = ASK.format(city=city, items=items, year=year)
        text = tokenizer.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True, tokenize=False)
        out.append(tokenizer(text, add_special_tokens=False).input_ids)
    return out


def run(*, model: str = "smollm2-135m-instruct", output_len: int = 96, repeats: int = 2, threads: int = 2,
        k: int = 4, dtype: str = "auto") -> dict:
    import torch

    from serving.engine import EngineConfig, LLMEngine
    from serving.engine.modeling.loader import resolve_model_dir
    from serving.engine.spec.speculative import build_proposer

    torch.set_num_threads(threads)
    machine = hardware.machine_record(num_threads=threads)
    base = {"model": str(resolve_model_dir(model)), "dtype": dtype, "kv_cache_bytes": 256 * 2**20,
            "num_threads": threads, "enable_prefix_caching": False}
    engines = {"off": LLMEngine(EngineConfig(**base))}
    base["dtype"] = engines["off"].config.dtype  # "auto" is measured at start-up: the same for all
    for method in ("ngram", "suffix"):
        engines[method] = LLMEngine(EngineConfig(**base, speculative={"method": method, "num_speculative_tokens": k}))
    asks = prompts(engines["off"].tokenizer)
    for name, engine in engines.items():
        _stream(engine, f"warmup-{name}", asks[0], 8)
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {}
    for repeat in range(repeats):
        for name, engine in engines.items():
            if engine.speculator is not None:  # forget earlier repeats (and the warm-up)
                engine.speculator.proposer = build_proposer(engine.config.speculative)
            _progress(f"{name}: {len(asks)} requests -> {output_len} tokens, repeat {repeat + 1}/{repeats}")
            outs, streams = [], []
            for i, ask in enumerate(asks):
                tokens, stream = _stream(engine, f"{name}-{repeat}-{i}", ask, output_len)
                outs.append(tokens)
                streams.append(stream)
            outputs[name] = outs
            later = streams[1:]
            runs[name].append({
                "first_decode_tokens_per_s": streams[0].decode_tokens_per_s,
                "later_decode_tokens_per_s": sum(s.num_output_tokens - 1 for s in later) / sum(s.decode_s for s in later),
                "proposed": sum(s.proposed for s in streams), "accepted": sum(s.accepted for s in streams),
                "later_proposed": sum(s.proposed for s in later), "later_accepted": sum(s.accepted for s in later),
                "output_tokens": [s.num_output_tokens for s in streams],
            })
    tokenizer = engines["off"].tokenizer
    hardware.finish_machine_record(machine, dtype=engines["off"].config.dtype)
    engines = None
    gc.collect()
    summary = {}
    for name, rs in runs.items():
        proposed, accepted = sum(r["proposed"] for r in rs), sum(r["accepted"] for r in rs)
        later_proposed, later_accepted = sum(r["later_proposed"] for r in rs), sum(r["later_accepted"] for r in rs)
        summary[name] = {
            "first_decode_tokens_per_s": statistics.median(r["first_decode_tokens_per_s"] for r in rs),
            "later_decode_tokens_per_s": statistics.median(r["later_decode_tokens_per_s"] for r in rs),
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "later_acceptance_rate": later_accepted / later_proposed if later_proposed else 0.0,
            "later_accepted_per_output_token": later_accepted / sum(sum(r["output_tokens"][1:]) for r in rs),
        }
    off = summary["off"]["later_decode_tokens_per_s"]
    for name in summary:
        summary[name]["later_speedup"] = summary[name]["later_decode_tokens_per_s"] / off
    for name in ("ngram", "suffix"):
        # per request: None where the tokens are the same as without speculation, else where they part
        summary[name]["first_difference"] = [_first_difference(a, b) for a, b in zip(outputs[name], outputs["off"])]
    summary["identical"] = all(d is None for name in ("ngram", "suffix") for d in summary[name]["first_difference"])
    report = {
        "summary": summary,
        "params": {"model": model, "output_len": output_len, "repeats": repeats, "threads": threads, "k": k},
        "machine": machine,
        "output_texts": {name: [tokenizer.decode(o, skip_special_tokens=True) for o in outs] for name, outs in outputs.items()},
        "runs": runs,
    }
    print(format_table(report))
    return report


def _first_difference(a: list[int], b: list[int]) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def format_table(report: dict) -> str:
    s, p, m = report["summary"], report["params"], report["machine"]
    isa = ", ".join(name for name, present in m["isa"].items() if present)
    lines = [
        f"{p['model']} ({m.get('dtype')}), {len(VARIANTS)} similar SQL requests in sequence -> <= {p['output_len']} tokens, "
        f"greedy, k={p['k']}, {p['threads']} threads, median of {p['repeats']} ({m['cpu_model']}; {isa})",
        "                 request 1 tok/s   requests 2-5 tok/s   speedup 2-5   acceptance 2-5   accepted/token 2-5",
    ]
    for name in ("off", "ngram", "suffix"):
        r = s[name]
        lines.append(
            f"  {name:<8} {r['first_decode_tokens_per_s']:17.1f} {r['later_decode_tokens_per_s']:20.1f} "
            f"{r['later_speedup']:13.2f} {r['later_acceptance_rate']:16.2f} {r['later_accepted_per_output_token']:20.2f}"
        )
    lines.append(
        f"  same tokens: {'yes' if s['identical'] else 'NO'} (first differences per request, ngram "
        f"{s['ngram']['first_difference']}, suffix {s['suffix']['first_difference']})"
    )
    return "\n".join(lines)


def proposer_cost() -> dict:
    """The proposer alone (the figures in spec_suffix.py's docstring): a step's cost and a first
    proposal's at 300 and 3000 tokens, beside prompt lookup's, with 64 finished 128-token outputs cached."""
    import torch

    from serving.engine import SamplingParams
    from serving.engine.request import RequestStatus, Sequence
    from serving.engine.spec.ngram import NgramProposer
    from serving.engine.spec.suffix import SuffixProposer

    gen = torch.Generator().manual_seed(0)

    def text(n: int) -> list[int]:
        return torch.randint(3, 2000, (n,), generator=gen).tolist()

    def sequence(tokens: list[int]) -> Sequence:
        return Sequence(request_id="r", index=0, prompt_token_ids=tokens, params=SamplingParams(), max_tokens=10**6)

    proposer = SuffixProposer(k=4, max_depth=16, max_cached_requests=256, max_cached_tokens=65536,
                              min_probability=0.1, max_spec_factor=1.0, cache_prompts=False)
    cache_s = []
    for _ in range(64):
        done = sequence([1])
        done.token_ids += text(128)
        done.status = RequestStatus.FINISHED_STOPPED
        start = time.perf_counter()
        proposer.release(done)
        cache_s.append(time.perf_counter() - start)
    out = {"machine": hardware.machine_record(num_threads=1), "cache_128_token_output_ms": statistics.median(cache_s) * 1e3}
    ngram = NgramProposer(min_n=2, max_n=4, k=4)
    for n in (300, 3000):
        seq = sequence(text(n))
        start = time.perf_counter()
        proposer.propose(seq, 4)
        first_ms = (time.perf_counter() - start) * 1e3
        num_nodes = proposer.live[seq.seq_id].tree.num_nodes
        more = text(1000)
        start = time.perf_counter()
        for token in more:
            seq.token_ids.append(token)
            proposer.propose(seq, 4)
        step_us = (time.perf_counter() - start) / len(more) * 1e6
        tokens = seq.token_ids[:n]
        start = time.perf_counter()
        for _ in range(200):
            ngram.propose(tokens, 4)
        ngram_us = (time.perf_counter() - start) / 200 * 1e6
        proposer.release(seq)
        out[f"{n}_tokens"] = {"step_us": step_us, "first_proposal_ms": first_ms, "tree_nodes": num_nodes, "ngram_step_us": ngram_us}
    print(json.dumps(out, indent=1))
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m load_tests.engine.spec_suffix", description=__doc__.split("\n")[0])
    parser.add_argument("--cost", action="store_true", help="time the proposer alone (no model)")
    parser.add_argument("--json", metavar="PATH", help="write the report here")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    if args.cost:
        report = proposer_cost()
    else:
        report = run(model=args.model, output_len=args.output_len, repeats=args.repeats, threads=args.threads, dtype=args.dtype)
        report["command"] = " ".join(["python -m load_tests.engine.spec_suffix", *argv])
    if args.json:
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
