"""The parameters of `kvrelay bench serve` and its command-line options.

Kept apart from the benchmark so that `kvrelay --help` builds the parser without importing
httpx or numpy (serving/cli/parser.py imports this module for every command).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

__all__ = ["DESCRIPTION", "DATASETS", "BenchParams", "LengthDist", "add_arguments", "params_from_args", "parse_length"]

DESCRIPTION = (
    "Stream a dataset (random, shared-prefix, multi-turn, chat-burst) to --base-url at each "
    "request rate (Poisson, or gamma with --burstiness) or under --max-concurrency; report "
    "TTFT, TPOT, ITL, E2E (mean, p50, p90, p95, p99), request and token throughput and "
    "goodput under --slo; JSON with --json, a PNG report next to it (load_tests/serve/bench.py)."
)

DATASETS = ("random", "shared-prefix", "multi-turn", "chat-burst")


@dataclass(frozen=True)
class BenchParams:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "chat"  # or "completions"
    model: str | None = None  # None: the first of GET /v1/models
    api_key: str | None = None
    dataset: str = "random"
    num_prompts: int = 100
    input_len: str = "256"  # LengthDist spec: N, LOW-HIGH, normal:MEAN:SD
    output_len: str = "128"
    num_groups: int = 8  # shared-prefix
    prefix_len: int = 512
    suffix_len: int = 64
    num_sessions: int = 8  # multi-turn (num_prompts is ignored: sessions x turns requests)
    num_turns: int = 4
    burst_every_s: float = 10.0  # chat-burst
    burst_size: int = 4
    burst_len: int = 2048
    burst_output_len: int = 64
    token_ids_vocab: int | None = None  # random + completions: token-id prompts from [100, vocab)
    request_rates: tuple[float, ...] = (math.inf,)
    burstiness: float = 1.0
    max_concurrency: int | None = None
    slo: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    timeout_s: float = 600.0
    seed: int = 0
    is_progress_shown: bool = True
    extra_body: str | None = None  # JSON object merged into every request body


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `kvrelay bench serve` (serving/cli/parser.py adds them to its subparser)."""
    d = BenchParams()
    p.add_argument("--base-url", default=d.base_url, help="the server [%(default)s]")
    p.add_argument("--endpoint", choices=["chat", "completions"], default=d.endpoint,
                   help="/v1/chat/completions or /v1/completions [%(default)s]")
    p.add_argument("--model", help="model name [the first of GET /v1/models]")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token [$OPENAI_API_KEY]")
    p.add_argument("--dataset", choices=DATASETS, default=d.dataset, help="workload [%(default)s]")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts, metavar="N",
                   help="requests (chat-burst: the steady chat requests) [%(default)s]")
    p.add_argument("--input-len", default=d.input_len, metavar="LEN",
                   help="prompt tokens (random, chat-burst's chat, multi-turn's user turn): N, LOW-HIGH or normal:MEAN:SD [%(default)s]")
    p.add_argument("--output-len", default=d.output_len, metavar="LEN", help="max_tokens, same forms [%(default)s]")
    p.add_argument("--num-groups", type=int, default=d.num_groups, help="shared-prefix groups [%(default)s]")
    p.add_argument("--prefix-len", type=int, default=d.prefix_len, metavar="TOKENS", help="shared-prefix prefix [%(default)s]")
    p.add_argument("--suffix-len", type=int, default=d.suffix_len, metavar="TOKENS", help="shared-prefix suffix [%(default)s]")
    p.add_argument("--num-sessions", type=int, default=d.num_sessions, help="multi-turn sessions [%(default)s]")
    p.add_argument("--num-turns", type=int, default=d.num_turns, help="multi-turn turns per session [%(default)s]")
    p.add_argument("--burst-every-s", type=float, default=d.burst_every_s, metavar="S", help="chat-burst: seconds between bursts [%(default)s]")
    p.add_argument("--burst-size", type=int, default=d.burst_size, metavar="N", help="chat-burst: long prompts per burst [%(default)s]")
    p.add_argument("--burst-len", type=int, default=d.burst_len, metavar="TOKENS", help="chat-burst: long prompt length [%(default)s]")
    p.add_argument("--burst-output-len", type=int, default=d.burst_output_len, metavar="TOKENS",
                   help="chat-burst: max_tokens of a long prompt [%(default)s]")
    p.add_argument("--token-ids-vocab", type=int, metavar="N",
                   help="random + --endpoint completions: send random token ids from [100, N) instead of text")
    p.add_argument("--request-rate", default="inf", metavar="R[,R...]",
                   help="requests/s, one run per rate, 'inf' = all at once [%(default)s]")
    p.add_argument("--burstiness", type=float, default=d.burstiness,
                   help="gamma shape of the arrival gaps: 1 Poisson, < 1 burstier [%(default)s]")
    p.add_argument("--max-concurrency", type=int, metavar="N", help="cap on requests in flight [none]")
    p.add_argument("--slo", metavar="ttft_ms=..,tpot_ms=..", help="bounds for goodput (ttft_ms, tpot_ms, e2e_ms)")
    p.add_argument("--temperature", type=float, default=d.temperature, help="[%(default)s]")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM, SGLang, kvrelay) for exact output lengths")
    p.add_argument("--extra-body", metavar="JSON",
                   help='fields merged into every request body, e.g. \'{"min_tokens": 128}\' for exact lengths on vLLM')
    p.add_argument("--timeout-s", type=float, default=d.timeout_s, help="per-request HTTP timeout [%(default)s]")
    p.add_argument("--seed", type=int, default=d.seed, help="dataset and arrival seed [%(default)s]")
    p.add_argument("--json", metavar="PATH", help="write summary, config, raw records and hardware here")
    p.add_argument("--png", metavar="PATH", help="the PNG report [next to --json, PATH.png]")
    p.add_argument("--no-png", action="store_true", help="no PNG report")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


