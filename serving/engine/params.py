"""Per-request sampling and stopping parameters, valid by construction.

A SamplingParams that exists has every field in range: `__post_init__` checks them (raising
InvalidRequestError that names the field), so the ingress, which builds one from the wire request,
validates them once, and no later layer checks them again (a copy made with `replace` is checked
as it is made; one unpickled on a worker is the ingress's, already checked). What depends on the
model (token ids within its vocabulary) is `check_vocab`, which the engine's invariant checks run.

`guided` (a GuidedSpec) constrains the output to a grammar: a JSON schema, any JSON object, a
regex, one of a list of strings, or an EBNF / Lark grammar (serving/engine/sampling/grammar.py compiles it
and masks every step's logits to the tokens it allows). The spec is structurally checked here;
whether it compiles is the grammar module's verdict, which the ingress asks for once, at the edge.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Literal, get_args

from serving.engine.errors import InvalidRequestError

__all__ = ["GuidedKind", "GuidedSpec", "SamplingParams", "MAX_N", "MAX_STOP_STRINGS", "MAX_TOP_LOGPROBS"]

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs
MAX_N = 128  # OpenAI's limit for n
MAX_STOP_STRINGS = 16  # the ingress's stop checker matches each at every token


GuidedKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class GuidedSpec:
    """What a structured output must match; hashable, so it is also the compile cache's key.

    | kind          | value                                                               |
    | ------------- | ------------------------------------------------------------------- |
    | `json_schema` | the JSON schema, as JSON text (an object or a boolean)               |
    | `json_object` | "" (any JSON object: OpenAI's `response_format: {"type": "json_object"}`) |
    | `regex`       | the regular expression the whole output matches                      |
    | `choice`      | a JSON array of strings, as JSON text: the output is exactly one     |
    | `grammar`     | an EBNF grammar (GBNF style, `root ::= ...`), or a Lark one (no `::=`) |

    Build the text values with `GuidedSpec.json_schema(schema)` and `GuidedSpec.choice(options)`:
    equal schemas then give equal specs (one compile). The output is compact JSON for both JSON
    kinds (`, ` and `: ` between items, no other whitespace), so a model cannot spend its budget on
    whitespace.
    """

    kind: GuidedKind
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in get_args(GuidedKind):
            raise InvalidRequestError("guided", f"kind must be one of {', '.join(get_args(GuidedKind))}, got {self.kind!r}")
        if not isinstance(self.value, str):
            raise InvalidRequestError("guided", f"value must be a string, got {type(self.value).__name__}")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.value)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError("guided", f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError("guided", f"a JSON schema is an object or a boolean, got {type(schema).__name__}")
        elif self.kind == "choice":
            try:
                options = json.loads(self.value)
            except json.JSONDecodeError:
                options = None
            if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
                raise InvalidRequestError("guided", "choice is a JSON array of one or more non-empty strings")
        elif self.kind in ("regex", "grammar") and not self.value:
            raise InvalidRequestError("guided", f"the {self.kind} must not be empty")

    @classmethod
    def json_schema(cls, schema: dict | bool) -> GuidedSpec:
        return cls("json_schema", json.dumps(schema, ensure_ascii=False, separators=(",", ":")))

    @classmethod
    def choice(cls, options: list[str]) -> GuidedSpec:
        return cls("choice", json.dumps(list(options), ensure_ascii=False))


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    Defaults follow OpenAI's API: temperature 1, top_p 1, no penalties. `temperature == 0`
    means greedy. `logprobs=None` returns no logprobs; `logprobs=k` returns the sampled
    token's logprob plus the k most likely tokens (k may be 0).

    `prompt_logprobs=k` returns, with the request's first output, each prompt token's logprob
    (after the first), its rank and the k most likely tokens at its position, from the logits of
    the prompt's own forward passes (model_runner.py). Such a request reads nothing from the
    prefix cache (a cached block has KV but no logits). A request continued from tokens generated
    elsewhere (`prior_output_token_ids`, a KV import) computes none: its prompt logprobs came with
    its first output, from the engine that computed its prompt. `max_tokens=0` computes the prompt
    and generates nothing (finish_reason "length"): scoring a prompt.

    With `guided`, every token is one the grammar allows, and once the grammar is complete only
    EOS is: the output ends with finish_reason "stop" (EOS not shown), or "length" when max_tokens
    (or the context window) cut it first, and then the output may be incomplete (a JSON document
    without its closing braces): the finish_reason says so. Stop strings still apply, as asked,
    and may cut it too (finish_reason "stop" with the string as stop_reason). `min_tokens` and
    `ignore_eos` cannot be combined with it: the grammar decides where the output ends.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # False: return token ids only (text "" in every output), for callers that detokenize
    # themselves (the ingress). Stop strings then are the caller's job too.
    detokenize: bool = True
    guided: GuidedSpec | None = None  # structured output: the grammar every token must follow
    # False: this request never gets proposed tokens where the engine speculates (speculative.py),
    # e.g. a short or high-entropy output that proposals would only slow down; no effect otherwise
    speculative: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._check_ranges()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def _check_ranges(self) -> None:
        """Raise InvalidRequestError naming the first bad field and its allowed range."""
        _check_int("n", self.n, lo=1, hi=MAX_N)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=0)
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        _check_float("temperature", self.temperature, lo=0.0, hi=2.0)
        _check_float("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _check_int("top_k", self.top_k, lo=0)
        _check_float("min_p", self.min_p, lo=0.0, hi=1.0)
        _check_float("repetition_penalty", self.repetition_penalty, lo=0.0, hi=10.0, lo_open=True)
        _check_float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=-(2**63), hi=2**63 - 1)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=MAX_TOP_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_TOP_LOGPROBS)
        for token_id, bias in (self.logit_bias or {}).items():
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                raise InvalidRequestError("logit_bias", f"bias for token {token_id} must be in [-100, 100], got {bias}")
        for token_id in self.stop_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int):
                raise InvalidRequestError("stop_token_ids", f"token ids are integers, got {token_id!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError("stop", "stop strings must be non-empty strings")
        if self.guided is not None:
            if not isinstance(self.guided, GuidedSpec):
                raise InvalidRequestError("guided", f"must be a GuidedSpec, got {type(self.guided).__name__}")
            if self.min_tokens:
                raise InvalidRequestError("min_tokens", "cannot be combined with a structured output (the grammar decides where it ends); drop min_tokens")
            if self.ignore_eos:
                raise InvalidRequestError(
                    "ignore_eos", "cannot be combined with a structured output (it ends with EOS when the grammar is complete); drop ignore_eos",
                )

    def check_vocab(self, vocab_size: int) -> None:
        """Raise InvalidRequestError for a token id (logit_bias, stop_token_ids) outside the vocabulary."""
        for name, token_ids in (("logit_bias", self.logit_bias or {}), ("stop_token_ids", self.stop_token_ids)):
            for token_id in token_ids:
                if not 0 <= token_id < vocab_size:
                    raise InvalidRequestError(name, f"token id {token_id} is not in the vocabulary (0..{vocab_size - 1})")


def _check_int(name: str, value: object, *, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(name, f"must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise InvalidRequestError(name, f"must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise InvalidRequestError(name, f"must be <= {hi}, got {value}")


def _check_float(
    name: str, value: object, *, lo: float, hi: float, lo_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(name, f"must be a finite number, got {value!r}")
    too_low = value <= lo if lo_open else value < lo
    if too_low or value > hi:
        bracket = "(" if lo_open else "["
        raise InvalidRequestError(name, f"must be in {bracket}{lo}, {hi}], got {value}")
