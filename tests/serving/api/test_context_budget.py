"""Fitting prompts into the context window (serving/api/generation/context_budget.py): which turns go, the
tokens kept, and what the response says was dropped; over HTTP against a tiny model whose context
window is 128 tokens."""

from __future__ import annotations

import functools
import json

import pytest

from serving.api.endpoints.routes import OpenAIServer
from serving.api.generation.context_budget import budget_for, fit_chat, split_turns
from serving.api.generation.pipeline import Frontend
from serving.config import ContextBudgetConfig, ServeConfig
from serving.deployments.local_backend import LocalBackend
from serving.engine import SamplingParams
from serving.engine.contract import EngineRequest
from serving.engine.errors import ContextLengthError, InvalidRequestError
from serving.engine.outputs import merge_outputs
from tests.asgi import post as asgi_post
from tests.helpers import tiny_async_engine

MODEL = "tiny"
WINDOW = 128

SYSTEM = {"role": "system", "content": "Be brief."}
LAST = {"role": "user", "content": "And now?"}


def turn(k: int) -> list[dict]:
    return [{"role": "user", "content": f"question {k} " + "word " * 8}, {"role": "assistant", "content": f"answer {k} " + "word " * 8}]


# Four turns of 35 tokens between a system prompt and the last question (20 tokens): 160 rendered.
HISTORY = [SYSTEM, *turn(1), *turn(2), *turn(3), *turn(4), LAST]


