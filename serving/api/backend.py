"""What the API asks of whoever generates its tokens: the request it sends (GenerateRequest) and the
Backend protocol it sends it through. Nothing here knows HTTP or Ray.

    serving/api/generation/pipeline.py Frontend ──Backend.generate(GenerateRequest)──▶ RequestOutputs (token ids)
                                                   │
                           LocalBackend (serving/deployments/local_backend.py): an in-process
                           AsyncEngine, for tests and embedding
                           ServeBackend (serving/deployments/serve_backend.py): prefill/decode pools
                           behind Serve handles; it sends the request on as a WorkerRequest
                           (serving/deployments/messages.py)

A GenerateRequest carries ids and sampling params, no text: the ingress owns the text (the chat
template before, detokenizing and stop strings after), so a backend only schedules tokens.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from serving.engine.outputs import RequestOutput
from serving.engine.params import SamplingParams
from serving.engine.validation import ModelInfo

__all__ = ["GenerateRequest", "Backend"]


@dataclass
class GenerateRequest:
    """What the pipeline asks a Backend to generate: ids and sampling params, no text. The Serve
    backend sends it to the workers as a WorkerRequest (serving/deployments/messages.py)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    arrival_unix_s: float = field(default_factory=time.time)  # wall clock (time.time()), comparable across nodes
    lora_name: str | None = None  # the LoRA adapter it runs with (EngineConfig.lora); None: the base model
    # its PEFT directory, as the ingress knows it: a worker registers a name it has not heard of
    # (an adapter loaded at run time, POST /v1/load_lora_adapter) from here
    lora_path: str | None = None
    # Routing: the prompt's chained block hashes, computed once at the ingress with the engines'
    # block size and extra keys (router/index.py), and the session-affinity key (`user`).
    block_hashes: list[int] = field(default_factory=list)
    block_size: int = 16
    session: str | None = None
    # Set by the prefill pool's router (router/request_router.py): False when the prompt's new
    # blocks are worth less than what caching them would evict on the chosen replica.
    keep_cached: bool = True
    # The ingress span's W3C context (serving/observability/tracing.py), so workers continue the
    # trace; None when tracing is off.
    trace_context: dict[str, str] | None = None


class Backend(Protocol):
    async def model_info(self) -> ModelInfo: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Token-id outputs; raises engine errors (InvalidRequestError, ...) or APIErrors.
        Closing the iterator early aborts the request everywhere it runs."""
        ...

    async def health(self) -> dict[str, Any]:
        """Per pool, whether a replica is alive; raises NoWorkerError when one is not."""
        ...

    async def check_adapter(self, name: str, path: str) -> None:
        """Whether the PEFT LoRA adapter at `path` loads on the workers; raises
        InvalidRequestError naming `lora_path` (and the file and field) when it does not."""
        ...
