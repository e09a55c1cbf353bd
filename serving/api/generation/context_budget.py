"""Fitting a prompt into the context window instead of refusing it.

A prompt fits when its tokens plus those reserved for the output are within the context window:

    len(prompt ids) + reserve <= max_model_len       reserve = the request's max_tokens
                                                               (max_completion_tokens, max_output_tokens),
                                                               else api.context_budget.reserve_output_tokens

Two ways to fit one, decided once at the ingress, before the prompt is validated:

`truncation: "auto"` (chat and /v1/responses; the Responses API's field and values, a kvrelay
extension on chat; default `api.context_budget.truncation`) drops whole turns, oldest first. A turn
is a user message and the messages after it up to the next user message (the assistant's reply, its
tool calls and their results), so no reply or tool result is left without what it answered:

    [system] [user assistant] [user assistant tool assistant] [developer] [user assistant tool]
     kept     dropped 1st      dropped 2nd                      kept       the last turn: kept

System and developer messages are kept wherever they are; so is the last turn (the last user
message and everything after it: the tool results of an agent's current step). Context a client
retrieved (RAG) is kept when sent as a system message, and dropped with its turn when sent inside
the history. The fewest oldest turns are dropped: the prompt is rendered again through the chat
template for each candidate (a binary search over how many turns go, all in the request's one
render thread, under `api.render_timeout_s`), so the count is exact for the model's template. If
even the kept messages alone do not fit, the request is refused with a 400 context_length_exceeded
that names both numbers: the tokens needed (kept messages + reserve) and the context window.

`truncate_prompt_tokens: k` (vLLM's; chat and completions) keeps the last k prompt tokens (left
truncation, whatever they hold: the cut may fall inside the system prompt). -1 keeps what fits:
k = max_model_len - reserve. It applies after turns were dropped, and to each prompt of a completion.
The prompt that results is validated as any other (a k that still leaves no room for max_tokens is
the usual 400).

What was dropped is reported whenever a request was fitted (zeros included): the headers
`x-kvrelay-dropped-messages` (chat) and `x-kvrelay-dropped-tokens`, and the same counts as
`dropped_messages` / `dropped_tokens` in `usage.prompt_tokens_details` (/v1/responses:
`usage.input_tokens_details`), next to OpenAI's `cached_tokens`; `prompt_tokens` counts what was
sent to the model. With neither way asked for, nothing changes: a prompt over the window is a 400.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from serving.config import ContextBudgetConfig
from serving.engine.errors import ContextLengthError, InvalidRequestError

__all__ = [
    "DROPPED_MESSAGES_HEADER",
    "DROPPED_TOKENS_HEADER",
    "Budget",
    "Fitted",
    "budget_for",
    "split_turns",
    "fit_chat",
    "fit_prompt",
]

DROPPED_MESSAGES_HEADER = "x-kvrelay-dropped-messages"
DROPPED_TOKENS_HEADER = "x-kvrelay-dropped-tokens"

_KEPT_ROLES = ("system", "developer")


@dataclass(frozen=True)
class Budget:
    """One request's fitting: how many tokens the output needs, and which ways it asked for."""

    max_model_len: int
    reserve_tokens: int
    reserve_source: str  # what set reserve_tokens, named in errors: the max_tokens field or the config key
    drop_turns: bool  # truncation: "auto"
    truncate_prompt_tokens: int | None  # as the request sent it (-1 or >= 1)

    @property
    def is_fitting(self) -> bool:
        return self.drop_turns or self.truncate_prompt_tokens is not None

    def keep_last(self) -> int | None:
        """How many prompt tokens truncate_prompt_tokens keeps; None when not asked."""
        k = self.truncate_prompt_tokens
        if k is None:
            return None
        if k != -1:
            return k
        room = self.max_model_len - self.reserve_tokens
        if room < 1:
            raise ContextLengthError(
                _max_tokens_param(self.reserve_source),
                f"truncate_prompt_tokens -1 keeps what fits beside the {self.reserve_tokens} tokens reserved for "
                f"the output ({self.reserve_source}), but the context window is {self.max_model_len} tokens; "
                f"lower {self.reserve_source}",
                num_tokens=self.reserve_tokens + 1, limit=self.max_model_len,
            )
        return room


@dataclass(frozen=True)
class Fitted:
    """A prompt as it will run, and what fitting it dropped (None: no fitting was asked, so the
    response reports nothing; dropped_messages is None for a completion, which has no messages)."""

    prompt_ids: list[int]
    dropped_messages: int | None = None
    dropped_tokens: int | None = None

    def headers(self) -> dict[str, str]:
        headers = {}
        if self.dropped_messages is not None:
            headers[DROPPED_MESSAGES_HEADER] = str(self.dropped_messages)
        if self.dropped_tokens is not None:
            headers[DROPPED_TOKENS_HEADER] = str(self.dropped_tokens)
        return headers


