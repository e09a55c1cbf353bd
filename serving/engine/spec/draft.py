"""Draft-model proposals: a smaller model with the model's tokenizer decodes k tokens, greedily.

    target sequence   t0 ... t(n-1) │                    (│: the known tokens end)
    draft's view      t0 ... t(m-1) d1 .. dk             what it saw and proposed last step; its KV
                                                         holds the first n' of those
    sync              keep the KV of the longest prefix it shares with the target's tokens, drop
                      the rest (BlockManager.trim), take the target's tokens after it
    draft step 0      one chunk: the known tokens it has no KV for ─▶ d1 (argmax of the last row)
    draft steps 1..   d1 ─▶ d2, d2 ─▶ d3, ..., d(k-1) ─▶ dk: one row per sequence

Each draft step is one forward pass of the draft over every speculating sequence of the engine's
step at once (step 0 mixes one-row decodes and catch-up chunks, as the engine's own steps mix
decodes and prefill chunks), so a step of the engine costs k draft forwards, whatever the batch.

The draft is loaded by the engine's own loader (loader.py, model.py) in the model's dtype
on its device, and runs through the engine's ModelRunner with a KV cache and a BlockManager of its
own (`draft_num_blocks` blocks of the engine's block size, no prefix caching). It keeps one
Sequence per target sequence: the tokens it last saw and proposed, and how many of them have KV
(num_computed_tokens). A target sequence's tokens only grow (preemption recomputes them, it
never changes them), so after verification the draft's view agrees with them up to the old
length plus the accepted proposals:

    accepted j of k (the model's own token after them)  ─▶  KV kept for n + j tokens, or
                                                            n + k - 1 at j = k (dk was never fed)

and the catch-up chunk is the model's token (plus dk when all were kept). A sequence the target
preempted and recomputed is simply caught up: its tokens are the same.

Greedy (argmax) drafting makes the draft distribution one-hot on each proposal, which is what the
Speculator's "sample, then compare" verification assumes (speculative.py): greedy requests get the
model's tokens, sampled ones its distribution, seeded ones the same tokens as without speculation.
A sampled draft would need its probabilities in the acceptance rule; this one never samples.

Back-pressure, never errors: a sequence whose KV for this step (its tokens plus k - 1 proposals
fed back) does not fit the draft's pool gets no proposals and its draft KV is dropped, so the
blocks serve the sequences that fit (those first in the engine's running order keep theirs); it is
rebuilt from its tokens, in one catch-up chunk, when it fits again. Positions past the draft's
own context window (max_position_embeddings) are not drafted: fewer or no proposals there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from serving.engine.config import SpeculativeConfig
from serving.engine.errors import ModelLoadError
from serving.engine.kv.block_manager import BlockManager
from serving.engine.kv.cache import KVCache
from serving.engine.modeling.loader import ModelSpec, load_model_spec, load_state_dict, load_tokenizer, resolve_model_dir
from serving.engine.modeling.model import LlamaModel
from serving.engine.modeling.runner import ModelRunner
from serving.engine.request import Sequence

if TYPE_CHECKING:
    from serving.engine.setup import EngineParts

__all__ = ["DraftModelProposer"]

logger = logging.getLogger(__name__)

_FIELD = "speculative.draft_model"


@dataclass
class _Draft:
    seq: Sequence  # the draft's view: the target's tokens it last saw, then its proposals
    num_known: int  # how many of seq.token_ids are the target's (its proposals follow them)


class DraftModelProposer:
    """Proposes up to k tokens per sequence by greedy decoding with a draft model (module docstring)."""

    name = "draft"

    def __init__(self, config: SpeculativeConfig, target: EngineParts):
        assert config.draft_model, "method draft without draft_model (SpeculativeConfig checks it)"
        self.k = config.num_speculative_tokens
        try:
            model_dir = resolve_model_dir(config.draft_model)
            spec = load_model_spec(model_dir)
            tokenizer = load_tokenizer(model_dir)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{_FIELD}: {exc}") from exc
        _check_same_tokenizer(config.draft_model, spec, tokenizer, target)
        dtype, block_size = target.config.torch_dtype, target.config.block_size
        self.model = LlamaModel(spec, load_state_dict(model_dir), dtype=dtype, device=target.device)
        self.kv_cache = KVCache(
            num_layers=spec.num_layers, num_blocks=config.draft_num_blocks, block_size=block_size,
            num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, dtype=dtype, device=target.device,
        )
        self.block_manager = BlockManager(config.draft_num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(self.model, self.kv_cache)
        self.max_model_len = min(spec.max_position_embeddings, target.max_model_len)
        self._drafts: dict[int, _Draft] = {}  # by the target sequence's seq_id
        self.num_computed_tokens = 0  # tokens the draft has run (catch-up chunks and fed proposals)
        self.num_unfit = 0  # sequence-steps without proposals because their KV did not fit the pool
        logger.info(
            "draft model %s (%d layers, hidden %d): %d KV blocks x %d tokens, %.1f MiB",
            config.draft_model, spec.num_layers, spec.hidden_size, config.draft_num_blocks, block_size,
            self.kv_cache.num_bytes / 2**20,
        )

    def draft_seq(self, seq: Sequence) -> Sequence | None:
        """The draft's view of `seq` (its tokens and KV), None when it holds nothing for it."""
        draft = self._drafts.get(seq.seq_id)
        return None if draft is None else draft.seq

    def propose_batch(self, seqs: list[Sequence], max_ks: list[int]) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in seqs]
        live: list[tuple[int, Sequence, int]] = []  # (index in seqs, the draft's view, its k)
        for i, (seq, max_k) in enumerate(zip(seqs, max_ks)):
            # The draft runs the known tokens and k - 1 proposals: positions up to num_tokens + k - 2.
            k = min(self.k, max_k, self.max_model_len - seq.num_tokens + 1)
            if k <= 0:
                continue
            draft = self._sync(seq)
            if not self.block_manager.allocate(draft, seq.num_tokens + k - 1):
                self.release(seq)  # the pool is full: its blocks go to the sequences that fit
                self.num_unfit += 1
                continue
            live.append((i, draft, k))
        while live:
            scheduled = [(draft, draft.num_tokens - draft.num_computed_tokens) for _, draft, _ in live]
            next_tokens = self._greedy(scheduled)
            for i, draft, _ in live:
                draft.num_computed_tokens = draft.num_tokens
                draft.append_token(next_tokens[draft])
                proposals[i].append(next_tokens[draft])
            live = [(i, draft, k) for i, draft, k in live if len(proposals[i]) < k]
        return proposals

    def release(self, seq: Sequence) -> None:
        draft = self._drafts.pop(seq.seq_id, None)
        if draft is not None and draft.seq.block_ids:
            self.block_manager.free(draft.seq)

    def _sync(self, seq: Sequence) -> Sequence:
        """The draft's view of `seq` with its KV cut to the tokens it shares with `seq` and the
        rest of `seq`'s tokens after them (to compute)."""
        draft = self._drafts.get(seq.seq_id)
        if draft is None:
            view = Sequence(
                request_id=seq.request_id, index=seq.index, prompt_token_ids=seq.prompt_token_ids,
                params=seq.params, max_tokens=seq.max_tokens,
            )
            view.token_ids += seq.output_token_ids
            self._drafts[seq.seq_id] = _Draft(view, seq.num_tokens)
            return view
        view, tokens = draft.seq, seq.token_ids
        assert seq.num_tokens >= draft.num_known, f"{seq}: its tokens shrank ({draft.num_known} before)"
        same = draft.num_known  # the target's tokens only grow: the first num_known still agree
        limit = min(view.num_tokens, seq.num_tokens)
        while same < limit and view.token_ids[same] == tokens[same]:
            same += 1
        # The last known token is always run: its row gives the first proposal.
        view.num_computed_tokens = min(view.num_computed_tokens, same, seq.num_tokens - 1)
        self.block_manager.trim(view)  # the blocks that held only rejected proposals
        del view.token_ids[same:]
        view.token_ids += tokens[same:]
        draft.num_known = seq.num_tokens
        return view

    def _greedy(self, scheduled: list[tuple[Sequence, int]]) -> dict[Sequence, int]:
        """One forward pass of the draft: each scheduled sequence's argmax after its last token."""
        step = self.runner.prepare(scheduled)
        logits = self.runner.execute(step)  # one row per sequence, in step.sampling_seqs order
        self.num_computed_tokens += sum(n for _, n in scheduled)
        return dict(zip(step.sampling_seqs, logits.argmax(dim=-1).tolist()))


