"""Apps whose pools run vLLM (`engine.backend: vllm`) on one local Ray: the OpenAI API in front
answers as it does for kvrelay's engine, and the pools' signals come from vLLM's stats.

    /vllm     colocated: one Worker on vLLM (a chat completion equal to transformers' greedy
              tokens, streaming, /v1/models, a bad request's 400, vLLM's figures at /metrics)
    /vllmpd   disaggregated: two prefill replicas and one decode replica on vLLM; every request's
              KV crosses kvrelay's hand-off (vLLM's cache -> the node's KV arena -> the other
              vLLM's cache, serving/engine/vllm/connector.py) with no fallback and one engine's
              greedy text, a hand-off lost before its claim is recomputed with the same tokens,
              and the prefix router follows each prefix across the two prefill replicas from
              vLLM's own KV events
"""

from __future__ import annotations

import random
import time

import httpx
import openai
import pytest

from load_tests.local_ray import free_port
from serving.api.generation.pipeline import Frontend
from serving.api.protocol.wire import ChatMessage
from serving.deployments.messages import WorkerRequest, WorkerStats
from serving.engine import SamplingParams
from serving.engine.modeling.loader import load_tokenizer
from tests.helpers import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

APP = "vllmpd"
PREFIX_TOKENS = 64  # two of vLLM's blocks of 32
ENGINE = {"backend": "vllm", "dtype": "float32", "kv_cache_bytes": 2**28, "max_model_len": 1024, "max_num_seqs": 8}


@pytest.fixture(scope="module")
def served(tmp_path_factory, default_model_dir, needs_vllm):
    """Both apps on one Ray, behind Serve's proxy: {"coloc": url, "pd": url}."""
    import ray
    from ray import serve

    from serving.config import ServeConfig
    from serving.deployments import kv_transfer
    from serving.deployments.app import build_app

    small = {"num_cpus": 0.1}
    configs = {
        "vllm": {"mode": "colocated", "worker": {"num_cpus": 1}},
        APP: {"mode": "disaggregated", "prefill": {**small, "num_replicas": 2}, "decode": small,
              # the load bound off: with four prefixes on two replicas it may move one on purpose
              "routing": {"stats_period_s": 0.2, "prefill_params": {"max_load_ratio": None}}},
    }
    ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING", _temp_dir=str(tmp_path_factory.mktemp("ray")))
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # Both apps start together (serve.run_many): a vLLM engine's start waits on its own
        # processes part of the time, which the other app's engines fill.
        targets = []
        for name, layout in configs.items():
            config = ServeConfig.model_validate({"model": str(default_model_dir), "served_model_name": "smol",
                                                 "app_name": name, "engine": ENGINE, "ingress": {"num_cpus": 0.05},
                                                 **layout})
            targets.append(serve.RunTarget(build_app(config), name=name, route_prefix=f"/{name}"))
        serve.run_many(targets)
        yield {"coloc": f"http://127.0.0.1:{port}/vllm", "pd": f"http://127.0.0.1:{port}/{APP}"}
        kv_transfer.kill_all(APP)
        serve.shutdown()
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def coloc(served) -> str:
    return served["coloc"]


@pytest.fixture(scope="module")
def pd(served) -> str:
    return served["pd"]


# ---- colocated ---------------------------------------------------------------------------------
def test_a_chat_completion_through_vllm_gives_transformers_greedy_text(coloc, default_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    frontend = Frontend(load_tokenizer(default_model_dir), backend=None, model_name="smol")
    prompt = frontend.encode_chat([ChatMessage(role="user", content="What is the capital of France?")])
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    client = openai.OpenAI(base_url=f"{coloc}/v1", api_key="none")
    reply = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "What is the capital of France?"}],
                                           max_tokens=12, temperature=0)
    eos = hf.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    kept = expected[: next((i for i, t in enumerate(expected) if t in eos), len(expected))]
    assert reply.choices[0].message.content == frontend.tokenizer.decode(kept, skip_special_tokens=True)
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == len(kept) + (len(kept) < 12)

    stream = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "What is the capital of France?"}],
                                            max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reply.choices[0].message.content
    assert [m.id for m in client.models.list().data] == ["smol"]


def test_a_bad_request_is_a_400_naming_the_field_and_the_pool_reports_vllms_figures(coloc):
    bad = httpx.post(f"{coloc}/v1/chat/completions", json={"model": "smol", "messages": [{"role": "user", "content": "hi"}],
                                                         "temperature": -1}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"

    def engine_info():  # the worker's sampled engine figures reach the ingress's /metrics
        text = httpx.get(f"{coloc}/metrics", timeout=30).text
        return [line for line in text.splitlines() if line.startswith("kvrelay_engine_kernel_info") and 'kernel_path="vllm"' in line]

    assert wait_until(engine_info, timeout_s=60)


# ---- disaggregated: the hand-off through kvrelay -------------------------------------------------
@pytest.fixture(scope="module")
def greedy(default_model_dir):
    """transformers' greedy tokens (fp32) for a chat message through the ingress's template."""
    import torch
    from transformers import AutoModelForCausalLM

    frontend = Frontend(load_tokenizer(default_model_dir), backend=None, model_name="smol")
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    eos = hf.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])

    def run(content: str, max_tokens: int) -> tuple[list[int], list[int]]:
        prompt = frontend.encode_chat([ChatMessage(role="user", content=content)])
        with torch.inference_mode():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)[0, len(prompt):].tolist()
        return prompt, out[: next((i for i, t in enumerate(out) if t in eos), len(out))]

    run.tokenizer = frontend.tokenizer
    return run


