"""Structured outputs: a request's GuidedSpec compiled once into a grammar, and one matcher per
sequence that says which tokens may come next.

    add_request(guided spec) ──GrammarCompiler.submit(spec)──▶ Future (the cache's, shared)
        cache hit: done at once ─────────────────────────┐
        miss: its thread pool compiles (the GIL is free) │   the request waits "compiling", not
        and the done-callback wakes the step loop ───────┤   scheduled; the batch goes on
                                                         ▼
    step: the sampler fills one bitmask row per constrained row (GrammarMatcher.fill_bitmask),
          masks those rows' logits to -inf where the bit is 0, samples; then the engine feeds
          the token to the row's matcher (accept). Free rows are not touched.

The backend is xgrammar, chosen by measurement on this CPU against llguidance (SmolLM2's 49,152-
token vocabulary, docs/benchmarks.md): a mask costs xgrammar ~2.4 us a row at batch 32 (median
0.08 ms for the batch, p90 0.31 ms) and llguidance ~30 us (0.96 ms, p90 2.5 ms): that cost is paid
on the step thread at every step, by every constrained row; compiling costs xgrammar 4-25 ms a
schema (llguidance < 1 ms, as it computes masks lazily), paid once per schema, off the step
thread, and cached. xgrammar is imported on the first compile, in the pool's thread.

The bitmask is int32 words, `ceil(vocab / 32)` per row, bit j of word w set when token 32 w + j
is allowed (xgrammar's and llguidance's layout): ops.apply_token_bitmask applies it.

Grammars per kind (GuidedSpec in params.py): JSON schemas in xgrammar's strict mode (no
properties or items beyond those named, unless the schema allows them) and compact separators
(`, ` and `: `, no other whitespace): a model cannot spend its budget on whitespace; json_object is
the schema `{"type": "object"}` with any properties; a choice is the EBNF `root ::= "a" | "b"`; a
grammar with `::=` is EBNF (xgrammar's GBNF dialect), otherwise Lark. A JSON grammar never allows
a token holding a raw control byte (< 0x20): compact JSON has none (strings escape them), but
xgrammar's length-bounded strings would let one through and no JSON parser would take the output.
Special tokens (`<|im_start|>` ...) are never allowed inside an output: the detokenizer drops them,
and the text would not be what the grammar matched. When the grammar is complete and cannot go on, only the stop tokens
(the model's EOS ids) are allowed.

One GrammarCompiler per tokenizer and process (`compiler_for`): an in-process API front and its
engine share the cache, so a schema validated at the edge is not compiled again. Processes
(Ray replicas) each compile a schema once. The cache holds `max_cached` specs, least recently
used out first; a spec that failed to compile is cached with its error.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from serving.engine.errors import InvalidRequestError
from serving.engine.params import GuidedSpec

__all__ = [
    "CompiledGrammar", "GrammarCompileError", "GrammarCompiler", "GrammarMatcher", "PendingGrammars", "SpeculativeMask",
    "allocate_bitmask", "compiler_for",
]

logger = logging.getLogger(__name__)

_COMPILE_THREADS = 2  # one long compile does not hold up the next request's short one
_MAX_CACHED = 128  # compiled grammars kept per compiler (each holds its token-mask cache: KBs to MBs)


class GrammarCompileError(InvalidRequestError):
    """A spec the backend cannot compile (a bad regex, an unsupported JSON schema, ...). Its param
    is "guided"; the ingress names the request's own field instead."""

    def __init__(self, message: str):
        super().__init__("guided", message)


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 [num_rows, ceil(vocab_size / 32)] bitmask on the CPU, for fill_bitmask."""
    return torch.empty((num_rows, (vocab_size + 31) // 32), dtype=torch.int32)


@dataclass(frozen=True)
class CompiledGrammar:
    """A spec's grammar (xgrammar's), and the tokens it may ever use (None: any it allows)."""

    handle: Any
    allowed: torch.Tensor | None = None  # int32 words as a bitmask row, ANDed into every mask


class GrammarMatcher:
    """One sequence's place in its grammar. Only the engine's step thread uses it."""

    def __init__(self, handle: Any, allowed: torch.Tensor | None = None):
        self._handle = handle  # xgrammar.GrammarMatcher
        self._allowed = allowed

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Row `index` of `bitmask`: the tokens that may come next."""
        self._handle.fill_next_token_bitmask(bitmask, index)
        if self._allowed is not None:
            bitmask[index].bitwise_and_(self._allowed)

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False (state unchanged) when the grammar does not allow it."""
        return bool(self._handle.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculation's proposals, engine.py)."""
        if num_tokens:
            self._handle.rollback(num_tokens)

    def allowed_prefix(self, token_ids: list[int]) -> int:
        """How many leading `token_ids` the grammar allows from here; the state is unchanged."""
        n = 0
        while n < len(token_ids) and not self.is_terminated and self.accept(token_ids[n]):
            n += 1
        self.rollback(n)
        return n

    def fill_bitmask_after(self, bitmask: torch.Tensor, index: int, token_ids: list[int]) -> None:
        """Row `index` of `bitmask`: the tokens that may come after `token_ids` (proposals the
        grammar allows: allowed_prefix); the state is unchanged. After a stop token nothing may
        follow and the sequence ends there: the row allows every token (its sample is dropped)."""
        accepted = 0
        try:
            for token_id in token_ids:
                assert self.accept(token_id), f"proposed token {token_id} is not allowed: trim with allowed_prefix"
                accepted += 1
            if self.is_terminated:
                bitmask[index].fill_(-1)
            else:
                self.fill_bitmask(bitmask, index)
        finally:
            self.rollback(accepted)

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted: nothing may follow."""
        return bool(self._handle.is_terminated())


class SpeculativeMask:
    """The mask of a speculating sequence's row m: its grammar after the first m proposals."""

    def __init__(self, matcher: GrammarMatcher, token_ids: list[int]):
        self._matcher = matcher
        self._token_ids = token_ids

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self._matcher.fill_bitmask_after(bitmask, index, self._token_ids)


