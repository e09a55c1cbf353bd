"""Per-key limits on a virtual clock: exact refusals, Retry-After values and headers, and the
counters shared by two ingress replicas."""

from __future__ import annotations

import pytest

from serving.api.admission.rate_limits import LimitReport, LimitsExchange, RateLimiter, RateLimitError, format_reset
from serving.config.access import TierConfig, hash_key
from serving.engine.errors import InvalidRequestError
from tests.helpers import VirtualClock


def _limiter(clock: VirtualClock, **tier) -> tuple[RateLimiter, object]:
    key = hash_key("sk-test-key-0123456789", name="team", tier="t", salt=b"\x01" * 16)
    return RateLimiter({"t": TierConfig(**tier), "default": TierConfig()}, clock), key


def _refusal(limiter, key, num_tokens=0) -> RateLimitError:
    with pytest.raises(RateLimitError) as info:
        limiter.admit(key, num_tokens)
    return info.value


def test_requests_per_minute_is_a_bucket_of_a_minute_refilled_evenly():
    clock = VirtualClock()
    limiter, key = _limiter(clock, requests_per_minute=3)
    for _ in range(3):
        limiter.admit(key, 10)
    error = _refusal(limiter, key)
    # One request's room comes back every 60 / 3 = 20 s.
    assert (error.status, error.headers["retry-after"], error.type, error.code) == (429, "20", "requests", "rate_limit_exceeded")
    assert "3 requests per minute" in error.message
    clock.now += 19.5
    assert _refusal(limiter, key).headers["retry-after"] == "1"  # 0.5 s, rounded up
    clock.now += 0.5
    limiter.admit(key, 10)
    assert _refusal(limiter, key).headers["retry-after"] == "20"


def test_tokens_per_minute_reserves_max_tokens_and_gives_back_what_was_not_used():
    clock = VirtualClock()
    limiter, key = _limiter(clock, tokens_per_minute=120)  # 2 tokens per second
    first = limiter.admit(key, 100)
    error = _refusal(limiter, key, 50)
    assert (error.headers["retry-after"], error.type) == ("15", "tokens")  # 30 missing / 2 per s
    first.release(used_tokens=40)  # 60 of its 100 go back: 80 left
    limiter.admit(key, 50)
    assert limiter.headers(key)["x-ratelimit-remaining-tokens"] == "30"
    first.release(used_tokens=0)  # a second release changes nothing
    assert limiter.headers(key)["x-ratelimit-remaining-tokens"] == "30"


def test_a_request_larger_than_a_minute_of_tokens_is_a_400_naming_max_tokens():
    limiter, key = _limiter(VirtualClock(), tokens_per_minute=100)
    with pytest.raises(InvalidRequestError) as info:
        limiter.admit(key, 101)
    assert info.value.param == "max_tokens"
    assert "101 tokens" in str(info.value) and "(100)" in str(info.value)


def test_concurrent_requests_are_limited_until_one_ends():
    limiter, key = _limiter(VirtualClock(), max_concurrent_requests=2)
    first = limiter.admit(key, 1)
    limiter.admit(key, 1)
    error = _refusal(limiter, key)
    assert (error.headers["retry-after"], error.headers["x-ratelimit-limit-concurrent"]) == ("1", "2")
    with pytest.raises(RateLimitError):
        limiter.check(key)
    first.release()
    limiter.check(key)
    limiter.admit(key, 1)


def test_headers_say_limit_remaining_and_reset_like_openai():
    clock = VirtualClock()
    limiter, key = _limiter(clock, requests_per_minute=60, tokens_per_minute=6000)
    limiter.admit(key, 1500)
    assert limiter.headers(key) == {
        "x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "59", "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "6000", "x-ratelimit-remaining-tokens": "4500", "x-ratelimit-reset-tokens": "15s",
    }
    assert [format_reset(s) for s in (0, 0.25, 59.9, 60, 361.5)] == ["0s", "0.25s", "59.9s", "1m0s", "6m1s"]


def test_an_unlimited_tier_is_never_refused_and_has_no_headers():
    limiter, _ = _limiter(VirtualClock())
    key = hash_key("sk-free-key-0123456789", tier="default")
    for _ in range(1000):
        limiter.admit(key, 10**6)
    assert limiter.headers(key) == {}


def _replicas(clock: VirtualClock, **tier):
    exchange = LimitsExchange(stale_s=10.0, clock=clock)
    a, key = _limiter(clock, **tier)
    b, _ = _limiter(clock, **tier)
    keys = {key.name: key}

    def trade(name, limiter):
        limiter.apply_peers(exchange.trade(name, limiter.report()), keys)

    return a, b, key, trade


def test_two_replicas_share_a_key_s_requests_within_the_documented_drift():
    clock = VirtualClock()
    a, b, key, trade = _replicas(clock, requests_per_minute=10)
    trade("a", a), trade("b", b)  # both known to the exchange
    for _ in range(6):
        a.admit(key, 1)
    for _ in range(6):
        b.admit(key, 1)
    # Before a trade each replica sees only its own: 12 admitted, 2 over the limit of 10 (the
    # bound: what the other replica admitted since the last trade).
    trade("a", a), trade("b", b), trade("a", a)
    # Each has now taken the other's 6: 10 - 12 = -2 requests of room, 3 to wait for at 1 per 6 s.
    assert _refusal(a, key).headers["retry-after"] == "18"
    assert _refusal(b, key).headers["retry-after"] == "18"
    clock.now += 18
    a.admit(key, 1)
    trade("a", a), trade("b", b)
    assert _refusal(b, key).headers["retry-after"] == "6"


def test_two_replicas_trading_after_every_request_admit_exactly_the_limit():
    clock = VirtualClock()
    a, b, key, trade = _replicas(clock, requests_per_minute=10)
    trade("a", a), trade("b", b)
    admitted = refused = 0
    for i in range(30):
        replica, name = (a, "a") if i % 2 == 0 else (b, "b")
        trade(name, replica)
        try:
            replica.admit(key, 1)
            admitted += 1
        except RateLimitError:
            refused += 1
        trade(name, replica)
    assert (admitted, refused) == (10, 20)


def test_requests_in_flight_count_across_replicas_until_a_replica_goes_stale():
    clock = VirtualClock()
    a, b, key, trade = _replicas(clock, max_concurrent_requests=2)
    tickets = [a.admit(key, 1), a.admit(key, 1)]
    trade("a", a), trade("b", b)
    assert _refusal(b, key).code == "rate_limit_exceeded"
    tickets[0].release()
    trade("a", a), trade("b", b)
    b.admit(key, 1)
    # `a` stops trading (it died): after stale_s its request no longer counts at `b`.
    clock.now += 10.5
    trade("b", b)
    b.admit(key, 1)
    assert b.report().in_flight == {"team": 2}


def test_a_replica_that_joins_late_takes_none_of_the_history():
    clock = VirtualClock()
    exchange = LimitsExchange(clock=clock)
    exchange.trade("a", LimitReport({"team": (50.0, 500.0)}, {}))
    assert exchange.trade("b", LimitReport({}, {})) == LimitReport({}, {})
    exchange.trade("a", LimitReport({"team": (1.0, 7.0)}, {"team": 1}))
    assert exchange.trade("b", LimitReport({}, {})) == LimitReport({"team": (1.0, 7.0)}, {"team": 1})
    assert exchange.trade("a", LimitReport({}, {})) == LimitReport({}, {})
