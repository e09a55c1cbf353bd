"""Where disaggregation pays: colocated against disaggregated over pool sizes and workload mixes,
at a tight and a loose SLO, for each cost fit; the goodput crossover.

Goodput of a layout, as DistServe measures it: the highest request rate at which at least
`attainment` (0.9) of the requests meet both the TTFT and the TPOT bound, per replica of the
pool. Found by bisection on the rate (`bisect_steps` halvings of a bracket whose top fails every
SLO), each step one simulation of the same requests (pd_workload.generate: only the rate
changes). A run lasts `run_e2e` lifetimes of a mean request (its prefill and its output decoded
at batch 32, unqueued), so queues have time to build, and is judged on the requests that arrive
after the first lifetime and before the last.

A disaggregated pool of N replicas is tried at several prefill:decode splits: all of them up to
4 replicas; from 8 up, a climb from the split that balances the work (the mean prompt's prefill
against its output decoded in the largest batch the KV allows) to the better neighbour (x1.25 or
/1.25) while goodput rises (`search_splits`). Its goodput is the best split's.

SLOs scale with the fit and the mix, so CPU and GPU are judged alike:

    TTFT bound = scale x the mix's mean chat prompt prefilled alone (chunked as the engine does)
    TPOT bound = scale x one decode step of one row at the mix's mean context
    tight: scale 2; loose: scale 5 (for the GPU fit's chat mix: 331 ms and 101 ms; DistServe's
    chatbot SLO for OPT-13B is 200 ms and 100 ms, simdistserve/README.md)

Routing in the sweep is pd_sim's least_loaded for both layouts (the replicas' state now, not
kvrelay's routers on 0.5 s stats): the comparison here is of the layouts, not of the routing
policies. Until issue 19 fixed it, kvrelay's least_kv counted nothing it sent between two stats
and sent a stats period's arrivals to one decode replica; the validation, at about one request
a second, routes as kvrelay does (pd_sim's "kvrelay").

The crossover of a (fit, mix, SLO): the smallest pool size at which disaggregated goodput per
replica is above colocated's, and whether it stays so at every larger size tried.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from load_tests.pd.costs import CostFit, chunk_pairs
from load_tests.pd.sim import attainment, simulate
from load_tests.pd.workload import MIXES, Mix, generate

__all__ = [
    "SweepParams", "QUICK", "FULL", "Cell", "capacity_estimate", "lifetime_estimate", "slos_for", "goodput", "first_split",
    "search_splits", "sweep", "crossovers",
]


@dataclass(frozen=True)
class SweepParams:
    mixes: tuple[str, ...] = tuple(MIXES)
    pool_sizes: tuple[int, ...] = (2, 4, 8, 16, 32, 64)
    slo_scales: tuple[tuple[str, float], ...] = (("tight", 2.0), ("loose", 5.0))
    attainment: float = 0.9
    run_e2e: float = 8.0  # a run lasts this many mean requests' lifetimes (lifetime_estimate)
    min_requests: int = 400  # ... and holds at least this many requests at the estimated capacity
    bisect_steps: int = 6  # the goodput's resolution: 1/64 of the search bracket
    router: str = "least_loaded"  # pd_sim.simulate's: the replicas' state now (module docstring)
    seed: int = 0


FULL = SweepParams()
QUICK = SweepParams(mixes=("chat", "chat-bursts"), pool_sizes=(2, 8), run_e2e=4.0, min_requests=40, bisect_steps=4)


def _chunked_prefill_s(fit: CostFit, num_tokens: int) -> float:
    """A prompt alone, chunked as the engine chunks it."""
    seconds, done = 0.0, 0
    while done < num_tokens:
        left = num_tokens - done
        n = min(left, fit.max_num_batched_tokens)
        if 0 < fit.long_prefill_token_threshold < left:
            n = min(n, fit.long_prefill_token_threshold)
        seconds += fit.step.step_s(n, int(done + n >= num_tokens), chunk_pairs(n, done), 0, done)
        done += n
    return seconds


def slos_for(fit: CostFit, mix: Mix, scales: tuple[tuple[str, float], ...]) -> dict[str, tuple[float, float]]:
    """{name: (ttft_ms, tpot_ms)} (module docstring)."""
    ttft_s = _chunked_prefill_s(fit, round(mix.prompt.mean))
    tpot_s = fit.step.decode_s(1, round(mix.prompt.mean + mix.output.mean / 2))
    return {name: (scale * ttft_s * 1e3, scale * tpot_s * 1e3) for name, scale in scales}


def _work_s(fit: CostFit, mix: Mix) -> tuple[float, float]:
    """(prefill, decode) seconds of one mean request on one replica, decoding in the largest batch
    its KV and max_num_seqs allow."""
    context = round(mix.mean_prompt() + mix.mean_output() / 2)
    batch = max(1, min(fit.max_num_seqs, int(fit.kv_capacity_tokens // (mix.mean_prompt() + mix.mean_output()))))
    return _chunked_prefill_s(fit, round(mix.mean_prompt())), mix.mean_output() * fit.step.decode_s(batch, context) / batch


def first_split(fit: CostFit, mix: Mix, num_replicas: int) -> int:
    """The prefill replicas that balance the work (_work_s), within 1..N-1: the split search's start."""
    prefill_s, decode_s = _work_s(fit, mix)
    return min(max(round(num_replicas * prefill_s / (prefill_s + decode_s)), 1), num_replicas - 1)


