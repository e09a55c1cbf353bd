"""A worker's autoscaling signals: latency windows, per-request TTFT/TPOT, the reported dict."""

from __future__ import annotations

from dataclasses import replace

import pytest

from router.autoscaling.decide import WIRE_SIGNALS
from serving.deployments.engine_worker import replica_signals
from serving.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from serving.observability import worker_metrics
from serving.observability.worker_metrics import (
    DecodeStepRates,
    LatencyWindow,
    RequestLatencies,
    TokensPerStep,
    WorkloadWindow,
)


def output(tokens: int, *, arrival: float, first: float | None, finished: float | None, reason: str | None = None):
    return RequestOutput(
        "r", [CompletionOutput(0, "", [7] * tokens, finish_reason=reason)], finished is not None, 10, 0,
        RequestMetrics(arrival_mono_s=arrival, first_token_mono_s=first, finished_mono_s=finished),
    )


def test_percentile_is_nearest_rank_over_the_window():
    window = LatencyWindow(window_s=10.0)
    assert window.percentile(95, now=0.0) is None
    for i, value in enumerate(range(1, 21)):  # 1..20 ms at t = 0..19
        window.add(float(value), now=float(i))
    assert window.percentile(95, now=19.0) == 20.0  # window t >= 9: 10..20, rank ceil(0.95 * 11) = 11
    assert window.percentile(50, now=19.0) == 15.0
    assert window.percentile(95, now=25.0) == 20.0  # t >= 15: 16..20
    assert window.percentile(95, now=40.0) is None


def test_window_keeps_at_most_max_samples():
    window = LatencyWindow(window_s=100.0, max_samples=3)
    for value in (50.0, 1.0, 2.0, 3.0):
        window.add(value, now=0.0)
    assert window.percentile(100, now=0.0) == 3.0


def test_ttft_at_the_first_token_and_tpot_at_the_finish():
    latencies = RequestLatencies(window_s=1e9)
    tracker = latencies.track()
    tracker.observe(output(0, arrival=10.0, first=None, finished=None))
    tracker.observe(output(1, arrival=10.0, first=10.25, finished=None))
    assert latencies.ttft_ms.percentile(100) == 250.0 and latencies.tpot_ms.percentile(100) is None
    tracker.observe(output(4, arrival=10.0, first=10.25, finished=10.75, reason="length"))
    assert latencies.ttft_ms.percentile(100) == 250.0  # once per request
    assert latencies.tpot_ms.percentile(100) == 125.0  # (10.75 - 10.25) / (5 - 1)


def test_continued_requests_have_no_ttft_and_count_every_token_as_a_gap():
    latencies = RequestLatencies(window_s=1e9)
    tracker = latencies.track(continues=True)  # the first token came from the prefill worker
    tracker.observe(output(4, arrival=20.0, first=20.125, finished=20.5, reason="stop"))
    assert latencies.ttft_ms.percentile(100) is None
    assert latencies.tpot_ms.percentile(100) == 125.0  # (20.5 - 20.0) / 4


def test_aborted_and_single_token_requests_give_no_tpot():
    latencies = RequestLatencies(window_s=1e9)
    latencies.track().observe(output(3, arrival=0.0, first=0.1, finished=0.5, reason="abort"))
    latencies.track().observe(output(1, arrival=0.0, first=0.2, finished=0.2, reason="length"))  # a prefill
    assert latencies.tpot_ms.percentile(100) is None
    assert latencies.ttft_ms.percentile(100) == 200.0


def test_replica_signals_report_every_signal_on_the_wire():
    stats = EngineStats(
        num_running=3, num_waiting=2, num_blocks=100, num_free_blocks=40, kv_usage=0.6, num_preemptions=0,
        prefix_cache_query_tokens=0, prefix_cache_hit_tokens=0, num_computed_tokens=0, num_generated_tokens=0,
        num_held_exports=0, num_queued_prefill_tokens=1234,
    )
    latencies = RequestLatencies()
    assert replica_signals(replace(stats, prefill_tokens_per_s=296.5), latencies).to_wire() == {
        "num_queued_prefill_tokens": 1234.0, "ttft_p95_ms": 0.0, "num_seqs": 5.0, "kv_usage": 0.6, "tpot_p95_ms": 0.0,
        "requests_per_s": 0.0, "prompt_tokens_per_request": 0.0, "output_tokens_per_request": 0.0,
        "output_tokens_per_s": 0.0, "prefill_tokens_per_s": 296.5, "decode_tokens_per_step": 1.0,
        "requests_total": 0.0, "decode_steps_per_s": 0.0, "decode_rows_per_s": 0.0, "decode_busy_s_per_s": 0.0,
    }
    latencies.ttft_ms.add(80.0)
    assert replica_signals(replace(stats, num_waiting=0), latencies).ttft_p95_ms == 80.0
    assert tuple(replica_signals(stats, latencies).to_wire()) == WIRE_SIGNALS


