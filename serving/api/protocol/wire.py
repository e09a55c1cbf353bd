"""OpenAI wire models for requests, and their translation to the engine's SamplingParams.

Unknown fields are accepted, as OpenAI does, and never silently: the response names them in its
`x-kvrelay-ignored-fields` header (serving/api/protocol/field_support.py; nested ones by path, e.g.
`messages[0].foo`). A known OpenAI field is one of three kinds, tabled in field_support.py and in
README's API section: implemented (the fields of these models); not implemented, refused with a 400
naming it whenever it asks for something (`audio`, `store: true`, `prediction`, ...; also image
parts, `suffix`, `prompt_logprobs` with streaming); or accepted without effect, with the reason in the table
(`metadata`, `prompt_cache_key`, ...), and named in the same header when set.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from serving.api.protocol.structured import ResponseFormat, StructuredOutputs, guided_spec
from serving.engine.errors import InvalidRequestError
from serving.engine.params import MAX_TOP_LOGPROBS, SamplingParams

__all__ = [
    "ChatMessage",
    "FunctionCall",
    "FunctionDefinition",
    "NamedToolChoice",
    "ToolCall",
    "ToolDefinition",
    "ChatCompletionRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "StreamOptions",
    "TokenizeChatRequest",
    "TokenizeCompletionRequest",
    "sampling_params",
    "message_text",
    "with_example",
]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields: kept as extras, named by field_support


def with_example(body: dict[str, Any]) -> ConfigDict:
    """A lenient body's config with one request the OpenAPI document shows as its example: a
    client sees a working request, and the property-based tests send it before their generated
    ones (tests/openapi_fuzz.py)."""
    return ConfigDict(extra="allow", json_schema_extra={"examples": [body]})


class StreamOptions(_Lenient):
    include_usage: bool = False


class TextPart(_Lenient):
    type: str
    text: str | None = None


class FunctionCall(_Lenient):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Lenient):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of an object; None: no arguments
    strict: bool | None = None


class ToolDefinition(_Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls, in a conversation's history
    tool_call_id: str | None = None  # a tool message: the call it answers


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
    prompt_logprobs: int | None = None  # each prompt token's logprob and top k (not with stream)
    # kvrelay's: seconds until the request is aborted (serving/api/admission/deadlines.py)
    timeout: float | None = Field(None, gt=0, allow_inf_nan=False)
    # kvrelay's: false opts this request out of speculative decoding where the engine has it on
    # (vLLM has no per-request field; its proposed `disable_spec_decode` was not merged)
    speculative: bool = True
    # Structured outputs, at most one (serving/api/protocol/structured.py): OpenAI's, vLLM's, vLLM's older ones
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Any = None  # a schema, or its JSON text: checked by guided_spec, naming the field
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: keep the last k prompt tokens, -1 what fits (serving/api/generation/context_budget.py)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)


class ChatCompletionRequest(_SamplingFields):
    model_config = with_example({"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8})
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # kvrelay's, with the Responses API's name and values: "auto" drops the oldest turns to fit the
    # context window (serving/api/generation/context_budget.py); None: the server's default
    truncation: Literal["auto", "disabled"] | None = None


class CompletionRequest(_SamplingFields):
    model_config = with_example({"prompt": "Once upon a time", "max_tokens": 8})
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class TokenizeCompletionRequest(_Lenient):
    """POST /tokenize with a prompt (vLLM's shape)."""

    model_config = with_example({"prompt": "Hello world"})

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Lenient):
    """POST /tokenize with chat messages, rendered as /v1/chat/completions renders them."""

    model_config = with_example({"messages": [{"role": "user", "content": "Hello"}]})

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the chat template writes the special tokens
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False
    tools: list[ToolDefinition] | None = None  # shown as a chat completion with them would show them
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class DetokenizeRequest(_Lenient):
    """POST /detokenize (vLLM's shape)."""

    model_config = with_example({"tokens": [1, 2, 3]})

    model: str | None = None
    tokens: list[int]


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
    prompt_logprobs = request.prompt_logprobs
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
        if request.echo and logprobs is not None:  # the echoed prompt's tokens have logprobs too
            prompt_logprobs = logprobs if prompt_logprobs is None else max(logprobs, prompt_logprobs)
    _check_scoring(request, max_tokens)
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
        prompt_logprobs=prompt_logprobs,
        stop=stop,
        stop_token_ids=list(request.stop_token_ids or []),
        include_stop_str_in_output=request.include_stop_str_in_output,
        ignore_eos=request.ignore_eos,
        skip_special_tokens=request.skip_special_tokens,
        guided=guided_spec(request),
        speculative=request.speculative,
    )


def _check_scoring(request: ChatCompletionRequest | CompletionRequest, max_tokens: int | None) -> None:
    """max_tokens 0 scores the prompt without generating: only where the prompt's logprobs come
    back (prompt_logprobs, or a completion's echo). prompt_logprobs is not streamed (as vLLM)."""
    if request.prompt_logprobs is not None and request.stream:
        hint = "; stream echo with logprobs instead" if isinstance(request, CompletionRequest) else ""
        raise InvalidRequestError("prompt_logprobs", f"is not available with stream{hint}")
    if max_tokens == 0 and request.prompt_logprobs is None and not getattr(request, "echo", False):
        field = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) is not None else "max_tokens"
        needs = "prompt_logprobs or echo" if isinstance(request, CompletionRequest) else "prompt_logprobs"
        raise InvalidRequestError(field, f"must be >= 1, got 0 (0 scores the prompt without generating: with {needs})")
