"""The autoscaling policy YAML: defaults, errors naming file/field/value/range, the shipped files,
and `kvrelay policy check / simulate`."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.autoscaling.policy import DecodePoolPolicy, PolicyError, PrefillPoolPolicy, load_policy, parse_policy
from router.autoscaling.simulator import TraceError, read_trace, simulate
from serving.cli.dispatch import main
from tests.helpers import REPO

POLICIES = REPO / "deploy" / "autoscaling"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, "p.yaml", text)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    return str(info.value).replace(str(path), "p.yaml")


# ---- schema ----------------------------------------------------------------------------------
def test_defaults_fill_a_minimal_pool():
    policy = parse_policy({"prefill": {"max_replicas": 3}})
    assert policy.decode is None and policy.worker is None and policy.name == "default"
    assert policy.prefill == PrefillPoolPolicy(
        min_replicas=1, max_replicas=3, max_step=2, window_s=30, metrics_interval_s=5, stale_after_s=30,
        upscale_delay_s=10, upscale_cooldown_s=30, downscale_delay_s=120, downscale_threshold=0.7,
        targets={"ttft_p95_ms": 2000, "queued_prefill_tokens_per_replica": 4096},
    )
    assert policy.prefill.target_by_signal() == {"ttft_p95_ms": 2000.0, "num_queued_prefill_tokens": 4096.0}
    decode = DecodePoolPolicy(max_replicas=2, targets={"kv_utilization": None, "tpot_p95_ms": None})
    assert decode.target_by_signal() == {"num_seqs": 32.0}


def test_bad_values_name_file_field_value_and_range(tmp_path):
    text = """
prefill:
  max_replicas: 0
  max_step: 0
  downscale_threshold: 1.5
  targets: {ttft_p95_ms: -1}
decode:
  max_replicas: many
