"""`kvrelay bench serve`: the client's arithmetic against a scripted fake OpenAI server with known
delays (exact TTFT, TPOT, ITL, E2E, throughput and goodput on a virtual clock), percentiles,
arrivals, dataset shapes, and a seconds-long run of the command against the fake server over
real HTTP."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
import pytest

from load_tests.local_ray import free_port
from load_tests.serve.bench import BenchParams, format_table, run_rates
from load_tests.serve.client import RequestSpec, ServeClient
from load_tests.serve.datasets import (
    arrival_times,
    chat_burst,
    multi_turn,
    parse_length,
    random_dataset,
    shared_prefix,
)
from load_tests.serve.load import run_load, schedule
from load_tests.serve.metrics import parse_slo, percentile, stats_ms, summarize_records
from load_tests.serve.params import params_from_args
from serving.cli.parser import build_parser
from tests.asgi import local_app
from tests.helpers import REPO as REPO_ROOT
from tests.helpers import tiny_engine_config


# ---- the scripted fake server ----------------------------------------------------------------
class VirtualClock:
    """Time moves only when someone sleeps: the fake server's delays are the only time there is."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(0)  # first let tasks that are ready run (and read the clock) at the old time
        self.t += max(0.0, seconds)
        await asyncio.sleep(0)


@dataclass
class Script:
    """One answer: the first content chunk after `first_s`, then one chunk after each gap."""

    first_s: float
    gaps_s: list[float]
    tokens_per_chunk: int = 1
    is_usage_sent: bool = True
    status: int = 200


