"""`kvrelay bench routing`: the simulator's arithmetic on hand-checkable cases (hits, queue waits,
LRU eviction order, the oracle), the report's figures, a seconds-long --simulate smoke run
through the CLI, and a short real run on a tiny model (integration)."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest

from load_tests.routing.bench import REAL_QUICK, SIM_FULL, SIM_QUICK, params_from_args, policy_figures, summarize
from load_tests.routing.bounds import pooled_lru_hit_tokens, pooled_optimal_hit_tokens, single_home
from load_tests.routing.calibration import CalibrationPoint, fit
from load_tests.routing.metrics import PolicyRun, RoutedRequest, percentile
from load_tests.routing.sim import BlockCache, CostModel, SimConfig, SimReplica, oracle_hit_tokens, simulate
from load_tests.routing.sweep import ONE_ROUTER, SWEEP_FULL, SWEEP_QUICK, SweepGrid, cells, summarize_sweep
from load_tests.routing.workload import Workload, WorkloadRequest, WorkloadSpec, make_workload
from router.char_prefix_tree import token_text
from serving.cli.dispatch import main
from serving.cli.parser import build_parser
from serving.engine.kv.block_hash import hash_blocks
from tests.helpers import REPO as REPO_ROOT

BS = 4  # tokens per block in the hand-built cases


def tiny_workload(arrivals: list[tuple[float, int]], *, prefix_len: int = 8, suffix_len: int = 4) -> Workload:
    """Requests (arrival_s, group) over groups whose prefixes are [1000g, 1000g + 1, ...]."""
    num_groups = max(group for _, group in arrivals) + 1
    spec = WorkloadSpec(num_groups, prefix_len, suffix_len, len(arrivals), 1.0, block_size=BS)
    prefixes = [[1000 * g + i for i in range(prefix_len)] for g in range(num_groups)]
    workload = Workload(spec, prefixes, [token_text(p) for p in prefixes], [])
    for i, (arrival_s, group) in enumerate(arrivals):
        suffix = [100 + 10 * i + j for j in range(suffix_len)]
        hashes = hash_blocks(prefixes[group] + suffix, BS)
        workload.requests.append(WorkloadRequest(f"r{i}", group, arrival_s, suffix, hashes, workload))
    return workload


def test_block_cache_hits_cap_and_lru_eviction_order():
    cache = BlockCache(num_blocks=6, block_size=BS)
    a, b, c = (hash_blocks([base + i for i in range(12)], BS) for base in (0, 100, 200))  # 3 blocks each
    assert cache.acquire(a, 12) == 0
    cache.release(a, 12)
    assert list(cache.lru) == [a[2], a[1], a[0]]  # freed tail first: the head is the most recent
    cache.acquire(b, 12)
    cache.release(b, 12)
    assert cache.acquire(c[:2], 8) == 0  # 2 blocks needed: the two oldest go, A's tail first
    assert cache.evicted == [a[2], a[1]]
    cache.release(c[:2], 8)
    assert list(cache.lru) == [a[0], b[2], b[1], b[0], c[1], c[0]]
    assert cache.num_matched_blocks(a, 12) == 1  # a[1] is gone: a[2] could not be used anyway
    assert cache.acquire(a, 12) == 1  # holds a[0], needs 3 blocks: evicts b[2], b[1]
    assert cache.evicted == [a[2], a[1], b[2], b[1]]
    assert cache.hashes() == [b[0], c[1], c[0], a[0]]  # in eviction order: the running prompt's hit last
    cache.release(a, 12)
    assert list(cache.lru) == [b[0], c[1], c[0], a[2], a[1], a[0]]
    # One token is always computed: an 8-token prompt with both blocks cached hits 1 block.
    assert cache.num_matched_blocks(c[:2], 8) == 1
    assert cache.num_matched_blocks(c[:2], 9) == 2


def test_block_cache_frees_a_prompt_not_kept_to_the_eviction_end():
    cache = BlockCache(num_blocks=8, block_size=BS)
    a, b = (hash_blocks([base + i for i in range(12)], BS) for base in (0, 100))  # 3 blocks each
    cache.acquire(a, 12)
    cache.release(a, 12)
    b_on_a = a[:2] + hash_blocks([0, 1, 2, 3, 4, 5, 6, 7, 90, 91, 92, 93], BS)[2:]  # a's first two blocks, its own third
    assert cache.acquire(b_on_a, 12) == 2
    cache.release(b_on_a, 12, retain=False)
    # Its hits go back to the recent end as ever; the block it computed goes first out.
    assert list(cache.lru) == [b_on_a[2], a[2], a[1], a[0]]
    cache.acquire(b, 12)
    cache.release(b, 12, retain=False)
    assert list(cache.lru) == [b[2], b[1], b[0], b_on_a[2], a[2], a[1], a[0]]  # the tail first out
    assert cache.acquire(hash_blocks(list(range(500, 512)), BS), 12) == 0  # needs 3, 1 empty: b[2], b[1] go
    assert cache.evicted == [b[2], b[1]]


def test_simulated_queue_waits_and_hits_with_a_fixed_rate():
    # 128 tokens/s, no overhead: a cold 12-token prompt takes 0.09375 s, 4 uncached tokens 0.03125 s.
    cost = CostModel(overhead_s=0.0, tokens_per_s=128.0)
    workload = tiny_workload([(0.0, 0), (0.0625, 0), (0.0625, 1), (1.0, 0)])
    run = simulate(workload, "round_robin", SimConfig(num_replicas=1, num_blocks=16, block_size=BS), cost)
    by_id = {f"r{i}": record for i, record in enumerate(sorted(run.records, key=lambda r: r.ttft_s))}
    ttfts = sorted((r.ttft_s, r.num_cached_tokens) for r in run.records)
    # r0 cold: 0.09375. r1 waits 0.03125 then hits the 8-token prefix: 0.03125 + 0.03125.
    # r2 (group 1) waits for r0 and r1 (until 0.125), cold: 0.125 + 0.09375 - 0.0625 = 0.15625.
    # r3 alone, hit: 0.03125.
    assert ttfts == [(0.03125, 8), (0.0625, 8), (0.09375, 0), (0.15625, 0)]
    assert run.hit_rate == 16 / 48
    assert run.computed_tokens_by_replica == {"replica-00": 4 + 4 + 12 + 12} and run.max_over_mean_load == 1.0
    assert len(by_id) == 4


def test_simulated_replica_reports_counters_and_the_prompts_it_took_like_a_worker():
    # 128 tokens/s: a cold 12-token prompt takes 0.09375 s. r0 runs, r1 waits behind it.
    workload = tiny_workload([(0.0, 0), (0.0, 1)])
    r0, r1 = workload.requests
    replica = SimReplica("a", SimConfig(num_replicas=1, num_blocks=16, block_size=BS), CostModel(0.0, 128.0))
    assert replica.submit(r0, 0.0) is not None and replica.submit(r1, 0.0) is None
    half = replica.routing_stats(0.09375 / 2)
    assert (half.num_computed_tokens, half.num_requests, half.num_queued_prefill_tokens) == (6, 2, 6 + 12)
    # Nothing cached yet; both prompts listed as taken, each tail first, in the order taken.
    assert half.kv_hashes == [*reversed(r0.block_hashes), *reversed(r1.block_hashes)]
    replica.finish(0.09375)  # r0 done: its 3 blocks cached; r1 starts
    done = replica.routing_stats(0.09375)
    assert (done.num_computed_tokens, done.num_requests) == (12, 2)
    assert done.kv_hashes == [*reversed(r0.block_hashes), *reversed(r1.block_hashes)]
    # How often its requests used each listed block, as a worker reports it (router/eviction.py):
    # one request each, r0's decayed by one request of a 256-request window.
    decay = math.exp(-1 / 256)
    assert done.block_reuse == pytest.approx({**{h: decay for h in r0.block_hashes}, **{h: 1.0 for h in r1.block_hashes}})
    assert done.block_reuse_weight == pytest.approx(1 + decay)


def test_routers_see_stats_and_their_own_routing():
    # Two replicas; group 0 ten times in a row, 0.25 s apart, then group 1: ours keeps group 0
    # where its prefix is.
    cost = CostModel(overhead_s=0.0, tokens_per_s=128.0)
    workload = tiny_workload([(0.25 * i, 0) for i in range(10)] + [(2.5, 1)])
    config = SimConfig(num_replicas=2, num_blocks=16, block_size=BS, stats_period_s=0.125)
    unbounded = simulate(workload, "prefix_cost", config, cost, {"max_load_ratio": None})
    assert [r.num_cached_tokens for r in unbounded.records] == [0] + [8] * 9 + [0]
    assert len({r.replica for r in unbounded.records[:10]}) == 1
    # With the load bound (in force once the pool has taken a request per replica), the holder
    # takes 3 (12 + 2 x 4 tokens) before the 4th would put it past 1.25 x the pool's mean: that
    # one computes the prefix on the other replica (a miss); from then on both hold it and share
    # group 0's hits, and group 1 goes to the lighter.
    ours = simulate(workload, "prefix_cost", config, cost)
    assert [r.num_cached_tokens for r in ours.records] == [0, 8, 8, 0, 8, 8, 8, 8, 8, 8, 0]
    replicas = [r.replica for r in ours.records]
    assert len(set(replicas[:3])) == 1 and replicas[3] != replicas[0] and len(set(replicas[3:])) == 2
    assert ours.decisions == {"tie_break": 2, "prefix_hit": 8, "load_bound": 1}
    rr = simulate(workload, "round_robin", config, cost)
    assert [r.num_cached_tokens for r in rr.records] == [0, 0] + [8] * 8 + [0]  # alternates: r1 misses


def test_oracle_pins_the_most_requested_groups_that_fit():
    # 8-token prefixes (2 blocks); a 12-token prompt needs 1 block of its own beside them.
    workload = tiny_workload([(0.0, 0), (0.1, 0), (0.2, 0), (0.3, 1), (0.4, 1), (0.5, 2)])
    # 3 blocks: room 2, one prefix: group 0 (3 requests) wins: 2 later requests x 8 tokens.
    assert oracle_hit_tokens(workload, num_replicas=1, num_blocks=3) == (16, 72, {0: 2})
    # Room for both on one replica, or one each on two; group 2 (one request) is never pinned.
    assert oracle_hit_tokens(workload, num_replicas=1, num_blocks=5) == (24, 72, {0: 2, 1: 2})
    assert oracle_hit_tokens(workload, num_replicas=2, num_blocks=3) == (24, 72, {0: 2, 1: 2})
    # Room 3: group 0's 2 blocks, then group 1's first block (4 tokens for its 1 later request).
    assert oracle_hit_tokens(workload, num_replicas=1, num_blocks=4) == (16 + 4, 72, {0: 2, 1: 1})
    assert oracle_hit_tokens(workload, num_replicas=1, num_blocks=1) == (0, 72, {})


def test_the_oracle_without_foresight_pins_by_popularity_not_by_the_draw():
    # Group 1 happened to come three times, group 0 (the more popular by its weight) once.
    workload = tiny_workload([(0.0, 0), (0.1, 1), (0.2, 1), (0.3, 1)])
    assert oracle_hit_tokens(workload, num_replicas=1, num_blocks=3) == (16, 48, {1: 2})
    assert oracle_hit_tokens(workload, num_replicas=1, num_blocks=3, foresight=False) == (0, 48, {0: 2})
    assert oracle_hit_tokens(workload, num_replicas=1, num_blocks=5, foresight=False) == (16, 48, {0: 2, 1: 2})


def test_workload_is_seeded_and_shares_prefix_hashes():
    spec = WorkloadSpec(num_groups=3, prefix_len=40, suffix_len=8, num_requests=50, request_rate_per_s=10.0, zipf_s=1.0)
    one, two = make_workload(spec), make_workload(spec)
    assert [(r.group, r.arrival_s, r.block_hashes) for r in one.requests] == [
        (r.group, r.arrival_s, r.block_hashes) for r in two.requests
    ]
    r = one.requests[0]
    assert r.block_hashes == hash_blocks(r.token_ids, 16) and r.text == token_text(r.token_ids)
    assert r.num_prompt_tokens == 48 and len(r.block_hashes) == 3
    same_group = [q for q in one.requests if q.group == r.group]
    assert all(q.block_hashes[:2] == r.block_hashes[:2] and q.block_hashes[2] != r.block_hashes[2] for q in same_group[1:])
    counts = one.group_counts()
    assert counts[0] > counts[2] and sum(counts) == 50  # zipf: group 0 the most popular


def test_percentile_and_calibration_fit():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5 and percentile([1.0, 2.0, 3.0, 5.0], 100) == 5.0
    assert percentile([1.0, 2.0, 3.0, 5.0], 95) == pytest.approx(4.7) and percentile([], 50) is None
    truth = CostModel(overhead_s=0.01, tokens_per_s=500.0, attention_pair_s=1e-6)
    shapes = [(64, 0), (256, 0), (512, 0), (1088, 0), (1088, 1024)]
    points = [CalibrationPoint(n, c, [truth.service_s(n - c, c)]) for n, c in shapes]
    assert fit(points) == pytest.approx((0.01, 500.0, 1e-6))
    linear = [CalibrationPoint(n, 0, [n / 1000]) for n in (100, 200, 400)]  # no intercept, no pairs
    assert fit(linear) == pytest.approx((0.0, 1000.0, 0.0), rel=1e-9, abs=1e-12)


def run_of(policy: str, ttfts: list[float], loads: dict[str, tuple[int, int]]) -> PolicyRun:
    """loads: replica -> (prompt tokens, cached tokens), one request each, TTFTs in order."""
    records = [RoutedRequest(r, n, c, t) for (r, (n, c)), t in zip(loads.items(), ttfts)]
    return PolicyRun(policy, list(loads), records)


def test_figures_and_summary():
    runs = {
        "prefix_cost": run_of("prefix_cost", [0.25, 0.5], {"a": (100, 75), "b": (100, 50)}),
        "pow2": run_of("pow2", [1.0, 2.0], {"a": (100, 0), "b": (100, 0)}),
    }
    figures = policy_figures(runs, oracle_hit_rate=0.8)
    ours = figures["prefix_cost"]
    assert ours["hit_rate"] == 0.625 and ours["hit_rate_fraction_of_oracle"] == 0.78125
    assert ours["ttft_ms_p50"] == 375.0 and ours["ttft_p50_speedup_vs_pow2"] == 4.0
    assert ours["computed_tokens_by_replica"] == {"a": 25, "b": 50} and ours["max_over_mean_load"] == 50 / 37.5
    assert figures["pow2"]["ttft_p50_speedup_vs_pow2"] == 1.0
    summary = summarize(figures, 0.8, "simulation, 2 replicas")
    assert summary["targets"] == {
        "hit_rate_fraction_of_oracle": {"target": ">= 0.95", "met": False},
        "ttft_p50_speedup_vs_pow2": {"target": ">= 3x", "met": True},
        "max_over_mean_load": {"target": "<= 1.3", "met": False},
    }


def test_presets_and_overrides():
    parse = build_parser().parse_args
    assert params_from_args(parse(["bench", "routing", "--simulate"])) == SIM_FULL
    assert params_from_args(parse(["bench", "routing", "--simulate", "--quick"])) == SIM_QUICK
    assert params_from_args(parse(["bench", "routing", "--quick"])) == REAL_QUICK
    p = params_from_args(parse(["bench", "routing", "--simulate", "--sweep", "4,8", "--zipf", "1.2", "--num-replicas", "4"]))
    assert (p.sweep, p.zipf, p.num_replicas, p.num_requests) == ((4, 8), 1.2, 4, 4000)
    assert params_from_args(parse(["bench", "routing", "--simulate", "--sweep", "none"])).sweep == ()
    p = params_from_args(parse(["bench", "routing", "--param", "max_load_ratio=null", "--param", "tie_tolerance=0.1"]))
    assert p.policy_params("prefix_cost") == {"max_load_ratio": None, "tie_tolerance": 0.1}
    assert p.policy_params("pow2") == {}
    with pytest.raises(SystemExit, match="--param: routing policy 'prefix_cost'.*'bogus'"):
        params_from_args(parse(["bench", "routing", "--param", "bogus=1"]))
    with pytest.raises(SystemExit, match="cannot hold one 1088-token prompt"):
        params_from_args(parse(["bench", "routing", "--simulate", "--kv-cache-tokens", "512"]))


def test_simulate_quick_smoke_through_the_cli(tmp_path, capsys):
    out = tmp_path / "routing.json"
    argv = ["bench", "routing", "--simulate", "--quick", "--rate-tokens-per-s", "800", "--overhead-ms", "5",
            "--num-requests", "400", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert set(report) == {"summary", "config", "raw", "hardware"}
    assert set(report["hardware"]["isa"]) == {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "amx_int8"}  # hardware.machine_record
    assert report["hardware"]["num_threads"] == 1 and report["hardware"]["load_avg_1m_at_end"] >= 0
    summary = report["summary"]
    assert 0.5 < summary["hit_rate_fraction_of_oracle"] <= 1.0
    assert summary["ttft_p50_speedup_vs_pow2"] > 1.0 and summary["max_over_mean_load"] >= 1.0
    assert set(summary["targets"]) == {"hit_rate_fraction_of_oracle", "ttft_p50_speedup_vs_pow2", "max_over_mean_load"}
    figures = report["raw"]["simulation"]["16"]["figures"]
    assert set(figures) == {"prefix_cost", "round_robin", "pow2", "char_prefix_tree"}
    for f in figures.values():
        assert f["num_requests"] == 400 and 0.0 <= f["hit_rate"] <= 1.0 and len(f["computed_tokens_by_replica"]) == 16
        assert {"hit_rate_fraction_of_oracle", "ttft_p50_speedup_vs_pow2", "max_over_mean_load"} <= set(f)
    assert report["config"]["calibration"]["source"] == "--rate-tokens-per-s"
    assert report["config"]["cost_model"] == {"overhead_s": 0.005, "tokens_per_s": 800.0, "attention_pair_s": 0.0}
    table = capsys.readouterr().out
    assert "ours (prefix_cost)" in table and "char_prefix_tree" in table and "max / mean load (ours)" in table


@pytest.mark.integration
@pytest.mark.slow
def test_real_run_on_a_tiny_model(tiny_model_dir, tmp_path):
    """Two prefill replicas on a local Ray, every policy, a handful of requests."""
    out = tmp_path / "routing.json"
    command = [
        sys.executable, "-m", "serving.cli", "bench", "routing", "--quick", "--model", str(tiny_model_dir),
        "--num-requests", "8", "--prefix-len", "64", "--suffix-len", "16", "--kv-cache-tokens", "512",
        "--json", str(out),
    ]
    proc = subprocess.run(command, check=False, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["summary"]["source"] == "real, 2 replicas"
    real = report["raw"]["real"]["2"]["figures"]
    assert set(real) == {"prefix_cost", "round_robin", "pow2", "char_prefix_tree"}
    for f in real.values():
        assert f["num_requests"] == 8 and sum(f["requests_by_replica"].values()) == 8
        assert len(f["requests_by_replica"]) == 2 and 0.0 <= f["hit_rate"] <= 1.0
    assert report["config"]["calibration"]["source"] == "measured"
    assert set(report["raw"]["simulation"]["2"]["figures"]) == set(real)
    assert "ours (prefix_cost)" in proc.stdout


def test_pressure_sweep_cells_skip_the_ones_that_cannot_be_short_of_room():
    grid = SweepGrid(num_groups=(16, 64), zipf=(0.0,), num_replicas=(16,), cache_ratios=(4.0, 0.5),
                     requests_per_group=10, min_requests=300)
    out = cells(grid, prefix_len=1024, suffix_len=64, block_size=16)
    assert [(c.name, c.kv_cache_tokens, c.num_requests, c.skipped is None) for c in out] == [
        ("g16-z0-r16-c4", 4352, 300, True),  # 4 x 16 x 1024 / 16 = 4096 < 4 prompts (4352): ample gets 4 prompts
        ("g16-z0-r16-c0.5", 512, 300, False),  # 512 tokens: not even one prompt
        ("g64-z0-r16-c4", 16384, 640, True),
        ("g64-z0-r16-c0.5", 2048, 640, True),  # 2048 >= 1.5 x 1088
    ]
    assert out[1].skipped == "0.5 x the working set is 512 tokens per replica, under 1.5 prompts (1632)"


def sweep_record(name: str, oracle: float, skipped: str | None = None, **hit_p95_load) -> dict:
    figures = {policy: {"hit_rate": h, "ttft_ms_p95": p, "max_over_mean_load": m} for policy, (h, p, m) in hit_p95_load.items()}
    return {"cell": name, "skipped": skipped, "oracle_hit_rate": oracle, "figures": figures}


def test_pressure_sweep_summary_takes_the_worst_cell_of_each_figure():
    records = [
        sweep_record("a", 0.8, prefix_cost=(0.76, 400.0, 1.1), char_prefix_tree=(0.8, 500.0, 1.5)),
        sweep_record("b", 0.5, prefix_cost=(0.4, 900.0, 1.2), char_prefix_tree=(0.38, 600.0, 1.1)),
        sweep_record("c", 0.9, skipped="too small"),
    ]
    records[0].update(pooled_lru_hit_rate=0.8, pooled_optimal_hit_rate=0.95)
    records[1].update(pooled_lru_hit_rate=0.4, pooled_optimal_hit_rate=0.8)
    summary = summarize_sweep(records)
    assert summary["min_fraction_of_oracle"] == pytest.approx(0.8) and summary["min_fraction_of_oracle_cell"] == "b"
    assert (summary["min_hit_ratio_vs_pooled_lru"], summary["min_hit_ratio_vs_pooled_lru_cell"]) == (pytest.approx(0.95), "a")
    assert (summary["min_fraction_of_pooled_optimal"], summary["min_fraction_of_pooled_optimal_cell"]) == (pytest.approx(0.5), "b")
    assert summary["min_hit_ratio_vs_char_tree"] == pytest.approx(0.95) and summary["min_hit_ratio_vs_char_tree_cell"] == "a"
    assert summary["max_ttft_p95_ratio_vs_char_tree"] == pytest.approx(1.5) and summary["max_ttft_p95_ratio_vs_char_tree_cell"] == "b"
    assert (summary["max_over_mean_load"], summary["max_over_mean_load_cell"]) == (1.2, "b")
    assert summary["min_hit_ratio_vs_one_router"] is None  # one router: nothing to compare
    assert (summary["num_cells"], summary["num_cells_skipped"]) == (2, 1)
    assert {key: t["met"] for key, t in summary["targets"].items()} == {
        "min_fraction_of_oracle": False, "min_hit_ratio_vs_char_tree": False,
        "max_ttft_p95_ratio_vs_char_tree": False, "max_over_mean_load": True, "min_hit_ratio_vs_one_router": None,
    }


def test_several_routers_compare_by_the_mean_hit_rate_over_their_seeds():
    record = sweep_record("a", 0.8, prefix_cost=(0.7, 400.0, 1.1))
    record["figures"][ONE_ROUTER] = {"hit_rate": 0.8}
    assert summarize_sweep([record])["min_hit_ratio_vs_one_router"] == pytest.approx(0.7 / 0.8)  # one seed each
    record.update(router_seeds=3, one_router_hit_rates=[0.8, 0.75, 0.85], several_routers_hit_rates=[0.7, 0.8, 0.78])
    assert summarize_sweep([record])["min_hit_ratio_vs_one_router"] == pytest.approx(2.28 / 2.4)
    p = params_from_args(build_parser().parse_args(
        ["bench", "routing", "--simulate", "--pressure-sweep", "--num-routers", "2", "--router-seeds", "3"]))
    assert (p.num_routers, p.router_seeds) == (2, 3)
    with pytest.raises(SystemExit, match="--router-seeds must be >= 1"):
        params_from_args(build_parser().parse_args(["bench", "routing", "--simulate", "--router-seeds", "0"]))


def test_pressure_sweep_presets_and_grid_options():
    parse = build_parser().parse_args
    p = params_from_args(parse(["bench", "routing", "--simulate", "--pressure-sweep"]))
    assert p.pressure_sweep and p.grid == SWEEP_FULL and p.sweep == ()
    p = params_from_args(parse(["bench", "routing", "--simulate", "--pressure-sweep", "--quick", "--grid-zipf", "0,0.6",
                                "--grid-cache", "2,0.5", "--grid-min-requests", "100"]))
    assert p.grid == dataclasses.replace(SWEEP_QUICK, zipf=(0.0, 0.6), cache_ratios=(2.0, 0.5), min_requests=100)
    with pytest.raises(SystemExit, match="--pressure-sweep runs simulated replicas only: add --simulate"):
        params_from_args(parse(["bench", "routing", "--pressure-sweep"]))
    with pytest.raises(SystemExit, match="--grid-\\* options shape the --pressure-sweep grid"):
        params_from_args(parse(["bench", "routing", "--simulate", "--grid-groups", "16"]))
    with pytest.raises(SystemExit, match="--grid-replicas wants counts >= 1, got '0,8'"):
        params_from_args(parse(["bench", "routing", "--simulate", "--pressure-sweep", "--grid-replicas", "0,8"]))


def test_pressure_sweep_tiny_grid_through_the_cli(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    argv = ["bench", "routing", "--simulate", "--pressure-sweep", "--rate-tokens-per-s", "800", "--overhead-ms", "5",
            "--grid-groups", "8,64", "--grid-zipf", "0", "--grid-replicas", "4", "--grid-cache", "4,0.5",
            "--grid-min-requests", "120", "--grid-requests-per-group", "1", "--num-routers", "2", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    cells_run = [r for r in report["raw"]["cells"] if r["skipped"] is None]
    assert [r["cell"] for r in report["raw"]["cells"]] == ["g8-z0-r4-c4", "g8-z0-r4-c0.5", "g64-z0-r4-c4", "g64-z0-r4-c0.5"]
    assert [r["cell"] for r in cells_run] == ["g8-z0-r4-c4", "g64-z0-r4-c4", "g64-z0-r4-c0.5"]
    for record in cells_run:
        assert set(record["figures"]) == {
            "prefix_cost", "round_robin", "pow2", "char_prefix_tree", "oracle_replay", "prefix_cost_one_router",
        }
        assert all(f["num_requests"] == record["num_requests"] for f in record["figures"].values())
    summary = report["summary"]
    assert summary["num_cells"] == 3 and summary["source"] == "simulation, pressure sweep, 2 router(s)"
    for key in ("min_fraction_of_oracle", "min_hit_ratio_vs_char_tree", "max_ttft_p95_ratio_vs_char_tree",
                "max_over_mean_load", "min_hit_ratio_vs_one_router", "min_hit_ratio_vs_oracle_replay"):
        assert summary[key] > 0 and summary[f"{key}_cell"] in {r["cell"] for r in cells_run}
    assert "worst cell: hit rate / tree's" in capsys.readouterr().out


def test_pooled_references_lru_and_offline_optimal():
    # Prefixes A and B (2 blocks each) alternate, A B A B A, into one cache of 4 blocks; every
    # prompt also has a 1-block suffix nobody reuses. LRU keeps each prompt's blocks (the suffix
    # too), so each of the last three requests finds only the head of its prefix: 3 x 1 block.
    # MIN drops the suffixes and B once nobody wants it: the last three find both blocks.
    workload = tiny_workload([(0.0, 0), (1.0, 1), (2.0, 0), (3.0, 1), (4.0, 0)])
    assert pooled_lru_hit_tokens(workload, num_blocks=4) == 3 * BS
    assert pooled_optimal_hit_tokens(workload, num_blocks=4) == 3 * 2 * BS
    # Room for everything: both hit all they can (2 blocks of 3: one token is always computed).
    assert pooled_lru_hit_tokens(workload, num_blocks=100) == pooled_optimal_hit_tokens(workload, num_blocks=100) == 3 * 2 * BS


def test_single_home_is_the_most_hits_and_its_least_load():
    # Group 0 three times, group 1 once; prompts of 12 tokens, 8 of them the prefix (2 blocks of 4).
    # The most any router hits: group 0's second and third requests find its 8 prefix tokens, 16 of
    # 48 tokens. Reaching it puts group 0 on one replica, which computes 12 + 4 + 4 = 20 tokens
    # against a mean of 32 / 2 replicas = 16 (1.25x), or 32 / 4 = 8 (2.5x).
    workload = tiny_workload([(0.0, 0), (1.0, 0), (2.0, 1), (3.0, 0)])
    assert single_home(workload, 2) == (pytest.approx(16 / 48), pytest.approx(1.25))
    assert single_home(workload, 4) == (pytest.approx(16 / 48), pytest.approx(2.5))
    # Nothing to hit: 2 prompts of 12 tokens on 8 replicas put 12 where the mean is 3; 4 on 2
    # replicas, 12 against 24: a replica holds at least the mean, so the floor is 1.
    assert single_home(tiny_workload([(0.0, 0), (1.0, 1)]), 8) == (0.0, 4.0)
    assert single_home(tiny_workload([(0.0, 0), (1.0, 1), (2.0, 2), (3.0, 3)]), 2) == (0.0, 1.0)
    # the same hits as one cache that never evicts
    assert pooled_lru_hit_tokens(workload, num_blocks=100) == 16


def test_in_one_sweep_cell_the_trees_hit_rate_and_the_load_target_conflict():
    # g16-z1.2-r16-c4 of the quick sweep: 364 of the 1,000 requests are of group 0. Computing each
    # prefix once, its replica computes 364 x 64 + 1024 = 24,320 tokens against a mean of
    # (1,000 x 64 + 16 x 1,024) / 16 = 5,024: 4.84x, when the target is 1.3x.
    workload = make_workload(WorkloadSpec(num_groups=16, num_requests=1000, request_rate_per_s=1.0, zipf_s=1.2, seed=0))
    assert max(workload.group_counts()) == 364
    hit_rate, floor = single_home(workload, 16)
    assert hit_rate == pytest.approx(984 * 1024 / (1000 * 1088))
    assert floor == pytest.approx(24320 / 5024)
    # The tree reached that hit rate there (docs/benchmarks/routing-pressure-sweep-quick-2026-11-28.json):
    # the summary names the cell; a cell whose tree copied a prefix, or whose floor is within the
    # target, is not named.
    def record(name, tree_hit, floor):
        r = sweep_record(name, 0.93, prefix_cost=(0.91, 200.0, 1.2), char_prefix_tree=(tree_hit, 300.0, floor))
        return {**r, "single_home_hit_rate": hit_rate, "single_home_load_floor": floor}
    records = [record("g16-z1.2-r16-c4", hit_rate, floor), record("copied", hit_rate - 0.01, floor), record("even", hit_rate, 1.22)]
    assert summarize_sweep(records)["conflicting_cells"] == ["g16-z1.2-r16-c4"]
    assert summarize_sweep([sweep_record("old", 0.9, prefix_cost=(0.9, 1.0, 1.0), char_prefix_tree=(0.9, 1.0, 1.0))])["conflicting_cells"] == []
