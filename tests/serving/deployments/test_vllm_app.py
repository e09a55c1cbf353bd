"""A served app whose worker pool runs vLLM (`worker.engine.backend: vllm`, colocated) on a local
Ray: the OpenAI API in front answers as it does for kvrelay's engine (a chat completion equal to
transformers' greedy tokens, streaming, /v1/models, a bad request's 400), and the pool's signals
come from vLLM's stats."""

from __future__ import annotations

import httpx
import openai
import pytest

from load_tests.local_ray import free_port
from serving.api.pipeline import Frontend
from serving.api.protocol import ChatMessage
from serving.engine.model_loader import load_tokenizer
from tests.helpers import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


@pytest.fixture(scope="module")
def app(tmp_path_factory, default_model_dir, needs_vllm):
    import ray
    from ray import serve

    from serving.config import ServeConfig
    from serving.deployments.app import build_app

    ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING", _temp_dir=str(tmp_path_factory.mktemp("ray")))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = ServeConfig.model_validate({
        "model": str(default_model_dir), "served_model_name": "smol", "app_name": "vllm", "mode": "colocated",
        "engine": {"dtype": "float32", "kv_cache_bytes": 2**30, "max_model_len": 1024, "max_num_seqs": 8},
        "worker": {"num_cpus": 1, "engine": {"backend": "vllm"}}, "ingress": {"num_cpus": 0.1},
    })
    serve.run(build_app(config), name="vllm", route_prefix="/vllm")
    yield f"http://127.0.0.1:{port}/vllm"
    serve.shutdown()
    ray.shutdown()


def test_a_chat_completion_through_vllm_gives_transformers_greedy_text(app, default_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    frontend = Frontend(load_tokenizer(default_model_dir), backend=None, model_name="smol")
    prompt = frontend.encode_chat([ChatMessage(role="user", content="What is the capital of France?")])
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    client = openai.OpenAI(base_url=f"{app}/v1", api_key="none")
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


def test_a_bad_request_is_a_400_naming_the_field_and_the_pool_reports_vllms_figures(app):
    bad = httpx.post(f"{app}/v1/chat/completions", json={"model": "smol", "messages": [{"role": "user", "content": "hi"}],
                                                         "temperature": -1}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"

    def engine_info():  # the worker's sampled engine figures reach the ingress's /metrics
        text = httpx.get(f"{app}/metrics", timeout=30).text
        return [line for line in text.splitlines() if line.startswith("kvrelay_engine_kernel_info") and 'kernel_path="vllm"' in line]

    assert wait_until(engine_info, timeout_s=60)
