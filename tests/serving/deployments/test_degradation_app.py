"""Graceful degradation on a local Ray: a saturated primary and a dead one, each falling back on
another kvrelay app through a Serve handle, and low-priority work shed with Retry-After.

Three apps in one Serve instance, on one HTTP port, with one API key:

    /small   the fallback: another tiny model (its own weights, chat template and context)
    /busy    primary "tiny": its Worker takes one request and queues one (max_ongoing_requests 1,
             max_queued_requests 1); degradation: fallback small, shed priority >= 10, Retry-After 7
    /dead    primary "tiny": its Worker asks for a Ray resource no node has, so it never runs
             (no running replica: 503); the same degradation

Every expected text is the fallback model's greedy output for the prompt of its own chat
template, computed by an engine in this process.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from load_tests.local_ray import free_port
from serving.api.generation.pipeline import Frontend
from serving.api.protocol.wire import ChatMessage
from serving.engine.config import EngineConfig
from serving.engine.engine import LLMEngine
from serving.engine.params import SamplingParams
from tests.asgi import sse_events
from tests.helpers import tiny_app_config, wait_until

pytestmark = pytest.mark.integration

KEY = "sk-degradation-integration"
AUTH = {"Authorization": f"Bearer {KEY}"}
COLOCATED = {"mode": "colocated", "api_keys": [KEY]}  # each app: one Worker pool, behind the key
MAX_TOKENS = 16
DEGRADATION = {"fallback": {"app": "small", "model": "small"}, "shed_priority_at_or_above": 10, "retry_after_s": 7}


@pytest.fixture(scope="module")
def serve_instance(tmp_path_factory, tiny_model_dir, tiny_fallback_model_dir):
    import ray
    from ray import serve
    from ray.serve.api import _run

    from serving.deployments.app import build_app

    ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING", _temp_dir=str(tmp_path_factory.mktemp("ray")))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    worker = {"num_cpus": 0.1}
    configs = {
        "small": tiny_app_config(tiny_fallback_model_dir, "small", served_model_name="small", **COLOCATED),
        "busy": tiny_app_config(tiny_model_dir, "busy", degradation=DEGRADATION, **COLOCATED,
                           worker={**worker, "max_ongoing_requests": 1, "max_queued_requests": 1}),
        "dead": tiny_app_config(tiny_model_dir, "dead", degradation=DEGRADATION, **COLOCATED,
                           worker={**worker, "resources": {"kvrelay_nowhere": 0.01}}),
    }
    for name in ("small", "busy"):
        serve.run(build_app(configs[name]), name=name, route_prefix=f"/{name}")
    # Its Worker never starts, so the app never reaches RUNNING: deploy it without waiting for that.
    _run(build_app(configs["dead"]), _blocking=False, name="dead", route_prefix="/dead")

    def dead_ingress_up():
        app = serve.status().applications.get("dead")
        ingress = app.deployments.get("OpenAIIngress") if app is not None else None
        return ingress is not None and ingress.replica_states.get("RUNNING", 0) == 1

    wait_until(dead_ingress_up, timeout_s=120, interval_s=0.2)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(f"{url}/dead/health", timeout=10).status_code == 503, timeout_s=120, interval_s=0.2)  # routed, and down
    yield url
    from serving.deployments import kv_transfer

    for name in configs:
        kv_transfer.kill_all(name)
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def fallback_text(tiny_fallback_model_dir):
    """The fallback model's greedy text for a user message, through its own chat template."""
    engine = LLMEngine(EngineConfig(model=str(tiny_fallback_model_dir), dtype="float32", kv_cache_bytes=16 * 2**20))
    frontend = Frontend(engine.tokenizer, backend=None, model_name="small")

    def greedy(content: str) -> str:
        ids = frontend.encode_chat([ChatMessage(role="user", content=content)])
        return engine.generate([ids], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0].outputs[0].text

    return greedy


def chat(content: str, **fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS, "temperature": 0, **fields}


