"""The PNG of `kvrelay bench scenario` (matplotlib, Agg backend).

    pd-interference  left: chat TPOT over time (by send time) in the burst runs, one colour per
                     mode, grey bands where long prompts arrive; right: chat TPOT p99 steady
                     against burst, per mode
    prefix-routing   left: TTFT CDF per policy; right: TTFT p50 / p95 and prefix hit rate
    peers            left: TTFT CDF per system; right: output tokens/s per system
"""

from __future__ import annotations

import logging

__all__ = ["write_png"]

logger = logging.getLogger(__name__)


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    ordered = sorted(values)
    return ordered, [(i + 1) / len(ordered) for i in range(len(ordered))]


def write_png(path: str, scenario: str, runs: dict, summary: dict) -> str | None:
    """Draw the scenario's figure; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no PNG report (pip install matplotlib)")
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5))
    if scenario == "pd-interference":
        for mode, colour in (("disaggregated", "tab:blue"), ("colocated", "tab:red")):
            run = runs[f"{mode}/burst"]
            chat = [r for r in run.records if r.is_success and r.kind != "long" and r.tpot_s is not None]
            left.scatter([r.sent_s for r in chat], [r.tpot_s * 1e3 for r in chat], s=12, color=colour, label=mode)
        for r in runs["disaggregated/burst"].records:
            if r.kind == "long":  # arrival to its first token (prefill) on the prefill replica
                left.axvspan(r.scheduled_s, r.scheduled_s + (r.ttft_s or 0.5), color="0.85", zorder=0)
        left.set(xlabel="request sent, s from start", ylabel="chat TPOT, ms", yscale="log",
                 title="chat TPOT during the burst runs (grey: a long prompt's prefill, disaggregated)")
        left.legend()
        modes = ("disaggregated", "colocated")
        steady = [summary["modes"][m]["chat_tpot_ms_steady"]["p99"] or 0 for m in modes]
        burst = [summary["modes"][m]["chat_tpot_ms_burst"]["p99"] or 0 for m in modes]
        xs = range(len(modes))
        right.bar([x - 0.2 for x in xs], steady, width=0.4, label="steady")
        right.bar([x + 0.2 for x in xs], burst, width=0.4, label="with bursts")
        right.set_xticks(list(xs), modes)
        right.set(ylabel="chat TPOT p99, ms", title="TPOT p99: steady vs with bursts")
        right.legend()
    else:
        key = "policies" if scenario == "prefix-routing" else "systems"
        for label, run in runs.items():
            ttfts = [r.ttft_s * 1e3 for r in run.records if r.is_success]
            if ttfts:
                left.plot(*_cdf(ttfts), label=label)
        left.set(xlabel="TTFT, ms", ylabel="fraction of requests", xscale="log", title="TTFT CDF")
        left.legend()
        labels = [k for k, v in summary[key].items() if "ttft_ms" in v]
        if scenario == "prefix-routing":
            p50 = [summary[key][k]["ttft_ms"]["p50"] for k in labels]
            p95 = [summary[key][k]["ttft_ms"]["p95"] for k in labels]
            xs = range(len(labels))
            right.bar([x - 0.2 for x in xs], p50, width=0.4, label="TTFT p50")
            right.bar([x + 0.2 for x in xs], p95, width=0.4, label="TTFT p95")
            right.set_xticks(list(xs), [f"{k}\nhit rate {summary[key][k]['prefix_hit_rate'] or 0:.2f}" for k in labels])
            right.set(ylabel="ms", title="TTFT by policy")
            right.legend()
        else:
            right.bar(range(len(labels)), [summary[key][k]["output_throughput"] for k in labels], color="tab:green")
            right.set_xticks(list(range(len(labels))), labels, rotation=20, ha="right")
            right.set(ylabel="output tokens/s", title="output throughput at equal load")
    fig.suptitle(f"kvrelay bench scenario {scenario}" + (" (smoke)" if summary.get("smoke") else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