@dataclass(frozen=True)
class LengthDist:
    """Token lengths: fixed (`low == high`), uniform over [low, high], or normal(mean, sd) clipped
    to >= 1."""

    kind: str  # "fixed", "uniform", "normal"
    a: float  # fixed/uniform: low; normal: mean
    b: float  # fixed/uniform: high; normal: sd

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        import numpy as np

        if self.kind in ("fixed", "uniform"):
            return rng.integers(int(self.a), int(self.b) + 1, n).tolist()
        return np.maximum(1, np.rint(rng.normal(self.a, self.b, n))).astype(int).tolist()

    @property
    def mean(self) -> float:
        return self.a if self.kind == "normal" else (self.a + self.b) / 2


def parse_length(spec: str | int) -> LengthDist:
    """`256` fixed, `128-512` uniform (inclusive), `normal:256:64` mean and sd; ValueError otherwise."""
    text = str(spec).strip()
    try:
        if text.startswith("normal:"):
            _, mean, sd = text.split(":")
            dist = LengthDist("normal", float(mean), float(sd))
            ok = dist.a >= 1 and dist.b >= 0
        elif "-" in text:
            low, high = (int(x) for x in text.split("-"))
            dist = LengthDist("uniform", low, high)
            ok = 1 <= low <= high
        else:
            dist = LengthDist("fixed", int(text), int(text))
            ok = dist.a >= 1
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"length {text!r}: want N, LOW-HIGH or normal:MEAN:SD, lengths >= 1")
    return dist


def params_from_args(args: argparse.Namespace) -> BenchParams:
    from load_tests.serve.metrics import parse_slo

    try:
        rates = tuple(float(r) for r in args.request_rate.split(",") if r.strip())
        for spec in (args.input_len, args.output_len):
            parse_length(spec)
        parse_slo(args.slo)
    except ValueError as exc:
        raise SystemExit(f"kvrelay bench serve: {exc}") from None
    if not rates or any(r <= 0 for r in rates):
        raise SystemExit(f"kvrelay bench serve: --request-rate wants rates > 0 or inf, got {args.request_rate!r}")
    for name in ("num_prompts", "num_groups", "suffix_len", "num_sessions", "num_turns", "burst_size", "burst_len",
                 "burst_output_len"):
        if getattr(args, name) < 1:
            raise SystemExit(f"kvrelay bench serve: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.prefix_len < 0 or args.burstiness <= 0 or args.burst_every_s <= 0:
        raise SystemExit("kvrelay bench serve: --prefix-len must be >= 0, --burstiness and --burst-every-s > 0")
    if args.extra_body is not None:
        try:
            is_object = isinstance(json.loads(args.extra_body), dict)
        except ValueError:
            is_object = False
        if not is_object:
            raise SystemExit(f"kvrelay bench serve: --extra-body wants a JSON object, got {args.extra_body!r}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise SystemExit(f"kvrelay bench serve: --max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.dataset == "chat-burst" and any(math.isinf(r) for r in rates):
        raise SystemExit("kvrelay bench serve: chat-burst schedules its bursts in time: give a finite --request-rate")
    if args.dataset == "multi-turn" and args.endpoint != "chat":
        raise SystemExit("kvrelay bench serve: multi-turn sends chat histories: use --endpoint chat")
    return BenchParams(
        base_url=args.base_url.rstrip("/"), endpoint=args.endpoint, model=args.model, api_key=args.api_key,
        dataset=args.dataset, num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        num_groups=args.num_groups, prefix_len=args.prefix_len, suffix_len=args.suffix_len,
        num_sessions=args.num_sessions, num_turns=args.num_turns, burst_every_s=args.burst_every_s,
        burst_size=args.burst_size, burst_len=args.burst_len, burst_output_len=args.burst_output_len,
        token_ids_vocab=args.token_ids_vocab, request_rates=rates, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, slo=args.slo, temperature=args.temperature,
        ignore_eos=args.ignore_eos, timeout_s=args.timeout_s, seed=args.seed, is_progress_shown=not args.no_progress,
        extra_body=args.extra_body,
    )
