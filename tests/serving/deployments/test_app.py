"""The app on a local Ray: disaggregated and colocated, real clients, and every failure outcome.

One Ray (with its dashboard, for the state API) and one Serve instance for the module, with four
apps on one HTTP port under different route prefixes:

    /disagg   prefill + decode pools, KV through the KVTransfer actor
    /coloc    one Worker pool
    /faults   disaggregated, KV lease 1 s and a KV-claim timeout so short every import times out
    /queue    colocated, one ongoing + one queued request per replica (for 429)
    /spec     disaggregated, n-gram speculative decoding on the decode pool
    /crash    disaggregated, with faults (serving/deployments/faults.py) a test arms by deleting its file:
              a replica then exits at that point, once

All use a tiny random model in float32, so greedy outputs are compared token for token with the
engine run in this process.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path
from unittest import mock

import httpx
import openai
import pytest

from load_tests.local_ray import free_port
from serving.api.generation.pipeline import Frontend
from serving.api.protocol.wire import ChatMessage
from serving.cli.status import parse_metrics
from serving.deployments import faults, kv_transfer
from serving.deployments.messages import KVTransferStats, WorkerRequest, WorkerStats
from serving.engine.config import EngineConfig
from serving.engine.engine import LLMEngine
from serving.engine.params import SamplingParams
from tests.asgi import sse_events
from tests.helpers import TINY_KV_BYTES, tiny_app_config, wait_until

pytestmark = pytest.mark.integration

MAX_TOKENS = 24
# Adaptive speculation with its step costs pinned: measured, the tiny model's could turn it off.
PINNED_SPEC = {"verify_row_cost": 0.1, "max_batch_rows": 64}


@pytest.fixture(scope="module")
def serve_instance(tmp_path_factory, tiny_model_dir):
    import ray
    from ray import serve

    from serving.deployments.app import build_app

    ray.init(
        num_cpus=8, include_dashboard=True, dashboard_port=free_port(), logging_level="WARNING",
        _temp_dir=str(tmp_path_factory.mktemp("ray")),
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    faults_dir = tmp_path_factory.mktemp("faults")
    crash_faults = [
        {"point": "decode.after_tokens", "count": 2, "once": str(faults_dir / "decode")},
        {"point": "decode.after_tokens", "count": 2, "once": str(faults_dir / "decode-again")},
        {"point": "prefill.before_first_token", "once": str(faults_dir / "prefill")},
        {"point": "ingress.after_tokens", "count": 3, "once": str(faults_dir / "ingress")},
    ]
    for fault in crash_faults:
        Path(fault["once"]).touch()  # disarmed
    configs = {
        "disagg": tiny_app_config(tiny_model_dir, "disagg", engine={
            "dtype": "float32", "kv_cache_bytes": TINY_KV_BYTES, "num_threads": 1, "lora": {"allow_runtime_updates": True}}),
        "coloc": tiny_app_config(tiny_model_dir, "coloc", mode="colocated"),
        "faults": tiny_app_config(tiny_model_dir, "faults", kv_transfer={"lease_s": 1.0, "timeout_s": 1e-9}),
        "queue": tiny_app_config(
            tiny_model_dir, "queue", mode="colocated",
            worker={"num_cpus": 0.1, "max_ongoing_requests": 1, "max_queued_requests": 1},
        ),
        "spec": tiny_app_config(tiny_model_dir, "spec", decode={"num_cpus": 0.1, "engine": {"speculative": PINNED_SPEC}}),
    }
    for name, config in configs.items():
        serve.run(build_app(config), name=name, route_prefix=f"/{name}")
    crash = tiny_app_config(tiny_model_dir, "crash")
    with mock.patch.dict(os.environ, {faults.ENV: json.dumps(crash_faults)}):
        crash_app = build_app(crash)
    serve.run(crash_app, name="crash", route_prefix="/crash")
    configs["crash"] = crash
    yield {"url": f"http://127.0.0.1:{port}", "configs": configs, "faults": faults_dir}
    from serving.deployments import kv_transfer

    for name in configs:
        kv_transfer.kill_all(name)
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """The engine in this process, and the chat template applied the way the ingress does."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_bytes=TINY_KV_BYTES))
    frontend = Frontend(engine.tokenizer, backend=None, model_name="tiny")

    def greedy(content: str, max_tokens: int = MAX_TOKENS, **params) -> tuple[list[int], str]:
        ids = frontend.encode_chat([ChatMessage(role="user", content=content)])
        out = engine.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens, **params))[0]
        return out.outputs[0].token_ids, out.outputs[0].text

    return greedy


