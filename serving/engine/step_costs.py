"""What a step costs as its decode rows grow: the measurement adaptive speculation (speculative.py) decides by.

A decode step streams every weight once whatever its number of rows, so while that read dominates
(memory-bound) an extra row, such as a proposed token to verify, costs a small fraction of what a
row's share of the step is. As rows grow the matrix products' arithmetic takes over
(compute-bound) and an extra row costs a full row's share: verifying a guess then takes the
compute a sure token would have had, and speculation slows the batch down.

    step time t(n)
      │                                      ╱   compute-bound: t grows with n, elasticity ~1
      │                                  ╱
      │                             ╱
      │  ─────────────────────╱               memory-bound: t nearly flat, elasticity ~0
      │                     ▲ knee: the first n with elasticity(n) >= KNEE_FRACTION
      └─────────────────────┴──────────── decode rows n (1, 2, 4, ...)

    elasticity(n) = (t(2n) - t(n)) / n  /  (t(n) / n)  =  t(2n) / t(n) - 1
                    what one more row costs, as a fraction of one row's share of the step

`measure_step_costs` times a decode forward pass (one row per sequence, SHORT_CONTEXT_TOKENS of
context each, paged attention and the lm_head over every row, as verify rows have) at 1, 2, 4, ...
rows on the engine's own model, KV cache and threads (best of a few), until the knee or max_rows:
about a second on SmolLM2-135M (AMD EPYC, 2 threads). It also times 1 + k rows (k: the most
proposals) for the single stream's verify row cost, (t(1 + k) - t(1)) / (k t(1)).

`row_cost(n)` is what speculation weighs a proposal against at n rows in the step (the Speculator's
rule): the single stream's verify row cost at n = 1, the elasticity at the largest measured power
of two <= n above, made non-decreasing (a row never gets cheaper as the step grows; this irons out
timing noise in the small-n points).

Nothing is hard-coded per CPU: an AMX Xeon, an AVX-512 EPYC and a GPU have their knees at very
different rows, so it is measured where the engine runs (the figures go in the start-up log and
EngineStats).
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from serving.engine.attention import AttentionMetadata
from serving.engine.kv_cache import KVCache
from serving.engine.model import LlamaModel

__all__ = ["KNEE_FRACTION", "SHORT_CONTEXT_TOKENS", "StepCosts", "measure_step_costs", "step_costs_from"]

logger = logging.getLogger(__name__)

KNEE_FRACTION = 0.7  # an extra row costing this much of a row's share is "nearly a full row"
SHORT_CONTEXT_TOKENS = 128  # each measured row's context: attention stays a small part, as in chat


@dataclass(frozen=True)
class StepCosts:
    rows: tuple[int, ...]  # measured decode rows: 1, 2, 4, ... (powers of two, increasing)
    step_s: tuple[float, ...]  # best step time at each
    single_row_cost: float  # a verify row at one sequence, as a fraction of a one-row step
    knee_rows: int  # the first rows with elasticity >= KNEE_FRACTION; the last measured when none

    def elasticity(self) -> list[float]:
        """At each of rows[:-1], non-decreasing (module docstring)."""
        out, top = [], 0.0
        for t_n, t_2n in zip(self.step_s, self.step_s[1:]):
            top = max(top, t_2n / t_n - 1.0)
            out.append(top)
        return out

    def row_cost(self, num_rows: int) -> float:
        """One more row's cost at `num_rows` rows, as a fraction of a row's share of the step."""
        costs = [self.single_row_cost, *self.elasticity()]
        costs = [max(costs[: i + 1]) for i in range(len(costs))]
        if num_rows <= 1:
            return costs[0]
        i = bisect.bisect_right(self.rows, num_rows) - 1  # rows[i]: the largest measured power of two <= num_rows
        return costs[min(i + 1, len(costs) - 1)]  # costs[i + 1]: the elasticity at rows[i]

    def __str__(self) -> str:
        points = ", ".join(f"{n}: {s * 1e3:.1f}" for n, s in zip(self.rows, self.step_s))
        return (f"knee {self.knee_rows} rows, single-stream verify row {self.single_row_cost:.2f} of a step "
                f"(step ms by rows {points})")


def step_costs_from(rows: list[int], step_s: list[float], single_row_cost: float) -> StepCosts:
    """The knee of a measured curve (rows 1, 2, 4, ...): the first n whose elasticity reaches
    KNEE_FRACTION, else the last n measured (memory-bound throughout)."""
    assert len(rows) == len(step_s) >= 2 and rows[0] == 1, (rows, step_s)
    assert all(b == 2 * a for a, b in zip(rows, rows[1:])), rows
    costs = StepCosts(tuple(rows), tuple(step_s), single_row_cost, rows[-1])
    for n, e in zip(rows, costs.elasticity()):
        if e >= KNEE_FRACTION:
            return StepCosts(costs.rows, costs.step_s, single_row_cost, n)
    return costs


def _decode_step_s(model: LlamaModel, kv_cache: KVCache, num_rows: int, repeats: int) -> float:
    device, bs = model.device, kv_cache.block_size
    num_ctx_blocks = max(1, min(-(-SHORT_CONTEXT_TOKENS // bs), kv_cache.num_blocks))
    ctx = num_ctx_blocks * bs
    # Every row reads the same context blocks and writes a slot in them (garbage: nothing is cached yet).
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_rows, device=device) % ctx,
        num_decode_tokens=num_rows,
        decode_block_tables=torch.arange(num_ctx_blocks, device=device).repeat(num_rows, 1),
        decode_context_lens=torch.full((num_rows,), ctx, dtype=torch.long, device=device),
        prefills=[],
    )
    input_ids = torch.arange(num_rows, device=device) % model.vocab_size
    positions = torch.full((num_rows,), ctx - 1, dtype=torch.long, device=device)
    best = float("inf")
    for _ in range(repeats + 1):  # the first builds kernels for the shape
        started = time.perf_counter()
        with torch.inference_mode():
            model.compute_logits(model.forward(input_ids, positions, kv_cache.layers, meta))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best


def measure_step_costs(
    model: LlamaModel, kv_cache: KVCache, *, max_rows: int, num_speculative_tokens: int, repeats: int = 3,
) -> StepCosts:
    """Time decode steps of 1, 2, 4, ... rows until the knee (or max_rows), and 1 + k rows (module
    docstring). Leaves garbage in the first KV blocks, harmless before any request has run."""
    started = time.perf_counter()
    rows, step_s = [1, 2], [_decode_step_s(model, kv_cache, 1, repeats), _decode_step_s(model, kv_cache, 2, repeats)]
    while step_s[-1] / step_s[-2] - 1.0 < KNEE_FRACTION and rows[-1] * 2 <= max(max_rows, 2):
        rows.append(rows[-1] * 2)
        step_s.append(_decode_step_s(model, kv_cache, rows[-1], repeats))
    k = num_speculative_tokens
    t_k = _decode_step_s(model, kv_cache, 1 + k, repeats)
    costs = step_costs_from(rows, step_s, max(t_k - step_s[0], 0.0) / (k * step_s[0]))
    logger.info("speculation step costs (%.2f s to measure): %s", time.perf_counter() - started, costs)
    return costs
