"""The co-run probe (load_tests/pd/corun.py) on this machine's two cores, briefly: both engines
come up pinned, core 0's steps are told apart by phase, and the figures are what the fit reads."""

from __future__ import annotations

import os

import pytest

from load_tests.pd.corun import probe_corun

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="the probe pins engines to cores 0 and 1")
def test_the_probe_times_core_0_alone_and_beside_core_1_and_reports_the_difference():
    from load_tests.roofline import resolve_dtype
    from serving.engine.modeling.loader import resolve_model_dir

    model_dir = resolve_model_dir("smollm2-135m-instruct")
    probe = probe_corun(model_dir, resolve_dtype("auto", model_dir).dtype, rows=(1,), cycles=2, phase_s=0.5)
    (one,) = probe["by_rows"].values()
    assert one["steps"]["alone"] > 0 and one["steps"]["together"] > 0
    assert probe["corun_s"] == max(0.0, one["together_s"] - one["alone_s"])
    assert probe["corun_ref_s"] == one["alone_s"]
    assert (probe["context"], probe["cycles"], probe["phase_s"]) == (256, 2, 0.5)
