"""The simulator's cost model, measured on the real engine (one torch thread, as each prefill
replica runs).

One in-process LLMEngine times whole prefills (add_request -> the first token, max_tokens=1):

    cold     fresh random prompts of suffix_len, prefix_len // 4, prefix_len // 2 and
             prefix_len + suffix_len tokens, `repeats` each
    cached   prefix_len + suffix_len tokens whose prefix the previous prompt left in the cache

and fits, by least squares over the medians with every coefficient >= 0,

    seconds = overhead_s + uncached / tokens_per_s + attention_pair_s * pairs
    pairs   = uncached * cached + uncached * (uncached + 1) / 2   (query-key pairs of causal
              attention: each new token reads the cached prefix and the new tokens before it)

On this CPU the pair term matters: a cold 1088-token prefill costs ~1.8 ms per token, a 64-token
one ~1.4 ms, and 64 new tokens after a 1024-token cached prefix cost ~2.5 ms each. The result
goes into the benchmark's JSON (config.calibration) so a later run can reuse it (--calibration).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from load_tests.routing.sim import CostModel

__all__ = ["Calibration", "CalibrationPoint", "calibrate", "fit"]


@dataclass(frozen=True)
class CalibrationPoint:
    num_prompt_tokens: int
    num_cached_tokens: int
    seconds: list[float]

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)


@dataclass(frozen=True)
class Calibration:
    overhead_s: float
    tokens_per_s: float
    attention_pair_s: float
    points: list[CalibrationPoint] = field(default_factory=list)
    info: dict = field(default_factory=dict)  # model, dtype, threads, KV blocks, load average

    def cost_model(self) -> CostModel:
        return CostModel(self.overhead_s, self.tokens_per_s, self.attention_pair_s)

    def to_json(self) -> dict:
        out = asdict(self)
        for point, data in zip(self.points, out["points"]):
            data["median_s"] = point.median_s
            data["model_s"] = self.cost_model().service_s(
                point.num_prompt_tokens - point.num_cached_tokens, point.num_cached_tokens
            )
        return out

    @classmethod
    def from_json(cls, data: dict) -> Calibration:
        points = [
            CalibrationPoint(p["num_prompt_tokens"], p["num_cached_tokens"], list(p["seconds"]))
            for p in data.get("points", [])
        ]
        return cls(data["overhead_s"], data["tokens_per_s"], data["attention_pair_s"], points, dict(data.get("info", {})))


def _pairs(num_uncached: int, num_cached: int) -> float:
    return num_uncached * num_cached + num_uncached * (num_uncached + 1) / 2


def fit(points: list[CalibrationPoint]) -> tuple[float, float, float]:
    """(overhead_s, tokens_per_s, attention_pair_s): the least-squares fit with coefficients >= 0
    (the best of the fits that drop the intercept, the pair term, or both)."""
    rows = [(1.0, p.num_prompt_tokens - p.num_cached_tokens, _pairs(p.num_prompt_tokens - p.num_cached_tokens,
                                                                     p.num_cached_tokens)) for p in points]
    design = np.array(rows, dtype=float)
    seconds = np.array([p.median_s for p in points])
    if len({row[1:] for row in rows}) < 2:
        raise ValueError("the fit needs prompts of at least two shapes")
    best = None
    for columns in ([0, 1, 2], [1, 2], [0, 1], [1]):
        coef, *_ = np.linalg.lstsq(design[:, columns], seconds, rcond=None)
        if (coef < 0).any():
            continue
        residual = float(((design[:, columns] @ coef - seconds) ** 2).sum())
        if best is None or residual < best[0] - 1e-15:
            full = dict(zip(columns, coef.tolist()))
            best = (residual, full.get(0, 0.0), full[1], full.get(2, 0.0))
    assert best is not None and best[2] > 0, f"prefill time does not grow with the prompt: {points}"
    return best[1], 1.0 / best[2], best[3]


def calibrate(model: str, *, dtype: str = "bfloat16", prefix_len: int = 1024, suffix_len: int = 64,
              repeats: int = 3, seed: int = 0, progress=lambda message: None) -> Calibration:
    import os

    import torch

    from serving.engine import EngineConfig, LLMEngine, SamplingParams

    saved_threads = torch.get_num_threads()
    prompt_len = prefix_len + suffix_len
    engine = LLMEngine(EngineConfig(
        model=model, dtype=dtype, num_threads=1, kv_cache_bytes=256 * 2**20, max_model_len=max(2048, prompt_len + 1),
    ))
    rng = np.random.default_rng([seed, 7])
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)

    def draw(length: int) -> list[int]:
        return rng.integers(100, engine.vocab_size, length).tolist()

    def timed(prompt: list[int]) -> tuple[float, int]:
        start = time.perf_counter()
        (out,) = engine.generate([prompt], params)
        return time.perf_counter() - start, out.num_cached_tokens

    try:
        progress(f"calibration: {model} ({dtype}, 1 thread): cold prompts of {suffix_len} to {prompt_len} "
                 f"tokens and {suffix_len} after a cached {prefix_len}, x {repeats}")
        for _ in range(2):
            timed(draw(256))  # warm-up: first calls allocate and pick kernels
        cold_lengths = sorted({suffix_len, max(1, prefix_len // 4), max(1, prefix_len // 2), prompt_len})
        seconds: dict[tuple[int, int], list[float]] = {}
        for _ in range(repeats):
            for length in cold_lengths:
                prefix = draw(prefix_len) if length == prompt_len else None
                prompt = prefix + draw(suffix_len) if prefix is not None else draw(length)
                elapsed, num_cached = timed(prompt)
                assert num_cached == 0, num_cached
                seconds.setdefault((length, 0), []).append(elapsed)
                if prefix is not None:
                    elapsed, num_cached = timed(prefix + draw(suffix_len))  # the prefix is cached now
                    seconds.setdefault((prompt_len, num_cached), []).append(elapsed)
        points = [CalibrationPoint(n, c, s) for (n, c), s in sorted(seconds.items())]
        info = {
            "model": model, "dtype": dtype, "num_threads": 1, "num_kv_blocks": engine.block_manager.num_blocks,
            "load_avg_1m": os.getloadavg()[0],
        }
    finally:
        torch.set_num_threads(saved_threads)
    return Calibration(*fit(points), points, info)