def handle(app: str, deployment: str):
    from ray import serve

    return serve.get_deployment_handle(deployment, app_name=app)


def stats(app: str, deployment: str) -> WorkerStats:
    return handle(app, deployment).stats.remote().result(timeout_s=30)


def kv_actor_stats(app: str) -> KVTransferStats:
    """The stats of the app's KVTransfer actor on this node: all zeros before its first hand-off
    (a worker starts the actor on its first KV export; a test run alone reads it before that)."""
    import ray

    from serving.deployments import kv_transfer

    node_id = ray.get_runtime_context().get_node_id()
    try:
        actor = ray.get_actor(kv_transfer.actor_name(app, node_id), namespace=kv_transfer.NAMESPACE)
    except ValueError:  # no such actor (yet)
        return KVTransferStats(node_id, num_held=0, bytes_held=0, num_offered=0, num_claimed=0, num_released=0,
                               num_expired=0, num_missed=0, bytes_offered=0)
    return ray.get(actor.stats.remote(), timeout=30)


# ---- real clients ----------------------------------------------------------------------------
@pytest.mark.parametrize("app", ["disagg", "coloc"])
def test_openai_sdk_greedy_equals_engine(serve_instance, reference, app):
    client = openai.OpenAI(base_url=f"{serve_instance['url']}/{app}/v1", api_key="unused", max_retries=0)
    prompt = "Tell me about the ocean."
    token_ids, text = reference(prompt)

    response = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=MAX_TOKENS,
    )
    assert response.choices[0].message.content == text
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == len(token_ids) == MAX_TOKENS

    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=MAX_TOKENS,
        stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    # /v1/responses runs through the same pipeline: the same prompt, the same text
    answer = client.responses.create(model="tiny", input=prompt, temperature=0, max_output_tokens=MAX_TOKENS)
    assert answer.output_text == text and answer.usage.output_tokens == MAX_TOKENS
    events = list(client.responses.create(model="tiny", input=prompt, temperature=0, max_output_tokens=MAX_TOKENS, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == text


@pytest.mark.parametrize("app", ["disagg", "coloc"])
def test_schemathesis_over_http_gets_no_5xx_and_only_openai_shaped_4xx(serve_instance, app):
    """The served app (Serve's proxy, the ingress, the pools) under issue 17's property-based run,
    fewer cases than the ASGI run in tests/serving/api: what it adds is the real path."""
    import schemathesis

    from tests.openapi_fuzz import fuzz

    base_url = f"{serve_instance['url']}/{app}"
    failures, statuses = fuzz(schemathesis.openapi.from_url(f"{base_url}/openapi.json"), 5, base_url=base_url, timeout=120)
    assert failures == []
    for path in ("POST /v1/chat/completions", "POST /v1/completions"):
        assert 200 in statuses[path] and statuses[path] & {400, 422}, statuses

def test_a_response_over_grpcs_4_mib_default_crosses_serves_proxy_whole(serve_instance, tiny_model_dir):
    """Serve's proxy reads the ingress's response over gRPC as one message: Ray's default bound,
    4 MiB, made any larger one a 500. A tokenized 2.5 MiB prompt with its token strings is over 6 MiB."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_bytes=TINY_KV_BYTES))
    prompt = "hello world " * 218_000  # 2.6 MB: within the body limit
    ids = engine.tokenizer(prompt).input_ids
    response = httpx.post(f"{serve_instance['url']}/coloc/tokenize", json={"prompt": prompt, "return_token_strs": True}, timeout=120)
    assert response.status_code == 200, response.text[:300]
    assert len(response.content) > 6 * 2**20
    body = response.json()
    assert (body["count"], body["tokens"], len(body["token_strs"])) == (len(ids), ids, len(ids))


@pytest.mark.parametrize("app", ["disagg", "coloc"])
def test_scoring_a_prompt_and_tokenizing_it(serve_instance, tiny_model_dir, app):
    """Echo + logprobs, max_tokens 0 and prompt_logprobs equal the engine's own prompt logprobs
    (fp32); disaggregated, the prefill worker computes them and they cross Ray in its first output."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_bytes=TINY_KV_BYTES))
    prompt = "Once upon a time there was"
    ids = engine.tokenizer(prompt).input_ids
    [expected] = engine.generate([ids], SamplingParams(temperature=0, max_tokens=3, logprobs=1, prompt_logprobs=1))
    scores = [lp.logprob for lp in expected.prompt_logprobs]
    prefills = stats(app, "PrefillWorker").counters.num_prefills if app == "disagg" else 0
    client = openai.OpenAI(base_url=f"{serve_instance['url']}/{app}/v1", api_key="unused", max_retries=0)

    echoed = client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=1, max_tokens=3, temperature=0)
    scored = client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    with httpx.Client(base_url=f"{serve_instance['url']}/{app}", timeout=60) as http:
        vllm_style = http.post("/v1/completions", json={"prompt": prompt, "prompt_logprobs": 0, "max_tokens": 2, "temperature": 0}).json()
        tokenized = http.post("/tokenize", json={"prompt": prompt}).json()
        detokenized = http.post("/detokenize", json={"tokens": ids}).json()
        max_model_len = http.get("/v1/models").json()["data"][0]["max_model_len"]

    lp = echoed.choices[0].logprobs
    assert echoed.choices[0].text == prompt + expected.outputs[0].text
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(scores, abs=1e-4)
    assert lp.token_logprobs[len(ids):] == pytest.approx([t.logprob for t in expected.outputs[0].logprobs], abs=1e-4)
    assert scored.choices[0].text == prompt and scored.choices[0].finish_reason == "length"
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(scores, abs=1e-4)
    assert scored.usage.completion_tokens == 0
    entries = vllm_style["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and [e[str(t)]["logprob"] for e, t in zip(entries[1:], ids[1:])] == pytest.approx(scores, abs=1e-4)
    assert tokenized == {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": None}
    assert detokenized == {"prompt": prompt}
    if app == "disagg":  # the three completions were prefilled on the prefill pool
        assert stats(app, "PrefillWorker").counters.num_prefills == prefills + 3


def test_httpx_completions_and_models(serve_instance, reference):
    url = serve_instance["url"] + "/disagg"
    with httpx.Client(base_url=url, timeout=60) as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
        assert client.get("/health").json() == {"status": "ok", "pools": {"prefill": {"RUNNING": 1}, "decode": {"RUNNING": 1}}}
        response = client.post("/v1/completions", json={"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
        body = response.json()
        assert response.status_code == 200, body
        assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 8
        missing = client.post("/v1/chat/completions", json={"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_disaggregated_equals_colocated_with_stop_string(serve_instance, reference):
    """The stop string spans the prefill→decode hand-off: the ingress owns the text."""
    _, text = reference("Write a poem.")
    stop = text[1:6]  # starts inside the first token's text, ends in decode's tokens
    results = {}
    for app in ("disagg", "coloc"):
        with httpx.Client(base_url=serve_instance["url"] + f"/{app}", timeout=60) as client:
            body = client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Write a poem."}], "temperature": 0,
                "max_tokens": MAX_TOKENS, "stop": [stop],
            }).json()
        results[app] = (body["choices"][0]["message"]["content"], body["choices"][0]["finish_reason"])
    assert results["disagg"] == results["coloc"] == (text[: text.index(stop)], "stop")


# ---- structured outputs ----------------------------------------------------------------------
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
    },
    "required": ["name", "age", "pet"],
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.mark.parametrize("app", ["disagg", "coloc"])
def test_structured_outputs_hold_greedy_and_sampled_100_times_out_of_100(serve_instance, reference, app):
    """Disaggregated, the prefill worker samples the first token under the grammar and the decode
    worker replays it into its own matcher before it goes on: the greedy document is the
    in-process engine's, and 100 sampled ones each validate. A schema that does not compile is a
    400 from the ingress, before any worker sees it."""
    import jsonschema

    from serving.engine.params import GuidedSpec

    messages = [{"role": "user", "content": "Describe someone."}]
    before = stats(app, "DecodeWorker" if app == "disagg" else "Worker")
    _, text = reference("Describe someone.", max_tokens=64, guided=GuidedSpec.json_schema(PERSON))
    client = openai.OpenAI(base_url=f"{serve_instance['url']}/{app}/v1", api_key="unused", max_retries=0)
    greedy = client.chat.completions.create(model="tiny", messages=messages, response_format=PERSON_FORMAT, temperature=0, max_tokens=64)
    assert greedy.choices[0].message.content == text and greedy.choices[0].finish_reason == "stop"

    async def sampled() -> list[httpx.Response]:
        limit = asyncio.Semaphore(16)

        async def one(client: httpx.AsyncClient, seed: int) -> httpx.Response:
            async with limit:
                return await client.post("/v1/chat/completions", json={
                    "messages": messages, "response_format": PERSON_FORMAT, "temperature": 1.0, "seed": seed, "max_tokens": 64,
                })

        async with httpx.AsyncClient(base_url=f"{serve_instance['url']}/{app}", timeout=120) as client:
            return await asyncio.gather(*[one(client, seed) for seed in range(100)])

    bodies = [r.json() for r in asyncio.run(sampled())]
    assert [b["choices"][0]["finish_reason"] for b in bodies] == ["stop"] * 100, bodies[0]
    for body in bodies:
        jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), PERSON)
    if app == "disagg":  # every one of them crossed the hand-off
        after = stats(app, "DecodeWorker")
        assert after.counters.num_kv_imports == before.counters.num_kv_imports + 101
        assert after.counters.num_kv_fallbacks == before.counters.num_kv_fallbacks

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny", messages=messages, response_format={**PERSON_FORMAT, "json_schema": {"name": "x", "schema": {"type": "strin"}}},
        )
    assert info.value.param == "response_format.json_schema.schema" and info.value.code == "invalid_value"
    assert info.value.body["message"] == 'response_format.json_schema.schema: cannot be compiled: Unsupported type "strin"'


def test_kv_crosses_through_the_transfer_actor(serve_instance, reference):
    before = stats("disagg", "DecodeWorker")
    actor_before = kv_actor_stats("disagg")
    _, text = reference("What is a KV cache?")
    with httpx.Client(base_url=serve_instance["url"] + "/disagg", timeout=60) as client:
        body = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "What is a KV cache?"}], "temperature": 0, "max_tokens": MAX_TOKENS,
        }).json()
    assert body["choices"][0]["message"]["content"] == text
    after = stats("disagg", "DecodeWorker")
    assert after.counters.num_kv_imports == before.counters.num_kv_imports + 1
    assert after.counters.num_kv_fallbacks == before.counters.num_kv_fallbacks
    actor_after = kv_actor_stats("disagg")
    assert actor_after.num_claimed == actor_before.num_claimed + 1
    assert actor_after.num_held == 0


