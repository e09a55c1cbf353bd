"""The KV hand-off between a prefill and a decode engine, timed step by step, against a memcpy.

The payload is a real one: the exporter's engine prefills a prompt with `hold_kv=True` and keeps
it. It then moves through the workers' own code (serving/deployments/kv_handoff.py: KVHandoff)
between two actors on this node, by either path EngineWorker takes, as in a served request:
the decode side's claim is already waiting at the KVTransfer actor when the prefill side offers
(the ingress calls the decode worker as soon as the first token is back; the export follows).

    arena (same node, the default)
    exporter actor                      KVTransfer actor        importer actor
    reserve(id, bytes) ───────────────▶ a range          (before the prefill: not in the hand-off)
                                        claim(id) ◀─────────── claim, waiting
    gather: export_kv into the range
    offer_slot(range) ────────────────▶ offered ─────────────▶ the claim returns the range
                                                               view: a tensor over the shared
                                                               memory, no copy
                                                               write_blocks from the view into
                                                               its engine's cache (scatter)
    hand-off = gather + handover (offer until the claim returns) + view + write

    object_store (no room in the arena, or another node)
    gather: export_kv (a new tensor)    claim(id) ◀─────────── claim, waiting
    ray.put ─▶ offer(id, [ref]) ──────▶ held ────────────────▶ [ref]
                                                               await ref (plasma mmap)
                                                               write_blocks
    hand-off = gather + put + handover + get + write

Each step is timed in the process that runs it, on the node's monotonic clock (one clock for
every process: the handover runs from one process to another). What it leaves out: the
KVHandle's trip through the ingress (control plane: the served TPOT of `kvrelay bench
serve-overhead` holds it), the arena reservation (before the prefill; reported on its own), and
the reader's `done` (in the background, after the write). The baseline is a plain memory copy of
the same number of bytes, `dst.copy_(src)` on uint8 tensors touched beforehand, in the
importer's process with its torch threads (one).
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
from dataclasses import dataclass, field

__all__ = ["KV_PATHS", "KV_TRANSFER_STEPS", "KVExporter", "KVImporter", "KVTransferResult", "measure_kv_transfer"]

# The steps of each path's hand-off, gather (export_kv out of the paged cache) first.
KV_TRANSFER_STEPS = {
    "arena": ("gather", "handover", "view", "write"),
    "object_store": ("gather", "put", "handover", "get", "write"),
}
KV_PATHS = tuple(KV_TRANSFER_STEPS)
KV_APP_NAME = "kvrelay-bench-kv"  # names this node's KVTransfer actor, apart from any app's
KV_LEASE_S = 120.0
_CLAIM_HEAD_START_S = 0.05  # the claim waits at the actor before the offer, as in a served request


def _handoff(arena_mib: int):
    from serving.config import KVTransferConfig
    from serving.deployments.kv_handoff import KVHandoff

    return KVHandoff(KV_APP_NAME, KVTransferConfig(lease_s=KV_LEASE_S, timeout_s=30.0, arena_mib=arena_mib))


@dataclass
class KVTransferResult:
    num_tokens: int
    num_bytes: int
    steps_s: dict[str, list[float]]  # the path's steps, one value per repeat
    memcpy_s: list[float]
    is_verified: bool  # the importer's blocks equal the exporter's (first repeat)
    path: str = "arena"
    info: dict = field(default_factory=dict)

    @property
    def steps(self) -> tuple[str, ...]:
        return KV_TRANSFER_STEPS[self.path]

    @property
    def transfer_s(self) -> list[float]:
        """The whole hand-off of each repeat: gather + transfer + scatter."""
        return [sum(parts) for parts in zip(*(self.steps_s[s] for s in self.steps))]

    @property
    def transfer_ms_p50(self) -> float:
        return statistics.median(self.transfer_s) * 1e3

    @property
    def memcpy_ms_p50(self) -> float:
        return statistics.median(self.memcpy_s) * 1e3

    @property
    def fraction_of_memcpy(self) -> float:
        return self.memcpy_ms_p50 / self.transfer_ms_p50

    def step_ms_p50(self, step: str) -> float:
        return statistics.median(self.steps_s[step]) * 1e3

    def to_json(self) -> dict:
        return {
            **dataclasses.asdict(self),
            "transfer_s": self.transfer_s,
            "timed_steps": list(self.steps),
            "steps_ms_p50": {s: self.step_ms_p50(s) for s in self.steps},
        }


class KVExporter:
    """Holds a real engine with one prefilled request whose KV is kept (hold_kv) for export."""

    def __init__(self, engine_config, prompt: list[int], arena_mib: int):
        import ray

        from serving.engine.engine import LLMEngine
        from serving.engine.params import SamplingParams

        self.engine = LLMEngine(engine_config)
        self.engine.add_request("kv", params=SamplingParams(temperature=0.0, max_tokens=1), prompt_token_ids=prompt, hold_kv=True)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        self.num_tokens = len(prompt)
        self.node_id = ray.get_runtime_context().get_node_id()
        self.kv = _handoff(arena_mib)
        self._slots: dict = {}

    async def reserve(self, request_id: str, path: str) -> dict:
        """As EngineWorker.prefill before its engine runs (arena: the range); the handle the
        decode side claims with."""
        num_bytes = self.engine.kv_payload_bytes(self.num_tokens)
        await self.kv.actor(self.node_id)  # looked up once per process, as a worker does
        t0 = time.monotonic()
        if path == "arena":
            slot = await self.kv.reserve(self.node_id, request_id, num_bytes)
            if slot is None:
                raise RuntimeError("the KVTransfer actor has no arena room for the payload")
            self._slots[request_id] = slot
        return {"reserve": time.monotonic() - t0, "handle": self.kv.handle(request_id, self.node_id, self.num_tokens, num_bytes)}

    # As EngineWorker._export_and_offer (the gather runs on the step thread there). This actor
    # serves one call at a time, so running the engine on the event loop blocks nobody.
    async def offer(self, request_id: str, path: str) -> dict:
        import ray

        t0 = time.monotonic()
        if path == "arena":
            slot = self._slots.pop(request_id)
            payload = self.engine.export_kv("kv", release=False, into=self.kv.arena(slot))
            t1 = time.monotonic()
            if not await self.kv.offer_slot(self.node_id, slot.described(payload)):
                raise RuntimeError(f"the arena offer of {request_id} was refused")
            times = {"gather": t1 - t0, "offered_from": t1}
        else:
            payload = self.engine.export_kv("kv", release=False)
            t1 = time.monotonic()
            ref = await asyncio.to_thread(ray.put, payload)
            t2 = time.monotonic()
            await self.kv.offer(self.node_id, request_id, ref, payload.num_bytes)
            times = {"gather": t1 - t0, "put": t2 - t1, "offered_from": t2}
        # Checked once, against a gather of its own into a new tensor (not the range itself).
        reference = self.engine.export_kv("kv", release=False).kv if request_id.endswith("-0") else None
        return {**times, "num_tokens": payload.num_tokens, "num_bytes": payload.num_bytes, "reference": reference}


class KVImporter:
    """A second real engine whose KV cache receives the payload, as a decode worker's does."""

    def __init__(self, engine_config, arena_mib: int):
        import ray

        from serving.engine.engine import LLMEngine

        self.engine = LLMEngine(engine_config)  # sets this process's torch threads
        self.node_id = ray.get_runtime_context().get_node_id()
        self.kv = _handoff(arena_mib)
        self._received: dict = {}

    # As KVHandoff.fetch: the claim (it waits for the offer), then the view or the get.
    async def claim(self, handle) -> dict:
        import torch

        from serving.deployments.messages import KVSlot
        from serving.engine.kv.payload import KVPayload

        await self.kv.actor(handle.node_id)  # looked up once per process, as a worker does
        answer = await self.kv.claim(handle, self.node_id)
        t0 = time.monotonic()
        if isinstance(answer, KVSlot):
            view = self.kv.arena(answer).view(getattr(torch, answer.layout.dtype)).view(answer.shape)
            payload = KVPayload(handle.request_id, list(answer.token_ids), answer.layout, view)
            times = {"view": time.monotonic() - t0}
        elif isinstance(answer, list):
            payload = await answer[0]
            times = {"get": time.monotonic() - t0}
        else:
            raise RuntimeError(f"the claim of {handle.request_id} got no payload: {answer}")
        self._received[handle.request_id] = (answer, payload)
        return {**times, "claimed_at": t0}

    # Then LLMEngine._write_import's write_blocks, and (arena; in the background in a worker) done.
    async def write(self, handle, reference) -> dict:
        import torch

        from serving.deployments.messages import KVSlot

        answer, payload = self._received.pop(handle.request_id)
        t0 = time.monotonic()
        block_ids = list(range(payload.num_blocks))  # the engine is idle: every block is free
        self.engine.kv_cache.write_blocks(block_ids, payload.kv)
        times = {"write": time.monotonic() - t0}
        is_equal = None
        if reference is not None:
            is_equal = bool(torch.equal(self.engine.kv_cache.read_blocks(block_ids), reference))
        del payload
        if isinstance(answer, KVSlot):
            actor = await self.kv.actor(handle.node_id)
            if not await actor.done.remote(answer):
                raise RuntimeError(f"the arena range of {handle.request_id} was reclaimed during the read")
        return {**times, "is_equal": is_equal}

    def memcpy(self, num_bytes: int, repeats: int) -> dict:
        import torch

        src = torch.ones(num_bytes, dtype=torch.uint8)
        dst = torch.zeros(num_bytes, dtype=torch.uint8)  # both touched: no first-fault cost
        dst.copy_(src)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        return {"memcpy_s": times, "torch_threads": torch.get_num_threads()}


