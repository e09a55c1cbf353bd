"""The workload replay: traces, the pool model's queueing on hand-built requests, the three
policies on a tiny deterministic trace, the planner's Serve hooks, and `kvrelay policy simulate
--workload`."""

from __future__ import annotations

import json
from collections import namedtuple

import pytest

from router.autoscaling import replay as replay_module
from router.autoscaling.decide import ReplicaSignals, serve_autoscaling_config
from router.autoscaling.plan_serve import (
    app_autoscaling_policy,
    decode_plan_policy,
    plan_policy,
    pool_load,
    prefill_plan_policy,
)
from router.autoscaling.planner import PoolLoad, decode_replicas, prefill_replicas
from router.autoscaling.policy import load_policy, parse_policy
from router.autoscaling.pool_model import Capacity, DecodeReplica, Pool, PrefillReplica
from router.autoscaling.replay import KNOWN_LOAD, RAY_DEFAULTS, compare, model_floor, replay
from router.autoscaling.workload import (
    Segment,
    TraceError,
    WorkloadTrace,
    builtin_trace,
    generate_requests,
    read_workload,
)
from serving.cli.dispatch import main
from tests.helpers import REPO

PLANNER_YAML = REPO / "deploy/autoscaling/planner.yaml"
Point = namedtuple("Point", "timestamp value")
CAPACITY = Capacity(prefill_tokens_per_s=100.0, tpot_base_ms=20.0, tpot_ms_per_seq=20.0, cold_start_s=10.0)


# ---- traces ------------------------------------------------------------------------------------
def test_builtin_traces_shapes():
    assert builtin_trace("steady").segments == (Segment(0.0, 2.0, 256, 64),)
    ramp = builtin_trace("ramp")
    assert (ramp.segments[0].requests_per_s, ramp.segments[-1].requests_per_s, len(ramp.segments)) == (0.25, 4.0, 41)
    burst = builtin_trace("burst")
    assert [(s.start_s, s.requests_per_s, s.prompt_tokens) for s in burst.segments[:3]] == [
        (0.0, 1.0, 256), (300.0, 5.0, 384), (420.0, 1.0, 256)]
    diurnal = builtin_trace("diurnal")
    noon = diurnal.segments[30]
    assert (noon.start_s, noon.requests_per_s, noon.prompt_tokens, noon.output_tokens) == (1800.0, 3.6, 384, 32)
    with pytest.raises(TraceError, match="unknown workload 'spiky'"):
        builtin_trace("spiky")


def test_requests_are_seeded_and_within_the_length_bounds():
    trace = WorkloadTrace("t", (Segment(0.0, 2.0, 100, 10), Segment(50.0, 0.0, 100, 10)), 100.0)
    requests = generate_requests(trace, seed=3)
    assert requests == generate_requests(trace, seed=3) != generate_requests(trace, seed=4)
    assert all(r.arrival_s < 50 for r in requests)  # the second segment has no arrivals
    assert all(50 <= r.prompt_tokens <= 150 and 5 <= r.output_tokens <= 15 for r in requests)


def test_read_workload_and_its_errors(tmp_path):
    path = tmp_path / "w.csv"
    path.write_text("time_s,requests_per_s,prompt_tokens,output_tokens\n0,1,100,10\n60,2,200,20\n120,,,\n")
    assert read_workload(path) == WorkloadTrace(
        "w.csv", (Segment(0.0, 1.0, 100.0, 10.0), Segment(60.0, 2.0, 200.0, 20.0)), 120.0)
    assert read_workload(REPO / "deploy/autoscaling/example-workload.csv").end_s == 1200.0
    for text, message in [
        ("time_s,rate\n0,1\n", "the header must be time_s,requests_per_s,prompt_tokens,output_tokens (got time_s,rate)"),
        ("time_s,requests_per_s,prompt_tokens,output_tokens\n0,1,100,10\n", "needs at least two rows"),
        ("time_s,requests_per_s,prompt_tokens,output_tokens\n0,x,100,10\n9,,,\n", "w.csv:2: requests_per_s = 'x' is not a number"),
        ("time_s,requests_per_s,prompt_tokens,output_tokens\n5,1,100,10\n5,,,\n", "w.csv:3: time_s = 5 is not after 5"),
        ("time_s,requests_per_s,prompt_tokens,output_tokens\n0,-1,100,10\n9,,,\n", "requests_per_s = '-1' (allowed: a finite number >= 0)"),
    ]:
        path.write_text(text)
        with pytest.raises(TraceError) as info:
            read_workload(path)
        assert message in str(info.value)


