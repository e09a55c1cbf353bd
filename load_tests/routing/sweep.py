"""`kvrelay bench routing --simulate --pressure-sweep`: every policy over a grid of workloads and
cache sizes, from caches that hold every prefix with room to spare to a pool that holds a quarter
of them.

    grid        prefix groups x Zipf skew x replicas x cache ratio, each cell one workload
                (load_tests/routing/workload.py) simulated under every policy
                (load_tests/routing/sim.py), the same seed for all of them
    cache ratio the pool's KV capacity / the working set (groups x prefix tokens). The first
                level is "ample": that ratio, and at least AMPLE_PROMPTS prompts per replica.
                A tighter level whose share per replica would be under MIN_PROMPTS_PER_REPLICA
                prompts (one running prompt and half a prefix) is skipped and listed as such:
                16 prefixes on 64 replicas cannot be short of room.
    requests    requests_per_group x groups, at least min_requests; the rate is the preset's
                `load` x the pool's capacity for prompts that hit nothing, as in the main run

    per cell    each policy's figures (hit rate, TTFT p50/p95, max/mean load), the oracle's
                hit rate (routing_sim.oracle_hit_tokens), the oracle's placement replayed on the
                simulated replicas (`oracle_replay`, routing_sim.OracleReplayPolicy: what that
                placement keeps once the other requests share the LRU caches), and one cache as
                large as the pool with LRU and with offline-optimal eviction
                (routing/bounds.py: `pooled_lru_hit_rate`, `pooled_optimal_hit_rate`)
    summary     over every cell, ours (prefix_cost):
                min_fraction_of_oracle        worst hit rate / oracle's             target >= 0.9
                min_hit_ratio_vs_char_tree    worst hit rate / the tree's           target >= 1.0
                max_ttft_p95_ratio_vs_char_tree  worst TTFT p95 / the tree's        target <= 1.0
                max_over_mean_load            worst max/mean computed tokens        target <= 1.3
                with the cell each worst one came from, and for information the worst hit rate
                against the replayed oracle, the pooled LRU cache and the pooled optimal one.
                conflicting_cells: the cells where the two hit-rate and load targets cannot
                both hold for any router: the tree reaches the single home's hit rate (the
                most any router can, bounds.single_home), and every placement that
                does has a max/mean load over the load target (its `single_home_load_floor`)
                With --num-routers N > 1 every policy runs with N routers (requests alternate
                between them, each with its own RouterState), ours once more with one
                (`prefix_cost_one_router`), and
                min_hit_ratio_vs_one_router       worst hit rate, N routers / one     target >= 0.98
                With --router-seeds K, ours runs K times with N routers and K times with one
                (the stats timers' phases differ by seed) and the ratio is of the means: one
                run's hit rate moves by up to 2-3% with the seed alone under pressure.

The oracle is the static placement of routing/sim.py: it pins the groups that will turn out most
requested (it knows the future counts) and counts its pinned blocks as always cached. Beside it,
for information, the same placement chosen without foresight (`prior_oracle_hit_rate`: by the
groups' popularity, which a router can learn, not by the draw, which it cannot): with uniform
popularity and a dozen requests per group, the groups that happen to come most often are worth
a third more hits than any others, and that edge is luck no online policy has. Under
pressure that is not a bound any router reaches on LRU engines: the requests it does not pin
must be computed somewhere, and their blocks evict pinned ones. The replayed oracle shows by
how much (in the uniform cells at a quarter of the working set, to 0.4 of the oracle's figure),
and the pooled LRU cache, which no routing loss touches, reaches 0.7-0.9 of it there.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from load_tests.common import Target
from load_tests.routing.sim import CostModel, SimConfig

__all__ = [
    "SweepGrid", "Cell", "SWEEP_FULL", "SWEEP_QUICK", "SWEEP_TARGETS", "cells", "summarize_sweep", "format_sweep",
    "AMPLE_PROMPTS", "MIN_PROMPTS_PER_REPLICA", "ONE_ROUTER",
]

ONE_ROUTER = "prefix_cost_one_router"  # ours with one router, beside a run with several
AMPLE_PROMPTS = 4.0  # the ample level gives every replica room for at least this many prompts
MIN_PROMPTS_PER_REPLICA = 1.5  # below it a replica cannot hold a prefix beside a running prompt


@dataclass(frozen=True)
class SweepGrid:
    num_groups: tuple[int, ...] = (16, 64, 256)
    zipf: tuple[float, ...] = (0.0, 0.6, 1.2)
    num_replicas: tuple[int, ...] = (8, 16, 64)
    cache_ratios: tuple[float, ...] = (4.0, 1.0, 0.5, 0.25)  # pool KV / working set; the first is "ample"
    requests_per_group: int = 12
    min_requests: int = 2000


SWEEP_FULL = SweepGrid()
SWEEP_QUICK = SweepGrid(num_groups=(16, 64, 256), zipf=(0.0, 1.2), num_replicas=(8, 16), cache_ratios=(4.0, 0.5, 0.25),
                        requests_per_group=8, min_requests=1000)

SWEEP_TARGETS = (
    Target("min_fraction_of_oracle", "worst cell: hit rate / oracle's", ">=", 0.9),
    Target("min_hit_ratio_vs_char_tree", "worst cell: hit rate / tree's", ">=", 1.0),
    Target("max_ttft_p95_ratio_vs_char_tree", "worst cell: TTFT p95 / tree's", "<=", 1.0),
    Target("max_over_mean_load", "worst cell: max / mean load", "<=", 1.3),
    Target("min_hit_ratio_vs_one_router", "worst cell: N routers / one", ">=", 0.98),
)
_LOAD_TARGET = next(t for t in SWEEP_TARGETS if t.key == "max_over_mean_load")


@dataclass(frozen=True)
class Cell:
    num_groups: int
    zipf: float
    num_replicas: int
    cache_ratio: float  # as asked; `kv_cache_tokens` is what it came to
    kv_cache_tokens: int  # per replica
    num_requests: int
    skipped: str | None = None  # why the cell was not run

    @property
    def name(self) -> str:
        return f"g{self.num_groups}-z{self.zipf:g}-r{self.num_replicas}-c{self.cache_ratio:g}"


def cells(grid: SweepGrid, *, prefix_len: int, suffix_len: int, block_size: int) -> list[Cell]:
    """The grid's cells in order, skipped ones included (with the reason)."""
    prompt_len = prefix_len + suffix_len
    out = []
    for num_groups, zipf, num_replicas, ratio in itertools.product(
        grid.num_groups, grid.zipf, grid.num_replicas, grid.cache_ratios,
    ):
        tokens = ratio * num_groups * prefix_len / num_replicas
        skipped = None
        if ratio == grid.cache_ratios[0]:
            tokens = max(tokens, AMPLE_PROMPTS * prompt_len)
        elif tokens < MIN_PROMPTS_PER_REPLICA * prompt_len:
            skipped = (f"{ratio:g} x the working set is {tokens:.0f} tokens per replica, under "
                       f"{MIN_PROMPTS_PER_REPLICA:g} prompts ({MIN_PROMPTS_PER_REPLICA * prompt_len:.0f})")
        kv_cache_tokens = math.ceil(tokens / block_size) * block_size
        num_requests = max(grid.min_requests, grid.requests_per_group * num_groups)
        out.append(Cell(num_groups, zipf, num_replicas, ratio, kv_cache_tokens, num_requests, skipped))
    return out