@dataclass
class FakeOpenAI:
    """Answers /v1/models and streams /v1/chat/completions and /v1/completions per `script(i)`
    (i: the request's index in arrival order), sleeping on `clock`. Served through an httpx
    transport (`transport()`, in-process) or as an ASGI app (`asgi`, for uvicorn)."""

    script: object  # callable(int) -> Script
    clock: object
    bodies: list[dict] = field(default_factory=list)
    num_in_flight: int = 0
    max_in_flight: int = 0

    async def chunks(self, body: dict):
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        async for part in self._chunks(body):
            if part == b"data: [DONE]\n\n":  # the client stops reading here
                self.num_in_flight -= 1
            yield part

    async def _chunks(self, body: dict):
        index = len(self.bodies)
        self.bodies.append(body)
        s = self.script(index)
        is_chat = "messages" in body

        def chunk(content: str | None, usage: dict | None = None) -> bytes:
            if is_chat:
                choices = [] if content is None else [{"index": 0, "delta": {"content": content}}]
            else:
                choices = [] if content is None else [{"index": 0, "text": content}]
            out = {"id": f"r{index}", "choices": choices}
            if usage:
                out["usage"] = usage
            return f"data: {json.dumps(out)}\n\n".encode()

        if is_chat:  # the role chunk: no content, not a token
            yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'role': 'assistant'}}]})}\n\n".encode()
        for delay in [s.first_s, *s.gaps_s]:
            await self.clock.sleep(delay)
            yield chunk(" tok" * s.tokens_per_chunk)
        if s.is_usage_sent:
            num = s.tokens_per_chunk * (1 + len(s.gaps_s))
            yield chunk(None, {"prompt_tokens": 7, "completion_tokens": num, "total_tokens": 7 + num})
        yield b"data: [DONE]\n\n"

    def transport(self) -> httpx.AsyncBaseTransport:
        async def handle(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/v1/models":
                return httpx.Response(200, json={"object": "list", "data": [{"id": "fake-model"}]})
            body = json.loads(request.content)
            if self.script(len(self.bodies)).status != 200:
                self.bodies.append(body)
                return httpx.Response(503, json={"error": {"message": "busy"}})
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=self.chunks(body))

        return httpx.MockTransport(handle)

    async def asgi(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/v1/models":
            payload = json.dumps({"object": "list", "data": [{"id": "fake-model"}]}).encode()
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": payload})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        async for part in self.chunks(json.loads(body)):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


def _chat_specs(num: int, max_tokens: int = 5) -> list[RequestSpec]:
    return [RequestSpec(i, max_tokens, messages=[{"role": "user", "content": f"hi {i}"}]) for i in range(num)]


async def _run(server: FakeOpenAI, specs, *, endpoint="chat", **load):
    async with httpx.AsyncClient(base_url="http://fake", transport=server.transport()) as http:
        client = ServeClient(http, model="fake-model", endpoint=endpoint, clock=server.clock)
        return await run_load(client, specs, **load)


# Delays are powers of two, so every figure is exact in binary floating point.
FAST = Script(first_s=0.125, gaps_s=[0.03125] * 4)  # 5 tokens: TTFT 0.125, E2E 0.25, TPOT 0.03125
SLOW_FIRST = Script(first_s=0.375, gaps_s=[0.03125] * 4)  # TTFT 0.375, E2E 0.5


# ---- the client's arithmetic -----------------------------------------------------------------
def test_exact_ttft_tpot_itl_e2e_throughput_and_goodput():
    server = FakeOpenAI(lambda i: SLOW_FIRST if i == 3 else FAST, VirtualClock())
    records, duration_s = asyncio.run(_run(server, _chat_specs(4), max_concurrency=1))

    fast = records[0]
    assert fast.is_success and fast.error is None
    assert fast.ttft_s == 0.125
    assert fast.itl_s == [0.03125] * 4
    assert fast.e2e_s == 0.25
    assert fast.tpot_s == 0.03125
    assert (fast.num_output_tokens, fast.num_prompt_tokens, fast.token_count_source) == (5, 7, "usage")
    assert [r.sent_s for r in records] == [0.0, 0.25, 0.5, 0.75]  # one at a time, back to back
    assert (records[3].ttft_s, records[3].e2e_s, records[3].tpot_s) == (0.375, 0.5, 0.03125)
    assert duration_s == 1.25

    summary = summarize_records(records, duration_s, parse_slo("ttft_ms=200,tpot_ms=40"))
    assert summary["num_completed"] == 4 and summary["num_failed"] == 0
    assert summary["request_throughput"] == 4 / 1.25
    assert summary["output_throughput"] == 20 / 1.25
    assert summary["total_token_throughput"] == (20 + 28) / 1.25
    assert summary["num_slo_met"] == 3  # the slow first token misses ttft_ms=200
    assert summary["goodput"] == 3 / 1.25
    # interpolated percentiles: rank (n - 1) x q / 100 is not exact in binary, hence approx
    assert summary["ttft_ms"] == pytest.approx({"mean": 187.5, "p50": 125.0, "p90": 300.0, "p95": 337.5, "p99": 367.5},
                                               rel=1e-12)
    assert summary["tpot_ms"]["mean"] == summary["tpot_ms"]["p99"] == 31.25
    assert summary["itl_ms"] == dict.fromkeys(("mean", "p50", "p90", "p95", "p99"), 31.25)
    assert summary["e2e_ms"]["mean"] == 312.5
    # a TPOT bound alone is met by all four; an E2E bound of 300 ms by three
    assert summarize_records(records, duration_s, {"tpot_ms": 31.25})["num_slo_met"] == 4
    assert summarize_records(records, duration_s, {"e2e_ms": 300})["num_slo_met"] == 3


def test_tokens_by_usage_when_chunks_carry_several_and_by_chunks_without_usage():
    scripts = [
        Script(first_s=0.25, gaps_s=[0.125, 0.125], tokens_per_chunk=2),  # 3 chunks, 6 tokens (usage)
        Script(first_s=0.25, gaps_s=[0.125, 0.125], is_usage_sent=False),  # 3 chunks, 3 tokens
    ]
    server = FakeOpenAI(lambda i: scripts[i], VirtualClock())
    records, _ = asyncio.run(_run(server, _chat_specs(2), max_concurrency=1))
    by_usage, by_chunks = records
    assert (by_usage.num_output_tokens, by_usage.token_count_source) == (6, "usage")
    assert by_usage.itl_s == [0.125, 0.125]  # ITL is per chunk
    assert by_usage.tpot_s == 0.25 / 5
    assert (by_chunks.num_output_tokens, by_chunks.token_count_source, by_chunks.num_prompt_tokens) == (3, "chunks", None)
    assert by_chunks.tpot_s == 0.125


def test_completions_endpoint_with_token_ids_and_a_failed_request():
    scripts = [Script(0.5, [0.25]), Script(0.5, [], status=503)]
    server = FakeOpenAI(lambda i: scripts[i], VirtualClock())
    specs = [RequestSpec(0, 2, prompt=[101, 102, 103]), RequestSpec(1, 2, prompt="text")]
    records, duration_s = asyncio.run(_run(server, specs, endpoint="completions", max_concurrency=1))
    assert server.bodies[0]["prompt"] == [101, 102, 103]
    assert server.bodies[0]["stream_options"] == {"include_usage": True}
    assert (records[0].ttft_s, records[0].e2e_s, records[0].tpot_s) == (0.5, 0.75, 0.25)
    assert not records[1].is_success and records[1].error.startswith("HTTP 503")
    summary = summarize_records(records, duration_s, {"ttft_ms": 1000})
    assert (summary["num_completed"], summary["num_failed"], summary["num_slo_met"]) == (1, 1, 1)


def test_one_token_answer_has_no_tpot_and_passes_a_tpot_bound():
    server = FakeOpenAI(lambda i: Script(0.25, []), VirtualClock())
    records, duration_s = asyncio.run(_run(server, _chat_specs(1, max_tokens=1)))
    assert records[0].tpot_s is None and records[0].itl_s == []
    summary = summarize_records(records, duration_s, {"tpot_ms": 1})
    assert summary["num_slo_met"] == 1 and summary["tpot_ms"]["p50"] is None


def test_multi_turn_sends_the_history_and_waits_for_the_previous_answer():
    server = FakeOpenAI(lambda i: Script(0.125, [0.125]), VirtualClock())
    specs = multi_turn(2, 3, parse_length(4), parse_length(2), seed=0)
    records, _ = asyncio.run(_run(server, specs))  # no concurrency cap: sessions still go in order
    assert [(s.session_id, s.turn) for s in specs] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    by_session = {}
    for body in server.bodies:
        by_session.setdefault(body["messages"][0]["content"], []).append(body["messages"])
    assert len(by_session) == 2
    for turns in by_session.values():
        assert [len(m) for m in turns] == [1, 3, 5]  # user; user, assistant, user; ...
        assert [m["role"] for m in turns[2]] == ["user", "assistant", "user", "assistant", "user"]
        assert turns[1][1] == {"role": "assistant", "content": " tok tok"}
        assert turns[2][:3] == turns[1]
    assert all(r.is_success for r in records)
    turn_starts = {(r.session_id, r.turn): r.sent_s for r in records}
    end_of = {(r.session_id, r.turn): r.sent_s + r.e2e_s for r in records}
    for session in (0, 1):
        for turn in (1, 2):
            assert turn_starts[(session, turn)] >= end_of[(session, turn - 1)]


def test_requests_are_sent_at_their_arrival_times():
    server = FakeOpenAI(lambda i: Script(0.0, []), VirtualClock())  # answers take no time
    records, duration_s = asyncio.run(_run(server, _chat_specs(50, max_tokens=1), request_rate=8.0, burstiness=0.5,
                                           seed=4))
    expected = arrival_times(50, 8.0, 0.5, seed=4)
    assert [r.scheduled_s for r in records] == expected
    assert [r.sent_s for r in records] == expected
    assert duration_s == expected[-1]


def test_concurrency_cap_bounds_the_requests_in_flight():
    for cap, expected in ((None, 12), (3, 3), (1, 1)):
        server = FakeOpenAI(lambda i: Script(0.125, [0.125] * 2), VirtualClock())
        records, _ = asyncio.run(_run(server, _chat_specs(12), max_concurrency=cap))
        assert server.max_in_flight == expected and all(r.is_success for r in records)


# ---- percentiles, arrivals, datasets ---------------------------------------------------------
def test_percentiles_interpolate_like_numpy():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([5.0], 99) == 5.0
    values = np.random.default_rng(0).exponential(1.0, 101).tolist()
    for q in (0, 50, 90, 95, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)
    assert stats_ms([0.001, 0.003]) == pytest.approx({"mean": 2.0, "p50": 2.0, "p90": 2.8, "p95": 2.9, "p99": 2.98},
                                                     rel=1e-12)
    assert stats_ms([])["p99"] is None


def test_poisson_and_gamma_arrivals_are_seeded_with_the_asked_mean_rate():
    poisson = arrival_times(20_000, 4.0, 1.0, seed=1)
    assert poisson == arrival_times(20_000, 4.0, 1.0, seed=1)
    assert poisson != arrival_times(20_000, 4.0, 1.0, seed=2)
    assert poisson[0] == 0.0 and (np.diff(poisson) >= 0).all()
    for burstiness, cv in ((1.0, 1.0), (0.25, 2.0), (4.0, 0.5)):
        gaps = np.diff(arrival_times(20_000, 4.0, burstiness, seed=1))
        assert gaps.mean() == pytest.approx(0.25, rel=0.05)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)  # 1/sqrt(shape)
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]


