"""Several routers agree, on a local Ray: two ingress replicas, each with its own prefix-aware
router over the same two-worker pool, send every request of a prefix to the worker that holds it,
and a router started after the caches are warm (a new handle in this process) does so from its
first request. Both learn the workers' cached blocks from the routing stats Serve broadcasts to
every router (router/index.py), not from their own history."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from serving.deployments.messages import WorkerRequest
from serving.engine.kv.block_hash import hash_blocks
from serving.engine.params import SamplingParams
from tests.helpers import served_app, tiny_app_config

pytestmark = pytest.mark.integration

BLOCK = 16
PREFIX_TOKENS = 64  # 4 blocks: what a request of its prefix finds cached on the worker holding it


@pytest.fixture(scope="module")
def app_url(tmp_path_factory, tiny_model_dir):
    # The load bound off: with four prefixes on two workers it may move one on purpose, which
    # would make the exact count below depend on where the warm-up put them.
    config = tiny_app_config(
        tiny_model_dir, "agree", mode="colocated", worker={"num_cpus": 0.1, "num_replicas": 2},
        ingress={"num_replicas": 2, "num_cpus": 0.1},
        routing={"stats_period_s": 0.2, "prefill_params": {"max_load_ratio": None}},
    )
    with served_app(config, tmp_path_factory.mktemp("ray")) as url:
        yield url


def test_two_ingress_routers_and_a_late_one_follow_the_cached_prefixes(app_url):
    from ray import serve

    app = serve.status().applications["agree"]
    assert app.deployments["OpenAIIngress"].replica_states.get("RUNNING") == 2
    rng = random.Random(0)
    prefixes = [[rng.randrange(100, 40000) for _ in range(PREFIX_TOKENS)] for _ in range(4)]

    def suffix() -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(8)]

    def cached(client: httpx.Client, prompt: list[int]) -> int:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        answer = client.post(f"{app_url}/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    with httpx.Client(timeout=60) as client:
        assert [cached(client, prefix + suffix()) for prefix in prefixes] == [0, 0, 0, 0]  # warm-up: cold
        # Both ingress routers learn the workers' snapshots through Serve's controller (a stats
        # period of 0.2 s, slower on a loaded machine): wait until 8 requests in a row, spread over
        # both ingress replicas by the proxy, find their prefix. A router that never learns them
        # misses about half, and the wait runs out.
        deadline, in_a_row = time.monotonic() + 30, 0
        while in_a_row < 8:
            assert time.monotonic() < deadline, "the ingress routers did not learn the cached prefixes in 30 s"
            in_a_row = in_a_row + 1 if cached(client, prefixes[in_a_row % 4] + suffix()) == PREFIX_TOKENS else 0
        # The proxy spreads these over both ingress replicas; whichever routes a request, it
        # goes to the worker holding its prefix: every one finds the whole prefix cached.
        hits = [cached(client, prefix + suffix()) for _ in range(4) for prefix in prefixes]
    assert hits == [PREFIX_TOKENS] * 16

    # A router that starts now: this process's first handle to the pool.
    handle = serve.get_deployment_handle("Worker", app_name="agree")

    async def first_requests() -> list[int]:
        out = []
        for i, prefix in enumerate(prefixes):
            ids = prefix + suffix()
            request = WorkerRequest(f"late-{i}", ids, SamplingParams(temperature=0, max_tokens=1, detokenize=False),
                                    block_hashes=hash_blocks(ids, BLOCK), block_size=BLOCK)
            last = None
            async for output in handle.options(stream=True).generate.remote(request):
                last = output
            out.append(last.num_cached_tokens)
        return out

    assert asyncio.run(first_requests()) == [PREFIX_TOKENS] * 4
