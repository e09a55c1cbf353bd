"""ServeBackend's pool checks, without Ray: a pool with no running replica answers 503 at once."""

from __future__ import annotations

import asyncio
import threading

import pytest

from serving.api.errors import HealthUnknownError, NoWorkerError, to_api_error
from serving.config import ServeConfig
from serving.deployments.messages import WorkerRequest
from serving.deployments.serve_backend import ServeBackend
from serving.engine.params import SamplingParams


class StubHandle:
    def __init__(self, deployment_name: str):
        self.deployment_name = deployment_name


def backend(states: dict, *, colocated: bool = False) -> tuple[ServeBackend, list]:
    calls = []

    def status_fn():
        calls.append(1)
        return states

    if colocated:
        b = ServeBackend(ServeConfig(mode="colocated"), decode=StubHandle("Worker"), status_fn=status_fn)
    else:
        b = ServeBackend(ServeConfig(), prefill=StubHandle("PrefillWorker"), decode=StubHandle("DecodeWorker"), status_fn=status_fn)
    return b, calls


async def first(iterator):
    async for item in iterator:
        return item


def test_health_reports_replica_states():
    b, _ = backend({"PrefillWorker": {"RUNNING": 2}, "DecodeWorker": {"RUNNING": 1, "STARTING": 1}})
    assert asyncio.run(b.health()) == {"prefill": {"RUNNING": 2}, "decode": {"RUNNING": 1, "STARTING": 1}}


def test_no_running_decode_replica_is_503_naming_the_pool():
    b, _ = backend({"PrefillWorker": {"RUNNING": 1}, "DecodeWorker": {"STARTING": 1, "UNHEALTHY": 1}})
    with pytest.raises(NoWorkerError) as info:
        asyncio.run(b.health())
    error = to_api_error(info.value)
    assert error.status == 503 and error.code == "no_worker"
    assert error.message == (
        "No decode replica is alive to serve this request: 1 starting, 1 unhealthy; "
        "retry once the pool has recovered."
    )


def test_generate_fails_fast_when_the_prefill_pool_is_down():
    b, _ = backend({"PrefillWorker": {}, "DecodeWorker": {"RUNNING": 1}})
    request = WorkerRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(NoWorkerError, match="No prefill replica is alive to serve this request: no replicas;"):
        asyncio.run(first(b.generate(request)))


def test_colocated_pool_is_called_worker():
    b, _ = backend({"Worker": {}}, colocated=True)
    with pytest.raises(NoWorkerError, match="No worker replica"):
        asyncio.run(b.health())


def test_status_is_cached_between_requests():
    b, calls = backend({"PrefillWorker": {"RUNNING": 1}, "DecodeWorker": {"RUNNING": 1}})

    async def twice():
        await b.health()
        await b.health()

    asyncio.run(twice())
    assert len(calls) == 1


def test_an_unreadable_controller_makes_health_unknown_but_fails_no_request():
    def broken():
        raise ConnectionError("controller unreachable at 10.0.0.7:6379")

    backend_, prefill, decode, _ = pools(threshold=100)
    backend_._status_fn = broken

    async def both():
        with pytest.raises(HealthUnknownError) as info:
            await backend_.health()
        request = WorkerRequest("r", [1, 2, 3], SamplingParams(max_tokens=3))
        return info.value, await collect(backend_.generate(request))

    error, tokens = asyncio.run(both())
    assert (error.status, error.code, error.type) == (503, "health_unknown", "service_unavailable_error")
    assert error.message == "The pools' health is unknown: the Serve controller's replica states could not be read (the read failed)."
    assert tokens == [[8], [9]]  # the request went on, to the decode pool


def test_health_over_http_is_503_while_the_controller_cannot_be_read():
    """Before, /health said ok (with empty pools) when the controller could not be read."""
    import httpx

    from serving.api.endpoints.routes import OpenAIServer
    from serving.api.generation.pipeline import Frontend

    def broken():
        raise ConnectionError("controller unreachable at 10.0.0.7:6379")

    config = ServeConfig()
    b = ServeBackend(config, prefill=StubHandle("PrefillWorker"), decode=StubHandle("DecodeWorker"), status_fn=broken)
    app = OpenAIServer(Frontend(None, b, config.model_name), config).build_app()

    async def get():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return await c.get("/health")

    response = asyncio.run(get())
    assert response.status_code == 503
    assert response.json() == {"error": {
        "message": "The pools' health is unknown: the Serve controller's replica states could not be read (the read failed).",
        "type": "service_unavailable_error", "param": None, "code": "health_unknown",
    }}


