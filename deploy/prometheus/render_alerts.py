"""Render kvrelay's Prometheus alert rules for your SLOs (thresholds are parameters).

    python deploy/prometheus/render_alerts.py                      # the defaults, to stdout
    python deploy/prometheus/render_alerts.py --ttft-p95-s 1.5 --min-stream-tokens-per-s 20 \\
        --selector 'job="ray"' -o my-alerts.yaml

`deploy/prometheus/kvrelay-alerts.yaml` is this script's output with the defaults (a test keeps
them equal). Every rule fires per model (per model and pool for the engine rules) once its
condition has held for `--for`:

    KVRelayTTFTHigh                  TTFT p95 over --window       > --ttft-p95-s
    KVRelayStreamTokensPerSecondLow  1 / TPOT p95 (the p5 of a stream's tokens/s) < --min-stream-tokens-per-s
    KVRelayErrorRateHigh             (5xx + 429 requests) / requests > --max-error-ratio
    KVRelayKVCacheFull               a replica's KV cache usage    > --max-kv-cache-usage
    KVRelayQueueDeep                 waiting sequences per replica, the pool's mean > --max-queue-depth

`--selector` adds label matchers to every series (e.g. `job="ray"` when Prometheus scrapes both
Ray's export and an ingress). The metrics are kvrelay's own names (serving/observability/metrics.py); Ray's
export needs the `ray_` prefix relabelled away, as deploy/prometheus/prometheus.yml does.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass, fields

import yaml

__all__ = ["Thresholds", "render", "rules"]


@dataclass(frozen=True)
class Thresholds:
    ttft_p95_s: float = 2.0
    min_stream_tokens_per_s: float = 10.0
    max_error_ratio: float = 0.01
    max_kv_cache_usage: float = 0.95
    max_queue_depth: float = 16.0
    window: str = "5m"  # rate() window of the latency and error rules
    for_: str = "5m"  # how long a condition holds before the alert fires
    selector: str = ""  # extra label matchers, e.g. job="ray"

    def __post_init__(self):
        for name in ("ttft_p95_s", "min_stream_tokens_per_s", "max_queue_depth"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_error_ratio", "max_kv_cache_usage"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")


def _series(name: str, t: Thresholds, *matchers: str) -> str:
    labels = [m for m in (*matchers, t.selector) if m]
    return f"{name}{{{','.join(labels)}}}" if labels else name


def rules(t: Thresholds) -> list[dict]:
    w = t.window

    def quantile(metric: str) -> str:
        return f"histogram_quantile(0.95, sum by (model, le) (rate({_series(metric + '_bucket', t)}[{w}])))"

    def rule(name: str, expr: str, summary: str, threshold: float, severity: str = "warning") -> dict:
        return {
            "alert": name,
            "expr": expr,
            "for": t.for_,
            "labels": {"severity": severity, "service": "kvrelay"},
            "annotations": {"summary": summary, "threshold": f"{threshold:g}"},
        }

    requests = _series("kvrelay_requests_total", t)
    errors = _series("kvrelay_requests_total", t, 'status=~"5..|429"')
    return [
        rule(
            "KVRelayTTFTHigh", f"{quantile('kvrelay_ttft_seconds')} > {t.ttft_p95_s:g}",
            f"TTFT p95 of {{{{ $labels.model }}}} is {{{{ $value | humanizeDuration }}}} (SLO {t.ttft_p95_s:g}s)",
            t.ttft_p95_s,
        ),
        rule(
            "KVRelayStreamTokensPerSecondLow", f"1 / {quantile('kvrelay_tpot_seconds')} < {t.min_stream_tokens_per_s:g}",
            f"The slowest 5% of {{{{ $labels.model }}}} streams get {{{{ $value | printf \"%.1f\" }}}} tokens/s (SLO {t.min_stream_tokens_per_s:g})",
            t.min_stream_tokens_per_s,
        ),
        rule(
            "KVRelayErrorRateHigh",
            f"sum by (model) (rate({errors}[{w}])) / sum by (model) (rate({requests}[{w}])) > {t.max_error_ratio:g}",
            f"{{{{ $value | humanizePercentage }}}} of {{{{ $labels.model }}}} requests fail with 5xx or 429 (SLO {t.max_error_ratio:g})",
            t.max_error_ratio, severity="critical",
        ),
        rule(
            "KVRelayKVCacheFull", f"max by (model, pool) ({_series('kvrelay_kv_cache_usage_ratio', t)}) > {t.max_kv_cache_usage:g}",
            f"A {{{{ $labels.pool }}}} replica's KV cache is {{{{ $value | humanizePercentage }}}} full (SLO {t.max_kv_cache_usage:g})",
            t.max_kv_cache_usage,
        ),
        rule(
            "KVRelayQueueDeep", f"avg by (model, pool) ({_series('kvrelay_num_requests_waiting', t)}) > {t.max_queue_depth:g}",
            f"{{{{ $labels.pool }}}} replicas have {{{{ $value | printf \"%.1f\" }}}} waiting sequences each (SLO {t.max_queue_depth:g})",
            t.max_queue_depth,
        ),
    ]


def render(t: Thresholds = Thresholds()) -> str:
    params = ", ".join(f"{k.rstrip('_')}={v!r}" for k, v in asdict(t).items())
    header = (
        "# kvrelay SLO alerts. Generated by deploy/prometheus/render_alerts.py; do not edit,\n"
        "# re-render with your thresholds instead (see its --help).\n"
        f"# Parameters: {params}\n"
    )
    body = {"groups": [{"name": "kvrelay-slo", "rules": rules(t)}]}
    return header + yaml.safe_dump(body, sort_keys=False, width=200)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = Thresholds()
    for f in fields(Thresholds):
        flag = "--" + f.name.rstrip("_").replace("_", "-")
        parser.add_argument(flag, dest=f.name, type=type(getattr(defaults, f.name)), default=getattr(defaults, f.name),
                            help=f"default: {getattr(defaults, f.name)!r}")
    parser.add_argument("-o", "--output", help="write here instead of stdout")
    args = vars(parser.parse_args(argv))
    output = args.pop("output")
    try:
        text = render(Thresholds(**args))
    except ValueError as exc:
        parser.error(str(exc))
    if output:
        with open(output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
