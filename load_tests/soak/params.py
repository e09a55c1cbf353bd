"""The knobs of `kvrelay bench soak` and their command line (argparse only: `kvrelay --help` must
not import Ray). What each does: load_tests/soak/bench.py."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DESCRIPTION", "SoakParams", "add_arguments", "params_from_args"]

DESCRIPTION = (
    "Start the app (deploy/local.yaml, disaggregated, two replicas per pool) on a Ray of its own, send "
    "--requests mixed requests (streamed and not, n > 1, stop strings, shared prefixes, long prompts, "
    "client aborts at random points) at --concurrency, then check that every engine's free blocks are "
    "back at their baseline, the KVTransfer actors hold nothing, every request ended within its "
    "deadline and replica memory stayed flat. --chaos kills a decode replica, a prefill replica and the "
    "KVTransfer actor along the way and reports what each kill did. Exit 1 if a check failed "
    "(load_tests/soak/bench.py)."
)

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class SoakParams:
    num_requests: int = 10_000
    concurrency: int = 16
    seed: int = 0
    is_chaos: bool = False
    config: str = str(REPO / "deploy" / "local.yaml")
    model: str | None = None  # None: the config's (the default model)
    dtype: str | None = None  # None: the config's (auto)
    prefill_replicas: int = 2
    decode_replicas: int = 2
    overrides: tuple[tuple[str, object], ...] = ()  # --set, after everything above
    deadline_s: float = 120.0
    abort_fraction: float = 0.1
    max_rss_growth: float = 0.05
    warmup_fraction: float = 0.2
    window_fraction: float = 0.1
    rss_period_s: float = 1.0
    settle_s: float = 20.0
    recovery_timeout_s: float = 180.0
    is_progress_shown: bool = True


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = SoakParams()
    p.add_argument("--requests", dest="num_requests", type=int, default=d.num_requests, metavar="N", help="requests [%(default)s]")
    p.add_argument("--concurrency", type=int, default=d.concurrency, metavar="N", help="requests in flight at most [%(default)s]")
    p.add_argument("--chaos", dest="is_chaos", action="store_true",
                   help="kill a decode replica, a prefill replica and the KVTransfer actor at 25/50/75%% of the run")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the workload (same seed, same requests) [%(default)s]")
    p.add_argument("--json", metavar="PATH", help="write summary, config, raw records and hardware here")
    p.add_argument("--config", default=d.config, metavar="FILE", help="the app's ServeConfig YAML [deploy/local.yaml]")
    p.add_argument("--model", help="model name or directory [the config's]")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32", "float16"], help="weights and KV dtype [the config's]")
    p.add_argument("--prefill-replicas", type=int, default=d.prefill_replicas, metavar="N", help="[%(default)s]")
    p.add_argument("--decode-replicas", type=int, default=d.decode_replicas, metavar="N", help="[%(default)s]")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                   help="override a field of the app's config by its dotted path, last, e.g. --set kv_transfer.lease_s=60")
    p.add_argument("--deadline-s", type=float, default=d.deadline_s, metavar="S",
                   help="a request without an end this long after it was sent is hung [%(default)s]")
    p.add_argument("--abort-fraction", type=float, default=d.abort_fraction, metavar="F",
                   help="requests the client abandons at a random point [%(default)s]")
    p.add_argument("--max-rss-growth", type=float, default=d.max_rss_growth, metavar="F",
                   help="largest RSS growth of a replica process after warm-up, as a fraction [%(default)s]")
    p.add_argument("--settle-s", type=float, default=d.settle_s, metavar="S",
                   help="how long the app may take to become idle and clean after the load (keep it under kv_transfer.lease_s) [%(default)s]")
    p.add_argument("--recovery-timeout-s", type=float, default=d.recovery_timeout_s, metavar="S",
                   help="how long a pool may take to come back after a kill [%(default)s]")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def params_from_args(args: argparse.Namespace) -> SoakParams:
    from serving.config import ConfigError, parse_set_items

    try:
        overrides = tuple(parse_set_items(args.set).items())
    except ConfigError as exc:
        raise SystemExit(f"kvrelay bench soak: {exc}") from None
    p = SoakParams(
        num_requests=args.num_requests, concurrency=args.concurrency, seed=args.seed, is_chaos=args.is_chaos,
        config=args.config, model=args.model, dtype=args.dtype, prefill_replicas=args.prefill_replicas,
        decode_replicas=args.decode_replicas, overrides=overrides, deadline_s=args.deadline_s,
        abort_fraction=args.abort_fraction, max_rss_growth=args.max_rss_growth, settle_s=args.settle_s,
        recovery_timeout_s=args.recovery_timeout_s, is_progress_shown=not args.no_progress,
    )
    for name in ("num_requests", "concurrency", "prefill_replicas", "decode_replicas"):
        if getattr(p, name) < 1:
            raise SystemExit(f"kvrelay bench soak: --{name.replace('_', '-').replace('num-', '')} must be >= 1, got {getattr(p, name)}")
    if not 0.0 <= p.abort_fraction <= 1.0:
        raise SystemExit(f"kvrelay bench soak: --abort-fraction must be in [0, 1], got {p.abort_fraction}")
    if p.is_chaos and (p.prefill_replicas < 2 or p.decode_replicas < 2):
        print("[bench soak] note: with one replica in a pool, a kill leaves the pool empty until Serve replaces it:"
              " requests then get 503 and count as failed during recovery", file=sys.stderr)
    return p
