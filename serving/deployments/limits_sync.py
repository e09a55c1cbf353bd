"""Per-key limits held across ingress replicas: each replica trades its admissions with the app's
one LimitsExchange deployment every `ingress.limits_sync_interval_s` (serving/api/admission/rate_limits.py says
what that bounds).

    ingress replica ──every interval: trade(replica id, what it admitted)──▶ LimitsExchange
          ▲                                                                      │
          └──────────── what the other replicas admitted since its last trade ◀──┘

A trade that fails (the exchange restarting) keeps its report for the next one, so nothing a
replica admitted is lost to the others; meanwhile each replica still enforces the whole limit on
its own share.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from ray import serve

from serving.api.admission.rate_limits import LimitReport, LimitsExchange, RateLimiter
from serving.config.access import APIKey
from serving.observability.periodic import PeriodicTask

__all__ = ["LimitsSync", "LimitsExchangeDeployment"]

logger = logging.getLogger(__name__)

_WARN_EVERY_S = 60.0


class LimitsSync:
    """One ingress replica's side: `trade_once` is one round; `start` runs it every interval."""

    def __init__(self, limiter: RateLimiter, keys: Mapping[str, APIKey], exchange, replica_id: str, interval_s: float):
        self.limiter = limiter
        self.keys = dict(keys)
        self.exchange = exchange  # a handle (or anything) whose `trade.remote(replica, report)` is awaitable
        self.replica_id = replica_id
        self.interval_s = interval_s
        self._loop = PeriodicTask(self.trade_once, interval_s, what="trading the rate limits", wait_first=True)
        self._warned_at = -_WARN_EVERY_S

    async def trade_once(self) -> bool:
        report = self.limiter.report()
        try:
            peers: LimitReport = await self.exchange.trade.remote(self.replica_id, report)
        except Exception as exc:  # noqa: BLE001 - limits stay per replica until the exchange is back
            self.limiter.restore(report)
            if time.monotonic() - self._warned_at >= _WARN_EVERY_S:
                self._warned_at = time.monotonic()
                logger.warning("cannot reach the LimitsExchange (%s): each ingress replica limits its own share", exc)
            return False
        self.limiter.apply_peers(peers, self.keys)
        return True

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()

@serve.deployment(name="LimitsExchange", num_replicas=1, max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
class LimitsExchangeDeployment:
    """The app's shared per-key counters (serving/api/admission/rate_limits.py LimitsExchange)."""

    def __init__(self, stale_s: float):
        self.exchange = LimitsExchange(stale_s=stale_s)

    def trade(self, replica: str, report: LimitReport) -> LimitReport:
        return self.exchange.trade(replica, report)
