"""The engine contract: what a worker replica asks of an engine, and the one request it sends.

    WorkerRequest ──messages.engine_request (once, in the worker)──▶ EngineRequest
    EngineClient.generate(EngineRequest) ──RequestOutput deltas──▶ worker ──▶ ingress

Two engines implement it: AsyncEngine (kvrelay's LLMEngine on a step thread, async_engine.py) and
VLLMEngine (vLLM's AsyncLLM, vllm/engine.py). The worker (serving/deployments/engine_worker.py)
and the in-process backend talk to `EngineClient` only, never to an engine's internals.

A third engine starts here. It implements every member of `EngineClient`:

- `generate(request)`: an async iterator of `RequestOutput` deltas (outputs.py), one choice per
  `params.n`, ending with one whose `finished` is True (finish_reason "stop", "length", "abort",
  or "queue_timeout" when it waited `max_queue_wait_s` for its first step: no tokens then). Its
  refusals (InvalidRequestError naming the field, ContextLengthError with both numbers) raise
  before the first output. A failure of this request alone raises RequestFailedError; an engine
  that can no longer serve raises EngineDeadError and turns `is_alive` False. Leaving the
  iteration early (a cancelled or closed iterator) aborts the request and frees what it held.
  `request.prior_output_token_ids` continue the output (they count towards max_tokens and are
  not emitted again); `max_tokens == 0` scores the prompt and ends with "length", no tokens.
- `abort(request_id)`: stop it now; its stream ends with finish_reason "abort". True if known.
- KV hand-off: with `hold_kv`, the prompt's KV stays after the request finishes until
  `export_kv` (release=True frees it) or `release_kv` / `release_kv_soon` (never blocks; safe in
  a `finally`). `export_into` is where the payload is written, of the kind `kv_export_target`
  says (a host tensor view of an arena range, or the range itself), only before
  `export_until_mono_s`; after it the export is a new payload. `kv_payload` imports KV computed
  elsewhere (an engine may recompute instead; the outputs are the same). `kv_payload_bytes(n)`
  is the size of the payload of an n-token prompt, so the worker can reserve a range first.
- `stats()`: an EngineStats snapshot, never blocking (the routers and the autoscaler read it).
- `model_info()`: the limits the ingress validates requests against (validation.ModelInfo),
  block_size being the one the engine runs (its blocks are the router's hash blocks).
- `subscribe_kv_events(callback)`: `callback(list[KVEvent])` for every block stored or evicted
  (kv/events.py), hashed as kv/block_hash.py does, so the router's index matches.
- `check_adapter(name, path)`: InvalidRequestError unless the PEFT adapter loads here.
- `tokenizer`, `is_alive`, `shutdown(timeout_s)`.

Invariants: request ids are unique among the requests an engine holds (a reused one is
InvalidRequestError "request_id"); every time field is on the node's `time.monotonic()` clock in
seconds (`*_mono_s`, RequestMetrics), the clock every process of a node shares, so a shared-memory
lease and a queue wait compare across processes; the request is validated once at the ingress,
and an engine checks only its own invariants again (validation.check_request).
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from serving.engine.params import SamplingParams

if TYPE_CHECKING:
    from serving.engine.kv.events import KVEvent
    from serving.engine.kv.payload import KVPayload
    from serving.engine.outputs import EngineStats, RequestOutput
    from serving.engine.validation import ModelInfo

__all__ = ["EngineClient", "EngineRequest", "KVExportTarget"]


@dataclass
class EngineRequest:
    """One request as an engine takes it: built once (the worker, from its WorkerRequest), read by
    every engine alike."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower runs first (the scheduler's tiers)
    # when the engine took it (time.monotonic()); None: the engine's clock as it adds the request
    arrival_mono_s: float | None = None
    cache_salt: str | None = None  # mixed into its blocks' hashes
    lora_name: str | None = None  # its LoRA adapter (EngineConfig.lora); None: the base model
    lora_path: str | None = None  # the adapter's PEFT directory, registered under lora_name first
    # False: the blocks it computes go to the prefix cache's eviction end when freed (the router's call)
    keep_cached: bool = True
    # prompt tokens the caller expects cached when it runs (the worker's view): until it is
    # scheduled, its queued prefill is the rest (EngineStats.num_queued_prefill_tokens)
    expected_cached_tokens: int = 0
    hold_kv: bool = False  # keep the prompt's KV after it finishes, for export_kv (prefill worker)
    # where the held KV is written as it finishes: a host tensor of exactly kv_payload_bytes bytes
    # (KVExportTarget.HOST_TENSOR) or a shared-memory range (SHM_RANGE); None: a new payload
    export_into: Any = None
    export_until_mono_s: float | None = None  # export_into is not written after this time
    kv_payload: KVPayload | None = None  # KV computed elsewhere, imported before its first step
    # tokens already generated elsewhere (a hand-off's first token, a resumed stream)
    prior_output_token_ids: list[int] = field(default_factory=list)


class KVExportTarget(enum.Enum):
    """What an engine's `export_into` is, so the worker reserves the right thing."""

    NONE = "none"  # no range: the payload leaves through Ray's object store
    HOST_TENSOR = "host_tensor"  # a host tensor viewing the node's arena range (the cache is in host memory)
    SHM_RANGE = "shm_range"  # the range's name (kv/payload.ShmRange): the cache is in another process


class EngineClient(Protocol):
    """What a worker replica asks of its engine (the module docstring says what each must do)."""

    kv_export_target: KVExportTarget

    @property
    def tokenizer(self) -> Any: ...

    @property
    def is_alive(self) -> bool: ...

    def model_info(self) -> ModelInfo: ...

    def stats(self) -> EngineStats: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> bool: ...

    def kv_payload_bytes(self, num_tokens: int) -> int: ...

    async def export_kv(self, request_id: str, *, release: bool = True) -> KVPayload: ...

    async def release_kv(self, request_id: str) -> bool: ...

    def release_kv_soon(self, request_id: str) -> None: ...

    def subscribe_kv_events(self, callback: Callable[[list[KVEvent]], None]) -> None: ...

    async def check_adapter(self, name: str, path: str) -> None: ...

    def shutdown(self, timeout_s: float = 10.0) -> None: ...
