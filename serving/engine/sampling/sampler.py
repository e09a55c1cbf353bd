"""Turns one step's logits into next tokens: one row per sequence, each with its own parameters.

Every row goes through the same pipeline, in this order:

    logits [rows, vocab] (any float dtype) -> float32 copy
      |
      |-- 1. logprobs     log_softmax of the RAW row: the sampled token's logprob and the
      |                   `params.logprobs` most likely tokens (OpenAI reports the model's
      |                   distribution, not the one we sample from)
      v
    2. logit_bias         added to the named tokens, from the request's LogitBias (token ids and
                          values as tensors, built once when the request arrives): O(entries) of
                          each row that has one, never a walk over the request's dict per step
    3. min_tokens         EOS ids and stop_token_ids -> -inf while len(output) < min_tokens
    4. penalties          repetition over prompt + output (HF: l > 0 ? l / p : l * p), then
                          presence and frequency over output only
                          (OpenAI: l -= frequency * count + presence * [count > 0])
    4b. grammar           rows with a `grammar` (a structured output): each fills its row of one
                          int32 bitmask (serving/engine/sampling/grammar.py) and the tokens it does not
                          allow become -inf; rows without one are not touched, so a free row
                          samples exactly as it would alone
      v
    5. greedy rows        argmax, ties -> lowest id  (temperature < 1e-5, or top_k == 1)
    6. sampled rows       / temperature -> top_k -> top_p on the renormalised top-k
                          -> min_p (prob < min_p * max prob) -> one uniform u per row,
                          inverse CDF over what is left

Random draws. The uniforms are drawn on the CPU in float64, then moved to the logits' device,
so a draw never depends on the device's RNG. Rows without a `seed_key` share the sampler's
generator, one batched draw per step. A row with a `seed_key` (seed, choice index, output
position) draws from a fresh generator seeded by `seed_from_key(seed_key)`, a blake2b mix of
the three ints: the token at that position is the same alone or in any batch, and in any
process (on the CPU; a GPU kernel may order tied logits differently).

Cost. Greedy rows with nothing else to do take one argmax over the caller's tensor (bf16/fp16 ->
fp32 is exact, so no copy), whatever else is in the batch. The other rows get one float32 copy
(on this CPU, a bf16 -> fp32 copy of 32 x 49k logits takes 3.7 ms: a step of 45 ms); bias, masking
and penalties touch only the listed tokens of the rows that ask for them; a grammar costs its
row a bitmask fill (xgrammar, microseconds) and one masked write of the row; only rows with
top_k or top_p are ordered, and partially where that is exact:

    top_k = k            topk(k): nothing beyond it can survive
    top_p only           topk(256), then topk(4096), then a full sort, each only for the rows
                         whose candidates so far hold less than top_p of the mass
    min_p only, or none  no ordering: softmax in vocabulary order

A row's path depends only on its own parameters and logits, so a seeded row meets the same
candidate order, and the same u the same CDF, whatever batch it sits in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from serving.engine.outputs import TokenLogprob
from serving.engine.params import SamplingParams
from serving.engine.sampling.ops import (
    _filter,
    _inverse_cdf,
    _put,
    _take,
    apply_penalties,
    apply_token_bitmask,
    seed_from_key,
    top_k_top_p_min_p,
)

__all__ = [
    "LogitBias",
    "SamplingRow",
    "TokenConstraint",
    "SamplerOutput",
    "Sampler",
    "RowFailure",
    "apply_penalties",
    "top_k_top_p_min_p",
    "seed_from_key",
]

# Below this temperature a row is sampled greedily, as in vLLM (_SAMPLING_EPS): dividing by
# a near-zero temperature overflows float32 and softmax returns NaN.
_MIN_TEMPERATURE = 1e-5
@dataclass(frozen=True)
class LogitBias:
    """A request's `logit_bias` as tensors on the logits' device, built once per request (the engine
    keeps it with the request): a step adds `values` at `token_ids` of each of its rows."""

    token_ids: torch.Tensor  # int64 [entries]
    values: torch.Tensor  # float32 [entries]

    @classmethod
    def of(cls, bias: dict[int, float] | None, device: torch.device | str = "cpu") -> LogitBias | None:
        if not bias:
            return None
        return cls(
            token_ids=torch.tensor(list(bias.keys()), dtype=torch.long, device=device),
            values=torch.tensor(list(bias.values()), dtype=torch.float32, device=device),
        )


class TokenConstraint(Protocol):
    """What step 4b needs of a row's grammar (serving/engine/sampling/grammar.py's GrammarMatcher)."""

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Row `index` of the int32 `bitmask`: bit set = the token may come next."""
        ...


@dataclass
class SamplingRow:
    """One sequence that needs a next token this step."""

    params: SamplingParams
    prompt_token_ids: list[int]  # repetition_penalty looks at prompt + output
    output_token_ids: list[int]  # presence/frequency penalties and min_tokens look at output only
    eos_token_ids: tuple[int, ...] = ()  # masked, with params.stop_token_ids, below min_tokens
    seed_key: tuple[int, int, int] | None = None  # (seed, choice index, output position)
    logit_bias: LogitBias | None = None  # LogitBias.of(params.logit_bias), built once per request
    grammar: TokenConstraint | None = None  # params.guided's matcher, at this sequence's place in it


