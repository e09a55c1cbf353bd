"""Graceful degradation without Ray: the config, the policy's decisions, and two OpenAI apps in
this process, the primary's pools refusing and the fallback answering through the same ASGI
forwarding the Serve handle carries.

    httpx ──ASGI──▶ primary OpenAIServer ("tiny") ── Frontend ──▶ RefusingBackend (429 / 503 on demand)
                        │ Degrader
                        ▼
                    FallbackClient ── StubHandle (what Serve's streamed handle call does) ──▶
                    serve_forwarded(fallback app) ── OpenAIServer ("small": another model, chat
                                                     template and context) ── LocalBackend ── AsyncEngine

Every expected text comes from the fallback's engine asked directly, with the prompt ids of its
own chat template, never from the API under test.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from pathlib import Path

import pytest
import yaml

from serving.api.admission.degradation import Action, Decision, DegradationPolicy, Reason, refusal_reason
from serving.api.admission.forwarding import ForwardedRequest, ResponseStart, serve_forwarded
from serving.api.endpoints.routes import OpenAIServer
from serving.api.errors import NoWorkerError, QueueFullError, QueueTimeoutError
from serving.api.generation.pipeline import Frontend
from serving.api.protocol.wire import ChatMessage
from serving.config import ConfigError, DegradationConfig, ServeConfig, load_config
from serving.deployments.fallback import FallbackClient
from serving.deployments.local_backend import LocalBackend
from serving.engine import SamplingParams
from serving.engine.contract import EngineRequest
from serving.engine.errors import EngineDeadError, InvalidRequestError
from serving.engine.outputs import merge_outputs
from tests.asgi import post as asgi_post
from tests.asgi import sse_events
from tests.helpers import REPO, tiny_async_engine

KEY = "sk-degrade-test-0001"
FALLBACK_LEN = 512  # the fallback's context window (tests/conftest.py; the primary's: 2048)
HELLO = [{"role": "user", "content": "Hello there"}]


# ---- config ----------------------------------------------------------------------------------
def load(tmp_path: Path, text: str, **kwargs) -> ServeConfig:
    path = tmp_path / "kvrelay.yaml"
    path.write_text(text)
    return load_config(path, env=kwargs.pop("env", {}), **kwargs)


def test_degradation_is_off_by_default_and_in_the_shipped_configs():
    assert ServeConfig().degradation is None
    assert load_config(REPO / "deploy/local.yaml", env={}).degradation is None


def test_a_degradation_section_loads_with_its_defaults(tmp_path):
    config = load(tmp_path, "degradation:\n  fallback: {app: small, model: smollm2-small}\n")
    assert config.degradation == DegradationConfig(
        when=["saturated", "down"], fallback={"app": "small", "model": "smollm2-small"},
        shed_priority_at_or_above=None, shed_window_s=2.0, retry_after_s=5,
    )
    config = load(tmp_path, "degradation:\n  fallback: {app: small, model: s}\n",
                  env={"KVRELAY_DEGRADATION__SHED_PRIORITY_AT_OR_ABOVE": "10"})
    assert config.degradation.shed_priority_at_or_above == 10


def test_the_shipped_serve_example_pairs_a_primary_with_its_fallback():
    from ray.serve.schema import ServeDeploySchema

    from serving.deployments.app import config_from_args

    repo = REPO
    schema = ServeDeploySchema.model_validate(yaml.safe_load((repo / "deploy/serve-degradation.yaml").read_text()))
    configs = {
        app.name: config_from_args({**app.args, "config": str(repo / app.args["config"])}) for app in schema.applications
    }
    assert {name: c.app_name for name, c in configs.items()} == {"kvrelay": "kvrelay", "kvrelay-fallback": "kvrelay-fallback"}
    fallback = configs["kvrelay"].degradation.fallback
    assert configs[fallback.app].model_name == fallback.model
    assert configs[fallback.app].degradation is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("degradation:\n  when: [saturated]\n",
         "degradation: nothing to do: set fallback (app and model), shed_priority_at_or_above, or both"),
        ("degradation:\n  on: [saturated]\n  shed_priority_at_or_above: 5\n",
         "YAML reads the key `on:` as true: the field is `when:`"),
        ("degradation:\n  when: [full]\n  shed_priority_at_or_above: 5\n",
         "degradation.when.0 = 'full': Input should be 'saturated' or 'down'"),
        ("degradation:\n  fallback: {app: small, modell: x}\n",
         "degradation.fallback.modell = 'x': unknown key; remove it or fix its spelling"),
        ("degradation:\n  fallback: {app: small}\n", "degradation.fallback.model: Field required"),
        ("degradation:\n  shed_priority_at_or_above: 1\n  retry_after_s: 0\n",
         "degradation.retry_after_s = 0: Input should be greater than or equal to 1"),
        ("app_name: big\ndegradation:\n  fallback: {app: big, model: x}\n",
         "degradation.fallback.app = 'big' is this app itself; name another kvrelay app"),
    ],
)
def test_bad_degradation_config_names_the_field_and_the_fix(tmp_path, text, message):
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text)
    assert message in str(info.value)


# ---- the policy ------------------------------------------------------------------------------
def policy(**fields) -> DegradationPolicy:
    return DegradationPolicy(DegradationConfig(**fields))


FALLBACK = {"app": "small", "model": "small"}
S, D = Reason.SATURATED, Reason.DOWN


@pytest.mark.parametrize(
    ("fields", "reason", "priority", "action"),
    [
        ({"fallback": FALLBACK}, S, 0, Action.FALLBACK),
        ({"fallback": FALLBACK}, D, 99, Action.FALLBACK),
        ({"fallback": FALLBACK, "when": ["down"]}, S, 0, Action.FAIL),
        ({"fallback": FALLBACK, "when": ["saturated"]}, D, 0, Action.FAIL),
        ({"fallback": FALLBACK, "shed_priority_at_or_above": 10}, S, 9, Action.FALLBACK),
        ({"fallback": FALLBACK, "shed_priority_at_or_above": 10}, S, 10, Action.SHED),
        ({"fallback": FALLBACK, "shed_priority_at_or_above": 10}, D, 11, Action.SHED),
        ({"fallback": FALLBACK, "shed_priority_at_or_above": 0}, S, -1, Action.FALLBACK),
        ({"shed_priority_at_or_above": 10}, S, 10, Action.SHED),
        ({"shed_priority_at_or_above": 10}, S, 9, Action.FAIL),
        ({"shed_priority_at_or_above": 10, "when": ["saturated"]}, D, 10, Action.FAIL),
    ],
)
def test_refusal_decisions(fields, reason, priority, action):
    assert policy(**fields).on_refusal(reason, priority, now=0.0) == Decision(action, reason)


def test_low_priority_is_shed_on_arrival_within_the_window_after_a_saturated_refusal():
    p = policy(fallback=FALLBACK, shed_priority_at_or_above=10, shed_window_s=2.0)
    assert p.on_arrival(10, now=0.0) is None  # nothing refused yet
    p.on_refusal(S, 0, now=10.0)  # an important request refused: the window opens too
    assert p.on_arrival(10, now=11.9) == Decision(Action.SHED, S)
    assert p.on_arrival(9, now=11.9) is None  # more important: tries the primary
    assert p.on_arrival(10, now=12.0) is None  # the window has closed
    p.on_refusal(S, 0, now=12.5)
    p.on_refusal(S, 0, now=11.0)  # a late report does not shorten it
    assert p.on_arrival(50, now=14.4) == Decision(Action.SHED, S)
    assert p.on_arrival(50, now=14.5) is None


def test_down_refusals_and_a_zero_window_never_shed_on_arrival():
    p = policy(fallback=FALLBACK, shed_priority_at_or_above=10)
    p.on_refusal(D, 0, now=0.0)
    assert p.on_arrival(10, now=0.1) is None
    p = policy(fallback=FALLBACK, shed_priority_at_or_above=10, shed_window_s=0)
    p.on_refusal(S, 0, now=0.0)
    assert p.on_arrival(10, now=0.0) is None
    p = policy(fallback=FALLBACK, when=["down"], shed_priority_at_or_above=10)
    p.on_refusal(S, 0, now=0.0)  # saturation is not degraded here: no window either
    assert p.on_arrival(10, now=0.1) is None


def test_refusal_reasons():
    assert refusal_reason(QueueFullError("decode")) is S
    assert refusal_reason(QueueTimeoutError()) is S
    assert refusal_reason(NoWorkerError("prefill", "no replicas")) is D
    assert refusal_reason(EngineDeadError("the step loop stopped")) is D
    assert refusal_reason(InvalidRequestError("messages", "bad")) is None
    assert refusal_reason(RuntimeError("x")) is None


# ---- two apps in this process ----------------------------------------------------------------
class RefusingBackend:
    """LocalBackend, or a refusal (raised before any token, or after `after_tokens` tokens)."""

    def __init__(self, inner: LocalBackend):
        self.inner = inner
        self.refusal: Exception | None = None
        self.after_tokens = 0
        self.num_calls = 0

    async def model_info(self):
        return await self.inner.model_info()

    async def health(self):
        return await self.inner.health()

    async def generate(self, request):
        self.num_calls += 1
        if self.refusal is not None and self.after_tokens == 0:
            raise self.refusal
        num_tokens = 0
        async for out in self.inner.generate(request):
            yield out
            num_tokens += len(out.outputs[0].token_ids)
            if self.refusal is not None and num_tokens >= self.after_tokens:
                raise self.refusal


class StubStream:
    """What Serve's streamed handle call is to its caller: the replica's generator runs in a task
    of its own, and cancel() cancels that task."""

    def __init__(self, generator):
        self._items: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.create_task(self._pump(generator))

    async def _pump(self, generator):
        try:
            async for item in generator:
                await self._items.put(item)
            await self._items.put(StopAsyncIteration())
        except Exception as exc:
            await self._items.put(exc)
        finally:
            await generator.aclose()

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self._items.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self):
        self._task.cancel()


class StubHandle:
    """The fallback app's ingress handle: `forward` runs its ASGI app as the replica would."""

    def __init__(self, app):
        self.app = app
        self.forwarded: list[ForwardedRequest] = []
        self.streams: list[StubStream] = []

    def options(self, **_):
        return self

    @property
    def forward(self):
        return self

    def remote(self, request: ForwardedRequest):
        self.forwarded.append(request)
        self.streams.append(StubStream(serve_forwarded(self.app, request)))
        return self.streams[-1]


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class Apps:
    def __init__(self, primary_dir: Path, fallback_dir: Path):
        def engine(model_dir):
            return tiny_async_engine(model_dir)

        # The fallback is smaller in every way: another model, another template, a shorter context.
        self.primary_engine, self.fallback_engine = engine(primary_dir), engine(fallback_dir)
        self.backend = RefusingBackend(LocalBackend(self.primary_engine))
        self.fallback_backend = RefusingBackend(LocalBackend(self.fallback_engine))
        self.degradation = {"fallback": {"app": "small-app", "model": "small"}, "shed_priority_at_or_above": 10,
                            "shed_window_s": 2.0, "retry_after_s": 7}
        self.primary_dir, self.fallback_dir = primary_dir, fallback_dir

    def build(self, **degradation):
        """A fresh primary (metrics, ledger, shed window) and fallback app, wired together."""
        config = ServeConfig(
            model=str(self.primary_dir), served_model_name="tiny", api_keys=[{"key": KEY, "name": "client"}], app_name="big-app",
            degradation={**self.degradation, **degradation} if degradation.get("fallback", True) is not None else degradation,
        )
        self.primary = OpenAIServer(Frontend(self.primary_engine.tokenizer, self.backend, "tiny"), config)
        # The fallback falls back on the primary: a forwarded request must not come back.
        fallback_config = ServeConfig(
            model=str(self.fallback_dir), served_model_name="small", api_keys=[{"key": KEY, "name": "client"}], app_name="small-app",
            degradation={"fallback": {"app": "big-app", "model": "tiny"}},
        )
        self.fallback = OpenAIServer(Frontend(self.fallback_engine.tokenizer, self.fallback_backend, "small"), fallback_config)
        self.handle = StubHandle(self.fallback.build_app())
        self.num_running = 1
        self.clock = Clock()
        self.primary.degrader.fallback = FallbackClient(
            "small-app", get_handle=lambda app: self.handle, running_replicas=lambda app: self.num_running, status_ttl_s=0,
        )
        self.primary.degrader._clock = self.clock
        self.app = self.primary.build_app()
        self.backend.refusal = self.fallback_backend.refusal = None
        self.backend.after_tokens = self.backend.num_calls = 0
        return self

    async def fallback_reference(self, messages: list[dict], max_tokens: int) -> str:
        """The fallback engine's own greedy text for the prompt of its own chat template."""
        ids = self.fallback.frontend.encode_chat([ChatMessage(**m) for m in messages])
        merged = None
        async for out in self.fallback_engine.generate(EngineRequest(
            f"reference-{time.monotonic_ns()}", prompt_token_ids=ids, params=SamplingParams(temperature=0, max_tokens=max_tokens),
        )):
            merged = merge_outputs(merged, out)
        return merged.outputs[0].text


