"""The engine on CUDA (skipped without a GPU; load_tests/gpu_check.sh runs them on a lent GPU machine).

The PyTorch path on CUDA gives the CPU's greedy tokens; every model family matches transformers as
on the CPU; mixed LoRA batches match PEFT's merged models; a KV hand-off between two CUDA engines
continues as one engine would; greedy speculation keeps the tokens; a windowed model frees blocks.
"""

from __future__ import annotations

import pytest
import torch

from serving.engine import EngineConfig, LLMEngine, SamplingParams
from tests.helpers import build_tiny_model
from tests.serving.engine.test_lora import ADAPTERS, assert_greedy_agrees, hand_off, make_adapter
from tests.serving.engine.test_model_parity import (
    TINY_VARIANTS,
    engine_first_logits,
    engine_greedy,
    hf_greedy,
    windowed_run,
)
from tests.serving.engine.test_speculative import SPEC, OracleProposer, workload

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def cuda_engine(model_dir, **config) -> LLMEngine:
    config = {"dtype": "float32", "kv_cache_bytes": 8 * 2**20, **config}
    return LLMEngine(EngineConfig(model=str(model_dir), device="cuda", **config))


def run(engine: LLMEngine, requests: list[tuple[str | None, list[int]]], params=GREEDY) -> list[list[int]]:
    for i, (name, prompt) in enumerate(requests):
        engine.add_request(f"r{i}", params=params, prompt_token_ids=prompt, lora_name=name)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    return [got[f"r{i}"] for i in range(len(requests))]


def test_cuda_greedy_matches_cpu(tiny_model_dir):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 40, 130)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = {}
    for device in ("cpu", "cuda"):
        engine = LLMEngine(
            EngineConfig(model=str(tiny_model_dir), dtype="float32", device=device, kv_cache_bytes=8 * 2**20)
        )
        outputs[device] = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
        payload_engine = engine
    assert outputs["cuda"] == outputs["cpu"]
    assert payload_engine.kv_cache.data.is_cuda
    assert payload_engine.stats().deterministic.startswith("off")


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_every_family_on_cuda_matches_transformers(variant, tmp_path, tokenizer_dir):
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path / variant, tokenizer_dir, **TINY_VARIANTS[variant])
    engine = cuda_engine(model_dir)
    # the reference, on the CPU, in eager attention: the math the engine follows (with SDPA some
    # transformers versions skip Gemma 2's score soft-capping)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 37, 300)]
    for prompt, got in zip(prompts, engine_greedy(engine, prompts, 64)):
        expected, hf_logits = hf_greedy(hf, prompt, 64)
        assert got == expected
        assert (engine_first_logits(engine, prompt).cpu() - hf_logits).abs().max().item() < 1e-3


def test_bf16_on_cuda_tracks_fp32(tiny_model_dir):
    prompt = list(range(200, 260))
    fp32 = engine_first_logits(cuda_engine(tiny_model_dir), prompt).float().cpu()
    bf16 = engine_first_logits(cuda_engine(tiny_model_dir, dtype="bfloat16"), prompt).float().cpu()
    # bf16's rounding on this tiny model: 0.019 on the CPU, 0.020 on an H200; a wrong path gives ~1
    assert ((bf16 - fp32).norm() / fp32.norm()).item() < 3e-2


def test_mixed_lora_batch_on_cuda_matches_peft_merged(tiny_model_dir, tmp_path):
    made = {name: (tmp_path / name, make_adapter(tiny_model_dir, tmp_path / name, *spec, seed))
            for seed, (name, spec) in enumerate(ADAPTERS.items())}
    engine = cuda_engine(tiny_model_dir, lora={"adapters": {n: str(p) for n, (p, _) in made.items()}})
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (7, 40, 90, 23)]
    names = [None, *ADAPTERS]
    got = run(engine, list(zip(names, prompts)))
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert got[0] == hf_greedy(base, prompts[0], 24)[0]
    for name, prompt, tokens in zip(names[1:], prompts[1:], got[1:]):
        assert_greedy_agrees(made[name][1], prompt, tokens)
        assert tokens[:4] != hf_greedy(base, prompt, 4)[0], name
    # P/D between two CUDA engines, with an adapter: the tokens of one engine alone (alone: a
    # batch of other shapes may take other cuBLAS kernels, and part at a near-tie)
    prompt = prompts[2]
    alone = run(cuda_engine(tiny_model_dir, lora={"adapters": {n: str(p) for n, (p, _) in made.items()}}),
                [("all-rslora", prompt)])[0]
    prefill, decode = (cuda_engine(tiny_model_dir, lora={"adapters": {n: str(p) for n, (p, _) in made.items()}})
                       for _ in range(2))
    tokens, _, _ = hand_off(prefill, decode, prompt, "all-rslora")
    assert tokens == alone


def test_greedy_speculation_on_cuda_keeps_the_tokens(tiny_model_dir):
    """Verified proposals (an oracle's, and prompt lookup's) give the plain engine's greedy tokens."""
    prompts = workload()
    plain = engine_greedy(cuda_engine(tiny_model_dir), prompts, 48)
    for oracle in (True, False):
        engine = cuda_engine(tiny_model_dir, speculative=SPEC)
        if oracle:
            engine.speculator.proposer = OracleProposer(prompts, plain, k=SPEC["num_speculative_tokens"])
        assert engine_greedy(engine, prompts, 48) == plain
        stats = engine.stats()
        assert (stats.spec_accepted_tokens if oracle else stats.spec_verify_steps) > 0


def test_a_windowed_model_on_cuda_keeps_only_its_window(tmp_path, tokenizer_dir):
    """As test_model_parity's CPU test: 300 + 64 tokens through a window of 24 in 8 blocks."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path / "m", tokenizer_dir, architecture="mistral", sliding_window=24)
    engine = cuda_engine(model_dir, kv_cache_bytes=8 * 16 * 512, max_num_batched_tokens=32)
    assert engine.stats().num_blocks == 8
    prompt = torch.randint(3, 49152, (300,), generator=torch.Generator().manual_seed(9)).tolist()
    got, most_used = windowed_run(engine, prompt)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert got == hf_greedy(hf, prompt, 64)[0]
    assert most_used <= 5 and engine.stats().num_free_blocks == 8
