"""The replica's side of a vLLM engine's P/D hand-off (the EngineCore's side is vllm_connector.py).

    VLLMEngine.generate            Handoffs                                 KVRelayConnector
    hold_kv, export_into? ──────▶  begin: a save into the arena's range     saves the prompt's
                                   (or a staging memfd of this replica's)   blocks, writes the
    the request's end ──────────▶  done: its receipt read; saved: held  ◀── receipt
    export_kv ──────────────────▶  export: a payload over the range (the
                                   arena's: offered in place), or a copy
                                   out of the staging range
    kv_payload ─────────────────▶  begin: checked (layout, tokens, size);   loads it before the
                                   a payload not in shared memory staged    first step, or fails
    the first output ───────────▶  done: not loaded (late, gone, another    and vLLM recomputes
                                   layout) is counted: num_expired_imports

Every check a request can fail is made before vLLM sees it, a 400 naming the field. A staging
memfd is closed with the request (or its export or release); nothing outlives its request but a
held save, which the worker exports or releases.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os

import torch

from serving.engine.errors import InvalidRequestError
from serving.engine.kv.payload import KVLayout, KVPayload, ShmRange

__all__ = ["Handoff", "Handoffs", "payload_bytes"]

logger = logging.getLogger(__name__)


def payload_bytes(layout: KVLayout, num_tokens: int) -> int:
    """A payload of `num_tokens` tokens in vLLM's blocks: every layer's K and V, whole blocks."""
    num_blocks = -(-num_tokens // layout.block_size)
    element_size = getattr(torch, layout.dtype).itemsize
    return num_blocks * layout.num_layers * 2 * layout.num_kv_heads * layout.block_size * layout.head_dim * element_size


@dataclasses.dataclass
class Handoff:
    """A request's hand-off in flight: what the connector was asked (vllm_connector.HandoffSpec),
    and this replica's staging memfd when the range is not the arena's."""

    spec: object
    staging_fd: int | None

    def params(self) -> dict:
        return self.spec.to_params()


@dataclasses.dataclass
class _Held:
    """A prefill's saved KV, until the worker exports or releases it."""

    range: ShmRange
    token_ids: list[int]
    layout: KVLayout
    staging_fd: int | None


class Handoffs:
    def __init__(self, layout: KVLayout, receipts_dir: str):
        self.layout = layout  # format "vllm": a saver's receipt names the exact one
        self._receipts_dir = receipts_dir
        self._receipts = itertools.count()
        self._held: dict[str, _Held] = {}  # saved KV by request id
        self.num_expired_imports = 0  # loads not made (late, gone, another layout): recomputed

    @property
    def num_held(self) -> int:
        return len(self._held)

    def begin(self, prompt: list[int], prior: list[int], hold_kv: bool, kv_payload: KVPayload | None,
              export_into: ShmRange | None, export_until_mono_s: float | None) -> Handoff | None:
        """What a request asks the connector to do (None: nothing), checked here."""
        from serving.engine.vllm.connector import HandoffSpec

        receipt = f"{self._receipts_dir}/receipt-{next(self._receipts)}"
        if hold_kv:
            num_bytes = payload_bytes(self.layout, len(prompt))
            staging = None
            if export_into is None:  # no arena range: a staging memfd of this replica's
                staging = _memfd(num_bytes)
                export_into = ShmRange(f"/proc/{os.getpid()}/fd/{staging}", 0, num_bytes)
            elif export_into.num_bytes != num_bytes:
                raise InvalidRequestError("export_into", f"needs {num_bytes} bytes for {len(prompt)} tokens, "
                                          f"not {export_into.num_bytes}")
            return Handoff(HandoffSpec("save", export_into, len(prompt), receipt, export_until_mono_s), staging)
        layout = kv_payload.layout
        if dataclasses.replace(layout, format="vllm") != self.layout or not layout.format.startswith("vllm/"):
            raise InvalidRequestError("kv_payload", f"layout {layout} is not this vLLM engine's ({self.layout})")
        num_tokens = kv_payload.num_tokens
        if num_tokens >= len(prompt) + len(prior) or (prompt + prior)[:num_tokens] != kv_payload.token_ids:
            raise InvalidRequestError("kv_payload", "its tokens are not a proper prefix of this request's")
        num_bytes = payload_bytes(self.layout, num_tokens)
        if kv_payload.num_bytes != num_bytes:
            raise InvalidRequestError("kv_payload", f"{kv_payload.num_bytes} bytes for {num_tokens} tokens, not {num_bytes}")
        source, staging = kv_payload.shm, None
        if source is None:  # not in shared memory (Ray's object store, another node): staged once
            staging = _memfd(num_bytes)
            source = ShmRange(f"/proc/{os.getpid()}/fd/{staging}", 0, num_bytes)
            source.tensor().copy_(kv_payload.kv.reshape(-1).view(torch.uint8))  # the bytes as they are
        return Handoff(HandoffSpec("load", source, num_tokens, receipt, kv_payload.readable_until, layout.format), staging)

    def done(self, request_id: str, handoff: Handoff, prompt: list[int], *, finished: bool) -> None:
        """The connector's copy is over (a load's before the first output, a save's by the last):
        its receipt read, a save of a finished request held for export; its staging goes with
        anything else."""
        from serving.engine.vllm.connector import read_receipt

        spec = handoff.spec
        receipt = read_receipt(spec.receipt)
        if spec.op == "load":
            if receipt is None or receipt[0] not in ("loaded", "cached"):
                self.num_expired_imports += 1
                logger.warning("the KV handed to %s was not loaded (%s): vLLM computed its prompt",
                               request_id, receipt[1] if receipt else "too late, or never scheduled")
        elif finished and receipt is not None and receipt[0] == "saved":
            layout = dataclasses.replace(self.layout, format=receipt[1])
            self._held[request_id] = _Held(spec.range, list(prompt), layout, handoff.staging_fd)
            return
        elif finished:
            logger.warning("the KV of %s was not saved for its hand-off (%s): its decode recomputes it", request_id,
                           receipt[1] if receipt else "its lease ran out, or it was never computed")
        _close(handoff.staging_fd)

    def export(self, request_id: str, *, release: bool = True) -> KVPayload:
        """A held save as a payload: over the range it was saved into (the arena's: the worker
        offers the range itself), or a copy out of this replica's staging range. KeyError when
        nothing was saved."""
        held = self._held.pop(request_id) if release else self._held[request_id]
        num_blocks = -(-len(held.token_ids) // held.layout.block_size)
        kv = held.range.tensor().view(getattr(torch, held.layout.dtype)).view(held.layout.num_layers, num_blocks, -1)
        if held.staging_fd is None:
            return KVPayload(request_id, held.token_ids, held.layout, kv, shm=held.range)
        payload = KVPayload(request_id, held.token_ids, held.layout, kv.clone())
        if release:
            _close(held.staging_fd)
        return payload

    def release(self, request_id: str) -> bool:
        held = self._held.pop(request_id, None)
        if held is not None:
            _close(held.staging_fd)
        return held is not None


def _memfd(num_bytes: int) -> int:
    """A staging range's memory (no file system: /dev/shm's size does not bound it)."""
    fd = os.memfd_create("kvrelay-vllm-kv", os.MFD_CLOEXEC)
    os.ftruncate(fd, num_bytes)
    return fd


def _close(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)
