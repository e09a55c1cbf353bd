"""`kvrelay status`: pools, replicas and their states (from the dashboard), plus queue depth, KV
usage and TTFT/TPOT p50/p95 per pool, the routers' prefix predictions against the hits the engines
found, the TTFT split into its components (and the decode start after a KV hand-off), KV hand-offs
imported and recomputed, speculative decoding per pool and proposer (acceptance rate, tokens per
step), and recoveries (from the ingress's /metrics, Prometheus text: its
histograms and counters since the ingress started).
"""

from __future__ import annotations

import math
import re

import httpx

from cluster.dashboard import pool_deployments

__all__ = ["fetch_metrics", "histogram_quantile", "parse_metrics", "status_report"]

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match:
            labels = dict(_LABEL.findall(match.group(3) or ""))
            samples.append((match.group(1), labels, float(match.group(4))))
    return samples


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) buckets."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] == 0:
        return None
    rank = q * buckets[-1][1]
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def _sum_by(samples, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric, labels, value in samples:
        if metric == name:
            key = labels.get(label, "")
            out[key] = out.get(key, 0.0) + value
    return out


def _quantiles(samples, name: str, label: str | None = None) -> dict[str, tuple[float | None, float | None]]:
    groups: dict[str, dict[float, float]] = {}
    for metric, labels, value in samples:
        if metric == f"{name}_bucket":
            key = labels.get(label, "") if label else ""
            bound = float(labels.get("le", "inf").replace("+Inf", "inf"))
            groups.setdefault(key, {})
            groups[key][bound] = groups[key].get(bound, 0.0) + value
    return {
        key: (histogram_quantile(0.5, list(b.items())), histogram_quantile(0.95, list(b.items())))
        for key, b in groups.items()
    }


def status_report(state: dict, app_name: str, metrics_text: str | None) -> str:
    info = pool_deployments(state, app_name)
    lines = [f"application {app_name}: {info['app_status']}", ""]
    samples = parse_metrics(metrics_text) if metrics_text else []
    running = _sum_by(samples, "kvrelay_num_requests_running", "pool")
    waiting = _sum_by(samples, "kvrelay_num_requests_waiting", "pool")
    kv = _sum_by(samples, "kvrelay_kv_cache_usage_ratio", "pool")
    kv_count = {
        pool: sum(1 for metric, labels, _ in samples if metric == "kvrelay_kv_cache_usage_ratio" and labels.get("pool") == pool)
        for pool in kv
    }
    header = f"{'pool':<8} {'deployment':<14} {'status':<10} {'replicas':<22} {'running':>7} {'waiting':>7} {'kv use':>7}"
    lines.append(header)
    for pool, p in info["pools"].items():
        replicas = ", ".join(f"{n} {s.lower()}" for s, n in sorted(p["replicas"].items())) or "none"
        if p["autoscaling"]:
            replicas += f" [{p['autoscaling'][0]}..{p['autoscaling'][1]}]"
        kv_use = f"{kv[pool] / kv_count[pool]:.0%}" if pool in kv and kv_count.get(pool) else "-"
        lines.append(
            f"{pool:<8} {p['deployment']:<14} {str(p['status']):<10} {replicas:<22} "
            f"{_fmt(running.get(pool)):>7} {_fmt(waiting.get(pool)):>7} {kv_use:>7}"
        )
    if samples:
        lines.append("")
        for label, name in (("TTFT", "kvrelay_ttft_seconds"), ("TPOT", "kvrelay_tpot_seconds"), ("E2E", "kvrelay_e2e_request_latency_seconds")):
            q = _quantiles(samples, name).get("")
            if q and q[0] is not None:
                lines.append(f"{label:<5} p50 {q[0] * 1000:8.1f} ms   p95 {q[1] * 1000:8.1f} ms")
    else:
        lines += ["", "(no metrics: the ingress's /metrics was not reachable; pass --url)"]
    lines += _prefix_lines(samples)
    lines += _split_lines(samples, "TTFT split", "kvrelay_ttft_split_seconds", ("queue", "prefill", "handoff", "delivery"))
    lines += _split_lines(samples, "decode start", "kvrelay_decode_start_seconds", ("kv_transfer", "first_decode_step", "delivery"))
    lines += _speculation_lines(samples)
    handoff = _handoff_line(samples)
    if handoff:
        lines += ["", handoff]
    kernels: dict[tuple[str, str, str], int] = {}
    for metric, labels, value in samples:
        if metric == "kvrelay_engine_kernel_info" and value == 1:
            key = (labels.get("pool", ""), labels.get("kernel_path", ""), labels.get("reason", ""))
            kernels[key] = kernels.get(key, 0) + 1
    if kernels:
        lines.append("")
        for (pool, path, reason), count in sorted(kernels.items()):
            lines.append(f"kernels  {pool:<8} {path} x{count} ({reason})")
    return "\n".join(lines)


def _prefix_lines(samples) -> list[str]:
    """Per pool: requests whose router's prefix prediction was checked, the hit rate the routers
    predicted and the one the engines found (of their prompt tokens), and the mispredicted ones
    by reason (serving/observability/request_path.py)."""
    tokens: dict[tuple[str, str], float] = {}
    checked: dict[str, float] = {}
    reasons: dict[str, dict[str, float]] = {}
    for metric, labels, value in samples:
        pool = labels.get("pool", "")
        if metric == "kvrelay_prefix_tokens_total":
            key = (pool, labels.get("kind", ""))
            tokens[key] = tokens.get(key, 0.0) + value
        elif metric == "kvrelay_prefix_predictions_total":
            checked[pool] = checked.get(pool, 0.0) + value
            if labels.get("outcome") != "exact" and value:
                by_reason = reasons.setdefault(pool, {})
                reason = labels.get("reason", "")
                by_reason[reason] = by_reason.get(reason, 0.0) + value
    pools = sorted(pool for pool, n in checked.items() if n)
    if not pools:
        return []
    lines = ["", f"{'prefix hits':<12} {'requests':>8} {'predicted':>9} {'cached':>7}  mispredicted"]
    for pool in pools:
        prompt = tokens.get((pool, "prompt"), 0.0)
        predicted, cached = (tokens.get((pool, kind), 0.0) / prompt if prompt else 0.0 for kind in ("predicted", "cached"))
        wrong = reasons.get(pool, {})
        line = f"  {pool:<10} {checked[pool]:>8g} {predicted:>9.1%} {cached:>7.1%}  {sum(wrong.values()):g} ({sum(wrong.values()) / checked[pool]:.1%})"
        if wrong:
            line += ": " + ", ".join(f"{reason} {n:g}" for reason, n in sorted(wrong.items(), key=lambda item: (-item[1], item[0])))
        lines.append(line)
    return lines


def _split_lines(samples, title: str, name: str, components: tuple[str, ...]) -> list[str]:
    """p50 / p95 of each component of a split histogram (every pool together)."""
    quantiles = _quantiles(samples, name, "component")
    shown = [c for c in components if c in quantiles and quantiles[c][0] is not None]
    if not shown:
        return []
    lines = ["", f"{title:<19} {'p50 ms':>8} {'p95 ms':>8}"]
    for component in shown:
        p50, p95 = quantiles[component]
        lines.append(f"  {component:<17} {p50 * 1000:>8.1f} {p95 * 1000:>8.1f}")
    return lines


def _speculation_lines(samples) -> list[str]:
    """Per pool and proposer, speculative decoding since the replicas started (their counters
    summed, so the rates are the pool's, not a mean of the replicas'): proposed and accepted
    tokens, the acceptance rate, and the tokens a verifying sequence-step kept, (accepted +
    steps) / steps (1 + the accepted proposals; a step without proposals keeps 1)."""
    counts: dict[tuple[str, str], dict[str, float]] = {}
    kinds = {"kvrelay_spec_decode_proposed_tokens_total": "proposed", "kvrelay_spec_decode_accepted_tokens_total": "accepted",
             "kvrelay_spec_decode_verify_steps_total": "steps"}
    for metric, labels, value in samples:
        if metric in kinds:
            by_kind = counts.setdefault((labels.get("pool", ""), labels.get("proposer", "")), {})
            by_kind[kinds[metric]] = by_kind.get(kinds[metric], 0.0) + value
    if not counts:
        return []
    lines = ["", f"{'speculative':<12} {'proposer':<10} {'proposed':>9} {'accepted':>9} {'rate':>6} {'tok/step':>8}"]
    for (pool, proposer), c in sorted(counts.items()):
        proposed, accepted, steps = c.get("proposed", 0.0), c.get("accepted", 0.0), c.get("steps", 0.0)
        rate = f"{accepted / proposed:.1%}" if proposed else "-"
        per_step = f"{(accepted + steps) / steps:.2f}" if steps else "-"
        lines.append(f"  {pool:<10} {proposer:<10} {proposed:>9g} {accepted:>9g} {rate:>6} {per_step:>8}")
    return lines


def _handoff_line(samples) -> str | None:
    """KV hand-offs imported and recomputed (by reason), and requests that survived a replica's
    death: what to look at when the KVTransfer actor or a replica died."""
    transfers = "kvrelay_kv_transfer_seconds"  # a histogram of the successful imports
    imported = sum(v for m, _, v in samples if m == f"{transfers}_count")
    fallbacks = _sum_by(samples, "kvrelay_kv_transfer_fallbacks_total", "reason")
    recovered = _sum_by(samples, "kvrelay_recoveries_total", "kind")
    if not imported and not fallbacks and not recovered:
        return None
    line = f"KV hand-off  {imported:g} imported, {sum(fallbacks.values()):g} recomputed"
    if fallbacks:
        line += " (" + ", ".join(f"{reason} {n:g}" for reason, n in sorted(fallbacks.items())) + ")"
    if recovered:
        line += "; recovered " + ", ".join(f"{kind} {n:g}" for kind, n in sorted(recovered.items()))
    return line


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def fetch_metrics(api_url: str, *, timeout_s: float = 10.0) -> str | None:
    try:
        response = httpx.get(api_url.rstrip("/") + "/metrics", timeout=timeout_s)
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None
