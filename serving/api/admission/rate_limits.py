"""Per-key rate limits from the key's tier, held across ingress replicas by shared counters.

    request ─check(key)──▶ over the requests bucket or the concurrency limit? 429 at once
            ─admit(key, tokens)──▶ Ticket (took 1 request and prompt + max_tokens tokens)
                                      └─ release(used tokens) when it ends: unused tokens back

A tier's `requests_per_minute` and `tokens_per_minute` are token buckets: a minute's worth of
room, refilled evenly (rate = limit / 60 s), so a key may burst its minute at once and then runs
at its rate. A refusal is a 429 whose `Retry-After` is the whole seconds until the bucket holds
what the request needs; every answer to a limited key carries OpenAI's `x-ratelimit-*` headers.
`max_concurrent_requests` counts the key's requests in flight.

Across ingress replicas (the proxy spreads a key's requests over them) each replica keeps its
own buckets and, every `sync_interval_s`, trades what it admitted since the last trade for what
the others admitted (`LimitsExchange`, one per app): their consumption is taken from its
buckets, their requests in flight count against its concurrency limit.

    Drift bound. A replica sees another's admissions at most two intervals late (the other
    reports once per interval, it collects once per interval). So over any span, a key is
    admitted at most its limit plus what the other R - 1 replicas admitted for it in the last
    2 x sync_interval_s: never more than (R - 1) x (a full bucket + 2 x sync_interval_s x rate)
    beyond the limit, and nothing beyond it once the replicas have traded. A replica that starts
    (or restarts) starts with full buckets, as the first ones did: it may add one bucket. Concurrency drifts
    the same way: at most what the others started in those two intervals. With one replica the
    limits are exact. If the exchange is unreachable, each replica still enforces the whole
    limit on its own share (the key gets at most R x its limit) and says so in its log.

Everything takes `now` from a clock passed in, so tests run on a virtual one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from serving.api.errors import APIError, InvalidRequestError
from serving.config.access import APIKey, TierConfig

__all__ = ["Bucket", "RateLimiter", "Ticket", "LimitsExchange", "LimitReport", "RateLimitError", "format_reset"]


class RateLimitError(APIError):
    """429 with `Retry-After` and the key's `x-ratelimit-*` headers."""

    def __init__(self, message: str, *, retry_after_s: int, headers: dict[str, str], kind: str):
        super().__init__(429, message, type=kind, code="rate_limit_exceeded",
                         headers={"retry-after": str(retry_after_s), **headers})
        self.retry_after_s = retry_after_s


class Bucket:
    """`per_minute` units of room, refilled evenly over a minute."""

    def __init__(self, per_minute: int, now: float):
        self.capacity = float(per_minute)
        self.rate_per_s = per_minute / 60.0
        self.level = self.capacity
        self._stamp = now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + max(0.0, now - self._stamp) * self.rate_per_s)
        self._stamp = max(self._stamp, now)

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until `amount` fits (0: now)."""
        self._refill(now)
        return 0.0 if self.level >= amount else (amount - self.level) / self.rate_per_s

    def take(self, amount: float, now: float) -> None:
        """Take `amount` (negative: give back, up to a full bucket); the level may go below zero
        when other replicas' consumption is taken."""
        self._refill(now)
        self.level = min(self.capacity, self.level - amount)

    def remaining(self, now: float) -> int:
        self._refill(now)
        return max(0, math.floor(self.level))

    def reset_s(self, now: float) -> float:
        """Seconds until the bucket is full again."""
        self._refill(now)
        return (self.capacity - self.level) / self.rate_per_s


@dataclass
class _KeyState:
    requests: Bucket | None
    tokens: Bucket | None
    in_flight: int = 0
    peers_in_flight: int = 0
    # Consumed here since the last trade: (requests, tokens); tokens given back count negative.
    unreported: list[float] = field(default_factory=lambda: [0.0, 0.0])


@dataclass
class LimitReport:
    """What one replica admitted since its last trade, and what it has in flight, per key name."""

    consumed: dict[str, tuple[float, float]]
    in_flight: dict[str, int]