# ---- the pool model ----------------------------------------------------------------------------
def test_prefill_replica_is_fcfs_at_its_rate():
    replica = PrefillReplica(0.0, 0.0, CAPACITY)
    assert replica.take(0.0, 100) == 1.0
    assert replica.take(0.5, 100) == 2.0  # waits for the first
    assert replica.ongoing(1.5) == 1
    signals = replica.signals(1.5, window_s=10.0)
    # 0.5 s of the second prompt left; only the first TTFT (1 s) is over by 1.5 s.
    assert (signals.num_queued_prefill_tokens, signals.ttft_p95_ms, signals.requests_per_s) == (50.0, 1000.0, 0.2)
    assert replica.take(3.0, 50) == 3.5  # idle since 2 s


def test_decode_replica_shares_its_steps():
    done = []
    replica = DecodeReplica(0.0, 0.0, CAPACITY)
    replica.join(1, 0.0, 10, lambda rid, joined, at: done.append((rid, at)))
    replica.join(2, 0.0, 20, lambda rid, joined, at: done.append((rid, at)))
    replica.advance(5.0, lambda rid, joined, at: done.append((rid, at)))
    # Two sequences: 60 ms a step, the first ends after 10 steps (0.6 s); the second then runs
    # alone at 40 ms for its last 10 (1.0 s).
    assert done == [(1, pytest.approx(0.6)), (2, pytest.approx(1.0))]
    assert replica.generated == pytest.approx(30.0)
    assert [round(ms, 6) for _, ms in replica.latencies] == [60.0, 50.0]  # TPOT of each


def test_pool_scaling_starts_cold_and_drains_what_it_removes():
    pool = Pool("prefill", CAPACITY, 1)
    pool.scale_to(3, 5.0)
    assert (pool.target, len(pool.accepting(5.0)), len(pool.accepting(15.0))) == (3, 1, 3)
    first = pool.replicas[0]
    first.take(15.0, 200)  # busy until 17 s
    pool.scale_to(1, 16.0)  # removes the two idle new ones at once, keeps the busy one
    assert [r.ended_at for r in pool.replicas] == [None, 16.0, 16.0]
    assert pool.replica_seconds(20.0) == 20.0 + 11.0 + 11.0


# ---- the three policies ------------------------------------------------------------------------
def tiny_trace() -> WorkloadTrace:
    return WorkloadTrace("tiny", (Segment(0.0, 0.5, 100, 10), Segment(60.0, 3.0, 100, 10)), 180.0)


def tiny_policy():
    config = load_policy(PLANNER_YAML)
    data = config.model_dump(mode="json")
    data["prefill"]["max_replicas"] = data["decode"]["max_replicas"] = 4
    data["planner"]["profiles"] = {"prefill": {"tokens_per_s": 100, "time_cv": 0.29},
                                   "decode": {"tpot_base_ms": 20, "tpot_ms_per_seq": 20}, "learn": False}
    return parse_policy(data)


def test_replay_of_a_tiny_trace_is_exact():
    config = tiny_policy()
    results = {p: replay(config, tiny_trace(), p, capacity=CAPACITY).to_dict() for p in ("reactive", "planner", "ray-default")}
    assert {p: (r["num_requests"], r["num_met"], r["replica_seconds"], r["max_replicas"]) for p, r in results.items()} == {
        "reactive": (414, 174, 745.0, {"prefill": 4, "decode": 2}),
        "planner": (414, 234, 868.0, {"prefill": 4, "decode": 3}),
        "ray-default": (414, 71, 615.0, {"prefill": 4, "decode": 1}),
    }


