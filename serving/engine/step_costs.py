"""What verifying proposals costs as the batch grows: the measurement adaptive speculation (speculative.py) decides by.

A decode step streams every weight once whatever its number of rows, so while that read dominates
(memory-bound) extra rows are cheap; as rows grow the matrix products' arithmetic takes over
(compute-bound) and an extra row costs a full row's share. A verifying sequence also pays for its
layout: its 1 + k rows are a chunk with its own attention call over its gathered context
(model_runner.py), where a plain decode shares one batched kernel. Both are measured, as the
engine runs them, on its own model, KV cache and threads:

    decode(n)   a step of n sequences decoding one token each (paged decode attention)
    verify(n)   a step of n sequences each verifying k proposals (n chunks of 1 + k rows)
    cost(n)     (verify(n) / decode(n) - 1) / k: one verify row, as a fraction of a sequence's
                share of the decode step; made non-decreasing in n (a row never gets cheaper as
                the batch grows: this irons out timing noise)

    cost(n)
      1 ┤                                 ●  ●        compute-bound: a verify row costs what a
        │                           ●                 sure token's row does
   0.7 ┼ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ KNEE_FRACTION
        │                  ●
        │        ●   ●                                 memory-bound: a verify row is cheap
      0 ┼──●─────────────────────────────────── decoding sequences n (1, 2, 4, ...)
                                     ▲ knee_rows: the first n with cost(n) >= KNEE_FRACTION

n runs 1, 2, 4, ... until the knee (or max_rows), each row SHORT_CONTEXT_TOKENS of context (attention
a small part, as in chat), best of a few: ~1-2 s on SmolLM2-135M (AMD EPYC, 2 threads).
`row_cost(n)` is the c the Speculator's rule weighs a proposal against at n decoding sequences
(the cost at the largest measured n' <= n), `single_row_cost` is cost(1).

Nothing is hard-coded per CPU: an AMX Xeon, an AVX-512 EPYC and a GPU have their knees at very
different rows, so it is measured where the engine runs (the figures go in the start-up log and
EngineStats).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from serving.engine.kv.cache import KVCache
from serving.engine.modeling.attention import AttentionMetadata, PrefillChunk
from serving.engine.modeling.model import LlamaModel

__all__ = ["KNEE_FRACTION", "SHORT_CONTEXT_TOKENS", "StepCosts", "measure_step_costs", "step_costs_from"]

logger = logging.getLogger(__name__)

KNEE_FRACTION = 0.7  # an extra row costing this much of a row's share is "nearly a full row"
SHORT_CONTEXT_TOKENS = 128  # each measured row's context: attention stays a small part, as in chat


@dataclass(frozen=True)
class StepCosts:
    rows: tuple[int, ...]  # measured numbers of decoding sequences: 1, 2, 4, ... (increasing)
    decode_s: tuple[float, ...]  # best step time with each decoding one token
    verify_s: tuple[float, ...]  # best step time with each verifying k proposals (a chunk of 1 + k rows)
    num_speculative_tokens: int
    knee_rows: int  # the first rows whose row_cost reaches KNEE_FRACTION; the last measured when none

    def costs(self) -> list[float]:
        """A verify row's cost at each of `rows`, as a fraction of a sequence's share of the
        decode step, made non-decreasing (module docstring)."""
        out, top = [], 0.0
        for t_decode, t_verify in zip(self.decode_s, self.verify_s):
            top = max(top, (t_verify / t_decode - 1.0) / self.num_speculative_tokens)
            out.append(top)
        return out

    @property
    def single_row_cost(self) -> float:
        return self.costs()[0]

    def row_cost(self, num_rows: int) -> float:
        """A verify row's cost at `num_rows` decoding sequences: at the largest measured rows <= num_rows."""
        i = max(bisect.bisect_right(self.rows, num_rows) - 1, 0)
        return self.costs()[i]

    def __str__(self) -> str:
        points = ", ".join(f"{n}: {d * 1e3:.1f}/{v * 1e3:.1f}" for n, d, v in zip(self.rows, self.decode_s, self.verify_s))
        return (f"knee {self.knee_rows} rows, single-stream verify row {self.single_row_cost:.2f} of a step "
                f"(step ms decode/verify {self.num_speculative_tokens} by sequences {points})")