class Ticket:
    """One admitted request's hold on its key's limits; `release` once, when it ends."""

    def __init__(self, limiter: RateLimiter, state: _KeyState, reserved_tokens: int):
        self._limiter = limiter
        self._state = state
        self.reserved_tokens = reserved_tokens
        self._released = False

    def release(self, used_tokens: int | None = None) -> None:
        """Ends the hold; tokens reserved and not used (`used_tokens`; None: all used) go back."""
        if self._released:
            return
        self._released = True
        self._state.in_flight -= 1
        if used_tokens is not None and used_tokens < self.reserved_tokens:
            self._limiter._give_back(self._state, self.reserved_tokens - used_tokens)


class RateLimiter:
    def __init__(self, tiers: Mapping[str, TierConfig], clock: Callable[[], float] = time.monotonic):
        self.tiers = dict(tiers)
        self.clock = clock
        self._keys: dict[str, _KeyState] = {}

    def _state(self, key: APIKey) -> _KeyState:
        state = self._keys.get(key.name)
        if state is None:
            tier = self.tiers[key.tier]
            now = self.clock()
            state = _KeyState(
                Bucket(tier.requests_per_minute, now) if tier.requests_per_minute else None,
                Bucket(tier.tokens_per_minute, now) if tier.tokens_per_minute else None,
            )
            self._keys[key.name] = state
        return state

    def is_limited(self, key: APIKey) -> bool:
        tier = self.tiers[key.tier]
        return bool(tier.requests_per_minute or tier.tokens_per_minute or tier.max_concurrent_requests)

    def check(self, key: APIKey) -> None:
        """Refuse at once a request its key has no room for (before its body is even tokenized)."""
        if self.is_limited(key):
            self._refusal(key, self._state(key), num_tokens=0)

    def admit(self, key: APIKey, num_tokens: int) -> Ticket:
        """Take one request and `num_tokens` (prompt + max_tokens) from the key's limits, or raise."""
        state = self._state(key)
        tier = self.tiers[key.tier]
        if tier.tokens_per_minute is not None and num_tokens > tier.tokens_per_minute:
            raise InvalidRequestError(
                "max_tokens",
                f"the request needs {num_tokens} tokens (prompt + max_tokens), more than its key's tier "
                f"{key.tier!r} allows per minute ({tier.tokens_per_minute}); lower max_tokens or shorten the prompt",
            )
        self._refusal(key, state, num_tokens)
        now = self.clock()
        for bucket, amount in ((state.requests, 1), (state.tokens, num_tokens)):
            if bucket is not None:
                bucket.take(amount, now)
        state.in_flight += 1
        state.unreported[0] += 1
        state.unreported[1] += num_tokens
        return Ticket(self, state, num_tokens)

    def _refusal(self, key: APIKey, state: _KeyState, num_tokens: int) -> None:
        tier = self.tiers[key.tier]
        now = self.clock()
        if tier.max_concurrent_requests is not None and state.in_flight + state.peers_in_flight >= tier.max_concurrent_requests:
            raise RateLimitError(
                f"the key {key.name!r} has {tier.max_concurrent_requests} requests in flight, its tier's "
                "max_concurrent_requests; retry when one ends",
                retry_after_s=1, headers=self.headers(key), kind="requests",
            )
        for bucket, amount, what in ((state.requests, 1, "requests"), (state.tokens, num_tokens, "tokens")):
            if bucket is None:
                continue
            wait_s = bucket.wait_s(amount, now)
            if wait_s > 0:
                limit = tier.requests_per_minute if what == "requests" else tier.tokens_per_minute
                raise RateLimitError(
                    f"rate limit of {limit} {what} per minute reached for the key {key.name!r} "
                    f"(tier {key.tier!r}); retry in {math.ceil(wait_s)} s",
                    retry_after_s=max(1, math.ceil(wait_s)), headers=self.headers(key),
                    kind=what,
                )

    def _give_back(self, state: _KeyState, num_tokens: int) -> None:
        if state.tokens is not None:
            state.tokens.take(-num_tokens, self.clock())
        state.unreported[1] -= num_tokens

    def headers(self, key: APIKey) -> dict[str, str]:
        """OpenAI's `x-ratelimit-*` headers for the key's limits (none for a key without)."""
        tier = self.tiers[key.tier]
        state = self._state(key)
        now = self.clock()
        out: dict[str, str] = {}
        for bucket, what in ((state.requests, "requests"), (state.tokens, "tokens")):
            if bucket is not None:
                out[f"x-ratelimit-limit-{what}"] = str(int(bucket.capacity))
                out[f"x-ratelimit-remaining-{what}"] = str(bucket.remaining(now))
                out[f"x-ratelimit-reset-{what}"] = format_reset(bucket.reset_s(now))
        if tier.max_concurrent_requests is not None:
            out["x-ratelimit-limit-concurrent"] = str(tier.max_concurrent_requests)
        return out

    # ---- sharing with the other ingress replicas ---------------------------------------------
    def report(self) -> LimitReport:
        """What this replica admitted since the last report (then forgotten), and its in-flight counts."""
        consumed = {}
        for name, state in self._keys.items():
            if state.unreported != [0.0, 0.0]:
                consumed[name] = (state.unreported[0], state.unreported[1])
                state.unreported = [0.0, 0.0]
        return LimitReport(consumed, {name: s.in_flight for name, s in self._keys.items() if s.in_flight})

    def restore(self, report: LimitReport) -> None:
        """A report that never reached the exchange: its consumption goes out with the next one."""
        for name, (num_requests, num_tokens) in report.consumed.items():
            state = self._keys.get(name)
            if state is not None:
                state.unreported[0] += num_requests
                state.unreported[1] += num_tokens

    def apply_peers(self, peers: LimitReport, keys: Mapping[str, APIKey]) -> None:
        """Take what the other replicas admitted from this one's buckets; count their in-flight."""
        now = self.clock()
        for name, state in self._keys.items():
            state.peers_in_flight = peers.in_flight.get(name, 0)
        for name, (num_requests, num_tokens) in peers.consumed.items():
            key = keys.get(name)
            if key is None:
                continue  # a key this replica does not know (a config being rolled out)
            state = self._state(key)
            if state.requests is not None:
                state.requests.take(num_requests, now)
            if state.tokens is not None:
                state.tokens.take(num_tokens, now)
        for name, count in peers.in_flight.items():
            key = keys.get(name)
            if key is not None:
                self._state(key).peers_in_flight = count