class Stack:
    def __init__(self, model_dir):
        self.engine = tiny_async_engine(model_dir, max_model_len=WINDOW)
        self.tokenizer = self.engine.tokenizer
        self.frontend = Frontend(self.tokenizer, LocalBackend(self.engine), MODEL)
        self.config = ServeConfig(model=str(model_dir), served_model_name=MODEL)

    def app(self, **budget):
        config = self.config.model_copy(update={"api": self.config.api.model_copy(update={"context_budget": ContextBudgetConfig(**budget)})})
        return OpenAIServer(self.frontend, config).build_app()

    def ids(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    async def greedy(self, prompt_ids: list[int], max_tokens: int) -> str:
        merged = None
        async for out in self.engine.generate(EngineRequest(f"ref-{len(prompt_ids)}-{max_tokens}-{prompt_ids[-1]}", prompt_token_ids=prompt_ids,
                                                            params=SamplingParams(temperature=0.0, max_tokens=max_tokens))):
            merged = merge_outputs(merged, out)
        return merged.outputs[0].text


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    stack = Stack(tiny_model_dir)
    yield stack
    stack.engine.shutdown()


post = functools.partial(asgi_post, model=MODEL)  # every body names the served model


# ---- turns, without a model ------------------------------------------------------------------
def test_a_turn_is_a_user_message_and_the_replies_after_it_and_the_last_turn_is_kept():
    roles = ["system", "assistant", "user", "assistant", "tool", "assistant", "developer", "user", "assistant", "user", "assistant", "tool"]
    turns, kept = split_turns(roles)
    assert turns == [[1], [2, 3, 4, 5], [7, 8]]
    assert kept == [0, 6, 9, 10, 11]
    assert split_turns(["system", "assistant"]) == ([], [0, 1])  # no user message: nothing to drop


def words_encode(messages) -> list[int]:
    """A stand-in for the template: a token per word, two per message."""
    return [0 for m in messages for _ in range(len(m.content.split()) + 2)]


class Message:
    def __init__(self, role: str, words: int):
        self.role, self.content = role, "w " * words


def test_the_fewest_oldest_turns_are_dropped_and_the_counts_are_exact():
    messages = [Message("system", 3), Message("user", 8), Message("assistant", 8), Message("user", 8), Message("assistant", 8),
                Message("user", 8), Message("assistant", 8), Message("user", 3)]
    # 5 + 3 x (10 + 10) + 5 = 70 tokens; 40 tokens of room for the prompt: two turns must go.
    budget = budget_for(truncation="auto", truncate_prompt_tokens=None, max_tokens=10, max_tokens_param="max_tokens",
                        max_model_len=50, config=ContextBudgetConfig())
    fitted = fit_chat(budget, messages, words_encode)
    assert (len(fitted.prompt_ids), fitted.dropped_messages, fitted.dropped_tokens) == (30, 4, 40)


def test_when_even_the_kept_messages_do_not_fit_the_error_names_both_numbers():
    messages = [Message("system", 30), Message("user", 8), Message("assistant", 8), Message("user", 10)]
    budget = budget_for(truncation="auto", truncate_prompt_tokens=None, max_tokens=None, max_tokens_param="max_tokens",
                        max_model_len=50, config=ContextBudgetConfig(reserve_output_tokens=16))
    with pytest.raises(ContextLengthError) as refused:
        fit_chat(budget, messages, words_encode)
    # kept: the system message (32 tokens) and the last turn (12)
    assert (refused.value.param, refused.value.num_tokens, refused.value.limit) == ("messages", 44 + 16, 50)
    assert refused.value.message == (
        "the system/developer messages and the last turn alone take 44 tokens and 16 are reserved for the output "
        "(api.context_budget.reserve_output_tokens): 60 tokens needed, but the context window is 50 tokens (shorten "
        "them or lower api.context_budget.reserve_output_tokens)"
    )


def test_truncate_prompt_tokens_must_be_positive_or_minus_one():
    with pytest.raises(InvalidRequestError) as refused:
        budget_for(truncation=None, truncate_prompt_tokens=0, max_tokens=None, max_tokens_param="max_tokens",
                   max_model_len=50, config=ContextBudgetConfig())
    assert refused.value.param == "truncate_prompt_tokens"


# ---- over HTTP -------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_chat_over_the_window_is_refused_when_truncation_is_off(stack):
    assert len(stack.ids(HISTORY)) == 160
    response = await post(stack.app(), "/v1/chat/completions", {"messages": HISTORY, "max_tokens": 4})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert "x-kvrelay-dropped-messages" not in response.headers


@pytest.mark.asyncio
async def test_truncation_auto_drops_the_oldest_turns_and_says_so(stack):
    kept = [SYSTEM, *turn(3), *turn(4), LAST]  # 160 + 20 > 128; without turn 1: 125 + 20 > 128; without 2: 90 + 20 fits
    expected_ids = stack.ids(kept)
    assert len(expected_ids) == 90
    expected_text = await stack.greedy(expected_ids, 20)

    response = await post(stack.app(), "/v1/chat/completions", {"messages": HISTORY, "max_tokens": 20, "temperature": 0, "truncation": "auto"})

    assert response.status_code == 200, response.text
    assert response.headers["x-kvrelay-dropped-messages"] == "4"
    assert response.headers["x-kvrelay-dropped-tokens"] == "70"
    body = response.json()
    assert body["choices"][0]["message"]["content"] == expected_text
    assert body["usage"] == {
        "prompt_tokens": 90, "completion_tokens": 20, "total_tokens": 110,
        "prompt_tokens_details": {"cached_tokens": 0, "dropped_messages": 4, "dropped_tokens": 70},
    }


@pytest.mark.asyncio
async def test_the_servers_default_truncation_and_reserve_apply_and_a_request_may_opt_out(stack):
    app = stack.app(truncation="auto", reserve_output_tokens=60)
    # No max_tokens: 60 reserved, so 68 tokens of prompt at most: turns 1 to 3 go (90 left with two, 55 with one).
    fitted = await post(app, "/v1/chat/completions", {"messages": HISTORY, "max_tokens": None, "temperature": 0})
    refused = await post(app, "/v1/chat/completions", {"messages": HISTORY, "max_tokens": 4, "truncation": "disabled"})

    assert fitted.status_code == 200, fitted.text
    assert fitted.json()["usage"]["prompt_tokens"] == len(stack.ids([SYSTEM, *turn(4), LAST])) == 55
    assert fitted.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "dropped_messages": 6, "dropped_tokens": 105}
    assert fitted.json()["usage"]["completion_tokens"] == WINDOW - 55  # max_tokens resolved to the room left
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.asyncio
async def test_a_prompt_that_fits_is_sent_whole_and_reports_nothing_dropped(stack):
    response = await post(stack.app(), "/v1/chat/completions", {"messages": [SYSTEM, LAST], "max_tokens": 2, "truncation": "auto"})
    assert response.status_code == 200
    assert (response.headers["x-kvrelay-dropped-messages"], response.headers["x-kvrelay-dropped-tokens"]) == ("0", "0")
    assert response.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "dropped_messages": 0, "dropped_tokens": 0}


