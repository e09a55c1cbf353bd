"""`kvrelay bench soak [--chaos]`: thousands of mixed requests with client aborts, then proof that
nothing leaked, nothing hung and memory stayed flat; with --chaos, components die along the way.

    Ray of its own (load_tests/local_ray.py) ─▶ the app of deploy/local.yaml, disaggregated,
    --prefill-replicas + --decode-replicas, fixed (no autoscaling), app name soak<pid>
        │  wait until every pool runs its replicas; baseline: each engine's free blocks
        ▼
    load: --requests requests (load_tests/soak/workload.py: streamed and not, n > 1, stop
          strings, shared prefixes, long prompts, completions, sampling, --abort-fraction client
          aborts before the first token / at the KV hand-off / mid-stream / non-streamed), at most
          --concurrency in flight, each with a --deadline-s (load_tests/soak/client.py: how each
          request ended)
          meanwhile: RSS of every replica process, which replicas exist (load_tests/soak/monitor.py)
          --chaos: kill decode, prefill, KVTransfer at 25/50/75 % (load_tests/soak/chaos.py)
        │
        ▼
    settle: wait (at most --settle-s, shorter than the KV lease so a lease cannot hide a missed
            release) until the engines are idle and back at their baseline and the KVTransfer
            actors hold nothing; then read the end state (load_tests/soak/app_probe.py)
        ▼
    verdict: load_tests/soak/report.py (its docstring lists the checks); exit 1 if one failed

Two replicas per pool by default, in both modes: a pool must outlive one replica's death for
"only the requests on the killed replica fail" to be testable, and the soak without chaos runs the
same topology so the two are comparable. `--json PATH` writes {summary, config, raw, hardware,
duration_s}; summary has leaked_blocks, hung_requests, kv_transfer_bytes_held,
rss_growth_fraction and failed_by_kind.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import time

import httpx

from load_tests import hardware
from load_tests.common import StepLog, command_line, write_report
from load_tests.local_ray import free_port, local_ray
from load_tests.scenario.servers import kvrelay_server
from load_tests.serve.load import Progress
from load_tests.soak import app_probe
from load_tests.soak.chaos import Chaos, LoadProgress
from load_tests.soak.client import SoakClient, SoakOutcome
from load_tests.soak.monitor import Monitor, rss_growth
from load_tests.soak.params import SoakParams, add_arguments, params_from_args
from load_tests.soak.report import Bounds, EndState, end_state_figures, format_report, summarize
from load_tests.soak.workload import SoakRequest, WorkloadMix, build_workload

__all__ = ["SoakParams", "add_arguments", "params_from_args", "run", "run_from_args", "soak_config"]

WORKER_DEPLOYMENTS = ("PrefillWorker", "DecodeWorker")


_progress = StepLog("bench soak", width=7)


def soak_config(p: SoakParams, port: int):
    """The config file's app, disaggregated, with fixed pools and this run's name and port."""
    from serving.config import load_config

    overrides: dict = {
        "mode": "disaggregated", "app_name": f"soak{os.getpid()}", "http.host": "127.0.0.1", "http.port": port,
        "autoscaling_policy": None, "prefill.num_replicas": p.prefill_replicas, "decode.num_replicas": p.decode_replicas,
    }
    if p.model is not None:
        overrides["model"] = p.model
    if p.dtype is not None:
        overrides["engine.dtype"] = p.dtype
    overrides.update(dict(p.overrides))
    return load_config(p.config, overrides=overrides)


# ---- reading the app (blocking: in this thread or via asyncio.to_thread) -----------------------
def _workers(app: str) -> dict[str, dict]:
    return {r.actor_name: app_probe.replica_stats(r) for r in app_probe.list_replicas(app) if r.deployment in WORKER_DEPLOYMENTS}


def _replica_ids(app: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for replica in app_probe.list_replicas(app):
        out.setdefault(replica.deployment, set()).add(replica.replica_id)
    return out


def _wait_pools(app: str, num_replicas: dict[str, int], timeout_s: float) -> bool:
    """Until every pool runs its replica count and each worker replica answers stats()."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = app_probe.replica_states(app)
        if all(states.get(d, {}).get("RUNNING", 0) >= n and sum(states.get(d, {}).values()) == n for d, n in num_replicas.items()):
            try:
                workers = _workers(app)
            except app_probe.ProbeError:
                workers = {}
            if len(workers) == sum(num_replicas[d] for d in WORKER_DEPLOYMENTS) and all(w["ready"] for w in workers.values()):
                return True
        time.sleep(0.5)
    return False