def test_the_model_floor_runs_each_segment_on_the_fewest_replicas_the_model_allows():
    # 0.5 req/s for 60 s, then 3 req/s for 120 s; 100-token prompts at 100 tokens/s (1 s each)
    # and 9 decoded tokens at TPOT 20 + 20 n ms. Prefill: 2 replicas, then 5 capped at the
    # file's max_replicas 4; decode: 1, then 2. No cold start, no forecast, no hysteresis.
    config = tiny_policy()
    assert [prefill_replicas(config.planner, r, 100) for r in (0.5, 3.0)] == [2, 5]
    assert [decode_replicas(config.planner, r, 9) for r in (0.5, 3.0)] == [1, 2]
    assert model_floor(config, tiny_trace(), CAPACITY) == {"prefill": 60 * 2 + 120 * 4, "decode": 60 * 1 + 120 * 2}


def test_the_known_load_yardstick_plans_on_the_traces_own_rate_and_lengths(monkeypatch):
    # The planner as shipped, each look fed the segment's rate and mean lengths (decode: the
    # tokens after the first, which prefill makes), with no arrival counters to count from.
    seen = set()
    real_plan = replay_module.plan

    def spy(policy, bounds, loads, currents, states, now):
        prefill, decode = loads["prefill"], loads["decode"]
        if prefill is not None and decode is not None:
            seen.add((now >= 60, prefill.requests_per_s, decode.requests_per_s, prefill.tokens_per_request,
                      decode.tokens_per_request, prefill.request_totals, decode.request_totals))
        return real_plan(policy, bounds, loads, currents, states, now)

    monkeypatch.setattr(replay_module, "plan", spy)
    result = replay(tiny_policy(), tiny_trace(), KNOWN_LOAD, capacity=CAPACITY).to_dict()
    assert seen == {(False, 0.5, 0.5, 100, 9, (), ()), (True, 3.0, 3.0, 100, 9, (), ())}
    # Knowing the load, it runs the model floor's counts (prefill 2 then 4, decode 1 then 2: 600 and
    # 300 replica-seconds) from its first plan at 1 s: prefill's first second is on min_replicas 1.
    # The planner that counts arrivals meets 234 at 868, with decode one replica over.
    assert (result["num_requests"], result["num_met"], result["replica_seconds_by_pool"], result["max_replicas"]) == (
        414, 267, {"prefill": 599.0, "decode": 300.0}, {"prefill": 4, "decode": 2})


def test_compare_reports_the_target_per_trace():
    report = compare(tiny_policy(), [tiny_trace()], capacity=CAPACITY)
    assert report["model_floor"] == {"tiny": {"replica_seconds": 900.0,
                                              "replica_seconds_by_pool": {"prefill": 600.0, "decode": 300.0}}}
    assert [r["policy"] for r in report["results"]] == ["reactive", "planner", "ray-default"]
    assert report["known_load"]["tiny"] == replay(tiny_policy(), tiny_trace(), KNOWN_LOAD, capacity=CAPACITY).to_dict()
    assert report["summary"]["by_trace"]["tiny"] == {
        "attainment_at_least_others": True, "replica_seconds_at_most_others": False, "met": False}
    assert report["slo"] == {"ttft_ms": 2000.0, "tpot_ms": 100.0}


def test_ray_defaults_are_ray_serves():
    from ray.serve.config import AutoscalingConfig

    defaults = AutoscalingConfig()
    assert RAY_DEFAULTS == {
        "target_ongoing_requests": defaults.get_target_ongoing_requests(), "upscale_delay_s": defaults.upscale_delay_s,
        "downscale_delay_s": defaults.downscale_delay_s, "look_back_period_s": defaults.look_back_period_s,
    }


