"""`kvrelay bench pd-sim`: the quick run end to end, a validation with a given cpu fit, the
refusals; and the engine probe's step shapes on a tiny model."""

from __future__ import annotations

import json

import pytest

from load_tests.pd.costs import CostFit, CostLine, HandoffCost, StepCost, StepShape, chunk_pairs
from load_tests.pd.probe import probe_steps
from serving.cli.dispatch import main

CPU_FIT = CostFit("cpu", StepCost((CostLine(0.012, 0.0012, 0.0001),), 1e-6, 5e-6), HandoffCost(0.0, 23040, 3e9))


def test_the_quick_run_writes_the_crossovers_and_a_png(tmp_path, capsys):
    path = tmp_path / "pd-sim.json"
    assert main(["bench", "pd-sim", "--quick", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    cells = report["raw"]["cells"]
    # the gpu fit alone (no cpu fit given): 2 mixes x pools of 2 and 8 x tight and loose
    assert {(c["fit"], c["mix"], c["num_replicas"], c["slo"]) for c in cells} == {
        ("gpu", mix, n, slo) for mix in ("chat", "chat-bursts") for n in (2, 8) for slo in ("tight", "loose")}
    assert all(c["colocated_per_replica"] > 0 and 1 <= c["best_prefill"] < c["num_replicas"] for c in cells)
    assert len(report["summary"]["crossovers"]) == 4
    assert report["config"]["fits"]["gpu"]["handoff"]["bytes_per_token"] == 819_200
    assert path.with_suffix(".png").stat().st_size > 0
    assert "crossover" in capsys.readouterr().out


def _scenario(tmp_path) -> str:
    def record(i, kind, at, prompt, output):
        return {"request_id": i, "kind": kind, "scheduled_s": at, "num_prompt_tokens": prompt,
                "num_output_tokens": output, "is_success": True}

    steady = [record(i, "random", i * 0.5, 100, 8) for i in range(6)]
    burst = steady[:3] + [record(9, "long", 0.7, 800, 4)] + steady[3:]
    burst = [{**r, "kind": "chat" if r["kind"] == "random" else r["kind"]} for r in burst]
    runs = {f"{mode}/{run}": {"records": records} for mode in ("disaggregated", "colocated")
            for run, records in (("steady", steady), ("burst", burst))}
    stats = {"p50": 100.0, "p95": 100.0, "p99": 100.0}
    modes = {mode: {"chat_ttft_ms_steady": stats, "chat_ttft_ms_burst": stats, "chat_tpot_ms_steady": stats,
                    "chat_tpot_ms_burst": stats, "long_ttft_ms_burst": stats, "goodput_burst": 0.5}
             for mode in ("disaggregated", "colocated")}
    summary = {"slo": {"ttft_ms": 2000.0, "tpot_ms": 100.0}, "modes": modes, "tpot_p99_burst_ratio_disagg": 1.0,
               "tpot_p99_burst_ratio_coloc": 1.0, "goodput_ratio_disagg_vs_coloc": 1.0}
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps({"raw": {"runs": runs}, "summary": summary}))
    return str(path)


def test_a_validation_with_a_given_cpu_fit_reports_every_figure(tmp_path, capsys):
    fit_report = tmp_path / "earlier.json"
    fit_report.write_text(json.dumps({"config": {"fits": {"cpu": CPU_FIT.to_json()}}}))
    out = tmp_path / "validation.json"
    assert main(["bench", "pd-sim", "--cpu-fit", str(fit_report), "--validate", _scenario(tmp_path), "--no-sweep",
                 "--json", str(out)]) == 0
    (validation,) = json.loads(out.read_text())["summary"]["validation"]
    assert len(validation["rows"]) == 2 * 10 + 3 and validation["num_judged"] == 23
    assert validation["tolerance"] == 0.15
    assert "within 15%" in capsys.readouterr().out


def test_the_co_run_term_comes_from_a_probe_file_or_milliseconds_and_a_bad_value_names_the_flag(tmp_path):
    fit_report = tmp_path / "earlier.json"
    fit_report.write_text(json.dumps({"config": {"fits": {"cpu": CPU_FIT.to_json()}}}))
    probe = tmp_path / "corun.json"
    probe.write_text(json.dumps({"corun_s": 0.003, "corun_ref_s": 0.021, "by_rows": {}}))
    for value, expected in ((str(probe), (0.003, 0.021)), ("2.5", (0.0025, CPU_FIT.corun_ref_s))):
        out = tmp_path / "validation.json"
        assert main(["bench", "pd-sim", "--cpu-fit", str(fit_report), "--corun", value, "--validate", _scenario(tmp_path),
                     "--no-sweep", "--json", str(out)]) == 0
        cpu = json.loads(out.read_text())["config"]["fits"]["cpu"]
        assert (cpu["corun_s"], cpu["corun_ref_s"]) == expected
    with pytest.raises(SystemExit, match="--corun wants milliseconds or a `python -m load_tests.pd.corun` JSON file; 'fast'"):
        main(["bench", "pd-sim", "--cpu-fit", str(fit_report), "--corun", "fast", "--no-sweep"])


def test_several_measured_runs_are_also_judged_on_their_median(tmp_path, capsys):
    fit_report = tmp_path / "earlier.json"
    fit_report.write_text(json.dumps({"config": {"fits": {"cpu": CPU_FIT.to_json()}}}))
    out = tmp_path / "validation.json"
    scenario = _scenario(tmp_path)
    assert main(["bench", "pd-sim", "--cpu-fit", str(fit_report), "--validate", scenario, "--validate", scenario,
                 "--no-sweep", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    assert len(summary["validation"]) == 2
    median = summary["validation_median"]
    assert median["scenarios"] == [scenario, scenario] and median["num_judged"] == 23
    # the same run twice: its figures, no spread
    assert [row["measured"] for row in median["rows"]] == [row["measured"] for row in summary["validation"][0]["rows"]]
    assert all(row["spread"] == 0.0 for row in median["rows"])
    assert "median of 2 runs" in capsys.readouterr().out


def test_the_cpu_fit_needs_a_serve_overhead_report_or_an_earlier_fit(capsys):
    with pytest.raises(SystemExit, match="--serve-overhead FILE"):
        main(["bench", "pd-sim", "--fits", "cpu", "--no-sweep"])
    with pytest.raises(SystemExit, match="--pool-sizes"):
        main(["bench", "pd-sim", "--quick", "--pool-sizes", "1,8"])
    with pytest.raises(SystemExit, match="unknown nope"):
        main(["bench", "pd-sim", "--quick", "--mixes", "nope"])


def test_the_engine_probe_times_steps_of_known_shapes(tiny_model_dir):
    points = probe_steps(tiny_model_dir, "float32", repeats=1, scenarios=("prefill-16", "decode-b2"))
    shapes = [p.shape for p in points]
    assert shapes[0] == StepShape(16, 1, chunk_pairs(16, 0), 0)
    # two 128-token prompts in one step, then 12 steps of two rows reading 129, 130, ... tokens
    assert shapes[1] == StepShape(256, 2, 2 * chunk_pairs(128, 0), 0)
    assert shapes[2:] == [StepShape(2, 2, 0, 2 * (129 + i)) for i in range(12)]
    assert all(p.seconds > 0 for p in points)
