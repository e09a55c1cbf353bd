"""Scoring prompts over HTTP: completions with echo + logprobs (OpenAI's legacy shape, streamed or
not, max_tokens 0) and vLLM's prompt_logprobs on both endpoints.

Every prompt logprob is checked against a direct full forward of the tiny model in transformers
(fp32, log_softmax of positions 0..n-2 gathered at tokens 1..n-1) to 1e-4; token strings are
the tokenizer's own, written out.
"""

from __future__ import annotations

import functools

import httpx
import openai
import pytest
import torch

from serving.config import ServeConfig
from tests.asgi import local_app, sse_events
from tests.asgi import post as asgi_post

MODEL = "tiny"
FOX = "The quick brown fox"
FOX_IDS = [504, 2365, 6354, 16438]
FOX_TOKENS = ["The", " quick", " brown", " fox"]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def app(engine, tiny_model_dir):
    config = ServeConfig(model=str(tiny_model_dir), served_model_name=MODEL)
    return local_app(engine, config, MODEL)


@pytest.fixture(scope="module")
def tokenizer(engine):
    return engine.tokenizer


@pytest.fixture(scope="module")
def full_forward(tiny_model_dir):
    """prompt ids -> [n - 1, vocab]: log_softmax of the logits of positions 0..n-2 (transformers)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def run(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)

    return run


post = functools.partial(asgi_post, model=MODEL)  # every body names the served model


def sse_data(response: httpx.Response) -> list:
    """The stream's JSON events, after checking it closes with [DONE]."""
    *events, done = sse_events(response)
    assert done == "[DONE]"
    return events


def expected_scores(full_forward, prompt: list[int]) -> list[float]:
    return full_forward(prompt).gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1).tolist()


def top_ids(full_forward, prompt: list[int], k: int) -> list[list[int]]:
    return full_forward(prompt).topk(k, dim=-1).indices.tolist()


