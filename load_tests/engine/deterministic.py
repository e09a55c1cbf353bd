"""What batch-invariant mode (EngineConfig.deterministic) costs: the same engine work with it off
and on, on one model and dtype, on this machine.

    prefill      N prompts of P tokens, one step each (max_tokens 1), prompt tokens per second
    decode x1    one sequence, D greedy tokens after a short prompt, generated tokens per second
    decode x16   16 sequences at once, the same

Each figure is the best of `repeats` runs, both modes measured in one process, alternately, so a
noisy neighbour hits both. Run it under the machine's CPU lock:

    python -m load_tests.engine.deterministic --dtype bfloat16 --out docs/bench_deterministic.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict, dataclass

import torch

from serving.engine import EngineConfig, LLMEngine, SamplingParams

__all__ = ["DeterministicFigures", "measure"]


@dataclass
class DeterministicFigures:
    model: str
    dtype: str
    num_threads: int
    prefill_tokens_per_s: dict[str, float]
    decode_1_tokens_per_s: dict[str, float]
    decode_16_tokens_per_s: dict[str, float]


def _prompts(num: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (length,), generator=gen).tolist() for _ in range(num)]


def _timed(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    engine.generate(prompts, params)
    return time.perf_counter() - started


def measure(model: str, dtype: str, *, prompt_tokens: int = 256, num_prefill: int = 8, decode_tokens: int = 64,
            repeats: int = 3) -> DeterministicFigures:
    engines = {
        mode: LLMEngine(EngineConfig(
            model=model, dtype=dtype, kv_cache_bytes=256 * 2**20, enable_prefix_caching=False,
            deterministic=mode == "on",
        ))
        for mode in ("off", "on")
    }
    best = {(mode, what): float("inf") for mode in engines for what in ("prefill", "d1", "d16")}
    long_prompts = _prompts(num_prefill, prompt_tokens, seed=1)
    short = _prompts(16, 16, seed=2)
    for engine in engines.values():  # warm-up: first calls pick kernels, allocate
        _timed(engine, long_prompts[:1], 1)
        _timed(engine, short[:2], 4)
    for _ in range(repeats):
        for mode, engine in engines.items():
            # one prompt per step: max_num_batched_tokens (512) holds at most two of 256
            best[mode, "prefill"] = min(best[mode, "prefill"], sum(_timed(engine, [p], 1) for p in long_prompts))
            best[mode, "d1"] = min(best[mode, "d1"], _timed(engine, short[:1], decode_tokens))
            best[mode, "d16"] = min(best[mode, "d16"], _timed(engine, short, decode_tokens))
    return DeterministicFigures(
        model=model, dtype=dtype, num_threads=torch.get_num_threads(),
        prefill_tokens_per_s={m: round(num_prefill * prompt_tokens / best[m, "prefill"], 1) for m in engines},
        decode_1_tokens_per_s={m: round(decode_tokens / best[m, "d1"], 1) for m in engines},
        decode_16_tokens_per_s={m: round(16 * decode_tokens / best[m, "d16"], 1) for m in engines},
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    figures = measure(args.model, args.dtype, repeats=args.repeats)
    result = {**asdict(figures), "cpu": platform.processor() or platform.machine()}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
