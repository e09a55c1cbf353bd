"""The plain-transformers peer server (load_tests/peers/transformers_peer.py) on the tiny model, over real
HTTP: the SSE shape the benchmark client reads, exact token counts per request, greedy output equal
to `model.generate`, static batches with left padding, 400s naming the field, and a disconnect."""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from load_tests.local_ray import free_port
from load_tests.peers.transformers_peer import (
    BatchRunner,
    GenRequest,
    _BatchStreamer,
    _Row,
    build_app,
)

MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def server_url(tiny_model_dir):
    import uvicorn

    # float32: batched (left-padded) and single greedy runs then agree token for token
    app = build_app(tiny_model_dir, "tiny", max_batch_size=4, dtype="float32")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the peer server did not start"
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=20)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """The same weights outside the server, and its tokenizer."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(tiny_model_dir))


def body(max_tokens: int, **extra) -> dict:
    return {"model": "tiny", "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}


async def stream(http: httpx.AsyncClient, request: dict) -> list:
    """The stream's events: parsed JSON chunks, and the string "[DONE]"."""
    events = []
    async with http.stream("POST", "/v1/chat/completions", json=request) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def run_streams(url: str, *requests: dict) -> list[list]:
    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            return await asyncio.gather(*(stream(http, r) for r in requests))

    return asyncio.run(go())


def content(events: list) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e != "[DONE]" and e["choices"])


def prompt_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def greedy_reference(reference, messages, max_new_tokens: int) -> tuple[list[int], str]:
    """`model.generate` greedy on one prompt: the answer's ids (through EOS) and its text."""
    model, tokenizer = reference
    ids = torch.tensor([prompt_ids(tokenizer, messages)])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=2)
    new = out[0, ids.shape[1]:].tolist()
    if 2 in new:  # EOS ends the answer; generate pads after it
        new = new[:new.index(2) + 1]
    return new, tokenizer.decode(new, skip_special_tokens=True)


def test_a_streamed_request_has_the_openai_shape(server_url, reference):
    [events] = run_streams(server_url, body(7, ignore_eos=True))
    role, *middle, finish, usage, done = events
    assert role["object"] == "chat.completion.chunk" and role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert middle and all(e["choices"][0]["delta"]["content"] for e in middle)
    assert finish["choices"] == [{"index": 0, "delta": {}, "finish_reason": "length"}]
    num_prompt_tokens = len(prompt_ids(reference[1], MESSAGES))
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": num_prompt_tokens, "completion_tokens": 7, "total_tokens": num_prompt_tokens + 7}
    assert done == "[DONE]"
    assert len({e["id"] for e in events[:-1]}) == 1


def test_concurrent_requests_each_get_their_own_token_count(server_url):
    short, long = run_streams(server_url, body(3, ignore_eos=True), body(11, ignore_eos=True))
    assert short[-2]["usage"]["completion_tokens"] == 3
    assert long[-2]["usage"]["completion_tokens"] == 11
    assert content(long).startswith(content(short))  # same prompt, greedy


def test_greedy_output_equals_model_generate(server_url, reference):
    [events] = run_streams(server_url, body(12))
    expected_ids, expected_text = greedy_reference(reference, MESSAGES, 12)
    assert events[-2]["usage"]["completion_tokens"] == len(expected_ids)
    assert content(events) == expected_text
    assert events[-3]["choices"][0]["finish_reason"] == ("stop" if expected_ids[-1] == 2 else "length")


