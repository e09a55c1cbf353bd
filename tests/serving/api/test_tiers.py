"""A key's tier over HTTP: exact 429s with Retry-After and x-ratelimit-* headers, tokens given
back when a request ends, priorities clamped or refused, and models the tier may not use."""

from __future__ import annotations

import httpx
import pytest

from serving.api.admission.rate_limits import LimitsExchange
from serving.api.endpoints.routes import OpenAIServer
from serving.api.generation.pipeline import Frontend
from serving.config import ServeConfig
from serving.deployments.limits_sync import LimitsSync
from serving.deployments.local_backend import LocalBackend
from tests.helpers import VirtualClock

MODEL = "tiny"
TEN = list(range(100, 110))  # a prompt of exactly 10 tokens
REQUEST = {"model": MODEL, "prompt": TEN, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
GOLD, FREE = "sk-gold-0123456789ab", "sk-free-0123456789ab"


class RecordingBackend(LocalBackend):
    """The engine, noting the priority each request reached it with."""

    def __init__(self, engine):
        super().__init__(engine)
        self.priorities: list[int] = []

    def generate(self, request):
        self.priorities.append(request.priority)
        return super().generate(request)


def server(engine, tiny_model_dir, tiers: dict) -> tuple[OpenAIServer, RecordingBackend, VirtualClock]:
    cfg = ServeConfig(
        model=str(tiny_model_dir), served_model_name=MODEL, tiers=tiers,
        api_keys=[{"key": GOLD, "name": "gold-team", "tier": "gold"}, {"key": FREE, "name": "free-team", "tier": "free"}],
    )
    backend = RecordingBackend(engine)
    srv = OpenAIServer(Frontend(engine.tokenizer, backend, MODEL), cfg)
    clock = VirtualClock(500.0)
    srv.limiter.clock = clock
    return srv, backend, clock


async def call(app, path: str, body: dict | None, key: str) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        if body is None:
            return await client.get(path, headers={"authorization": f"Bearer {key}"})
        return await client.post(path, json=body, headers={"authorization": f"Bearer {key}"})


@pytest.mark.asyncio
async def test_requests_over_the_tier_s_rate_get_429_with_retry_after_and_openai_headers(engine, tiny_model_dir):
    srv, backend, clock = server(engine, tiny_model_dir, {"free": {"requests_per_minute": 2}, "gold": {}})
    app = srv.build_app()
    first = await call(app, "/v1/completions", REQUEST, FREE)
    second = await call(app, "/v1/completions", {**REQUEST, "stream": True}, FREE)
    third = await call(app, "/v1/completions", REQUEST, FREE)
    assert [r.status_code for r in (first, second, third)] == [200, 200, 429]
    assert [r.headers["x-ratelimit-remaining-requests"] for r in (first, second, third)] == ["1", "0", "0"]
    assert third.headers["retry-after"] == "30"  # one request of room every 60 / 2 s
    assert third.headers["x-ratelimit-limit-requests"] == "2" and third.headers["x-ratelimit-reset-requests"] == "1m0s"
    assert third.json() == {"error": {
        "message": "rate limit of 2 requests per minute reached for the key 'free-team' (tier 'free'); retry in 30 s",
        "type": "requests", "param": None, "code": "rate_limit_exceeded",
    }}
    assert len(backend.priorities) == 2  # the refused one never reached the engine
    # Another key's tier is its own.
    gold = await call(app, "/v1/completions", REQUEST, GOLD)
    assert gold.status_code == 200 and "x-ratelimit-limit-requests" not in gold.headers
    clock.now += 30
    assert (await call(app, "/v1/completions", REQUEST, FREE)).status_code == 200


@pytest.mark.asyncio
async def test_tokens_are_reserved_as_prompt_plus_max_tokens_and_unused_ones_come_back(engine, tiny_model_dir):
    srv, _, _ = server(engine, tiny_model_dir, {"free": {"tokens_per_minute": 100}, "gold": {}})
    app = srv.build_app()
    # 10 prompt tokens + 4 generated: 14 taken; a 2-prompt request with n=2: 2 x (10 + 2 x 4) = 36.
    one = await call(app, "/v1/completions", REQUEST, FREE)
    assert one.headers["x-ratelimit-remaining-tokens"] == "86"
    two = await call(app, "/v1/completions", {**REQUEST, "prompt": [TEN, TEN], "n": 2}, FREE)
    assert two.headers["x-ratelimit-remaining-tokens"] == "50"
    # A stop string ends it early: 10 + 30 reserved, what it did not use comes back.
    text = (await call(app, "/v1/completions", {**REQUEST, "max_tokens": 1}, GOLD)).json()["choices"][0]["text"]
    stop = await call(app, "/v1/completions", {**REQUEST, "max_tokens": 30, "stop": [text]}, FREE)
    assert (stop.status_code, stop.json()["choices"][0]["finish_reason"]) == (200, "stop")
    used = stop.json()["usage"]["total_tokens"]
    assert used < 40
    assert stop.headers["x-ratelimit-remaining-tokens"] == str(50 - used)
    too_big = await call(app, "/v1/completions", {**REQUEST, "max_tokens": 95}, FREE)
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "max_tokens"
    assert "needs 105 tokens" in too_big.json()["error"]["message"]


@pytest.mark.asyncio
async def test_concurrency_is_released_by_every_way_a_request_ends(engine, tiny_model_dir):
    srv, _, _ = server(engine, tiny_model_dir, {"free": {"max_concurrent_requests": 1}, "gold": {}})
    app = srv.build_app()
    statuses = [
        (await call(app, "/v1/completions", REQUEST, FREE)).status_code,
        (await call(app, "/v1/completions", {**REQUEST, "stream": True}, FREE)).status_code,
        (await call(app, "/v1/completions", {**REQUEST, "max_tokens": 10**6}, FREE)).status_code,  # refused by validation
        (await call(app, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, FREE)).status_code,
    ]
    assert statuses == [200, 200, 400, 200]
    assert srv.limiter.report().in_flight == {}


@pytest.mark.asyncio
async def test_priority_is_clamped_to_the_tier_visibly_and_defaults_to_the_tier_s(engine, tiny_model_dir):
    tiers = {"gold": {"priority": 0, "highest_priority": -5}, "free": {"priority": 10, "highest_priority": 5}}
    srv, backend, _ = server(engine, tiny_model_dir, tiers)
    app = srv.build_app()
    answers = [
        await call(app, "/v1/completions", {**REQUEST, "priority": -100}, GOLD),
        await call(app, "/v1/completions", {**REQUEST, "priority": -3}, GOLD),
        await call(app, "/v1/completions", REQUEST, FREE),
        await call(app, "/v1/completions", {**REQUEST, "priority": 0, "stream": True}, FREE),
    ]
    assert [a.status_code for a in answers] == [200, 200, 200, 200]
    assert backend.priorities == [-5, -3, 10, 5]
    assert [a.headers["x-kvrelay-priority"] for a in answers] == ["-5", "-3", "10", "5"]


@pytest.mark.asyncio
async def test_request_type_and_estimated_cost_make_a_request_less_important_within_its_tier(engine, tiny_model_dir):
    # Batch (not streamed) work: +2 levels; every 20 tokens of prompt + n x max_tokens: +1 level, at most 3.
    tiers = {"gold": {"priority": 0, "highest_priority": -5, "non_stream_priority_offset": 2,
                      "priority_cost_step_tokens": 20, "max_cost_priority_levels": 3}, "free": {}}
    srv, backend, _ = server(engine, tiny_model_dir, tiers)
    app = srv.build_app()
    answers = [
        await call(app, "/v1/completions", {**REQUEST, "stream": True}, GOLD),  # 10 + 4 = 14 tokens: no level
        await call(app, "/v1/completions", REQUEST, GOLD),  # batch: +2
        await call(app, "/v1/completions", {**REQUEST, "stream": True, "max_tokens": 30}, GOLD),  # 40 tokens: +2
        await call(app, "/v1/completions", {**REQUEST, "stream": True, "max_tokens": 30, "n": 4}, GOLD),  # 130: +6, capped at 3
        await call(app, "/v1/completions", {**REQUEST, "priority": -100}, GOLD),  # clamped to -5, then batch +2
        await call(app, "/v1/completions", {**REQUEST, "stream": True}, FREE),  # a tier without the rules
    ]
    assert [a.status_code for a in answers] == [200] * 6
    assert backend.priorities == [0, 2, 2, 3, -3, 0]
    assert [a.headers["x-kvrelay-priority"] for a in answers] == ["0", "2", "2", "3", "-3", "0"]


@pytest.mark.asyncio
async def test_a_tier_that_refuses_over_limit_priorities_names_the_field_and_the_limit(engine, tiny_model_dir):
    srv, backend, _ = server(engine, tiny_model_dir, {"free": {"highest_priority": 0, "priority_over_limit": "refuse"}, "gold": {}})
    response = await call(srv.build_app(), "/v1/completions", {**REQUEST, "priority": -1}, FREE)
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "priority = -1 is more important than the key's tier 'free' allows (at most 0; lower is more "
        "important); send 0 or more", "type": "invalid_request_error", "param": "priority", "code": "priority_not_allowed",
    }
    assert backend.priorities == []