@pytest.fixture(scope="module")
def apps(tiny_model_dir, tiny_fallback_model_dir):
    apps = Apps(tiny_model_dir, tiny_fallback_model_dir)
    yield apps
    apps.primary_engine.shutdown()
    apps.fallback_engine.shutdown()


post = functools.partial(asgi_post, key=KEY)
sse = sse_events


def sample(server: OpenAIServer, name: str, **labels) -> float:
    return server.metrics.registry.get_sample_value(name, {"model": server.model_name, **labels}) or 0.0


def degraded(server: OpenAIServer, reason: str, target: str, outcome: str) -> float:
    return sample(server, "kvrelay_degraded_requests_total", reason=reason, target=target, outcome=outcome)


def requests(server: OpenAIServer) -> float:
    return sum(s.value for m in server.metrics.registry.collect() if m.name == "kvrelay_requests" for s in m.samples
               if s.name == "kvrelay_requests_total")


CHAT = {"model": "tiny", "messages": HELLO, "max_tokens": 12, "temperature": 0}


@pytest.mark.asyncio
async def test_a_healthy_primary_answers_and_names_itself(apps):
    apps.build()
    response = await post(apps.app, "/v1/chat/completions", CHAT)
    assert response.status_code == 200 and response.json()["model"] == "tiny"
    assert response.headers["x-kvrelay-model"] == "tiny" and "x-kvrelay-degraded" not in response.headers
    assert apps.handle.forwarded == []


