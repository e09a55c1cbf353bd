"""The simulator checked against reality: the four runs of a measured `kvrelay bench scenario
pd-interference` JSON replayed through pd_sim with a cost fit of the same machine.

Each run's requests are replayed exactly (pd_workload.scenario_requests: the client's scheduled
send times, the prompt and output tokens the server reported) through the scenario's layout:
disaggregated = 1 prefill + 1 decode replica, colocated = 2 workers (a core each). The simulated
runs are summarised with the scenario's own definitions (load_tests/scenario/bench.py
summarize_pd): chat requests' TTFT and TPOT percentiles with and without bursts, the long
prompts' TTFT, goodput of the burst run at the scenario's SLO, and its ratios.

`compare` puts each simulated figure beside the measured one with the relative error
(sim / measured - 1); `TOLERANCE` is the issue's 15%.

One measured run is one sample of a noisy machine: two runs of the scenario can differ by more
than 15% on half the figures (a tail percentile rests on 2-6 requests; a run whose machine is
slower for a while crosses into a regime where the long prompts overlap). `compare_median`
takes several measured runs (each replayed through the simulator on its own requests) and
judges the simulator on each figure's median over them, with the measured spread beside it:
(max - min) / median of the measured runs, the machine's own run-to-run variation, so that an
error can be read against what the machine reproduces of itself.

`split_rows` sets the mean TTFT's parts beside each other, for information (not judged): the
ingress's measured split (queue, prefill, handoff, delivery: serving/observability/request_path.py),
which a scenario run records since 2026-12-02, and the replay's (the request overhead, the
replica's queue, the prefill: pd_sim.ttft_split_ms). The prefill part is the step model's alone
on both sides; the rest says where a served request's first token spends what the model does not
carry.
"""

from __future__ import annotations

import statistics

from load_tests.pd.costs import CostFit
from load_tests.pd.sim import simulate, summarize
from load_tests.pd.workload import scenario_requests

__all__ = ["METRICS", "TOLERANCE", "compare", "compare_median", "simulate_scenario", "split_rows"]

TOLERANCE = 0.15
CHAT_KINDS = {"chat", "random"}  # as bench_scenario: the burst run's short requests, the steady run's
LAYOUT = {"disaggregated": (1, 1), "colocated": (0, 2)}  # (prefill, decode or worker) replicas

# (label, key in summary["modes"][mode] or in summary, the statistic; None: a number)
METRICS = [
    ("chat TTFT p50 steady, ms", "chat_ttft_ms_steady", "p50"),
    ("chat TTFT p95 steady, ms", "chat_ttft_ms_steady", "p95"),
    ("chat TTFT p50 burst, ms", "chat_ttft_ms_burst", "p50"),
    ("chat TTFT p95 burst, ms", "chat_ttft_ms_burst", "p95"),
    ("chat TPOT p50 steady, ms", "chat_tpot_ms_steady", "p50"),
    ("chat TPOT p99 steady, ms", "chat_tpot_ms_steady", "p99"),
    ("chat TPOT p50 burst, ms", "chat_tpot_ms_burst", "p50"),
    ("chat TPOT p99 burst, ms", "chat_tpot_ms_burst", "p99"),
    ("long TTFT p50 burst, ms", "long_ttft_ms_burst", "p50"),
    ("goodput burst, req/s", "goodput_burst", None),
]
RATIOS = ["tpot_p99_burst_ratio_disagg", "tpot_p99_burst_ratio_coloc", "goodput_ratio_disagg_vs_coloc"]