class PendingGrammars:
    """An engine's requests waiting for their grammar: request id -> the compile's future.
    `on_ready` (set by AsyncEngine) is called, from a compiler thread, when one is done."""

    def __init__(self):
        self._futures: dict[str, Future] = {}
        self.on_ready: Callable[[], None] | None = None

    def add(self, request_id: str, future: Future) -> None:
        self._futures[request_id] = future
        future.add_done_callback(self._done)

    def take_ready(self) -> list[tuple[str, Future]]:
        """The requests whose compile is done (with its future), no longer waiting."""
        ready = [(r, f) for r, f in self._futures.items() if f.done()]
        for request_id, _ in ready:
            del self._futures[request_id]
        return ready

    def discard(self, request_id: str) -> None:
        self._futures.pop(request_id, None)

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until one is done (for a caller that steps an engine itself and has nothing else to do)."""
        if self._futures:
            wait(list(self._futures.values()), timeout_s, FIRST_COMPLETED)

    def __len__(self) -> int:
        return len(self._futures)

    def _done(self, _future: Future) -> None:
        callback = self.on_ready
        if callback is not None:
            callback()


class GrammarCompiler:
    """Compiles GuidedSpecs for one tokenizer and logits width, in its own threads, with a cache.

    `vocab_size` is the width of the model's logits (it may exceed the tokenizer's vocabulary:
    the padding is never allowed); `stop_token_ids` end a complete grammar (the model's EOS ids).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...], *, max_cached: int = _MAX_CACHED):
        assert stop_token_ids, "a grammar needs a stop token to end with"
        self._tokenizer = weakref.ref(tokenizer)  # its owner (an engine, a front) keeps it alive
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.max_cached = max_cached
        self._pool = ThreadPoolExecutor(max_workers=_COMPILE_THREADS, thread_name_prefix="kvrelay-grammar")
        self._cache: OrderedDict[GuidedSpec, Future] = OrderedDict()
        self._lock = threading.Lock()  # the cache; and building the backend's compiler, once
        self._backend: Any = None  # xgrammar.GrammarCompiler, built by the first compile
        self._json_tokens: torch.Tensor | None = None  # bitmask row: tokens without a control byte
        self.num_compiled = 0  # specs compiled (cache misses), for tests and stats

    def submit(self, spec: GuidedSpec) -> Future:
        """The compiled grammar of `spec`, as a future shared by every caller of the same spec
        (never blocks; a cached one is already done). It raises GrammarCompileError when the
        spec does not compile. Callers must not cancel it."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None and not future.cancelled():
                self._cache.move_to_end(spec)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec] = future
            self.num_compiled += 1
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            return future

    def compile(self, spec: GuidedSpec) -> CompiledGrammar:
        """`submit(spec)`'s result, waiting for it."""
        return self.submit(spec).result()

    def matcher(self, compiled: CompiledGrammar, replay: Sequence[int] = ()) -> GrammarMatcher:
        """A fresh matcher of a compiled grammar (one per sequence), past the tokens `replay`
        (generated elsewhere); InvalidRequestError when one does not follow the grammar."""
        import xgrammar

        matcher = GrammarMatcher(xgrammar.GrammarMatcher(compiled.handle, terminate_without_stop_token=False), compiled.allowed)
        for position, token_id in enumerate(replay):
            if not matcher.accept(token_id):
                raise InvalidRequestError(
                    "prior_output_token_ids", f"token {token_id} at position {position} does not follow the request's grammar",
                )
        return matcher

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- in the pool's threads ---------------------------------------------------------------
    def _compile(self, spec: GuidedSpec) -> CompiledGrammar:
        backend = self._compiler()
        try:
            # Compact JSON never holds a raw control byte (< 0x20: JSON escapes them in strings, and
            # there is no whitespace between tokens), but xgrammar's length-bounded strings allow
            # them (`[^"\\\r\n]`): JSON grammars are kept to tokens without one.
            compiled = CompiledGrammar(self._compile_with(backend, spec), self._json_tokens if spec.kind.startswith("json") else None)
            # A grammar that allows no first token would leave its request nothing to sample.
            bitmask = allocate_bitmask(1, self.vocab_size)
            self.matcher(compiled).fill_bitmask(bitmask, 0)
        except Exception as exc:  # xgrammar's parse and conversion errors (RuntimeError, ValueError, ...): the spec's
            raise GrammarCompileError(f"cannot be compiled: {_reason(exc)}") from None
        if not bitmask.any():
            raise GrammarCompileError("matches no output: its grammar allows no first token")
        return compiled

    @staticmethod
    def _compile_with(backend: Any, spec: GuidedSpec) -> Any:
        if spec.kind == "json_schema":
            return backend.compile_json_schema(spec.value, any_whitespace=False, strict_mode=True)
        if spec.kind == "json_object":
            return backend.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if spec.kind == "regex":
            return backend.compile_regex(spec.value)
        if spec.kind == "choice":
            # JSON string literals are EBNF string literals (the same escapes).
            options = json.loads(spec.value)
            return backend.compile_grammar("root ::= " + " | ".join(json.dumps(o) for o in options))
        if "::=" in spec.value:
            return backend.compile_grammar(spec.value)
        return backend.compile_lark(spec.value)

    def _compiler(self) -> Any:
        with self._lock:
            if self._backend is None:
                tokenizer = self._tokenizer()
                assert tokenizer is not None, "the tokenizer was dropped while its grammars were still compiled"
                self._backend, self._json_tokens = _build_backend(tokenizer, self.vocab_size, self.stop_token_ids)
            return self._backend


def _build_backend(tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> tuple[Any, torch.Tensor]:
    """xgrammar's compiler for this tokenizer, with its special tokens made unmatchable; and the
    bitmask row of the tokens without a control byte."""
    import xgrammar

    assert sys.byteorder == "little", "the bitmask's bit order assumes a little-endian host"
    detected = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
    metadata = json.loads(detected.dump_metadata())
    # An empty token is special to xgrammar: never matched by a grammar.
    special = set(getattr(tokenizer, "all_special_ids", ())) | set(stop_token_ids)
    encoded = [""] * vocab_size
    for token, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size and token_id not in special:
            encoded[token_id] = token
    info = xgrammar.TokenizerInfo(
        encoded, vocab_type=xgrammar.VocabType(metadata["vocab_type"]), vocab_size=vocab_size,
        stop_token_ids=list(stop_token_ids), add_prefix_space=metadata["add_prefix_space"],
    )
    # One thread per compile: the pool runs beside the engine's step thread on the same cores.
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    return compiler, _tokens_without_control_bytes(info.decoded_vocab, vocab_size)


def _tokens_without_control_bytes(decoded_vocab: list[bytes], vocab_size: int) -> torch.Tensor:
    """A bitmask row (int32 words) of the tokens none of whose bytes is below 0x20."""
    clean = np.zeros(-(-vocab_size // 32) * 32, dtype=bool)
    for token_id, piece in enumerate(decoded_vocab[:vocab_size]):
        clean[token_id] = not any(b < 0x20 for b in piece)
    return torch.from_numpy(np.packbits(clean, bitorder="little").view(np.int32).copy())


def _reason(exc: BaseException) -> str:
    """xgrammar's message without its source location: `[time] /path/file.cc:123: reason`."""
    text = str(exc).strip()
    head, sep, tail = text.partition(".cc:")
    if sep and head.startswith("["):
        _, _, tail = tail.partition(": ")
        return tail.strip() or text
    return text


_COMPILERS: dict[tuple[int, int, tuple[int, ...]], GrammarCompiler] = {}
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> GrammarCompiler:
    """This process's GrammarCompiler for `tokenizer` (the same object) and logits width; it goes
    (with its cache and threads) when the tokenizer does."""
    key = (id(tokenizer), vocab_size, tuple(stop_token_ids))
    with _COMPILERS_LOCK:
        compiler = _COMPILERS.get(key)
        if compiler is None:
            compiler = _COMPILERS[key] = GrammarCompiler(tokenizer, vocab_size, tuple(stop_token_ids))
            weakref.finalize(tokenizer, _forget, key)
        return compiler


def _forget(key: tuple[int, int, tuple[int, ...]]) -> None:
    with _COMPILERS_LOCK:
        compiler = _COMPILERS.pop(key, None)
    if compiler is not None:
        compiler.shutdown()