@pytest.mark.asyncio
async def test_saturated_primary_non_streamed_answer_comes_from_the_fallback(apps):
    apps.build()
    apps.backend.refusal = QueueFullError("worker")
    text = await apps.fallback_reference(HELLO, 12)
    response = await post(apps.app, "/v1/chat/completions", CHAT)
    body = response.json()
    assert response.status_code == 200, body
    assert response.headers["x-kvrelay-model"] == "small" and response.headers["x-kvrelay-degraded"] == "saturated"
    assert body["model"] == "small" and body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == text
    # The fallback tokenized with its own chat template, not the primary's.
    fallback_ids = apps.fallback.frontend.encode_chat([ChatMessage(**HELLO[0])])
    assert body["usage"]["prompt_tokens"] == len(fallback_ids)
    assert len(fallback_ids) != len(apps.primary.frontend.encode_chat([ChatMessage(**HELLO[0])]))
    (forwarded,) = apps.handle.forwarded
    assert forwarded.path == "/v1/chat/completions" and forwarded.origin == "tiny"
    assert json.loads(forwarded.body) == {**CHAT, "model": "small"}
    assert ("authorization", f"Bearer {KEY}") in forwarded.headers
    # Counted and billed once, by the app that answered.
    assert degraded(apps.primary, "saturated", "small", "served") == 1
    assert requests(apps.primary) == 0
    assert sample(apps.fallback, "kvrelay_requests_total", status="200", finish_reason="length") == 1
    assert apps.primary.usage.keys() == []
    assert apps.fallback.usage.totals("client").completion_tokens == 12


