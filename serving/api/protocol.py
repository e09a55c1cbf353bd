"""OpenAI wire models for requests, and their translation to the engine's SamplingParams.

Unknown fields are accepted, as OpenAI does, and never silently: the response names them in its
`x-kvrelay-ignored-fields` header (serving/api/field_support.py; nested ones by path, e.g.
`messages[0].foo`). A known OpenAI field is one of three kinds, tabled in field_support.py and in
README's API section: implemented (the fields of these models); not implemented, refused with a 400
naming it whenever it asks for something (`audio`, `store: true`, `prediction`, ...; also image
parts, `suffix`, `echo` with streaming); or accepted without effect, with the reason in the table
(`metadata`, `prompt_cache_key`, ...), and named in the same header when set.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from serving.engine.errors import InvalidRequestError
from serving.engine.params import MAX_TOP_LOGPROBS, SamplingParams

__all__ = [
    "ChatMessage",
    "ChatCompletionRequest",
    "CompletionRequest",
    "StreamOptions",
    "sampling_params",
    "message_text",
]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields: kept as extras, named by field_support


class StreamOptions(_Lenient):
    include_usage: bool = False


class TextPart(_Lenient):
    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class _SamplingFields(_Lenient):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM-style extensions
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    cache_salt: str | None = None
    # kvrelay's: seconds until the request is aborted (serving/api/deadlines.py)
    timeout: float | None = Field(None, gt=0, allow_inf_nan=False)
    # vLLM's: keep the last k prompt tokens, -1 what fits (serving/api/context_budget.py)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # kvrelay's, with the Responses API's name and values: "auto" drops the oldest turns to fit the
    # context window (serving/api/context_budget.py); None: the server's default
    truncation: Literal["auto", "disabled"] | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


def message_text(message: ChatMessage, index: int) -> str:
    """A message's content as one string; text parts are joined, other parts refused."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise InvalidRequestError(
                f"messages[{index}].content[{j}]",
                f"only text content parts are supported, got type {part.type!r}",
            )
        texts.append(part.text)
    return "".join(texts)


def sampling_params(request: ChatCompletionRequest | CompletionRequest) -> SamplingParams:
    """Translate the request's sampling fields; SamplingParams checks the ranges when built."""
    if isinstance(request, ChatCompletionRequest):
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        if request.top_logprobs is not None and not request.logprobs:
            raise InvalidRequestError("top_logprobs", "requires logprobs to be true")
        if request.top_logprobs is not None and not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {request.top_logprobs}")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
    else:
        max_tokens = request.max_tokens
        logprobs = request.logprobs
        if request.suffix is not None:
            raise InvalidRequestError("suffix", "is not supported by this server")
    logit_bias = None
    if request.logit_bias:
        logit_bias = {}
        for key, bias in request.logit_bias.items():
            try:
                logit_bias[int(key)] = bias
            except ValueError:
                raise InvalidRequestError("logit_bias", f"keys must be token ids, got {key!r}") from None
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])

    def pick(value, default):
        return default if value is None else value

    return SamplingParams(
        n=request.n,
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        temperature=pick(request.temperature, 1.0),
        top_p=pick(request.top_p, 1.0),
        top_k=pick(request.top_k, 0),
        min_p=pick(request.min_p, 0.0),
        repetition_penalty=pick(request.repetition_penalty, 1.0),
        presence_penalty=pick(request.presence_penalty, 0.0),
        frequency_penalty=pick(request.frequency_penalty, 0.0),
        logit_bias=logit_bias,
        seed=request.seed,
        logprobs=logprobs,
        stop=stop,
        stop_token_ids=list(request.stop_token_ids or []),
        include_stop_str_in_output=request.include_stop_str_in_output,
        ignore_eos=request.ignore_eos,
        skip_special_tokens=request.skip_special_tokens,
    )