"""
    assert error_of(tmp_path, text) == (
        "p.yaml: invalid autoscaling policy\n"
        "  prefill.max_replicas = 0: Input should be greater than or equal to 1 (allowed: >= 1 and <= 256)\n"
        "  prefill.max_step = 0: Input should be greater than or equal to 1 (allowed: >= 1 and <= 64)\n"
        "  prefill.downscale_threshold = 1.5: Input should be less than 1 (allowed: > 0 and < 1)\n"
        "  prefill.targets.ttft_p95_ms = -1: Input should be greater than 0 (allowed: > 0 and <= 600000, or null)\n"
        "  decode.max_replicas = 'many': Input should be a valid integer, unable to parse string as an "
        "integer (allowed: >= 1 and <= 256)"
    )


def test_unknown_keys_list_the_allowed_ones(tmp_path):
    text = "prefil: {max_replicas: 2}\ndecode: {max_replicas: 2, targets: {tpot_ms: 100}}\n"
    assert error_of(tmp_path, text) == (
        "p.yaml: invalid autoscaling policy\n"
        "  decode.targets.tpot_ms = 100: unknown key; remove it or fix its spelling (allowed keys: "
        "num_seqs_per_replica, kv_utilization, tpot_p95_ms)\n"
        "  prefil: unknown key; remove it or fix its spelling (allowed keys: name, prefill, decode, worker, mode, planner)"
    )


def test_prefill_targets_are_not_decode_targets(tmp_path):
    assert error_of(tmp_path, "prefill: {max_replicas: 2, targets: {kv_utilization: 0.5}}") == (
        "p.yaml: invalid autoscaling policy\n"
        "  prefill.targets.kv_utilization = 0.5: unknown key; remove it or fix its spelling (allowed keys: "
        "ttft_p95_ms, queued_prefill_tokens_per_replica)"
    )


def test_cross_field_checks_name_the_field(tmp_path):
    cases = {
        "prefill: {min_replicas: 3, max_replicas: 2}":
            "prefill.max_replicas = 2: below min_replicas = 3 (allowed: >= 3 and <= 256)",
        "decode: {max_replicas: 2, window_s: 4, metrics_interval_s: 5}":
            "decode.metrics_interval_s = 5.0: not below window_s = 4.0 (allowed: >= 0.1 and < 4.0)",
        "worker: {max_replicas: 2, metrics_interval_s: 5, stale_after_s: 6}":
            "worker.stale_after_s = 6.0: below 2 x metrics_interval_s, so fresh data would look stale "
            "(allowed: >= 10.0 and <= 3600)",
        "decode: {max_replicas: 2, targets: {num_seqs_per_replica: null, kv_utilization: null, tpot_p95_ms: null}}":
            "decode.targets: every target is null; set at least one of num_seqs_per_replica, kv_utilization, tpot_p95_ms",
        "prefill: {}": "prefill.max_replicas: Field required (allowed: >= 1 and <= 256)",
        "name: default": "(top level): no pool is configured; add at least one of prefill, decode, worker",
    }
    for text, line in cases.items():
        assert error_of(tmp_path, text) == f"p.yaml: invalid autoscaling policy\n  {line}"


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(PolicyError, match=r"nope.yaml: cannot read the autoscaling policy \(No such file"):
        load_policy(tmp_path / "nope.yaml")
    assert error_of(tmp_path, "prefill: [1, 2").startswith("p.yaml: not valid YAML:")
    assert error_of(tmp_path, "") == "p.yaml: the top level must be a mapping with prefill/decode/worker sections, got empty"
    assert error_of(tmp_path, "- 1") == "p.yaml: the top level must be a mapping with prefill/decode/worker sections, got list"


def test_shipped_policies_load():
    default = load_policy(POLICIES / "default.yaml")
    # 2 cores: every pool stays at one replica (see the file's header).
    assert [(p.min_replicas, p.max_replicas) for p in (default.prefill, default.decode, default.worker)] == [(1, 1)] * 3
    cluster = load_policy(POLICIES / "cluster.yaml")
    assert (cluster.prefill.max_replicas, cluster.decode.max_replicas, cluster.worker) == (8, 8, None)


# ---- traces and simulation -------------------------------------------------------------------
def test_example_trace_through_the_cluster_policy():
    rows = read_trace(POLICIES / "example-trace.csv", required=("num_queued_prefill_tokens", "ttft_p95_ms"))
    steps = simulate(load_policy(POLICIES / "cluster.yaml").prefill, rows)
    counts = [s.num_replicas for s in steps]
    # step at t=75 -> 3 at t=90 -> 5 at t=120; the 15 s spike at t=240 and the stale gap at
    # t=300-315 change nothing; the load goes at t=330 and the pool steps down every 135 s.
    assert counts == [1] * 6 + [3] * 2 + [5] * 22 + [4] * 9 + [3] * 9 + [2] * 9 + [1] * 3
    assert [s.reason for s in steps if s.time_s in (240, 300)] == [
        "hold: demand 10.99 (queued_prefill_tokens) > 5 for 0.0s of upscale_delay_s 15",
        "hold: replica 0 last reported 35.0s ago (stale_after_s 30)",
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("time_s,queued\n0,1\n", "unknown column 'queued' (allowed: time_s, queued_prefill_tokens, ttft_p95_ms, num_seqs, kv_utilization, tpot_p95_ms, age_s)"),
        ("ttft_p95_ms\n1\n", "no time_s column (the policy needs it; columns: ttft_p95_ms)"),
        ("time_s,ttft_p95_ms\n0,1\n", "no queued_prefill_tokens column (the policy needs it; columns: time_s, ttft_p95_ms)"),
        ("time_s,queued_prefill_tokens\n0,1\n5,lots\n", ":3: queued_prefill_tokens = 'lots' is not a number"),
        ("time_s,queued_prefill_tokens\n0,1\n5,-2\n", ":3: queued_prefill_tokens = '-2' (allowed: a finite number >= 0)"),
        ("time_s,queued_prefill_tokens\n5,1\n5,1\n", ":3: time_s = 5 is not after 5"),
        ("time_s,queued_prefill_tokens\n,1\n", ":2: time_s is empty"),
    ],
)
def test_bad_traces_name_the_line_column_and_value(tmp_path, text, message):
    path = write(tmp_path, "t.csv", text)
    with pytest.raises(TraceError) as info:
        read_trace(path, required=("num_queued_prefill_tokens",))
    assert str(info.value) == f"{path}{'' if message.startswith(':') else ': '}{message}"


# ---- the CLI ---------------------------------------------------------------------------------
SMALL = """\
name: small
prefill:
  max_replicas: 3
  upscale_delay_s: 5
  upscale_cooldown_s: 10
  downscale_delay_s: 10
  targets: {ttft_p95_ms: null, queued_prefill_tokens_per_replica: 1000}
