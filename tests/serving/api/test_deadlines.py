"""Deadlines and queue limits over HTTP (serving/api/admission/deadlines.py): a request out of time is
aborted on the engine (its blocks come back), answers 408 with what it got, or ends its stream
with a `timeout` error event; a request an engine's queue held past max_queue_wait_s gets 503.

Expiry is certain, never raced: the backend stalls for good (on an Event nobody sets) with the
engine's request still open, and the server's clock is moved by hand to just before the deadline
as the backend stalls, so every earlier wait had all the time it could want and the last one
has 10 ms.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

import httpx
import pytest

from serving.api.admission.deadlines import timeout_for
from serving.api.endpoints.routes import OpenAIServer
from serving.api.generation.pipeline import Frontend
from serving.cli.status import parse_metrics
from serving.config import ServeConfig
from serving.deployments.local_backend import LocalBackend
from serving.engine import EngineConfig, SamplingParams
from serving.engine.async_engine import AsyncEngine
from serving.engine.contract import EngineRequest
from serving.engine.outputs import merge_outputs
from serving.engine.sampling.detokenizer import IncrementalDetokenizer
from tests.asgi import post as asgi_post
from tests.asgi import sse_events
from tests.helpers import VirtualClock, single_tokens

MODEL = "tiny"
TEN = list(range(100, 110))  # a prompt of exactly 10 tokens
MAX_TOKENS = 1500  # far more than a stalled request could generate before it is aborted
LONG = {"model": MODEL, "prompt": TEN, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": MAX_TOKENS,
        "temperature": 0, "ignore_eos": True}
GOLD, FREE = "sk-gold-0123456789ab", "sk-free-0123456789ab"


class Stalls(LocalBackend):
    """The engine's tokens, one per output, until `count` have been delivered; then a wait that
    never ends, with the engine's request still open (it keeps generating and holding blocks
    until the stream is closed). `before_stall()` runs just before the last token is delivered."""

    def __init__(self, engine, count: int, before_stall=lambda: None):
        super().__init__(engine)
        self.count = count
        self.before_stall = before_stall
        self.sent: list[int] = []

    async def generate(self, request):
        async with aclosing(super().generate(request)) as outputs:
            async for out in outputs:
                for one in single_tokens(out):
                    if len(self.sent) == self.count:
                        break
                    if len(self.sent) + 1 == self.count:
                        self.before_stall()
                    self.sent += one.outputs[0].token_ids
                    yield one
                if len(self.sent) == self.count:
                    await asyncio.Event().wait()


def server(engine, tiny_model_dir, backend, **config) -> tuple[OpenAIServer, VirtualClock]:
    cfg = ServeConfig.model_validate({"model": str(tiny_model_dir), "served_model_name": MODEL, **config})
    # One token per SSE event, however busy the machine: the stream tests count events per token
    # (with merging, tokens that arrive while the ingress is busy share one event).
    srv = OpenAIServer(Frontend(engine.tokenizer, backend, MODEL, max_merged_tokens=1), cfg)
    clock = VirtualClock()
    srv.clock = clock
    return srv, clock


def jump_to_10_ms_before(clock: VirtualClock, timeout_s: float):
    """A before_stall that leaves the request's last wait 10 ms (it was received at 1000.0)."""
    def jump():
        clock.now = 1000.0 + timeout_s - 0.01
    return jump


async def post(app, path: str, body: dict, key: str | None = None) -> httpx.Response:
    # A guard, not a measurement: a request whose deadline is not enforced would stall for good.
    return await asyncio.wait_for(asgi_post(app, path, body, key=key), 120)


async def get(app, path: str) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        return await client.get(path)


sse_data = sse_events


async def requests_by_status(app) -> dict[str, float]:
    samples = parse_metrics((await get(app, "/metrics")).text)
    return {labels["status"]: value for name, labels, value in samples if name == "kvrelay_requests_total" and value}


async def idle(engine: AsyncEngine, num_free_blocks: int, timeout_s: float = 10.0):
    """The engine's stats once nothing runs and `num_free_blocks` are free (or the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.stats()
        if (stats.num_running == 0 and stats.num_free_blocks == num_free_blocks) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.01)


def shown(tokenizer, token_ids: list[int]) -> str:
    """The text the ingress shows for these tokens of an unfinished choice (no final flush)."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    return "".join(detok.step([t]) for t in token_ids)


def timeout_error(timeout_s: str) -> dict:
    return {"message": f"The request did not finish within its timeout of {timeout_s} s.", "type": "timeout", "param": None, "code": "timeout"}


