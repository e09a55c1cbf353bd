"""Prompt logprobs: how likely the model found each prompt token, from the prompt's own forward pass.

    prompt tokens     t0   t1   t2   t3   t4
    positions          0    1    2    3    4
    logits row        l0   l1   l2   l3  (l4: the sampling row, it picks the first output token)
    scores                 t1   t2   t3   t4      logprob(t[p+1]) = log_softmax(l[p])[t[p+1]]

Positions 0..n-2 score tokens 1..n-1; token 0 has nothing before it to be predicted from (the
API shows it as null). A step computes a chunk of positions [start, end) of a sequence; the rows of
that chunk the sequence still needs are its `PromptSpan`, and the model runner sends them through
the lm_head together with the step's sampling rows: no second forward pass, and a step without
such a sequence has no extra rows at all. Chunked prefill scores each chunk as it runs; a sequence
recomputed after preemption skips positions it scored already. A cached prefix has KV but no
logits, so such a sequence reads nothing from the prefix cache (block_manager.lookup_prefix).

Each score is a TokenLogprob: the prompt token's logprob, its rank (1 + how many tokens the model
found strictly more likely) and the sequence's `params.prompt_logprobs` most likely tokens, ties
listed lower id first (as the sampler's logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serving.engine.outputs import TokenLogprob
from serving.engine.request import Sequence

__all__ = ["PromptSpan", "prompt_spans", "score_span"]


@dataclass(frozen=True)
class PromptSpan:
    """Positions [start, end) of `seq`'s prompt whose logits this step keeps: they score its
    tokens start + 1 .. end."""

    seq: Sequence
    start: int
    end: int

    @property
    def num_rows(self) -> int:
        return self.end - self.start


def prompt_spans(scheduled: list[tuple[Sequence, int]]) -> list[PromptSpan]:
    """The spans of a step's scheduled (sequence, new tokens), in that order."""
    spans = []
    for seq, n in scheduled:
        if not seq.needs_prompt_logprobs:
            continue
        start = max(seq.num_computed_tokens, len(seq.prompt_logprobs))
        end = min(seq.num_computed_tokens + n, seq.num_prompt_tokens - 1)
        if start < end:
            spans.append(PromptSpan(seq, start, end))
    return spans


def score_span(logits: torch.Tensor, span: PromptSpan) -> list[TokenLogprob]:
    """The TokenLogprobs of `span` from its logits rows ([span.num_rows, vocab])."""
    assert logits.shape[0] == span.num_rows, f"{logits.shape[0]} rows for a span of {span.num_rows}"
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(span.seq.token_ids[span.start + 1 : span.end + 1], dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(1, targets[:, None])
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    k = min(span.seq.params.prompt_logprobs or 0, logprobs.shape[1])
    top_values: list[list[float]] = [[] for _ in range(span.num_rows)]
    top_ids: list[list[int]] = [[] for _ in range(span.num_rows)]
    if k > 0:
        values, ids = logprobs.topk(k, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    return [
        TokenLogprob(
            token_id=token_id, logprob=logprob, rank=rank,
            # topk does not order ties: equal logprobs list lower ids first
            top=sorted(zip(ids_row, values_row), key=lambda t: (-t[1], t[0])),
        )
        for token_id, logprob, rank, ids_row, values_row in zip(
            targets.tolist(), chosen.squeeze(1).tolist(), ranks, top_ids, top_values,
        )
    ]
