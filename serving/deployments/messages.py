"""Every type that crosses a Ray boundary, in one place.

    ingress ──WorkerRequest──▶ PrefillWorker.prefill ──PrefillResult (first token, KVHandle, Admission) | WorkerError──▶ ingress
    ingress ──WorkerRequest, KVHandle, prior tokens──▶ DecodeWorker.generate
                                       ──WorkerOutput (the first), RequestOutput ... | WorkerError (a stream)──▶ ingress
    prefill worker ──reserve(request id, bytes)──▶ KVTransfer (its node's actor) ──KVSlot | None──▶
    prefill worker ──offer_slot(KVSlot described) | offer(request id, [ref to a KVPayload], ...)──▶ KVTransfer
    decode worker  ──claim(request id, wait, node)──▶ KVTransfer ──KVSlot | KVCopy | [ref] | ClaimMiss──▶
    decode worker  ──done(KVSlot)──▶ KVTransfer
    any caller ──model_info()──▶ ModelInfo        ──stats()──▶ WorkerStats | KVTransferStats
    worker ──record_routing_stats──▶ Serve controller ──▶ each router: RoutingStats
    worker ──record_autoscaling_stats──▶ Serve controller ──▶ the pool's policy: ReplicaSignals
    ingress ──ForwardedRequest──▶ the fallback app's ingress ──ResponseStart, body bytes──▶ ingress

Defined here: what only the deployments send. Defined in a lower layer, because that layer builds
or reads them and may not import this one, and named here so this list is complete:

    SamplingParams, RequestOutput, EngineStats, KVPayload, ModelInfo   serving/engine
    WorkerCounters                                                   serving/observability/worker_metrics.py
    Admission                                                        serving/observability/request_path.py
    RoutingStats                                                     router/replica_stats.py
    ReplicaSignals                                                   router/autoscaling/decide.py
    GenerateRequest (WorkerRequest's fields), ForwardedRequest,
    ResponseStart                                                    serving/api

Errors cross as values (WorkerError), never raised: Ray would wrap and re-type them. Two
messages go through Serve's controller, which unpickles them without our packages on its path:
routing stats and autoscaling signals are plain dicts on the wire, written and read only by
their classes' `to_wire` / `from_wire`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from enum import Enum
from typing import Any, NamedTuple

from router.autoscaling.decide import ReplicaSignals
from router.replica_stats import RoutingStats
from serving.api.admission.forwarding import ForwardedRequest, ResponseStart
from serving.api.backend import GenerateRequest
from serving.deployments.kv_arena import Lease
from serving.engine.contract import EngineRequest
from serving.engine.errors import ContextLengthError, EngineDeadError, InvalidRequestError, RequestFailedError
from serving.engine.kv.payload import KVLayout, KVPayload
from serving.engine.outputs import EngineStats, RequestOutput
from serving.engine.params import SamplingParams
from serving.engine.validation import ModelInfo
from serving.observability.request_path import Admission
from serving.observability.worker_metrics import WorkerCounters

__all__ = [
    # defined here
    "Caller", "ClaimMiss", "KVCopy", "KVHandle", "KVSlot", "KVTransferStats", "PrefillResult", "WorkerError", "WorkerErrorKind",
    "WorkerOutput", "WorkerRequest", "WorkerStats", "engine_request",
    # defined below this layer
    "Admission", "EngineStats", "ForwardedRequest", "GenerateRequest", "KVPayload", "ModelInfo", "ReplicaSignals", "RequestOutput",
    "ResponseStart", "RoutingStats", "SamplingParams", "WorkerCounters",
]


# ---- ingress → worker --------------------------------------------------------------------------
class Caller(NamedTuple):
    """An ingress replica, by its Ray actor name and namespace (serving/deployments/caller_watch.py)."""

    actor_name: str
    namespace: str


@dataclass
class WorkerRequest(GenerateRequest):
    """A GenerateRequest as the Serve backend sends it: with the ingress replica that sent it,
    whose death makes the workers abort it (None outside a named actor: tests, local use)."""

    caller: Caller | None = None

    @classmethod
    def sent_by(cls, request: GenerateRequest, caller: Caller | None) -> WorkerRequest:
        return cls(**{f.name: getattr(request, f.name) for f in fields(GenerateRequest)}, caller=caller)


def engine_request(request: GenerateRequest, **extra: Any) -> EngineRequest:
    """The one EngineRequest (serving/engine/contract.py) a worker, or the in-process backend,
    hands its engine for `request`; `extra` is what that worker adds or changes (a prefill's one
    token and hold_kv, a decode's KV payload and prior tokens). The ingress's wall-clock arrival
    stays behind: an engine's arrival is on its own monotonic clock, as it takes the request."""
    extra.setdefault("params", request.params)
    return EngineRequest(
        request.request_id, request.prompt_token_ids, priority=request.priority, cache_salt=request.cache_salt,
        lora_name=request.lora_name, lora_path=request.lora_path, keep_cached=request.keep_cached, **extra,
    )


@dataclass(frozen=True)
class KVHandle:
    """Where a request's exported KV waits (serving/deployments/kv_transfer.py): small, travels
    with the request from the prefill worker through the ingress to the decode worker."""

    request_id: str
    node_id: str  # its node's KVTransfer actor holds it (kv_transfer.actor_name)
    num_tokens: int
    num_bytes: int


@dataclass(frozen=True)
class KVSlot:
    """A request's KV in its node's shared-memory arena (serving/deployments/kv_arena.py): the
    range and its lease cross Ray, the bytes never do. Copies into or out of the range start
    before `deadline` (the node's time.monotonic(), one clock for every process of the node);
    the arena keeps a range that ran out in quarantine long enough for such a copy to end."""

    path: str
    lease: Lease
    deadline: float
    # What the bytes are, set by the writer when it offers them: KVPayload's fields.
    token_ids: tuple[int, ...] = ()
    layout: KVLayout | None = None
    shape: tuple[int, ...] = ()
    arena_id: bytes = b""  # the arena's random id (kv_arena.ArenaFile): a reused path is refused

    def described(self, payload: KVPayload) -> KVSlot:
        return replace(self, token_ids=tuple(payload.token_ids), layout=payload.layout, shape=tuple(payload.kv.shape))


@dataclass(frozen=True)
class KVCopy:
    """An arena range copied into Ray's object store for a decode worker on another node: a ref
    to the raw bytes (a numpy uint8 array), and what they are."""

    ref: Any  # ray.ObjectRef
    token_ids: tuple[int, ...]
    layout: KVLayout
    shape: tuple[int, ...]


# ---- worker → ingress --------------------------------------------------------------------------
@dataclass
class PrefillResult:
    output: RequestOutput  # the first token; `finished` when the request needs no decode
    kv: KVHandle | None  # None when finished
    replica: str = ""  # which prefill replica computed it (Serve's replica id)
    admission: Admission | None = None  # what the worker saw as the request arrived


@dataclass
class WorkerOutput(RequestOutput):
    """A decode (or colocated) worker's first output of a request, with what it saw as the request
    arrived: the ingress checks its router's prediction against the engine's hit, and splits the
    request's TTFT, with it (serving/observability/request_path.py). The outputs after it are
    plain RequestOutputs."""

    admission: Admission | None = None

    @classmethod
    def first(cls, output: RequestOutput, admission: Admission) -> WorkerOutput:
        return cls(**{f.name: getattr(output, f.name) for f in fields(RequestOutput)}, admission=admission)


class WorkerErrorKind(str, Enum):
    INVALID = "invalid"  # InvalidRequestError: 400, naming the field
    CONTEXT_LENGTH = "context_length"  # ContextLengthError: 400, with both numbers
    FAILED = "failed"  # RequestFailedError: this request alone failed in a step (500)
    DEAD = "dead"  # EngineDeadError: the replica's step loop stopped (503)
    INTERNAL = "internal"  # anything else (500)


@dataclass
class WorkerError:
    """An error a worker returns as a value; the ingress raises the engine's exception again, so a
    remote engine fails exactly as a local one does."""

    kind: WorkerErrorKind
    message: str
    param: str | None = None
    num_tokens: int | None = None
    limit: int | None = None

    @classmethod
    def from_exception(cls, exc: BaseException) -> WorkerError:
        if isinstance(exc, ContextLengthError):
            return cls(WorkerErrorKind.CONTEXT_LENGTH, exc.message, exc.param, exc.num_tokens, exc.limit)
        if isinstance(exc, InvalidRequestError):
            return cls(WorkerErrorKind.INVALID, exc.message, exc.param)
        if isinstance(exc, RequestFailedError):
            return cls(WorkerErrorKind.FAILED, str(exc))
        if isinstance(exc, EngineDeadError):
            return cls(WorkerErrorKind.DEAD, str(exc))
        return cls(WorkerErrorKind.INTERNAL, f"{type(exc).__name__}: {exc}")

    def to_exception(self) -> Exception:
        kind = self.kind
        if kind is WorkerErrorKind.CONTEXT_LENGTH:
            return ContextLengthError(self.param or "messages", self.message, num_tokens=self.num_tokens or 0, limit=self.limit or 0)
        if kind is WorkerErrorKind.INVALID:
            return InvalidRequestError(self.param or "request", self.message)
        if kind is WorkerErrorKind.FAILED:
            return RequestFailedError(self.message)
        if kind is WorkerErrorKind.DEAD:
            return EngineDeadError(self.message)
        return RuntimeError(self.message)


@dataclass(frozen=True)
class WorkerStats:
    """A worker replica's `stats()`: who it is, its engine's figures, its hand-off counts."""

    role: str
    pid: int
    node_id: str
    engine: EngineStats
    counters: WorkerCounters

    def flat(self) -> dict[str, Any]:
        """One level, for a report (JSON): who, then the engine's and the counters' fields."""
        return {"role": self.role, "pid": self.pid, "node_id": self.node_id,
                **asdict(self.engine), **asdict(self.counters)}


# ---- the KVTransfer actor ----------------------------------------------------------------------
class ClaimMiss(str, Enum):
    """Why a claim got no payload: the decode worker then recomputes the prompt."""

    TIMEOUT = "timeout"  # not offered within the wait
    RELEASED = "released"  # released first (the client left)
    EXPIRED = "expired"  # offered, but its lease ran out before the claim
    ERROR = "error"  # the actor or the object was lost (the decode side's verdict, never the actor's)


@dataclass(frozen=True)
class KVTransferStats:
    node_id: str
    num_held: int
    bytes_held: int
    num_offered: int
    num_claimed: int
    num_released: int
    num_expired: int
    num_missed: int  # claims that got nothing (timeout, released, expired)
    bytes_offered: int
    arena_bytes: int = 0  # the node's shared-memory arena (0: none; every hand-off goes through Ray)
    arena_free_bytes: int = 0
    num_arena_offers: int = 0  # hand-offs through the arena (the rest went through Ray's object store)
    num_arena_full: int = 0  # reservations refused for want of a free range (those went through Ray)
    num_arena_copies: int = 0  # arena ranges copied into Ray's object store for a claim from another node