# ---- the timeout a request gets ----------------------------------------------------------------
def test_a_request_s_timeout_is_its_own_bounded_by_its_tier_else_the_server_default_capped_by_the_tier():
    assert timeout_for(None, default_s=600, tier="t", tier_max_s=None) == 600
    assert timeout_for(None, default_s=600, tier="t", tier_max_s=30) == 30  # the tier caps the default
    assert timeout_for(None, default_s=600, tier="t", tier_max_s=900) == 600
    assert timeout_for(None, default_s=None, tier="t", tier_max_s=30) == 30
    assert timeout_for(None, default_s=None, tier="t", tier_max_s=None) is None
    assert timeout_for(5, default_s=600, tier="t", tier_max_s=None) == 5
    assert timeout_for(900, default_s=600, tier="t", tier_max_s=900) == 900  # a tier may grant more than the default
    assert timeout_for(10**6, default_s=None, tier="t", tier_max_s=None) == 10**6


@pytest.mark.asyncio
async def test_a_timeout_over_the_tier_s_limit_or_the_server_s_is_a_400_naming_it(engine, tiny_model_dir):
    srv, _ = server(
        engine, tiny_model_dir, LocalBackend(engine), request_timeout_s=600,
        tiers={"free": {"max_timeout_s": 5}, "gold": {"max_timeout_s": 900}},
        api_keys=[{"key": GOLD, "name": "gold-team", "tier": "gold"}, {"key": FREE, "name": "free-team", "tier": "free"},
                  {"key": "sk-plain-0123456789ab", "name": "plain"}],
    )
    app = srv.build_app()
    short = {**LONG, "max_tokens": 2}
    free = await post(app, "/v1/completions", {**short, "timeout": 10}, FREE)
    plain = await post(app, "/v1/chat/completions", {**CHAT, "max_tokens": 2, "timeout": 601}, "sk-plain-0123456789ab")
    zero = await post(app, "/v1/completions", {**short, "timeout": 0}, GOLD)
    gold = await post(app, "/v1/completions", {**short, "timeout": 900}, GOLD)
    free_ok = await post(app, "/v1/completions", {**short, "timeout": 5}, FREE)
    assert (free.status_code, free.json()) == (400, {"error": {
        "message": "timeout = 10 s is longer than the key's tier 'free' allows (max_timeout_s = 5 s); send 5 or less, or leave it out",
        "type": "invalid_request_error", "param": "timeout", "code": "timeout_not_allowed",
    }})
    assert (plain.status_code, plain.json()) == (400, {"error": {
        "message": "timeout = 601 s is longer than this server allows (request_timeout_s = 600 s); send 600 or less, or leave it out",
        "type": "invalid_request_error", "param": "timeout", "code": "timeout_not_allowed",
    }})
    assert (zero.status_code, zero.json()["error"]["param"], zero.json()["error"]["code"]) == (400, "timeout", "invalid_value")
    assert gold.status_code == free_ok.status_code == 200


# ---- a request out of time ---------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_non_streamed_request_out_of_time_is_aborted_and_answers_408_with_its_partial_output(engine, tiny_model_dir):
    baseline = (await idle(engine, engine.stats().num_blocks)).num_free_blocks
    before = engine.stats()
    seen = {}

    def stall_soon():
        seen["in_use"] = engine.stats()
        jump()

    backend = Stalls(engine, 3, stall_soon)
    srv, clock = server(engine, tiny_model_dir, backend)
    jump = jump_to_10_ms_before(clock, 30)
    app = srv.build_app()

    response = await post(app, "/v1/completions", {**LONG, "timeout": 30})

    stats = await idle(engine, baseline)
    assert response.status_code == 408
    body = response.json()
    assert body == {
        "error": timeout_error("30"),
        "partial": {
            "id": body["partial"]["id"], "object": "text_completion", "created": body["partial"]["created"],
            "model": MODEL, "system_fingerprint": None,
            "choices": [{"index": 0, "text": shown(engine.tokenizer, backend.sent), "logprobs": None, "finish_reason": None}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13, "prompt_tokens_details": {"cached_tokens": 0}},
        },
    }
    assert len(backend.sent) == 3
    # It ran until the deadline, then it was aborted and every block came back.
    assert seen["in_use"].num_running == 1 and seen["in_use"].num_free_blocks < baseline
    assert stats.num_running == 0 and stats.num_free_blocks == baseline
    assert stats.num_generated_tokens - before.num_generated_tokens < MAX_TOKENS
    # Billed for what it got; counted as a 408.
    totals = srv.usage.totals("anonymous")
    assert (totals.num_requests, totals.prompt_tokens, totals.completion_tokens) == (1, 10, 3)
    assert await requests_by_status(app) == {"408": 1.0}