"""


def test_policy_check_prints_the_effective_policy(tmp_path, capsys):
    path = write(tmp_path, "small.yaml", SMALL)
    assert main(["policy", "check", str(path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"# {path}: valid; the effective policy (null pool: fixed replicas, null target: signal off)",
        "name: small",
        "prefill:",
        "  min_replicas: 1",
        "  max_replicas: 3",
        "  max_step: 2",
        "  window_s: 30.0",
        "  metrics_interval_s: 5.0",
        "  stale_after_s: 30.0",
        "  upscale_delay_s: 5.0",
        "  upscale_cooldown_s: 10.0",
        "  downscale_delay_s: 10.0",
        "  downscale_threshold: 0.7",
        "  targets:",
        "    ttft_p95_ms: null",
        "    queued_prefill_tokens_per_replica: 1000",
        "decode: null",
        "worker: null",
        "mode: reactive",
        "planner: null",
    ]


def test_policy_check_rejects_a_bad_file_with_exit_2(tmp_path, capsys):
    path = write(tmp_path, "bad.yaml", "prefill: {max_replicas: 300}\n")
    assert main(["policy", "check", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"kvrelay policy: {path}: invalid autoscaling policy\n"
        "  prefill.max_replicas = 300: Input should be less than or equal to 256 (allowed: >= 1 and <= 256)\n"
    )


def test_policy_simulate_prints_the_count_per_row(tmp_path, capsys):
    policy = write(tmp_path, "small.yaml", SMALL)
    trace = write(tmp_path, "t.csv", "time_s,queued_prefill_tokens\n0,500\n5,2500\n10,2500\n15,2500\n20,\n25,100\n30,100\n35,100\n40,100\n")
    assert main(["policy", "simulate", str(policy), "--trace", str(trace)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"# policy 'small' ({policy}), prefill pool, trace {trace}",
        "  time_s  replicas  reason",
        "       0         1  hold: demand 0.50 (queued_prefill_tokens) within (0.00, 1]",
        "       5         1  hold: demand 2.50 (queued_prefill_tokens) > 1 for 0.0s of upscale_delay_s 5",
        "      10         3  up: 1 -> 3, demand 2.50 (queued_prefill_tokens)",
        "      15         3  hold: demand 2.50 (queued_prefill_tokens) within (1.40, 3]",
        "      20         3  hold: replica 0 has no queued_prefill_tokens in the window",
        "      25         3  hold: demand 0.10 (queued_prefill_tokens) <= 1.40 for 0.0s of downscale_delay_s 10",
        "      30         3  hold: demand 0.10 (queued_prefill_tokens) <= 1.40 for 5.0s of downscale_delay_s 10",
        "      35         2  down: 3 -> 2, demand 0.10 (queued_prefill_tokens)",
        "      40         2  hold: demand 0.10 (queued_prefill_tokens) <= 0.70 for 0.0s of downscale_delay_s 10",
    ]


def test_policy_simulate_errors_exit_2(tmp_path, capsys):
    policy = write(tmp_path, "small.yaml", SMALL)
    trace = write(tmp_path, "t.csv", "time_s,num_seqs\n0,1\n")
    assert main(["policy", "simulate", str(policy), "--trace", str(trace), "--pool", "decode"]) == 2
    assert capsys.readouterr().err == f"kvrelay policy: {policy} has no decode section (it has: prefill)\n"
    assert main(["policy", "simulate", str(policy), "--trace", str(trace)]) == 2
    assert capsys.readouterr().err == (
        f"kvrelay policy: {trace}: no queued_prefill_tokens column (the policy needs it; columns: time_s, num_seqs)\n"
    )


# ---- wiring into the app ---------------------------------------------------------------------
def test_config_path_is_relative_to_the_config_file_and_only_named_pools_autoscale(tmp_path):
    from serving.config import load_config
    from serving.deployments.app import build_app

    (tmp_path / "policies").mkdir()
    write(tmp_path / "policies", "p.yaml", SMALL)
    config = load_config(write(tmp_path, "c.yaml", "autoscaling_policy: policies/p.yaml\ndecode: {num_replicas: 2}\n"), env={})
    assert config.autoscaling_policy == str(tmp_path / "policies" / "p.yaml")
    prefill, decode = (a._bound_deployment._deployment_config for a in build_app(config)._bound_deployment.init_args[1:])
    scaling = prefill.autoscaling_config
    assert (scaling.min_replicas, scaling.initial_replicas, scaling.max_replicas) == (1, 1, 3)
    assert (scaling.upscale_delay_s, scaling.downscale_delay_s, scaling.metrics_interval_s) == (0.0, 0.0, 5.0)
    assert scaling.policy.policy_function == "router.autoscaling.decide:prefill_policy"
    assert scaling.policy.policy_kwargs["pool"]["targets"]["queued_prefill_tokens_per_replica"] == 1000
    assert (decode.autoscaling_config, decode.num_replicas) == (None, 2)


def test_serve_refuses_a_bad_policy_before_starting_ray(tmp_path, capsys):
    write(tmp_path, "p.yaml", "prefill: {max_replicas: 2, max_step: 99}\n")
    config = write(tmp_path, "c.yaml", "autoscaling_policy: p.yaml\n")
    assert main(["serve", "--config", str(config)]) == 2
    assert capsys.readouterr().err == (
        f"kvrelay serve: {tmp_path / 'p.yaml'}: invalid autoscaling policy\n"
        "  prefill.max_step = 99: Input should be less than or equal to 64 (allowed: >= 1 and <= 64)\n"
    )