def test_a_controller_that_does_not_answer_makes_health_unknown():
    answer = threading.Event()

    def hung():
        answer.wait(60)
        return {"PrefillWorker": {"RUNNING": 1}, "DecodeWorker": {"RUNNING": 1}}

    b = ServeBackend(ServeConfig(), prefill=StubHandle("PrefillWorker"), decode=StubHandle("DecodeWorker"), status_fn=hung,
                     status_timeout_s=0.05)
    # a loop of its own: asyncio.run would wait for the hung read's thread before it returns
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(HealthUnknownError, match=r"could not be read \(no answer in 0.05 s\)"):
            loop.run_until_complete(b.health())
    finally:
        answer.set()  # the read's thread returns now; its task ends, then the loop
        pending = asyncio.all_tasks(loop)
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()


def test_a_deployment_the_controller_does_not_list_is_unhealthy():
    b, _ = backend({"PrefillWorker": {"RUNNING": 1}})
    with pytest.raises(NoWorkerError) as info:
        asyncio.run(b.health())
    assert info.value.message == (
        "No decode replica is alive to serve this request: the Serve controller lists no DecodeWorker deployment; "
        "retry once the pool has recovered."
    )


# ---- routing between the pools, with recording stub handles ------------------------------------
class _Call:
    def __init__(self, value):
        self._value = value

    def __await__(self):
        async def value():
            return self._value

        return value().__await__()

    def cancel(self):
        pass


class _Stream:
    def __init__(self, items):
        self._items = list(items)

    async def _fetch_future_result_async(self):
        return self  # placed on a replica at once

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._items:
            raise StopAsyncIteration
        return self._items.pop(0)

    def cancel(self):
        pass


class _Method:
    def __init__(self, owner, name):
        self.owner, self.name = owner, name

    def remote(self, *args):
        self.owner.calls.append((self.name, args))
        return self.owner.reply(self.name, args)


class RecordingHandle(StubHandle):
    def __init__(self, deployment_name, reply):
        super().__init__(deployment_name)
        self.calls = []
        self.reply = reply

    def options(self, **_):
        return self

    def __getattr__(self, name):
        return _Method(self, name)


def _output(token_ids, finish_reason=None):
    from serving.engine.outputs import CompletionOutput, RequestOutput

    return RequestOutput("r", [CompletionOutput(0, "", token_ids, None, finish_reason)], finish_reason is not None, 3, 0)


def pools(first_finish=None, *, threshold=4, cached_tokens_fn=None):
    from serving.deployments.messages import KVHandle, PrefillResult

    kv = None if first_finish else KVHandle("r", "n", 3, 100)
    prefill = RecordingHandle("PrefillWorker", lambda name, args: _Call(PrefillResult(_output([7], first_finish), kv)))
    decode = RecordingHandle("DecodeWorker", lambda name, args: _Stream([_output([8]), _output([9], "length")]))
    config = ServeConfig(min_remote_prefill_tokens=threshold)
    status = {"PrefillWorker": {"RUNNING": 1}, "DecodeWorker": {"RUNNING": 1}}
    backend_ = ServeBackend(config, prefill=prefill, decode=decode, status_fn=lambda: status, cached_tokens_fn=cached_tokens_fn)
    return backend_, prefill, decode, kv


async def collect(iterator):
    return [out.outputs[0].token_ids for out in [item async for item in iterator]]