@pytest.mark.asyncio
async def test_a_stream_out_of_time_ends_with_the_text_so_far_a_timeout_event_and_done(engine, tiny_model_dir):
    baseline = (await idle(engine, engine.stats().num_blocks)).num_free_blocks
    backend = Stalls(engine, 3, lambda: jump())
    srv, clock = server(engine, tiny_model_dir, backend)
    jump = jump_to_10_ms_before(clock, 30)
    app = srv.build_app()

    response = await post(app, "/v1/chat/completions", {**CHAT, "timeout": 30, "stream": True, "logprobs": True,
                                                         "stream_options": {"include_usage": True}})

    stats = await idle(engine, baseline)
    assert response.status_code == 200
    events = sse_data(response)
    assert events[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
    tokens = events[1:4]  # one chunk per token (each has its logprob), none finished
    assert [[e["token"] for e in c["choices"][0]["logprobs"]["content"]] for c in tokens] == [[engine.tokenizer.decode([t])] for t in backend.sent]
    assert all(c["choices"][0]["finish_reason"] is None for c in tokens)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in tokens) == shown(engine.tokenizer, backend.sent)
    assert events[4:] == [{"error": timeout_error("30")}, "[DONE]"]  # no usage chunk: it did not end
    assert stats.num_running == 0 and stats.num_free_blocks == baseline
    totals = srv.usage.totals("anonymous")
    assert (totals.num_requests, totals.completion_tokens) == (1, 3)
    assert await requests_by_status(app) == {"408": 1.0}


@pytest.mark.asyncio
@pytest.mark.parametrize("path, body", [("/v1/completions", LONG), ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_out_of_time_before_its_first_token_is_a_408_and_not_billed(engine, tiny_model_dir, path, body, stream):
    """The backend stalls before its first token (with the engine's request open): nothing was
    sent, so a stream answers 408 too."""
    baseline = (await idle(engine, engine.stats().num_blocks)).num_free_blocks
    srv, _ = server(engine, tiny_model_dir, Stalls(engine, 0))
    srv.clock = time.monotonic
    app = srv.build_app()

    response = await post(app, path, {**body, "timeout": 0.01, "stream": stream})

    stats = await idle(engine, baseline)
    assert (response.status_code, response.json()) == (408, {"error": timeout_error("0.01")})
    assert stats.num_running == 0 and stats.num_free_blocks == baseline
    assert srv.usage.totals("anonymous").num_requests == 0
    assert await requests_by_status(app) == {"408": 1.0}


@pytest.mark.asyncio
async def test_the_server_default_applies_without_a_timeout_and_a_request_in_time_is_untouched(engine, tiny_model_dir):
    backend = Stalls(engine, 2, lambda: jump())
    srv, clock = server(engine, tiny_model_dir, backend, request_timeout_s=45)
    jump = jump_to_10_ms_before(clock, 45)
    app = srv.build_app()
    late = await post(app, "/v1/completions", LONG)
    assert (late.status_code, late.json()["error"]) == (408, timeout_error("45"))
    assert late.json()["partial"]["usage"]["completion_tokens"] == 2

    srv, _ = server(engine, tiny_model_dir, LocalBackend(engine), request_timeout_s=None)
    expected = None
    async for out in engine.generate(EngineRequest("reference", prompt_token_ids=TEN, params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))):
        expected = merge_outputs(expected, out)
    in_time = await post(srv.build_app(), "/v1/completions", {**LONG, "max_tokens": 8, "timeout": 600})
    assert in_time.status_code == 200
    assert in_time.json()["choices"][0]["text"] == expected.outputs[0].text


# ---- max_queue_wait_s --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_engine(tiny_model_dir):
    """12 blocks of 16 tokens; a held export of 160 tokens pins 10 of them, so a 50-token prompt
    (4 blocks) waits in the queue until the export is released: past its 50 ms, for certain."""
    engine = AsyncEngine(EngineConfig(
        model=str(tiny_model_dir), dtype="float32", kv_cache_bytes=12 * 16 * 512, enable_prefix_caching=False,
        num_threads=1, max_queue_wait_s=0.05,
    ))
    yield engine
    engine.shutdown()


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_held_in_an_engine_queue_past_max_queue_wait_s_gets_503_with_retry_after(small_engine, tiny_model_dir, stream):
    srv, _ = server(small_engine, tiny_model_dir, LocalBackend(small_engine))
    app = srv.build_app()
    hold = SamplingParams(temperature=0.0, max_tokens=1)
    async for _ in small_engine.generate(EngineRequest("held", params=hold, prompt_token_ids=list(range(10, 170)), hold_kv=True)):
        pass
    try:
        response = await post(app, "/v1/completions", {"model": MODEL, "prompt": list(range(200, 250)), "max_tokens": 4, "stream": stream})
    finally:
        assert await small_engine.release_kv("held")

    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert response.json() == {"error": {
        "message": "The request waited longer than the engine's queue limit (max_queue_wait_s) without starting; "
        f"the pool is overloaded. Retry after 1 s. (request id: {response.headers['x-request-id']})",
        "type": "service_unavailable_error", "param": None, "code": "queue_timeout",
    }}
    assert srv.usage.totals("anonymous").num_requests == 0
    assert await requests_by_status(app) == {"503": 1.0}
    stats = small_engine.stats()
    assert stats.num_waiting == 0 and stats.num_free_blocks == stats.num_blocks