def measure_kv_transfer(engine_config, prompt: list[int], repeats: int, path: str = "arena",
                        arena_mib: int = 256) -> KVTransferResult:
    """One untimed hand-off (it also checks the bytes arrive intact), then `repeats` timed ones
    by `path` and as many memcpys. Needs a running Ray; starts and kills its own actors."""
    import ray

    from serving.deployments import kv_transfer

    if path not in KV_TRANSFER_STEPS:
        raise ValueError(f"path must be one of {KV_PATHS}, got {path!r}")
    exporter = ray.remote(num_cpus=0.5)(KVExporter).remote(engine_config, prompt, arena_mib)
    importer = ray.remote(num_cpus=0.5)(KVImporter).remote(engine_config, arena_mib)
    try:
        samples = []
        for i in range(1 + repeats):
            request_id = f"kv-{path}-{i}"
            reserved = ray.get(exporter.reserve.remote(request_id, path))
            claimed = importer.claim.remote(reserved["handle"])  # waits at the actor for the offer
            time.sleep(_CLAIM_HEAD_START_S)
            offered = ray.get(exporter.offer.remote(request_id, path))
            received = ray.get(claimed)
            written = ray.get(importer.write.remote(reserved["handle"], offered.pop("reference")))
            handover = received["claimed_at"] - offered["offered_from"]
            samples.append({**reserved, **offered, **received, **written, "handover": handover})
        copy = ray.get(importer.memcpy.remote(samples[0]["num_bytes"], repeats))
        kv_transfer.kill_all(KV_APP_NAME)
    finally:
        for actor in (exporter, importer):
            ray.kill(actor)
    first, timed = samples[0], samples[1:]
    return KVTransferResult(
        num_tokens=first["num_tokens"], num_bytes=first["num_bytes"],
        steps_s={s: [t[s] for t in timed] for s in KV_TRANSFER_STEPS[path]},
        memcpy_s=copy["memcpy_s"], is_verified=first["is_equal"], path=path,
        info={
            "importer_torch_threads": copy["torch_threads"], "memcpy": "dst.copy_(src), uint8, in the importer",
            **({"reserve_s": [t["reserve"] for t in timed]} if path == "arena" else {}),  # before the prefill
        },
    )