def test_shared_prefix_groups():
    specs = shared_prefix(12, 3, 20, 5, parse_length(8), seed=0)
    texts = [s.messages[0]["content"].split() for s in specs]
    assert all(len(t) == 25 for t in texts)
    for i, words in enumerate(texts):
        assert words[:20] == texts[i % 3][:20]  # the group's prefix
    assert len({tuple(t[:20]) for t in texts}) == 3
    assert len({tuple(t[20:]) for t in texts}) == 12  # fresh suffixes
    assert [s.kind for s in specs[:4]] == ["group0", "group1", "group2", "group0"]
    assert all(s.max_tokens == 8 and s.approx_prompt_tokens == 25 for s in specs)


def test_random_lengths_and_token_ids():
    specs = random_dataset(200, parse_length("10-20"), parse_length("normal:50:5"), seed=3)
    lengths = [len(s.messages[0]["content"].split()) for s in specs]
    assert min(lengths) >= 10 and max(lengths) <= 20 and len(set(lengths)) > 5
    assert [s.approx_prompt_tokens for s in specs] == lengths
    assert 45 < np.mean([s.max_tokens for s in specs]) < 55
    assert specs[0].messages == random_dataset(200, parse_length("10-20"), parse_length("normal:50:5"), seed=3)[0].messages
    ids = random_dataset(2, parse_length(16), parse_length(4), token_ids_vocab=1000)
    assert all(len(s.prompt) == 16 and all(100 <= t < 1000 for t in s.prompt) for s in ids)
    for bad in ("0", "5-3", "normal:x:1", "abc"):
        with pytest.raises(ValueError, match="want N, LOW-HIGH"):
            parse_length(bad)


