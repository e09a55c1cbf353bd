"""Fixtures of the engine tests that need vLLM (.venv-vllm)."""

from __future__ import annotations

import asyncio

import pytest


@pytest.fixture(scope="package")
def vllm_engines(default_model_dir, needs_vllm):
    """Two vLLM engines that take part in hand-offs (a prefill and a decode one; fp32, 512 MiB of
    KV each) and the event loop their output handlers run on, shared by this package's vLLM tests
    (each starts in about half a minute) and stopped after them."""
    from serving.engine import EngineConfig
    from serving.engine.vllm.engine import VLLMEngine

    loop = asyncio.new_event_loop()
    config = EngineConfig(model=str(default_model_dir), dtype="float32", kv_cache_bytes=2**29, max_model_len=1024,
                          max_num_seqs=16, backend="vllm")
    prefill, decode = VLLMEngine(config, kv_handoff=True), VLLMEngine(config, kv_handoff=True)
    yield prefill, decode, loop
    prefill.shutdown()
    decode.shutdown()
    pending = asyncio.all_tasks(loop)  # vLLM's output handlers
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()
