"""`kvrelay bench soak [--chaos]`: the seeded workload, how the client ends each request (against a
scripted transport), the memory arithmetic, the verdict on fabricated runs, and short real runs on
a tiny model (integration: each starts Ray and the app).

The real runs assert what the soak promises, exactly: no leaked block, no hung request, nothing
held by the KVTransfer actor, no lease that ran out, and, under chaos, failures only on requests a
kill could reach, each ended by an error the client can read. Never timing."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections import Counter

import httpx
import pytest

from load_tests.soak.app_probe import parse_replica_name
from load_tests.soak.chaos import Kill, LoadProgress, Target
from load_tests.soak.client import End, SoakClient, SoakOutcome
from load_tests.soak.monitor import Monitor, RssSample, rss_growth
from load_tests.soak.params import params_from_args
from load_tests.soak.report import Bounds, EndState, format_report, summarize
from load_tests.soak.workload import AbortPoint, SoakRequest, WorkloadMix, build_workload
from serving.cli.parser import build_parser
from tests.helpers import REPO as REPO_ROOT


# ---- the workload ------------------------------------------------------------------------------
def test_workload_is_seeded_and_mixes_every_feature():
    mix = WorkloadMix()
    first = build_workload(2000, mix, model="m", seed=3)
    assert [r.body for r in first] == [r.body for r in build_workload(2000, mix, model="m", seed=3)]
    assert [r.body for r in first] != [r.body for r in build_workload(2000, mix, model="m", seed=4)]
    features = Counter(f for r in first for f in r.features)
    assert set(features) == {"stream", "n>1", "stop", "shared_prefix", "long", "completions", "sampled"}
    aborts = Counter(r.abort for r in first)
    assert set(aborts) == set(AbortPoint) and 150 < 2000 - aborts[AbortPoint.NONE] < 250  # ~10 %
    for r in first:
        assert r.is_streamed == r.abort.is_streamed if r.abort is not AbortPoint.NONE else True
        assert 1 <= r.n <= mix.max_n and ("n>1" in r.features) == (r.n > 1)
        assert (r.path == "/v1/completions") == ("completions" in r.features) == ("prompt" in r.body)
        if r.abort is AbortPoint.MID_STREAM:
            assert 2 <= r.abort_after_chunks < r.body["max_tokens"]
        if r.abort in (AbortPoint.BEFORE_FIRST_TOKEN, AbortPoint.NON_STREAM):
            assert 0.0 <= r.abort_after_s <= mix.max_abort_after_s
        if "shared_prefix" in r.features and "messages" in r.body:
            assert r.body["messages"][0]["role"] == "system"
    prefixes = {r.body["messages"][0]["content"] for r in first if "shared_prefix" in r.features and "messages" in r.body}
    assert len(prefixes) == mix.num_prefix_groups


# ---- the client against a scripted server ------------------------------------------------------
def _request(*, stream=True, n=1, stop=(), abort=AbortPoint.NONE, after_s=0.0, after_chunks=0, completions=False):
    body = {"model": "m", "max_tokens": 8, "stream": stream, "n": n}
    if stop:
        body["stop"] = list(stop)
    body["prompt" if completions else "messages"] = "hi" if completions else [{"role": "user", "content": "hi"}]
    path = "/v1/completions" if completions else "/v1/chat/completions"
    return SoakRequest(0, path, body, (), abort, after_s, after_chunks)


class Script:
    """A scripted answer: SSE events (each a dict, "[DONE]", or ("sleep", s)) or a JSON body."""

    def __init__(self, events=None, *, status=200, body=None, delay_s=0.0):
        self.events, self.status, self.body, self.delay_s = events or [], status, body, delay_s
        self.num_sent = 0
        self.is_closed_early = False

    def transport(self) -> httpx.AsyncBaseTransport:
        async def handle(request: httpx.Request) -> httpx.Response:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if self.body is not None or self.status != 200:
                return httpx.Response(self.status, json=self.body or {"error": {"message": "busy", "code": "no_worker"}})
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=self._stream())

        return httpx.MockTransport(handle)

    async def _stream(self):
        finished = False
        try:
            for event in self.events:
                if isinstance(event, tuple):
                    await asyncio.sleep(event[1])
                    continue
                self.num_sent += 1
                yield f"data: {event if event == '[DONE]' else json.dumps(event)}\n\n".encode()
            finished = True
        finally:
            self.is_closed_early = not finished


def _delta(text, index=0, finish=None):
    return {"id": "chatcmpl-1", "choices": [{"index": index, "delta": {"content": text}, "finish_reason": finish}]}


def _send(script: Script, request: SoakRequest, *, deadline_s: float = 30.0) -> SoakOutcome:
    async def go():
        async with httpx.AsyncClient(base_url="http://fake", transport=script.transport()) as http:
            return await SoakClient(http, deadline_s=deadline_s).send(request)

    return asyncio.run(go())


TWO_CHOICES = [_delta("a"), _delta("b", 1), _delta("c", 0, "length"), _delta("", 1, "stop"), "[DONE]"]


def test_a_finished_stream_has_every_choice_and_no_stop_string():
    out = _send(Script(TWO_CHOICES), _request(n=2, stop=["x"]))
    assert (out.end, out.error_kind, out.num_content_chunks, out.finish_reasons) == (End.FINISHED, None, 3, ["length", "stop"])
    assert out.response_id == "chatcmpl-1" and out.is_success
    missing = _send(Script(TWO_CHOICES), _request(n=3))
    assert (missing.end, missing.error_kind) == (End.ERRORED, "bad_response:choices")
    stop = _send(Script([_delta("a. b", 0, "stop"), "[DONE]"]), _request(stop=["."]))
    assert (stop.end, stop.error_kind) == (End.ERRORED, "bad_response:stop_string")


def test_server_errors_are_named_by_kind():
    sse = _send(Script([_delta("a"), {"error": {"message": "replica died", "code": "no_worker"}}, "[DONE]"]), _request())
    assert (sse.end, sse.error_kind, sse.error) == (End.ERRORED, "sse_no_worker", "replica died")
    status = _send(Script(status=503), _request())
    assert (status.end, status.error_kind) == (End.ERRORED, "http_503")
    cut = _send(Script([_delta("a")]), _request())
    assert (cut.end, cut.error_kind) == (End.ERRORED, "incomplete_stream")
    body = _send(Script(status=429, body={"error": {"message": "full", "type": "rate_limit"}}), _request(stream=False))
    assert (body.end, body.error_kind, body.error) == (End.ERRORED, "http_429", "full")


def test_the_client_leaves_where_it_was_told_and_closes_the_stream():
    events = [_delta("a"), _delta("b"), _delta("c"), _delta("d", 0, "length"), "[DONE]"]
    script = Script(events)
    hand_off = _send(script, _request(abort=AbortPoint.HAND_OFF))
    assert (hand_off.end, hand_off.left_at, hand_off.num_content_chunks) == (End.ABORTED, "at_first_token", 1)
    assert script.is_closed_early and script.num_sent == 1
    mid = _send(Script(events), _request(abort=AbortPoint.MID_STREAM, after_chunks=3))
    assert (mid.end, mid.left_at, mid.num_content_chunks) == (End.ABORTED, "mid_stream", 3)
    # a stream shorter than the planned leave finishes
    short = _send(Script(events), _request(abort=AbortPoint.MID_STREAM, after_chunks=7))
    assert (short.end, short.left_at) == (End.FINISHED, None)
    slow = Script([("sleep", 30.0), *events])
    early = _send(slow, _request(abort=AbortPoint.BEFORE_FIRST_TOKEN, after_s=0.05))
    assert (early.end, early.left_at, early.num_content_chunks) == (End.ABORTED, "before_first_token", 0)
    # the first token beat the timer: the client leaves right on it
    quick = _send(Script(events), _request(abort=AbortPoint.BEFORE_FIRST_TOKEN, after_s=30.0))
    assert (quick.end, quick.left_at) == (End.ABORTED, "at_first_token")
    abandoned = _send(Script(body={"choices": []}, delay_s=30.0), _request(stream=False, abort=AbortPoint.NON_STREAM, after_s=0.05))
    assert (abandoned.end, abandoned.left_at) == (End.ABORTED, "non_stream")


def test_no_end_within_the_deadline_is_hung():
    hung = _send(Script([_delta("a"), ("sleep", 30.0), "[DONE]"]), _request(), deadline_s=0.1)
    assert (hung.end, hung.error_kind, hung.num_content_chunks) == (End.HUNG, "client_timeout", 1)
    silent = _send(Script(body={"choices": []}, delay_s=30.0), _request(stream=False), deadline_s=0.1)
    assert (silent.end, silent.error_kind) == (End.HUNG, "client_timeout")


def test_non_streamed_answers_are_checked_too():
    body = {"id": "cmpl-9", "choices": [{"index": 0, "text": "ab", "finish_reason": "length"},
                                        {"index": 1, "text": "cd", "finish_reason": "stop"}]}
    out = _send(Script(body=body), _request(stream=False, n=2, completions=True))
    assert (out.end, out.finish_reasons, out.response_id) == (End.FINISHED, ["length", "stop"], "cmpl-9")
    bad = _send(Script(body=body), _request(stream=False, n=2, stop=["c"], completions=True))
    assert bad.error_kind == "bad_response:stop_string"


# ---- the load's progress, shared with the chaos task ------------------------------------------
def test_wait_ended_wakes_at_its_threshold_or_when_the_load_is_done():
    async def go():
        load = LoadProgress(total=4)
        woken = []

        async def waiter(threshold):
            await load.wait_ended(threshold)
            woken.append((threshold, load.num_ended, load.is_done))

        tasks = [asyncio.create_task(waiter(t)) for t in (2, 9)]
        await asyncio.sleep(0)
        for request_id in range(3):
            load.in_flight[request_id] = 0.0
            load.ended(request_id)
            await asyncio.sleep(0)
        load.done()
        await asyncio.gather(*tasks)
        return woken, load.in_flight

    woken, in_flight = asyncio.run(go())
    assert woken == [(2, 2, False), (9, 3, True)] and in_flight == {}


# ---- memory ------------------------------------------------------------------------------------
def _samples(pid: int, values: list[int], deployment="DecodeWorker") -> list[RssSample]:
    # one sample per 10 requests ended: 0, 10, ..., 90 of 100
    return [RssSample(float(i), 10 * i, pid, deployment, 4 * v, v) for i, v in enumerate(values)]


def test_rss_growth_compares_the_last_window_with_the_one_after_warm_up():
    flat = _samples(1, [100, 120, 200, 200, 200, 200, 200, 200, 200, 200])  # warm-up growth is ignored
    leaking = _samples(2, [100, 100, 200, 210, 220, 230, 240, 250, 260, 300])
    restarted = _samples(3, [100, 100, 100])  # died after 20 requests: not measured
    out = rss_growth(flat + leaking + restarted, 100, warmup_fraction=0.2, window_fraction=0.1)
    assert out["by_process"][1]["growth_fraction"] == 0.0
    assert out["by_process"][2]["growth_fraction"] == 0.5  # base window: 200 (20 ended); last: 300 (90 ended)
    assert out["by_process"][3]["growth_fraction"] is None
    assert out["rss_growth_fraction"] == 0.5
    assert rss_growth(leaking, 100, warmup_fraction=0.2, window_fraction=0.1, value="rss_bytes")["rss_growth_fraction"] == 0.5
    assert rss_growth(restarted, 100, warmup_fraction=0.2, window_fraction=0.1)["rss_growth_fraction"] is None


def test_the_monitor_samples_once_more_as_the_load_ends(monkeypatch):
    """The last window has a sample even when the run's last requests end within one period: the
    monitor samples as it stops. (Before, 200 requests on a tiny model ended 178 at the last
    sample, the last window began at 180, and the growth went unmeasured.)"""
    from load_tests.soak import monitor as soak_monitor

    rss = iter(range(100, 200))
    monkeypatch.setattr(soak_monitor.app_probe, "process_rss", lambda app: {7: ("DecodeWorker", 4 * (v := next(rss)), v)})
    monkeypatch.setattr(soak_monitor.app_probe, "list_replicas", lambda app: [])
    monkeypatch.setattr(soak_monitor.app_probe, "kv_transfer_stats", lambda app: {})
    monkeypatch.setattr(soak_monitor.app_probe, "kv_transfer_held", lambda app: {})
    ended = [0]
    monitor = Monitor("app", num_ended=lambda: ended[0], clock=lambda: float(ended[0]), period_s=3600.0)
    monitor.start()
    deadline = time.monotonic() + 30.0
    while not monitor.samples and time.monotonic() < deadline:  # the first sample; then it waits its period
        time.sleep(0.01)
    ended[0] = 200  # the load ends; stop() comes after it
    monitor.stop()
    assert [(s.num_ended, s.anon_bytes) for s in monitor.samples] == [(0, 100), (200, 101)]
    assert monitor.num_read_errors == 0


def test_a_replacement_replica_gets_its_own_warm_up():
    """A replica started mid-run (a chaos kill's replacement) warms up from its first sample: its
    model load and first requests are not compared with the end of the run."""
    replacement = [RssSample(float(i), 10 * i, 4, "DecodeWorker", 0, v)
                   for i, v in zip(range(3, 10), [100, 150, 200, 200, 200, 200, 200])]  # from 30 ended on
    out = rss_growth(replacement, 100, warmup_fraction=0.2, window_fraction=0.1)
    assert out["by_process"][4]["base_mean_bytes"] == 200  # at 50 ended: 30 + the 20 of warm-up
    assert out["rss_growth_fraction"] == 0.0
    late = [RssSample(float(i), 10 * i, 5, "DecodeWorker", 0, 100) for i in range(8, 10)]  # no room for both windows
    assert rss_growth(late, 100, warmup_fraction=0.2, window_fraction=0.1)["by_process"][5]["growth_fraction"] is None


# ---- the verdict -------------------------------------------------------------------------------
def _worker(free, *, num_blocks=100, held=0, live_free=None, live_held=None, running=0, alive=True):
    return {"num_blocks": num_blocks, "num_free_blocks": free, "num_held_exports": held, "num_running": running,
            "num_waiting": 0, "live_num_free_blocks": free if live_free is None else live_free,
            "live_num_held_exports": held if live_held is None else live_held, "is_engine_alive": alive,
            "num_kv_fallbacks": 0}


def _kv(held=0, num_bytes=0, expired=0):
    return {"KVTransfer:a:n": {"num_held": held, "bytes_held": num_bytes, "num_expired": expired}}


def _outcome(i, start, end, kind=End.FINISHED, error_kind=None, left_at=None):
    return SoakOutcome(i, start, end, kind, error_kind, None, left_at)


REQUESTS = [SoakRequest(i, "/v1/chat/completions", {"max_tokens": 8, "n": 2 if i == 3 else 1}, ("stream",))
            for i in range(6)]
FLAT = {"rss_growth_fraction": 0.01, "by_process": {}}
INITIAL = {"PrefillWorker": {"p1"}, "DecodeWorker": {"d1", "d2"}, "OpenAIIngress": {"i1"}}


def _checks(summary) -> dict:
    return {c["name"]: c["ok"] for c in summary["checks"]}


def test_a_clean_soak_passes_every_check():
    outcomes = [_outcome(i, i, i + 1) for i in range(5)] + [_outcome(5, 5, 5.5, End.ABORTED, left_at="mid_stream")]
    end = EndState({"a": _worker(100), "b": _worker(50, num_blocks=50)}, _kv())
    summary = summarize(REQUESTS, outcomes, {"a": _worker(100)}, end, FLAT, [], Bounds(0.05, False, INITIAL, INITIAL), 6.0)
    assert summary["passed"] and summary["failed_checks"] == []
    assert set(_checks(summary)) == {"no_leaked_blocks", "engine_stats_current", "kv_transfer_empty", "no_expired_leases",
                                     "no_hung_requests", "engines_idle", "engines_alive", "rss_flat", "replicas_stable",
                                     "no_errors"}
    assert (summary["leaked_blocks"], summary["hung_requests"], summary["kv_transfer_bytes_held"]) == (0, 0, 0)
    assert summary["ends"] == {"finished": 5, "aborted": 1, "errored": 0, "hung": 0}
    assert summary["aborted_at"] == {"mid_stream": 1} and summary["failed_by_kind"] == {}
    assert summary["requests_per_s"] == 1.0
    assert "soak: PASSED" in format_report(summary, "header")
    json.dumps(summary, allow_nan=False)


def test_leaks_hangs_stale_stats_and_restarts_each_fail_their_check():
    outcomes = [_outcome(0, 0, 1), _outcome(1, 0, 120, End.HUNG, "client_timeout"), _outcome(2, 0, 1, End.ERRORED, "http_500")]
    end = EndState(
        {"a": _worker(90, held=1, live_free=97, live_held=1),  # 3 blocks and an export leaked; stats() is stale
         "b": _worker(100, running=1, alive=False)},  # a replica that started during the run: baseline = all blocks
        _kv(held=1, num_bytes=4096, expired=2), kv_expired_before_restarts=1,
    )
    seen = {**INITIAL, "DecodeWorker": {"d1", "d2", "d3"}}
    summary = summarize(REQUESTS[:3], outcomes, {"a": _worker(100)}, end, {"rss_growth_fraction": 0.2, "by_process": {}},
                        [], Bounds(0.05, False, INITIAL, seen), 10.0)
    assert not summary["passed"]
    assert _checks(summary) == {
        "no_leaked_blocks": False, "engine_stats_current": False, "kv_transfer_empty": False, "no_expired_leases": False,
        "no_hung_requests": False, "engines_idle": False, "engines_alive": False, "rss_flat": False,
        "replicas_stable": False, "no_errors": False,
    }
    assert (summary["leaked_blocks"], summary["hung_requests"], summary["kv_transfer_bytes_held"]) == (3, 1, 4096)
    assert summary["end_state"]["kv_transfer_num_expired"] == 3
    assert summary["failed_by_kind"] == {"client_timeout": 1, "http_500": 1}
    assert summary["new_replicas"]["DecodeWorker"] == ["d3"]
    assert "soak: FAILED" in format_report(summary, "header")


def test_chaos_failures_are_allowed_only_on_requests_a_kill_could_reach():
    kills = [Kill(Target.DECODE, 0.25, "d1", killed_s=10.0, recovered_s=20.0),
             Kill(Target.PREFILL, 0.5, "p1", killed_s=30.0, recovered_s=40.0),
             Kill(Target.KV_TRANSFER, 0.75, "kv", killed_s=50.0, recovered_s=51.0, claims_resumed_s=52.0)]
    outcomes = [
        _outcome(0, 9.0, 11.0, End.ERRORED, "sse_no_worker"),  # in flight at the decode kill: allowed
        _outcome(1, 15.0, 16.0, End.ERRORED, "http_503"),  # started during its recovery: allowed
        _outcome(2, 25.0, 26.0, End.ERRORED, "http_500"),  # no kill near it: not allowed
        _outcome(3, 29.0, 31.0, End.ERRORED, "connection"),  # in flight at the prefill kill, but no error event
        _outcome(4, 31.0, 60.0),  # the first success after the prefill kill: 30 s later
        _outcome(5, 50.5, 53.0),
    ]
    seen = {**INITIAL, "DecodeWorker": {"d1", "d2", "d3"}, "PrefillWorker": {"p1", "p2"}}
    end = EndState({"a": _worker(100)}, _kv())
    summary = summarize(REQUESTS, outcomes, {}, end, FLAT, kills, Bounds(0.05, True, INITIAL, seen), 60.0)
    checks = _checks(summary)
    assert checks["failures_from_kills"] is False and summary["failed_outside_kills"] == [2]
    assert checks["failures_are_errors"] is False
    assert checks["kills_recovered"] is True and checks["replicas_stable"] is True  # one new replica per killed pool
    decode, prefill, kv = summary["chaos"]
    assert (decode["num_in_flight"], decode["num_failed_in_flight"], decode["num_failed_during_recovery"]) == (1, 1, 1)
    assert decode["failed_by_kind"] == {"http_503": 1, "sse_no_worker": 1} and decode["recovery_s"] == 10.0
    assert decode["first_success_after_s"] == 43.0  # request 5, ended at 53 s
    assert (prefill["num_in_flight"], prefill["num_failed_without_error"], prefill["first_success_after_s"]) == (1, 1, 23.0)
    assert (kv["recovery_s"], kv["claims_resumed_after_s"], kv["first_success_after_s"]) == (1.0, 2.0, 3.0)
    not_done = Kill(Target.KV_TRANSFER, 0.75, error="not done: the load ended first (run more requests)")
    summary = summarize(REQUESTS[:2], outcomes[:2], {}, end, FLAT, kills[:1] + [not_done], Bounds(0.05, True, INITIAL, {
        **INITIAL, "DecodeWorker": {"d1", "d2", "d3"}}), 60.0)
    assert _checks(summary)["kills_recovered"] is False and "NOT DONE" in format_report(summary, "header")


def test_replica_names_parse_for_this_app_only():
    replica = parse_replica_name("SERVE_REPLICA::soak1#DecodeWorker#ab12", "soak1")
    assert (replica.deployment, replica.replica_id) == ("DecodeWorker", "ab12")
    assert parse_replica_name("SERVE_REPLICA::soak10#DecodeWorker#ab12", "soak1") is None
    assert parse_replica_name("SERVE_CONTROLLER_ACTOR", "soak1") is None


def test_cli_parses_bench_soak_without_importing_ray():
    code = ("import sys; from serving.cli.parser import build_parser; "
            "build_parser().parse_args(['bench', 'soak', '--chaos']); print('ray' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    assert out.stdout.split() == ["False", "False"]
    args = build_parser().parse_args(["bench", "soak", "--requests", "300", "--concurrency", "8", "--chaos", "--seed", "2",
                                      "--set", "kv_transfer.lease_s=60", "--deadline-s", "30"])
    p = params_from_args(args)
    assert (p.num_requests, p.concurrency, p.is_chaos, p.seed, p.deadline_s) == (300, 8, True, 2, 30.0)
    assert p.overrides == (("kv_transfer.lease_s", 60),) and p.prefill_replicas == p.decode_replicas == 2
    with pytest.raises(SystemExit, match="--requests must be >= 1"):
        params_from_args(build_parser().parse_args(["bench", "soak", "--requests", "0"]))


def test_the_app_config_is_the_default_one_disaggregated_with_fixed_pools():
    from load_tests.soak.bench import soak_config

    p = params_from_args(build_parser().parse_args(["bench", "soak", "--set", "kv_transfer.lease_s=60"]))
    config = soak_config(p, 8123)
    assert (config.mode, config.autoscaling_policy, config.model) == ("disaggregated", None, "smollm2-135m-instruct")
    assert (config.prefill.num_replicas, config.decode.num_replicas, config.http.port) == (2, 2, 8123)
    assert config.kv_transfer.lease_s == 60 and config.app_name.startswith("soak")


# ---- short real runs (tiny model) --------------------------------------------------------------
def _soak(tiny_model_dir, tmp_path, *extra) -> tuple[dict, subprocess.CompletedProcess]:
    out = tmp_path / "soak.json"
    command = [sys.executable, "-m", "serving.cli", "bench", "soak", "--model", str(tiny_model_dir), "--dtype", "float32",
               "--concurrency", "16", "--no-progress", "--json", str(out),
               # a small KV cache, so long prompts at 16 in flight preempt: those paths must not leak either
               "--set", f"engine.kv_cache_bytes={4 * 2**20}", *extra]
    proc = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert out.exists(), proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert proc.returncode == (0 if report["summary"]["passed"] else 1), proc.stderr[-4000:]
    return report, proc


def _assert_nothing_leaked_or_hung(summary: dict, proc) -> None:
    """The issue's promises. Not asserted here: rss_flat (a bound for long runs, not a short one on
    a tiny model) and engine_stats_current (whether stats() is fresh when idle: the soak reports
    it, tests/serving/engine owns it)."""
    checks = _checks(summary)
    context = proc.stdout[-3000:]
    assert (summary["leaked_blocks"], summary["hung_requests"], summary["kv_transfer_bytes_held"]) == (0, 0, 0), context
    for name in ("no_leaked_blocks", "kv_transfer_empty", "no_expired_leases", "no_hung_requests",
                 "engines_idle", "engines_alive", "replicas_stable"):
        assert checks[name] is True, f"{name}: {context}"
    assert summary["rss_growth_fraction"] is not None  # measured


@pytest.mark.integration
def test_short_soak_on_a_tiny_model(tiny_model_dir, tmp_path):
    report, proc = _soak(tiny_model_dir, tmp_path, "--requests", "200")
    s = report["summary"]
    assert s["num_requests"] == 200 and sum(s["ends"].values()) == 200
    _assert_nothing_leaked_or_hung(s, proc)
    assert s["failed_by_kind"] == {} and s["ends"]["errored"] == 0, proc.stdout[-3000:]
    assert s["ends"]["aborted"] > 0 and set(s["by_feature"]) == {"stream", "n>1", "stop", "shared_prefix", "long",
                                                                 "completions", "sampled"}
    assert set(report["hardware"]["isa"]) >= {"avx2"} and report["config"]["serve"]["mode"] == "disaggregated"
    assert len(report["raw"]["outcomes"]) == 200 and report["raw"]["rss_samples"]["rows"]


@pytest.mark.integration
def test_short_chaos_soak_on_a_tiny_model(tiny_model_dir, tmp_path):
    report, proc = _soak(tiny_model_dir, tmp_path, "--requests", "450", "--chaos")
    s = report["summary"]
    assert sum(s["ends"].values()) == 450
    _assert_nothing_leaked_or_hung(s, proc)
    checks = _checks(s)
    for name in ("kills_recovered", "failures_from_kills", "failures_are_errors"):
        assert checks[name] is True, f"{name}: {proc.stdout[-3000:]}"
    assert [k["target"] for k in s["chaos"]] == ["decode", "prefill", "kv_transfer"]
    for kill in s["chaos"]:
        assert kill["killed_s"] is not None and kill["recovered_s"] is not None, kill
        assert all(kind.startswith(("http_", "sse_")) for kind in kill["failed_by_kind"]), kill
    assert s["chaos"][2]["claims_resumed_s"] is not None  # the restarted KVTransfer actor hands KV over again
