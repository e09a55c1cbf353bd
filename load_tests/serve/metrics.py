"""The figures of `kvrelay bench serve` from its request records (pure arithmetic).

    latency     TTFT, TPOT, ITL, E2E in ms: mean, p50, p90, p95, p99 over the successful requests
                (ITL over every gap of every request); percentiles interpolate linearly between
                the two nearest ranks, as numpy's default does
    throughput  completed requests / duration, output tokens / duration, (prompt + output
                tokens) / duration; duration = the run's first send to its last completion
    goodput     successful requests meeting every given SLO bound / duration; a one-token answer
                has no TPOT and passes a TPOT bound
SLO bounds: `ttft_ms=...,tpot_ms=...,e2e_ms=...` (any subset; `parse_slo`).
"""

from __future__ import annotations

import math

from load_tests.serve.client import RequestRecord

__all__ = ["PERCENTILES", "SLO_KEYS", "meets_slo", "parse_slo", "percentile", "stats_ms", "summarize_records"]

PERCENTILES = (50, 90, 95, 99)
SLO_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's 'linear' method)."""
    assert values, "percentile of no values"
    assert 0 <= q <= 100, q
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def stats_ms(values_s: list[float]) -> dict[str, float | None]:
    """mean and percentiles in milliseconds; None for every figure when there are no values."""
    keys = ["mean", *(f"p{q}" for q in PERCENTILES)]
    if not values_s:
        return dict.fromkeys(keys)
    values_ms = [v * 1e3 for v in values_s]
    out = {"mean": sum(values_ms) / len(values_ms)}
    out.update({f"p{q}": percentile(values_ms, q) for q in PERCENTILES})
    return out


def parse_slo(text: str | None) -> dict[str, float]:
    """"ttft_ms=200,tpot_ms=50" -> {"ttft_ms": 200.0, "tpot_ms": 50.0}; ValueError names the fix."""
    if not text:
        return {}
    slo = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--slo: {item!r} is not KEY=MS with KEY one of {', '.join(SLO_KEYS)}")
        try:
            slo[key] = float(value)
        except ValueError:
            raise ValueError(f"--slo: {key} wants milliseconds, got {value!r}") from None
        if slo[key] <= 0:
            raise ValueError(f"--slo: {key} must be > 0, got {value}")
    return slo


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    if not record.is_success:
        return False
    values_s = {"ttft_ms": record.ttft_s, "tpot_ms": record.tpot_s, "e2e_ms": record.e2e_s}
    for key, bound_ms in slo.items():
        value_s = values_s[key]
        if value_s is not None and value_s * 1e3 > bound_ms:
            return False
    return True


def summarize_records(records: list[RequestRecord], duration_s: float, slo: dict[str, float] | None = None) -> dict:
    """Every headline figure of one run (one request rate)."""
    slo = slo or {}
    ok = [r for r in records if r.is_success]
    num_output = sum(r.num_output_tokens for r in ok)
    num_prompt = sum(r.num_prompt_tokens or 0 for r in ok)
    num_good = sum(meets_slo(r, slo) for r in ok)
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: None)
    return {
        "num_requests": len(records),
        "num_completed": len(ok),
        "num_failed": len(records) - len(ok),
        "duration_s": duration_s,
        "num_output_tokens": num_output,
        "num_prompt_tokens": num_prompt,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(num_output),
        "total_token_throughput": per_s(num_output + num_prompt),
        "slo": slo,
        "num_slo_met": num_good,
        "goodput": per_s(num_good),
        "ttft_ms": stats_ms([r.ttft_s for r in ok]),
        "tpot_ms": stats_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": stats_ms([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": stats_ms([r.e2e_s for r in ok]),
        "token_count_sources": sorted({r.token_count_source for r in ok}),
    }