def _settle(app: str, baseline: dict[str, dict], num_replicas: dict[str, int], p: SoakParams, monitor: Monitor) -> EndState:
    """Wait until the app is idle and clean (at most p.settle_s), then read its end state. KV still
    held past the claim timeout is noted in `monitor.stale_kv` as the wait sees it: its lease may
    run out before the wait ends, and the report should still name it."""
    notes = []
    if not _wait_pools(app, num_replicas, p.recovery_timeout_s):
        notes.append(f"the pools were not all back to {num_replicas} running replicas within {p.recovery_timeout_s:g} s")
    started = time.monotonic()
    while True:
        try:
            end = EndState(_workers(app), app_probe.kv_transfer_stats(app))
            f = end_state_figures(baseline, end)
            if f["kv_transfer_num_held"]:
                end.kv_held = app_probe.kv_transfer_held(app)
        except app_probe.ProbeError:
            if time.monotonic() - started >= p.settle_s:
                raise
            time.sleep(0.5)
            continue
        monitor.note_stale_kv(end.kv_held, older_than_s=monitor.kv_stale_after_s)
        is_clean = not (f["leaked_blocks"] or f["held_exports"] or f["unfinished_on_engines"] or f["kv_transfer_num_held"])
        end.settle_s = time.monotonic() - started
        if is_clean or end.settle_s >= p.settle_s:
            end.is_settled = is_clean
            end.note = "; ".join(notes)
            return end
        time.sleep(0.5)


# ---- the load ------------------------------------------------------------------------------------
async def _drive(requests: list[SoakRequest], p: SoakParams, base_url: str, load: LoadProgress, t0: float,
                 chaos: Chaos | None) -> list[SoakOutcome]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    outcomes: list[SoakOutcome] = []
    progress = Progress(len(requests), "[bench soak] requests", is_enabled=p.is_progress_shown)
    # No httpx timeout: each request's deadline (soak/client.py) bounds everything it waits for.
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as http:
        client = SoakClient(http, deadline_s=p.deadline_s, t0=t0)
        pending = iter(requests)

        async def worker() -> None:
            for request in pending:  # one iterator shared by the workers: each request once
                load.in_flight[request.request_id] = client.now()
                outcome = await client.send(request)
                outcomes.append(outcome)
                load.ended(request.request_id)
                progress.update(outcome)

        chaos_task = asyncio.create_task(chaos.run(load)) if chaos is not None else None
        try:
            await asyncio.gather(*(worker() for _ in range(p.concurrency)))
        finally:
            load.done()
            if chaos_task is not None:
                await chaos_task
    return sorted(outcomes, key=lambda o: o.request_id)