class LimitsExchange:
    """The shared counters (Ray-free; the app runs one in a Serve deployment): each replica sends
    its report and gets the sum of the others' since its previous trade. A replica that has not
    traded for `stale_s` no longer counts in flight (it died, or was scaled away)."""

    def __init__(self, stale_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.stale_s = stale_s
        self.clock = clock
        self._totals: dict[str, dict[str, list[float]]] = {}  # replica -> key -> [requests, tokens] ever
        self._seen: dict[str, dict[str, tuple[float, float]]] = {}  # replica -> others' totals at its last trade
        self._in_flight: dict[str, dict[str, int]] = {}
        self._stamp: dict[str, float] = {}

    def trade(self, replica: str, report: LimitReport) -> LimitReport:
        now = self.clock()
        totals = self._totals.setdefault(replica, {})
        for name, (num_requests, num_tokens) in report.consumed.items():
            acc = totals.setdefault(name, [0.0, 0.0])
            acc[0] += num_requests
            acc[1] += num_tokens
        self._in_flight[replica] = dict(report.in_flight)
        self._stamp[replica] = now
        others: dict[str, tuple[float, float]] = {}
        for other, other_totals in self._totals.items():
            if other == replica:
                continue
            for name, (num_requests, num_tokens) in other_totals.items():
                r, t = others.get(name, (0.0, 0.0))
                others[name] = (r + num_requests, t + num_tokens)
        # A replica's first trade takes none of the others' history: it started with full
        # buckets, like they did (part of the drift bound: a new replica may admit a bucket).
        seen = self._seen.get(replica, others)
        consumed = {}
        for name, (r, t) in others.items():
            r0, t0 = seen.get(name, (0.0, 0.0))
            if (r - r0, t - t0) != (0.0, 0.0):
                consumed[name] = (r - r0, t - t0)
        self._seen[replica] = others
        in_flight: dict[str, int] = {}
        for other, counts in self._in_flight.items():
            if other == replica or now - self._stamp[other] > self.stale_s:
                continue
            for name, n in counts.items():
                in_flight[name] = in_flight.get(name, 0) + n
        return LimitReport(consumed, in_flight)


def format_reset(seconds: float) -> str:
    """OpenAI's reset format: `6m0s`, `1.5s`, `0s`."""
    if seconds <= 0:
        return "0s"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{int(rest)}s"