@pytest.mark.asyncio
async def test_a_model_outside_the_tier_does_not_exist_for_the_key(engine, tiny_model_dir):
    srv, backend, _ = server(engine, tiny_model_dir, {"free": {"models": ["tiny-adapter"]}, "gold": {"models": [MODEL]}})
    app = srv.build_app()
    assert (await call(app, "/v1/models", None, FREE)).json() == {"object": "list", "data": []}
    assert [m["id"] for m in (await call(app, "/v1/models", None, GOLD)).json()["data"]] == [MODEL]
    refused = await call(app, "/v1/completions", REQUEST, FREE)
    assert refused.status_code == 404
    assert refused.json()["error"]["message"] == "The model 'tiny' does not exist or you do not have access to it."
    assert (await call(app, "/v1/completions", REQUEST, GOLD)).status_code == 200
    assert len(backend.priorities) == 1


class _Exchange:
    """What the Serve handle of the app's LimitsExchange does, in process; `down` makes it fail."""

    def __init__(self):
        self.exchange = LimitsExchange()
        self.down = False
        outer = self

        class _Trade:
            async def remote(self, replica, report):
                if outer.down:
                    raise ConnectionError("exchange restarting")
                return outer.exchange.trade(replica, report)

        self.trade = _Trade()


@pytest.mark.asyncio
async def test_two_ingress_replicas_hold_one_limit_through_the_exchange(engine, tiny_model_dir):
    exchange = _Exchange()
    replicas = []
    for name in ("a", "b"):
        srv, _, _ = server(engine, tiny_model_dir, {"free": {"requests_per_minute": 4}, "gold": {}})
        sync = LimitsSync(srv.limiter, {k.name: k for k in srv.config.keys}, exchange, name, interval_s=1.0)
        replicas.append((srv.build_app(), sync))
    for _, sync in replicas:
        assert await sync.trade_once()
    statuses = []
    for i in range(8):  # the proxy alternates; the replicas trade between requests
        app, sync = replicas[i % 2]
        statuses.append((await call(app, "/v1/completions", REQUEST, FREE)).status_code)
        await sync.trade_once()  # reports it...
        await replicas[(i + 1) % 2][1].trade_once()  # ...before the other collects
    assert statuses == [200, 200, 200, 200, 429, 429, 429, 429]
    # While the exchange is down each replica's admissions wait in its report, and reach the
    # other replica once it is back.
    exchange.down = True
    (app_a, sync_a), (app_b, sync_b) = replicas
    for srv_clock in (sync_a.limiter.clock, sync_b.limiter.clock):
        srv_clock.now += 15  # one request of room each
    assert (await call(app_a, "/v1/completions", REQUEST, FREE)).status_code == 200
    assert not await sync_a.trade_once()
    exchange.down = False
    assert await sync_a.trade_once() and await sync_b.trade_once()
    refused = await call(app_b, "/v1/completions", REQUEST, FREE)
    assert (refused.status_code, refused.headers["retry-after"]) == (429, "15")
