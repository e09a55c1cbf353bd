"""`kvrelay bench soak --chaos`: kill a decode replica, a prefill replica and the KVTransfer actor,
once each, while the soak runs, and measure what each kill did.

    requests ended:  0 ──── 25% ──────────── 50% ──────────── 75% ──────────── 100%
                            kill decode      kill prefill     kill KVTransfer
                            └─ recovery ───┘ └─ recovery ───┘ └─ recovery ─┘

A kill waits for its point in the run only: a pool can take longer to come back (a replica's
process start and model load: ~20 s here) than a short run takes between two kills, so
recoveries may overlap. A kill whose point comes after the load ended is not done (reported, and
the run fails: give it more requests).

    decode, prefill   the replica of the pool with the most running requests is killed with
                      ray.kill (no restart: its process dies as in a crash; Serve's controller
                      starts a replacement). Recovered: a replica that did not exist before the
                      kill is ready and the pool has its replica count RUNNING again.
    kv_transfer       this node's KVTransfer actor, ray.kill with restart (Ray restarts it,
                      empty). Recovered: the actor answers from a new process; then
                      `claims_resumed_s`: the restarted actor has handed over a KV (num_claimed
                      > 0), so hand-offs work again.

The kills and the polls block (actor and GCS calls): each runs in a thread, off the load's loop.
Which requests a kill affected, and whether each failed one ended with an error, is worked out
afterwards from the requests' times (load_tests/soak/report.py).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from load_tests.soak import app_probe

__all__ = ["CHAOS_PLAN", "Chaos", "Kill", "LoadProgress", "Target"]

logger = logging.getLogger(__name__)


class Target(enum.Enum):
    DECODE = "decode"
    PREFILL = "prefill"
    KV_TRANSFER = "kv_transfer"


DEPLOYMENT_OF = {Target.DECODE: "DecodeWorker", Target.PREFILL: "PrefillWorker"}
CHAOS_PLAN = ((0.25, Target.DECODE), (0.5, Target.PREFILL), (0.75, Target.KV_TRANSFER))


@dataclass
class Kill:
    target: Target
    at_fraction: float
    victim: str = ""  # the replica's actor name, or the KVTransfer actor's
    killed_s: float | None = None  # on the run's clock, just before ray.kill
    num_ended_at_kill: int = 0
    recovered_s: float | None = None  # on the run's clock (see the module docstring)
    claims_resumed_s: float | None = None  # kv_transfer only
    error: str | None = None  # why the kill was not done, or its recovery not seen

    def to_json(self) -> dict:
        return {
            "target": self.target.value, "at_fraction": self.at_fraction, "victim": self.victim,
            "killed_s": self.killed_s, "num_ended_at_kill": self.num_ended_at_kill, "recovered_s": self.recovered_s,
            "claims_resumed_s": self.claims_resumed_s, "error": self.error,
        }


@dataclass
class LoadProgress:
    """How far the load is, shared between the load's tasks and the chaos task (one loop)."""

    total: int
    num_ended: int = 0
    is_done: bool = False
    in_flight: dict[int, float] = field(default_factory=dict)  # request id -> started_s
    _waiters: list[tuple[int, asyncio.Event]] = field(default_factory=list)

    def ended(self, request_id: int) -> None:
        self.in_flight.pop(request_id, None)
        self.num_ended += 1
        self._wake()

    def done(self) -> None:
        self.is_done = True
        self._wake()

    def _wake(self) -> None:
        for threshold, event in self._waiters:
            if self.num_ended >= threshold or self.is_done:
                event.set()

    async def wait_ended(self, threshold: int) -> None:
        """Until `threshold` requests have ended, or the load is done."""
        if self.num_ended >= threshold or self.is_done:
            return
        event = asyncio.Event()
        self._waiters.append((threshold, event))
        try:
            await event.wait()
        finally:
            self._waiters.remove((threshold, event))


def _actor_pid(actor) -> int:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=10)