def test_a_lora_adapter_loaded_at_run_time_crosses_the_kv_hand_off(serve_instance, tiny_model_dir, tmp_path):
    """Both pools check the adapter before it is served; its request is prefilled with it, handed
    off and decoded with it: the text of one engine with the adapter, and no fallback."""
    pytest.importorskip("peft")
    from tests.serving.engine.test_lora import make_adapter

    path = str(tmp_path / "late")
    make_adapter(tiny_model_dir, path, 8, 16, ["q_proj", "v_proj", "up_proj"], False, seed=15)
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_bytes=TINY_KV_BYTES,
                                    lora={"adapters": {"late": path}}))
    prompt = list(range(200, 260))
    engine.add_request("ref", params=SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                       prompt_token_ids=prompt, lora_name="late")
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.outputs[0].token_ids
    expected = engine.tokenizer.decode(tokens)
    before = stats("disagg", "DecodeWorker")
    with httpx.Client(base_url=serve_instance["url"] + "/disagg", timeout=60) as client:
        bad = client.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(tmp_path / "nowhere")})
        assert bad.status_code == 400 and "adapter_config.json not found" in bad.json()["error"]["message"]
        assert client.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": path}).status_code == 200
        body = client.post("/v1/completions", json={"model": "late", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                    "temperature": 0, "ignore_eos": True}).json()
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
    assert body["choices"][0]["text"] == expected
    after = stats("disagg", "DecodeWorker")
    assert after.counters.num_kv_imports == before.counters.num_kv_imports + 1
    assert after.counters.num_kv_fallbacks == before.counters.num_kv_fallbacks


