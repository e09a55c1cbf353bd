"""The checks a request must pass before anything is scheduled, and ModelInfo, the limits they
check against (what the ingress must know of the workers' engines).

The ingress runs `check_request` once per request with the workers' ModelInfo, naming the
client's fields; each engine runs it again on what it receives, as its invariants: cheap checks
(lengths, token ids within its vocabulary, a KV payload that fits) without which it would fail
or corrupt its cache. Sampling parameters are valid by construction (params.py)."""

from __future__ import annotations

from dataclasses import dataclass

from serving.engine.errors import ContextLengthError, InvalidRequestError
from serving.engine.kv.payload import KVLayout, KVPayload
from serving.engine.params import SamplingParams

__all__ = ["ModelInfo", "check_request"]


@dataclass(frozen=True)
class ModelInfo:
    """What the ingress must know of the workers' engines to validate a request."""

    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    block_size: int

    @classmethod
    def of(cls, engine) -> ModelInfo:
        """The limits of an LLMEngine (serving/engine/engine.py)."""
        return cls(vocab_size=engine.vocab_size, max_model_len=engine.max_model_len,
                   eos_token_ids=tuple(engine.eos_token_ids), block_size=engine.config.block_size)


def check_request(
    prompt: list[int],
    prior: list[int],
    params: SamplingParams,
    *,
    hold_kv: bool,
    kv_payload: KVPayload | None,
    vocab_size: int,
    max_model_len: int,
    kv_layout: KVLayout,
) -> None:
    """Raise InvalidRequestError (naming the field and the limit) for anything unschedulable."""
    if not prompt:
        raise InvalidRequestError("prompt", "must not be empty")
    bad = [t for t in prompt if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise InvalidRequestError(
            "prompt_token_ids", f"token id {bad[0]!r} is not in the vocabulary (0..{vocab_size - 1})"
        )
    params.check_vocab(vocab_size)
    num_tokens = len(prompt) + len(prior)
    if num_tokens >= max_model_len:
        raise ContextLengthError(
            "messages",
            f"the prompt has {num_tokens} tokens but the context window is {max_model_len} "
            "(shorten the prompt)",
            num_tokens=num_tokens, limit=max_model_len,
        )
    if params.max_tokens is not None and len(prompt) + params.max_tokens > max_model_len:
        raise ContextLengthError(
            "max_tokens",
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
            f"context window of {max_model_len} tokens (lower max_tokens to at most "
            f"{max_model_len - len(prompt)})",
            num_tokens=len(prompt) + params.max_tokens, limit=max_model_len,
        )
    if prior and params.max_tokens is not None and len(prior) >= params.max_tokens:
        raise InvalidRequestError("max_tokens", f"must exceed the {len(prior)} tokens generated already")
    if (hold_kv or kv_payload is not None) and params.n != 1:
        raise InvalidRequestError("n", "KV export/import supports n=1 only")
    if kv_payload is not None:
        if kv_payload.layout != kv_layout:
            raise InvalidRequestError(
                "kv_payload", f"layout {kv_payload.layout} does not match this engine's {kv_layout}"
            )
        if kv_payload.token_ids != (prompt + prior)[: kv_payload.num_tokens] or kv_payload.num_tokens >= num_tokens:
            raise InvalidRequestError(
                "kv_payload", "its tokens are not a proper prefix of the prompt and prior outputs"
            )