def test_long_prompt_prefills_remotely_and_hands_the_kv_to_decode():
    backend_, prefill, decode, kv = pools()
    request = WorkerRequest("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3))
    assert asyncio.run(collect(backend_.generate(request))) == [[7], [8], [9]]
    assert prefill.calls == [("prefill", (request,))]
    assert decode.calls == [("generate", (request, kv, [7]))]


def test_short_prompt_and_n_above_one_stay_on_the_decode_worker():
    backend_, prefill, decode, _ = pools()
    short = WorkerRequest("r", [1, 2, 3], SamplingParams(max_tokens=3))
    assert asyncio.run(collect(backend_.generate(short))) == [[8], [9]]
    several = WorkerRequest("r2", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=3, n=2))
    asyncio.run(collect(backend_.generate(several)))
    assert prefill.calls == []
    assert decode.calls == [("generate", (short, None, [])), ("generate", (several, None, []))]


def test_the_threshold_counts_the_tokens_the_decode_pool_has_not_cached():
    """A 40-token prompt is long, but with 32 of its tokens cached on a decode replica only 8
    are left to compute: under a threshold of 16 it stays on the decode worker; with 16 cached,
    24 are left and it goes to the prefill pool. A fully cached prompt still computes its last
    token, so it counts 1."""
    cached = {"n": 32}
    backend_, prefill, decode, kv = pools(threshold=16, cached_tokens_fn=lambda request: cached["n"])
    prompt = list(range(1, 41))
    turn = WorkerRequest("r", prompt, SamplingParams(max_tokens=3))
    asyncio.run(collect(backend_.generate(turn)))
    assert prefill.calls == [] and decode.calls == [("generate", (turn, None, []))]
    cached["n"] = 16
    asyncio.run(collect(backend_.generate(turn)))
    assert prefill.calls == [("prefill", (turn,))]
    assert decode.calls[1] == ("generate", (turn, kv, [7]))
    cached["n"] = 48  # more than the prompt (the index's whole blocks): one token left to compute
    assert backend_._uncached_tokens_below_threshold(turn)
    at_one, _, _, _ = pools(threshold=1, cached_tokens_fn=lambda request: 48)
    assert not at_one._uncached_tokens_below_threshold(turn)  # 1 token left is not fewer than 1


def test_the_decode_routers_index_gives_the_prefix_every_decode_replica_holds():
    """Without a stub: the decode pool's router of this app, in this process, says how many
    leading blocks the decode replicas hold; the least of them counts, since the decode policy
    places by load and may pick any replica. Another app's router of the same name does not count."""
    from router.policies import build_policy
    from router.routing_state import RouterState
    from serving.observability.metrics import register_router

    class Router:
        def __init__(self, app, replicas):
            self.deployment_name, self.app_name = "DecodeWorker", app
            self.state = RouterState(build_policy("least_kv"))
            for replica, hashes in replicas.items():
                self.state.index.update(replica, 1, hashes)

    request = WorkerRequest("r", list(range(64)), SamplingParams(max_tokens=3), block_hashes=[11, 12, 13, 14], block_size=16)
    backend_, _, _, _ = pools(threshold=40)
    assert backend_._decode_cached_tokens(request) == 0  # no router yet: nothing is known cached
    other = Router("another-app", {"a": {11, 12, 13, 14}})
    register_router(other)
    assert backend_._decode_cached_tokens(request) == 0
    ours = Router(backend_.config.app_name, {"replica-1": {11, 12, 14}})
    register_router(ours)
    assert backend_._decode_cached_tokens(request) == 32  # blocks 11, 12; 13 is missing
    assert backend_._uncached_tokens_below_threshold(request)  # 64 - 32 = 32 < 40
    ours.state.index.update("replica-2", 1, {11})
    assert backend_._decode_cached_tokens(request) == 16  # replica-2 holds one block
    assert not backend_._uncached_tokens_below_threshold(request)  # 48 >= 40