@dataclass
class RowFailure:
    """A row that failed when sampled alone: its request is at fault."""

    row: int
    error: Exception


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # None where the row's params.logprobs is None


class Sampler:
    """Samples one token per row; see the module docstring for the pipeline."""

    def __init__(self, vocab_size: int, seed: int | None = None):
        self.vocab_size = vocab_size  # the logits' width, which may exceed the tokenizer's vocab
        if seed is None:
            # From torch's default generator, so torch.manual_seed() makes a run reproducible.
            seed = int(torch.randint(0, 2**63 - 1, (1,)).item())
        self._generator = torch.Generator().manual_seed(seed)

    def sample_each(
        self, logits: torch.Tensor, rows: list[SamplingRow],
    ) -> tuple[list[tuple[int | None, TokenLogprob | None]], list[RowFailure]]:
        """One (token, logprob) per row, and the rows at fault. If the batch fails, each row is
        sampled alone to find them: their results are (None, None), the others get their tokens.
        When every row of a batch fails alone as well, no row is at fault (the logits are) and the
        batch's error is raised."""
        try:
            sampled = self(logits, rows)
            return list(zip(sampled.token_ids, sampled.logprobs)), []
        except Exception as batch_error:
            results: list[tuple[int | None, TokenLogprob | None]] = []
            failures: list[RowFailure] = []
            for i, row in enumerate(rows):
                try:
                    one = self(logits[i : i + 1], [row])
                    results.append((one.token_ids[0], one.logprobs[0]))
                except Exception as exc:
                    failures.append(RowFailure(i, exc))
                    results.append((None, None))
            if len(rows) > 1 and len(failures) == len(rows):
                raise batch_error
            return results, failures

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (
            f"logits {tuple(logits.shape)} do not match {len(rows)} rows"
        )
        assert logits.shape[1] == self.vocab_size, (
            f"logits have {logits.shape[1]} columns, the sampler expects {self.vocab_size}"
        )
        num_rows = len(rows)
        if num_rows == 0:
            return SamplerOutput(token_ids=[], logprobs=[])

        greedy_rows = [i for i, r in enumerate(rows) if _is_greedy(r.params)]
        bias_rows = [i for i, r in enumerate(rows) if r.logit_bias is not None]
        assert all((r.logit_bias is None) == (not r.params.logit_bias) for r in rows), (
            "a row's logit_bias must be LogitBias.of(its params.logit_bias)"
        )
        masked_rows = [i for i, r in enumerate(rows) if _needs_min_tokens_mask(r)]
        penalty_rows = [i for i, r in enumerate(rows) if r.params.needs_penalties]
        logprob_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        grammar_rows = [i for i, r in enumerate(rows) if r.grammar is not None]

        busy = set(bias_rows) | set(masked_rows) | set(penalty_rows) | set(logprob_rows) | set(grammar_rows)
        plain = [i for i in greedy_rows if i not in busy]
        if len(plain) == num_rows:
            return SamplerOutput(
                token_ids=logits.argmax(dim=-1).tolist(), logprobs=[None] * num_rows
            )
        if plain:
            return self._split(logits, rows, plain)

        x = logits.to(torch.float32, copy=True).contiguous()
        raw_logprobs = (
            torch.log_softmax(_take(x, logprob_rows), dim=-1) if logprob_rows else None
        )
        self._process(x, rows, bias_rows, masked_rows, penalty_rows, grammar_rows)
        token_ids = self._choose(x, rows, greedy_rows)

        logprobs: list[TokenLogprob | None] = [None] * num_rows
        if raw_logprobs is not None:
            chosen = _take(token_ids, logprob_rows)
            collected = _collect_logprobs(raw_logprobs, chosen, [rows[i] for i in logprob_rows])
            for i, lp in zip(logprob_rows, collected):
                logprobs[i] = lp
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)

    def _process(self, x: torch.Tensor, rows: list[SamplingRow], bias_rows: list[int], masked_rows: list[int],
                 penalty_rows: list[int], grammar_rows: list[int]) -> None:
        """The logits processors, in place on the float32 copy `x`, each on the rows that need it:
        logit bias, the min_tokens mask, penalties, then the grammar's allowed tokens."""
        if bias_rows:
            _apply_logit_bias(x, rows, bias_rows)
        if masked_rows:
            _apply_min_tokens_mask(x, rows, masked_rows)
        if penalty_rows:
            apply_penalties(
                x,
                [rows[i].prompt_token_ids for i in penalty_rows],
                [rows[i].output_token_ids for i in penalty_rows],
                [rows[i].params.repetition_penalty for i in penalty_rows],
                [rows[i].params.presence_penalty for i in penalty_rows],
                [rows[i].params.frequency_penalty for i in penalty_rows],
                row_ids=penalty_rows,
            )
        if grammar_rows:
            bitmask = torch.empty((len(grammar_rows), (self.vocab_size + 31) // 32), dtype=torch.int32)
            for j, i in enumerate(grammar_rows):
                rows[i].grammar.fill_bitmask(bitmask, j)
            apply_token_bitmask(x, bitmask, grammar_rows)

    def _choose(self, x: torch.Tensor, rows: list[SamplingRow], greedy_rows: list[int]) -> torch.Tensor:
        """Each row's token from its processed logits: argmax for the greedy rows, a draw for the others."""
        num_rows = len(rows)
        token_ids = torch.empty(num_rows, dtype=torch.long, device=x.device)
        if greedy_rows:
            _put(token_ids, greedy_rows, _take(x, greedy_rows).argmax(dim=-1))
        sampled_rows = [i for i in range(num_rows) if not _is_greedy(rows[i].params)]
        if sampled_rows:
            _put(
                token_ids,
                sampled_rows,
                self._sample(_take(x, sampled_rows), [rows[i] for i in sampled_rows]),
            )
        return token_ids

    def _split(self, logits: torch.Tensor, rows: list[SamplingRow], plain: list[int]) -> SamplerOutput:
        """Plain greedy rows (nothing else to do) take one argmax over the caller's tensor; the
        others go through the pipeline as a batch of their own. Only greedy rows move, and they
        draw no uniform, so every row's token is what the whole batch would have given it."""
        plain_set = set(plain)
        rest = [i for i in range(len(rows)) if i not in plain_set]
        token_ids = [0] * len(rows)
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        for i, token_id in zip(plain, _take(logits, plain).argmax(dim=-1).tolist()):
            token_ids[i] = token_id
        others = self(_take(logits, rest), [rows[i] for i in rest])
        for i, token_id, logprob in zip(rest, others.token_ids, others.logprobs):
            token_ids[i], logprobs[i] = token_id, logprob
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    def _sample(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Step 6 on `x`, a private copy of the sampled rows' processed logits."""
        device = x.device
        temperatures = [r.params.temperature for r in rows]
        x.div_(torch.tensor(temperatures, dtype=torch.float32, device=device)[:, None])
        u = self._uniforms(rows).to(device)
        out = torch.empty(len(rows), dtype=torch.long, device=device)
        params = [r.params for r in rows]
        for group in _filter(
            x, [p.top_k for p in params], [p.top_p for p in params], [p.min_p for p in params]
        ):
            tokens = _inverse_cdf(group.probs, _take(u, group.rows))
            if group.token_ids is not None:
                tokens = group.token_ids.gather(1, tokens[:, None]).squeeze(1)
            _put(out, group.rows, tokens)
        return out

    def _uniforms(self, rows: list[SamplingRow]) -> torch.Tensor:
        """One float64 uniform in [0, 1) per row, on the CPU."""
        u = torch.empty(len(rows), dtype=torch.float64)
        unseeded = [i for i, r in enumerate(rows) if r.seed_key is None]
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), generator=self._generator, dtype=torch.float64)
        for i, r in enumerate(rows):
            if r.seed_key is not None:
                g = torch.Generator().manual_seed(seed_from_key(r.seed_key))
                u[i] = torch.rand(1, generator=g, dtype=torch.float64)[0]
        return u


def _is_greedy(params: SamplingParams) -> bool:
    return params.is_greedy or params.temperature < _MIN_TEMPERATURE


def _needs_min_tokens_mask(row: SamplingRow) -> bool:
    return len(row.output_token_ids) < row.params.min_tokens and bool(
        row.eos_token_ids or row.params.stop_token_ids
    )


def _apply_logit_bias(x: torch.Tensor, rows: list[SamplingRow], row_idx: list[int]) -> None:
    for i in row_idx:
        bias = rows[i].logit_bias
        x[i].index_add_(0, bias.token_ids, bias.values)


def _apply_min_tokens_mask(x: torch.Tensor, rows: list[SamplingRow], row_idx: list[int]) -> None:
    r_idx: list[int] = []
    c_idx: list[int] = []
    for i in row_idx:
        banned = set(rows[i].eos_token_ids) | set(rows[i].params.stop_token_ids)
        r_idx.extend([i] * len(banned))
        c_idx.extend(banned)
    device = x.device
    x[torch.tensor(r_idx, device=device), torch.tensor(c_idx, device=device)] = -math.inf


def _collect_logprobs(
    raw_logprobs: torch.Tensor, chosen: torch.Tensor, rows: list[SamplingRow]
) -> list[TokenLogprob]:
    """Step 1's output: the sampled token's raw logprob and the top `params.logprobs`."""
    chosen_logprobs = raw_logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
    chosen_ids = chosen.tolist()
    num_top = [r.params.logprobs or 0 for r in rows]
    max_top = min(max(num_top), raw_logprobs.shape[1])
    top_values: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if max_top > 0:
        values, ids = raw_logprobs.topk(max_top, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    result = []
    for j, k in enumerate(num_top):
        # topk does not order ties; sort the k pairs so equal logprobs list lower ids first.
        top = sorted(zip(top_ids[j][:k], top_values[j][:k]), key=lambda t: (-t[1], t[0]))
        result.append(TokenLogprob(token_id=chosen_ids[j], logprob=chosen_logprobs[j], top=top))
    return result