def test_workload_window_reports_rates_lengths_and_tokens_since_the_last_report():
    workload = WorkloadWindow(window_s=10.0)
    workload.arrived(50, now=0.5)
    workload.arrived(100, now=1.0)
    workload.arrived(300, now=2.0)
    assert workload.report(now=5.0) == (0.3, 150.0, 0.0, 0.0)  # no previous report: no token rate yet
    workload.generated(40)
    workload.finished(40, now=6.0)
    workload.generated(20)
    workload.finished(20, now=7.0)
    # 60 tokens in the 5 s since the previous report.
    assert workload.report(now=10.0) == (0.3, 150.0, 30.0, 12.0)
    # The arrivals at 0.5 s and 1 s have left the 10 s window; the counter keeps them.
    assert workload.report(now=12.0) == (0.1, 300.0, 30.0, 0.0)
    assert workload.num_arrived == 3


def test_decode_step_rates_are_the_accounts_increments_over_the_time_between_reports():
    rates = DecodeStepRates()
    assert rates.report(10, 30, 0.5, now=100.0) == (0.0, 0.0, 0.0)  # no previous report: no interval yet
    # 40 steps of 120 sequences in 1.8 s of periods, over the 2 s since
    assert rates.report(50, 150, 2.3, now=102.0) == pytest.approx((20.0, 60.0, 0.9), rel=1e-12)
    assert rates.report(50, 150, 2.3, now=107.0) == (0.0, 0.0, 0.0)  # no step counted: nothing to say
    assert rates.report(52, 158, 2.4, now=108.0) == pytest.approx((2.0, 8.0, 0.1), rel=1e-12)


def test_replica_signals_carry_the_engines_decode_step_account(monkeypatch):
    stats = EngineStats(
        num_running=4, num_waiting=0, num_blocks=100, num_free_blocks=40, kv_usage=0.6, num_preemptions=0,
        prefix_cache_query_tokens=0, prefix_cache_hit_tokens=0, num_computed_tokens=0, num_generated_tokens=0,
        num_held_exports=0,
    )
    latencies = RequestLatencies()
    latencies.decode_steps.report(0, 0, 0.0, now=100.0)  # the worker's previous report
    monkeypatch.setattr(worker_metrics.time, "monotonic", lambda: 105.0)  # five seconds later
    signals = replica_signals(replace(stats, decode_steps=100, decode_step_rows=400, decode_step_s=4.5), latencies)
    assert (signals.decode_steps_per_s, signals.decode_rows_per_s, signals.decode_busy_s_per_s) == (20.0, 80.0, 0.9)


def test_tracked_requests_feed_the_workload_window():
    latencies = RequestLatencies(window_s=1e9)
    latencies.workload.report(now=0.0)
    tracker = latencies.track(continues=True)
    tracker.observe(output(4, arrival=20.0, first=20.125, finished=20.5, reason="stop"))
    latencies.track().observe(output(3, arrival=0.0, first=0.1, finished=0.5, reason="abort"))  # made, not finished
    _, _, output_tokens, made_per_s = latencies.workload.report(now=7.0)
    assert (output_tokens, made_per_s) == (4.0, 1.0)


def test_tokens_per_step_is_generated_over_generated_less_accepted_between_reports():
    per_step = TokensPerStep()
    assert per_step.report(0, 0) == 1.0  # nothing yet
    assert per_step.report(10, 0) == 1.0  # no speculation: a token per step
    assert per_step.report(40, 15) == 2.0  # 30 tokens in 15 steps (15 accepted)
    assert per_step.report(40, 15) == 2.0  # idle: the last interval's
    assert per_step.report(48, 21) == 4.0  # 8 tokens, 6 accepted: 2 steps


def test_replica_signals_carry_the_decode_tokens_per_step():
    stats = EngineStats(
        num_running=1, num_waiting=0, num_blocks=100, num_free_blocks=90, kv_usage=0.1, num_preemptions=0,
        prefix_cache_query_tokens=0, prefix_cache_hit_tokens=0, num_computed_tokens=0, num_generated_tokens=0,
        num_held_exports=0, spec_method="ngram",
    )
    latencies = RequestLatencies()
    assert replica_signals(stats, latencies).decode_tokens_per_step == 1.0
    stats = replace(stats, num_generated_tokens=25, spec_proposed_tokens=40, spec_accepted_tokens=15, spec_verify_steps=10)
    assert replica_signals(stats, latencies).decode_tokens_per_step == 2.5  # 25 tokens, 10 steps
