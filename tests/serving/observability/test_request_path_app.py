"""What the routers predicted and where the first token's time went, on a live app (tiny model,
a local Ray, the app on a free port; serving/observability/request_path.py):

    /d   disaggregated: prefill + decode pools
    /c   colocated: one Worker pool
    /s   colocated, its workers reporting routing stats only every 60 s: the ingress's router
         predicts from a snapshot that a test then makes stale, on purpose

Prompts are token ids (/v1/completions), random per test, so how many of their tokens an engine
can find cached is known exactly: a 70-token prompt's 4 whole blocks, 64 tokens.
"""

from __future__ import annotations

import random

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from load_tests.local_ray import free_port
from tests.helpers import tiny_app_config, wait_until

pytestmark = pytest.mark.integration

PROMPT_TOKENS = 70
CACHEABLE = 64  # (70 - 1) // 16 whole blocks: an engine always computes the last prompt token
COMPONENTS = ("queue", "prefill", "handoff", "delivery")


@pytest.fixture(scope="module")
def app_url(tmp_path_factory, tiny_model_dir):
    import ray
    from ray import serve

    from serving.deployments.app import build_app

    ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING", _temp_dir=str(tmp_path_factory.mktemp("ray")))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    apps = {
        "d": tiny_app_config(tiny_model_dir, "pathd"),
        "c": tiny_app_config(tiny_model_dir, "pathc", mode="colocated"),
        "s": tiny_app_config(tiny_model_dir, "paths", mode="colocated", routing={"stats_period_s": 60}),
    }
    for prefix, config in apps.items():
        serve.run(build_app(config), name=config.app_name, route_prefix=f"/{prefix}")
    yield f"http://127.0.0.1:{port}"
    from serving.deployments import kv_transfer

    for config in apps.values():
        kv_transfer.kill_all(config.app_name)
    serve.shutdown()
    ray.shutdown()


def prompt(seed: int, length: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(length)]


