"""What the benches share: the report writer and the plain run_from_args."""

from __future__ import annotations

import argparse
import json
import math

from load_tests.common import command_line, load_note, run_and_report, write_report


def test_a_report_with_a_figure_that_could_not_be_computed_is_still_written(tmp_path):
    report = {"summary": {"tok_s": 12.5, "ratio": math.nan, "roof": math.inf}, "runs": [(1.0, -math.inf)]}
    path = write_report(tmp_path / "sub" / "r.json", report)
    assert json.loads(path.read_text()) == {"summary": {"tok_s": 12.5, "ratio": None, "roof": None}, "runs": [[1.0, None]]}


def test_run_and_report_runs_the_params_of_the_command_line_and_writes_json(tmp_path):
    seen, lines = [], []

    def run(params, *, command):
        seen.append((params, command))
        return {"summary": {"n": params}}

    args = argparse.Namespace(json=str(tmp_path / "out.json"), n=3)
    assert run_and_report(args, ["bench", "x", "--n", "3"], lambda a: a.n, run, lines.append) == 0
    assert seen == [(3, "kvrelay bench x --n 3")]
    assert json.loads((tmp_path / "out.json").read_text()) == {"summary": {"n": 3}}
    assert lines == [f"wrote {tmp_path / 'out.json'}"]
    assert run_and_report(argparse.Namespace(json=None, n=4), [], lambda a: a.n, run, lines.append) == 0
    assert len(lines) == 1 and seen[-1] == (4, "kvrelay")


def test_the_load_note_speaks_only_of_a_busy_machine():
    assert load_note(None) is None and load_note(0.49) is None
    assert load_note(1.5) == "note: 1-min load average 1.50 at start: other processes shared the CPU"
    assert command_line(["bench", "engine"]) == "kvrelay bench engine"
