"""Text grown by streamed deltas: each delta appended in O(1), the pieces joined once when read
(a long output read at every step would otherwise cost a copy per token)."""

from __future__ import annotations

import logging

__all__ = ["TextChunks"]

logger = logging.getLogger(__name__)


class TextChunks:
    __slots__ = ("_chunks",)

    def __init__(self) -> None:
        self._chunks: list[str] = []

    def append(self, delta: str) -> None:
        self._chunks.append(delta)

    @property
    def text(self) -> str:
        """Every delta so far, in order."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""