def run(p: SoakParams, *, command: str = "") -> dict:
    """The whole soak; prints the report; returns {summary, config, raw, hardware, duration_s}."""
    import ray

    from serving.engine.modeling.loader import resolve_model_dir

    started = time.monotonic()
    config = soak_config(p, free_port())
    app = config.app_name
    num_replicas = {"PrefillWorker": p.prefill_replicas, "DecodeWorker": p.decode_replicas,
                    "OpenAIIngress": config.ingress.num_replicas}
    machine = hardware.machine_record(num_threads=config.engine_config(config.prefill).num_threads)  # torch threads per replica
    model_dir = resolve_model_dir(config.model)  # converts the default model once, before Ray starts
    mix = WorkloadMix(abort_fraction=p.abort_fraction)
    requests = build_workload(p.num_requests, mix, model=config.model_name, seed=p.seed)
    base_url = f"http://{config.http.host}:{config.http.port}"
    verdict = {"passed": True}  # Ray's logs are kept when the soak fails: the replicas' side of it
    with local_ray("bench soak", _progress, keep_logs=lambda: not verdict["passed"]):
        with kvrelay_server(config, progress=_progress) as server:
            if not _wait_pools(app, num_replicas, p.recovery_timeout_s):
                raise SystemExit(f"kvrelay bench soak: the pools did not reach {num_replicas} running replicas")
            initial_replicas = _replica_ids(app)
            baseline = _workers(app)
            load = LoadProgress(len(requests))
            t0 = time.monotonic()
            monitor = Monitor(app, num_ended=lambda: load.num_ended, clock=lambda: time.monotonic() - t0,
                              period_s=p.rss_period_s, kv_lease_s=config.kv_transfer.lease_s,
                              kv_stale_after_s=config.kv_transfer.timeout_s + 5.0)
            monitor.note_replicas()
            chaos = (Chaos(app, num_replicas, monitor.clock, recovery_timeout_s=p.recovery_timeout_s, progress=_progress)
                     if p.is_chaos else None)
            _progress(f"{len(requests)} requests, concurrency {p.concurrency}" + (", chaos" if chaos else ""))
            monitor.start()
            try:
                outcomes = asyncio.run(_drive(requests, p, base_url, load, t0, chaos))
            finally:
                monitor.stop()
            duration_s = time.monotonic() - t0
            _progress(f"load done in {duration_s:.1f} s; settling (at most {p.settle_s:g} s)")
            end = _settle(app, baseline, num_replicas, p, monitor)
            monitor.note_replicas()
            monitor.note_kv_transfer()
            end.kv_expired_before_restarts = sum(monitor.kv_expired_before_restarts.values())
            end.stale_kv = monitor.stale_kv
            hardware.finish_machine_record(machine, ray_version=ray.__version__)

        kills = chaos.kills if chaos else []
        windows = {"warmup_fraction": p.warmup_fraction, "window_fraction": p.window_fraction}
        rss = rss_growth(monitor.samples, len(requests), value="anon_bytes", **windows)
        bounds = Bounds(p.max_rss_growth, p.is_chaos, initial_replicas, monitor.replicas_seen)
        summary = summarize(requests, outcomes, baseline, end, rss, kills, bounds, duration_s)
        summary["total_rss_growth_fraction"] = rss_growth(monitor.samples, len(requests), value="rss_bytes", **windows)["rss_growth_fraction"]
        verdict["passed"] = summary["passed"]
    header = (
        f"kvrelay bench soak{' --chaos' if p.is_chaos else ''}: {len(requests)} requests at concurrency {p.concurrency}, "
        f"seed {p.seed}, deadline {p.deadline_s:g} s; {config.model} ({config.engine.dtype}), disaggregated, "
        f"{p.prefill_replicas} prefill + {p.decode_replicas} decode replicas; app started in {server['startup_s']:.0f} s"
    )
    print(format_report(summary, header))
    return {
        "summary": summary,
        "config": {
            "command": command, "params": dataclasses.asdict(p), "mix": dataclasses.asdict(mix),
            "model_dir": str(model_dir), "serve": config.model_dump(mode="json"), "startup_s": server["startup_s"],
        },
        "raw": {
            "requests": [r.to_json() for r in requests],
            "outcomes": [o.to_json() for o in outcomes],
            "baseline": baseline,
            "end_state": end.to_json(),
            "kills": [k.to_json() for k in kills],
            "rss_samples": {"columns": ["t_s", "num_ended", "pid", "deployment", "rss_bytes", "anon_bytes"],
                            "rows": [s.to_json() for s in monitor.samples]},
            "replicas_initial": {d: sorted(ids) for d, ids in initial_replicas.items()},
            "replicas_seen": {d: sorted(ids) for d, ids in monitor.replicas_seen.items()},
            "monitor_read_errors": monitor.num_read_errors,
        },
        "hardware": machine,
        "duration_s": time.monotonic() - started,
    }


def run_from_args(args: argparse.Namespace, argv: list[str]) -> int:
    from serving.config import ConfigError

    p = params_from_args(args)
    try:
        report = run(p, command=command_line(argv))
    except ConfigError as exc:
        print(f"kvrelay bench soak: {exc}", file=sys.stderr)
        return 2
    if args.json:
        _progress(f"wrote {write_report(args.json, report, default=str)}")
    return 0 if report["summary"]["passed"] else 1