@pytest.mark.asyncio
async def test_saturated_primary_stream_comes_from_the_fallback(apps):
    apps.build()
    apps.backend.refusal = QueueFullError("decode")
    text = await apps.fallback_reference(HELLO, 12)
    response = await post(apps.app, "/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert response.status_code == 200
    assert response.headers["x-kvrelay-model"] == "small" and response.headers["x-kvrelay-degraded"] == "saturated"
    events = sse(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["model"] for c in chunks} == {"small"}
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == text
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    assert degraded(apps.primary, "saturated", "small", "served") == 1
    assert apps.fallback.usage.totals("client").num_requests == 1 and apps.primary.usage.keys() == []


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
async def test_down_primary_completions_come_from_the_fallback(apps, stream):
    apps.build()
    apps.backend.refusal = NoWorkerError("worker", "no replicas")
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "stream": stream}
    response = await post(apps.app, "/v1/completions", body)
    assert response.status_code == 200
    assert response.headers["x-kvrelay-model"] == "small" and response.headers["x-kvrelay-degraded"] == "down"
    if stream:
        chunks = sse(response)[:-1]
        assert {c["model"] for c in chunks} == {"small"} and chunks[-1]["choices"][0]["finish_reason"] == "length"
    else:
        assert response.json()["model"] == "small" and response.json()["usage"]["completion_tokens"] == 6
    assert degraded(apps.primary, "down", "small", "served") == 1


