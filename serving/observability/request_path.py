"""What the ingress learns of one request's way through the pools, to show two things per request:
the prefix hit its router predicted against the one its engine found, and where its time to first
token went.

    ingress process                                               worker (the engine that computes
    ───────────────                                               the prompt)
    Frontend.generate ── PATHS.open(request id) ─▶ RequestPath
    request router (Serve's router loop) ── predicted(pool, Prediction: replica, cached tokens)
                                                     │            _took: Admission (what the engine
    ServeBackend / LocalBackend, first output back ──┤                    held as it arrived)
      computed(pool, output, admission, at)          │◀── PrefillResult / WorkerOutput carry it,
      placed(at)        (disaggregated)              │    with num_cached_tokens and the engine's
      decode_started(output, admission)              │    RequestMetrics
    RequestRecord.finish ── PATHS.close ─▶ IngressMetrics records the check and the split

A process-local table keyed by request id, because the router runs on Serve's own event loop in
this process (router/request_router.py), out of reach of any argument the ingress passes: it
finds the request's path by the id its WorkerRequest carries. A path lives from Frontend.generate
to its record's finish; a router's prediction for a request nobody follows is dropped.

The prefix check (`check_prefix`). P: the tokens the router expected the chosen replica to hold
(its prefix index, capped as the engine caps a hit: the last prompt token is always computed);
A: `num_cached_tokens` of the engine that computed the prompt. A == P is `exact` (reason `match`).
Otherwise, with what the worker saw as the request arrived (`Admission`: H leading tokens held,
F held or in the prompts of requests it was still computing):

    reassigned        Serve ran it on another replica than the router's first choice (its
                      replica was busy; Serve's FIFO queue gives a freed replica to the oldest
                      waiting request)
    prompt_logprobs   a miss: the request asked for prompt logprobs, which need the logits a
                      cached block does not hold (the engine looks nothing up)
    evicted_in_queue  a miss: the engine held the prefix when the request arrived (H >= P) and
                      evicted it before the request was scheduled
    in_flight         a miss: another request was computing the prefix when it arrived (F >= P)
                      and had not finished when it was scheduled
    stale             a miss: the engine did not hold the prefix when it arrived: the router's
                      view was older than an eviction, or counted a routed prompt the engine
                      did not keep
    unseen            a surprise hit (A > P): the engine held more than the router's view showed
                      (blocks computed after its last snapshot, or placed there by another router)

The TTFT split (`RequestPath.split`). Boundaries on the ingress's clock (time.monotonic), a
worker's engine times moved onto it by the difference of the two processes' wall-minus-monotonic
offsets (exact on one node, where both read the same clocks; across nodes it carries their wall
clocks' offset, as the trace's route span does):

    received ── queue ──▶ scheduled ── prefill ──▶ first token ── delivery ──▶ back at the ingress
    (ingress)             (the engine that computes the prompt)                  │ disaggregated:
                                                                   ── handoff ──▶ decode call placed
                                                                   ── delivery ─▶ first token out

    queue     received at the ingress → the engine scheduled the prompt's first chunk: tokenizing,
              routing, the handle call, the engine's queue
    prefill   scheduled → the engine's first token (every prefill chunk; the first token is
              sampled by the last one)
    handoff   disaggregated only: the prefill's result at the ingress → the decode call placed on
              a decode replica (the first token waits for it, so that a full decode pool refuses
              the request with a 429 before its first byte)
    delivery  the rest: the output's way back through Ray, and the pipeline to the first token

Each boundary is clamped between its neighbours (a clock offset across nodes must not make a
component negative), so the components sum to the TTFT the ingress measured, exactly. In kvrelay
the prefill step samples the first token and the KV moves after it leaves, so the KV transfer
and the first decode step are on the second token's path: for a disaggregated request whose KV
the decode pool imported, `decode_split` splits the decode call's placement → the second token
at the ingress into kv_transfer (the call reaching the decode replica, its claim: the wait for
the prefill's offer, the fetch), first_decode_step (the decode engine: arrival → its first token:
its queue, the scatter of the KV into its blocks, one step) and delivery.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serving.engine.outputs import RequestOutput

__all__ = [
    "Admission",
    "Prediction",
    "PrefixCheck",
    "RequestPath",
    "PathTable",
    "PATHS",
    "TTFT_COMPONENTS",
    "DECODE_COMPONENTS",
    "check_prefix",
    "clock_offset_s",
    "record_prediction",
    "split_between",
]

TTFT_COMPONENTS = ("queue", "prefill", "handoff", "delivery")
DECODE_COMPONENTS = ("kv_transfer", "first_decode_step", "delivery")


def clock_offset_s() -> float:
    """This process's wall clock minus its monotonic clock: what moves another process's
    monotonic times onto this one's (the difference of the two offsets)."""
    return time.time() - time.monotonic()


