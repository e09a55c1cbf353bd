"""The KV hand-off between a prefill and a decode engine, timed step by step, against a memcpy.

The payload is a real one: the exporter's engine prefills a prompt with `hold_kv=True` and
`export_kv` copies it out of the paged cache. It then moves through the workers' own code (serving/deployments/kv_handoff.py:
KVHandoff.offer and claim), between two actors on this node:

    exporter actor                      KVTransfer actor        importer actor
    export_kv  (timed, not part of `transfer`: reported on its own)
    ray.put ─▶ offer(id, [ref]) ──────▶ held
                                        claim(id) ◀─────────── claim
                                        [ref] ───────────────▶ await ref (plasma mmap)
                                                               write_blocks into its
                                                               engine's cache

    transfer = put + offer + claim + get + write, each step timed in the process that runs it.

What it leaves out: the KVHandle's trip through the ingress between offer and claim (control
plane: the served TPOT of `kvrelay bench serve-overhead` holds it). The baseline is a plain
memory copy of the same number of bytes, `dst.copy_(src)` on uint8 tensors touched beforehand,
in the importer's process with its torch threads (one).
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
from dataclasses import dataclass, field

__all__ = ["KV_TRANSFER_STEPS", "KVExporter", "KVImporter", "KVTransferResult", "measure_kv_transfer"]

KV_TRANSFER_STEPS = ("put", "offer", "claim", "get", "write")
KV_APP_NAME = "kvrelay-bench-kv"  # names this node's KVTransfer actor, apart from any app's
KV_LEASE_S = 120.0


def _handoff():
    from serving.config import KVTransferConfig
    from serving.deployments.kv_handoff import KVHandoff

    return KVHandoff(KV_APP_NAME, KVTransferConfig(lease_s=KV_LEASE_S, timeout_s=30.0))


@dataclass
class KVTransferResult:
    num_tokens: int
    num_bytes: int
    steps_s: dict[str, list[float]]  # KV_TRANSFER_STEPS, one value per repeat
    export_s: list[float]  # export_kv's gather out of the paged cache (a copy), not in `transfer`
    memcpy_s: list[float]
    is_verified: bool  # the importer's blocks equal the payload (first repeat)
    info: dict = field(default_factory=dict)

    @property
    def transfer_s(self) -> list[float]:
        return [sum(parts) for parts in zip(*(self.steps_s[s] for s in KV_TRANSFER_STEPS))]

    @property
    def transfer_ms_p50(self) -> float:
        return statistics.median(self.transfer_s) * 1e3

    @property
    def transfer_with_export_ms_p50(self) -> float:
        return statistics.median(t + e for t, e in zip(self.transfer_s, self.export_s)) * 1e3

    @property
    def memcpy_ms_p50(self) -> float:
        return statistics.median(self.memcpy_s) * 1e3

    @property
    def export_ms_p50(self) -> float:
        return statistics.median(self.export_s) * 1e3

    def step_ms_p50(self, step: str) -> float:
        return statistics.median(self.steps_s[step]) * 1e3

    def to_json(self) -> dict:
        return {
            **dataclasses.asdict(self),
            "transfer_s": self.transfer_s,
            "timed_steps": list(KV_TRANSFER_STEPS),
            "steps_ms_p50": {s: self.step_ms_p50(s) for s in KV_TRANSFER_STEPS},
        }


class KVExporter:
    """Holds a real engine with one prefilled request whose KV is kept (hold_kv) for export."""

    def __init__(self, engine_config, prompt: list[int]):
        import ray

        from serving.engine.engine import LLMEngine
        from serving.engine.params import SamplingParams

        self.engine = LLMEngine(engine_config)
        self.engine.add_request("kv", params=SamplingParams(temperature=0.0, max_tokens=1), prompt_token_ids=prompt, hold_kv=True)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.kv = _handoff()

    # As EngineWorker._export_and_offer. This actor serves one call at a time, so running the
    # engine on the event loop blocks nobody.
    async def offer(self, request_id: str) -> dict:
        import ray

        t0 = time.perf_counter()
        payload = self.engine.export_kv("kv", release=False)
        t1 = time.perf_counter()
        ref = await asyncio.to_thread(ray.put, payload)
        t2 = time.perf_counter()
        await self.kv.offer(self.node_id, request_id, ref, payload.num_bytes)
        t3 = time.perf_counter()
        handle = self.kv.handle(request_id, self.node_id, payload.num_tokens, payload.num_bytes)
        return {
            "export": t1 - t0, "put": t2 - t1, "offer": t3 - t2, "handle": handle,
            "num_tokens": payload.num_tokens, "num_bytes": payload.num_bytes,
        }


class KVImporter:
    """A second real engine whose KV cache receives the payload, as a decode worker's does."""

    def __init__(self, engine_config):
        from serving.engine.engine import LLMEngine

        self.engine = LLMEngine(engine_config)  # sets this process's torch threads
        self.kv = _handoff()

    # As KVHandoff.fetch (claim, then get), then LLMEngine._write_import's write_blocks.
    async def claim_and_write(self, handle, verify: bool) -> dict:
        import torch

        await self.kv.actor(handle.node_id)  # looked up once per process, as a worker does
        t0 = time.perf_counter()
        refs = await self.kv.claim(handle)
        t1 = time.perf_counter()
        if not isinstance(refs, list):
            raise RuntimeError(f"the claim of {handle.request_id} got no payload: {refs}")
        payload = await refs[0]
        t2 = time.perf_counter()
        block_ids = list(range(payload.num_blocks))  # the engine is idle: every block is free
        self.engine.kv_cache.write_blocks(block_ids, payload.kv)
        t3 = time.perf_counter()
        is_equal = bool(torch.equal(self.engine.kv_cache.read_blocks(block_ids), payload.kv)) if verify else None
        return {"claim": t1 - t0, "get": t2 - t1, "write": t3 - t2, "is_equal": is_equal}

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


def measure_kv_transfer(engine_config, prompt: list[int], repeats: int) -> KVTransferResult:
    """One untimed transfer (it also checks the bytes arrive intact), then `repeats` timed ones
    and as many memcpys. Needs a running Ray; starts and kills its own actors."""
    import ray

    from serving.deployments import kv_transfer

    exporter = ray.remote(num_cpus=0.5)(KVExporter).remote(engine_config, prompt)
    importer = ray.remote(num_cpus=0.5)(KVImporter).remote(engine_config)
    try:
        samples = []
        for i in range(1 + repeats):
            request_id = f"kv-{i}"
            offered = ray.get(exporter.offer.remote(request_id))
            imported = ray.get(importer.claim_and_write.remote(offered["handle"], i == 0))
            samples.append({**offered, **imported})
        copy = ray.get(importer.memcpy.remote(samples[0]["num_bytes"], repeats))
        kv_transfer.kill_all(KV_APP_NAME)
    finally:
        for actor in (exporter, importer):
            ray.kill(actor)
    first, timed = samples[0], samples[1:]
    return KVTransferResult(
        num_tokens=first["num_tokens"], num_bytes=first["num_bytes"],
        steps_s={s: [t[s] for t in timed] for s in KV_TRANSFER_STEPS},
        export_s=[t["export"] for t in timed], memcpy_s=copy["memcpy_s"], is_verified=first["is_equal"],
        info={"importer_torch_threads": copy["torch_threads"], "memcpy": "dst.copy_(src), uint8, in the importer"},
    )
