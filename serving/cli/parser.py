"""The `kvrelay` command's arguments (serving/cli/dispatch.py runs them). Building the parser
imports no command's implementation.

`kvrelay bench` lists its targets from load_tests/registry.py (a table: target, module, one line
of help) and asks a target's module for its arguments only when that target is parsed, so the
benchmarks' arguments live beside their code and `kvrelay --help` imports none of them. The
benchmarks are not part of an installed kvrelay (they are the `[bench]` extra's checkout):
`load_benchmarks` finds them on the path, or beside serving/ in the checkout an editable install
points at, or says there are none; `kvrelay bench` then says how to get them."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

__all__ = ["NO_BENCHMARKS", "build_parser", "load_benchmarks"]

NO_BENCHMARKS = (
    "the benchmarks (load_tests/) are not part of an installed kvrelay: run `kvrelay bench` from a "
    "checkout of kvrelay's repository, installed with its bench extra: pip install -e '.[bench]'"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrelay", description="kvrelay: LLM serving with disaggregated prefill/decode and KV transfer.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    _add_serve(commands)
    _add_bench(commands)
    _add_policy(commands)
    _add_ops(commands)

    hash_key = commands.add_parser(
        "hash-key", help="print an API key's stored form (salted SHA-256) for a config's api_keys",
        description="Reads the key from standard input (so it stays out of shell history) and prints a "
        "YAML entry for `api_keys:`; the config then holds no usable key.",
    )
    hash_key.add_argument("--name", help="how usage, logs and metrics name the key [key-<digest prefix>]")
    hash_key.add_argument("--tier", default="default", help="the key's tier [%(default)s]")
    _add_cluster(commands)
    _add_k8s(commands)
    return parser


def _add_cluster(commands) -> None:
    cluster = commands.add_parser(
        "cluster", help="a local multi-node Ray cluster for development (head, prefill and decode nodes)",
        description="Separate Ray nodes on this machine, each with its role's resource "
        "(cluster/roles.py); the state is kept in $KVRELAY_CACHE_DIR/cluster/NAME.json.",
    )
    actions = cluster.add_subparsers(dest="action", metavar="ACTION", required=True)
    up = actions.add_parser("up", help="start a head, N prefill nodes and M decode nodes; print the address")
    up.add_argument("--prefill-nodes", type=int, default=1, metavar="N", help="prefill nodes [%(default)s]")
    up.add_argument("--decode-nodes", type=int, default=1, metavar="M", help="decode nodes [%(default)s]")
    up.add_argument("--num-cpus", type=int, default=2, metavar="N", help="Ray logical CPUs per prefill/decode node [%(default)s]")
    up.add_argument("--head-num-cpus", type=int, default=2, metavar="N", help="Ray logical CPUs of the head [%(default)s]")
    up.add_argument("--object-store-mib", type=int, default=512, metavar="MIB", help="object store per node [%(default)s]")
    down = actions.add_parser("down", help="stop every process `cluster up` started (never `ray stop`)")
    for parser in (up, down):
        parser.add_argument("--name", default="dev", help="which dev cluster [%(default)s]")


def _add_k8s(commands) -> None:
    k8s = commands.add_parser("k8s", help="kvrelay on Kubernetes (KubeRay)")
    actions = k8s.add_subparsers(dest="action", metavar="ACTION", required=True)
    status = actions.add_parser(
        "status", help="a Helm release's RayService status and its pods per worker group",
        description="Read the RayService named after the release and the pods labelled with it "
        "(kubeconfig, or the in-cluster service account).",
    )
    status.add_argument("--release", required=True, help="the Helm release (the RayService's name)")
    status.add_argument("--namespace", default="default", help="namespace [%(default)s]")
    status.add_argument("--context", help="kubeconfig context [the current one]")


def _add_serve(commands) -> None:
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

def _add_policy(commands) -> None:
    policy = commands.add_parser(
        "policy", help="check or simulate an autoscaling policy (deploy/autoscaling/*.yaml)",
        description="Autoscaling policy files: the schema is router/autoscaling/policy.py, the decision "
        "router/autoscaling/decide.py.",
    )
    actions = policy.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = actions.add_parser(
        "check", help="validate a policy and print it with every default filled in",
        description="Validate FILE; print the effective policy as YAML, or the problems (file, "
        "field, value, allowed values) and exit 2.",
    )
    check.add_argument("file", metavar="FILE", help="policy YAML")
    sim = actions.add_parser(
        "simulate", help="replay a metric trace through one pool, or a workload through three policies",
        description="With --trace: replay TRACE.csv (time_s plus metric columns; "
        "router/autoscaling/simulator.py documents them, deploy/autoscaling/example-trace.csv is one) "
        "through one pool's decision, starting from min_replicas. With --workload or --workload-trace: "
        "replay a whole workload (request rate, prompt and output lengths) through a queueing model of "
        "both pools under the reactive policy, the planner and Ray Serve's default, and report each "
        "one's SLO attainment and replica-seconds (router/autoscaling/replay.py; FILE needs a planner "
        "section, deploy/autoscaling/planner.yaml is one).",
    )
    sim.add_argument("file", metavar="FILE", help="policy YAML")
    source = sim.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", metavar="TRACE.csv", help="a metric trace, replayed through one pool")
    source.add_argument(
        "--workload", choices=["steady", "ramp", "diurnal", "burst", "all"],
        help="a built-in hour-long workload (router/autoscaling/workload.py), or all four",
    )
    source.add_argument(
        "--workload-trace", metavar="WORKLOAD.csv",
        help="a workload CSV: time_s,requests_per_s,prompt_tokens,output_tokens "
        "(deploy/autoscaling/example-workload.csv)",
    )
    sim.add_argument(
        "--pool", choices=["prefill", "decode", "worker"],
        help="with --trace: which pool's section to use [the first the policy has: prefill, decode, worker]",
    )
    sim.add_argument("--seed", type=int, default=0, help="with a workload: the requests' seed [%(default)s]")
    sim.add_argument(
        "--cold-start-s", type=float, default=30.0, metavar="S",
        help="with a workload: seconds before a new replica takes work [%(default)s]",
    )
    sim.add_argument("--json", metavar="OUT.json", help="with a workload: also write the results as JSON")
    apply = actions.add_parser(
        "apply", help="switch the live app to this policy (through the Ray dashboard's Serve API)",
        description="Validate FILE, then change the running app's autoscaling policy. The file must be "
        "readable where the Serve controller runs (the head node).",
    )
    apply.add_argument("file", metavar="FILE", help="policy YAML")
    _add_live_app_args(apply)


def _add_live_app_args(parser) -> None:
    parser.add_argument("--dashboard", default="http://127.0.0.1:8265", help="Ray dashboard URL [%(default)s]")
    parser.add_argument("--app", default="kvrelay", help="Serve application name [%(default)s]")


def _add_ops(commands) -> None:
    status = commands.add_parser(
        "status", help="pools, replicas, queue depth, KV usage and TTFT/TPOT of a running app",
        description="Deployments and replica states from the Ray dashboard's Serve REST API (token "
        "authentication: $RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token), plus queue "
        "depth, KV usage and latency quantiles from the ingress's /metrics.",
    )
    _add_live_app_args(status)
    status.add_argument("--url", default="http://127.0.0.1:8000", help="the app's API base URL, for /metrics [%(default)s]")
    scale = commands.add_parser("scale", help="set the replica count of a pool in a running app")
    scale.add_argument("pool", choices=["prefill", "decode", "worker", "ingress"], help="the pool")
    scale.add_argument("num_replicas", type=int, metavar="N", help="replicas")
    _add_live_app_args(scale)



def load_benchmarks() -> dict | None:
    """load_tests.registry.BENCHMARKS, or None where there is no load_tests: an editable install
    maps only the product's packages, so the checkout beside serving/ is put on the path."""
    try:
        return importlib.import_module("load_tests.registry").BENCHMARKS
    except ModuleNotFoundError as exc:
        if exc.name not in ("load_tests", "load_tests.registry"):
            raise
    checkout = Path(__file__).resolve().parents[2]
    if not (checkout / "load_tests" / "registry.py").is_file():
        return None
    sys.path.insert(0, str(checkout))
    return importlib.import_module("load_tests.registry").BENCHMARKS


class _BenchTargets(argparse._SubParsersAction):
    """`kvrelay bench`'s targets: a target's arguments are added from its module when it is
    parsed (the module's DESCRIPTION and add_arguments), never for `kvrelay bench --help`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.arguments_modules: dict[str, str] = {}

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        name = values[0]
        if name in self.arguments_modules:
            module = importlib.import_module(self.arguments_modules.pop(name))
            target = self._name_parser_map[name]
            target.description = module.DESCRIPTION
            module.add_arguments(target)
        super().__call__(parser, namespace, values, option_string)


def _add_bench(commands) -> None:
    benchmarks = load_benchmarks()
    if benchmarks is None:
        bench = commands.add_parser("bench", help="benchmarks against peers (from a checkout: not installed here)",
                                    description=f"kvrelay bench: {NO_BENCHMARKS}.")
        bench.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        return
    bench = commands.add_parser("bench", help="benchmarks against peers on this machine")
    targets = bench.add_subparsers(dest="target", metavar="TARGET", required=True, action=_BenchTargets)
    for name, benchmark in benchmarks.items():
        targets.add_parser(name, help=benchmark.help)
        targets.arguments_modules[name] = benchmark.arguments_module