def test_speculation_on_the_decode_pool_after_a_kv_hand_off(serve_instance):
    """The decode pool speculates on what it imported (the prefill pool never does): greedy output
    equal to the same request kept out of speculation (`speculative: false`) and to the app
    without it; the decode worker's stats, its routing stats' metrics at the ingress's /metrics
    and `kvrelay status` show the accepted tokens."""
    from serving.cli.status import _speculation_lines

    # Greedy over three biased tokens: the tiny model loops, and prompt lookup predicts the loops.
    body = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "logit_bias": {"1000": 100, "2000": 100, "3000": 100}}
    before = stats("spec", "DecodeWorker")
    contents = {}
    for app, extra in (("spec", {}), ("spec", {"speculative": False}), ("disagg", {})):
        with httpx.Client(base_url=serve_instance["url"] + f"/{app}", timeout=60) as client:
            answer = client.post("/v1/chat/completions", json={**body, **extra}).json()
        contents[(app, bool(extra))] = (answer["choices"][0]["message"]["content"], answer["usage"]["completion_tokens"])
    assert contents[("spec", False)] == contents[("spec", True)] == contents[("disagg", False)]
    assert contents[("spec", False)][1] == 40
    after = stats("spec", "DecodeWorker")
    assert after.counters.num_kv_imports == before.counters.num_kv_imports + 2  # both decoded after a hand-off
    assert after.engine.spec_method == "ngram"
    assert 0 < after.engine.spec_accepted_tokens - before.engine.spec_accepted_tokens < (
        after.engine.spec_proposed_tokens - before.engine.spec_proposed_tokens)
    assert stats("spec", "PrefillWorker").engine.spec_method == ""
    assert stats("disagg", "DecodeWorker").engine.spec_method == ""

    def reported() -> list[str]:  # the decode replica's routing stats carry its metrics every stats period
        text = httpx.get(f"{serve_instance['url']}/spec/metrics", timeout=10).text
        accepted = sum(v for n, labels, v in parse_metrics(text)
                       if n == "kvrelay_spec_decode_accepted_tokens_total" and labels.get("pool") == "decode")
        return _speculation_lines(parse_metrics(text)) if accepted == after.engine.spec_accepted_tokens else []

    lines = wait_until(reported, timeout_s=30)
    engine = after.engine
    assert lines[2:] == [
        f"  decode     ngram      {engine.spec_proposed_tokens:>9g} {engine.spec_accepted_tokens:>9g} "
        f"{engine.spec_acceptance_rate:>6.1%} {engine.spec_tokens_per_step:>8.2f}",
    ]