@pytest.mark.asyncio
async def test_the_400_names_the_tokens_needed_and_the_window_when_the_kept_messages_do_not_fit(stack):
    kept = [SYSTEM, LAST]
    response = await post(stack.app(), "/v1/chat/completions", {"messages": HISTORY, "max_tokens": 120, "truncation": "auto"})

    assert response.status_code == 400
    needed = len(stack.ids(kept)) + 120
    assert response.json()["error"] == {
        "message": f"the system/developer messages and the last turn alone take {needed - 120} tokens and 120 are reserved "
        f"for the output (max_tokens): {needed} tokens needed, but the context window is {WINDOW} tokens (shorten "
        "them or lower max_tokens)",
        "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded",
    }


@pytest.mark.asyncio
async def test_truncate_prompt_tokens_keeps_the_last_tokens_of_a_chat(stack):
    full = stack.ids(HISTORY)
    expected_text = await stack.greedy(full[-50:], 8)

    response = await post(stack.app(), "/v1/chat/completions", {"messages": HISTORY, "max_tokens": 8, "temperature": 0, "truncate_prompt_tokens": 50})

    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == expected_text
    assert response.json()["usage"]["prompt_tokens"] == 50
    assert response.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "dropped_messages": 0, "dropped_tokens": 110}
    assert response.headers["x-kvrelay-dropped-tokens"] == "110"


@pytest.mark.asyncio
async def test_truncate_prompt_tokens_on_completions_per_prompt_and_minus_one_fills_the_window(stack):
    long = " ".join(f"w{i}" for i in range(100))
    ids = stack.tokenizer(long).input_ids
    assert len(ids) > 120
    expected = [await stack.greedy(ids[-40:], 3), await stack.greedy(ids[-(WINDOW - 3):], 3)]

    by_count = await post(stack.app(), "/v1/completions", {"prompt": long, "max_tokens": 3, "temperature": 0, "truncate_prompt_tokens": 40})
    minus_one = await post(stack.app(), "/v1/completions", {"prompt": [ids, ids[:10]], "max_tokens": 3, "temperature": 0, "truncate_prompt_tokens": -1})
    zero = await post(stack.app(), "/v1/completions", {"prompt": long, "max_tokens": 3, "truncate_prompt_tokens": 0})

    assert by_count.status_code == 200, by_count.text
    assert by_count.json()["choices"][0]["text"] == expected[0]
    assert by_count.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "dropped_tokens": len(ids) - 40}
    assert by_count.headers["x-kvrelay-dropped-tokens"] == str(len(ids) - 40)
    assert minus_one.status_code == 200, minus_one.text
    assert minus_one.json()["choices"][0]["text"] == expected[1]
    assert minus_one.json()["usage"]["prompt_tokens"] == (WINDOW - 3) + 10
    assert minus_one.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "dropped_tokens": len(ids) - (WINDOW - 3)}
    assert zero.status_code == 400 and zero.json()["error"]["param"] == "truncate_prompt_tokens"


@pytest.mark.asyncio
async def test_a_streamed_chat_says_what_was_dropped_in_its_headers_and_usage_chunk(stack):
    response = await post(stack.app(truncation="auto"), "/v1/chat/completions", {
        "messages": HISTORY, "max_tokens": 20, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
    })

    assert response.status_code == 200, response.text
    assert (response.headers["x-kvrelay-dropped-messages"], response.headers["x-kvrelay-dropped-tokens"]) == ("4", "70")
    last = json.loads(response.text.split("\n\n")[-3].removeprefix("data: "))
    assert last["usage"]["prompt_tokens"] == 90
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "dropped_messages": 4, "dropped_tokens": 70}


@pytest.mark.asyncio
async def test_an_echoed_prompt_is_the_part_the_model_was_given(stack):
    long = " ".join(f"w{i}" for i in range(100))
    ids = stack.tokenizer(long).input_ids

    response = await post(stack.app(), "/v1/completions", {"prompt": long, "max_tokens": 1, "temperature": 0, "echo": True, "truncate_prompt_tokens": 40})

    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"].startswith(stack.tokenizer.decode(ids[-40:]))
    assert not response.json()["choices"][0]["text"].startswith(long[:10])
