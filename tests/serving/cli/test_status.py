"""`kvrelay status` against a recorded dashboard answer and a recorded /metrics page."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cluster.dashboard import OpsError
from serving.cli import status
from tests.helpers import REPO

DATA = REPO / "tests" / "cluster" / "data" / "serve_applications.json"

METRICS = """\
# HELP kvrelay_ttft_seconds time to first token
# TYPE kvrelay_ttft_seconds histogram
kvrelay_ttft_seconds_bucket{model="m",le="0.1"} 2.0
kvrelay_ttft_seconds_bucket{model="m",le="0.2"} 6.0
kvrelay_ttft_seconds_bucket{model="m",le="0.4"} 10.0
kvrelay_ttft_seconds_bucket{model="m",le="+Inf"} 10.0
kvrelay_ttft_seconds_count{model="m"} 10.0
kvrelay_num_requests_running{pool="decode",replica="a"} 3.0
kvrelay_num_requests_running{pool="decode",replica="b"} 2.0
kvrelay_num_requests_waiting{pool="prefill",replica="c"} 4.0
kvrelay_kv_cache_usage_ratio{pool="decode",replica="a"} 0.5
kvrelay_kv_cache_usage_ratio{pool="decode",replica="b"} 0.25
kvrelay_engine_kernel_info{pool="decode",replica="a",kernel_path="native",reason="loaded from the cache /c"} 1.0
kvrelay_engine_kernel_info{pool="decode",replica="b",kernel_path="native",reason="loaded from the cache /c"} 1.0
kvrelay_engine_kernel_info{pool="prefill",replica="c",kernel_path="pytorch",reason="KVRELAY_DISABLE_NATIVE=1"} 1.0
kvrelay_kv_transfer_seconds_count{pool="decode",replica="a"} 40.0
kvrelay_kv_transfer_seconds_count{pool="decode",replica="b"} 30.0
kvrelay_kv_transfer_fallbacks_total{pool="decode",replica="a",reason="error"} 2.0
kvrelay_kv_transfer_fallbacks_total{pool="decode",replica="b",reason="error"} 1.0
kvrelay_kv_transfer_fallbacks_total{pool="decode",replica="b",reason="timeout"} 4.0
kvrelay_recoveries_total{model="m",kind="decode_resumed"} 1.0
"""


def recorded() -> dict:
    return json.loads(DATA.read_text())


def test_status_report_lines():
    report = status.status_report(recorded(), "kvrelay", METRICS).splitlines()
    assert report[0] == "application kvrelay: RUNNING"
    assert report[3].split() == ["prefill", "PrefillWorker", "HEALTHY", "1", "running", "[1..1]", "-", "4", "-"]
    assert report[4].split() == ["decode", "DecodeWorker", "HEALTHY", "1", "running", "[1..1]", "5", "-", "38%"]
    assert report[5].split() == ["ingress", "OpenAIIngress", "HEALTHY", "1", "running", "-", "-", "-"]
    # p50: rank 5 in (0.1, 0.2] holding counts 2..6 -> 0.1 + 0.1 * 3/4;
    # p95: rank 9.5 in (0.2, 0.4] holding counts 6..10 -> 0.2 + 0.2 * 3.5/4
    assert report[7] == "TTFT  p50    175.0 ms   p95    375.0 ms"
    # Each pool's kernel path and why, counted over its replicas: a fallback cannot hide.
    # The KVTransfer actor's or a replica's death shows: imports, recomputes by reason, recoveries.
    assert report[-5:-3] == ["", "KV hand-off  70 imported, 7 recomputed (error 3, timeout 4); recovered decode_resumed 1"]
    assert report[-3:] == [
        "",
        "kernels  decode   native x2 (loaded from the cache /c)",
        "kernels  prefill  pytorch x1 (KVRELAY_DISABLE_NATIVE=1)",
    ]


def test_status_without_metrics_says_so():
    assert status.status_report(recorded(), "kvrelay", None).endswith(
        "(no metrics: the ingress's /metrics was not reachable; pass --url)"
    )
    with pytest.raises(OpsError, match="no Serve application 'other' \\(found: kvrelay\\)"):
        status.status_report(recorded(), "other", None)


def test_histogram_quantile():
    buckets = [(1.0, 0.0), (2.0, 10.0), (float("inf"), 10.0)]
    assert status.histogram_quantile(0.5, buckets) == 1.5
    assert status.histogram_quantile(0.5, [(1.0, 0.0), (float("inf"), 0.0)]) is None
    assert status.histogram_quantile(0.99, [(1.0, 5.0), (float("inf"), 10.0)]) == 1.0  # +Inf: the last finite bound


def test_status_reads_only_metrics_the_app_exports():
    from serving.observability.metrics import METRICS

    exported = {spec.name for spec in METRICS}
    used = set(re.findall(r'"(kvrelay_[a-z_]+)"', Path(status.__file__).read_text()))
    assert used and used <= exported, used - exported


DECISIONS = """\
kvrelay_prefix_tokens_total{model="m",pool="prefill",kind="prompt"} 1000.0
kvrelay_prefix_tokens_total{model="m",pool="prefill",kind="predicted"} 640.0
kvrelay_prefix_tokens_total{model="m",pool="prefill",kind="cached"} 608.0
kvrelay_prefix_predictions_total{model="m",pool="prefill",outcome="exact",reason="match"} 16.0
kvrelay_prefix_predictions_total{model="m",pool="prefill",outcome="miss",reason="stale"} 3.0
kvrelay_prefix_predictions_total{model="m",pool="prefill",outcome="surprise",reason="unseen"} 1.0
kvrelay_prefix_predictions_total{model="m",pool="decode",outcome="exact",reason="match"} 0.0
kvrelay_ttft_split_seconds_bucket{model="m",pool="prefill",component="queue",le="0.01"} 5.0
kvrelay_ttft_split_seconds_bucket{model="m",pool="prefill",component="queue",le="0.05"} 10.0
kvrelay_ttft_split_seconds_bucket{model="m",pool="prefill",component="queue",le="+Inf"} 10.0
kvrelay_ttft_split_seconds_bucket{model="m",pool="prefill",component="prefill",le="0.1"} 0.0
kvrelay_ttft_split_seconds_bucket{model="m",pool="prefill",component="prefill",le="0.2"} 10.0
kvrelay_ttft_split_seconds_bucket{model="m",pool="prefill",component="prefill",le="+Inf"} 10.0
kvrelay_ttft_split_seconds_bucket{model="m",pool="prefill",component="handoff",le="0.001"} 10.0
kvrelay_ttft_split_seconds_bucket{model="m",pool="prefill",component="handoff",le="+Inf"} 10.0
kvrelay_decode_start_seconds_bucket{model="m",component="kv_transfer",le="0.005"} 0.0
kvrelay_decode_start_seconds_bucket{model="m",component="kv_transfer",le="0.01"} 10.0
kvrelay_decode_start_seconds_bucket{model="m",component="kv_transfer",le="+Inf"} 10.0
"""


def test_status_shows_the_routers_predictions_and_the_ttft_split():
    report = status.status_report(recorded(), "kvrelay", METRICS + DECISIONS).splitlines()
    start = report.index("prefix hits  requests predicted  cached  mispredicted")
    # 640 of 1000 prompt tokens predicted cached, 608 found; 4 of 20 requests mispredicted
    assert report[start + 1] == "  prefill          20     64.0%   60.8%  4 (20.0%): stale 3, unseen 1"
    assert report[start + 2:start + 8] == [
        "",
        "TTFT split            p50 ms   p95 ms",
        "  queue                 10.0     46.0",  # p50: the 5th of 10 at 0.01; p95: 0.01 + 0.04 * 4.5/5
        "  prefill              150.0    195.0",
        "  handoff                0.5      0.9",
        "",
    ]
    assert report[start + 8:start + 10] == ["decode start          p50 ms   p95 ms", "  kv_transfer            7.5      9.8"]


SPECULATION = """\
kvrelay_spec_decode_proposed_tokens_total{model="m",pool="decode",replica="a",proposer="ngram"} 300.0
kvrelay_spec_decode_proposed_tokens_total{model="m",pool="decode",replica="b",proposer="ngram"} 100.0
kvrelay_spec_decode_accepted_tokens_total{model="m",pool="decode",replica="a",proposer="ngram"} 240.0
kvrelay_spec_decode_accepted_tokens_total{model="m",pool="decode",replica="b",proposer="ngram"} 20.0
kvrelay_spec_decode_verify_steps_total{model="m",pool="decode",replica="a",proposer="ngram"} 75.0
kvrelay_spec_decode_verify_steps_total{model="m",pool="decode",replica="b",proposer="ngram"} 25.0
kvrelay_spec_decode_proposed_tokens_total{model="m",pool="worker",replica="c",proposer="ngram"} 0.0
kvrelay_spec_decode_accepted_tokens_total{model="m",pool="worker",replica="c",proposer="ngram"} 0.0
kvrelay_spec_decode_verify_steps_total{model="m",pool="worker",replica="c",proposer="ngram"} 0.0
"""


def test_status_shows_speculation_per_pool_and_proposer():
    report = status.status_report(recorded(), "kvrelay", METRICS + SPECULATION).splitlines()
    start = report.index("speculative  proposer    proposed  accepted   rate tok/step")
    # The pool's counters summed over its replicas: 260 of 400 kept, (260 + 100) / 100 per step;
    # a pool that has not proposed yet shows no rates.
    assert report[start + 1:start + 4] == [
        "  decode     ngram            400       260  65.0%     3.60",
        "  worker     ngram              0         0      -        -",
        "",
    ]
    assert report[start + 4].startswith("KV hand-off")