def step_costs_from(
    rows: list[int], decode_s: list[float], verify_s: list[float], num_speculative_tokens: int,
) -> StepCosts:
    """The knee of a measured curve: the first rows whose verify row cost reaches KNEE_FRACTION,
    else the last rows measured (verifying pays throughout)."""
    assert len(rows) == len(decode_s) == len(verify_s) >= 1 and rows == sorted(rows), (rows, decode_s, verify_s)
    costs = StepCosts(tuple(rows), tuple(decode_s), tuple(verify_s), num_speculative_tokens, rows[-1])
    for n, c in zip(rows, costs.costs()):
        if c >= KNEE_FRACTION:
            return dataclasses.replace(costs, knee_rows=n)
    return costs


def _decode_step_s(model: LlamaModel, kv_cache: KVCache, num_rows: int, repeats: int) -> float:
    device, bs = model.device, kv_cache.block_size
    num_ctx_blocks = max(1, min(-(-SHORT_CONTEXT_TOKENS // bs), kv_cache.fewest_blocks))
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
    return _best_s(model, kv_cache, input_ids, positions, meta, repeats)


def _best_s(model, kv_cache, input_ids, positions, meta, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats + 1):  # the first builds kernels for the shape
        started = time.perf_counter()
        with torch.inference_mode():
            model.compute_logits(model.forward(input_ids, positions, kv_cache.layers, meta))
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        best = min(best, time.perf_counter() - started)
    return best


def _verify_step_s(model: LlamaModel, kv_cache: KVCache, num_seqs: int, num_rows: int, repeats: int) -> float:
    """`num_seqs` sequences each verifying: a chunk of `num_rows` query rows over its context, as
    the engine lays a verify out (model_runner.py)."""
    device, bs = model.device, kv_cache.block_size
    num_ctx_blocks = max(1, min(-(-SHORT_CONTEXT_TOKENS // bs), kv_cache.fewest_blocks))
    ctx = num_ctx_blocks * bs
    assert num_rows <= ctx, (num_rows, ctx)
    block_ids = torch.arange(num_ctx_blocks, device=device)
    mask = torch.ones(num_rows, ctx, dtype=torch.bool).tril(diagonal=ctx - num_rows).to(device)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_seqs * num_rows, device=device) % ctx,
        num_decode_tokens=0,
        decode_block_tables=None,
        decode_context_lens=None,
        prefills=[PrefillChunk(i * num_rows, num_rows, ctx, block_ids, mask) for i in range(num_seqs)],
    )
    input_ids = torch.arange(num_seqs * num_rows, device=device) % model.vocab_size
    positions = torch.arange(ctx - num_rows, ctx, device=device).repeat(num_seqs)
    return _best_s(model, kv_cache, input_ids, positions, meta, repeats)


def measure_step_costs(
    model: LlamaModel, kv_cache: KVCache, *, max_rows: int, num_speculative_tokens: int, repeats: int = 3,
) -> StepCosts:
    """Time steps of 1, 2, 4, ... sequences decoding and verifying k proposals, until the knee (or
    max_rows); module docstring. Leaves garbage in the first KV blocks, harmless before any request has run."""
    started = time.perf_counter()
    k = num_speculative_tokens
    rows: list[int] = []
    decode_s: list[float] = []
    verify_s: list[float] = []
    n = 1
    while n <= max(max_rows, 1):
        rows.append(n)
        decode_s.append(_decode_step_s(model, kv_cache, n, repeats))
        verify_s.append(_verify_step_s(model, kv_cache, n, 1 + k, repeats))
        if (verify_s[-1] / decode_s[-1] - 1.0) / k >= KNEE_FRACTION:
            break
        n *= 2
    costs = step_costs_from(rows, decode_s, verify_s, k)
    logger.info("speculation step costs (%.2f s to measure): %s", time.perf_counter() - started, costs)
    return costs
