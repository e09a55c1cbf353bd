"""Tables and the PNG of `kvrelay bench pd-sim` (matplotlib, Agg backend, when installed).

    validation   each figure of the measured pd-interference run beside the simulated one,
                 with the relative error and whether it is within the 15% the issue asks
    sweep        per cost fit and SLO: goodput per replica, colocated / disaggregated (best
                 prefill:decode split) and their ratio, for every mix and pool size
    crossovers   per cost fit, mix and SLO: the smallest pool where disaggregated goodput per
                 replica is at least colocated's
    PNG          one panel per (fit, SLO): disaggregated / colocated goodput per replica against
                 the pool size, one line per mix, the break-even line at 1
"""

from __future__ import annotations

import logging

__all__ = ["format_crossovers", "format_sweep", "format_validation", "write_png"]

logger = logging.getLogger(__name__)


def _f(value, spec: str = ".3g") -> str:
    return "-" if value is None else f"{value:{spec}}"


def format_validation(rows: list[dict]) -> str:
    """The rows of pd_validate.compare, or of compare_median (then with the measured spread)."""
    spread = any("spread" in row for row in rows)
    lines = [f"{'metric':<32}{'mode':<15}{'measured':>11}{'simulated':>11}{'error':>9}  within 15%"
             + ("  measured spread" if spread else "")]
    for row in rows:
        error = "-" if row["error"] is None else f"{row['error']:+.1%}"
        within = {True: "yes", False: "NO", None: "-"}[row["within"]]
        lines.append(f"{row['metric']:<32}{row['mode'] or '':<15}{_f(row['measured'], '.4g'):>11}"
                     f"{_f(row['simulated'], '.4g'):>11}{error:>9}  {within:<10}"
                     + (f"  {_f(row.get('spread'), '.0%')}" if spread else ""))
    return "\n".join(line.rstrip() for line in lines)


def format_split(rows: list[dict]) -> str:
    """The rows of pd_validate.split_rows: the mean TTFT's parts, measured at the ingress and replayed, ms."""
    lines = [f"{'mode/run':<24}{'':<10}{'TTFT':>8}{'overhead':>10}{'queue':>8}{'prefill':>9}{'handoff':>9}{'delivery':>10}"]
    for row in rows:
        m, s = row["measured"], row["simulated"]
        lines.append(f"{row['mode'] + '/' + row['run']:<24}{'measured':<10}{_f(m['ttft'], '.1f'):>8}{'':>10}"
                     f"{_f(m.get('queue'), '.1f'):>8}{_f(m.get('prefill'), '.1f'):>9}{_f(m.get('handoff'), '.1f'):>9}"
                     f"{_f(m.get('delivery'), '.1f'):>10}")
        lines.append(f"{'':<24}{'simulated':<10}{_f(s['ttft'], '.1f'):>8}{_f(s['overhead'], '.1f'):>10}"
                     f"{_f(s['queue'], '.1f'):>8}{_f(s['prefill'], '.1f'):>9}")
    return "\n".join(lines)


def format_sweep(cells: list[dict]) -> str:
    lines = []
    for fit, slo in sorted({(c["fit"], c["slo"]) for c in cells}):
        chosen = [c for c in cells if c["fit"] == fit and c["slo"] == slo]
        bounds = sorted({(c["mix"], round(c["ttft_ms"], 1), round(c["tpot_ms"], 1)) for c in chosen})
        lines.append(f"{fit} fit, {slo} SLO (" + "; ".join(f"{m}: TTFT {t:g} ms, TPOT {p:g} ms" for m, t, p in bounds) + ")")
        sizes = sorted({c["num_replicas"] for c in chosen})
        lines.append(f"  {'mix':<13}" + "".join(f"{'N=' + str(n):>17}" for n in sizes))
        for mix in dict.fromkeys(c["mix"] for c in chosen):
            row = {c["num_replicas"]: c for c in chosen if c["mix"] == mix}
            lines.append(f"  {mix:<13}" + "".join(
                f"{_f(row[n]['colocated_per_replica'], '.2f') + '/' + _f(row[n]['disaggregated_per_replica'], '.2f'):>17}"
                if n in row else f"{'':>17}" for n in sizes))
        lines.append("  (goodput per replica, req/s: colocated/disaggregated)")
    return "\n".join(lines)


def format_crossovers(crossovers: list[dict]) -> str:
    lines = [f"{'fit':<5}{'mix':<13}{'SLO':<7}{'crossover':>10}  disaggregated / colocated by pool size"]
    for c in crossovers:
        first = "none" if c["crossover_replicas"] is None else f"N={c['crossover_replicas']}" + ("" if c["holds_above"] else "*")
        ratios = ", ".join(f"{n}: {_f(r, '.2f')}" for n, r in c["ratio_by_size"].items())
        lines.append(f"{c['fit']:<5}{c['mix']:<13}{c['slo']:<7}{first:>10}  {ratios}")
    lines.append("* not at every larger size")
    return "\n".join(lines)


def write_png(path: str, cells: list[dict]) -> str | None:
    """The crossover figure; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no PNG report")
        return None
    panels = sorted({(c["fit"], c["slo"]) for c in cells})
    fits = sorted({fit for fit, _ in panels})
    slos = sorted({slo for _, slo in panels}, reverse=True)  # tight, loose
    fig, axes = plt.subplots(len(fits), len(slos), figsize=(6 * len(slos), 4.2 * len(fits)), squeeze=False)
    for i, fit in enumerate(fits):
        for j, slo in enumerate(slos):
            ax = axes[i][j]
            chosen = [c for c in cells if c["fit"] == fit and c["slo"] == slo]
            for mix in dict.fromkeys(c["mix"] for c in chosen):
                row = sorted((c for c in chosen if c["mix"] == mix), key=lambda c: c["num_replicas"])
                points = [(c["num_replicas"], c["ratio"]) for c in row if c["ratio"] is not None]
                if points:
                    ax.plot(*zip(*points), marker="o", label=mix)
            ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("replicas in the pool")
            ax.set_ylabel("disaggregated / colocated goodput per replica")
            ax.set_title(f"{fit} fit, {slo} SLO")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