# ---- failure outcomes ------------------------------------------------------------------------
def test_kv_claim_timeout_recomputes_with_the_same_output(serve_instance, reference):
    before = stats("faults", "DecodeWorker")
    _, text = reference("Explain transfer timeouts.")
    with httpx.Client(base_url=serve_instance["url"] + "/faults", timeout=60) as client:
        body = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Explain transfer timeouts."}], "temperature": 0, "max_tokens": MAX_TOKENS,
        }).json()
    assert body["choices"][0]["message"]["content"] == text
    after = stats("faults", "DecodeWorker")
    assert after.counters.num_kv_fallbacks == before.counters.num_kv_fallbacks + 1
    assert after.counters.fallback_reasons.get("timeout", 0) == before.counters.fallback_reasons.get("timeout", 0) + 1
    assert after.counters.num_kv_imports == before.counters.num_kv_imports
    # The timed-out worker released the KV instead of leaving it to the lease.
    wait_until(lambda: kv_actor_stats("faults").num_held == 0, timeout_s=10)


def test_kv_lost_before_claim_recomputes(serve_instance, tiny_model_dir, reference):
    """The KV is gone (released) when the decode worker claims it: it recomputes, same tokens."""
    import ray

    from serving.engine.modeling.loader import load_tokenizer

    token_ids, _ = reference("Lost KV.")

    frontend = Frontend(load_tokenizer(tiny_model_dir), None, "tiny")
    ids = frontend.encode_chat([ChatMessage(role="user", content="Lost KV.")])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, detokenize=False)
    request = WorkerRequest("lost-kv-1", ids, params)
    result = handle("disagg", "PrefillWorker").prefill.remote(request).result(timeout_s=30)
    assert result.kv is not None and result.kv.num_tokens == len(ids)
    from serving.deployments import kv_transfer

    # The offer follows the first token (and creates the node's actor in a fresh app); release
    # once it is held.
    def held() -> bool:
        try:
            return kv_actor_stats("disagg").num_held == 1
        except ValueError:  # no actor yet
            return False

    wait_until(held, timeout_s=10)
    actor = ray.get_actor(kv_transfer.actor_name("disagg", result.kv.node_id), namespace=kv_transfer.NAMESPACE)
    assert ray.get(actor.release.remote("lost-kv-1")) is True

    before = stats("disagg", "DecodeWorker")
    first = result.output.outputs[0].token_ids
    gen = handle("disagg", "DecodeWorker").options(stream=True).generate.remote(request, result.kv, first)
    rest = [t for out in gen for t in out.outputs[0].token_ids]
    assert first + rest == token_ids
    after = stats("disagg", "DecodeWorker")
    assert after.counters.fallback_reasons.get("released", 0) == before.counters.fallback_reasons.get("released", 0) + 1


