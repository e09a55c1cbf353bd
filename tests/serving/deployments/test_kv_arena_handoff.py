"""The KV hand-off through the node's shared-memory arena, end to end in one process: two real
engine workers (prefill and decode), the real KVTransfer class behind a stand-in for its Ray
actor handle. Only leases cross; the decode engine reads the
range in place and continues with exactly the tokens of a single engine; the range is free
afterwards; a claim from another node gets a copy; a full arena or an arena-less app goes
through the object store path, with the same tokens."""

from __future__ import annotations

import asyncio

import pytest
import torch

from serving.config import KVTransferConfig
from serving.deployments import engine_worker, kv_handoff, kv_transfer
from serving.deployments.engine_worker import EngineWorker
from serving.deployments.kv_transfer import KVTransfer
from serving.deployments.messages import WorkerRequest
from serving.engine import LLMEngine, SamplingParams
from tests.helpers import tiny_engine_config


class _Ref:
    """What the fake ray.put returns: awaitable, like an ObjectRef."""

    def __init__(self, value):
        self.value = value

    def __await__(self):
        return self.value
        yield  # makes this a generator


class _Method:
    def __init__(self, target, name, calls):
        self.target, self.name, self.calls = target, name, calls

    def remote(self, *args):
        self.calls.append(self.name)
        return getattr(self.target, self.name)(*args)


class _Ready:
    def remote(self):
        async def ready():
            return True

        return ready()


class LocalActor:
    """A KVTransfer called like its Ray actor handle (`actor.method.remote(...)` is awaitable)."""

    __ray_ready__ = _Ready()

    def __init__(self, transfer: KVTransfer):
        self.transfer = transfer
        self.calls: list[str] = []

    def __getattr__(self, name):
        return _Method(self.transfer, name, self.calls)


@pytest.fixture
def actors(monkeypatch):
    """One KVTransfer per node id (its arena in this process); Ray's object store faked."""
    made: dict[str, LocalActor] = {}

    def get_or_create(app_name, node_id, arena_bytes=0):
        if node_id not in made:
            made[node_id] = LocalActor(KVTransfer(app_name, node_id, arena_bytes))
        return made[node_id]

    monkeypatch.setattr(kv_handoff, "get_or_create", get_or_create)
    monkeypatch.setattr(kv_transfer, "_MIN_ARENA_BYTES", 4096)
    monkeypatch.setattr(kv_transfer.ray, "put", _Ref)
    monkeypatch.setattr(engine_worker.ray, "put", _Ref)
    return made


def workers(model_dir, arena_mib: int, decode_node: str = "node-a") -> tuple[EngineWorker, EngineWorker]:
    config = tiny_engine_config(model_dir)
    kv = KVTransferConfig(lease_s=30.0, timeout_s=5.0, arena_mib=arena_mib)
    prefill, decode = EngineWorker("prefill", config, kv, "app"), EngineWorker("decode", config, kv, "app")
    prefill._node_id, decode._node_id = "node-a", decode_node
    return prefill, decode


PROMPT = torch.randint(3, 49152, (75,), generator=torch.Generator().manual_seed(5)).tolist()
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)


def expected_tokens(model_dir) -> list[int]:
    engine = LLMEngine(tiny_engine_config(model_dir))
    return engine.generate([PROMPT], PARAMS)[0].outputs[0].token_ids


async def hand_off(prefill: EngineWorker, decode: EngineWorker, request_id: str = "r1") -> list[int]:
    request = WorkerRequest(request_id, PROMPT, PARAMS)
    first = await prefill.prefill(request)
    await asyncio.gather(*prefill._offers)
    prior = first.output.outputs[0].token_ids
    rest = []
    async for out in decode.generate(request, first.kv, prior):
        rest += out.outputs[0].token_ids
    for _ in range(3):  # the done / release calls run in the background
        await asyncio.gather(*decode.kv._background, *prefill.kv._background)
    return prior + rest


def test_a_same_node_hand_off_goes_through_the_arena_in_place(tiny_model_dir, actors):
    prefill, decode = workers(tiny_model_dir, arena_mib=1)

    async def main():
        return [await hand_off(prefill, decode, f"r{i}") for i in range(3)]

    try:
        results = asyncio.run(main())
    finally:
        prefill.shutdown()
        decode.shutdown()
    expected = expected_tokens(tiny_model_dir)
    assert results == [expected] * 3
    transfer = actors["node-a"].transfer
    stats = asyncio.run(transfer.stats())
    payload_bytes = prefill.engine.kv_payload_bytes(75)
    # 1 MiB less the header page that holds the arena's id
    assert (stats.arena_bytes, stats.num_arena_offers, stats.num_claimed, stats.num_arena_copies) == ((1 << 20) - 4096, 3, 3, 0)
    assert stats.bytes_offered == 3 * payload_bytes and stats.num_held == 0
    assert stats.arena_free_bytes == stats.arena_bytes  # every range done and free
    # Only leases crossed: no object-store offer at all, and one reserve / offer / claim / done each.
    assert sorted(set(actors["node-a"].calls)) == ["claim", "done", "offer_slot", "reserve"]
    assert actors["node-a"].calls.count("done") == 3
    assert decode.engine.stats().num_expired_imports == 0
    assert (decode.recorder.counters.num_kv_imports, decode.recorder.counters.num_kv_fallbacks) == (3, 0)