def test_request_finished_by_prefill_never_reaches_decode():
    backend_, prefill, decode, _ = pools(first_finish="stop")
    request = WorkerRequest("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3))
    assert asyncio.run(collect(backend_.generate(request))) == [[7]]
    assert len(prefill.calls) == 1 and decode.calls == []


def test_worker_error_value_becomes_the_engine_exception():
    from serving.deployments.messages import WorkerError, WorkerErrorKind
    from serving.engine.errors import ContextLengthError

    backend_, prefill, _, _ = pools()
    prefill.reply = lambda name, args: _Call(WorkerError(WorkerErrorKind.CONTEXT_LENGTH, "too long", "messages", 9000, 8192))
    request = WorkerRequest("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3))
    with pytest.raises(ContextLengthError) as info:
        asyncio.run(collect(backend_.generate(request)))
    assert (info.value.param, info.value.num_tokens, info.value.limit) == ("messages", 9000, 8192)


# ---- the controller's view is this app's -------------------------------------------------------
def test_replica_states_are_read_for_this_app_only(monkeypatch):
    """Every kvrelay app has a DecodeWorker: a fallback app's (serving/api/admission/degradation.py) running
    replicas must not hide that ours are gone. The states come from the controller's details, one
    replica each, as `serve.status()` would count them."""
    from types import SimpleNamespace

    from ray.serve import context

    def app(**deployments):
        return {"deployments": {name: {"target_num_replicas": sum(states.values()),
                                       "replicas": [{"state": state} for state, n in states.items() for _ in range(n)]}
                                for name, states in deployments.items()}}

    details = {"applications": {
        "big": app(PrefillWorker={"RUNNING": 1}, DecodeWorker={"STARTING": 1}),
        "small": app(PrefillWorker={"RUNNING": 1}, DecodeWorker={"RUNNING": 2}),
    }}
    monkeypatch.setattr(context, "_get_global_client", lambda: SimpleNamespace(get_serve_details=lambda: details))
    b = ServeBackend(ServeConfig(app_name="big"), prefill=StubHandle("PrefillWorker"), decode=StubHandle("DecodeWorker"))
    with pytest.raises(NoWorkerError, match="No decode replica is alive to serve this request: 1 starting;"):
        asyncio.run(b.health())
    small = ServeBackend(ServeConfig(app_name="small"), prefill=StubHandle("PrefillWorker"), decode=StubHandle("DecodeWorker"))
    assert asyncio.run(small.health()) == {"prefill": {"RUNNING": 1}, "decode": {"RUNNING": 2}}


def test_model_info_fails_fast_when_a_pool_never_came_up():
    """Without the check, the handle call would wait for a replica forever (the first request
    of an app whose pool cannot be placed); a 503 can be degraded."""
    backend_, prefill, decode, _ = pools()
    backend_._status_fn = lambda: {"PrefillWorker": {"RUNNING": 1}, "DecodeWorker": {"STARTING": 1}}
    with pytest.raises(NoWorkerError, match="No decode replica"):
        asyncio.run(backend_.model_info())
    assert prefill.calls == [] and decode.calls == []


def test_auto_prefills_on_an_idle_decode_replica_and_hands_off_from_a_busy_one():
    """min_remote_prefill_tokens: auto (router/disaggregation.py) from the pools' routing stats."""
    from router.replica_stats import RoutingStats

    stats = {"decode": [RoutingStats(num_running=0, prefill_tokens_per_s=1000.0, kv_import_s=0.05)]}
    backend_, prefill, decode, kv = pools()
    backend_.config = ServeConfig(min_remote_prefill_tokens="auto")
    backend_._pool_stats = lambda: (stats["decode"], [])
    request = WorkerRequest("r", list(range(1, 101)), SamplingParams(max_tokens=3))
    assert asyncio.run(collect(backend_.generate(request))) == [[8], [9]]  # idle: prefilled there
    assert prefill.calls == [] and decode.calls == [("generate", (request, None, []))]
    # 4 sequences x 100 tokens / 1000 tok/s = 0.4 s of waiting there, against a 0.05 s hand-off
    stats["decode"] = [RoutingStats(num_running=4, prefill_tokens_per_s=1000.0, kv_import_s=0.05)]
    assert asyncio.run(collect(backend_.generate(request))) == [[7], [8], [9]]
    assert prefill.calls == [("prefill", (request,))] and decode.calls[1] == ("generate", (request, kv, [7]))
    # nothing measured yet: the configured layout
    stats["decode"] = [RoutingStats(num_running=0)]
    asyncio.run(collect(backend_.generate(request)))
    assert len(prefill.calls) == 2


def test_auto_counts_the_local_prefills_sent_after_the_decode_replicas_stats():
    """A burst: the decode replica's stats (taken before it) say idle, so the first prompt is
    prefilled there; the next ones see it, sent after those stats, and go to the prefill pool
    (1 x 100 tokens / 1000 tok/s = 0.1 s of waiting there, against a 0.05 s hand-off)."""
    import time

    from router.replica_stats import RoutingStats

    backend_, prefill, decode, kv = pools()
    backend_.config = ServeConfig(min_remote_prefill_tokens="auto")
    stats = RoutingStats(wall_time_s=time.time() - 1.0, num_running=0, prefill_tokens_per_s=1000.0, kv_import_s=0.05)
    backend_._pool_stats = lambda: ([stats], [])
    request = WorkerRequest("r", list(range(1, 101)), SamplingParams(max_tokens=3))
    for _ in range(3):
        asyncio.run(collect(backend_.generate(request)))
    assert [name for name, _ in decode.calls] == ["generate"] * 3
    assert [args[1] for _, args in decode.calls] == [None, kv, kv]  # the first prefilled there, then handed off
    assert len(prefill.calls) == 2 and len(backend_._local_sent_at) == 1


# ---- a full decode pool refuses a disaggregated stream before its first byte --------------------
class _Refused(_Stream):
    """A streamed handle call Serve refuses: the pool's queue is full (raised where Serve raises
    it, when the call is placed, so before any item)."""

    def __init__(self):
        super().__init__([])
        self.cancelled = False

    async def _fetch_future_result_async(self):
        from ray.serve.exceptions import BackPressureError

        raise BackPressureError(num_queued_requests=1, max_queued_requests=1)

    async def __anext__(self):
        await self._fetch_future_result_async()

    def cancel(self):
        self.cancelled = True


def test_serve_has_the_placement_wait_the_backend_uses():
    """ServeBackend waits for a decode call's placement with a private method of Serve's
    DeploymentResponseGenerator (serve_backend._placed): an upgrade that drops it fails here."""
    import inspect

    from ray.serve.handle import DeploymentResponseGenerator

    assert inspect.iscoroutinefunction(DeploymentResponseGenerator._fetch_future_result_async)


def test_a_full_decode_pool_refuses_a_disaggregated_request_before_its_first_token():
    """The prefill's first token is not yielded before the decode call is placed: the refusal is
    a QueueFullError with nothing delivered, and the KV the prefill left is released."""
    from serving.api.errors import QueueFullError

    backend_, prefill, decode, kv = pools()
    decode.reply = lambda name, args: _Refused()
    released = []
    backend_.kv.release_soon = released.append
    request = WorkerRequest("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3))
    delivered = []

    async def run():
        async for out in backend_.generate(request):
            delivered.append(out)

    with pytest.raises(QueueFullError) as info:
        asyncio.run(run())
    assert (info.value.pool, info.value.status, info.value.headers) == ("decode", 429, {"Retry-After": "1"})
    assert delivered == [] and released == [kv]
    assert [name for name, _ in prefill.calls] == ["prefill"] and [name for name, _ in decode.calls] == ["generate"]


def test_over_http_a_disaggregated_stream_refused_by_the_decode_pool_is_a_429_not_an_sse_error(tiny_model_dir):
    """The same 429 as a colocated request whose pool is full; a decode pool that takes it
    streams the prefill's token first, then its own."""
    import json

    import httpx
    from transformers import AutoTokenizer

    from serving.api.endpoints.routes import OpenAIServer
    from serving.api.generation.pipeline import Frontend
    from serving.engine.validation import ModelInfo

    info = ModelInfo(vocab_size=49152, max_model_len=2048, eos_token_ids=(2,), block_size=16)
    backend_, prefill, decode, _ = pools(threshold=0)
    prefill.reply = lambda name, args: _Call(info) if name == "model_info" else pools()[1].reply(name, args)
    decode_reply = decode.reply
    decode.reply = lambda name, args: _Call(info) if name == "model_info" else decode_reply(name, args)
    backend_.kv.release_soon = lambda kv: None
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    app = OpenAIServer(Frontend(tokenizer, backend_, "tiny"), ServeConfig(served_model_name="tiny")).build_app()
    body = {"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}

    async def post():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post("/v1/completions", json=body)

    served = asyncio.run(post())
    decode.reply = lambda name, args: _Call(info) if name == "model_info" else _Refused()
    refused = asyncio.run(post())

    assert served.status_code == 200
    *chunks, usage, done = [json.loads(e.removeprefix("data: ")) if e != "data: [DONE]" else e for e in served.text.split("\n\n") if e]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and done == "data: [DONE]"
    assert usage["usage"]["completion_tokens"] == 3  # 7 from the prefill pool, 8 and 9 from the decode pool
    assert (refused.status_code, refused.headers["retry-after"]) == (429, "1")
    assert refused.headers["content-type"] == "application/json"
    assert refused.json() == {"error": {
        "message": "The decode pool's queues are full; retry after 1 s.", "type": "rate_limit_error",
        "param": None, "code": "queue_full",
    }}


# ---- what a request's path learns here (serving/observability/request_path.py) ---------------
def _timed(token_ids, arrival, scheduled, first_token, *, num_cached=0, finish_reason=None):
    from serving.engine.outputs import RequestMetrics

    out = _output(token_ids, finish_reason)
    out.num_cached_tokens, out.metrics = num_cached, RequestMetrics(arrival, scheduled, first_token)
    return out


def test_a_disaggregated_requests_path_learns_its_prefill_its_placement_and_its_decode_start(monkeypatch):
    from serving.deployments.messages import KVHandle, PrefillResult, WorkerOutput
    from serving.observability import request_path
    from serving.observability.request_path import PATHS, Admission, Prediction

    monkeypatch.setattr(request_path, "clock_offset_s", lambda: 0.0)  # the workers' clocks are ours
    kv = KVHandle("r", "n", 5, 100)
    prefilled = PrefillResult(_timed([7], 1.0, 1.25, 1.75, num_cached=0), kv, "p1", Admission("p1", 0, 0, 0.0))
    decoded = WorkerOutput.first(_timed([8], 2.5, 2.5, 2.75), Admission("d1", 0, 0, 0.0, imported=True))
    prefill = RecordingHandle("PrefillWorker", lambda name, args: _Call(prefilled))
    decode = RecordingHandle("DecodeWorker", lambda name, args: _Stream([decoded, _output([9], "length")]))
    times = iter([2.0, 2.125])  # the prefill's result back, the decode call placed
    backend_ = ServeBackend(ServeConfig(min_remote_prefill_tokens=4), prefill=prefill, decode=decode,
                            status_fn=lambda: {"PrefillWorker": {"RUNNING": 1}, "DecodeWorker": {"RUNNING": 1}},
                            clock=lambda: next(times))
    path = PATHS.open("r")
    try:
        path.predicted("prefill", Prediction("prefix_cost", "p1", 0))
        assert asyncio.run(collect(backend_.generate(WorkerRequest("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3))))) == [[7], [8], [9]]
    finally:
        PATHS.close("r")
    assert (path.pool, path.scheduled_at, path.engine_first_token_at, path.returned_at, path.placed_at) == ("prefill", 1.25, 1.75, 2.0, 2.125)
    assert (path.decode_arrived_at, path.decode_first_token_at) == (2.5, 2.75)
    assert (path.check.outcome, path.check.reason, path.check.replica) == ("exact", "match", "p1")
    assert path.split(0.5, 2.25) == {"queue": 0.75, "prefill": 0.5, "delivery": 0.375, "handoff": 0.125}


def test_a_colocated_requests_path_learns_where_its_prompt_was_computed(monkeypatch):
    from serving.deployments.messages import WorkerOutput
    from serving.observability import request_path
    from serving.observability.request_path import PATHS, Admission, Prediction

    monkeypatch.setattr(request_path, "clock_offset_s", lambda: 0.0)
    first = WorkerOutput.first(_timed([8], 1.0, 1.5, 2.0, num_cached=16), Admission("w2", 32, 32, 0.0))
    worker = RecordingHandle("Worker", lambda name, args: _Stream([first, _output([9], "length")]))
    backend_ = ServeBackend(ServeConfig(mode="colocated"), decode=worker, status_fn=lambda: {"Worker": {"RUNNING": 1}},
                            clock=lambda: 2.25)
    path = PATHS.open("r")
    try:
        path.predicted("worker", Prediction("prefix_cost", "w1", 32))  # the router chose w1; Serve ran it on w2
        asyncio.run(collect(backend_.generate(WorkerRequest("r", list(range(40)), SamplingParams(max_tokens=2)))))
    finally:
        PATHS.close("r")
    assert (path.pool, path.returned_at, path.placed_at, path.decode_arrived_at) == ("worker", 2.25, None, None)
    assert (path.check.outcome, path.check.reason, path.check.error_tokens) == ("miss", "reassigned", 16)
    assert path.split(0.5, 2.5) == {"queue": 1.0, "prefill": 0.5, "delivery": 0.5}


class _BrokenStream(_Stream):
    """Yields its items, then raises `exc`, as a call to a replica that went away does."""

    def __init__(self, items, exc):
        super().__init__(items)
        self._exc = exc

    async def __anext__(self):
        if not self._items:
            raise self._exc
        return self._items.pop(0)


def _grpc_error(code):
    import grpc

    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="Stream removed")


def _colocated_over_grpc(first_stream_code):
    streams = [_BrokenStream([_output([8])], _grpc_error(first_stream_code)), _Stream([_output([9]), _output([10], "length")])]
    worker = RecordingHandle("Worker", lambda name, args: streams.pop(0))
    recoveries = []
    backend_ = ServeBackend(ServeConfig(mode="colocated"), decode=worker, status_fn=lambda: {"Worker": {"RUNNING": 1}},
                            on_recovery=recoveries.append)
    return backend_, worker, recoveries


@pytest.mark.parametrize("code", ["UNKNOWN", "INTERNAL", "CANCELLED"])
def test_a_grpc_stream_the_replica_broke_resumes_from_the_tokens_it_gave(code):
    """On Serve's gRPC transport a stream reset by a dying replica is a raw AioRpcError (Serve
    maps only UNAVAILABLE to ActorUnavailableError): it resumes like an actor error, from the
    one token delivered."""
    import grpc

    backend_, worker, recoveries = _colocated_over_grpc(getattr(grpc.StatusCode, code))
    request = WorkerRequest("r", [1, 2, 3], SamplingParams(max_tokens=3))
    assert asyncio.run(collect(backend_.generate(request))) == [[8], [9], [10]]
    assert recoveries == ["decode_resumed"]
    assert [args[2] for _, args in worker.calls] == [[], [8]]  # the second call carries the token given


def test_a_grpc_error_that_is_not_a_lost_replica_is_not_retried():
    """A message over the channel's limit would fail on any replica: it propagates as it is."""
    import grpc

    backend_, worker, recoveries = _colocated_over_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED)
    request = WorkerRequest("r", [1, 2, 3], SamplingParams(max_tokens=3))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(collect(backend_.generate(request)))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert recoveries == [] and len(worker.calls) == 1


def test_a_decode_replica_lost_before_its_first_output_releases_the_kv_it_was_handed():
    """The decode replica died with the hand-off's KV perhaps unclaimed: the resumed call
    recomputes from the tokens, and the KV is released now rather than held until its lease
    runs out (a soak under chaos found one such export)."""
    import ray

    backend_, prefill, decode, kv = pools()
    streams = [_BrokenStream([], ray.exceptions.ActorUnavailableError("gone", None)), _Stream([_output([8]), _output([9], "length")])]
    decode.reply = lambda name, args: streams.pop(0)
    released, recoveries = [], []
    backend_.kv.release_soon = released.append
    backend_.on_recovery = recoveries.append
    request = WorkerRequest("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3))
    assert asyncio.run(collect(backend_.generate(request))) == [[7], [8], [9]]
    assert released == [kv] and recoveries == ["decode_resumed"]
    assert [(args[1], args[2]) for _, args in decode.calls] == [(kv, [7]), (None, [7])]  # the prefill's token both times