# ---- the Serve hooks ---------------------------------------------------------------------------
def test_pool_load_from_replica_signals():
    prefill = (ReplicaSignals(updated_at_s=1.0, requests_per_s=1.0, prompt_tokens_per_request=100.0, num_queued_prefill_tokens=50.0,
                              prefill_tokens_per_s=300.0),
               ReplicaSignals(updated_at_s=1.0, requests_per_s=3.0, prompt_tokens_per_request=200.0, num_queued_prefill_tokens=0.0,
                              prefill_tokens_per_s=0.0))
    assert pool_load("prefill", prefill) == PoolLoad(4.0, 175.0, backlog=50.0, measured_tokens_per_s=300.0)
    decode = (ReplicaSignals(updated_at_s=1.0, requests_per_s=2.0, output_tokens_per_request=30.0, num_seqs=3.0,
                             output_tokens_per_s=20.0),)
    assert pool_load("decode", decode) == PoolLoad(2.0, 30.0, backlog=3.0, measured_decode=((3.0, 20.0),))
    # Speculating replicas: sequence-steps/s are tokens/s over tokens per step (0: not reported,
    # 1); the pool's tokens per step is its tokens over its steps, (30 + 20) / (10 + 20).
    speculating = (ReplicaSignals(updated_at_s=1.0, requests_per_s=1.0, output_tokens_per_request=50.0, num_seqs=3.0,
                                  output_tokens_per_s=30.0, decode_tokens_per_step=3.0),
                   ReplicaSignals(updated_at_s=1.0, requests_per_s=1.0, output_tokens_per_request=50.0, num_seqs=2.0,
                                  output_tokens_per_s=20.0, decode_tokens_per_step=0.0))
    assert pool_load("decode", speculating) == PoolLoad(2.0, 50.0, backlog=5.0, measured_decode=((3.0, 10.0), (2.0, 20.0)),
                                                        tokens_per_step=50.0 / 30.0)
    # The engines' decode step accounts, summed over the replicas that counted steps (an idle
    # one, or vLLM's engine, reports none).
    stepping = (ReplicaSignals(updated_at_s=1.0, requests_per_s=1.0, output_tokens_per_request=50.0, num_seqs=3.0,
                               output_tokens_per_s=30.0, decode_steps_per_s=10.0, decode_rows_per_s=30.0, decode_busy_s_per_s=0.75),
                ReplicaSignals(updated_at_s=1.0, requests_per_s=1.0, output_tokens_per_request=50.0, num_seqs=0.0),
                ReplicaSignals(updated_at_s=1.0, requests_per_s=1.0, output_tokens_per_request=50.0, num_seqs=1.0,
                               output_tokens_per_s=20.0, decode_steps_per_s=20.0, decode_rows_per_s=20.0, decode_busy_s_per_s=0.5))
    assert pool_load("decode", stepping).decode_steps == (30.0, 50.0, 1.25)
    assert pool_load("decode", speculating).decode_steps is None
    unfinished = (ReplicaSignals(updated_at_s=1.0, requests_per_s=2.0, output_tokens_per_request=0.0, num_seqs=3.0),)
    assert pool_load("decode", unfinished) is None
    idle = (ReplicaSignals(updated_at_s=1.0, requests_per_s=0.0, output_tokens_per_request=40.0, num_seqs=0.0),
            ReplicaSignals(updated_at_s=1.0, requests_per_s=0.0, output_tokens_per_request=0.0, num_seqs=0.0))
    assert pool_load("decode", idle).tokens_per_request == 40.0  # lengths of earlier requests
    assert pool_load("decode", (ReplicaSignals(),)) is None


def serve_context(config: dict, name: str, raw: dict, *, target: int = 1, now: float = 100.0, state=None):
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    return AutoscalingContext(
        deployment_id=None, deployment_name=name, app_name="kvrelay", current_num_replicas=target,
        target_num_replicas=target, running_replicas=[f"r{i}" for i in range(target)], total_num_requests=0.0,
        total_queued_requests=0.0, aggregated_metrics=None, raw_metrics=lambda: raw,
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=16, policy_state=state or {},
        last_scale_up_time=None, last_scale_down_time=None, current_time=now, config=AutoscalingConfig(**config),
    )


def reported(now: float, **signals) -> dict:
    return {name: {"r0": [Point(now - 1, value)]} for name, value in signals.items()}