def _check_same_tokenizer(name: str, spec: ModelSpec, tokenizer, target: EngineParts) -> None:
    """A draft's token ids must mean the model's: same vocabulary size, eos tokens and, where both
    tokenizers list it, the same token -> id map. Raises ModelLoadError naming the field."""
    problem = None
    if spec.vocab_size != target.spec.vocab_size:
        problem = f"its vocabulary has {spec.vocab_size} tokens, the model's {target.spec.vocab_size}"
    elif set(spec.eos_token_ids) != set(target.spec.eos_token_ids):
        problem = f"its eos token ids are {sorted(spec.eos_token_ids)}, the model's {sorted(target.spec.eos_token_ids)}"
    elif hasattr(tokenizer, "get_vocab") and hasattr(target.tokenizer, "get_vocab"):
        ours, theirs = tokenizer.get_vocab(), target.tokenizer.get_vocab()
        if ours != theirs:
            differ = sorted(set(ours.items()) ^ set(theirs.items()))
            problem = f"its tokenizer maps {len(differ)} (token, id) pairs differently from the model's, e.g. {differ[0]}"
    if problem is not None:
        raise ModelLoadError(
            f"{_FIELD} {name!r}: {problem}. A draft model must use the model's tokenizer: choose a smaller "
            "model of the same family (or method 'ngram')"
        )
