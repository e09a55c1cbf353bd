"""LoRA across a P/D hand-off between two workers (Ray faked as in test_kv_arena_handoff): an
adapter neither worker was configured with arrives with its path on the request (a runtime load,
POST /v1/load_lora_adapter), both register it, and the tokens are those of one engine with the
adapter; the workers check a path before it is served, and report what they hold to the routers."""

from __future__ import annotations

import asyncio

import pytest

from router.replica_stats import RoutingStats
from serving.config import KVTransferConfig
from serving.deployments.engine_worker import EngineWorker
from serving.deployments.messages import WorkerErrorKind, WorkerRequest
from serving.engine import LLMEngine
from tests.helpers import tiny_engine_config
from tests.serving.deployments.test_kv_arena_handoff import PARAMS, PROMPT, actors

__all__ = ["actors"]  # the fixture, used by name

pytest.importorskip("peft")


def test_an_adapter_loaded_at_run_time_crosses_the_hand_off(tiny_model_dir, actors, tmp_path):
    from tests.serving.engine.test_lora import make_adapter

    path = str(tmp_path / "late")
    make_adapter(tiny_model_dir, path, 8, 16, ["q_proj", "v_proj", "gate_proj"], False, seed=21)
    config = tiny_engine_config(tiny_model_dir, lora={"allow_runtime_updates": True})
    reference = LLMEngine(tiny_engine_config(tiny_model_dir, lora={"adapters": {"late": path}}))
    reference.add_request("ref", params=PARAMS, prompt_token_ids=PROMPT, lora_name="late")
    expected = []
    while reference.has_unfinished_requests():
        for out in reference.step():
            expected += out.outputs[0].token_ids
    kv = KVTransferConfig(lease_s=30.0, timeout_s=5.0, arena_mib=1)
    prefill, decode = EngineWorker("prefill", config, kv, "app"), EngineWorker("decode", config, kv, "app")
    prefill._node_id = decode._node_id = "node-a"

    async def main():
        for worker in (prefill, decode):
            assert await worker.check_adapter("late", path) is None
            bad = await worker.check_adapter("late", str(tmp_path / "missing"))
            assert (bad.kind, bad.param) == (WorkerErrorKind.INVALID, "lora_path") and "adapter_config.json not found" in bad.message
        request = WorkerRequest("r1", PROMPT, PARAMS, lora_name="late", lora_path=path)
        first = await prefill.prefill(request)
        await asyncio.gather(*prefill._offers)
        tokens = list(first.output.outputs[0].token_ids)
        async for out in decode.generate(request, first.kv, list(tokens)):
            tokens += out.outputs[0].token_ids
        for _ in range(3):  # the done / release calls run in the background
            await asyncio.gather(*decode.kv._background, *prefill.kv._background)
        return tokens

    try:
        tokens = asyncio.run(main())
        stats = [RoutingStats.from_wire(worker.routing_stats().to_wire()) for worker in (prefill, decode)]
    finally:
        prefill.shutdown()
        decode.shutdown()
    assert tokens == expected
    for routing in stats:  # what the routers read: resident, and what its load took
        assert routing.lora_resident == ("late",) and routing.lora_load_s > 0