def test_chat_burst_schedule():
    specs = chat_burst(40, parse_length(8), parse_length(4), request_rate=4.0, burst_every_s=4.0, burst_size=3,
                       burst_len=64, burst_output_len=16)
    long = [s for s in specs if s.kind == "long"]
    assert [s.arrival_s for s in long] == [4.0] * 3 + [8.0] * 3  # the stream lasts 40 / 4 = 10 s
    assert all(len(s.messages[0]["content"].split()) == 64 and s.max_tokens == 16 for s in long)
    timed = schedule(specs, 4.0, 1.0, seed=0)
    times = [at for at, _ in timed]
    assert times == sorted(times) and len(timed) == 46
    assert sum(1 for at, s in timed if s.kind == "chat") == 40


def test_slo_parsing():
    assert parse_slo("ttft_ms=200, tpot_ms=50") == {"ttft_ms": 200.0, "tpot_ms": 50.0}
    assert parse_slo(None) == {}
    for bad, match in (("ttft=200", "KEY=MS"), ("ttft_ms=fast", "milliseconds"), ("e2e_ms=0", "> 0")):
        with pytest.raises(ValueError, match=match):
            parse_slo(bad)


def test_cli_parses_bench_serve():
    args = build_parser().parse_args([
        "bench", "serve", "--request-rate", "1,2.5,inf", "--dataset", "shared-prefix", "--slo", "ttft_ms=100",
        "--max-concurrency", "4", "--burstiness", "0.5",
    ])
    p = params_from_args(args)
    assert p.request_rates == (1.0, 2.5, math.inf) and p.dataset == "shared-prefix" and p.max_concurrency == 4
    for argv, match in (
        (["--request-rate", "0"], "request-rate"),
        (["--dataset", "chat-burst"], "finite --request-rate"),
        (["--slo", "ttft=1"], "KEY=MS"),
        (["--input-len", "x"], "want N"),
        (["--extra-body", "[1]"], "JSON object"),
    ):
        with pytest.raises(SystemExit, match=match):
            params_from_args(build_parser().parse_args(["bench", "serve", *argv]))
    assert isinstance(args, argparse.Namespace)


def test_run_rates_and_table_on_the_virtual_clock():
    server = FakeOpenAI(lambda i: FAST, VirtualClock())
    p = BenchParams(base_url="http://fake", num_prompts=4, input_len="8", output_len="5", request_rates=(2.0, math.inf),
                    max_concurrency=1, slo="ttft_ms=200", is_progress_shown=False, extra_body='{"min_tokens": 5}')
    model, runs = asyncio.run(run_rates(p, transport=server.transport(), clock=server.clock))
    assert model == "fake-model" and [r.request_rate for r in runs] == [2.0, math.inf]
    assert server.bodies[0]["min_tokens"] == 5 and server.bodies[0]["model"] == "fake-model"
    assert runs[1].duration_s == 1.0 and runs[1].summary["goodput"] == 4.0
    table = format_table(p, model, runs)
    assert "goodput/s (SLO below)" in table and "SLO: ttft_ms <= 200" in table and "4/4" in table
    assert "TTFT p99, ms" in table and "counted by: usage" in table