def test_unclaimed_kv_is_freed_when_its_lease_ends(serve_instance, tiny_model_dir):
    from serving.engine.modeling.loader import load_tokenizer

    frontend = Frontend(load_tokenizer(tiny_model_dir), None, "tiny")
    ids = frontend.encode_chat([ChatMessage(role="user", content="Nobody claims this KV.")])
    before = kv_actor_stats("faults")
    request = WorkerRequest("lease-1", ids, SamplingParams(temperature=0, max_tokens=8, detokenize=False))
    result = handle("faults", "PrefillWorker").prefill.remote(request).result(timeout_s=30)
    assert result.kv is not None
    held = wait_until(lambda: (s := kv_actor_stats("faults")).num_held == before.num_held + 1 and s, timeout_s=10)
    assert held.bytes_held == result.kv.num_bytes
    after = wait_until(lambda: (s := kv_actor_stats("faults")).num_held == 0 and s, timeout_s=15)
    assert after.num_expired == before.num_expired + 1
    assert after.bytes_held == 0


def test_client_disconnect_frees_every_block(serve_instance):
    baseline = {d: stats("disagg", d).engine.num_free_blocks for d in ("PrefillWorker", "DecodeWorker")}
    generated_before = stats("disagg", "DecodeWorker").engine.num_generated_tokens  # the module's earlier tests count too
    url = serve_instance["url"] + "/disagg"
    with httpx.Client(base_url=url, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Talk for a long time."}], "temperature": 0,
            "max_tokens": 2000, "ignore_eos": True, "stream": True,
        }) as response:
            assert response.status_code == 200
            seen = 0
            for line in response.iter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen == 4:
                    break  # leave: the connection closes mid-stream

    def settled():
        current = {d: stats("disagg", d) for d in baseline}
        return all(
            s.engine.num_running == 0 and s.engine.num_waiting == 0 and s.engine.num_free_blocks == baseline[d]
            for d, s in current.items()
        ) and current

    current = wait_until(settled, timeout_s=30)
    assert current["DecodeWorker"].engine.num_generated_tokens - generated_before < 2000
    assert kv_actor_stats("disagg").num_held == 0


def test_bad_request_does_not_disturb_the_batch(serve_instance, reference, tiny_model_dir):
    """A worker-level bad request (token id outside the vocabulary) among good streams."""
    prompts = ["First question?", "Second question?", "Third question?"]
    expected = [reference(p)[1] for p in prompts]

    async def good(client, prompt):
        response = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": MAX_TOKENS,
        })
        return response.json()["choices"][0]["message"]["content"]

    async def bad():
        request = WorkerRequest("bad-1", [1, 2, 10**9], SamplingParams(temperature=0, max_tokens=4, detokenize=False))
        gen = handle("disagg", "DecodeWorker").options(stream=True).generate.remote(request, None, [])
        return [item async for item in gen]

    async def run():
        async with httpx.AsyncClient(base_url=serve_instance["url"] + "/disagg", timeout=60) as client:
            return await asyncio.gather(*(good(client, p) for p in prompts), bad())

    *texts, bad_items = asyncio.run(run())
    assert texts == expected
    assert len(bad_items) == 1
    assert bad_items[0].kind == "invalid" and bad_items[0].param == "prompt_token_ids"
    assert "not in the vocabulary" in bad_items[0].message


