"""The proposers' side of speculative decoding (speculative.py): what the Speculator asks of one.

A proposer guesses each decoding sequence's next tokens; the model verifies them, so a guess
costs compute when wrong and never correctness. The Speculator calls `propose_batch` once a
step for every sequence that speculates, and `release` when a sequence ends.
"""

from __future__ import annotations

from typing import Protocol

from serving.engine.request import Sequence

__all__ = ["Proposer", "TokenProposer"]


class Proposer(Protocol):
    """What the Speculator asks of a proposer. Batched, so one that runs a model (a draft model)
    runs it once for every sequence of a step."""

    name: str  # the metrics' and stats' label (spec_method)

    def propose_batch(self, seqs: list[Sequence], max_ks: list[int]) -> list[list[int]]:
        """Each sequence's proposals for its next step, at most max_ks[i] of them ([]: none)."""

    def release(self, seq: Sequence) -> None:
        """`seq` has ended (finished, aborted or failed): drop what is kept for it. A proposer
        that learns from recent requests may keep its tokens (seq.status says how it ended)."""


class TokenProposer:
    """A proposer that looks at one sequence's token ids at a time."""

    name = "tokens"

    def propose(self, token_ids: list[int], max_k: int | None = None) -> list[int]:
        raise NotImplementedError

    def propose_batch(self, seqs: list[Sequence], max_ks: list[int]) -> list[list[int]]:
        return [self.propose(seq.token_ids, max_k) if max_k > 0 else [] for seq, max_k in zip(seqs, max_ks)]

    def release(self, seq: Sequence) -> None:
        pass
