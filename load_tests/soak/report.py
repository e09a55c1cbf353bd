"""The verdict of `kvrelay bench soak`: figures and checks from what the run recorded (pure).

    input                          from
    requests, outcomes             load_tests/soak/workload.py, load_tests/soak/client.py
    baseline, end state            each worker replica's stats() before the load and after it
                                   settled, each KVTransfer actor's stats() (load_tests/soak/app_probe.py)
    RSS growth, replicas seen      load_tests/soak/monitor.py
    kills                          load_tests/soak/chaos.py (--chaos)

The checks, each true or false (None: could not be measured, shown, not failed):

    no_leaked_blocks         every live engine's free blocks back at its baseline (a replica that
                             started during the run: all its blocks), counted from what the engine
                             holds, and no KV export still held
    engine_stats_current     stats() agrees with what the engine holds (else the pools' KV figures,
                             which the routers and `kvrelay status` read, are stale)
    kv_transfer_empty        the KVTransfer actors hold no KV (reference nor bytes)
    no_expired_leases        no KV lease ran out during the run: each one is an export nobody
                             claimed nor released, pinned in the object store until its lease
                             (kv_transfer.lease_s) freed it; the settle wait cannot hide one
    no_hung_requests         every request ended (finished, aborted by the client, or errored)
                             within its deadline
    engines_idle             no request still running or waiting on any engine: none is generating
                             for a client that is gone
    engines_alive            every engine's step loop runs
    rss_flat                 rss_growth_fraction <= the bound: the largest growth of a replica
                             process's anonymous RSS after warm-up (load_tests/soak/monitor.py)
    no_errors                (soak) every request the client did not leave finished, correctly
    replicas_stable          (soak) no replica died and was replaced; (chaos) exactly the killed ones
    failures_from_kills      (chaos) every failed request was in flight at a kill, or started
                             before that kill's recovery
    failures_are_errors      (chaos) every failed request ended with an HTTP error status or an SSE
                             error event: never a hang, a broken connection or a cut stream
    kills_recovered          (chaos) every kill was done and its component came back (the
                             KVTransfer actor: and handed over KV again)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from load_tests.soak.chaos import Kill, Target
from load_tests.soak.client import End, SoakOutcome
from load_tests.soak.workload import SoakRequest

__all__ = ["EndState", "format_report", "summarize"]


@dataclass
class EndState:
    """What the app holds once the load has ended and the app has settled."""

    workers: dict[str, dict]  # replica actor name -> app_probe.replica_stats
    kv_transfer: dict[str, dict]  # actor name -> KVTransfer.stats()
    kv_held: dict[str, dict] = field(default_factory=dict)  # actor name -> app_probe.kv_transfer_held
    kv_expired_before_restarts: int = 0  # leases that ran out in an actor that was restarted since
    stale_kv: dict[str, dict] = field(default_factory=dict)  # soak_monitor.Monitor.stale_kv
    settle_s: float = 0.0  # how long it took to settle, or the bound if it never did
    is_settled: bool = True
    note: str = ""

    def to_json(self) -> dict:
        return {"workers": self.workers, "kv_transfer": self.kv_transfer, "kv_held": self.kv_held,
                "kv_expired_before_restarts": self.kv_expired_before_restarts, "stale_kv": self.stale_kv, "settle_s": self.settle_s,
                "is_settled": self.is_settled, "note": self.note}


def _is_failed(outcome: SoakOutcome) -> bool:
    return outcome.end in (End.ERRORED, End.HUNG)


def _is_error_end(outcome: SoakOutcome) -> bool:
    """Ended by the server with an error the client can read: an HTTP status or an SSE error event."""
    kind = outcome.error_kind or ""
    return outcome.end is End.ERRORED and (kind.startswith("http_") or kind.startswith("sse_"))


def _uses(target: Target, request: SoakRequest) -> bool:
    """Whether a request goes through the killed component (n > 1 is prefilled on the decode pool;
    a KV hand-off needs a token after the first)."""
    if target is Target.DECODE:
        return True
    if target is Target.PREFILL:
        return request.n == 1
    return request.n == 1 and request.body["max_tokens"] > 1


def free_blocks(stats: dict) -> int:
    return stats.get("live_num_free_blocks", stats["num_free_blocks"])


def held_exports(stats: dict) -> int:
    return stats.get("live_num_held_exports", stats["num_held_exports"])


def end_state_figures(baseline: dict[str, dict], end: EndState) -> dict:
    leaked = {}
    stale = []
    for name, stats in sorted(end.workers.items()):
        base = baseline.get(name, {}).get("num_free_blocks", stats["num_blocks"])
        leaked[name] = max(0, base - free_blocks(stats))
        if "live_num_free_blocks" in stats and (
            stats["num_free_blocks"] != stats["live_num_free_blocks"] or stats["num_held_exports"] != stats["live_num_held_exports"]
        ):
            stale.append(f"{name}: stats() says {stats['num_free_blocks']} free / {stats['num_held_exports']} held exports, "
                         f"the engine holds {stats['live_num_free_blocks']} free / {stats['live_num_held_exports']}")
    return {
        "leaked_blocks": sum(leaked.values()),
        "leaked_blocks_by_replica": leaked,
        "num_blocks": sum(s["num_blocks"] for s in end.workers.values()),
        "held_exports": sum(held_exports(s) for s in end.workers.values()),
        "stale_stats": stale,
        "unfinished_on_engines": sum(s["num_running"] + s["num_waiting"] for s in end.workers.values()),
        "dead_engines": sorted(name for name, s in end.workers.items() if not s.get("is_engine_alive", True)),
        "kv_transfer_num_held": sum(s["num_held"] for s in end.kv_transfer.values()),
        "kv_transfer_bytes_held": sum(s["bytes_held"] for s in end.kv_transfer.values()),
        "kv_transfer_num_expired": sum(s["num_expired"] for s in end.kv_transfer.values()) + end.kv_expired_before_restarts,
        "kv_fallbacks": sum(s.get("num_kv_fallbacks", 0) for s in end.workers.values()),
        "settle_s": end.settle_s,
        "is_settled": end.is_settled,
        "note": end.note,
    }


def kill_figures(kill: Kill, outcomes: list[SoakOutcome], requests: dict[int, SoakRequest]) -> dict:
    out = kill.to_json()
    if kill.killed_s is None:
        return out
    t = kill.killed_s
    window_end = kill.recovered_s if kill.recovered_s is not None else max((o.ended_s for o in outcomes), default=t)
    in_flight = [o for o in outcomes if o.started_s <= t < o.ended_s]
    during = [o for o in outcomes if t < o.started_s <= window_end]
    failed = [o for o in in_flight + during if _is_failed(o)]
    successes = [o.ended_s - t for o in outcomes
                 if o.started_s >= t and o.end is End.FINISHED and _uses(kill.target, requests[o.request_id])]
    out.update(
        num_in_flight=len(in_flight),
        num_failed_in_flight=sum(_is_failed(o) for o in in_flight),
        num_started_during_recovery=len(during),
        num_failed_during_recovery=sum(_is_failed(o) for o in during),
        failed_by_kind=dict(sorted(Counter(o.error_kind for o in failed).items())),
        num_failed_without_error=sum(not _is_error_end(o) for o in failed),
        failed_request_ids=sorted(o.request_id for o in failed),
        recovery_s=None if kill.recovered_s is None else kill.recovered_s - t,
        claims_resumed_after_s=None if kill.claims_resumed_s is None else kill.claims_resumed_s - t,
        first_success_after_s=min(successes) if successes else None,
    )
    return out


@dataclass
class Bounds:
    max_rss_growth: float
    is_chaos: bool
    initial_replicas: dict[str, set[str]] = field(default_factory=dict)  # deployment -> ids at the start
    replicas_seen: dict[str, set[str]] = field(default_factory=dict)  # deployment -> ids ever seen


def summarize(requests: list[SoakRequest], outcomes: list[SoakOutcome], baseline: dict[str, dict], end: EndState,
              rss: dict, kills: list[Kill], bounds: Bounds, duration_s: float) -> dict:
    by_id = {r.request_id: r for r in requests}
    ends = Counter(o.end.value for o in outcomes)
    failed = [o for o in outcomes if _is_failed(o)]
    figures = end_state_figures(baseline, end)
    figures["kv_transfer_held_requests"] = _name_kv(
        {rid: {"actor": actor, **entry} for actor, entries in end.kv_held.items() for rid, entry in entries.items()}, outcomes, by_id)
    figures["kv_stale_offers"] = _name_kv(end.stale_kv, outcomes, by_id)
    features = sorted({f for r in requests for f in r.features})
    by_feature = {
        f: {"num_requests": sum(f in by_id[o.request_id].features for o in outcomes),
            "num_failed": sum(f in by_id[o.request_id].features for o in failed)}
        for f in features
    }
    chaos = [kill_figures(k, outcomes, by_id) for k in kills] if bounds.is_chaos else None
    new_replicas = {d: sorted(ids - bounds.initial_replicas.get(d, set())) for d, ids in sorted(bounds.replicas_seen.items())}
    killed = Counter(k.target for k in kills if k.killed_s is not None) if bounds.is_chaos else Counter()
    expected_new = {d: killed[t] for t, d in ((Target.DECODE, "DecodeWorker"), (Target.PREFILL, "PrefillWorker"))}
    unexpected_replicas = {d: ids for d, ids in new_replicas.items() if len(ids) != expected_new.get(d, 0)}

    checks = [
        _check("no_leaked_blocks", figures["leaked_blocks"] == 0 and figures["held_exports"] == 0,
               f"{figures['leaked_blocks']} blocks leaked of {figures['num_blocks']}, {figures['held_exports']} KV exports held"),
        _check("engine_stats_current", not figures["stale_stats"], "; ".join(figures["stale_stats"]) or "stats() matches the engines"),
        _check("kv_transfer_empty", figures["kv_transfer_num_held"] == 0 and figures["kv_transfer_bytes_held"] == 0,
               f"{figures['kv_transfer_num_held']} held, {figures['kv_transfer_bytes_held']} bytes"),
        _check("no_expired_leases", figures["kv_transfer_num_expired"] == 0,
               f"{figures['kv_transfer_num_expired']} KV exports were neither claimed nor released: their leases ran out"),
        _check("no_hung_requests", ends.get("hung", 0) == 0, f"{ends.get('hung', 0)} requests without an end within the deadline"),
        _check("engines_idle", figures["unfinished_on_engines"] == 0,
               f"{figures['unfinished_on_engines']} requests still running or waiting on the engines"),
        _check("engines_alive", not figures["dead_engines"], ", ".join(figures["dead_engines"]) or "every step loop runs"),
        _check("rss_flat", None if rss["rss_growth_fraction"] is None else rss["rss_growth_fraction"] <= bounds.max_rss_growth,
               "not measured (too few samples after warm-up)" if rss["rss_growth_fraction"] is None
               else f"largest growth {rss['rss_growth_fraction']:+.4f}, bound {bounds.max_rss_growth:g}"),
        _check("replicas_stable", not unexpected_replicas,
               "; ".join(f"{d}: {len(ids)} new replicas ({', '.join(ids)}), expected {expected_new.get(d, 0)}"
                         for d, ids in unexpected_replicas.items()) or "no unexpected replica replacement"),
    ]
    unattributed: list[int] = []
    if bounds.is_chaos:
        attributed = {i for k in chaos for i in k.get("failed_request_ids", [])}
        unattributed = sorted(o.request_id for o in failed if o.request_id not in attributed)
        without_error = [o for o in failed if not _is_error_end(o)]
        not_recovered = [f"{k['target']}: {k['error']}" for k in chaos if k["error"] or k["recovered_s"] is None]
        checks += [
            _check("failures_from_kills", not unattributed,
                   f"{len(unattributed)} failed requests not in flight at a kill nor started during its recovery"
                   + (f" (ids {unattributed[:20]})" if unattributed else "")),
            _check("failures_are_errors", not without_error,
                   f"{len(without_error)} failed requests ended without an HTTP error or SSE error event: "
                   + ", ".join(f"{k} {n}" for k, n in sorted(Counter(o.error_kind for o in without_error).items()))),
            _check("kills_recovered", not not_recovered, "; ".join(not_recovered) or "every kill done and recovered"),
        ]
    else:
        checks.append(_check("no_errors", not failed, f"{len(failed)} requests failed: "
                             + ", ".join(f"{k} {n}" for k, n in sorted(Counter(o.error_kind for o in failed).items()))))
    summary = {
        "passed": all(c["ok"] is not False for c in checks),
        "failed_checks": [c["name"] for c in checks if c["ok"] is False],
        "leaked_blocks": figures["leaked_blocks"],
        "hung_requests": ends.get("hung", 0),
        "kv_transfer_bytes_held": figures["kv_transfer_bytes_held"],
        "rss_growth_fraction": rss["rss_growth_fraction"],
        "rss_growth_bound": bounds.max_rss_growth,
        "failed_by_kind": dict(sorted(Counter(o.error_kind for o in failed).items())),
        "num_requests": len(outcomes),
        "ends": {e.value: ends.get(e.value, 0) for e in End},
        "aborted_at": dict(sorted(Counter(o.left_at for o in outcomes if o.end is End.ABORTED).items())),
        "by_feature": by_feature,
        "duration_s": duration_s,
        "requests_per_s": len(outcomes) / duration_s if duration_s > 0 else None,
        "end_state": figures,
        "new_replicas": new_replicas,
        "rss_by_process": rss["by_process"],
        "checks": checks,
        "chaos": chaos,
        "failed_outside_kills": unattributed if bounds.is_chaos else None,
    }
    return summary


def _name_kv(entries: dict[str, dict], outcomes: list[SoakOutcome], by_id: dict[int, SoakRequest]) -> list[dict]:
    """KV entries by the server's request id, each with the soak request it belongs to when the
    client saw that id (it does once a response has begun)."""
    ours = {o.response_id: o for o in outcomes if o.response_id}
    named = []
    for request_id, entry in sorted(entries.items()):
        outcome = ours.get(request_id) or ours.get(request_id.rsplit("-", 1)[0])  # completions: <id>-<prompt>
        item = {"server_request_id": request_id, **entry}
        if outcome is not None:
            request = by_id[outcome.request_id]
            item.update(request_id=outcome.request_id, end=outcome.end.value, left_at=outcome.left_at,
                        error_kind=outcome.error_kind, features=list(request.features), abort=request.abort.value,
                        started_s=outcome.started_s, ended_s=outcome.ended_s)
        named.append(item)
    return named


def _describe_kv(item: dict) -> str:
    if "request_id" not in item:
        return "a request the client saw no id of"
    return (f"soak request {item['request_id']} ({item['abort']}, {'+'.join(item['features']) or 'plain'}; "
            f"{item['end']}{' at ' + item['left_at'] if item['left_at'] else ''}, {item['started_s']:.1f}-{item['ended_s']:.1f} s)")


def _check(name: str, ok: bool | None, detail: str) -> dict:
    return {"name": name, "ok": ok, "detail": detail}


def _counts(counts: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "none"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def format_report(summary: dict, header: str) -> str:
    s, e = summary, summary["end_state"]
    lines = [
        header,
        "",
        f"{'ends':<18}{_counts(s['ends'])}  ({s['duration_s']:.1f} s, {s['requests_per_s'] or 0:.2f} requests/s)",
        f"{'client left at':<18}{_counts(s['aborted_at'])}",
        f"{'failed by kind':<18}{_counts(s['failed_by_kind'])}",
        f"{'by feature':<18}" + ", ".join(f"{f} {v['num_failed']}/{v['num_requests']} failed" for f, v in s["by_feature"].items()),
        f"{'end state':<18}leaked blocks {e['leaked_blocks']} of {e['num_blocks']}, held exports {e['held_exports']}, "
        f"KVTransfer held {e['kv_transfer_num_held']} ({e['kv_transfer_bytes_held']} bytes), "
        f"unfinished on engines {e['unfinished_on_engines']}; settled {'in ' + _s(e['settle_s']) if e['is_settled'] else 'NOT within ' + _s(e['settle_s'])}",
        f"{'':<18}KV leases expired {e['kv_transfer_num_expired']}, KV fallbacks (prompt recomputed) {e['kv_fallbacks']}",
    ]
    if e.get("note"):
        lines.append(f"{'':<18}{e['note']}")
    for item in e["kv_transfer_held_requests"]:
        lines.append(f"{'':<18}KV still held: {item['server_request_id']} ({item['num_bytes']} bytes, lease left "
                     f"{item['lease_left_s']:.1f} s): {_describe_kv(item)}")
    for item in e["kv_stale_offers"]:
        lines.append(f"{'':<18}KV never claimed: {item['server_request_id']} ({item['num_bytes']} bytes, held "
                     f"{item['age_s']:.0f} s when seen at {item['seen_s']:.1f} s): {_describe_kv(item)}")
    growth = [(pid, p) for pid, p in s["rss_by_process"].items() if p["growth_fraction"] is not None]
    lines.append(
        f"{'memory':<18}anonymous RSS, largest growth "
        + ("not measured" if s["rss_growth_fraction"] is None else f"{s['rss_growth_fraction']:+.4f}")
        + f" (bound {s['rss_growth_bound']:g}; total RSS "
        + ("-" if s.get("total_rss_growth_fraction") is None else f"{s['total_rss_growth_fraction']:+.4f}") + "): "
        + ", ".join(f"{p['deployment']}[{pid}] {p['growth_fraction']:+.4f} of {p['base_mean_bytes'] / 2**20:.0f} MiB" for pid, p in growth)
    )
    for k in s["chaos"] or []:
        if k.get("killed_s") is None:
            lines.append(f"{'chaos ' + k['target']:<18}NOT DONE: {k['error']}")
            continue
        lines.append(
            f"{'chaos ' + k['target']:<18}at {k['killed_s']:.1f} s ({k['num_ended_at_kill']} ended): "
            f"{k['num_in_flight']} in flight, {k['num_failed_in_flight']} of them failed; "
            f"{k['num_failed_during_recovery']}/{k['num_started_during_recovery']} started during recovery failed; "
            f"kinds: {_counts(k['failed_by_kind'])}; recovered in {_s(k['recovery_s'])}"
            + (f", KV handed over again after {_s(k['claims_resumed_after_s'])}" if k["target"] == "kv_transfer" else "")
            + f", first success after {_s(k['first_success_after_s'])}"
            + (f"; {k['error']}" if k["error"] else "")
        )
    lines.append("")
    for c in s["checks"]:
        verdict = {True: "pass", False: "FAIL", None: "n/a "}[c["ok"]]
        lines.append(f"  {verdict}  {c['name']:<22}{c['detail']}")
    lines.append("")
    lines.append("soak: PASSED" if s["passed"] else f"soak: FAILED ({', '.join(s['failed_checks'])})")
    return "\n".join(lines)
