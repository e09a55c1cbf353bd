"""The PNG report of `kvrelay bench serve` (matplotlib, Agg backend: no display needed).

    +---------------------------+---------------------------+
    | latency CDFs (ms, log x): | TTFT over time            |
    | TTFT, TPOT, ITL, E2E;     | (send time -> TTFT, one   |
    | the highest rate's run    |  colour per rate)         |
    +---------------------------+---------------------------+
    | TPOT over time            | throughput against rate:  |
    |                           | output tokens/s, and      |
    |                           | requests/s and goodput/s  |
    +---------------------------+---------------------------+

An infinite rate is drawn at the achieved request throughput on the rate axis.
"""

from __future__ import annotations

import logging
import math

__all__ = ["write_png"]

logger = logging.getLogger(__name__)


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    ordered = sorted(values)
    n = len(ordered)
    return ordered, [(i + 1) / n for i in range(n)]


def write_png(path: str, runs: list, *, title: str = "") -> str | None:
    """Draw the four panels of `runs` (bench_serve.RateRun) into `path`; None (and a log line)
    when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no PNG report (pip install matplotlib)")
        return None

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    (ax_cdf, ax_ttft), (ax_tpot, ax_tput) = axes

    def label(run) -> str:
        return "rate inf" if math.isinf(run.request_rate) else f"rate {run.request_rate:g}/s"

    last = runs[-1]
    ok = [r for r in last.records if r.is_success]
    series = {
        "TTFT": [r.ttft_s * 1e3 for r in ok],
        "TPOT": [r.tpot_s * 1e3 for r in ok if r.tpot_s is not None],
        "ITL": [gap * 1e3 for r in ok for gap in r.itl_s],
        "E2E": [r.e2e_s * 1e3 for r in ok],
    }
    for name, values in series.items():
        if values:
            xs, ys = _cdf([max(v, 1e-3) for v in values])
            ax_cdf.step(xs, ys, where="post", label=name)
    ax_cdf.set(xscale="log", xlabel="ms", ylabel="fraction of requests (ITL: of gaps)",
               title=f"latency CDFs ({label(last)})")
    ax_cdf.grid(True, which="both", alpha=0.3)
    ax_cdf.legend()

    for run in runs:
        ok = [r for r in run.records if r.is_success]
        ax_ttft.plot([r.sent_s for r in ok], [r.ttft_s * 1e3 for r in ok], ".", label=label(run), alpha=0.7)
        with_tpot = [r for r in ok if r.tpot_s is not None]
        ax_tpot.plot([r.sent_s for r in with_tpot], [r.tpot_s * 1e3 for r in with_tpot], ".", label=label(run), alpha=0.7)
    ax_ttft.set(xlabel="send time, s", ylabel="TTFT, ms", title="TTFT over time")
    ax_tpot.set(xlabel="send time, s", ylabel="TPOT, ms", title="TPOT over time")
    for ax in (ax_ttft, ax_tpot):
        ax.grid(True, alpha=0.3)
        ax.legend()

    rates = [(run.summary["request_throughput"] or 0.0) if math.isinf(run.request_rate) else run.request_rate
             for run in runs]
    order = sorted(range(len(runs)), key=lambda i: rates[i])
    xs = [rates[i] for i in order]
    ax_tput.plot(xs, [runs[i].summary["output_throughput"] or 0.0 for i in order], "o-", color="C0",
                 label="output tokens/s")
    ax_tput.set(xlabel="request rate, /s (inf: achieved)", ylabel="output tokens/s", title="throughput against rate")
    ax_req = ax_tput.twinx()
    ax_req.plot(xs, [runs[i].summary["request_throughput"] or 0.0 for i in order], "s--", color="C1", label="requests/s")
    if runs[0].summary["slo"]:
        ax_req.plot(xs, [runs[i].summary["goodput"] or 0.0 for i in order], "^:", color="C2", label="goodput/s")
    ax_req.set_ylabel("requests/s")
    handles = ax_tput.get_legend_handles_labels()[0] + ax_req.get_legend_handles_labels()[0]
    ax_tput.legend(handles, [h.get_label() for h in handles], loc="upper left")
    ax_tput.grid(True, alpha=0.3)

    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