def handle(deployment: str):
    from ray import serve

    return serve.get_deployment_handle(deployment, app_name=APP)


def stats(deployment: str) -> WorkerStats:
    return handle(deployment).stats.remote().result(timeout_s=30)


def kv_held() -> int:
    import ray

    from serving.deployments import kv_transfer

    actor = ray.get_actor(kv_transfer.actor_name(APP, ray.get_runtime_context().get_node_id()), namespace=kv_transfer.NAMESPACE)
    return ray.get(actor.stats.remote(), timeout=30).num_held


def prompt_tokens_computed(s: WorkerStats) -> int:
    return s.engine.num_computed_tokens - s.engine.num_generated_tokens


def test_a_chat_crosses_the_hand_off_with_no_fallback_and_one_engines_text(pd, greedy):
    content = "What is the capital of France?"
    prompt, expected = greedy(content, 12)
    before = stats("DecodeWorker")
    client = openai.OpenAI(base_url=f"{pd}/v1", api_key="none")
    reply = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": content}],
                                           max_tokens=12, temperature=0)
    assert reply.choices[0].message.content == greedy.tokenizer.decode(expected, skip_special_tokens=True)
    assert reply.usage.prompt_tokens == len(prompt)
    stream = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": content}],
                                            max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reply.choices[0].message.content

    def settled():  # vLLM's stat loggers report after the step
        after = stats("DecodeWorker")
        return after if after.engine.num_generated_tokens - before.engine.num_generated_tokens == 2 * (len(expected) + (len(expected) < 12) - 1) else None

    after = wait_until(settled, timeout_s=20)
    assert after.counters.num_kv_imports == before.counters.num_kv_imports + 2
    assert after.counters.num_kv_fallbacks == before.counters.num_kv_fallbacks
    assert after.engine.num_expired_imports == before.engine.num_expired_imports
    # the decode engine computed only each request's first token as prompt: the KV came over
    assert prompt_tokens_computed(after) - prompt_tokens_computed(before) == 2
    wait_until(lambda: kv_held() == 0, timeout_s=10)
    assert stats("PrefillWorker").engine.num_held_exports == 0


def test_a_hand_off_lost_before_its_claim_is_recomputed_with_the_same_tokens(pd, greedy):
    import ray

    from serving.deployments import kv_transfer

    prompt, expected = greedy("Tell me about lost caches.", 10)
    request = WorkerRequest("lost-1", prompt, SamplingParams(temperature=0, max_tokens=10, detokenize=False))
    result = handle("PrefillWorker").prefill.remote(request).result(timeout_s=60)
    assert result.kv is not None and result.kv.num_tokens == len(prompt)
    wait_until(lambda: kv_held() == 1, timeout_s=10)
    actor = ray.get_actor(kv_transfer.actor_name(APP, result.kv.node_id), namespace=kv_transfer.NAMESPACE)
    assert ray.get(actor.release.remote("lost-1")) is True
    before = stats("DecodeWorker")
    first = result.output.outputs[0].token_ids
    rest = [t for out in handle("DecodeWorker").options(stream=True).generate.remote(request, result.kv, first)
            for t in out.outputs[0].token_ids]
    assert (first + rest)[: len(expected)] == expected
    after = stats("DecodeWorker")
    assert after.counters.fallback_reasons.get("released", 0) == before.counters.fallback_reasons.get("released", 0) + 1


def test_the_router_follows_each_prefix_across_two_vllm_prefill_replicas(pd):
    from ray import serve

    assert serve.status().applications[APP].deployments["PrefillWorker"].replica_states.get("RUNNING") == 2
    rng = random.Random(0)
    prefixes = [[rng.randrange(100, 40000) for _ in range(PREFIX_TOKENS)] for _ in range(4)]

    def cached(client: httpx.Client, prompt: list[int]) -> int:
        body = {"model": "smol", "prompt": prompt, "max_tokens": 1, "temperature": 0}  # the prefill pool alone
        answer = client.post(f"{pd}/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def suffix() -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(8)]

    with httpx.Client(timeout=60) as client:
        assert [cached(client, prefix + suffix()) for prefix in prefixes] == [0, 0, 0, 0]  # cold
        time.sleep(1.0)  # vLLM's events relayed, then a few stats periods: the routers hold the blocks
        hits = [cached(client, prefix + suffix()) for _ in range(3) for prefix in prefixes]
    # each on the replica holding its prefix, as vLLM itself found: the whole prefix cached
    assert hits == [PREFIX_TOKENS] * 12
