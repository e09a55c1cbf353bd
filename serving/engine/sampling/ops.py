"""The array work behind the sampler: penalties, top-k/top-p/min-p filtering, the inverse-CDF draw.

Split from sampler.py, which decides per row what to apply; these functions only compute.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["apply_penalties", "apply_token_bitmask", "top_k_top_p_min_p", "seed_from_key"]

# A top_p-only row looks at its 256 most likely tokens, then 4096, and is sorted in full only
# when those hold less than top_p of the mass (a flat distribution, or top_p near 1). On one
# CPU thread, 128 rows x 49k: topk(256) ~20 ms, topk(4096) ~85 ms, a full sort ~500 ms.
_TOP_P_CANDIDATES = (256, 4096)
# Columns per block of the two-level CDF (see _inverse_cdf).
_CDF_BLOCK = 64



def seed_from_key(seed_key: tuple[int, int, int]) -> int:
    """A stable 63-bit seed for (seed, choice index, output position), the same in any process.

    Python's hash() is salted per process, hence blake2b over fixed-width encodings.
    """
    data = b"".join(int(v).to_bytes(16, "little", signed=True) for v in seed_key)
    digest = hashlib.blake2b(data, digest_size=8, person=b"kvrelay.sampler").digest()
    return int.from_bytes(digest, "little") >> 1


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    repetition_penalties: Sequence[float],
    presence_penalties: Sequence[float],
    frequency_penalties: Sequence[float],
    *,
    row_ids: Sequence[int] | None = None,
) -> torch.Tensor:
    """Step 4, in place on contiguous float32 `logits` [rows, vocab]; returns `logits`.

    Entry j of each list belongs to logits row `row_ids[j]` (default: row j). Repetition
    (HF): every token in prompt + output has its logit divided by p when positive, multiplied
    by p otherwise. Then OpenAI's presence and frequency, over output tokens only:
    l -= frequency * count + presence. Only the listed tokens are read and written.
    """
    assert logits.is_contiguous(), "apply_penalties writes through a flat view"
    num_rows, vocab_size = logits.shape
    device = logits.device
    flat = logits.view(-1)
    rows = list(range(len(output_token_ids))) if row_ids is None else list(row_ids)

    def by_row(values: Sequence[float], neutral: float) -> torch.Tensor:
        t = torch.full((num_rows,), neutral, dtype=torch.float32)
        t[rows] = torch.tensor(values, dtype=torch.float32)
        return t.to(device)

    if any(p != 1.0 for p in repetition_penalties):
        active = [j for j, p in enumerate(repetition_penalties) if p != 1.0]
        seen = [prompt_token_ids[j] for j in active] + [output_token_ids[j] for j in active]
        index = _flat_index(seen, [rows[j] for j in active] * 2, vocab_size, device)
        if index is not None:
            p = by_row(repetition_penalties, 1.0)[index // vocab_size]
            values = flat[index]
            # A repeated token writes the same value each time, so duplicates need no dedup. A
            # penalty that float32 rounds to 0 (the API accepts any p > 0) would make a positive
            # logit +inf, and a masked one (-inf * 0) NaN: the first is held at the largest finite
            # logit, the second stays masked, so the row still has a distribution to sample.
            penalized = torch.where(values > 0, values / p, values * p)
            flat[index] = torch.nan_to_num(penalized, nan=float("-inf"), posinf=torch.finfo(torch.float32).max)

    if any(p != 0.0 for p in presence_penalties) or any(p != 0.0 for p in frequency_penalties):
        index = _flat_index(output_token_ids, rows, vocab_size, device)
        if index is not None:
            # Indices are offset by row, so unique() counts per (row, token).
            tokens, counts = torch.unique(index, return_counts=True)
            row = tokens // vocab_size
            penalty = by_row(frequency_penalties, 0.0)[row] * counts + by_row(
                presence_penalties, 0.0
            )[row]
            flat[tokens] -= penalty
    return logits


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, row_ids: Sequence[int]) -> torch.Tensor:
    """Step 4b, in place on float32 `logits` [rows, vocab]: row `row_ids[j]` keeps the tokens whose
    bit is set in `bitmask[j]` (int32 words on the CPU, bit b of word w = token 32 w + b, as
    serving/engine/sampling/grammar.py fills it) and the others become -inf. Returns `logits`. A row with
    no bit set raises ValueError: it would have nothing to sample.

    The words are read as bytes (little-endian: token order) and each byte looks up its 8 values,
    0 or -inf, in a [256, 8] table; the rows get them added (x + 0 is x exactly). On 2 cores that is
    0.2 ms for 16 rows of 49k, where a masked_fill from unpacked bits takes 1.9 ms.
    """
    assert bitmask.dtype == torch.int32 and bitmask.device.type == "cpu" and bitmask.is_contiguous()
    assert sys.byteorder == "little", "the bitmask's bytes are read in little-endian order"
    num_rows, vocab_size = len(row_ids), logits.shape[1]
    assert bitmask.shape == (num_rows, (vocab_size + 31) // 32), f"bitmask {tuple(bitmask.shape)} for {num_rows} rows of {vocab_size}"
    dead = (bitmask == 0).all(dim=1)  # bits past the vocabulary are never set
    if dead.any():  # nothing to sample: the row's request fails (Sampler.sample_each finds it), not the batch
        raise ValueError(f"the grammar of row {row_ids[int(dead.nonzero()[0])]} allows no token")
    table = _bit_bias_table(logits.device)
    byte_ids = bitmask.view(torch.uint8).view(-1).to(device=logits.device, dtype=torch.int32)
    bias = torch.index_select(table, 0, byte_ids).view(num_rows, -1)[:, :vocab_size]
    if num_rows == logits.shape[0]:
        logits.add_(bias)
    else:
        logits.index_add_(0, torch.tensor(list(row_ids), device=logits.device), bias)
    return logits


_BIT_BIAS_TABLES: dict[torch.device, torch.Tensor] = {}


def _bit_bias_table(device: torch.device) -> torch.Tensor:
    """[256, 8] float32: row b holds, for each bit k of the byte b (least significant first), 0 when
    it is set and -inf when not."""
    table = _BIT_BIAS_TABLES.get(device)
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        table = _BIT_BIAS_TABLES[device] = torch.where(bits == 1, 0.0, -math.inf).to(device)
    return table


def top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: Sequence[int],
    top_p: Sequence[float],
    min_p: Sequence[float],
) -> torch.Tensor:
    """Step 6's filters on temperature-scaled float32 `logits` [rows, vocab].

    Returns probabilities [rows, vocab] in vocabulary order, dropped tokens at 0, not
    renormalised. Disabled values: top_k 0 (or >= vocab), top_p 1, min_p 0.

    - top_k keeps the k highest logits.
    - top_p keeps the smallest prefix of the renormalised top-k whose mass reaches top_p:
      a token survives when the mass strictly before it is < top_p; the top token always does.
    - min_p drops tokens with prob < min_p * max prob (a ratio: renormalising cannot change it).
    """
    probs = torch.zeros_like(logits)
    for group in _filter(logits, top_k, top_p, min_p):
        rows = torch.tensor(group.rows, device=logits.device)
        if group.token_ids is None:
            probs[rows] = group.probs
        else:
            probs[rows] = probs[rows].scatter(1, group.token_ids, group.probs)
    return probs


@dataclass
class _Candidates:
    """Rows that share a filter path, with what survives of their distributions."""

    rows: list[int]  # rows of the filtered batch
    probs: torch.Tensor  # [len(rows), width], unnormalised, dropped tokens at 0
    token_ids: torch.Tensor | None  # [len(rows), width]; None: column j is token j


def _filter(
    x: torch.Tensor,
    top_k: Sequence[int],
    top_p: Sequence[float],
    min_p: Sequence[float],
    *,
    stage: int = 0,
) -> list[_Candidates]:
    """Group rows by filter path (see the module docstring) and filter each group.

    `stage` indexes _TOP_P_CANDIDATES for top_p-only rows; past its end they are sorted.
    """
    result: list[_Candidates] = []
    too_narrow: list[int] = []
    for (kind, width), idx in _filter_paths(*x.shape, top_k, top_p, stage).items():
        sub = _take(x, idx)
        if kind == "vocab":
            probs = torch.softmax(sub, dim=-1)
            _apply_min_p(probs, probs.amax(dim=-1, keepdim=True), [min_p[i] for i in idx])
            result.append(_Candidates(idx, probs, None))
            continue
        candidates, narrow = _filter_top(sub, kind, width, idx, top_p, min_p)
        too_narrow.extend(narrow)
        if candidates is not None:
            result.append(candidates)

    if too_narrow:
        for group in _filter(
            _take(x, too_narrow),
            [0] * len(too_narrow),
            [top_p[i] for i in too_narrow],
            [min_p[i] for i in too_narrow],
            stage=stage + 1,
        ):
            group.rows = [too_narrow[j] for j in group.rows]
            result.append(group)
    return result


def _filter_paths(
    num_rows: int, vocab_size: int, top_k: Sequence[int], top_p: Sequence[float], stage: int
) -> dict[tuple[str, int], list[int]]:
    """Rows by (filter path, candidate width): top_k, top_p (over a stage's candidates) or vocab."""
    num_top_p_candidates = (
        _TOP_P_CANDIDATES[stage] if stage < len(_TOP_P_CANDIDATES) else vocab_size
    )
    groups: dict[tuple[str, int], list[int]] = {}
    for i in range(num_rows):
        if 0 < top_k[i] < vocab_size:
            key = ("top_k", top_k[i])
        elif top_p[i] < 1.0:
            key = ("top_p", min(vocab_size, num_top_p_candidates))
        else:
            key = ("vocab", vocab_size)
        groups.setdefault(key, []).append(i)
    return groups


def _filter_top(
    sub: torch.Tensor,
    kind: str,
    width: int,
    idx: list[int],
    top_p: Sequence[float],
    min_p: Sequence[float],
) -> tuple[_Candidates | None, list[int]]:
    """One top_k or top_p group (rows `idx` of the batch, logits `sub`) filtered to its `width`
    best tokens; and the top_p rows whose candidates were too few (to be tried wider)."""
    vocab_size = sub.shape[1]
    if width < vocab_size:
        values, token_ids = sub.topk(width, dim=-1)
    else:
        # stable: tied logits keep id order.
        values, token_ids = sub.sort(dim=-1, descending=True, stable=True)
    # top_k renormalises over the k kept; a top_p-only row needs its full-vocab mass.
    log_norm = torch.logsumexp(values if kind == "top_k" else sub, dim=-1, keepdim=True)
    probs = torch.exp(values - log_norm)
    cum = probs.cumsum(dim=-1)
    thresholds = torch.tensor(
        # A disabled row gets an infinite threshold: a float32 cumsum can reach 1.0 before
        # the tail and would cut tokens with tiny but nonzero probability.
        [top_p[i] if top_p[i] < 1.0 else math.inf for i in idx],
        dtype=torch.float32,
        device=sub.device,
    )[:, None]
    too_narrow: list[int] = []
    if kind == "top_p" and width < vocab_size:
        # The candidates are enough where the first token past them would be cut anyway.
        enough = (cum[:, -1:] >= thresholds).squeeze(1).tolist()
        if not all(enough):
            too_narrow = [i for i, ok in zip(idx, enough) if not ok]
            keep = [j for j, ok in enumerate(enough) if ok]
            idx = [idx[j] for j in keep]
            if not idx:
                return None, too_narrow
            keep_t = torch.tensor(keep, device=sub.device)
            probs, token_ids = probs[keep_t], token_ids[keep_t]
            cum, thresholds = cum[keep_t], thresholds[keep_t]
    beyond_p = (cum - probs) >= thresholds
    beyond_p[:, 0] = False
    probs.masked_fill_(beyond_p, 0.0)
    _apply_min_p(probs, probs[:, :1], [min_p[i] for i in idx])
    return _Candidates(idx, probs, token_ids), too_narrow


def _apply_min_p(probs: torch.Tensor, max_probs: torch.Tensor, min_p: list[float]) -> None:
    if any(p > 0.0 for p in min_p):
        ratios = torch.tensor(min_p, dtype=torch.float32, device=probs.device)[:, None]
        probs.masked_fill_(probs < ratios * max_probs, 0.0)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Column per row where the float64 uniform `u` falls in the unnormalised `probs`.

    A float32 running sum is rounded to float32 at every token: near 1 that is +-3e-8, so a
    tail token's share comes out as 0 or 6e-8 whatever its probability (and on a GPU, which
    also accumulates in float32, the tail can vanish). A float64 scan of the whole row costs
    ~10x more on the CPU, so the search has two levels: float32 sums of blocks of _CDF_BLOCK
    columns, accumulated in float64 across blocks, then a float64 scan of the one block the
    target falls in. Each token's share is then exact to float32 precision of its block's
    mass. A zero-probability column is never returned: the search finds the first running
    sum strictly above the target, and the target stays below each level's total.
    """
    num_rows, width = probs.shape
    num_blocks = -(-width // _CDF_BLOCK)
    if width % _CDF_BLOCK:
        probs = F.pad(probs, (0, num_blocks * _CDF_BLOCK - width))
    blocks = probs.reshape(num_rows, num_blocks, _CDF_BLOCK)
    # cumsum, not sum: the CPU cumsum accumulates in float64 and rounds once, where sum()
    # lets a large token absorb the tiny ones in its block (0.5 + 63 * 2**-30 sums to 0.5).
    block_sums = blocks.cumsum(dim=-1)[:, :, -1].double()
    block_cdf = block_sums.cumsum(dim=-1)
    target = _below(u[:, None] * block_cdf[:, -1:], block_cdf[:, -1:])
    block = torch.searchsorted(block_cdf, target, right=True)  # [rows, 1]; its sum is > 0
    start = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    in_block = blocks[torch.arange(num_rows, device=probs.device), block[:, 0]]
    in_block_cdf = in_block.cumsum(dim=-1, dtype=torch.float64)
    # The float32 block sum and the float64 scan may differ in the last bits: stay below both.
    limit = torch.minimum(block_sums.gather(1, block), in_block_cdf[:, -1:])
    column = torch.searchsorted(in_block_cdf, _below(target - start, limit), right=True)
    return (block * _CDF_BLOCK + column)[:, 0]


def _below(values: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """`values` clamped to strictly less than a positive `limit`."""
    return torch.minimum(values, torch.nextafter(limit, torch.zeros_like(limit)))


def _take(t: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """t[idx] along dim 0; `t` itself when idx is every row (callers pass sorted indices)."""
    if len(idx) == t.shape[0]:
        return t
    return t[torch.tensor(idx, device=t.device)]


def _put(t: torch.Tensor, idx: list[int], values: torch.Tensor) -> None:
    if len(idx) == t.shape[0]:
        if values is not t:
            t.copy_(values)
        return
    t[torch.tensor(idx, device=t.device)] = values


def _flat_index(
    token_lists: Sequence[Sequence[int]],
    rows: Sequence[int],
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor | None:
    """row * vocab + token for every token of every list (list j belongs to rows[j])."""
    lengths = [len(ids) for ids in token_lists]
    total = sum(lengths)
    if total == 0:
        return None
    # np.fromiter reads Python ints ~10x faster than torch.tensor(list).
    tokens = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=total)
    assert 0 <= tokens.min() and tokens.max() < vocab_size, (
        f"token ids must be in [0, {vocab_size}), got {tokens.min()}..{tokens.max()}"
    )
    offsets = np.repeat(np.asarray(rows, dtype=np.int64) * vocab_size, lengths)
    return torch.from_numpy(tokens + offsets).to(device)