def test_a_claim_from_another_node_gets_a_copy_and_frees_the_range(tiny_model_dir, actors):
    prefill, decode = workers(tiny_model_dir, arena_mib=1, decode_node="node-b")
    try:
        tokens = asyncio.run(hand_off(prefill, decode))
    finally:
        prefill.shutdown()
        decode.shutdown()
    assert tokens == expected_tokens(tiny_model_dir)
    stats = asyncio.run(actors["node-a"].transfer.stats())
    assert (stats.num_arena_offers, stats.num_arena_copies, stats.arena_free_bytes) == (1, 1, (1 << 20) - 4096)
    assert "done" not in actors["node-a"].calls  # the actor copied it out and freed it itself


@pytest.mark.parametrize("arena_mib", [0, 1])
def test_without_room_in_the_arena_the_kv_goes_through_the_object_store(tiny_model_dir, actors, arena_mib):
    prefill, decode = workers(tiny_model_dir, arena_mib=arena_mib)

    async def main():
        if arena_mib:  # another request holds all but one page (this payload needs 10)
            actor = await prefill.kv.actor("node-a")
            assert actor.transfer.allocator.reserve("other", (1 << 20) - 2 * 4096, 60.0) is not None
        return await hand_off(prefill, decode)

    try:
        tokens = asyncio.run(main())
    finally:
        prefill.shutdown()
        decode.shutdown()
    assert tokens == expected_tokens(tiny_model_dir)
    calls = actors["node-a"].calls
    assert "offer" in calls and "offer_slot" not in calls and "done" not in calls
    stats = asyncio.run(actors["node-a"].transfer.stats())
    assert stats.num_arena_offers == 0 and stats.num_claimed == 1
    assert stats.num_arena_full == (1 if arena_mib else 0)


def test_a_release_frees_an_offered_range_at_once_and_quarantines_one_being_written(tiny_model_dir, actors):
    prefill, _ = workers(tiny_model_dir, arena_mib=1)

    async def main():
        transfer = None
        for request_id in ("offered", "writing"):
            result = await prefill.prefill(WorkerRequest(request_id, PROMPT, PARAMS))
            assert result.kv is not None  # it goes on to decode: its range is in use
            transfer = actors["node-a"].transfer
            assert transfer.allocator.free_bytes < transfer.arena.capacity
            if request_id == "offered":
                await asyncio.gather(*prefill._offers)
            await prefill.kv.release("node-a", request_id)  # the client left before the claim
            await asyncio.gather(*prefill._offers)
            await asyncio.gather(*prefill.kv._background)
            if request_id == "offered":  # nobody holds an offered range: free at once
                assert transfer.allocator.free_bytes == transfer.arena.capacity
        return transfer

    try:
        transfer = asyncio.run(main())
    finally:
        prefill.shutdown()
    # Released before its offer (as far as the actor knows, the writer may still be copying):
    # quarantined, its offer refused, nothing held.
    assert transfer.allocator.num_quarantined == 1
    assert transfer.allocator.free_bytes == transfer.arena.capacity - 10 * 4096
    stats = asyncio.run(transfer.stats())
    assert (stats.num_arena_offers, stats.num_held, stats.num_claimed) == (1, 0, 0)


def test_a_prompt_that_stops_at_its_first_token_gives_its_range_back_at_once(tiny_model_dir, actors):
    """Finished at the prefill worker: its engine's gather is over, so the range is free at once
    (no quarantine holding arena space for 30 s)."""
    first = expected_tokens(tiny_model_dir)[0]
    prefill, _ = workers(tiny_model_dir, arena_mib=1)

    async def main():
        params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[first])
        result = await prefill.prefill(WorkerRequest("r1", PROMPT, params))
        assert result.kv is None and result.output.outputs[0].finish_reason == "stop"
        await asyncio.gather(*prefill.kv._background)
        return actors["node-a"].transfer

    try:
        transfer = asyncio.run(main())
    finally:
        prefill.shutdown()
    assert actors["node-a"].calls == ["reserve", "release_slot"]
    assert transfer.allocator.free_bytes == transfer.arena.capacity and transfer.allocator.num_quarantined == 0


def test_each_first_output_says_what_its_engine_held_as_the_request_arrived(tiny_model_dir, actors):
    """What the ingress checks its router's prediction against (serving/observability/request_path.py):
    the 75-token prompt's 4 whole blocks can be hits (its last token is always computed)."""
    from dataclasses import replace

    from serving.deployments.messages import WorkerOutput
    from serving.engine.kv.block_hash import hash_blocks

    prefill, decode = workers(tiny_model_dir, arena_mib=1)
    prefill.replica, decode.replica = "p1", "d1"
    hashes = hash_blocks(PROMPT, 16)

    async def main():
        request = WorkerRequest("a", PROMPT, PARAMS, block_hashes=hashes)
        cold = await prefill.prefill(request)
        await asyncio.gather(*prefill._offers)
        imported = [out async for out in decode.generate(request, cold.kv, cold.output.outputs[0].token_ids)]
        for _ in range(3):
            await asyncio.gather(*decode.kv._background, *prefill.kv._background)
        warm = await prefill.prefill(WorkerRequest("b", PROMPT, replace(PARAMS, max_tokens=1), block_hashes=hashes))
        return cold, imported, warm

    try:
        cold, imported, warm = asyncio.run(main())
    finally:
        prefill.shutdown()
        decode.shutdown()
    assert (cold.admission.replica, cold.admission.num_held_tokens, cold.admission.num_pending_tokens) == ("p1", 0, 0)
    assert cold.output.num_cached_tokens == 0
    assert (warm.admission.num_held_tokens, warm.admission.num_pending_tokens, warm.output.num_cached_tokens) == (64, 64, 64)
    assert isinstance(imported[0], WorkerOutput) and not any(isinstance(out, WorkerOutput) for out in imported[1:])
    assert (imported[0].admission.replica, imported[0].admission.imported) == ("d1", True)