@pytest.mark.asyncio
async def test_low_priority_is_shed_with_retry_after_then_on_arrival_for_the_window(apps):
    apps.build()
    apps.backend.refusal = QueueFullError("worker")
    response = await post(apps.app, "/v1/chat/completions", {**CHAT, "priority": 10})
    assert response.status_code == 503
    assert response.headers["retry-after"] == "7" and response.headers["x-kvrelay-degraded"] == "saturated"
    error = response.json()["error"]
    assert (error["code"], error["type"]) == ("request_shed", "service_unavailable_error")
    assert error["message"] == (
        "The pools are saturated: requests with priority >= 10 are shed first (lower values are more "
        f"important; this one has 10). Retry after 7 s. (request id: {response.headers['x-request-id']})"
    )
    assert apps.backend.num_calls == 1 and apps.handle.forwarded == []
    # Within the window, low priority never reaches the saturated pool; high priority does.
    apps.backend.refusal = None
    apps.clock.now += 1.9
    calls = apps.backend.num_calls
    assert (await post(apps.app, "/v1/chat/completions", {**CHAT, "priority": 50})).status_code == 503
    assert apps.backend.num_calls == calls
    ok = await post(apps.app, "/v1/chat/completions", {**CHAT, "priority": -1})
    assert ok.status_code == 200 and ok.json()["model"] == "tiny" and apps.backend.num_calls == calls + 1
    apps.clock.now += 0.1
    assert (await post(apps.app, "/v1/chat/completions", {**CHAT, "priority": 50})).json()["model"] == "tiny"
    assert degraded(apps.primary, "saturated", "none", "shed") == 2
    assert sample(apps.primary, "kvrelay_requests_total", status="503", finish_reason="none") == 2
    assert sample(apps.primary, "kvrelay_requests_total", status="200", finish_reason="length") == 2
    assert requests(apps.primary) == 4
    assert apps.primary.usage.totals("client").num_requests == 2  # the two answered; shed ones are not billed


@pytest.mark.asyncio
async def test_unreachable_fallback_leaves_the_primary_error_as_it_was(apps):
    apps.build()
    apps.num_running = 0
    apps.backend.refusal = QueueFullError("worker")
    response = await post(apps.app, "/v1/chat/completions", {**CHAT, "stream": True})
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "queue_full"
    assert degraded(apps.primary, "saturated", "small", "failed") == 1
    assert sample(apps.primary, "kvrelay_requests_total", status="429", finish_reason="error") == 1
    assert requests(apps.primary) == 1