def test_planner_serve_configs():
    config = load_policy(PLANNER_YAML)
    prefill = serve_autoscaling_config("prefill", config)
    assert prefill["policy"]["policy_function"] == "router.autoscaling.plan_serve:prefill_plan_policy"
    assert prefill["policy"]["policy_kwargs"]["pool_name"] == "prefill"
    assert prefill["policy"]["policy_kwargs"]["planner"]["targets"]["attainment"] == 0.97
    assert app_autoscaling_policy(config) == {"policy_function": "router.autoscaling.plan_serve:plan_policy"}
    assert app_autoscaling_policy(load_policy(REPO / "deploy/autoscaling/cluster.yaml")) is None


def test_application_policy_plans_both_pools_from_both_contexts():
    config = load_policy(PLANNER_YAML)
    prefill_raw = reported(100.0, requests_per_s=3.0, prompt_tokens_per_request=256.0, num_queued_prefill_tokens=0.0,
                           prefill_tokens_per_s=296.4)
    decode_raw = reported(100.0, requests_per_s=0.5, output_tokens_per_request=63.0, num_seqs=2.0, output_tokens_per_s=20.0)
    contexts = {
        "P": serve_context(serve_autoscaling_config("prefill", config), "PrefillWorker", prefill_raw),
        "D": serve_context(serve_autoscaling_config("decode", config), "DecodeWorker", decode_raw),
    }
    decisions, states = plan_policy(contexts)
    # Prefill: 3 req/s x 256 tokens at 296.4 tokens/s; decode plans for the 3 req/s prefill sends
    # it, not the 0.5 it has seen so far.
    assert decisions == {"P": 4, "D": 6}
    assert states["P"]["kvrelay.plan.planned_at"] == 100.0 and states["D"]["kvrelay.plan.rate_level"] == 0.5
    # Alone (serve.run), the decode hook sees only its own 0.5 req/s (and its 2 running sequences
    # at 20 tokens/s, which the learnt correction reads as a slower TPOT than the profile's).
    assert prefill_plan_policy(contexts["P"])[0] == 4
    assert decode_plan_policy(contexts["D"])[0] == 2


def test_application_policy_holds_on_missing_data():
    config = load_policy(PLANNER_YAML)
    contexts = {
        "P": serve_context(serve_autoscaling_config("prefill", config), "PrefillWorker", {}, target=2),
        "D": serve_context(serve_autoscaling_config("decode", config), "DecodeWorker", {}, target=3),
    }
    decisions, _ = plan_policy(contexts)
    assert decisions == {"P": 2, "D": 3}


# ---- the command -------------------------------------------------------------------------------
def test_policy_simulate_workload_prints_and_writes_json(tmp_path, capsys):
    trace = tmp_path / "w.csv"
    trace.write_text("time_s,requests_per_s,prompt_tokens,output_tokens\n0,0.5,100,10\n60,,,\n")
    out = tmp_path / "r.json"
    assert main(["policy", "simulate", str(PLANNER_YAML), "--workload-trace", str(trace), "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "SLO: TTFT <= 2000 ms and TPOT <= 100 ms; cold start 30 s"
    assert [line.split()[:2] for line in lines[3:6]] == [["w.csv", "reactive"], ["w.csv", "planner"], ["w.csv", "ray-default"]]
    assert lines[6].split()[:3] == ["w.csv", "known", "load"]
    assert lines[7].split()[:4] == ["w.csv", "model", "floor", "120"]  # 0.5 req/s: 1 + 1 replicas for 60 s
    report = json.loads(out.read_text())
    assert set(report) == {"summary", "results", "model_floor", "known_load", "capacity", "slo", "seed", "config",
                           "hardware"}
    assert report["capacity"]["prefill_tokens_per_s"] == 296.4 and "cpu_model" in report["hardware"]


def test_policy_simulate_workload_needs_a_planner_section(capsys):
    assert main(["policy", "simulate", str(REPO / "deploy/autoscaling/cluster.yaml"), "--workload", "steady"]) == 2
    assert "has no planner section; --workload needs one" in capsys.readouterr().err