# ---- the command, end to end, against the fake server over HTTP ------------------------------
class RealClock:
    def now(self) -> float:
        return time.perf_counter()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@pytest.fixture
def fake_server_url():
    import uvicorn

    port = free_port()
    app = FakeOpenAI(lambda i: Script(0.05, [0.01] * 3), RealClock())
    server = uvicorn.Server(uvicorn.Config(app.asgi, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                                            interface="asgi3"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the fake server did not start"
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_bench_serve_command_against_the_fake_server(fake_server_url, tmp_path):
    path = tmp_path / "serve.json"
    command = [
        sys.executable, "-m", "serving.cli", "bench", "serve", "--base-url", fake_server_url,
        "--num-prompts", "6", "--input-len", "8", "--output-len", "4", "--request-rate", "20,inf",
        "--slo", "ttft_ms=1000,tpot_ms=1000", "--json", str(path), "--api-key", "secret-key",
    ]
    proc = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "TTFT p50, ms" in proc.stdout and "6/6" in proc.stderr  # the table; the progress bar
    assert "secret-key" not in path.read_text()
    report = json.loads(path.read_text())
    assert set(report) == {"summary", "config", "raw", "hardware"}
    assert set(report["hardware"]["isa"]) == {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "amx_int8"}  # hardware.machine_record
    assert report["hardware"]["num_threads"] is None and report["hardware"]["httpx_version"] == httpx.__version__
    assert report["config"]["model"] == "fake-model"
    runs = report["summary"]["runs"]
    assert [r["request_rate"] for r in runs] == [20.0, "inf"]
    for run in runs:
        assert run["num_completed"] == 6 and run["num_output_tokens"] == 24
        # lower bounds only: the server sleeps 50 ms before the first token and 10 ms before each
        # later one, and a busy machine only adds (a late first chunk can shorten one TPOT, though)
        assert 50 <= run["ttft_ms"]["p50"] < 1000
        assert 0 < run["tpot_ms"]["p50"] < 1000
        assert run["goodput"] == run["request_throughput"]
        assert run["token_count_sources"] == ["usage"]
    records = report["raw"]["runs"][0]["records"]
    assert len(records) == 6 and all(len(r["itl_s"]) == 3 for r in records)
    assert all(r["e2e_s"] >= 0.08 and r["ttft_s"] >= 0.05 for run in report["raw"]["runs"] for r in run["records"])
    pytest.importorskip("matplotlib")
    png = path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- the client against kvrelay's own OpenAI API (in process, tiny model) ---------------------
def test_client_against_the_kvrelay_openai_api(tiny_model_dir):
    """kvrelay's stream parses as the fake one does: usage counts every token (ignore_eos), chat
    and completions (token ids) both work, and a multi-turn history goes through the chat
    template. httpx.ASGITransport delivers the body at the end, so no timing is checked here."""
    from serving.config import ServeConfig
    from serving.engine.async_engine import AsyncEngine

    engine = AsyncEngine(tiny_engine_config(tiny_model_dir, max_model_len=1024, num_threads=1))
    try:
        config = ServeConfig(model=str(tiny_model_dir), served_model_name="tiny")
        app = local_app(engine, config, config.model_name)
        common = {"base_url": "http://test", "input_len": "8", "output_len": "4", "ignore_eos": True,
                  "is_progress_shown": False}

        async def all_runs():
            out = {}
            for name, p in {
                "chat": BenchParams(num_prompts=3, **common),
                "ids": BenchParams(num_prompts=2, endpoint="completions", token_ids_vocab=1000, **common),
                "turns": BenchParams(dataset="multi-turn", num_sessions=2, num_turns=2, **common),
            }.items():
                out[name] = await run_rates(p, transport=httpx.ASGITransport(app=app))
            return out

        results = asyncio.run(all_runs())
    finally:
        engine.shutdown()
    for name, (model, runs) in results.items():
        assert model == "tiny", name
        records = runs[0].records
        assert all(r.is_success for r in records), [r.error for r in records]
        assert all(r.num_output_tokens == 4 and r.token_count_source == "usage" for r in records), name
        assert all(r.num_prompt_tokens and r.ttft_s is not None for r in records), name
    ids = results["ids"][1][0].records
    assert [r.num_prompt_tokens for r in ids] == [8, 8]  # token ids go in as they are
    turns = results["turns"][1][0].records
    first, second = (r for r in turns if r.session_id == 0)
    assert second.num_prompt_tokens > first.num_prompt_tokens + 4  # the history and the answer came along
