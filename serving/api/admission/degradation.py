"""Graceful degradation: what the ingress does when its pools refuse a request before its first
token, by config (`degradation:` in the ServeConfig; off when absent).

    request ─▶ DegradationPolicy.on_arrival(priority) ── shed now? ──▶ 503 + Retry-After
                 │ no
                 ▼
               the primary: this app's pools, as without degradation
                 │ refused before any token:
                 │   saturated  QueueFullError (a pool's queues are full; Serve's back-pressure),
                 │              QueueTimeoutError (it waited past an engine's max_queue_wait_s)
                 │   down       NoWorkerError (no running replica), EngineDeadError
                 ▼
               DegradationPolicy.on_refusal(reason, priority)
                 ├─ FAIL      reason not in `when`, or nothing configured for this request:
                 │            the primary's 429 / 503, unchanged
                 ├─ SHED      priority >= shed_priority_at_or_above: 503 request_shed, Retry-After
                 └─ FALLBACK  the fallback app's ingress answers (serving/deployments/fallback.py); if it
                              cannot be reached, the primary's error after all

Priorities follow vLLM's convention (and the engine's scheduler): a lower `priority` is more
important, default 0. Low-priority requests go first: a refused one is shed rather than given
the fallback's capacity, and for `shed_window_s` after a saturated refusal they are refused on
arrival, so they take no queue slot that the saturated pool frees for more important work.
The window is per ingress replica (each sees its own refusals).

What the client sees: the answering model's name in the body's and every chunk's `model` and in
the `x-kvrelay-model` header (on every completion this app or its fallback answers), and
`x-kvrelay-degraded: saturated|down` on a degraded response (a fallback's answer or a shed 503).

Accounting, so that each request counts once: a request the fallback answers is counted, billed
and traced by the fallback app (its model, its prices, the caller's API key); here only in
kvrelay_degraded_requests_total (outcome served or failed) and in the ingress span's
`kvrelay.degraded.*` attributes. A shed request is this app's 503 (kvrelay_requests_total, not
billed) and kvrelay_degraded_requests_total{outcome="shed"}. A refusal that is not degraded
counts as before. Requests that already streamed a token are never degraded: the client has
its answer's beginning (its failure is an SSE error event, as before).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from serving.api.admission.forwarding import FORWARDED_SCOPE_KEY, FallbackUnavailable, ForwardedRequest, Forwarder, forward_headers, relay
from serving.api.errors import NoWorkerError, QueueFullError, QueueTimeoutError, ShedError
from serving.config import DegradationConfig
from serving.engine.errors import EngineDeadError

if TYPE_CHECKING:
    from fastapi import Request
    from fastapi.responses import Response

    from serving.observability.ingress_metrics import IngressMetrics

__all__ = [
    "Reason",
    "Action",
    "Decision",
    "refusal_reason",
    "DegradationPolicy",
    "Degrader",
    "MODEL_HEADER",
    "DEGRADED_HEADER",
]

logger = logging.getLogger(__name__)

MODEL_HEADER = "x-kvrelay-model"  # the model that answered
DEGRADED_HEADER = "x-kvrelay-degraded"  # why a response did not come from the requested model


class Reason(str, Enum):
    SATURATED = "saturated"
    DOWN = "down"


class Action(Enum):
    FAIL = "fail"  # the primary's error, as without degradation
    SHED = "shed"
    FALLBACK = "fallback"


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: Reason


def refusal_reason(exc: BaseException) -> Reason | None:
    """Why the pools refused a request, if that is what `exc` says; None for any other failure."""
    if isinstance(exc, (QueueFullError, QueueTimeoutError)):
        return Reason.SATURATED
    if isinstance(exc, (NoWorkerError, EngineDeadError)):
        return Reason.DOWN
    return None


class DegradationPolicy:
    """The decisions, Ray- and HTTP-free; `now` is monotonic seconds. Its only state is the end of
    the current shed window."""

    name = "degradation"

    def __init__(self, config: DegradationConfig):
        self.config = config
        self._when = frozenset(Reason(w) for w in config.when)
        self._shed_until = float("-inf")

    def is_low_priority(self, priority: int) -> bool:
        threshold = self.config.shed_priority_at_or_above
        return threshold is not None and priority >= threshold

    def on_arrival(self, priority: int, now: float) -> Decision | None:
        """SHED for a low-priority request within the shed window; None: try the primary."""
        if self.is_low_priority(priority) and now < self._shed_until:
            return Decision(Action.SHED, Reason.SATURATED)
        return None

    def on_refusal(self, reason: Reason, priority: int, now: float) -> Decision:
        """What to do with a request the primary refused before its first token."""
        if reason not in self._when:
            return Decision(Action.FAIL, reason)
        if reason is Reason.SATURATED:
            self._shed_until = max(self._shed_until, now + self.config.shed_window_s)
        if self.is_low_priority(priority):
            return Decision(Action.SHED, reason)
        if self.config.fallback is not None:
            return Decision(Action.FALLBACK, reason)
        return Decision(Action.FAIL, reason)


Handler = Callable[[dict, Any], Awaitable["Response"]]  # OpenAIServer's (body, call) -> Response


class Degrader:
    """The ingress's side: wraps a completion handler of OpenAIServer, inside its `_guard` (so
    auth, body limits and error mapping stay where they are). `metrics` gets the counter;
    `fallback` opens requests at the configured fallback app (the Serve ingress passes a
    FallbackClient, serving/deployments/fallback.py); without one (a server outside Serve, where
    no other app exists) a request to degrade keeps the primary's refusal, counted as failed."""

    def __init__(
        self,
        config: DegradationConfig | None,
        model_name: str,
        metrics: IngressMetrics,
        *,
        fallback: Forwarder | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.model_name = model_name
        self.metrics = metrics
        self.policy = DegradationPolicy(config) if config is not None else None
        self.fallback = fallback
        self._clock = clock

    def wrap(self, request: Request, handler: Handler) -> Handler:
        async def run(body: dict, call) -> Response:
            if self.policy is None or FORWARDED_SCOPE_KEY in request.scope:
                return self._answered(await handler(body, call))  # never degraded twice
            return await self._run(request, handler, body, call)

        return run

    async def _run(self, request: Request, handler: Handler, body: dict, call) -> Response:
        priority = _priority(body)
        decision = self.policy.on_arrival(priority, self._clock())
        if decision is not None:
            raise self._shed(decision, priority, call)
        # The primary's refusal is held back from the request metrics until we know whether the
        # fallback answers (it then counts the request) or this app does.
        call.record.hold()
        keep = True
        try:
            try:
                response = await handler(body, call)
            except Exception as exc:
                reason = refusal_reason(exc)
                if reason is None or call.record.first_token_at is not None:
                    raise
                decision = self.policy.on_refusal(reason, priority, self._clock())
                if decision.action is Action.SHED:
                    keep = False  # counted as the 503 it becomes
                    raise self._shed(decision, priority, call) from exc
                if decision.action is Action.FALLBACK:
                    keep = False  # a client leaving meanwhile is counted as the 499 it is
                    response = await self._fall_back(request, body, call, decision.reason)
                    if response is not None:
                        return response
                    keep = True  # unreachable: the primary's refusal stands as it was counted
                raise
        finally:
            call.record.release(keep=keep)
        return self._answered(response)

    def _answered(self, response: Response) -> Response:
        response.headers[MODEL_HEADER] = self.model_name
        return response

    def _shed(self, decision: Decision, priority: int, call) -> ShedError:
        self.metrics.degraded(decision.reason.value, "none", "shed")
        if call.trace is not None:
            call.trace.set({"kvrelay.degraded.reason": decision.reason.value, "kvrelay.degraded.outcome": "shed"})
        return ShedError(decision.reason.value, priority, self.config.shed_priority_at_or_above, self.config.retry_after_s)

    async def _fall_back(self, request: Request, body: dict, call, reason: Reason) -> Response | None:
        """The fallback's answer, relayed; None if it cannot be reached."""
        target = self.config.fallback.model
        forwarded = ForwardedRequest(
            path=request.scope["route"].path,
            headers=forward_headers(request.headers.items(), call.trace.carrier() if call.trace is not None else None),
            body=json.dumps({**body, "model": target}).encode(),
            origin=self.model_name,
        )
        try:
            if self.fallback is None:
                raise FallbackUnavailable(f"this ingress has no transport to app {self.config.fallback.app!r}")
            start, chunks = await self.fallback.open(forwarded)
        except FallbackUnavailable as exc:
            logger.warning("%s request refused (%s) and the fallback cannot take it: %s", self.model_name, reason.value, exc)
            self.metrics.degraded(reason.value, target, "failed")
            return None
        outcome = "served" if start.status < 400 else "failed"
        if outcome == "failed":
            logger.warning("%s request (%s) degraded to %r, which answered %d", self.model_name, reason.value, target, start.status)
        self.metrics.degraded(reason.value, target, outcome)
        call.account.hand_over()  # the fallback app bills it
        if call.trace is not None:
            call.trace.set({"kvrelay.degraded.reason": reason.value, "kvrelay.degraded.target": target, "kvrelay.degraded.outcome": outcome})
        return relay(start, chunks, extra_headers={DEGRADED_HEADER: reason.value}, on_close=call.finish, request_id=call.request_id)


def _priority(body: dict) -> int:
    """The request's priority for the decision; the handler validates the field itself (a bad
    value is its 400), so anything but an int counts as the default here."""
    value = body.get("priority", 0)
    return value if type(value) is int else 0