def metric(url: str, app: str, name: str, **labels) -> float:
    """One sample of an app's GET /metrics (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/{app}/metrics", timeout=30).text
    wanted = set(labels.items())
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and wanted <= set(s.labels.items()))


def usage(url: str, app: str) -> dict:
    return httpx.get(f"{url}/{app}/v1/usage", headers=AUTH, timeout=30).json()["data"][0]


async def degraded_answers(client: httpx.AsyncClient, app: str, fallback_text) -> None:
    """A non-streamed and a streamed chat: both from the fallback, saying so."""
    text = fallback_text("Tell me about the sea.")
    response = await client.post(f"/{app}/v1/chat/completions", json=chat("Tell me about the sea."))
    body = response.json()
    assert response.status_code == 200, body
    assert response.headers["x-kvrelay-model"] == "small"
    assert body["model"] == "small" and body["choices"][0]["message"]["content"] == text
    assert body["usage"]["completion_tokens"] == MAX_TOKENS

    response = await client.post(f"/{app}/v1/chat/completions", json=chat("Tell me about the sea.", stream=True))
    assert response.status_code == 200 and response.headers["x-kvrelay-model"] == "small"
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    assert {e["model"] for e in events[:-1]} == {"small"}
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1]) == text


async def shed(client: httpx.AsyncClient, app: str, reason: str) -> None:
    response = await client.post(f"/{app}/v1/chat/completions", json=chat("Not important.", priority=10))
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "7" and response.headers["x-kvrelay-degraded"] == reason
    assert response.json()["error"]["code"] == "request_shed"


def test_saturated_primary_falls_back_and_sheds_low_priority(serve_instance, fallback_text):
    url = serve_instance
    held = chat("Talk for a long time.", max_tokens=1500, ignore_eos=True, stream=True)

    async def run():
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as client:
            # Fill the pool: one request running, one queued behind it.
            async with client.stream("POST", "/busy/v1/chat/completions", json=held) as running:
                assert running.status_code == 200 and running.headers["x-kvrelay-model"] == "tiny"
                lines = running.aiter_lines()
                while not (await anext(lines)).startswith("data: "):
                    pass
                queued = asyncio.create_task(client.post("/busy/v1/chat/completions", json=held))
                await asyncio.sleep(2.0)  # it reaches the Worker's queue (its answer waits for the running one)
                assert not queued.done()

                await degraded_answers(client, "busy", fallback_text)
                await shed(client, "busy", "saturated")
                # The held work went on on the primary meanwhile.
                while not (line := await anext(lines)):
                    pass
                assert json.loads(line.removeprefix("data: "))["model"] == "tiny"
                queued.cancel()
                await asyncio.gather(queued, return_exceptions=True)

    asyncio.run(run())
    assert metric(url, "busy", "kvrelay_degraded_requests_total", reason="saturated", target="small", outcome="served") == 2
    assert metric(url, "busy", "kvrelay_degraded_requests_total", reason="saturated", target="none", outcome="shed") == 1
    assert metric(url, "busy", "kvrelay_requests_total", status="503", finish_reason="none") == 1
    # Billed once, by the app that answered, under the caller's key.
    assert usage(url, "small")["output_tokens"] >= 2 * MAX_TOKENS
    assert metric(url, "small", "kvrelay_requests_total", model="small", status="200") >= 2


def test_dead_primary_falls_back_and_sheds_low_priority(serve_instance, fallback_text):
    url = serve_instance
    small_before = metric(url, "small", "kvrelay_requests_total", model="small", status="200")

    async def run():
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as client:
            await degraded_answers(client, "dead", fallback_text)
            await shed(client, "dead", "down")
            completion = await client.post("/dead/v1/completions", json={
                "model": "tiny", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "stream": True,
            })
            assert completion.status_code == 200 and completion.headers["x-kvrelay-degraded"] == "down"
            assert {e["model"] for e in sse_events(completion.text)[:-1]} == {"small"}

    asyncio.run(run())
    assert metric(url, "dead", "kvrelay_degraded_requests_total", reason="down", target="small", outcome="served") == 3
    assert metric(url, "dead", "kvrelay_degraded_requests_total", reason="down", target="none", outcome="shed") == 1
    assert metric(url, "dead", "kvrelay_requests_total", status="200") == 0  # counted by the fallback
    assert metric(url, "small", "kvrelay_requests_total", model="small", status="200") == small_before + 3
    assert usage(url, "dead")["num_model_requests"] == 0
