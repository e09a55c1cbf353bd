"""Prefix-aware routing on a local Ray with two prefill replicas: requests follow their prefix,
and spill over to the other replica when the holder is overloaded."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from load_tests.local_ray import free_port
from serving.deployments.messages import WorkerRequest
from serving.engine.kv.block_hash import hash_blocks
from serving.engine.params import SamplingParams
from tests.helpers import tiny_app_config

pytestmark = pytest.mark.integration

BLOCK = 16



@pytest.fixture(scope="module")
def prefill_handle(tmp_path_factory, tiny_model_dir):
    import ray
    from ray import serve

    from serving.deployments import kv_transfer
    from serving.deployments.app import build_app

    ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING", _temp_dir=str(tmp_path_factory.mktemp("ray")))
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    config = tiny_app_config(tiny_model_dir, "routing", prefill={"num_cpus": 0.1, "num_replicas": 2},
                             routing={"stats_period_s": 0.2})
    serve.run(build_app(config), name="routing", route_prefix="/routing")
    yield serve.get_deployment_handle("PrefillWorker", app_name="routing")
    kv_transfer.kill_all("routing")
    serve.shutdown()
    ray.shutdown()


def make_request(request_id: str, token_ids: list[int]) -> WorkerRequest:
    # max_tokens=1: the prefill worker finishes the request itself (no KV export to clean up).
    return WorkerRequest(
        request_id, token_ids, SamplingParams(temperature=0, max_tokens=1, detokenize=False),
        block_hashes=hash_blocks(token_ids, BLOCK), block_size=BLOCK,
    )


def test_requests_follow_their_prefix_and_spill_over_under_load(prefill_handle):
    rng = random.Random(0)
    prefixes = [[rng.randrange(100, 40000) for _ in range(256)] for _ in range(4)]

    def suffix():
        return [rng.randrange(100, 40000) for _ in range(32)]

    async def send(request_id, tokens):
        result = await prefill_handle.prefill.remote(make_request(request_id, tokens))
        return result.replica

    async def scenario():
        holders = [await send(f"warm-{p}", prefix + suffix()) for p, prefix in enumerate(prefixes)]
        await asyncio.sleep(1.0)  # the holders' routing stats now carry the prefixes' blocks
        hits = 0
        total = 0
        for round_ in range(6):
            for p, prefix in enumerate(prefixes):
                replica = await send(f"seq-{round_}-{p}", prefix + suffix())
                hits += replica == holders[p]
                total += 1
        # Overload: 24 concurrent requests on one prefix; the holder's queue outgrows the
        # 256-token hit and the rest go to the other replica.
        burst = await asyncio.gather(*(send(f"burst-{i}", prefixes[0] + suffix()) for i in range(24)))
        return holders, hits / total, Counter(burst)

    holders, hit_fraction, burst = asyncio.run(scenario())
    assert len(set(holders)) == 2, holders  # the four prefixes were spread over both replicas
    assert hit_fraction >= 0.9, hit_fraction
    assert burst[holders[0]] >= 12 and len(burst) == 2, burst
