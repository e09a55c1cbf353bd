"""The engine on CUDA (skipped without a GPU): the PyTorch path gives the CPU's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from serving.engine import EngineConfig, LLMEngine, SamplingParams


@pytest.mark.gpu
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
