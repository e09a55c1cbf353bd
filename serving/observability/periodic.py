"""PeriodicTask: one background loop on the running event loop, cancellable, for the replicas'
periodic work (the ingress's pool gauges, serving/observability/export.py; the LoRA adapter table,
serving/deployments/adapter_registry.py; the rate limits' trade, serving/deployments/limits_sync.py).

    start() ──▶ [wait_first: sleep] ─▶ tick() ─▶ sleep(period_s) ─▶ tick() ─▶ ...   stop(): cancelled

A tick that raises is logged and the loop goes on: a slow controller or a vanished actor must not
end the task. Its owner stops it when it shuts down. Here, not in serving/deployments, because the
metrics export below the Ray layer runs one too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

__all__ = ["PeriodicTask"]

logger = logging.getLogger(__name__)


class PeriodicTask:
    """Awaits `tick()` every `period_s` seconds from start() to stop(); `what` names it in logs."""

    def __init__(
        self, tick: Callable[[], Awaitable[object]], period_s: float, *, what: str, wait_first: bool = False,
    ):
        self.tick = tick
        self.period_s = period_s
        self.what = what
        self.wait_first = wait_first
        self._task: asyncio.Task | None = None

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start on the running loop (RuntimeError without one); a second start does nothing."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        if self.wait_first:
            await asyncio.sleep(self.period_s)
        while True:
            try:
                await self.tick()
            except Exception as exc:  # noqa: BLE001 - one failed tick must not end the task
                logger.warning("%s failed (%s); trying again in %g s", self.what, exc, self.period_s)
            await asyncio.sleep(self.period_s)