def simulate_scenario(report: dict, fit: CostFit) -> dict:
    """The scenario's summary (summarize_pd's keys) from its runs replayed through the simulator,
    each with the CPU other processes took from the machine meanwhile where the report has it
    (config.servers.foreign_cpu, as the scenario records it, or foreign_cpu, as
    load_tests/scenario/foreign_cpu.py annotates an earlier run: ["cores"][label])."""
    foreign = (report.get("foreign_cpu") or report.get("config", {}).get("servers", {}).get("foreign_cpu") or {}).get("cores", {})
    slo = report["summary"]["slo"]
    slos = {"scenario": (slo["ttft_ms"], slo["tpot_ms"])}
    out: dict = {"slo": slo, "modes": {}}
    for mode, (num_prefill, num_decode) in LAYOUT.items():
        figures = {}
        for run in ("steady", "burst"):
            sim = simulate(scenario_requests(report, f"{mode}/{run}"), fit, mode, num_prefill=num_prefill, num_decode=num_decode,
                           foreign_cpu=foreign.get(f"{mode}/{run}", 0.0))
            chat = summarize(sim, slos, kinds=CHAT_KINDS)
            figures[f"chat_ttft_ms_{run}"] = chat["ttft_ms"]
            figures[f"chat_tpot_ms_{run}"] = chat["tpot_ms"]
            everything = summarize(sim, slos)
            figures[f"goodput_{run}"] = everything["goodput"]["scenario"]
            figures[f"num_slo_met_{run}"] = round(everything["goodput"]["scenario"] * everything["span_s"])
            figures[f"utilisation_{run}"] = everything["utilisation"]
            figures[f"ttft_split_ms_{run}"] = {**everything["ttft_split_ms"], "ttft": everything["ttft_ms"]["mean"]}
            if run == "burst":
                figures["long_ttft_ms_burst"] = summarize(sim, slos, kinds={"long"})["ttft_ms"]
                figures["num_requests_burst"] = everything["num_requests"]
        out["modes"][mode] = figures
    d, c = out["modes"]["disaggregated"], out["modes"]["colocated"]
    out["tpot_p99_burst_ratio_disagg"] = _ratio(d["chat_tpot_ms_burst"]["p99"], d["chat_tpot_ms_steady"]["p99"])
    out["tpot_p99_burst_ratio_coloc"] = _ratio(c["chat_tpot_ms_burst"]["p99"], c["chat_tpot_ms_steady"]["p99"])
    out["goodput_ratio_disagg_vs_coloc"] = _ratio(d["goodput_burst"], c["goodput_burst"])
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _get(summary: dict, mode: str | None, key: str, stat: str | None):
    value = summary["modes"][mode][key] if mode else summary[key]
    return value[stat] if stat else value


def compare(measured: dict, simulated: dict, *, metrics: list = METRICS, ratios: list = RATIOS) -> list[dict]:
    """[{metric, mode, measured, simulated, error, within}], error = simulated / measured - 1."""
    rows = []
    for mode in LAYOUT:
        for label, key, stat in metrics:
            rows.append(_row(label, mode, _get(measured, mode, key, stat), _get(simulated, mode, key, stat)))
    for key in ratios:
        rows.append(_row(key, None, measured.get(key), simulated.get(key)))
    return rows


def _row(label: str, mode: str | None, measured: float | None, simulated: float | None) -> dict:
    error = None if measured in (None, 0) or simulated is None else simulated / measured - 1
    return {"metric": label, "mode": mode, "measured": measured, "simulated": simulated, "error": error,
            "within": None if error is None else abs(error) <= TOLERANCE}


def compare_median(measured: list[dict], simulated: list[dict], *, metrics: list = METRICS, ratios: list = RATIOS) -> list[dict]:
    """Each figure's median over the measured runs beside the median of their replays:
    [{metric, mode, measured, simulated, error, within, measured_values, simulated_values,
    spread}], spread = (max - min) / median of the measured values (None with fewer than 2)."""
    assert measured and len(measured) == len(simulated), (len(measured), len(simulated))
    per_run = [compare(m, s, metrics=metrics, ratios=ratios) for m, s in zip(measured, simulated)]
    rows = []
    for i, first in enumerate(per_run[0]):
        values = [rows_[i]["measured"] for rows_ in per_run if rows_[i]["measured"] is not None]
        sims = [rows_[i]["simulated"] for rows_ in per_run if rows_[i]["simulated"] is not None]
        median = statistics.median(values) if values else None
        row = _row(first["metric"], first["mode"], median, statistics.median(sims) if sims else None)
        row["measured_values"], row["simulated_values"] = values, sims
        row["spread"] = (max(values) - min(values)) / median if len(values) >= 2 and median else None
        rows.append(row)
    return rows


def split_rows(report: dict, simulated: dict) -> list[dict]:
    """[{mode, run, measured: {ttft (the client's mean), queue, prefill, handoff, delivery, requests},
    simulated: {ttft, overhead, queue, prefill}}] for the runs whose measured split the report has."""
    rows = []
    servers = report.get("config", {}).get("servers", {})
    for mode in LAYOUT:
        for run in ("steady", "burst"):
            split = servers.get(mode, {}).get(f"ttft_split_ms_{run}", {}).get("ttft_split")
            if not split:
                continue
            records = [r for r in report["raw"]["runs"][f"{mode}/{run}"]["records"] if r["is_success"]]
            client_ms = sum(r["ttft_s"] for r in records) / len(records) * 1e3 if records else None
            rows.append({"mode": mode, "run": run, "measured": {"ttft": client_ms, **split},
                         "simulated": simulated["modes"][mode][f"ttft_split_ms_{run}"]})
    return rows
