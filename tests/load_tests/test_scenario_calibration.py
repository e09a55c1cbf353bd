"""Scenario loads from measured machine rates: exact arithmetic on hand-made rates."""

from __future__ import annotations

import dataclasses

import pytest

from load_tests.scenario.bench import _PD_FULL, _PREFIX_FULL
from load_tests.scenario.calibration import MachineRates, calibrate_pd, calibrate_prefix

# one core prefills 500 tok/s; decode steps of 20 ms at batch 1 and 40 ms at batch 4 (10 ms a token)
RATES = MachineRates(prefill_tokens_per_s=500.0, decode_step_s={1: 0.02, 4: 0.04}, probe_len=1024, dtype="float32")


def test_pd_load_follows_the_rates():
    w, info = calibrate_pd(_PD_FULL, RATES, max_model_len=8192)
    # a burst is 4 s of one core's prefill: 2000 tokens, one prompt
    assert (w.burst_len, w.burst_size) == (2000, 1)
    # chat: 128/500 + 64 * 0.01 = 0.896 core-s; burst: 2000/500 + 64 * 0.01 = 4.64 core-s
    assert info["chat_work_core_s"] == 0.896 and info["burst_work_core_s"] == 4.64
    # 0.6 of 2 cores = 1.2 core-s/s: chat gets 0.72 -> 0.8036 req/s, bursts 0.48 -> one per 9.67 s
    assert w.request_rates == (0.804,) and w.burst_every_s == 9.67
    assert w.num_prompts == 72  # 90 s of the chat stream
    assert info["rates"] == {"prefill_tokens_per_s": 500.0, "decode_step_ms": {"1": 20.0, "4": 40.0},
                             "probe_len": 1024, "dtype": "float32", "threads": 1}


def test_a_fast_machine_splits_the_burst_at_the_context():
    fast = MachineRates(prefill_tokens_per_s=5000.0, decode_step_s={1: 0.005, 4: 0.01}, probe_len=1024, dtype="bfloat16")
    w, _ = calibrate_pd(_PD_FULL, fast, max_model_len=8192)
    # 20000 tokens of prefill per burst do not fit 8192 - 64 - 16: three prompts of 8112
    assert (w.burst_len, w.burst_size) == (8112, 3)


def test_a_long_probe_that_is_slower_per_token_shortens_the_burst():
    # 1000 tokens in 1 s and 3000 in 5 s: t(n) = n / 1500 + n^2 / 3e6 s. 4 s of prefill is the
    # root of n^2 + 2000 n - 12e6: n = 2605.55, where the linear rule counted 4000 tokens.
    rates = MachineRates(prefill_tokens_per_s=1000.0, decode_step_s={1: 0.02, 4: 0.04}, probe_len=1000, dtype="bfloat16",
                         long_probe=(3000, 5.0))
    assert (rates.prefill_s(1000), rates.prefill_s(3000)) == (pytest.approx(1.0), pytest.approx(5.0))
    w, info = calibrate_pd(_PD_FULL, rates, max_model_len=8192)
    assert (w.burst_len, w.burst_size) == (2606, 1)
    # the burst's work: t(2606) = 1.73733 + 2.26375 s, plus 64 output tokens at 10 ms
    assert info["burst_work_core_s"] == 4.641
    assert info["rates"]["long_probe"] == {"tokens": 3000, "prefill_s": 5.0}
    # A long probe no slower per token than the short one leaves the rule linear.
    flat = dataclasses.replace(rates, long_probe=(3000, 2.9))
    assert calibrate_pd(_PD_FULL, flat, max_model_len=8192)[0].burst_len == 4000


def test_prefix_rate_loads_the_pool_when_nothing_is_cached():
    w, info = calibrate_prefix(_PREFIX_FULL, RATES)
    # (512 + 32) / 500 = 1.088 core-s per uncached request; 0.6 of 2 replicas -> 1.103 req/s
    assert info["uncached_work_core_s"] == 1.088
    assert w.request_rates == (pytest.approx(1.103),)
