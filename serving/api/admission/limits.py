"""What one request may ask for, checked once at the ingress against the config's `api:` section.

    wire request ──check_request(request, num_prompts, api)──▶ counts within their limits
    prompt ids + SamplingParams ──fit_max_tokens(...)──▶ one SamplingParams per prompt, each with a
                                   definite max_tokens, prompts x n x max_tokens within the limit

Each refusal is an InvalidRequestError (400 `invalid_value`) whose `param` names the field and
whose message gives the limit. Why they exist: without them one /v1/completions body of 8 MiB
holds thousands of prompts, each with n up to 128 and, with max_tokens null, the whole context
window to fill: millions of engine sequences from one request, every KV block of a replica held by
it. The costs per token grow with the rest: every stop string is matched at every token (and as
many characters of the stream are held back), logprobs are a top-k per token, and logit_bias is
applied at every step (the engine applies it from tensors built once per request,
serving/engine/sampling/sampler.py, so a step costs O(entries) of each row that has one).

The defaults (serving/config/api_limits.py APIConfig) are above what OpenAI's and vLLM's clients
send: n <= 16, 64 prompts, 16 stop strings of 256 characters, 20 logprobs, 1024 logit_bias
entries; a request without max_tokens may generate default_max_tokens (4096) or up to the context
window if that is fewer.
"""

from __future__ import annotations

from dataclasses import replace

from serving.api.protocol.wire import ChatCompletionRequest, CompletionRequest
from serving.config import APIConfig
from serving.engine.errors import InvalidRequestError
from serving.engine.params import SamplingParams

__all__ = ["check_request", "fit_max_tokens", "max_tokens_param"]


def check_request(request: ChatCompletionRequest | CompletionRequest, num_prompts: int, api: APIConfig) -> None:
    """The request's counts and lengths, before anything is tokenized or built from them."""
    if num_prompts > api.max_prompts_per_request:
        raise InvalidRequestError("prompt", f"at most {api.max_prompts_per_request} prompts per request, got {num_prompts}")
    if request.n > api.max_n:
        raise InvalidRequestError("n", f"at most {api.max_n} choices per prompt, got {request.n}")
    if isinstance(request, ChatCompletionRequest):
        if request.top_logprobs is not None and request.top_logprobs > api.max_logprobs:
            raise InvalidRequestError("top_logprobs", f"must be in [0, {api.max_logprobs}], got {request.top_logprobs}")
    elif request.logprobs is not None and request.logprobs > api.max_logprobs:
        raise InvalidRequestError("logprobs", f"must be <= {api.max_logprobs}, got {request.logprobs}")
    if request.prompt_logprobs is not None and request.prompt_logprobs > api.max_logprobs:
        raise InvalidRequestError("prompt_logprobs", f"must be <= {api.max_logprobs}, got {request.prompt_logprobs}")
    if request.logit_bias is not None and len(request.logit_bias) > api.max_logit_bias_entries:
        raise InvalidRequestError("logit_bias", f"at most {api.max_logit_bias_entries} entries, got {len(request.logit_bias)}")
    stop = [request.stop] if isinstance(request.stop, str) else request.stop or []
    if len(stop) > api.max_stop_strings:
        raise InvalidRequestError("stop", f"at most {api.max_stop_strings} stop strings, got {len(stop)}")
    for i, text in enumerate(stop):
        if len(text) > api.max_stop_string_chars:
            where = "the stop string" if isinstance(request.stop, str) else f"stop[{i}]"
            raise InvalidRequestError("stop", f"{where} has {len(text)} characters; the limit is {api.max_stop_string_chars}")
    if request.stop_token_ids is not None and len(request.stop_token_ids) > api.max_stop_token_ids:
        raise InvalidRequestError("stop_token_ids", f"at most {api.max_stop_token_ids} token ids, got {len(request.stop_token_ids)}")


def fit_max_tokens(
    params: SamplingParams, prompt_lengths: list[int], max_model_len: int, api: APIConfig, *, param: str,
) -> list[SamplingParams]:
    """One SamplingParams per prompt (of `prompt_lengths` tokens, each validated against the
    context window already): a max_tokens the request left out becomes default_max_tokens, or the
    room left in the context window if that is fewer; then the request's total, prompts x n x
    max_tokens, must be within max_output_tokens_per_request (`param` names the max_tokens field)."""
    if params.max_tokens is not None:
        fitted = [params] * len(prompt_lengths)
    else:
        fitted = []
        for length in prompt_lengths:
            room = max_model_len - length
            fitted.append(replace(params, max_tokens=room if api.default_max_tokens is None else min(room, api.default_max_tokens)))
    total = sum(p.n * p.max_tokens for p in fitted)
    if total > api.max_output_tokens_per_request:
        shown = str(fitted[0].max_tokens) if len({p.max_tokens for p in fitted}) == 1 else "(per prompt)"
        raise InvalidRequestError(
            param,
            f"{len(fitted)} prompt(s) x n {params.n} x max_tokens {shown} = {total} tokens to generate, over the "
            f"limit of {api.max_output_tokens_per_request} per request; lower max_tokens or n",
        )
    return fitted


def max_tokens_param(request: ChatCompletionRequest | CompletionRequest) -> str:
    """The field a request's max_tokens came from."""
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        return "max_completion_tokens"
    return "max_tokens"
