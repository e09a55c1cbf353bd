"""`kvrelay bench scenario`: the summaries' arithmetic on hand-made records (exact ratios), the
steady run's identity with the burst run's chat stream, option errors, and a seconds-long smoke
run of each scenario on the tiny model (integration: each starts Ray and its servers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from load_tests.scenario.bench import (
    ScenarioParams,
    default_mode,
    format_summary,
    params_from_args,
    parse_split_totals,
    prefix_cache_tokens,
    split_means,
    steady_of,
    summarize_pd,
    summarize_peers,
    summarize_prefix_routing,
    workload,
)
from load_tests.serve.bench import RateRun, build_specs
from load_tests.serve.client import RequestRecord
from load_tests.serve.load import schedule
from serving.cli.parser import build_parser
from tests.helpers import REPO as REPO_ROOT


def record(i: int, kind: str, ttft_s: float, tpot_s: float, num_tokens: int = 11) -> RequestRecord:
    """A finished request: first token at ttft_s, then num_tokens - 1 tokens tpot_s apart."""
    e2e = ttft_s + tpot_s * (num_tokens - 1)
    return RequestRecord(i, kind, 0.0, 0.0, is_success=True, ttft_s=ttft_s, e2e_s=e2e,
                         itl_s=[tpot_s] * (num_tokens - 1), num_output_tokens=num_tokens, num_prompt_tokens=10,
                         token_count_source="usage")


def run_of(records: list[RequestRecord], duration_s: float = 10.0) -> RateRun:
    return RateRun(1.0, records, duration_s, {})


def test_pd_summary_ratios_are_exact():
    # steady: chat TPOTs 10..19 ms -> p99 = 18.91 ms; burst disagg: chat 10..19 ms + one 21 ms chat
    steady = [record(i, "random", 0.1, (10 + i) / 1e3) for i in range(10)]
    disagg_burst = [record(i, "chat", 0.1, (10 + i) / 1e3) for i in range(10)] + [
        record(10, "chat", 0.1, 0.021), record(11, "long", 3.0, 0.030)]
    coloc_burst = [record(i, "chat", 0.1, (10 + i) / 1e3) for i in range(9)] + [
        record(9, "chat", 0.1, 0.400), record(10, "chat", 0.1, 0.500), record(11, "long", 3.0, 0.030)]
    runs = {"disaggregated/steady": run_of(steady), "disaggregated/burst": run_of(disagg_burst),
            "colocated/steady": run_of(steady), "colocated/burst": run_of(coloc_burst)}
    slo = {"ttft_ms": 2000.0, "tpot_ms": 100.0}
    s = summarize_pd(runs, slo)
    # disagg burst chat TPOTs 10..19, 21 (11 values): rank 9.9 -> 19 + 0.9 * 2 = 20.8 ms
    assert s["tpot_p99_burst_ratio_disagg"] == pytest.approx(20.8 / 18.91)
    # coloc burst chat TPOTs 10..18, 400, 500: rank 9.9 -> 400 + 0.9 * 100 = 490 ms
    assert s["tpot_p99_burst_ratio_coloc"] == pytest.approx(490 / 18.91)
    # goodput: disagg misses only the long one (TTFT 3 s): 11 / 10 s; coloc misses 3: 9 / 10 s
    assert s["modes"]["disaggregated"]["num_slo_met_burst"] == 11
    assert s["modes"]["colocated"]["num_slo_met_burst"] == 9
    assert s["goodput_ratio_disagg_vs_coloc"] == pytest.approx(11 / 9)
    assert s["modes"]["disaggregated"]["long_ttft_ms_burst"]["p50"] == pytest.approx(3000.0)
    assert s["targets"]["tpot_p99_burst_ratio_disagg"] == {"target": "<= 1.3", "met": True}
    assert s["targets"]["tpot_p99_burst_ratio_coloc"] == {"target": ">= 2", "met": True}
    assert s["targets"]["goodput_ratio_disagg_vs_coloc"] == {"target": ">= 1.5", "met": False}
    # the SLO grid: at TTFT <= 5 s every disagg request passes; coloc's 400 and 500 ms TPOTs never do
    grid = {(g["slo"]["ttft_ms"], g["slo"]["tpot_ms"]): g for g in s["goodput_by_slo"]}
    assert grid[(5000.0, 50.0)]["disaggregated"] == pytest.approx(1.2)  # all 12 (the long one: TTFT 3 s, TPOT 30 ms)
    assert grid[(5000.0, 50.0)]["colocated"] == pytest.approx(1.0)
    assert grid[(1000.0, 100.0)]["ratio"] == pytest.approx(11 / 9)


def test_steady_run_sends_the_burst_runs_chat_stream_at_the_same_times():
    w = workload(ScenarioParams("pd-interference"))
    burst = schedule(build_specs(w, w.request_rates[0]), w.request_rates[0], w.burstiness, seed=w.seed)
    steady = schedule(build_specs(steady_of(w), w.request_rates[0]), w.request_rates[0], w.burstiness, seed=w.seed)
    chat = [(at, spec.messages, spec.max_tokens) for at, spec in burst if spec.kind == "chat"]
    assert len(chat) == w.num_prompts == len(steady)
    assert chat == [(at, spec.messages, spec.max_tokens) for at, spec in steady]
    longs = [at for at, spec in burst if spec.kind == "long"]
    assert longs == [15.0, 30.0, 45.0, 60.0, 75.0]  # one every 15 s while the 90 s stream lasts


def test_prefix_cache_counters_are_summed_over_the_pools_replicas():
    text = "\n".join([
        "# HELP kvrelay_prefix_cache_hit_tokens_total Prompt tokens found in the prefix cache.",
        'kvrelay_prefix_cache_hit_tokens_total{model="m",pool="prefill",replica="a"} 512.0',
        'kvrelay_prefix_cache_hit_tokens_total{model="m",pool="prefill",replica="b"} 256.0',
        'kvrelay_prefix_cache_hit_tokens_total{model="m",pool="decode",replica="c"} 9999.0',
        'kvrelay_prefix_cache_queried_tokens_total{model="m",pool="prefill",replica="a"} 1024.0',
        'kvrelay_prefix_cache_queried_tokens_total{model="m",pool="prefill",replica="b"} 1024.0',
    ])
    assert prefix_cache_tokens(text, "prefill") == (768.0, 2048.0)
    assert prefix_cache_tokens(text, "worker") == (0.0, 0.0)


def test_the_ingress_ttft_split_is_read_per_component_and_its_mean_taken_over_the_run():
    def page(queue_sum, queue_n, prefill_sum, prefill_n):
        return "\n".join([
            "# HELP kvrelay_ttft_split_seconds Each request's TTFT split into components that sum to it.",
            f'kvrelay_ttft_split_seconds_sum{{component="queue",model="m",pool="prefill"}} {queue_sum}',
            f'kvrelay_ttft_split_seconds_count{{component="queue",model="m",pool="prefill"}} {queue_n}',
            'kvrelay_ttft_split_seconds_bucket{component="queue",model="m",pool="prefill",le="0.1"} 1.0',
            f'kvrelay_ttft_split_seconds_sum{{component="prefill",model="m",pool="prefill"}} {prefill_sum}',
            f'kvrelay_ttft_split_seconds_count{{component="prefill",model="m",pool="prefill"}} {prefill_n}',
            'kvrelay_ttft_split_seconds_sum{component="queue",model="m",pool="decode"} 0.5',
            'kvrelay_ttft_split_seconds_count{component="queue",model="m",pool="decode"} 2.0',
            'kvrelay_decode_start_seconds_sum{component="kv_transfer",model="m"} 0.25',
            'kvrelay_decode_start_seconds_count{component="kv_transfer",model="m"} 4.0',
            'kvrelay_routing_decisions_total{pool="prefill",decision="prefix_hit"} 3.0',
        ])

    before = parse_split_totals(page(0.5, 2.0, 1.0, 2.0))
    # every pool summed: queue 0.5 + 0.5 s over 2 + 2 requests
    assert before[("ttft_split", "queue")] == [1.0, 4.0]
    assert before[("decode_start", "kv_transfer")] == [0.25, 4.0]
    assert sorted(before) == [("decode_start", "kv_transfer"), ("ttft_split", "prefill"), ("ttft_split", "queue")]
    after = parse_split_totals(page(1.25, 5.0, 2.5, 5.0))
    # the run: queue (1.25 - 0.5) s over 3 requests, prefill 1.5 s over 3; the decode start did not move
    assert split_means(before, after) == {"ttft_split": {"requests": 3, "prefill": 500.0, "queue": 250.0}}
    assert split_means({}, before)["decode_start"] == {"requests": 4, "kv_transfer": 62.5}


def test_prefix_routing_summary():
    ours = run_of([record(i, "group0", 0.1, 0.01) for i in range(4)])
    pow2 = run_of([record(i, "group0", 0.4, 0.01) for i in range(4)])
    info = {"prefix_cost": {"prefix_cache_hit_tokens": 750, "prefix_cache_queried_tokens": 1000},
            "pow2": {"prefix_cache_hit_tokens": 250, "prefix_cache_queried_tokens": 1000}}
    s = summarize_prefix_routing({"prefix_cost": ours, "pow2": pow2}, info)
    assert s["ttft_p50_ratio_pow2_vs_prefix_cost"] == pytest.approx(4.0)
    assert s["prefix_hit_rate_prefix_cost"] == 0.75
    assert s["prefix_hit_rate_pow2"] == 0.25


def test_peers_summary_ratios_and_skipped_peers():
    # 4 requests x 11 tokens in 10 s = 4.4 tok/s; the peer: 4 x 11 in 20 s = 2.2 tok/s
    ours = run_of([record(i, "random", 0.1 * (i + 1), 0.01) for i in range(4)], 10.0)
    vllm = run_of([record(i, "random", 0.2 * (i + 1), 0.01) for i in range(4)], 20.0)
    skipped = {"skipped": "no peers venv at .venv-peers (make peers)", "peer_config": "default"}
    info = {"ray-serve-llm[default]": skipped,
            "transformers": {"failed": "the server exited before it was ready"}}
    s = summarize_peers({"kvrelay-disaggregated": ours, "vllm[default]": vllm}, info, ours_mode="disaggregated")
    assert s["vllm_best_config"] == "default" and s["ray_serve_llm_best_config"] is None
    assert s["output_tok_s_ratio_vs_vllm"] == pytest.approx(2.0)
    # TTFT p95 of 100..400 ms: rank 2.85 -> 385 ms; of 200..800 ms: 770 ms
    assert s["ttft_p95_ratio_vs_vllm"] == pytest.approx(385 / 770)
    assert s["output_tok_s_ratio_vs_ray_serve_llm"] is None
    assert s["output_tok_s_ratio_coloc_vs_vllm"] is None  # colocated did not run
    assert s["systems"]["ray-serve-llm[default]"] == {"skipped": "no peers venv at .venv-peers (make peers)"}
    assert s["systems"]["transformers"] == {"failed": "the server exited before it was ready"}
    assert s["targets"]["output_tok_s_ratio_vs_vllm"]["met"] is True
    assert s["targets"]["ttft_p95_ratio_vs_vllm"]["met"] is True
    assert s["targets"]["output_tok_s_ratio_vs_ray_serve_llm"]["met"] is None


def test_peers_are_compared_in_their_best_configuration_against_the_default_mode():
    def run(ttft_s: float, duration_s: float) -> RateRun:  # 4 requests x 11 tokens
        return run_of([record(i, "random", ttft_s, 0.01) for i in range(4)], duration_s)

    runs = {
        "kvrelay-disaggregated": run(0.2, 10.0),  # 4.4 tok/s, TTFT 200 ms
        "kvrelay-colocated": run(0.1, 20.0),  # 2.2 tok/s, TTFT 100 ms
        "vllm[default]": run(0.1, 22.0),  # 2.0 tok/s, the better TTFT: not the one compared with
        "vllm[all-cores]": run(0.8, 11.0),  # 4.0 tok/s: best
        "ray-serve-llm[all-cores]": run(0.4, 40.0),  # 1.1 tok/s, the only one that ran
        "ray-serve-llm-pd[default]": run(0.4, 40.0),
        "ray-serve-llm-pd[all-cores]": run(0.4, 44.0),
    }
    info = {"ray-serve-llm[default]": {"failed": "not ready after 600 s", "peer_config": "default"}}
    s = summarize_peers(runs, info, ours_mode="disaggregated")
    assert s["ours"]["system"] == "kvrelay-disaggregated"
    assert (s["vllm_best_config"], s["ray_serve_llm_best_config"], s["ray_serve_llm_pd_best_config"]) == (
        "all-cores", "all-cores", "default")
    assert s["compared_as"] == {"transformers": None, "kvrelay-vllm-colocated": None, "kvrelay-vllm-disaggregated": None,
                                "vllm": "vllm[all-cores]",
                                "ray-serve-llm": "ray-serve-llm[all-cores]",
                                "ray-serve-llm-pd": "ray-serve-llm-pd[default]"}
    assert s["output_tok_s_ratio_vs_vllm"] == pytest.approx(4.4 / 4.0)
    assert s["ttft_p95_ratio_vs_vllm"] == pytest.approx(0.2 / 0.8)  # all-cores' TTFT, not default's
    assert s["output_tok_s_ratio_vs_ray_serve_llm"] == pytest.approx(4.0)
    assert s["output_tok_s_ratio_vs_ray_serve_llm_pd"] == pytest.approx(4.0)
    assert s["output_tok_s_ratio_coloc_vs_vllm"] == pytest.approx(2.2 / 4.0)  # the other mode, beside it
    assert s["ttft_p95_ratio_coloc_vs_vllm"] == pytest.approx(0.1 / 0.8)
    assert s["output_tok_s_ratio_vs_transformers"] is None
    assert s["systems"]["ray-serve-llm[default]"] == {"failed": "not ready after 600 s"}
    assert list(s["systems"]) == ["kvrelay-colocated", "kvrelay-disaggregated", "vllm[default]", "vllm[all-cores]",
                                  "ray-serve-llm[default]", "ray-serve-llm[all-cores]", "ray-serve-llm-pd[default]",
                                  "ray-serve-llm-pd[all-cores]"]
    assert s["targets"]["output_tok_s_ratio_vs_vllm"] == {"target": ">= 1.5", "met": False}
    text = format_summary({"summary": {"scenario": "peers", "smoke": False, **s}})
    assert "  transformers as - (none ran), kvrelay-vllm-colocated as - (none ran), kvrelay-vllm-disaggregated as - " \
           "(none ran), vllm as vllm[all-cores], ray-serve-llm as ray-serve-llm[all-cores], " \
           "ray-serve-llm-pd as ray-serve-llm-pd[default]" in text.splitlines()
    assert "ray-serve-llm[default]          FAILED: not ready after 600 s" in text.splitlines()
    # the other mode as ours: the prefixes swap
    s = summarize_peers(runs, info, ours_mode="colocated")
    assert s["output_tok_s_ratio_vs_vllm"] == pytest.approx(2.2 / 4.0)
    assert s["output_tok_s_ratio_disagg_vs_vllm"] == pytest.approx(4.4 / 4.0)


def test_kvrelay_on_vllm_is_compared_with_vllms_own_server_each_in_its_best_configuration():
    def run(ttft_s: float, duration_s: float) -> RateRun:  # 4 requests x 11 tokens
        return run_of([record(i, "random", ttft_s, 0.01) for i in range(4)], duration_s)

    runs = {
        "kvrelay-vllm-colocated[default]": run(0.3, 22.0),  # 2.0 tok/s
        "kvrelay-vllm-colocated[all-cores]": run(0.5, 11.5),  # 44 / 11.5 tok/s: its best
        "kvrelay-vllm-disaggregated[all-cores]": run(0.2, 20.0),  # 2.2 tok/s, the only one that ran
        "vllm[default]": run(0.1, 22.0),
        "vllm[all-cores]": run(0.4, 11.0),  # 4.0 tok/s: best
    }
    info = {"kvrelay-vllm-disaggregated[default]": {"skipped": "no kvrelay venv with vLLM at .venv-vllm (make vllm-env)",
                                                    "peer_config": "default"}}
    s = summarize_peers(runs, info, ours_mode="colocated")
    assert (s["kvrelay_vllm_colocated_best_config"], s["kvrelay_vllm_disaggregated_best_config"]) == ("all-cores", "all-cores")
    assert s["output_tok_s_ratio_vllm_coloc_vs_vllm"] == pytest.approx((44 / 11.5) / 4.0)
    assert s["ttft_p95_ratio_vllm_coloc_vs_vllm"] == pytest.approx(0.5 / 0.4)
    assert s["output_tok_s_ratio_vllm_disagg_vs_vllm"] == pytest.approx(2.2 / 4.0)
    assert s["output_tok_s_ratio_vllm_coloc_vs_ray_serve_llm"] is None  # it did not run
    assert s["targets"]["output_tok_s_ratio_vllm_coloc_vs_vllm"] == {"target": ">= 0.95", "met": True}
    assert s["systems"]["kvrelay-vllm-disaggregated[default]"] == {
        "skipped": "no kvrelay venv with vLLM at .venv-vllm (make vllm-env)"}


def test_default_mode_is_what_make_serve_runs(monkeypatch):
    # deploy/local.yaml says auto: colocated below 4 cores
    monkeypatch.setattr("serving.config.layout.node_cores", lambda: 2)
    assert default_mode() == "colocated"
    monkeypatch.setattr("serving.config.layout.node_cores", lambda: 8)
    assert default_mode() == "disaggregated"


def test_unknown_system_and_bad_slo_are_named():
    parser = build_parser()
    args = parser.parse_args(["bench", "scenario", "peers", "--systems", "vllm,sglang"])
    with pytest.raises(SystemExit, match="unknown sglang; choose from kvrelay-colocated"):
        params_from_args(args)
    args = parser.parse_args(["bench", "scenario", "peers", "--peer-configs", "all-cores,turbo"])
    with pytest.raises(SystemExit, match="--peer-configs: unknown turbo; choose from default, all-cores"):
        params_from_args(args)
    assert params_from_args(parser.parse_args(["bench", "scenario", "peers"])).peer_configs == ("default", "all-cores", "all-cores-grpc")
    args = parser.parse_args(["bench", "scenario", "peers", "--peer-configs", "all-cores"])
    assert params_from_args(args).peer_configs == ("all-cores",)
    args = parser.parse_args(["bench", "scenario", "pd-interference", "--slo", "ttft=5"])
    with pytest.raises(SystemExit, match="--slo"):
        params_from_args(args)
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "scenario", "nope"])


# ---- smoke runs: seconds of load on the tiny model, the servers started and stopped -------------
def _scenario(name: str, tiny_model_dir: Path, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "serving.cli", "bench", "scenario", name, "--smoke", "--model", str(tiny_model_dir),
         "--json", str(out), "--log-dir", str(tmp_path / "logs"), *extra],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=900, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["summary"]["scenario"] == name and report["summary"]["smoke"] is True
    assert out.with_suffix(".png").stat().st_size > 10_000
    for label, run in report["raw"]["runs"].items():
        assert run["records"] and all(r["is_success"] for r in run["records"]), label
    return report


@pytest.mark.integration
def test_pd_interference_smoke(tiny_model_dir, tmp_path):
    report = _scenario("pd-interference", tiny_model_dir, tmp_path)
    s = report["summary"]
    assert sorted(report["raw"]["runs"]) == ["colocated/burst", "colocated/steady", "disaggregated/burst",
                                            "disaggregated/steady"]
    for key in ("tpot_p99_burst_ratio_disagg", "tpot_p99_burst_ratio_coloc", "goodput_ratio_disagg_vs_coloc"):
        assert s[key] > 0, key
    burst = report["raw"]["runs"]["disaggregated/burst"]["records"]
    assert [r["kind"] for r in burst].count("long") == 2  # bursts at 0.5 s and 1.0 s of the 1.5 s stream
    servers = report["config"]["servers"]
    assert servers["disaggregated"]["serve_config"]["decode"]["cpu_affinity"] == [[1]]
    # min_remote_prefill_tokens 0: the prefill pool computed every prompt, warm-ups included
    # (steady: 2 warm-ups + 6 chat requests; burst: 3 warm-ups + 6 chat + 2 long)
    assert (servers["disaggregated"]["prefill_pool_requests_steady"], servers["disaggregated"]["prefill_pool_requests_burst"]) == (8, 11)
    assert servers["colocated"]["prefill_pool_requests_burst"] == 0  # no prefill pool
    # the ingress's TTFT split of each run's own requests (the warm-ups' are read before it starts)
    for mode, components in (("disaggregated", {"queue", "prefill", "handoff", "delivery"}),
                             ("colocated", {"queue", "prefill", "delivery"})):
        split = servers[mode]["ttft_split_ms_steady"]["ttft_split"]
        assert split["requests"] == 6 and components <= set(split), (mode, split)
        assert servers[mode]["ttft_split_ms_burst"]["ttft_split"]["requests"] == 8
    # the CPU other processes took during each run, for the simulator's replay
    assert sorted(servers["foreign_cpu"]["cores"]) == sorted(report["raw"]["runs"])
    assert all(cores >= 0 for cores in servers["foreign_cpu"]["cores"].values())


@pytest.mark.integration
def test_prefix_routing_smoke(tiny_model_dir, tmp_path):
    report = _scenario("prefix-routing", tiny_model_dir, tmp_path)
    s = report["summary"]
    assert sorted(s["policies"]) == ["pow2", "prefix_cost"]
    assert s["ttft_p50_ratio_pow2_vs_prefix_cost"] > 0
    # 6 requests over 2 groups: every group's prefix is computed once and then found (48 of ~70 tokens)
    assert 0 < s["prefix_hit_rate_prefix_cost"] < 1


@pytest.mark.integration
def test_peers_smoke_without_the_peers_venv(tiny_model_dir, tmp_path):
    report = _scenario("peers", tiny_model_dir, tmp_path, "--peers-venv", str(tmp_path / "no-venv"),
                       "--vllm-venv", str(tmp_path / "no-vllm-venv"))
    systems = report["summary"]["systems"]
    for ran in ("kvrelay-colocated", "kvrelay-disaggregated", "transformers"):
        assert systems[ran]["num_completed"] == 4 and systems[ran]["num_failed"] == 0, ran
    configs = {"vllm": ("default", "all-cores"), "ray-serve-llm": ("default", "all-cores", "all-cores-grpc"),
               "ray-serve-llm-pd": ("default", "all-cores", "all-cores-grpc")}  # the last: behind Serve's proxy only
    for skipped, names in configs.items():
        for config in names:
            assert systems[f"{skipped}[{config}]"] == {"skipped": f"no peers venv at {tmp_path / 'no-venv'} (make peers)"}
    assert "vllm[all-cores-grpc]" not in systems
    for skipped in ("kvrelay-vllm-colocated", "kvrelay-vllm-disaggregated"):
        for config in ("default", "all-cores"):
            assert systems[f"{skipped}[{config}]"] == {
                "skipped": f"no kvrelay venv with vLLM at {tmp_path / 'no-vllm-venv'} (make vllm-env)"}
        assert f"{skipped}[all-cores-grpc]" not in systems
    assert report["summary"]["ours"]["system"] == f"kvrelay-{default_mode()}"  # make serve's mode on this machine
    assert report["summary"]["output_tok_s_ratio_vs_transformers"] > 0
    other = "disagg" if default_mode() == "colocated" else "coloc"  # the mode that is not ours
    assert report["summary"][f"output_tok_s_ratio_{other}_vs_transformers"] > 0
    assert report["summary"]["output_tok_s_ratio_vs_vllm"] is None
    assert report["summary"]["vllm_best_config"] is None
    assert set(report["hardware"]["isa"]) >= {"avx2", "amx_bf16"} and report["hardware"]["nproc"] >= 1


def test_set_overrides_every_kvrelay_config_after_the_scenarios_own(tmp_path):
    from load_tests.scenario.bench import kvrelay_config
    from load_tests.scenario.servers import ScenarioError

    args = build_parser().parse_args(["bench", "scenario", "peers", "--set", "engine.long_prefill_token_threshold=512",
                                      "--set", "worker.engine.num_threads=2"])
    p = params_from_args(args)
    assert p.overrides == (("engine.long_prefill_token_threshold", 512), ("worker.engine.num_threads", 2))
    config = kvrelay_config(p, tmp_path, "colocated", 8000, app="a")
    assert config.engine.long_prefill_token_threshold == 512
    assert config.engine.dtype == p.dtype  # the scenario's own engine keys stay
    assert config.engine_config(config.worker).num_threads == 2 and config.worker.num_replicas == 2  # the rest of the pool stays
    bad = params_from_args(build_parser().parse_args(["bench", "scenario", "peers", "--set", "worker.num_thread=2"]))
    with pytest.raises(ScenarioError, match=r"(?s)--set worker.num_thread: .*worker.num_thread.*Extra inputs are not permitted"):
        kvrelay_config(bad, tmp_path, "colocated", 8000, app="a")
    with pytest.raises(SystemExit, match="--set wants KEY=VALUE"):
        params_from_args(build_parser().parse_args(["bench", "scenario", "peers", "--set", "nothing"]))