def test_queue_full_answers_429_with_retry_after(serve_instance):
    body = {"messages": [{"role": "user", "content": "Keep going."}], "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def one(client):
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return response.status_code, response.headers.get("retry-after"), response.json()
            async for _ in response.aiter_lines():
                pass
            return 200, None, None

    async def run():
        async with httpx.AsyncClient(base_url=serve_instance["url"] + "/queue", timeout=120) as client:
            return await asyncio.gather(*(one(client) for _ in range(4)))

    results = asyncio.run(run())
    rejected = [r for r in results if r[0] == 429]
    assert rejected, results
    assert all(r[1] == "1" and r[2]["error"]["code"] == "queue_full" for r in rejected)
    assert any(r[0] == 200 for r in results)


# ---- replicas and the KVTransfer actor die ----------------------------------------------------
def arm(serve_instance, fault: str) -> Path:
    """Arm one of /crash's faults: the next replica to reach it exits (once)."""
    marker = serve_instance["faults"] / fault
    marker.unlink()
    return marker


def wait_healthy(serve_instance, app: str) -> None:
    """Every deployment of the app has its one replica alive and running again (after a test
    killed one). The controller notices a dead replica only at its next health check, so its
    status alone can still say HEALTHY: count the live replica actors too."""
    from ray import serve
    from ray.util.state import list_actors

    def healthy():
        status = serve.status().applications[app]
        if status.status != "RUNNING" or any(d.status != "HEALTHY" for d in status.deployments.values()):
            return False
        alive = list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
        replicas = [a for a in alive if a.class_name.startswith(f"ServeReplica:{app}:")]
        if len(replicas) != len(status.deployments):
            return False
        return httpx.get(f"{serve_instance['url']}/{app}/health", timeout=10).status_code == 200

    wait_until(healthy, timeout_s=120, interval_s=0.5)


def recoveries(serve_instance, app: str, kind: str) -> float:
    text = httpx.get(f"{serve_instance['url']}/{app}/metrics", timeout=10).text
    return sum(v for n, labels, v in parse_metrics(text) if n == "kvrelay_recoveries_total" and labels.get("kind") == kind)


def stream_chat(url: str, body: dict) -> list:
    with httpx.Client(base_url=url, timeout=httpx.Timeout(120)) as client:
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
            assert response.status_code == 200
            return sse_events(response.iter_lines())


def streamed_text(payloads: list) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in payloads if "choices" in e)


def test_a_decode_replica_that_dies_mid_stream_is_resumed_with_the_same_greedy_text(serve_instance, reference):
    """The decode replica exits after streaming two tokens: the request resumes on the restarted
    replica from the three tokens the client has (prefill's and decode's two), and the client gets
    exactly the greedy text, once, with no error; the resume is counted."""
    wait_healthy(serve_instance, "crash")
    prompt = "A long story, please."
    _, text = reference(prompt, max_tokens=40, ignore_eos=True)
    before = recoveries(serve_instance, "crash", "decode_resumed")
    marker = arm(serve_instance, "decode")
    events = stream_chat(serve_instance["url"] + "/crash", {
        "messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 40, "ignore_eos": True,
    })
    assert marker.exists()  # the fault fired
    assert events[-1] == "[DONE]"
    payloads = events[:-1]
    assert [e for e in payloads if "error" in e] == []
    assert streamed_text(payloads) == text
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert recoveries(serve_instance, "crash", "decode_resumed") == before + 1


def test_a_live_ingress_is_never_taken_for_dead(serve_instance):
    """Workers check each request's ingress every second (serving/deployments/caller_watch.py): a stream of a
    few seconds through a live ingress runs to its end."""
    wait_healthy(serve_instance, "crash")
    events = stream_chat(serve_instance["url"] + "/crash", {
        "messages": [{"role": "user", "content": "Talk for a while."}], "temperature": 0, "max_tokens": 1200,
        "ignore_eos": True, "stream_options": {"include_usage": True},
    })
    assert events[-1] == "[DONE]"
    assert [e for e in events[:-1] if "error" in e] == []
    assert events[-2]["usage"]["completion_tokens"] == 1200
    assert [e["choices"][0]["finish_reason"] for e in events[:-2] if e["choices"][0]["finish_reason"]] == ["length"]


def test_a_decode_replica_that_dies_again_while_resuming_ends_the_stream_with_an_error_event(serve_instance, reference):
    wait_healthy(serve_instance, "crash")
    prompt = "Another long story."
    _, text = reference(prompt, max_tokens=40, ignore_eos=True)
    arm(serve_instance, "decode")
    arm(serve_instance, "decode-again")
    events = stream_chat(serve_instance["url"] + "/crash", {
        "messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 40, "ignore_eos": True,
    })
    assert events[-1] == "[DONE]"
    *tokens, error = events[:-1]
    assert error["error"]["code"] == "no_worker"
    assert "the replica serving this request died" in error["error"]["message"]
    assert all("choices" in e for e in tokens)
    assert text.startswith(streamed_text(tokens))  # what came before the error was right