@dataclass(frozen=True)
class Admission:
    """What a worker saw as a request arrived, sent back with its first output: which replica, the
    leading prompt tokens its engine held, those held or in the prompts of requests it was still
    computing (both capped as a hit is), and its clock offset. `imported`: a decode worker took
    the prompt's KV from a prefill worker (its engine computed none of the prompt)."""

    replica: str
    num_held_tokens: int
    num_pending_tokens: int
    clock_offset_s: float
    imported: bool = False


@dataclass(frozen=True)
class Prediction:
    """A router's expectation for a request: the replica it chose first and the prompt tokens
    its prefix index says that replica holds, capped as the engine caps a hit."""

    policy: str
    replica: str
    num_tokens: int


@dataclass(frozen=True)
class PrefixCheck:
    pool: str
    num_prompt_tokens: int
    num_predicted_tokens: int
    num_cached_tokens: int
    outcome: str  # exact | miss | surprise
    reason: str  # match | reassigned | prompt_logprobs | evicted_in_queue | in_flight | stale | unseen
    replica: str = ""  # where it ran ("" when the worker did not say)

    @property
    def error_tokens(self) -> int:
        """|predicted - cached|: how far the prediction was off."""
        return abs(self.num_predicted_tokens - self.num_cached_tokens)


def check_prefix(
    pool: str, prediction: Prediction, admission: Admission | None, *, num_prompt_tokens: int,
    num_cached_tokens: int, needs_prompt_logprobs: bool = False,
) -> PrefixCheck:
    """The prediction against the hit the engine found, with the reason of a difference (module
    docstring)."""
    predicted, actual = prediction.num_tokens, num_cached_tokens
    replica = admission.replica if admission is not None else ""

    def check(outcome: str, reason: str) -> PrefixCheck:
        return PrefixCheck(pool, num_prompt_tokens, predicted, actual, outcome, reason, replica)

    if actual == predicted:
        return check("exact", "match")
    outcome = "miss" if actual < predicted else "surprise"
    if admission is not None and admission.replica and prediction.replica and admission.replica != prediction.replica:
        return check(outcome, "reassigned")
    if outcome == "surprise":
        return check(outcome, "unseen")
    if needs_prompt_logprobs:
        return check(outcome, "prompt_logprobs")
    if admission is None:
        return check(outcome, "unknown")
    if admission.num_held_tokens >= predicted:
        return check(outcome, "evicted_in_queue")
    if admission.num_pending_tokens >= predicted:
        return check(outcome, "in_flight")
    return check(outcome, "stale")


def split_between(boundaries: list[float]) -> list[float]:
    """The gaps between consecutive boundaries, each inner boundary clamped between the one before
    it and the last: non-negative, and summing to last - first exactly."""
    first, last = boundaries[0], boundaries[-1]
    clamped = [first]
    for b in boundaries[1:-1]:
        clamped.append(min(max(b, clamped[-1]), last))
    clamped.append(max(last, first))
    return [b - a for a, b in zip(clamped, clamped[1:])]


