"""LoRA adapters loaded at run time, shared by several ingress replicas: each load or unload
(POST /v1/load_lora_adapter, serving/api/endpoints/routes.py) goes to the app's one AdapterRegistry, and
every replica copies the registry's table every `ingress.limits_sync_interval_s`, and at once
when a request names an adapter it does not know.

    ingress replica A ──load(name, path)──▶ AdapterRegistry {name: path, version}
    ingress replica B ──every interval, or on a miss: table(since=its version)──┘
                      ◀── the table, if it changed

So a load answered by one replica serves on every replica from the next request that names it;
an unload reaches the others within the interval (until then they still send the adapter's
requests, which the workers still serve). The workers never need the table: each request carries
its adapter's path. The table lives in the registry's replica; a restart of it loses the runtime
adapters, as a vLLM server's restart does.
"""

from __future__ import annotations

import logging
import time
import uuid

from ray import serve

from serving.observability.periodic import PeriodicTask

__all__ = ["AdapterRegistry", "AdapterRegistryDeployment", "AdapterSync"]

logger = logging.getLogger(__name__)

_WARN_EVERY_S = 60.0


class AdapterRegistry:
    """The shared table: adapter name -> PEFT path, with a version that grows on every change."""

    def __init__(self) -> None:
        self.adapters: dict[str, str] = {}
        # (this start, changes since): a restarted registry never repeats a version a replica holds
        self.version = (uuid.uuid4().hex, 0)

    def load(self, name: str, path: str) -> str | None:
        """Registers `name`; None, or the path another replica registered it with first."""
        if name in self.adapters:
            return self.adapters[name]
        self.adapters[name] = path
        self.version = (self.version[0], self.version[1] + 1)
        return None

    def unload(self, name: str) -> bool:
        if self.adapters.pop(name, None) is None:
            return False
        self.version = (self.version[0], self.version[1] + 1)
        return True

    def table(self, since: tuple[str, int] | None) -> tuple[tuple[str, int], dict[str, str]] | None:
        """The table and its version, or None when it has not changed since `since`."""
        return None if since == self.version else (self.version, dict(self.adapters))


class AdapterSync:
    """One ingress replica's side. `registry` is a handle (or anything) whose `load`, `unload` and
    `table` have awaitable `.remote(...)`; `adapters` is the server's runtime table, updated in place."""

    def __init__(self, registry, adapters: dict[str, str], interval_s: float):
        self.registry = registry
        self.adapters = adapters
        self.interval_s = interval_s
        self.version: tuple[str, int] | None = None
        self._loop = PeriodicTask(self.refresh, interval_s, what="copying the LoRA adapter table")
        self._warned_at = -_WARN_EVERY_S

    async def load(self, name: str, path: str) -> str | None:
        taken = await self.registry.load.remote(name, path)
        await self.refresh()
        return taken

    async def unload(self, name: str) -> bool:
        removed = await self.registry.unload.remote(name)
        await self.refresh()
        return removed

    async def refresh(self) -> bool:
        """Copies the registry's table if it changed; False when the registry cannot be reached
        (the replica keeps its last copy)."""
        try:
            changed = await self.registry.table.remote(self.version)
        except Exception as exc:  # noqa: BLE001 - keep serving the last copy
            if time.monotonic() - self._warned_at >= _WARN_EVERY_S:
                self._warned_at = time.monotonic()
                logger.warning("cannot reach the AdapterRegistry (%s): runtime LoRA adapters as last seen", exc)
            return False
        if changed is not None:
            self.version, table = changed
            self.adapters.clear()
            self.adapters.update(table)
        return True

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()

@serve.deployment(name="AdapterRegistry", num_replicas=1, max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
class AdapterRegistryDeployment(AdapterRegistry):
    """The app's shared table of runtime LoRA adapters (module docstring)."""