def test_a_prefill_replica_that_dies_before_the_first_token_is_replaced_by_the_decode_pool(serve_instance, reference):
    wait_healthy(serve_instance, "crash")
    prompt = "Prefill, then die."
    _, text = reference(prompt)
    before = recoveries(serve_instance, "crash", "prefill_on_decode")
    marker = arm(serve_instance, "prefill")
    response = httpx.post(serve_instance["url"] + "/crash/v1/chat/completions", json={
        "messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": MAX_TOKENS,
    }, timeout=120)
    assert marker.exists()
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == text
    assert recoveries(serve_instance, "crash", "prefill_on_decode") == before + 1


def test_when_the_ingress_dies_its_request_is_aborted_everywhere_and_every_block_returns(serve_instance):
    """The ingress exits holding a stream of 2000 tokens: the decode worker must not generate
    them for nobody (it aborts within about a second; 2000 tokens take about 5 s here); its
    engine and the prefill's go back to their free blocks."""
    wait_healthy(serve_instance, "crash")
    baseline = {d: stats("crash", d) for d in ("PrefillWorker", "DecodeWorker")}
    marker = arm(serve_instance, "ingress")
    got: list[str] = []
    with httpx.Client(base_url=serve_instance["url"] + "/crash", timeout=httpx.Timeout(120)) as client:
        try:
            with client.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Talk for a long time."}], "temperature": 0,
                "max_tokens": 2000, "ignore_eos": True, "stream": True,
            }) as response:
                for line in response.iter_lines():
                    got.append(line)
        except httpx.HTTPError:
            pass  # the connection dropped with the ingress
    assert marker.exists()

    keys = ("num_running", "num_waiting", "num_held_exports", "num_free_blocks")
    expected = {d: (0, 0, 0, s.engine.num_free_blocks) for d, s in baseline.items()}
    seen = {}

    def settled():
        current = {d: stats("crash", d) for d in baseline}
        seen.update({d: tuple(getattr(s.engine, k) for k in keys) for d, s in current.items()})
        return seen == expected and current

    try:
        current = wait_until(settled, timeout_s=60, interval_s=0.5)
    except AssertionError:
        raise AssertionError(f"{keys}: {seen}, expected {expected}") from None
    generated = current["DecodeWorker"].engine.num_generated_tokens - baseline["DecodeWorker"].engine.num_generated_tokens
    assert generated < 2000, f"the decode worker generated all {generated} tokens for a client nobody serves"
    wait_healthy(serve_instance, "crash")


@pytest.mark.parametrize("restart", [True, False], ids=["ray-restarts-it", "killed-for-good"])
def test_the_kv_transfer_actor_dies_mid_load_and_imports_resume(serve_instance, reference, restart):
    """Requests keep coming while the KVTransfer actor is killed: every one answers with the
    greedy text (a request caught by the kill recomputes its prompt), and KV imports resume within
    a bound, through the restarted actor, or a new one when it was killed for good."""
    import ray

    prompts = [f"Question number {i}?" for i in range(6)]
    expected = {p: reference(p)[1] for p in prompts}
    node_id = ray.get_runtime_context().get_node_id()
    name = kv_transfer.actor_name("disagg", node_id)
    results: list[tuple[str, int, str]] = []
    stop = threading.Event()

    def client():
        with httpx.Client(base_url=serve_instance["url"] + "/disagg", timeout=120) as http:
            i = 0
            while not stop.is_set():
                prompt = prompts[i % len(prompts)]
                response = http.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": MAX_TOKENS,
                })
                body = response.json()
                results.append((prompt, response.status_code, body["choices"][0]["message"]["content"] if response.status_code == 200 else body))
                i += 1

    threads = [threading.Thread(target=client) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(results) >= 6, timeout_s=60)
        ray.kill(ray.get_actor(name, namespace=kv_transfer.NAMESPACE), no_restart=not restart)
        imports_at_kill = stats("disagg", "DecodeWorker").counters.num_kv_imports
        # Imports resume: later requests find the KV through the (restarted or new) actor.
        wait_until(lambda: stats("disagg", "DecodeWorker").counters.num_kv_imports >= imports_at_kill + 3, timeout_s=60, interval_s=0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert all(status == 200 and text == expected[prompt] for prompt, status, text in results), results
    wait_until(lambda: kv_actor_stats("disagg").num_held == 0, timeout_s=30)