@dataclass
class RequestPath:
    """One GenerateRequest's path, as the ingress learns it. Written by the router (on Serve's
    router loop: one attribute store per decision) and by the backend; read when its record
    finishes. Times are the ingress's time.monotonic()."""

    request_id: str
    predictions: dict[str, Prediction] = field(default_factory=dict)  # by pool
    needs_prompt_logprobs: bool = False
    check: PrefixCheck | None = None
    pool: str | None = None  # the pool whose engine computed the prompt
    scheduled_at: float | None = None
    engine_first_token_at: float | None = None
    returned_at: float | None = None  # that engine's first output at the ingress
    placed_at: float | None = None  # disaggregated: the decode call placed on a replica
    decode_arrived_at: float | None = None  # the decode engine, after importing the prompt's KV
    decode_first_token_at: float | None = None

    def predicted(self, pool: str, prediction: Prediction) -> None:
        """A router's choice (the last one counts: Serve asks again when no replica took it)."""
        self.predictions = {**self.predictions, pool: prediction}

    def computed(self, pool: str, output: RequestOutput, admission: Admission | None, at: float) -> None:
        """The first output of the engine that computed the prompt reached the ingress at `at`;
        only the first such call counts (a resumed request computes its prompt again)."""
        if self.pool is not None:
            return
        self.pool = pool
        self.returned_at = at
        shift = _shift(admission)
        m = output.metrics
        if m is not None and m.first_scheduled_mono_s is not None and m.first_token_mono_s is not None:
            self.scheduled_at = m.first_scheduled_mono_s + shift
            self.engine_first_token_at = m.first_token_mono_s + shift
        prediction = self.predictions.get(pool)
        if prediction is not None:
            self.check = check_prefix(
                pool, prediction, admission, num_prompt_tokens=output.num_prompt_tokens,
                num_cached_tokens=output.num_cached_tokens, needs_prompt_logprobs=self.needs_prompt_logprobs,
            )

    def placed(self, at: float) -> None:
        self.placed_at = at

    def decode_started(self, output: RequestOutput, admission: Admission | None) -> None:
        """The decode worker's first output, after it imported the prompt's KV."""
        m = output.metrics
        if self.decode_arrived_at is not None or m is None or m.first_token_mono_s is None:
            return
        shift = _shift(admission)
        self.decode_arrived_at = m.arrival_mono_s + shift
        self.decode_first_token_at = m.first_token_mono_s + shift

    @property
    def first_out_at(self) -> float | None:
        """When its first token left the backend: after the decode call's placement, if any."""
        return self.placed_at if self.placed_at is not None else self.returned_at

    def split(self, received_at: float, first_token_at: float) -> dict[str, float] | None:
        """TTFT_COMPONENTS (seconds) between the ingress's receipt and its first token out (module
        docstring); handoff only where a decode call was placed. None without the engine's times."""
        if self.scheduled_at is None or self.engine_first_token_at is None or self.returned_at is None:
            return None
        placed = self.placed_at if self.placed_at is not None else self.returned_at
        queue, prefill, back, handoff, out = split_between(
            [received_at, self.scheduled_at, self.engine_first_token_at, self.returned_at, placed, first_token_at])
        parts = {"queue": queue, "prefill": prefill, "delivery": back + out}
        if self.placed_at is not None:
            parts["handoff"] = handoff
        return parts

    def decode_split(self, second_token_at: float | None) -> dict[str, float] | None:
        """DECODE_COMPONENTS (seconds) from the decode call's placement to the second token at the
        ingress, for a request whose KV the decode pool imported; None otherwise."""
        if self.placed_at is None or self.decode_arrived_at is None or second_token_at is None:
            return None
        return dict(zip(DECODE_COMPONENTS, split_between(
            [self.placed_at, self.decode_arrived_at, self.decode_first_token_at, second_token_at])))


def _shift(admission: Admission | None) -> float:
    """What moves the worker's monotonic times onto this process's: 0 without an admission (the
    engine runs in this process)."""
    return 0.0 if admission is None else admission.clock_offset_s - clock_offset_s()


class PathTable:
    """This process's open request paths, by request id."""

    def __init__(self) -> None:
        self._paths: dict[str, RequestPath] = {}

    def open(self, request_id: str) -> RequestPath:
        path = self._paths[request_id] = RequestPath(request_id)
        return path

    def find(self, request_id: str) -> RequestPath | None:
        """The request's path if somebody follows it (any thread: one dict read)."""
        return self._paths.get(request_id)

    def close(self, request_id: str) -> None:
        self._paths.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._paths)


PATHS = PathTable()


def record_prediction(request_id: str, pool: str, prediction: Prediction) -> None:
    """A router's prediction for a request, kept on its path if this process follows it. A
    function of this module, not PATHS itself, for the routers: Serve ships a router class by
    value, and a module global it named would arrive as a copy (serving/observability/metrics.py
    register_router does the same)."""
    path = PATHS.find(request_id)
    if path is not None:
        path.predicted(pool, prediction)