@pytest.mark.asyncio
async def test_refusals_outside_when_are_not_degraded(apps):
    apps.build(when=["down"])
    apps.backend.refusal = QueueFullError("worker")
    response = await post(apps.app, "/v1/chat/completions", {**CHAT, "priority": 99})
    assert response.status_code == 429 and apps.handle.forwarded == []
    assert sum(s.value for m in apps.primary.metrics.registry.collect() for s in m.samples
               if s.name == "kvrelay_degraded_requests_total") == 0


@pytest.mark.asyncio
async def test_a_request_that_streamed_a_token_is_never_degraded(apps):
    apps.build()
    apps.backend.refusal, apps.backend.after_tokens = NoWorkerError("decode", "the replica died"), 1
    response = await post(apps.app, "/v1/chat/completions", {**CHAT, "stream": True})
    events = sse(response)
    assert response.status_code == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "no_worker"
    assert apps.handle.forwarded == []


@pytest.mark.asyncio
async def test_a_forwarded_request_is_never_degraded_again(apps):
    """Both refuse, and each falls back on the other: the client gets the fallback's refusal."""
    apps.build()
    apps.backend.refusal = apps.fallback_backend.refusal = QueueFullError("worker")
    response = await post(apps.app, "/v1/chat/completions", CHAT)
    assert response.status_code == 429 and response.headers["x-kvrelay-degraded"] == "saturated"
    assert len(apps.handle.forwarded) == 1
    assert degraded(apps.primary, "saturated", "small", "failed") == 1
    assert sample(apps.fallback, "kvrelay_requests_total", status="429", finish_reason="error") == 1


@pytest.mark.asyncio
async def test_the_fallback_refuses_what_it_cannot_serve_in_its_own_words(apps):
    """Validation is the fallback's: a request the primary would take, beyond its context window."""
    apps.build()
    apps.backend.refusal = QueueFullError("worker")
    response = await post(apps.app, "/v1/chat/completions", {**CHAT, "max_tokens": 1000})
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "context_length_exceeded"
    assert str(FALLBACK_LEN) in error["message"]
    assert degraded(apps.primary, "saturated", "small", "failed") == 1


@pytest.mark.asyncio
async def test_closing_a_forwarded_stream_aborts_the_fallback_generation(apps):
    apps.build()
    free = apps.fallback_engine.stats().num_free_blocks
    client = apps.primary.degrader.fallback
    body = {"model": "small", "messages": HELLO, "max_tokens": 480, "ignore_eos": True, "stream": True}
    forwarded = ForwardedRequest("/v1/chat/completions", (("authorization", f"Bearer {KEY}"),), json.dumps(body).encode(), "tiny")
    start, chunks = await client.open(forwarded)
    assert isinstance(start, ResponseStart) and start.status == 200
    assert (await anext(chunks)).startswith(b"data: ")
    await chunks.aclose()
    deadline = time.monotonic() + 10
    while (s := apps.fallback_engine.stats()).num_running or s.num_free_blocks != free:
        assert time.monotonic() < deadline, s
        await asyncio.sleep(0.01)
    assert apps.fallback.usage.totals("client").completion_tokens < 480  # billed for what it made, then stopped


@pytest.mark.asyncio
async def test_leaving_before_a_forwarded_answer_aborts_the_fallback_generation(apps):
    """A non-streamed answer starts only once complete: leaving before it cancels the handle call,
    and the fallback replica cancels its request, as Serve does on a disconnect."""
    apps.build()
    free = apps.fallback_engine.stats().num_free_blocks
    body = {"model": "small", "messages": HELLO, "max_tokens": 480, "ignore_eos": True}
    forwarded = ForwardedRequest("/v1/chat/completions", (("authorization", f"Bearer {KEY}"),), json.dumps(body).encode(), "tiny")
    opening = asyncio.create_task(apps.primary.degrader.fallback.open(forwarded))
    deadline = time.monotonic() + 10
    while apps.fallback_engine.stats().num_running == 0:
        assert time.monotonic() < deadline and not opening.done()
        await asyncio.sleep(0.01)
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening
    while (s := apps.fallback_engine.stats()).num_running or s.num_free_blocks != free:
        assert time.monotonic() < deadline, s
        await asyncio.sleep(0.01)
    assert apps.fallback.usage.totals("client").completion_tokens < 480
