"""A prompt's logprobs on the wire: the engine's prompt logprobs (RequestOutput.prompt_logprobs,
one TokenLogprob per prompt token after the first) in the two shapes clients read.

    echo + logprobs (/v1/completions)     OpenAI's legacy `logprobs` of the prompt's tokens, which
                                          the generated tokens' follow:
        tokens          ["The", " quick", ...]           each token's own text
        token_logprobs  [null, -7.1, ...]                the first token has nothing before it
        top_logprobs    [null, {" quick": -7.1, " the": -2.3}, ...]
                                                         the token and the `logprobs` most likely
                                                         (up to logprobs + 1 entries, as OpenAI)
        text_offset     [0, 3, ...]                      cumulative over the token texts, from 0

    prompt_logprobs (vLLM's; a completion choice's, a chat response's)
        [null, {"3918": {"logprob": -7.1, "rank": 812, "decoded_token": " quick"},
                "262": {"logprob": -2.3, "rank": 1, "decoded_token": " the"}}, ...]
                                                         the prompt's token first, then the
                                                         `prompt_logprobs` most likely

A rank is 1 + how many tokens the model found strictly more likely. Logprobs of -inf are written
-9999.0, as OpenAI does (JSON has no infinity). A request that ended before its prompt was scored
(its 408 `partial`) shows the prompt's tokens with null logprobs.
"""

from __future__ import annotations

from serving.api.endpoints.http_io import finite_logprob
from serving.engine.outputs import TokenLogprob

__all__ = ["echoed_logprobs", "legacy_top", "vllm_prompt_logprobs", "joined"]


def legacy_top(frontend, lp: TokenLogprob, k: int) -> dict[str, float]:
    """A token's `top_logprobs` entry: itself and the k most likely, by their texts."""
    top = {frontend.token_text(lp.token_id): finite_logprob(lp.logprob)}
    for token_id, value in lp.top[:k]:
        top[frontend.token_text(token_id)] = finite_logprob(value)
    return top


def echoed_logprobs(frontend, prompt_ids: list[int], prompt_logprobs: list[TokenLogprob] | None, k: int) -> dict:
    """The legacy `logprobs` of the prompt's tokens (k alternatives each)."""
    tokens, token_logprobs, top, text_offset = [], [], [], []
    offset = 0
    for i, token_id in enumerate(prompt_ids):
        text = frontend.token_text(token_id)
        lp = prompt_logprobs[i - 1] if i > 0 and prompt_logprobs is not None else None
        tokens.append(text)
        token_logprobs.append(finite_logprob(lp.logprob) if lp is not None else None)
        top.append(legacy_top(frontend, lp, k) if lp is not None else None)
        text_offset.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": text_offset}


def joined(first: dict, second: dict) -> dict:
    """Two legacy `logprobs` objects, one after the other."""
    return {key: first[key] + second[key] for key in first}


def vllm_prompt_logprobs(frontend, prompt_ids: list[int], prompt_logprobs: list[TokenLogprob] | None, k: int) -> list | None:
    """vLLM's `prompt_logprobs`: null first, then per token a dict by token id (as a string, the
    way JSON writes vLLM's int keys); None when the prompt was not scored."""
    if prompt_logprobs is None:
        return None
    entries: list[dict | None] = [None]
    for token_id, lp in zip(prompt_ids[1:], prompt_logprobs, strict=True):
        entry = {str(token_id): _vllm_logprob(frontend, token_id, lp.logprob, lp.rank)}
        values = [v for _, v in lp.top]
        for top_id, value in lp.top[:k]:
            # lp.top is sorted most likely first: those before it that are strictly more likely
            rank = 1 + sum(1 for v in values if v > value)
            entry.setdefault(str(top_id), _vllm_logprob(frontend, top_id, value, rank))
        entries.append(entry)
    return entries


def _vllm_logprob(frontend, token_id: int, logprob: float, rank: int | None) -> dict:
    return {"logprob": finite_logprob(logprob), "rank": rank, "decoded_token": frontend.token_text(token_id)}
