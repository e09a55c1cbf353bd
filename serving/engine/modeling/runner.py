"""Turns a scheduled step into tensors, runs the model, and returns logits for sampling rows.

Token layout of a step (see attention.py): decodes first, one token each, then prefill chunks.
A sequence samples when this step computes its last known token; a chunk that ends mid-prompt
produces no logits, so the lm_head only runs on sampling rows, and on the rows of sequences that
asked for prompt logprobs (prompt_logprobs.py), which follow the sampling rows:

    logits  [ sampling rows (step.sampling_seqs) | prompt rows (step.prompt_spans, in order) ]

A sequence with max_tokens 0 (scoring a prompt) that computes its last prompt token does not
sample: it is in `scored_seqs`, and the engine finishes it.

A decoding sequence with k proposed tokens (`seq.spec_token_ids`, speculative.py) computes its
last token and the k proposals as one chunk of 1 + k query rows, causal among themselves, laid
out and attended like a prefill chunk over its cached context; all 1 + k rows are sampling rows
(`num_sample_rows`): row i predicts the token after proposal i - 1.

    logits  [ seq A: 1 row | seq B: 1 + k rows | ... | prompt rows ]

In batch-invariant mode (model.is_batch_invariant) every token attends as a decode row of its
own: its block table and context length (its position + 1), so the same paged kernel computes
a token's attention in one order whether its keys were cached, handed over or computed in this
step, and whatever chunk it fell in:

    decode rows  [ A's token | B's token | chunk C: token 0 (len s+1) | token 1 (len s+2) | ... ]
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from serving.engine.kv.cache import KVCache
from serving.engine.modeling.attention import AttentionMetadata, PrefillChunk
from serving.engine.modeling.cpu_kernels import native_kernels
from serving.engine.modeling.lora import LoRABatch
from serving.engine.modeling.model import LlamaModel
from serving.engine.request import Sequence
from serving.engine.sampling.prompt_logprobs import PromptSpan, prompt_spans

__all__ = ["ModelRunner", "StepInput"]

logger = logging.getLogger(__name__)


@dataclass
class StepInput:
    seqs: list[Sequence]  # in token-layout order
    num_new_tokens: list[int]
    sampling_seqs: list[Sequence]  # those that sample this step, in logits-row order
    prompt_spans: list[PromptSpan] = field(default_factory=list)  # their rows follow the sampling rows
    scored_seqs: list[Sequence] = field(default_factory=list)  # max_tokens 0: prompt done, nothing to sample
    num_sample_rows: list[int] = field(default_factory=list)  # each one's rows: 1 + its proposed tokens


def _segments(step: StepInput, slot_of: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of the step's sequences that have an adapter, sorted by its slot, and each row's
    slot (lora.LoRABatch's segmented form), built from one span per sequence."""
    spans, start = [], 0
    for seq, n in zip(step.seqs, step.num_new_tokens):
        if seq.lora is not None:
            spans.append((slot_of[seq.lora.name], start, n))
        start += n
    spans.sort(key=lambda span: span[0])
    slots, starts, lengths = (torch.tensor(column, dtype=torch.long) for column in zip(*spans))
    offsets = torch.cumsum(lengths, 0) - lengths  # where each span starts among the listed rows
    rows = torch.arange(int(lengths.sum())) + torch.repeat_interleave(starts - offsets, lengths)
    return rows, torch.repeat_interleave(slots, lengths)


def _rows_by_adapter(step: StepInput) -> dict:
    """Each LoRA adapter of the step: the token rows of its sequences (in the token layout)."""
    rows: dict = {}
    start = 0
    for seq, n in zip(step.seqs, step.num_new_tokens):
        if seq.lora is not None:
            rows.setdefault(seq.lora, []).extend(range(start, start + n))
        start += n
    return rows


_NATIVE_LORA_DTYPES = (torch.bfloat16, torch.float32)  # lora_segmented's


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache):
        self.lora_manager = None  # the engine's LoRAManager, when it serves adapters
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = model.device

    def _lora_batch(self, step: StepInput, num_tokens: int) -> LoRABatch | None:
        """The step's adapters and their rows (None: every row is the base model's), in the form
        that runs fastest here (lora.LoRABatch): segmented on a CPU with the native kernels; else
        one adapter's products on its rows, or several adapters stacked."""
        if all(seq.lora is None for seq in step.seqs):
            return None
        kernels = native_kernels() if self.device.type == "cpu" and self.model.dtype in _NATIVE_LORA_DTYPES else None
        manager = self.lora_manager
        if kernels is not None:
            stacked = manager.stacked()
            rows, row_slots = _segments(step, manager.slot_of)
            return LoRABatch(stacked=stacked, rows=rows, row_slots=row_slots, kernels=kernels)
        by_adapter = _rows_by_adapter(step)
        if len(by_adapter) == 1:
            ((adapter, rows),) = by_adapter.items()
            index = None if len(rows) == num_tokens else torch.tensor(rows, dtype=torch.long, device=self.device)
            return LoRABatch(groups=[(adapter, index)])
        stacked = manager.stacked()
        slots = torch.full((num_tokens,), -1, dtype=torch.long)
        for adapter, rows in by_adapter.items():
            slots[rows] = manager.slot_of[adapter.name]
        return LoRABatch(slots=slots.to(self.device), stacked=stacked)

    def prepare(self, scheduled: list[tuple[Sequence, int]]) -> StepInput:
        decodes = [(s, n) for s, n in scheduled if n == 1]
        prefills = [(s, n) for s, n in scheduled if n > 1]
        ordered = decodes + prefills
        done = [(s, n) for s, n in ordered if s.num_computed_tokens + n >= s.num_tokens]
        sampling = [(s, n) for s, n in done if s.max_tokens > 0]
        return StepInput(
            [s for s, _ in ordered], [n for _, n in ordered], [s for s, _ in sampling],
            prompt_spans(ordered), [s for s, _ in done if s.max_tokens == 0],
            num_sample_rows=[s.num_computed_tokens + n - s.num_tokens + 1 for s, n in sampling],
        )

    def execute(self, step: StepInput) -> torch.Tensor:
        """Run one forward pass; returns float32 logits, [len(step.sampling_seqs) + the prompt
        spans' rows, vocab]: the sampling rows first."""
        num_pools = 2 if self.kv_cache.sliding_layers else 1  # the sliding layers' blocks: a pool of their own
        layout = _StepLayout(self.block_size, num_pools, self.model.is_batch_invariant, self.device)
        span_of = {span.seq: span for span in step.prompt_spans}
        for seq, n in zip(step.seqs, step.num_new_tokens):
            # in step.prompt_spans order: spans follow the token layout
            layout.add(seq, n, span_of.get(seq) if span_of else None)
        hidden = self.model.forward(
            torch.tensor(layout.input_ids, dtype=torch.long, device=self.device),
            torch.tensor(layout.positions, dtype=torch.long, device=self.device),
            self.kv_cache.layers,
            layout.attention_metadata(),
            lora=self._lora_batch(step, len(layout.input_ids)),
        )
        rows = torch.tensor(layout.sample_rows + layout.prompt_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, rows))


