"""The machine's other load beside a benchmark: which processes count, the mean over a run's window."""

from __future__ import annotations

import json
import os
import time

from load_tests.scenario.foreign_cpu import ForeignSampler, _foreign_seconds, is_benchmark, main, mean_cores


def test_the_benchmarks_own_processes_do_not_count():
    assert is_benchmark("ray::ServeReplica:kvrelay-scenario-colocated:Worker")
    assert is_benchmark("/work/main/.venv/bin/python .venv/bin/kvrelay bench scenario pd-interference --json x.json")
    assert is_benchmark("/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --node_id=1")
    assert not is_benchmark(".venv/bin/python -m serving.cli bench routing --simulate")
    assert not is_benchmark(".venv/bin/python -m pytest tests/router")


def test_the_mean_weighs_each_sample_by_its_overlap_with_the_window():
    # a sample covers the period before its time: 0-10 s at 1 core, 10-20 s at 0.5 cores
    samples = [{"t": 0.0, "foreign_cores": 0.0}, {"t": 10.0, "foreign_cores": 1.0}, {"t": 20.0, "foreign_cores": 0.5}]
    assert mean_cores(samples, 5.0, 15.0) == 0.75
    assert mean_cores(samples, 0.0, 10.0) == 1.0
    assert mean_cores(samples, 30.0, 40.0) == 0.0  # no samples there


def test_annotate_writes_each_runs_mean_into_the_scenario(tmp_path):
    scenario, samples = tmp_path / "s.json", tmp_path / "samples.jsonl"
    scenario.write_text(json.dumps({"summary": {}}))
    samples.write_text("\n".join(json.dumps({"t": t, "foreign_cores": c, "top": {}}) for t, c in [(0, 0), (10, 1.0), (20, 0.5)]))
    assert main(["annotate", str(scenario), str(samples), "colocated/burst=5,15", "colocated/steady=0,10"]) == 0
    foreign = json.loads(scenario.read_text())["foreign_cpu"]
    assert foreign["cores"] == {"colocated/burst": 0.75, "colocated/steady": 1.0}


def test_foreign_seconds_count_other_processes_only_and_new_ones_whole():
    before = {1: ("ray::Worker", 10.0), 2: ("make -j2", 1.0), os.getpid(): ("python -m pytest", 5.0)}
    after = {1: ("ray::Worker", 14.0), 2: ("make -j2", 2.5), 3: ("cc1plus x.c", 0.5), os.getpid(): ("python -m pytest", 9.0)}
    assert _foreign_seconds(before, after) == {"make -j2": 1.5, "cc1plus x.c": 0.5}


def test_the_sampler_reports_mean_cores_after_its_block(monkeypatch):
    from load_tests.scenario import foreign_cpu

    snapshots = iter([{7: ("make -j2", 1.0)}, {7: ("make -j2", 1.5), 8: ("cc1plus x.c", 0.25)}])
    monkeypatch.setattr(foreign_cpu, "_snapshot", lambda: next(snapshots))
    with ForeignSampler(period_s=60.0) as foreign:  # no tick in the block: one reading at its end
        pass
    ended = time.monotonic()
    assert foreign.top == {"make -j2": 0.5, "cc1plus x.c": 0.25}
    assert foreign.cores >= 0.75 / (ended - foreign._started)  # those CPU seconds over the block's wall time
    assert not foreign._thread.is_alive()