def complete(base: str, ids: list[int], *, max_tokens: int = 4) -> dict:
    body = {"model": "tiny", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


Samples = dict[tuple[str, frozenset], float]


def scrape(base: str) -> Samples:
    response = httpx.get(f"{base}/metrics", timeout=30)
    assert response.status_code == 200
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(response.text) for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


# ---- a cached prefix: predicted = found = 64 tokens ------------------------------------------
@pytest.mark.parametrize("prefix, pool", [("d", "prefill"), ("c", "worker")])
def test_a_cached_prefix_is_predicted_and_found(app_url, prefix, pool):
    base = f"{app_url}/{prefix}"
    ids = prompt(seed={"d": 1, "c": 2}[prefix])
    before = scrape(base)
    first = complete(base, ids)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    middle = scrape(base)
    second = complete(base, ids)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == CACHEABLE
    after = scrape(base)

    labels = {"model": "tiny", "pool": pool}
    # the cold request: nothing predicted, nothing found
    assert moved(before, middle, "kvrelay_prefix_predictions_total", outcome="exact", reason="match", **labels) == 1
    assert moved(before, middle, "kvrelay_prefix_tokens_total", kind="predicted", **labels) == 0
    # the same prompt again: the router predicted its 64 cacheable tokens on the replica it chose,
    # and the engine found them there
    assert moved(middle, after, "kvrelay_prefix_tokens_total", kind="prompt", **labels) == PROMPT_TOKENS
    assert moved(middle, after, "kvrelay_prefix_tokens_total", kind="predicted", **labels) == CACHEABLE
    assert moved(middle, after, "kvrelay_prefix_tokens_total", kind="cached", **labels) == CACHEABLE
    assert moved(middle, after, "kvrelay_prefix_predictions_total", outcome="exact", reason="match", **labels) == 1
    assert moved(before, after, "kvrelay_prefix_predictions_total") == 2
    assert moved(before, after, "kvrelay_prefix_prediction_error_tokens_count") == 0


# ---- the TTFT split sums to the TTFT ---------------------------------------------------------
@pytest.mark.parametrize("prefix, pool, parts", [
    ("d", "prefill", ("queue", "prefill", "handoff", "delivery")),
    ("c", "worker", ("queue", "prefill", "delivery")),
])
def test_a_requests_ttft_split_sums_to_the_ttft_the_ingress_measured(app_url, prefix, pool, parts):
    base = f"{app_url}/{prefix}"
    complete(base, prompt(seed=7))  # warm: the routers and the handles exist
    before = scrape(base)
    complete(base, prompt(seed=8 + len(prefix)), max_tokens=6)
    after = scrape(base)

    assert moved(before, after, "kvrelay_ttft_seconds_count") == 1
    ttft = moved(before, after, "kvrelay_ttft_seconds_sum")
    split = {c: moved(before, after, "kvrelay_ttft_split_seconds_sum", model="tiny", pool=pool, component=c) for c in COMPONENTS}
    counts = {c: moved(before, after, "kvrelay_ttft_split_seconds_count", pool=pool, component=c) for c in COMPONENTS}
    assert counts == {c: 1 if c in parts else 0 for c in COMPONENTS}
    assert all(seconds >= 0 for seconds in split.values()), split
    assert split["prefill"] > 0 and split["queue"] > 0
    # one request between the scrapes: its components sum to its TTFT, to the clock's precision
    assert sum(split.values()) == pytest.approx(ttft, abs=1e-6), (split, ttft)
    decode = {c: moved(before, after, "kvrelay_decode_start_seconds_count", component=c) for c in ("kv_transfer", "first_decode_step", "delivery")}
    # after a KV import (disaggregated) the second token's path: placed → claim → first decode step
    assert decode == dict.fromkeys(decode, 1 if prefix == "d" else 0)
    print(f"\n{prefix}: TTFT {ttft * 1000:.2f} ms = " + " + ".join(f"{c} {s * 1000:.2f}" for c, s in split.items() if c in parts))


# ---- a miss and a surprise, made on purpose --------------------------------------------------
def _worker_handle():
    from ray import serve

    return serve.get_deployment_handle("Worker", app_name="paths")


def _compute_directly(ids: list[int], request_id: str) -> None:
    """The prompt computed on the Worker replica through a handle of this process: the ingress's
    router neither routes it nor (for 60 s) hears of it."""
    from serving.deployments.messages import WorkerRequest
    from serving.engine.params import SamplingParams

    stream = _worker_handle().options(stream=True).generate.remote(WorkerRequest(request_id, ids, SamplingParams(max_tokens=1)))
    assert [out for out in stream]


def _engine_blocks() -> int:
    return _worker_handle().stats.remote().result(timeout_s=30).engine.num_blocks


def _stats_reported(base: str) -> None:
    """Until the ingress has the Worker's stats (its metrics ride on them)."""
    wait_until(lambda: any(n == "kvrelay_kv_cache_usage_ratio" and ("pool", "worker") in ls for n, ls in scrape(base)))


def test_an_eviction_the_router_did_not_see_is_a_stale_miss_and_a_prompt_it_did_not_route_an_unseen_hit(app_url):
    """The ingress's router notes each prompt it routes on its replica, and hears from the replica
    only every 60 s. P goes through the ingress; then, behind the router's back, other prompts
    fill the engine's cache (evicting P) and Q is computed. Through the ingress again, P is
    predicted cached (64 tokens) and found evicted: a miss, `stale` (the engine did not hold it
    when the request arrived); Q is predicted cold and found cached: a surprise, `unseen`. Should
    the replica's stats arrive in the middle (its queried-tokens counter, which rides on them,
    moves), the scenario is run again with new prompts."""
    base = f"{app_url}/s"
    complete(base, prompt(seed=100))  # warm: the router exists and has the replica's first stats
    _stats_reported(base)
    num_blocks = _engine_blocks()
    for attempt in range(3):
        p, q = prompt(seed=200 + attempt), prompt(seed=300 + attempt)
        before = scrape(base)
        complete(base, p)
        filler_len = 16 * 16 + 1  # 16 whole blocks each
        for i in range(num_blocks // 16 + 2):  # more blocks than the engine has: P's are evicted
            _compute_directly(prompt(seed=10_000 * (attempt + 1) + i, length=filler_len), f"fill-{attempt}-{i}")
        _compute_directly(q, f"q-{attempt}")
        miss, surprise = complete(base, p), complete(base, q)
        after = scrape(base)
        queried = "kvrelay_prefix_cache_queried_tokens_total"
        if value(after, queried, pool="worker") == value(before, queried, pool="worker"):
            break  # no stats between the scrapes: the router saw none of the direct work
    else:
        pytest.fail("the Worker's routing stats arrived during every attempt")
    assert miss["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert surprise["usage"]["prompt_tokens_details"]["cached_tokens"] == CACHEABLE
    labels = {"model": "tiny", "pool": "worker"}
    assert moved(before, after, "kvrelay_prefix_predictions_total", outcome="exact", reason="match", **labels) == 1  # P, cold
    assert moved(before, after, "kvrelay_prefix_predictions_total", outcome="miss", reason="stale", **labels) == 1
    assert moved(before, after, "kvrelay_prefix_predictions_total", outcome="surprise", reason="unseen", **labels) == 1
    assert moved(before, after, "kvrelay_prefix_predictions_total") == 3
    assert moved(before, after, "kvrelay_prefix_tokens_total", kind="predicted", **labels) == CACHEABLE  # P again
    assert moved(before, after, "kvrelay_prefix_tokens_total", kind="cached", **labels) == CACHEABLE  # Q
    for outcome in ("miss", "surprise"):
        assert moved(before, after, "kvrelay_prefix_prediction_error_tokens_sum", outcome=outcome, **labels) == CACHEABLE
        assert moved(before, after, "kvrelay_prefix_prediction_error_tokens_bucket", outcome=outcome, le="64.0", **labels) == 1
        assert moved(before, after, "kvrelay_prefix_prediction_error_tokens_bucket", outcome=outcome, le="32.0", **labels) == 0


def test_kvrelay_status_reads_them_from_the_ingress(app_url):
    """`kvrelay status`'s lines over the live /metrics of the disaggregated app (printed with -s:
    README's example is one such run)."""
    from serving.cli.status import _prefix_lines, _split_lines, fetch_metrics, parse_metrics

    base = f"{app_url}/d"
    for seed in range(400, 410):
        complete(base, prompt(seed=400 if seed % 2 else seed), max_tokens=6)  # every other one a repeat
    samples = parse_metrics(fetch_metrics(base))
    lines = _prefix_lines(samples)
    lines += _split_lines(samples, "TTFT split", "kvrelay_ttft_split_seconds", COMPONENTS)
    lines += _split_lines(samples, "decode start", "kvrelay_decode_start_seconds", ("kv_transfer", "first_decode_step", "delivery"))
    print("\n" + "\n".join(lines))
    assert lines[1] == "prefix hits  requests predicted  cached  mispredicted"
    assert lines[2].split()[0] == "prefill"
    assert [line.split()[0] for line in lines[4:9]] == ["TTFT", *COMPONENTS]
    assert [line.split()[0] for line in lines[10:14]] == ["decode", "kv_transfer", "first_decode_step", "delivery"]