@pytest.mark.asyncio
async def test_echo_with_logprobs_scores_the_prompt_then_the_completion(app, tokenizer, full_forward):
    response = await post(app, "/v1/completions", {"prompt": FOX, "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0})
    body = response.json()
    plain = (await post(app, "/v1/completions", {"prompt": FOX, "logprobs": 1, "max_tokens": 3, "temperature": 0})).json()

    assert response.status_code == 200, body
    [choice] = body["choices"]
    generated = plain["choices"][0]["logprobs"]
    lp = choice["logprobs"]
    assert choice["text"] == FOX + plain["choices"][0]["text"]
    assert tokenizer(FOX).input_ids == FOX_IDS
    assert lp["tokens"] == FOX_TOKENS + generated["tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:4] == pytest.approx(expected_scores(full_forward, FOX_IDS), abs=TOLERANCE)
    assert lp["token_logprobs"][4:] == generated["token_logprobs"]
    # each prompt token's entry: itself and the most likely token there (OpenAI: up to logprobs + 1)
    for i, best in enumerate(top_ids(full_forward, FOX_IDS, 1), start=1):
        top = lp["top_logprobs"][i]
        assert set(top) == {FOX_TOKENS[i], tokenizer.decode(best)}
        assert top[FOX_TOKENS[i]] == lp["token_logprobs"][i]
    assert lp["top_logprobs"][4:] == generated["top_logprobs"]
    assert lp["text_offset"] == [0, 3, 9, 15] + [len(FOX) + o for o in generated["text_offset"]]
    assert body["usage"]["prompt_tokens"] == 4 and body["usage"]["completion_tokens"] == 3
    assert "prompt_logprobs" not in choice  # only when asked for


@pytest.mark.asyncio
async def test_max_tokens_0_with_echo_scores_the_prompt_without_generating(app, full_forward):
    response = await post(app, "/v1/completions", {"prompt": FOX, "echo": True, "logprobs": 0, "max_tokens": 0})

    body = response.json()
    assert response.status_code == 200, body
    [choice] = body["choices"]
    assert choice["text"] == FOX and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == FOX_TOKENS
    assert choice["logprobs"]["text_offset"] == [0, 3, 9, 15]
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(expected_scores(full_forward, FOX_IDS), abs=TOLERANCE)
    assert [None if t is None else list(t) for t in choice["logprobs"]["top_logprobs"]] == [None, *([t] for t in FOX_TOKENS[1:])]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 0, "total_tokens": 4, "prompt_tokens_details": {"cached_tokens": 0}}


@pytest.mark.asyncio
@pytest.mark.parametrize("max_tokens", [0, 5])
async def test_a_streamed_echo_adds_up_to_the_whole_response(app, max_tokens):
    body = {"prompt": [FOX, "Hello there"], "echo": True, "logprobs": 2, "max_tokens": max_tokens, "temperature": 0, "n": 2}
    whole = (await post(app, "/v1/completions", body)).json()

    streamed = sse_data(await post(app, "/v1/completions", {**body, "stream": True}))

    assert len(whole["choices"]) == 4
    for choice in whole["choices"]:
        chunks = [c["choices"][0] for c in streamed if c["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in chunks) == choice["text"]
        assert chunks[0]["text"].startswith(FOX if choice["index"] < 2 else "Hello there")
        got = {key: [v for c in chunks if c["logprobs"] for v in c["logprobs"][key]] for key in choice["logprobs"]}
        assert got == choice["logprobs"]
        assert chunks[-1]["finish_reason"] == choice["finish_reason"] == "length"


@pytest.mark.asyncio
async def test_prompt_logprobs_on_a_completion_choice_in_vllms_shape(app, tokenizer, full_forward):
    response = await post(app, "/v1/completions", {"prompt": FOX, "prompt_logprobs": 2, "max_tokens": 2, "temperature": 0})

    body = response.json()
    assert response.status_code == 200, body
    scores = body["choices"][0]["prompt_logprobs"]
    assert scores[0] is None and len(scores) == 4
    expected = expected_scores(full_forward, FOX_IDS)
    reference = full_forward(FOX_IDS)
    for i, (entry, best) in enumerate(zip(scores[1:], top_ids(full_forward, FOX_IDS, 2)), start=1):
        token = str(FOX_IDS[i])
        assert list(entry)[0] == token  # the prompt's token first, then the 2 most likely
        assert list(entry)[1:] == [str(t) for t in best if str(t) != token]
        assert entry[token]["decoded_token"] == FOX_TOKENS[i]
        assert entry[token]["logprob"] == pytest.approx(expected[i - 1], abs=TOLERANCE)
        assert entry[token]["rank"] == int((reference[i - 1] > reference[i - 1, FOX_IDS[i]]).sum()) + 1
        for rank, t in enumerate(best, start=1):
            assert entry[str(t)]["rank"] == rank and entry[str(t)]["decoded_token"] == tokenizer.decode(t)
            assert entry[str(t)]["logprob"] == pytest.approx(float(reference[i - 1, t]), abs=TOLERANCE)
    assert body["choices"][0]["logprobs"] is None  # logprobs were not asked for


@pytest.mark.asyncio
async def test_prompt_logprobs_of_a_chat_are_at_the_response_level(app, tokenizer, full_forward):
    messages = [{"role": "user", "content": "Hi"}]
    ids = tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids

    body = (await post(app, "/v1/chat/completions", {"messages": messages, "prompt_logprobs": 0, "max_tokens": 0})).json()

    assert body["choices"][0]["message"]["content"] == "" and body["choices"][0]["finish_reason"] == "length"
    scores = body["prompt_logprobs"]
    assert len(scores) == len(ids) == body["usage"]["prompt_tokens"] and scores[0] is None
    assert [list(e) for e in scores[1:]] == [[str(t)] for t in ids[1:]]
    got = [e[str(t)]["logprob"] for e, t in zip(scores[1:], ids[1:])]
    assert got == pytest.approx(expected_scores(full_forward, ids), abs=TOLERANCE)
    assert body["usage"]["completion_tokens"] == 0


@pytest.mark.asyncio
async def test_the_openai_sdk_reads_a_scored_prompt(app, full_forward):
    async with openai.AsyncOpenAI(
        base_url="http://test/v1", api_key="unused", max_retries=0,
        http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)),
    ) as api:
        completion = await api.completions.create(model=MODEL, prompt=FOX, echo=True, logprobs=1, max_tokens=0)

    choice = completion.choices[0]
    assert choice.text == FOX and choice.finish_reason == "length"
    assert choice.logprobs.tokens == FOX_TOKENS and choice.logprobs.text_offset == [0, 3, 9, 15]
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected_scores(full_forward, FOX_IDS), abs=TOLERANCE)
    assert completion.usage.completion_tokens == 0
