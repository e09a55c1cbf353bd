"""What `kvrelay bench soak` watches while the load runs, and the memory verdict it draws.

A thread (the reads block) samples, every `period_s`:
    RSS and anonymous RSS of every replica process of the app (app_probe.process_rss), each sample
    tagged with the time and how many requests had ended by then;
and, every `replicas_every` samples, which replica actors exist (app_probe.list_replicas), so a
replica that died and was replaced between two reads is still seen (its id is new), and the
KVTransfer actors' counters: a restarted actor counts from zero again, so the leases that expired
before its restart are added up here (`kv_expired_before_restarts`); and which KV they hold: an
offer older than the decode side's claim timeout will never be claimed, so it is noted
(`stale_kv`: the server's request id, its age, its bytes) to name the request a lease expiry
belongs to.

Memory growth, per process (pid), over the run after warm-up, on anonymous RSS (RssAnon: the
process's own heap and arrays). Total RSS also counts shared pages: the model's weights mapped
from disk and the object store's shared memory, which a prefill replica's ray.put and a decode
replica's import touch a little more of with each new region the store hands out (measured here:
total RSS of a worker +10 % over 200 requests while its anonymous RSS moved +1 %). That is not
the process's memory and stops at the store's size, so the verdict reads RssAnon; total RSS
growth is reported beside it.

    requests ended:  0 ....... warm-up ....... W ─ base window ─ W+B ....... N-L ─ last window ─ N
    growth = (mean in the last window - mean in the base window) / mean in the base window

    W = warmup_fraction x N, B = L = window_fraction x N (N: the run's requests), counted from the
    process's first sample: a replica started mid-run (a chaos kill's replacement) has its own
    warm-up, loading its model and filling its caches, before its base window. A process must
    have samples in both windows (one started too late for them is reported as not measured);
    `rss_growth_fraction` is the largest growth over the processes measured, so one leaking
    replica is not averaged away by the others.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from load_tests.soak import app_probe

__all__ = ["Monitor", "RssSample", "rss_growth"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RssSample:
    t_s: float
    num_ended: int
    pid: int
    deployment: str
    rss_bytes: int
    anon_bytes: int

    def to_json(self) -> list:
        return [round(self.t_s, 3), self.num_ended, self.pid, self.deployment, self.rss_bytes, self.anon_bytes]


def _mean(values: list[int]) -> float:
    return sum(values) / len(values)


def rss_growth(samples: list[RssSample], num_requests: int, *, warmup_fraction: float, window_fraction: float,
               value: str = "anon_bytes") -> dict:
    """{"rss_growth_fraction": max over processes or None, "by_process": {pid: {...}}}."""
    last_lo = (1.0 - window_fraction) * num_requests
    by_pid: dict[int, list[RssSample]] = {}
    for s in samples:
        by_pid.setdefault(s.pid, []).append(s)
    by_process = {}
    for pid, series in sorted(by_pid.items()):
        base_lo = series[0].num_ended + warmup_fraction * num_requests  # after this process's own warm-up
        base_hi = base_lo + window_fraction * num_requests
        base = [getattr(s, value) for s in series if base_lo <= s.num_ended < base_hi]
        last = [getattr(s, value) for s in series if s.num_ended >= last_lo]
        entry = {"deployment": series[0].deployment, "num_samples": len(series),
                 "first_bytes": getattr(series[0], value), "max_bytes": max(getattr(s, value) for s in series)}
        if base and last and last_lo >= base_hi:
            entry.update(base_mean_bytes=_mean(base), last_mean_bytes=_mean(last),
                         growth_fraction=(_mean(last) - _mean(base)) / _mean(base))
        else:
            entry["growth_fraction"] = None  # restarted mid-run, or the run is too short for the windows
        by_process[pid] = entry
    measured = [e["growth_fraction"] for e in by_process.values() if e["growth_fraction"] is not None]
    return {"rss_growth_fraction": max(measured) if measured else None, "by_process": by_process}


@dataclass
class Monitor:
    """Samples in a daemon thread from `start()` to `stop()`; `num_ended()` is read at each sample."""

    app: str
    num_ended: Callable[[], int]
    clock: Callable[[], float]  # the run's clock (seconds since the load started)
    period_s: float = 1.0
    replicas_every: int = 2
    samples: list[RssSample] = field(default_factory=list)
    replicas_seen: dict[str, set[str]] = field(default_factory=dict)  # deployment -> replica ids
    kv_last: dict[str, dict] = field(default_factory=dict)  # KVTransfer actor name -> its latest stats()
    kv_expired_before_restarts: dict[str, int] = field(default_factory=dict)
    kv_lease_s: float = 30.0  # kv_transfer.lease_s: a held offer's age is lease_s - lease left
    kv_stale_after_s: float = 15.0  # kv_transfer.timeout_s + a margin: no claim comes after that
    stale_kv: dict[str, dict] = field(default_factory=dict)  # server request id -> {"age_s", "num_bytes", "seen_s"}
    num_read_errors: int = 0

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30.0)

    def note_replicas(self) -> None:
        for replica in app_probe.list_replicas(self.app):
            self.replicas_seen.setdefault(replica.deployment, set()).add(replica.replica_id)

    def note_kv_transfer(self) -> None:
        for name, stats in app_probe.kv_transfer_stats(self.app).items():
            last = self.kv_last.get(name)
            if last is not None and stats["num_offered"] < last["num_offered"]:  # restarted: counts from 0
                self.kv_expired_before_restarts[name] = self.kv_expired_before_restarts.get(name, 0) + last["num_expired"]
            self.kv_last[name] = stats
        self.note_stale_kv(app_probe.kv_transfer_held(self.app), older_than_s=self.kv_stale_after_s)

    def note_stale_kv(self, held: dict[str, dict], *, older_than_s: float) -> None:
        """Note each held KV (app_probe.kv_transfer_held) offered more than `older_than_s` ago."""
        for entries in held.values():
            for request_id, entry in entries.items():
                age_s = self.kv_lease_s - entry["lease_left_s"]
                if age_s > older_than_s and request_id not in self.stale_kv:
                    self.stale_kv[request_id] = {"age_s": age_s, "num_bytes": entry["num_bytes"], "seen_s": self.clock()}

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            started = time.monotonic()
            self._sample(notes=i % self.replicas_every == 0)
            i += 1
            self._stop.wait(max(0.0, self.period_s - (time.monotonic() - started)))
        # One more as the load ends (stop() comes after its last request): the last window always
        # has a sample. Without it, a run whose last tenth of requests ended within one period had
        # none there, and its RSS growth went unmeasured (seen: 200 requests on a tiny model, the
        # last sample at 178 ended, the window from 180).
        self._sample(notes=False)

    def _sample(self, *, notes: bool) -> None:
        try:
            t_s, num_ended = self.clock(), self.num_ended()
            for pid, (deployment, rss, anon) in app_probe.process_rss(self.app).items():
                self.samples.append(RssSample(t_s, num_ended, pid, deployment, rss, anon))
            if notes:
                self.note_replicas()
                self.note_kv_transfer()
        except Exception as exc:  # noqa: BLE001 - a missed sample is counted, the run goes on
            self.num_read_errors += 1
            logger.warning("soak monitor: a sample failed (%s: %s)", type(exc).__name__, exc)