def search_splits(evaluate: Callable[[int], dict[str, float]], num_replicas: int, start: int,
                  slo_names: list[str]) -> dict[int, dict[str, float]]:
    """{prefill replicas: goodput by SLO} of the splits tried: every split up to 4 replicas; from 8
    up, for each SLO a climb from `start` to the better neighbour (x1.25 or /1.25, at least one
    replica away) while goodput rises. `evaluate` runs once per split."""
    tried: dict[int, dict[str, float]] = {}

    def at(p: int) -> dict[str, float]:
        if p not in tried:
            tried[p] = evaluate(p)
        return tried[p]

    if num_replicas <= 4:
        for p in range(1, num_replicas):
            at(p)
        return tried
    clip = lambda p: min(max(p, 1), num_replicas - 1)  # noqa: E731
    for name in slo_names:
        p = clip(start)
        while True:
            around = {clip(max(p + 1, round(p * 1.25))), clip(min(p - 1, round(p / 1.25)))} - {p}
            best = max(around, key=lambda q: at(q)[name], default=p)
            if at(best)[name] <= at(p)[name]:
                break
            p = best
    return tried


def goodput(measure: Callable[[float, float], dict[str, float]], slo_names: list[str], *, target: float, high: float,
            steps: int) -> dict[str, float]:
    """{slo: the highest rate in [0, high] with attainment >= target}, by bisection;
    `measure(rate, high)` returns every SLO's attainment at that rate (memoised here: the
    searches share rates). The bracket doubles until its top fails every SLO."""
    memo: dict[float, dict[str, float]] = {}

    def at(rate: float) -> dict[str, float]:
        if rate not in memo:
            memo[rate] = measure(rate, high)
        return memo[rate]

    for _ in range(6):
        if all(at(high)[name] < target for name in slo_names):
            break
        high *= 2
    out = {}
    for name in slo_names:
        low, top = 0.0, high
        for _ in range(steps):
            mid = (low + top) / 2
            if at(mid)[name] >= target:
                low = mid
            else:
                top = mid
        out[name] = low
    return out


@dataclass(frozen=True)
class Cell:
    fit: str
    mix: str
    num_replicas: int
    slo: str
    ttft_ms: float
    tpot_ms: float
    colocated_per_replica: float
    disaggregated_per_replica: float
    best_prefill: int
    split_goodput: dict  # prefill replicas -> per-replica goodput

    @property
    def ratio(self) -> float | None:
        return self.disaggregated_per_replica / self.colocated_per_replica if self.colocated_per_replica else None

    def to_json(self) -> dict:
        return {**asdict(self), "split_goodput": {str(k): v for k, v in self.split_goodput.items()}, "ratio": self.ratio}