def budget_for(
    *, truncation: str | None, truncate_prompt_tokens: int | None, max_tokens: int | None, max_tokens_param: str,
    max_model_len: int, config: ContextBudgetConfig,
) -> Budget:
    """The request's budget: `truncation` None takes the config's default (pass "disabled" for an
    endpoint without turns); `max_tokens` None reserves the configured number of tokens."""
    if truncate_prompt_tokens is not None and truncate_prompt_tokens != -1 and truncate_prompt_tokens < 1:
        raise InvalidRequestError(
            "truncate_prompt_tokens",
            f"must be a number of tokens >= 1, or -1 (what fits the context window), got {truncate_prompt_tokens}",
        )
    if max_tokens is not None:
        reserve, source = max_tokens, max_tokens_param
    else:
        reserve, source = config.reserve_output_tokens, "api.context_budget.reserve_output_tokens"
    return Budget(
        max_model_len=max_model_len, reserve_tokens=max(reserve, 1), reserve_source=source,
        drop_turns=(truncation or config.truncation) == "auto", truncate_prompt_tokens=truncate_prompt_tokens,
    )


def split_turns(roles: Sequence[str]) -> tuple[list[list[int]], list[int]]:
    """The droppable turns (message indices, oldest first) and the indices always kept (system and
    developer messages, and the last turn). Messages before the first user message that are not
    system ones form a turn of their own; without a user message nothing is droppable."""
    users = [i for i, role in enumerate(roles) if role == "user"]
    if not users:
        return [], list(range(len(roles)))
    turns: list[list[int]] = []
    current: list[int] = []
    kept: list[int] = []
    for i, role in enumerate(roles):
        if i >= users[-1] or role in _KEPT_ROLES:
            kept.append(i)
            continue
        if role == "user" and current:
            turns.append(current)
            current = []
        current.append(i)
    if current:
        turns.append(current)
    return turns, kept


def fit_chat(budget: Budget, messages: Sequence[Any], encode: Callable[[list[Any]], list[int]]) -> Fitted:
    """The conversation's prompt ids within the budget (`encode` renders messages to ids: the chat
    template and the tokenizer, as the request asked). Runs in the request's render thread."""
    full = encode(list(messages))
    if not budget.drop_turns:
        return _then_truncate(budget, full, full, dropped_messages=0)
    if _fits(budget, full):
        return _then_truncate(budget, full, full, dropped_messages=0)
    turns, _ = split_turns([m.role for m in messages])

    def without(num_turns: int) -> list[int]:
        gone = {i for turn in turns[:num_turns] for i in turn}
        return encode([m for i, m in enumerate(messages) if i not in gone])

    rendered: dict[int, list[int]] = {0: full}
    least = without(len(turns)) if turns else full
    rendered[len(turns)] = least
    if not _fits(budget, least):
        needed = len(least) + budget.reserve_tokens
        raise ContextLengthError(
            "messages",
            f"the system/developer messages and the last turn alone take {len(least)} tokens and "
            f"{budget.reserve_tokens} are reserved for the output ({budget.reserve_source}): {needed} tokens "
            f"needed, but the context window is {budget.max_model_len} tokens (shorten them or lower "
            f"{budget.reserve_source})",
            num_tokens=needed, limit=budget.max_model_len,
        )
    low, high = 0, len(turns)  # low does not fit, high does: the fewest turns to drop is in (low, high]
    while high - low > 1:
        middle = (low + high) // 2
        rendered[middle] = without(middle)
        if _fits(budget, rendered[middle]):
            high = middle
        else:
            low = middle
    num_dropped = sum(len(turn) for turn in turns[:high])
    return _then_truncate(budget, full, rendered[high], dropped_messages=num_dropped)


def fit_prompt(budget: Budget, prompt_ids: list[int]) -> Fitted:
    """A completion's prompt with truncate_prompt_tokens applied (it has no turns to drop)."""
    return _then_truncate(budget, prompt_ids, prompt_ids, dropped_messages=None)


def _then_truncate(budget: Budget, full: list[int], ids: list[int], *, dropped_messages: int | None) -> Fitted:
    keep = budget.keep_last()
    if keep is not None and len(ids) > keep:
        ids = ids[len(ids) - keep:]
    if not budget.is_fitting:
        return Fitted(ids)
    return Fitted(ids, dropped_messages=dropped_messages, dropped_tokens=len(full) - len(ids))


def _fits(budget: Budget, ids: list[int]) -> bool:
    return len(ids) + budget.reserve_tokens <= budget.max_model_len


def _max_tokens_param(source: str) -> str:
    return source if source in ("max_tokens", "max_completion_tokens", "max_output_tokens") else "truncate_prompt_tokens"