class Chaos:
    def __init__(self, app: str, num_replicas: dict[str, int], clock: Callable[[], float], *,
                 plan: tuple[tuple[float, Target], ...] = CHAOS_PLAN, recovery_timeout_s: float = 180.0,
                 poll_s: float = 0.25, progress: Callable[[str], None] = lambda message: None) -> None:
        self.app = app
        self.num_replicas = num_replicas  # deployment -> its replica count
        self.clock = clock
        self.kills = [Kill(target, fraction) for fraction, target in plan]
        self.recovery_timeout_s = recovery_timeout_s
        self.poll_s = poll_s
        self._progress = progress

    async def run(self, load: LoadProgress) -> None:
        watchers = []
        for kill in self.kills:
            await load.wait_ended(int(kill.at_fraction * load.total))
            if load.is_done:
                kill.error = "not done: the load ended first (run more requests)"
                continue
            kill.num_ended_at_kill = load.num_ended
            try:
                before = await asyncio.to_thread(self._kill, kill)
            except Exception as exc:  # noqa: BLE001 - reported; the soak goes on and fails its check
                logger.exception("chaos: the %s kill failed", kill.target.value)
                kill.error = f"{type(exc).__name__}: {exc}"
                continue
            self._progress(f"chaos: killed {kill.target.value} ({kill.victim}) at {kill.killed_s:.1f} s, "
                           f"{len(load.in_flight)} requests in flight")
            watchers.append(asyncio.create_task(asyncio.to_thread(self._watch, kill, before, load)))
        await asyncio.gather(*watchers)

    # ---- in a thread ---------------------------------------------------------------------------
    def _kill(self, kill: Kill) -> object:
        """Kill now; returns what the recovery watch compares against."""
        if kill.target is Target.KV_TRANSFER:
            pid = _actor_pid(app_probe.kv_transfer_handle(self.app))
            kill.killed_s = self.clock()
            kill.victim = app_probe.kill_kv_transfer(self.app)
            return pid
        deployment = DEPLOYMENT_OF[kill.target]
        replicas = [r for r in app_probe.list_replicas(self.app) if r.deployment == deployment]
        if not replicas:
            raise app_probe.ProbeError(f"no {deployment} replica to kill")
        # The busiest replica: its death is the one that has requests to fail or resume.
        running = {r: self._num_running(r) for r in replicas}
        victim = max(replicas, key=lambda r: (running[r], r.replica_id))
        kill.victim = victim.actor_name
        kill.killed_s = self.clock()
        app_probe.kill_replica(victim)
        return (victim, {r.replica_id for r in replicas})

    def _watch(self, kill: Kill, before: object, load: LoadProgress) -> None:
        try:
            if kill.target is Target.KV_TRANSFER:
                self._watch_kv_transfer(kill, before, load)
            else:
                self._watch_pool(kill, *before)
        except Exception as exc:  # noqa: BLE001 - reported as the kill's error
            logger.exception("chaos: watching the %s recovery failed", kill.target.value)
            kill.error = f"{type(exc).__name__}: {exc}"
        self._progress(
            f"chaos: {kill.target.value} "
            + (f"recovered {kill.recovered_s - kill.killed_s:.1f} s after its kill" if kill.recovered_s is not None
               else f"not recovered: {kill.error}")
            + (f", KV handed over again after {kill.claims_resumed_s - kill.killed_s:.1f} s"
               if kill.claims_resumed_s is not None else "")
        )

    def _watch_pool(self, kill: Kill, victim: app_probe.Replica, before: set[str]) -> None:
        deployment = victim.deployment
        deadline = time.monotonic() + self.recovery_timeout_s
        while time.monotonic() < deadline:
            time.sleep(self.poll_s)
            live = [r for r in app_probe.list_replicas(self.app) if r.deployment == deployment]
            new = [r for r in live if r.replica_id not in before]
            states = app_probe.replica_states(self.app).get(deployment, {})
            if (new and victim.replica_id not in {r.replica_id for r in live}
                    and states.get("RUNNING", 0) >= self.num_replicas[deployment]
                    and all(self._is_ready(r) for r in new)):
                kill.recovered_s = self.clock()
                return
        kill.error = f"{deployment} not back to {self.num_replicas[deployment]} running replicas within {self.recovery_timeout_s:g} s"

    def _num_running(self, replica: app_probe.Replica) -> int:
        try:
            return int(app_probe.replica_stats(replica, timeout_s=5.0).get("num_running", 0))
        except app_probe.ProbeError:
            return -1  # not readable (starting?): the last choice

    def _is_ready(self, replica: app_probe.Replica) -> bool:
        try:
            return bool(app_probe.replica_stats(replica, timeout_s=5.0).get("ready"))
        except app_probe.ProbeError:
            return False

    def _watch_kv_transfer(self, kill: Kill, pid: int, load: LoadProgress) -> None:
        deadline = time.monotonic() + self.recovery_timeout_s
        while time.monotonic() < deadline:
            time.sleep(self.poll_s)
            try:
                new_pid = _actor_pid(app_probe.kv_transfer_handle(self.app))
                stats = app_probe.kv_transfer_stats(self.app).get(kill.victim)
            except Exception:  # noqa: BLE001 - restarting: not answering yet
                continue
            if new_pid == pid or stats is None:
                continue
            if kill.recovered_s is None:
                kill.recovered_s = self.clock()
            if stats["num_claimed"] > 0:
                kill.claims_resumed_s = self.clock()
                return
            if load.is_done:
                kill.error = "the restarted KVTransfer actor handed over no KV before the load ended"
                return
        kill.error = f"the KVTransfer actor did not {'hand over a KV' if kill.recovered_s else 'answer'} within {self.recovery_timeout_s:g} s"