class _StepLayout:
    """One step's tokens laid out for the forward pass (module docstring), sequence by sequence:
    input ids and positions, the logits rows, and per KV pool (the full layers', the sliding
    layers') the slots written and the block tables read."""

    def __init__(self, block_size: int, num_pools: int, per_token_attention: bool, device: torch.device):
        self.block_size, self.num_pools, self.device = block_size, num_pools, device
        self.per_token_attention = per_token_attention  # batch-invariant: every token a decode row
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self.sample_rows: list[int] = []
        self.prompt_rows: list[int] = []
        self.prefills: list[PrefillChunk] = []
        self.decode_lens: list[int] = []
        self.slot_mapping: list[list[int]] = [[] for _ in range(num_pools)]
        self.decode_tables: list[list[list[int]]] = [[] for _ in range(num_pools)]
        self.prefill_blocks: list[list[torch.Tensor]] = [[] for _ in range(num_pools)]

    def add(self, seq: Sequence, n: int, span: PromptSpan | None) -> None:
        """`seq`'s next `n` tokens (its prompt logprobs' `span`, if any, among them)."""
        bs = self.block_size
        start = seq.num_computed_tokens
        end = start + n
        tables = [seq.block_ids] if self.num_pools == 1 else [seq.block_ids, seq.sliding_table.block_ids]
        q_start = len(self.input_ids)
        known = seq.num_tokens
        if end <= known:
            self.input_ids += seq.token_ids[start:end]
        else:  # the last known token and proposed ones after it
            self.input_ids += seq.token_ids[start:] + seq.spec_token_ids[: end - known]
        self.positions += range(start, end)
        for slots, table in zip(self.slot_mapping, tables):
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
        if end >= known and seq.max_tokens > 0:
            self.sample_rows += range(q_start + known - 1 - start, q_start + n)
        if span is not None:
            self.prompt_rows += range(q_start + span.start - start, q_start + span.end - start)
        if n == 1:
            for pool, table in zip(self.decode_tables, tables):
                pool.append(table)
            self.decode_lens.append(end)
        elif self.per_token_attention:
            for pool, table in zip(self.decode_tables, tables):
                pool += [table[: -(-end // bs)]] * n
            self.decode_lens += range(start + 1, end + 1)
        else:
            num_blocks = -(-end // bs)
            for pool, table in zip(self.prefill_blocks, tables):
                pool.append(torch.tensor(table[:num_blocks], dtype=torch.long, device=self.device))
            mask = None
            if start > 0:
                # query i (position start + i) sees keys 0 .. start + i
                mask = torch.ones(n, end, dtype=torch.bool).tril(diagonal=start).to(self.device)
            self.prefills.append(PrefillChunk(q_start, n, end, self.prefill_blocks[0][-1], mask))

    def attention_metadata(self) -> AttentionMetadata:
        """The full pool's metadata, the sliding pool's (if any) as its `sliding`."""
        decode_lens = self.decode_lens
        decode_lens_t = torch.tensor(decode_lens, dtype=torch.long, device=self.device) if decode_lens else None
        metas = [
            AttentionMetadata(
                slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
                num_decode_tokens=len(decode_lens),
                decode_block_tables=self._padded(tables),
                decode_context_lens=decode_lens_t,
                prefills=[dataclasses.replace(chunk, block_ids=ids) for chunk, ids in zip(self.prefills, blocks)],
            )
            for slots, tables, blocks in zip(self.slot_mapping, self.decode_tables, self.prefill_blocks)
        ]
        meta = metas[0]
        meta.sliding = metas[1] if self.num_pools == 2 else None
        return meta

    def _padded(self, tables: list[list[int]]) -> torch.Tensor | None:
        """[B, max_blocks] int64, padded with block 0; None for no rows."""
        if not tables:
            return None
        width = max(len(t) for t in tables)
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=self.device)
