"""The routing benchmark on a real pool: the workload sent to PrefillWorker replicas of a local
Ray Serve app (the prefill pool alone: serving/deployments/app.py, build_prefill_pool) through a
deployment handle, once per policy (a fresh app each time, so every policy
starts from cold caches).

    driver (this process): Serve handle to PrefillWorker ── its router: RouterState + the policy
        └─ at each request's Poisson arrival time: prefill.remote(WorkerRequest(ids, max_tokens=1,
           block_hashes=hash_blocks(ids, 16)))  → PrefillResult (first token; the worker finishes
           the request itself: no KV export)
    TTFT = call → result; cached tokens = result.output.num_cached_tokens (the engine's prefix
    lookup); load = uncached tokens per result.replica

Ray is started here (address="local", its own temp dir, no dashboard) and shut down at the end.
Each policy gets an app of its own name: a handle in this process keeps the request router it
built for a deployment, so an app redeployed under the same name with another policy would still
be routed by the first one (measured: every "policy" then behaved like the first).
Each policy first gets 2 x replicas warm-up requests (random 64-token prompts, one at a time,
not recorded) so the first measured requests do not pay for first-call allocations.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from load_tests.routing.metrics import PolicyRun, RoutedRequest
from load_tests.routing.workload import Workload

__all__ = ["run_policy", "serve_config"]

APP_NAME = "kvrelay-bench-routing"


def serve_config(model_dir: Path, dtype: str, policy: str, *, num_replicas: int, kv_cache_bytes: int,
                 stats_period_s: float, max_model_len: int, params: dict | None = None):
    """Prefill pool of `num_replicas` (1 torch thread, 0.5 CPU each) routed by `policy`."""
    from serving.config import ServeConfig

    small = {"num_replicas": 1, "num_cpus": 0.25}
    return ServeConfig.model_validate({
        "model": str(model_dir),
        "engine": {"dtype": dtype, "kv_cache_bytes": kv_cache_bytes, "max_model_len": max_model_len, "num_threads": 1},
        "app_name": f"{APP_NAME}-{policy.replace('_', '-')}",
        "prefill": {"num_replicas": num_replicas, "num_cpus": 0.5},
        "decode": small, "ingress": {"num_cpus": 0.1},
        "routing": {"prefill_policy": policy, "prefill_params": params or {}, "stats_period_s": stats_period_s},
    })


def _request(request_id: str, token_ids: list[int], block_size: int):
    from serving.deployments.messages import WorkerRequest
    from serving.engine.kv.block_hash import hash_blocks
    from serving.engine.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    return WorkerRequest(request_id, token_ids, params, block_hashes=hash_blocks(token_ids, block_size), block_size=block_size)


async def _send(handle, request) -> tuple[float, object]:
    from serving.deployments.messages import WorkerError

    start = time.perf_counter()
    result = await handle.prefill.remote(request)
    elapsed = time.perf_counter() - start
    if isinstance(result, WorkerError):
        raise RuntimeError(f"prefill of {request.request_id} failed: {result}")
    return elapsed, result


async def _run_workload(handle, workload: Workload, warmup: list[list[int]], settle_s: float) -> tuple[list, set]:
    bs = workload.spec.block_size
    seen = set()
    for i, ids in enumerate(warmup):
        _, result = await _send(handle, _request(f"warmup-{i}", ids, bs))
        seen.add(result.replica)
    await asyncio.sleep(settle_s)  # the warm-up's stats reach the router
    start = time.perf_counter()

    async def one(request):
        await asyncio.sleep(max(0.0, request.arrival_s - (time.perf_counter() - start)))
        ttft_s, result = await _send(handle, _request(request.request_id, request.token_ids, bs))
        return RoutedRequest(result.replica, request.num_prompt_tokens, result.output.num_cached_tokens, ttft_s)

    records = await asyncio.gather(*(one(request) for request in workload.requests))
    return list(records), seen | {r.replica for r in records}


def run_policy(policy: str, workload: Workload, config, warmup: list[list[int]], progress) -> tuple[PolicyRun, dict]:
    """Deploy the app routed by `policy`, send the workload, tear the app down."""
    from ray import serve

    from serving.deployments import kv_transfer
    from serving.deployments.app import build_prefill_pool

    app = config.app_name
    progress(f"real: {policy}: deploying {config.prefill.num_replicas} prefill replicas")
    started = time.monotonic()
    serve.run(build_prefill_pool(config), name=app, route_prefix=None)
    startup_s = time.monotonic() - started
    try:
        handle = serve.get_deployment_handle("PrefillWorker", app_name=app)
        progress(f"real: {policy}: {len(warmup)} warm-up + {len(workload.requests)} requests")
        records, seen = asyncio.run(_run_workload(handle, workload, warmup, 2 * config.routing.stats_period_s + 0.5))
    finally:
        serve.delete(app)
        kv_transfer.kill_all(app)
    replicas = sorted(seen) + [f"(idle {i})" for i in range(config.prefill.num_replicas - len(seen))]
    return PolicyRun(policy, replicas, records), {"startup_s": startup_s}