def test_non_streamed_answer(server_url, reference):
    response = httpx.post(f"{server_url}/v1/chat/completions", timeout=30,
                          json={"messages": MESSAGES, "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200
    answer = response.json()
    assert answer["object"] == "chat.completion" and answer["model"] == "tiny"
    [choice] = answer["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == greedy_reference(reference, MESSAGES, 5)[1]
    assert answer["usage"]["completion_tokens"] == 5


def test_models_and_health(server_url):
    assert httpx.get(f"{server_url}/health").status_code == 200
    assert [m["id"] for m in httpx.get(f"{server_url}/v1/models").json()["data"]] == ["tiny"]


@pytest.mark.parametrize("request_body, status, param", [
    ({"model": "tiny", "max_tokens": 4}, 400, "messages"),
    ({"messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": MESSAGES, "max_tokens": True}, 400, "max_tokens"),
    ({"messages": MESSAGES, "temperature": -1}, 400, "temperature"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ({"messages": MESSAGES, "max_tokens": 4000}, 400, "max_tokens"),
    ({"model": "other", "messages": MESSAGES}, 404, "model"),
])
def test_bad_requests_name_the_field(server_url, request_body, status, param):
    response = httpx.post(f"{server_url}/v1/chat/completions", json=request_body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and param in error["message"]


def test_a_disconnect_drops_the_output_and_the_server_goes_on(server_url):
    async def go():
        async with httpx.AsyncClient(base_url=server_url, timeout=30) as http:
            async with http.stream("POST", "/v1/chat/completions", json=body(200, ignore_eos=True)) as response:
                async for line in response.aiter_lines():
                    if '"content": "' in line and '"content": ""' not in line:
                        break  # leave after the first token
            return await stream(http, body(4, ignore_eos=True))

    events = asyncio.run(go())
    assert events[-2]["usage"]["completion_tokens"] == 4


def test_one_static_batch_matches_single_runs(reference):
    """Three prompts of different lengths, submitted before the thread starts: one left-padded
    batch; each row stops at its own max_tokens with the text of a single greedy run."""
    model, tokenizer = reference
    prompts = [[{"role": "user", "content": c}] for c in ("Hi", "Tell me about the sea and the sky.", "Why?")]
    max_tokens = [6, 3, 9]
    events: queue.Queue = queue.Queue()
    runner = BatchRunner(model, tokenizer, max_batch_size=4)
    for i, (messages, n) in enumerate(zip(prompts, max_tokens)):
        runner.submit(GenRequest(prompt_ids(tokenizer, messages), n, 0.0, 1.0, False, emit=lambda e, i=i: events.put((i, e))))
    runner.start()
    texts, finals = ["", "", ""], {}
    while len(finals) < 3:
        i, event = events.get(timeout=30)
        assert event.error is None, event.error
        texts[i] += event.text
        if event.finish_reason is not None:
            finals[i] = event
    runner.stop()
    for i, (messages, n) in enumerate(zip(prompts, max_tokens)):
        expected_ids, expected_text = greedy_reference(reference, messages, n)
        assert (texts[i], finals[i].num_completion_tokens) == (expected_text, len(expected_ids))


def test_a_batch_takes_only_requests_with_the_same_sampling():
    class Config:
        eos_token_id, pad_token_id = 2, 2

    class Model:
        generation_config = Config()

    class Tokenizer:
        eos_token_id = pad_token_id = 2

    runner = BatchRunner(Model(), Tokenizer(), max_batch_size=2)
    greedy = [GenRequest([1], 4, 0.0, 0.5, False, print) for _ in range(3)]
    sampled = GenRequest([1], 4, 0.7, 1.0, False, print)
    for request in (greedy[0], sampled, greedy[1], greedy[2]):
        runner.submit(request)
    greedy[1].is_cancelled = True  # left while waiting: never run
    assert runner._take_batch() == [greedy[0], greedy[2]]
    assert runner._take_batch() == [sampled]


@pytest.mark.parametrize("ends_with_eos", [False, True])
def test_incremental_text_holds_back_half_characters(reference, ends_with_eos):
    """Fed one token at a time, the deltas add up to the text and never carry U+FFFD; EOS is
    counted but not shown."""
    _, tokenizer = reference
    text = "Café 🙂 naïve 東京"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    events = []
    max_tokens = len(ids) + 5 if ends_with_eos else len(ids)
    streamer = _BatchStreamer([_Row(GenRequest([1], max_tokens, 0.0, 1.0, False, events.append))], tokenizer, {2})
    streamer.put(torch.tensor([[1]]))  # the prompt
    for token in ids + ([2, 7] if ends_with_eos else []):
        streamer.put(torch.tensor([token]))
    assert "".join(e.text for e in events) == text
    assert all("\ufffd" not in e.text for e in events)
    assert [e.finish_reason for e in events][-1] == ("stop" if ends_with_eos else "length")
    assert events[-1].num_completion_tokens == len(ids) + ends_with_eos
    assert sum(e.finish_reason is not None for e in events) == 1  # nothing after the end