def run_cells(
    grid_cells: Sequence[Cell], simulate_cell: Callable[[Cell], dict], progress: Callable[[str], None],
) -> list[dict]:
    """Each cell's record: the cell, then what `simulate_cell` returns for it (its policies'
    figures and the oracle's hit rate), or the reason it was skipped."""
    records = []
    runnable = [cell for cell in grid_cells if cell.skipped is None]
    started = time.monotonic()
    for cell in grid_cells:
        record = {"cell": cell.name, **dataclasses.asdict(cell)}
        if cell.skipped is None:
            record.update(simulate_cell(cell))
            done = sum(1 for r in records if r["skipped"] is None) + 1
            progress(f"sweep: {cell.name} ({done}/{len(runnable)}, {time.monotonic() - started:.0f}s)")
        records.append(record)
    return records


def sim_config(cell: Cell, *, block_size: int, stats_period_s: float, num_routers: int, seed: int) -> SimConfig:
    return SimConfig(cell.num_replicas, cell.kv_cache_tokens // block_size, block_size, stats_period_s, num_routers, seed)


def _worst(records: list[dict], figure: Callable[[dict], float | None], pick) -> tuple[float | None, str | None]:
    values = [(value, r["cell"]) for r in records if r["skipped"] is None and (value := figure(r)) is not None]
    if not values:
        return None, None
    return pick(values, key=lambda item: item[0])


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def _vs_one_router(record: dict) -> float | None:
    """Ours with several routers / with one: the ratio of their mean hit rates over the seeds
    where several ran, else of the one run each."""
    if record.get("one_router_hit_rates"):
        return _ratio(sum(record["several_routers_hit_rates"]), sum(record["one_router_hit_rates"]))
    return _ratio(record["figures"]["prefix_cost"]["hit_rate"], record["figures"].get(ONE_ROUTER, {}).get("hit_rate"))


def _targets_conflict(record: dict) -> bool:
    """Whether no router can meet both "hit rate >= the tree's" and the load target in this cell
    (module docstring: conflicting_cells)."""
    tree = record["figures"].get("char_prefix_tree", {}).get("hit_rate")
    floor, most = record.get("single_home_load_floor"), record.get("single_home_hit_rate")
    if tree is None or floor is None or most is None:
        return False
    return tree >= most - 1e-12 and not _LOAD_TARGET.met(floor)


def summarize_sweep(records: list[dict]) -> dict:
    """The summary of the module docstring from the cells' records."""
    def ours(r):
        return r["figures"]["prefix_cost"]

    def tree(r):
        return r["figures"].get("char_prefix_tree", {})

    figures = {
        "min_fraction_of_oracle": (lambda r: _ratio(ours(r)["hit_rate"], r["oracle_hit_rate"]), min),
        "min_hit_ratio_vs_char_tree": (lambda r: _ratio(ours(r)["hit_rate"], tree(r).get("hit_rate")), min),
        "max_ttft_p95_ratio_vs_char_tree": (lambda r: _ratio(ours(r)["ttft_ms_p95"], tree(r).get("ttft_ms_p95")), max),
        "max_over_mean_load": (lambda r: ours(r)["max_over_mean_load"], max),
        # Not targets: ours against the oracle that knows the groups' popularity but not the
        # draw (routing_sim.oracle_hit_tokens, foresight=False), the oracle's own placement on
        # the simulated LRU caches, one LRU cache as large as the pool, and the same cache with
        # offline-optimal eviction.
        "min_fraction_of_prior_oracle": (lambda r: _ratio(ours(r)["hit_rate"], r.get("prior_oracle_hit_rate")), min),
        "min_hit_ratio_vs_oracle_replay": (lambda r: _ratio(ours(r)["hit_rate"], r["figures"].get("oracle_replay", {}).get("hit_rate")), min),
        "min_hit_ratio_vs_pooled_lru": (lambda r: _ratio(ours(r)["hit_rate"], r.get("pooled_lru_hit_rate")), min),
        "min_fraction_of_pooled_optimal": (lambda r: _ratio(ours(r)["hit_rate"], r.get("pooled_optimal_hit_rate")), min),
        "min_hit_ratio_vs_one_router": (_vs_one_router, min),
    }
    summary: dict = {}
    for key, (figure, pick) in figures.items():
        summary[key], summary[f"{key}_cell"] = _worst(records, figure, pick)
    summary["num_cells"] = sum(1 for r in records if r["skipped"] is None)
    summary["num_cells_skipped"] = sum(1 for r in records if r["skipped"] is not None)
    summary["conflicting_cells"] = [r["cell"] for r in records if r["skipped"] is None and _targets_conflict(r)]
    summary["targets"] = {t.key: {"target": t.text, "met": t.met(summary[t.key])} for t in SWEEP_TARGETS}
    run = [r for r in records if r["skipped"] is None]
    for t in SWEEP_TARGETS:  # how many cells meet each target on their own
        figure = figures[t.key][0]
        values = [figure(r) for r in run]
        summary["targets"][t.key]["cells_met"] = sum(1 for v in values if v is not None and t.met(v))
        summary["targets"][t.key]["cells"] = sum(1 for v in values if v is not None)
    return summary


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else f"{value:{spec}}"


def format_sweep(records: list[dict], summary: dict, cost: CostModel) -> str:
    several = any(ONE_ROUTER in r.get("figures", {}) for r in records)
    lines = [
        "pressure sweep: every policy's hit rate / the oracle's (LRU, MIN: one cache as large as the pool, "
        "routing/bounds.py), TTFT p95 ms, max/mean load"
        + ("; ours' hit rate / ours with one router" if several else ""),
        f"{'cell':<22}{'KV tok':>7}{'oracle':>8}{'ours':>7}{'tree':>7}{'pow2':>7}{'rr':>7}{'replay':>7}{'LRU':>7}{'MIN':>7}"
        f"{'p95 ours':>10}{'p95 tree':>10}{'load ours':>10}{'load tree':>10}" + (f"{'/1 router':>10}" if several else ""),
    ]
    for r in records:
        if r["skipped"] is not None:
            continue
        f = r["figures"]
        oracle = r["oracle_hit_rate"]

        def frac(name, f=f, oracle=oracle):
            return _fmt(_ratio(f[name]["hit_rate"], oracle), ".3f") if name in f else "-"

        lines.append(
            f"{r['cell']:<22}{r['kv_cache_tokens']:>7}{oracle:>8.3f}{frac('prefix_cost'):>7}{frac('char_prefix_tree'):>7}"
            f"{frac('pow2'):>7}{frac('round_robin'):>7}{frac('oracle_replay'):>7}"
            f"{_fmt(_ratio(r.get('pooled_lru_hit_rate'), oracle), '.3f'):>7}{_fmt(_ratio(r.get('pooled_optimal_hit_rate'), oracle), '.3f'):>7}"
            f"{_fmt(f['prefix_cost']['ttft_ms_p95'], '.0f'):>10}{_fmt(f.get('char_prefix_tree', {}).get('ttft_ms_p95'), '.0f'):>10}"
            f"{_fmt(f['prefix_cost']['max_over_mean_load'], '.2f'):>10}"
            f"{_fmt(f.get('char_prefix_tree', {}).get('max_over_mean_load'), '.2f'):>10}"
            + (f"{_fmt(_vs_one_router(r), '.3f'):>10}" if several else "")
        )
    skipped = [r for r in records if r["skipped"] is not None]
    if skipped:
        lines.append(f"skipped {len(skipped)} cells: " + ", ".join(r["cell"] for r in skipped))
    lines += ["", f"{'summary (ours, ' + str(summary['num_cells']) + ' cells)':<40}{'value':>8}{'target':>10}{'result':>8}  worst cell"]
    for t in SWEEP_TARGETS:
        if summary[t.key] is None and t.key == "min_hit_ratio_vs_one_router":
            continue  # one router: nothing to compare
        verdict = {True: "pass", False: "miss", None: "n/a"}[summary["targets"][t.key]["met"]]
        met = summary["targets"][t.key]
        lines.append(f"{t.label:<40}{_fmt(summary[t.key], '.3f'):>8}{t.text:>10}{verdict:>8}  {summary[t.key + '_cell']}"
                     f"  ({met['cells_met']}/{met['cells']} cells)")
    for key, label in (("min_fraction_of_prior_oracle", "worst cell: hit rate / no-foresight oracle's"),
                       ("min_hit_ratio_vs_oracle_replay", "worst cell: hit rate / replayed oracle's"),
                       ("min_hit_ratio_vs_pooled_lru", "worst cell: hit rate / pooled LRU's"),
                       ("min_fraction_of_pooled_optimal", "worst cell: hit rate / pooled MIN's")):
        if summary.get(key) is not None:
            lines.append(f"{label:<40}{_fmt(summary[key], '.3f'):>8}{'(info)':>10}{'':>8}  {summary[key + '_cell']}")
    conflicting_names = set(summary.get("conflicting_cells", ()))
    conflicting = [r for r in records if r["cell"] in conflicting_names]
    if conflicting:
        lines.append("the tree's hit rate and the load target conflict (the tree hits the most any router can, which "
                     "takes this max/mean load): " + ", ".join(f"{r['cell']} {r['single_home_load_floor']:.2f}" for r in conflicting))
    lines.append(f"cost model: {cost.overhead_s * 1e3:.1f} ms + tokens / {cost.tokens_per_s:.0f}/s "
                 f"+ {cost.attention_pair_s:.2e} s per attention pair")
    return "\n".join(lines)