class _PoolRuns:
    """The runs of one (fit, mix, pool size): each at a rate, the same requests (a prefix of one
    draw per bracket), judged on those arriving after one lifetime and before the last."""

    def __init__(self, fit: CostFit, mix: Mix, num_replicas: int, slos: dict[str, tuple[float, float]], params: SweepParams):
        self.fit, self.mix, self.n, self.slos, self.seed = fit, mix, num_replicas, slos, params.seed
        self.router = params.router
        lifetime_s = lifetime_estimate(fit, mix)
        self.per_replica = capacity_estimate(fit, mix)
        # long enough for queues to build: run_e2e mean lifetimes, or min_requests at the estimate
        self.duration_s = max(params.run_e2e * lifetime_s, params.min_requests / (num_replicas * self.per_replica))
        self.window = (lifetime_s, self.duration_s - lifetime_s)
        self.templates: dict[float, list] = {}

    def attainments(self, rate: float, high: float, mode: str, num_prefill: int) -> dict[str, float]:
        if high not in self.templates:
            count = math.ceil(high * self.duration_s * 1.05) + 1
            self.templates[high] = generate(self.mix, count, 1.0, num_replicas=self.n, seed=self.seed)
        requests = [replace(r, arrival_s=r.arrival_s / rate) for r in self.templates[high] if r.arrival_s / rate <= self.duration_s]
        results = simulate(requests, self.fit, mode, num_prefill=num_prefill, num_decode=self.n - num_prefill,
                           router=self.router).results
        judged = [x for x in results if self.window[0] <= x.request.arrival_s <= self.window[1]] or results
        return {name: attainment(judged, *slo) for name, slo in self.slos.items()}

    def goodput(self, mode: str, num_prefill: int, *, search: dict) -> dict[str, float]:
        return goodput(lambda rate, high: self.attainments(rate, high, mode, num_prefill), list(self.slos), **search)


def sweep(fit: CostFit, params: SweepParams, *, progress: Callable[[str], None] = lambda message: None) -> list[Cell]:
    cells = []
    for mix_name in params.mixes:
        mix = MIXES[mix_name]
        slos = slos_for(fit, mix, params.slo_scales)
        names = list(slos)
        for n in params.pool_sizes:
            runs = _PoolRuns(fit, mix, n, slos, params)
            search = dict(target=params.attainment, high=3 * runs.per_replica * n, steps=params.bisect_steps)
            coloc = runs.goodput("colocated", 0, search=search)
            by_split = search_splits(functools.partial(runs.goodput, "disaggregated", search=search), n,
                                     first_split(fit, mix, n), names)
            for name in names:
                best = max(by_split, key=lambda p: by_split[p][name])
                cell = Cell(fit.name, mix_name, n, name, *slos[name], coloc[name] / n, by_split[best][name] / n, best,
                            {p: g[name] / n for p, g in by_split.items()})
                cells.append(cell)
                progress(f"{fit.name} {mix_name} N={n} {name}: colocated {cell.colocated_per_replica:.3g}, disaggregated "
                         f"{cell.disaggregated_per_replica:.3g} req/s per replica (best {best}P:{n - best}D)")
    return cells


def lifetime_estimate(fit: CostFit, mix: Mix) -> float:
    """Seconds from arrival to last token of a mean request in a batch of 32, unqueued."""
    context = round(mix.mean_prompt() + mix.mean_output() / 2)
    return _chunked_prefill_s(fit, round(mix.mean_prompt())) + mix.mean_output() * fit.step.decode_s(32, context)


def capacity_estimate(fit: CostFit, mix: Mix) -> float:
    """Requests/s one replica serves, roughly: the mean prompt's prefill plus its output decoded
    at batch 32 (the search's bracket and the runs' length start from it)."""
    context = round(mix.mean_prompt() + mix.mean_output() / 2)
    return 1.0 / (_chunked_prefill_s(fit, round(mix.mean_prompt())) + mix.mean_output() * fit.step.decode_s(32, context) / 32)


def crossovers(cells: list[Cell]) -> list[dict]:
    """Per (fit, mix, slo): the smallest pool size where disaggregated goodput per replica is
    above colocated's (equal ones, within the search's resolution, are not a win), whether it
    stays above at every larger size, and the ratio at each size."""
    out = []
    keys = sorted({(c.fit, c.mix, c.slo) for c in cells}, key=lambda k: (k[0], list(MIXES).index(k[1]), k[2]))
    for fit, mix, slo in keys:
        row = sorted((c for c in cells if (c.fit, c.mix, c.slo) == (fit, mix, slo)), key=lambda c: c.num_replicas)
        wins = [c.num_replicas for c in row if c.disaggregated_per_replica > c.colocated_per_replica]
        first = wins[0] if wins else None
        holds = first is not None and all(c.disaggregated_per_replica > c.colocated_per_replica
                                          for c in row if c.num_replicas >= first)
        out.append({"fit": fit, "mix": mix, "slo": slo, "crossover_replicas": first, "holds_above": holds,
                    "ratio_by_size": {str(c.num_replicas): c.ratio for c in row}})
    return out
