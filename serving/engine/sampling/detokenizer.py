"""Turn generated token ids into streamed text, a few tokens at a time.

Contract: the concatenation of every `step()` result plus `flush()` is exactly
`tokenizer.decode(output_token_ids, skip_special_tokens=...)`, and no step emits text that a
later token would change, in particular never a U+FFFD for a character whose UTF-8 bytes are
split across tokens (byte-level BPE splits emoji and CJK this way).

Algorithm (vLLM's prefix_offset/read_offset scheme, over the output ids only):

    output ids   t0 t1 t2 t3 t4 t5 t6 t7
                          ^prefix   ^read        ^end
                          |<-ctx-->|<-pending-->|

    ctx_text = decode(ids[prefix:read])          already emitted
    window   = decode(ids[prefix:end])           ctx_text + pending text
    pending  = window[len(ctx_text):]

`read` is a *clean boundary*: the decode up to it ended on a complete character, so the
decoder restarts fresh there and nothing before it can change. `prefix` is the clean boundary
before `read`; that bit of left context keeps decoders that treat the first token of a
sequence specially (SentencePiece's Metaspace drops its leading space) from doing so at the
window start. Each step:

- `pending` ends in a complete character: emit the rest of it, `prefix, read = read, end`.
- `pending` ends in U+FFFD: an unfinished character may still complete. Hold back the trailing
  run of U+FFFD (a whole run, not one: byte fallback gives one U+FFFD per byte) and emit only
  the text before it. Byte-level BPE (this project's default) decodes lossily byte by byte, so
  text before an unfinished character never changes.
- The last token is a SentencePiece byte-fallback token (`<0xE6>`): hold all of `pending`.
  That decoder turns a whole run of byte tokens into one U+FFFD per byte when the run is not
  valid UTF-8, even the characters already complete in it, so a run is final only once a
  non-byte token ends it.

`flush()` releases what is held: any U+FFFD still there is in the full decode as well.

Cost: two decodes of the window per step. For valid text the window spans the tokens of the
last two characters (one or a few tokens), so a step costs O(window), not O(output length).
Where speed and correctness conflict, correctness wins: the window only ever starts at a
boundary known to be clean, so a long run of invalid bytes (random ids) or of byte-fallback
tokens makes the window grow, and delays text, instead of guessing where the decoder restarts.

The prompt is not used as left context: the output must decode exactly as the output ids
alone, and context from the prompt could only change that (e.g. SentencePiece's leading space
of the first output token, which `decode(output_ids)` drops).

Known limit: a decoder that rewrites text across a clean boundary (a tokenizer configured with
`clean_up_tokenization_spaces`, which turns " ." into ".") cannot be streamed exactly by any
windowed scheme; that is logged once per sequence.
"""

from __future__ import annotations

import logging
import re
import weakref
from dataclasses import dataclass
from typing import Any

from serving.engine.sampling.text_chunks import TextChunks

__all__ = ["IncrementalDetokenizer"]

logger = logging.getLogger(__name__)

_REPLACEMENT_CHAR = "\ufffd"
_BYTE_FALLBACK_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@dataclass(frozen=True)
class _TokenizerFacts:
    byte_fallback_ids: frozenset[int]  # empty unless the decoder has a ByteFallback step
    special_ids: frozenset[int]  # ids that skip_special_tokens drops


_facts_cache: weakref.WeakKeyDictionary[Any, _TokenizerFacts] = weakref.WeakKeyDictionary()


def _tokenizer_facts(tokenizer: Any) -> _TokenizerFacts:
    """Scan the vocabulary once per tokenizer (tens of ms) and remember the result."""
    try:
        return _facts_cache[tokenizer]
    except (KeyError, TypeError):
        pass
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    byte_fallback_ids: frozenset[int] = frozenset()
    if "ByteFallback" in repr(decoder):
        byte_fallback_ids = frozenset(
            token_id
            for token, token_id in tokenizer.get_vocab().items()
            if _BYTE_FALLBACK_TOKEN.fullmatch(token)
        )
    special_ids = frozenset(
        token_id
        for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items()
        if getattr(added, "special", False)
    ) | frozenset(getattr(tokenizer, "all_special_ids", ()))
    facts = _TokenizerFacts(byte_fallback_ids, special_ids)
    try:
        _facts_cache[tokenizer] = facts
    except TypeError:  # not weak-referenceable: rescan per sequence, still correct
        pass
    return facts


class IncrementalDetokenizer:
    """Streams the text of one sequence's output tokens; see the module docstring."""

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True):
        # No prompt context: the module docstring says why the prompt is not part of the window.
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        facts = _tokenizer_facts(tokenizer)
        self._byte_fallback_ids = facts.byte_fallback_ids
        self._skipped_ids = facts.special_ids if skip_special_tokens else frozenset()
        self._token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        # Characters of the current `pending` text already emitted (the part before a held
        # trailing run of U+FFFD).
        self._num_pending_chars_emitted = 0
        self._chunks = TextChunks()
        self._is_flushed = False
        self._has_warned_unstable_decode = False

    @property
    def text(self) -> str:
        """All text emitted so far (held-back text excluded until it is released)."""
        return self._chunks.text

    @property
    def num_window_tokens(self) -> int:
        """Tokens decoded per step right now (for tests and metrics)."""
        return len(self._token_ids) - self._prefix_offset

    def step(self, new_token_ids: list[int]) -> str:
        """Add newly generated tokens; return the text that became final (may be "")."""
        if self._is_flushed:
            raise RuntimeError("IncrementalDetokenizer.step() called after flush()")
        self._token_ids.extend(new_token_ids)
        if self._in_byte_fallback_run():
            return ""
        pending = self._pending_text()
        if not pending:
            # Only tokens without text (skipped special tokens): the end is as clean as `read`
            # was. Move `read` but not `prefix`, so the left context survives.
            self._read_offset = len(self._token_ids)
            return ""
        if not pending.endswith(_REPLACEMENT_CHAR):
            delta = pending[self._num_pending_chars_emitted :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._token_ids)
            self._num_pending_chars_emitted = 0
        else:
            stable = pending.rstrip(_REPLACEMENT_CHAR)
            delta = stable[self._num_pending_chars_emitted :]
            self._num_pending_chars_emitted = max(self._num_pending_chars_emitted, len(stable))
        if delta:
            self._chunks.append(delta)
        return delta

    def flush(self) -> str:
        """At the finish: release the held-back text (an unfinished character's U+FFFD)."""
        if self._is_flushed:
            return ""
        self._is_flushed = True
        delta = self._pending_text()[self._num_pending_chars_emitted :]
        self._num_pending_chars_emitted += len(delta)
        if delta:
            self._chunks.append(delta)
        return delta

    def _in_byte_fallback_run(self) -> bool:
        """Whether the last token that reaches the decoder is a byte-fallback token."""
        if not self._byte_fallback_ids:
            return False
        for token_id in reversed(self._token_ids):
            if token_id not in self._skipped_ids:
                return token_id in self._byte_fallback_ids
        return False

    def _pending_text(self) -> str:
        ids = self._token_ids
        if self._read_offset == len(ids):
            return ""
        ctx_text = self._decode(ids[self._prefix_offset : self._read_offset])
        window = self._decode(ids[self._prefix_offset :])
        if not window.startswith(ctx_text) and not self._has_warned_unstable_decode:
            self._has_warned_unstable_decode = True
            logger.warning(
                "tokenizer decode is not prefix-stable at a token boundary (%r vs %r); "
                "streamed text may differ from the full decode",
                ctx_text,
                window,
            )
        return window[len(ctx_text) :]

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
