"""Autoscaling on a local Ray: a burst of long prompts takes the prefill pool from 1 to 2 replicas,
and it goes back to 1 after the burst ends.

The policy has short windows (0.5 s pushes, 2 s window, 1 s upscale delay, 3 s downscale delay) and
scales on queued prefill tokens only; the engines compute 32 tokens per step, so 16 clients
resending 1000-token prompts keep far more than 500 tokens queued per replica.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import yaml

from load_tests.local_ray import free_port
from serving.deployments.messages import WorkerRequest
from serving.engine.params import SamplingParams
from tests.helpers import tiny_app_config

pytestmark = pytest.mark.integration

APP = "autoscale"
POLICY = {
    "name": "burst-test",
    "prefill": {
        "min_replicas": 1, "max_replicas": 2, "max_step": 1,
        "window_s": 2, "metrics_interval_s": 0.5, "stale_after_s": 5,
        "upscale_delay_s": 1, "upscale_cooldown_s": 5, "downscale_delay_s": 3, "downscale_threshold": 0.5,
        "targets": {"ttft_p95_ms": None, "queued_prefill_tokens_per_replica": 500},
    },
}
NUM_CLIENTS = 16
PROMPT_TOKENS = 1000
DEADLINE_S = 90.0



@pytest.fixture(scope="module")
def app(tmp_path_factory, tiny_model_dir):
    import ray
    from ray import serve

    from serving.deployments import kv_transfer
    from serving.deployments.app import build_app

    policy = tmp_path_factory.mktemp("policy") / "burst.yaml"
    policy.write_text(yaml.safe_dump(POLICY))
    ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING", _temp_dir=str(tmp_path_factory.mktemp("ray")))
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    engine = {"dtype": "float32", "kv_cache_bytes": 64 * 2**20, "max_num_batched_tokens": 32, "num_threads": 1}
    config = tiny_app_config(tiny_model_dir, APP, engine=engine, autoscaling_policy=str(policy))
    serve.run(build_app(config), name=APP, route_prefix=f"/{APP}")
    yield serve.get_deployment_handle("PrefillWorker", app_name=APP)
    kv_transfer.kill_all(APP)
    serve.shutdown()
    ray.shutdown()


def prefill_replicas() -> dict[str, int]:
    from ray import serve

    return dict(serve.status().applications[APP].deployments["PrefillWorker"].replica_states)


async def wait_for(states: dict[str, int], started: float) -> float:
    while (now := await asyncio.to_thread(prefill_replicas)) != states:
        assert time.monotonic() - started < DEADLINE_S, f"PrefillWorker replicas {now}, waiting for {states}"
        await asyncio.sleep(0.25)
    return time.monotonic() - started


@pytest.mark.timeout(300)
def test_burst_scales_the_prefill_pool_up_and_back_down(app):
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=1, detokenize=False)  # no KV export

    async def client(i: int, stop: asyncio.Event) -> int:
        sent = 0
        while not stop.is_set():
            tokens = [rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)]  # no prefix hits
            await app.prefill.remote(WorkerRequest(f"burst-{i}-{sent}", tokens, params))
            sent += 1
        return sent

    async def scenario():
        assert prefill_replicas() == {"RUNNING": 1}
        stop = asyncio.Event()
        clients = [asyncio.create_task(client(i, stop)) for i in range(NUM_CLIENTS)]
        up_s = await wait_for({"RUNNING": 2}, time.monotonic())
        stop.set()
        sent = sum(await asyncio.gather(*clients))
        down_s = await wait_for({"RUNNING": 1}, time.monotonic())
        return up_s, sent, down_s

    up_s, sent, down_s = asyncio.run(scenario())
    print(f"1 -> 2 replicas after {up_s:.1f}s of burst ({sent} requests), back to 1 {down_s:.1f}s after it")
