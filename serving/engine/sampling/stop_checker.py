"""Decide after each token whether a sequence stops, and how much text may be streamed now.

Rules (vLLM's semantics), checked in this order for each new token:

1. Stop tokens. A token in `params.stop_token_ids` stops with `stop_reason` = its id; an EOS
   id stops with `stop_reason=None` unless `params.ignore_eos`. The token's own text is dropped.
2. Stop strings. `params.stop` is matched on the accumulated text, across token boundaries.
   The earliest match start wins (on a tie, the shorter string, which completed first); the
   text is cut right before the match, or right after it with `include_stop_str_in_output`.
3. Length. `num_output_tokens >= max_tokens` finishes with "length".

Stop tokens and stop strings only count once `num_output_tokens >= params.min_tokens`. A stop
string must end in the new text to count (a match wholly inside earlier text was either found
then or happened before `min_tokens`, where it does not count).

Hold-back: streamed text must never contain anything a later stop string removes. So the
longest suffix of the text that is a proper prefix of some stop string is held back, and
released as soon as it can no longer start a match:

    stop = ["</end>"]        text         held     released (delta)
    token "Hi <"             "Hi <"       "<"      "Hi "
    token "/e"               "Hi </e"     "</e"    ""
    token "x"                "Hi </ex"    ""       "</ex"

A match found later always starts inside the held suffix, so cutting there never takes back
released text. Holding is done even before `min_tokens`, so a match that straddles the
`min_tokens` boundary is also safe.

Two configurations of one class: the engine's (`for_params`: stop tokens, EOS, length, and the
stop strings when it detokenizes) and the ingress's (`for_text`: stop strings only, on the text it
detokenizes itself; the token rules stay the engine's, whose finish it receives).

Use, with an `IncrementalDetokenizer` per sequence:

    delta = detokenizer.step([token_id])
    result = checker.check(token_id, delta, num_output_tokens)
    stream(result.text)
    if finished and not isinstance(result.stop_reason, str):   # not cut by a stop string
        stream(checker.flush() + detokenizer.flush())

At a finish from `check()` the result's text already includes everything held back, so
`checker.flush()` returns "" then; it matters for finishes decided by the caller (abort, the
context window is full). `detokenizer.flush()` adds an unfinished character's U+FFFD.
"""

from __future__ import annotations

from dataclasses import dataclass

from serving.engine.params import SamplingParams
from serving.engine.sampling.text_chunks import TextChunks

__all__ = ["StopResult", "StopChecker"]


@dataclass
class StopResult:
    """The verdict for one token: whether the sequence finished, and the text to stream now."""

    finish_reason: str | None  # "stop" | "length" | None
    stop_reason: str | int | None  # matched stop string, stop token id, or None (eos)
    text: str  # delta that is safe to stream now

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StopChecker:
    """Stop-token, stop-string and length checks for one sequence; see the module docstring."""

    def __init__(
        self, *, stop_strings: tuple[str, ...] = (), stop_token_ids: frozenset[int] = frozenset(),
        eos_token_ids: frozenset[int] = frozenset(), include_stop_str: bool = False, min_tokens: int = 0,
        max_tokens: int | None = None,
    ):
        self._stop_strings = stop_strings
        self._stop_token_ids = stop_token_ids
        self._eos_token_ids = eos_token_ids
        self._include_stop_str = include_stop_str
        self._min_tokens = min_tokens
        self._max_tokens = max_tokens
        # Only the unreleased text is kept for matching: a later match always starts inside
        # the held suffix (module docstring), never in released text.
        self._released_chunks = TextChunks()
        self._held = ""
        self._finish_reason: str | None = None
        self._is_flushed = False

    @classmethod
    def for_params(cls, params: SamplingParams, eos_token_ids: tuple[int, ...], max_tokens: int) -> StopChecker:
        """The engine's: every rule, stop strings only when it detokenizes (it has no text otherwise)."""
        return cls(
            stop_strings=tuple(params.stop) if params.detokenize else (), stop_token_ids=frozenset(params.stop_token_ids),
            eos_token_ids=frozenset(() if params.ignore_eos else eos_token_ids),
            include_stop_str=params.include_stop_str_in_output, min_tokens=params.min_tokens, max_tokens=max_tokens,
        )

    @classmethod
    def for_text(cls, params: SamplingParams) -> StopChecker:
        """The ingress's: stop strings only, on text it detokenizes from the engine's tokens."""
        return cls(stop_strings=tuple(params.stop), include_stop_str=params.include_stop_str_in_output,
                   min_tokens=params.min_tokens)

    @property
    def text(self) -> str:
        """The text released so far (the final output text once finished)."""
        return self._released_chunks.text

    @property
    def held_text(self) -> str:
        """Text received but held back because it may be the start of a stop string."""
        return self._held

    @property
    def finish_reason(self) -> str | None:
        """The finish `check()` decided; None while running or when finished elsewhere."""
        return self._finish_reason

    def check(self, new_token_id: int, new_text: str, num_output_tokens: int) -> StopResult:
        """Account for one new token (`num_output_tokens` counts it) and its text delta."""
        if self._finish_reason is not None or self._is_flushed:
            raise RuntimeError(
                "StopChecker.check() after the sequence finished "
                f"({self._finish_reason or 'flushed'})"
            )
        can_stop = num_output_tokens >= self._min_tokens

        if can_stop and new_token_id in self._stop_token_ids:
            return self._finish("stop", new_token_id, self._held)
        if can_stop and new_token_id in self._eos_token_ids:
            return self._finish("stop", None, self._held)

        num_old_chars = len(self._held)
        unreleased = self._held + new_text
        if can_stop and new_text and self._stop_strings:
            match = self._find_stop_string(unreleased, num_old_chars)
            if match is not None:
                start, stop = match
                end = start + len(stop) if self._include_stop_str else start
                return self._finish("stop", stop, unreleased[:end])

        if self._max_tokens is not None and num_output_tokens >= self._max_tokens:
            return self._finish("length", None, unreleased)

        num_held_chars = self._num_held_chars(unreleased)
        delta = unreleased[: len(unreleased) - num_held_chars]
        self._held = unreleased[len(delta) :]
        self._release(delta)
        return StopResult(None, None, delta)

    def flush(self) -> str:
        """At a finish decided elsewhere (abort, context full): release the held-back text."""
        self._is_flushed = True
        delta, self._held = self._held, ""
        self._release(delta)
        return delta

    def _finish(self, finish_reason: str, stop_reason: str | int | None, delta: str) -> StopResult:
        self._held = ""
        self._release(delta)
        self._finish_reason = finish_reason
        return StopResult(finish_reason, stop_reason, delta)

    def _release(self, delta: str) -> None:
        if delta:
            self._released_chunks.append(delta)

    def _find_stop_string(self, text: str, num_old_chars: int) -> tuple[int, str] | None:
        """Earliest match that ends after `num_old_chars`; ties go to the one that ends first."""
        best: tuple[int, int, str] | None = None  # (start, length, stop string)
        for stop in self._stop_strings:
            start = text.find(stop, max(0, num_old_chars - len(stop) + 1))
            if start != -1 and (best is None or (start, len(stop)) < best[:2]):
                best = (start, len(stop), stop)
        return None if best is None else (best[0], best[2])

    def _num_held_chars(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        if not text or not self._stop_strings:
            return 0
        last_char = text[-1]
        longest = 0
        for stop in self._stop_strings:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if stop[length - 1] == last_char and text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
