"""What one API request may ask for (the `api` section of the app's config: APIConfig, with the
context budget), and how tools are shown to the model and its calls read (`tool_calling`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from serving.engine.params import MAX_N, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS
from serving.engine.strict import StrictModel

__all__ = ["APIConfig", "ContextBudgetConfig", "ToolCallingConfig", "TEMPLATE_CALL_KWARGS"]


# Keyword arguments of transformers' apply_chat_template that are not template variables: a request's
# chat_template_kwargs must never reach them (tokenize=True changes what it returns, `chat_template`
# is a program of the request's own; that one has its own switch, allow_request_chat_template).
TEMPLATE_CALL_KWARGS = frozenset({
    "chat_template", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "kwargs",
})


class ContextBudgetConfig(StrictModel):
    """How a prompt that does not fit the context window is fitted instead of refused
    (serving/api/generation/context_budget.py). A request chooses with `truncation` (chat, /v1/responses) and
    `truncate_prompt_tokens` (chat, completions); these are the server's side of it."""

    truncation: Literal["disabled", "auto"] = Field(
        "disabled",
        description="For a chat or /v1/responses request that sends no `truncation`. disabled: a prompt "
        "that, with the tokens reserved for the output, exceeds the context window is refused with a "
        "400 context_length_exceeded. auto: its oldest turns (a user message and the replies after it) "
        "are dropped until it fits; the system and developer messages and the last turn are always kept.",
    )
    reserve_output_tokens: int = Field(
        256, ge=1, le=1 << 20,
        description="Tokens kept free for the output when a prompt is fitted (truncation auto, or "
        "truncate_prompt_tokens: -1) and the request sets no max_tokens; one that does reserves its max_tokens.",
    )


class APIConfig(StrictModel):
    """What one API request may ask for. Each limit refused is a 400 whose `param` names the field
    and whose message gives the limit (serving/api/admission/limits.py, serving/api/generation/chat_template.py). The
    defaults sit above what OpenAI and vLLM clients send, and bound what one request costs."""

    max_prompts_per_request: int = Field(
        64, ge=1, le=4096, description="Prompts one /v1/completions request may batch (`prompt` as a list).",
    )
    max_n: int = Field(16, ge=1, le=MAX_N, description=f"Choices per prompt (`n`); the engine's own limit is {MAX_N}.")
    default_max_tokens: int | None = Field(
        4096, ge=1,
        description="A chat request without max_tokens (or a completion with max_tokens: null) may "
        "generate this many tokens, or up to the context window if that is fewer. null: up to the "
        "context window (vLLM's default).",
    )
    max_output_tokens_per_request: int = Field(
        262144, ge=1,
        description="The most tokens one request may ask to generate, summed over its prompts and "
        "choices: prompts x n x max_tokens (max_tokens as resolved, default_max_tokens when not given).",
    )
    max_logprobs: int = Field(
        MAX_TOP_LOGPROBS, ge=0, le=MAX_TOP_LOGPROBS,
        description="Alternatives per token: chat `top_logprobs`, completions `logprobs`, `prompt_logprobs`.",
    )
    max_logit_bias_entries: int = Field(1024, ge=0, le=1 << 20, description="Tokens one `logit_bias` may name.")
    max_stop_strings: int = Field(
        MAX_STOP_STRINGS, ge=0, le=MAX_STOP_STRINGS, description=f"Strings in `stop` (the engine's own limit is {MAX_STOP_STRINGS}).",
    )
    max_stop_string_chars: int = Field(
        256, ge=1, le=65536,
        description="Characters of one stop string (the ingress holds back that many characters of "
        "streamed text and matches each stop string at every token).",
    )
    max_stop_token_ids: int = Field(64, ge=0, le=65536, description="Token ids in `stop_token_ids`.")
    allow_request_chat_template: bool = Field(
        False,
        description="Render a chat template sent in a request (`chat_template_kwargs.chat_template`). "
        "A template is a Jinja program, and Jinja's sandbox bounds neither its CPU nor its memory: "
        "turn this on only for trusted clients. false: such a request is refused with a 400.",
    )
    chat_template_kwargs: list[str] = Field(
        default_factory=lambda: ["enable_thinking", "thinking", "reasoning_effort"],
        description="The template variables a request may set in `chat_template_kwargs`, each a "
        "string, number, boolean or null; any other key is refused with a 400 naming it.",
    )
    max_chat_template_kwarg_chars: int = Field(
        256, ge=1, le=65536, description="Characters of a string value in `chat_template_kwargs`.",
    )
    context_budget: ContextBudgetConfig = Field(
        default_factory=ContextBudgetConfig,
        description="Fitting a prompt that exceeds the context window instead of refusing it: the "
        "default `truncation` of a chat and the tokens reserved for the output (serving/api/generation/context_budget.py).",
    )
    render_timeout_s: float = Field(
        10.0, gt=0, le=600,
        description="The longest one request's prompt may take to render (chat template) and "
        "tokenize; both run in a thread, off the ingress's event loop. Longer: a 400, and a "
        "template still running is interrupted.",
    )

    @model_validator(mode="after")
    def _check_template_kwargs(self) -> APIConfig:
        reserved = sorted(set(self.chat_template_kwargs) & TEMPLATE_CALL_KWARGS)
        if "chat_template" in reserved:
            raise ValueError(
                "chat_template_kwargs lists chat_template: set allow_request_chat_template: true instead "
                "(and only for trusted clients)"
            )
        if reserved:
            raise ValueError(
                f"chat_template_kwargs lists {', '.join(reserved)}: arguments of apply_chat_template, "
                "not template variables; a request sets add_generation_prompt as a field of its own"
            )
        return self


class ToolCallingConfig(StrictModel):
    """How the served model is shown tools and how its tool calls are read (serving/api/generation/tool_calls.py)."""

    parser: Literal["hermes", "json"] = Field(
        "hermes",
        description="The model's own tool-call format, parsed when tool_choice is auto: `hermes`, JSON calls "
        "in <tool_call></tool_call> blocks (Hermes, Qwen, SmolLM-style), or `json`, the whole answer a JSON "
        "call {\"name\", \"arguments\"} or a list of them. required and named choices are constrained "
        "decoding and need no parser.",
    )
    prompt: Literal["auto", "template", "kvrelay"] = Field(
        "auto",
        description="Who describes the tools to the model: `template`, the model's chat template (it is "
        "given tools=); `kvrelay`, a system-prompt section written here in the parser's format; `auto`, the "
        "template if it renders tools, else kvrelay's.",
    )
    max_tools: int = Field(128, ge=1, le=4096, description="Tools one request may offer; more: a 400 naming `tools`.")
