"""The ingress replica's recorders: one RequestRecord per HTTP request (each delta a clock read and
token counts; at its end TTFT, TPOT, ITLs, E2E, status, tokens, and from its requests' paths the
prefix checks and the TTFT split: serving/observability/request_path.py), IngressMetrics over them,
the pool gauges, the recoveries and degradations it saw (definitions: serving/observability/metrics.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import aclosing
from typing import Protocol

from serving.observability.metrics import METRICS, Instruments
from serving.observability.request_path import PATHS, RequestPath
from serving.observability.tracing import RequestTrace

__all__ = ["CLIENT_CLOSED", "Delta", "IngressMetrics", "RequestRecord"]

CLIENT_CLOSED = 499  # status of a request whose client went away (nginx's convention)

_INGRESS = tuple(spec.name for spec in METRICS if spec.recorded_at == "ingress" and spec.name != "kvrelay_routing_decisions_total")
_REPLICA_STATES = ("RUNNING", "STARTING", "UPDATING", "RECOVERING", "STOPPING")


class Delta(Protocol):
    """What a request's record reads of each piece of output (the ingress's ChoiceDelta)."""

    index: int
    token_ids: list[int]
    finish_reason: str | None


class RequestRecord:
    """One HTTP request at the ingress, timed as its client sees it; recorded once, at finish."""

    def __init__(self, metrics: IngressMetrics, trace: RequestTrace | None = None):
        self._metrics = metrics
        self.trace = trace  # its ingress span, which gets the prefix check and the TTFT split
        self.start = time.monotonic()
        self.first_token_at: float | None = None
        self.second_token_at: float | None = None  # when its second token (any choice) came out
        self.paths: list[RequestPath] = []  # of its GenerateRequests (one per prompt), until it finishes
        self._last_token_at: dict[int, float] = {}  # by choice
        self.gaps_s: list[float] = []  # one per token after each choice's first
        self.tokens_by_choice: dict[int, int] = {}
        self.finish_reasons: dict[int, str] = {}
        self.prompt_tokens: int | None = None  # set when generation starts
        self.is_finished = False
        self._is_holding = False
        self._held: tuple[int, str, float] | None = None

    def on_delta(self, delta: Delta) -> None:
        if delta.token_ids:
            now = time.monotonic()
            num = len(delta.token_ids)
            if self.first_token_at is None:
                self.first_token_at = now
            if self.second_token_at is None and num + sum(self.tokens_by_choice.values()) >= 2:
                self.second_token_at = now
            last = self._last_token_at.get(delta.index)
            if last is None:  # this choice's first chunk: its tokens after the first arrived with it
                self.gaps_s.extend([0.0] * (num - 1))
            else:  # a chunk that merged k tokens (a slow reader): k gaps of an equal share
                self.gaps_s.extend([(now - last) / num] * num)
            self._last_token_at[delta.index] = now
            self.tokens_by_choice[delta.index] = self.tokens_by_choice.get(delta.index, 0) + num
        if delta.finish_reason is not None:
            self.finish_reasons[delta.index] = delta.finish_reason

    def follow(self, request_id: str) -> RequestPath:
        """Open the path of one of its GenerateRequests (Frontend.generate), closed when it finishes."""
        path = PATHS.open(request_id)
        self.paths.append(path)
        return path

    def finish(self, status: int, finish_reason: str | None = None) -> None:
        """Record the request (only the first call counts). `finish_reason` None: choice 0's."""
        if self.is_finished:
            return
        self.is_finished = True
        for path in self.paths:
            PATHS.close(path.request_id)
        if finish_reason is None:
            finish_reason = self.finish_reasons[min(self.finish_reasons)] if self.finish_reasons else "none"
        if self._is_holding:
            self._held = (status, finish_reason, time.monotonic())
            return
        self._metrics.record(self, status, finish_reason, time.monotonic())

    def hold(self) -> None:
        """Keep the next finish() instead of recording it, until release(): graceful degradation
        (serving/api/admission/degradation.py) may still send a request the pools refused elsewhere."""
        self._is_holding = True

    def release(self, *, keep: bool = True) -> None:
        """Stop holding. `keep`: record the held finish, if any; else forget it, and the record
        may be finished again (shed here) or never (served, and counted, by a fallback app)."""
        held, self._held, self._is_holding = self._held, None, False
        if held is None:
            return
        if keep:
            self._metrics.record(self, *held)
        else:
            self.is_finished = False


class IngressMetrics:
    """The ingress replica's request-level metrics and pool gauges; `registry` is what
    GET /metrics renders (serving/observability/export.py adds the routers' and workers' view)."""

    def __init__(self, model: str, *, use_ray: bool | None = None):
        self.model = model
        self.instruments = Instruments(_INGRESS, {"model": model}, use_ray=use_ray)
        self.registry = self.instruments.registry

    def start(self, trace: RequestTrace | None = None) -> RequestRecord:
        return RequestRecord(self, trace)

    async def track(
        self, record: RequestRecord, deltas: AsyncIterator[Delta], *, prompt_tokens: int,
        status_of: Callable[[BaseException], int],
    ) -> AsyncIterator[Delta]:
        """Pass `deltas` through, timing them; closing this closes `deltas` (which aborts the
        request). The request is recorded when the stream ends, fails (with the HTTP status
        `status_of` gives the error) or is closed."""
        record.prompt_tokens = prompt_tokens
        status, finish_reason = 200, None
        try:
            async with aclosing(deltas):
                async for delta in deltas:
                    record.on_delta(delta)
                    yield delta
        except (asyncio.CancelledError, GeneratorExit):
            status, finish_reason = CLIENT_CLOSED, "abort"
            raise
        except Exception as exc:
            status, finish_reason = status_of(exc), "error"
            raise
        finally:
            record.finish(status, finish_reason)

    def recovered(self, kind: str) -> None:
        """A request survived a replica's death (ServeBackend): `kind` as kvrelay_recoveries_total."""
        self.instruments.inc("kvrelay_recoveries_total", kind=kind)

    def degraded(self, reason: str, target: str, outcome: str) -> None:
        """Graceful degradation handled a refused request: labels as kvrelay_degraded_requests_total."""
        self.instruments.inc("kvrelay_degraded_requests_total", reason=reason, target=target, outcome=outcome)

    def record(self, r: RequestRecord, status: int, finish_reason: str, now: float) -> None:
        ins = self.instruments
        ins.inc("kvrelay_requests_total", status=str(status), finish_reason=finish_reason)
        if r.prompt_tokens:
            ins.inc("kvrelay_prompt_tokens_total", r.prompt_tokens)
        ins.inc("kvrelay_generation_tokens_total", sum(r.tokens_by_choice.values()))
        attributes = self._record_paths(r)
        if r.trace is not None and attributes:
            r.trace.set(attributes)
        if r.first_token_at is None:
            return
        ins.observe("kvrelay_ttft_seconds", [r.first_token_at - r.start])
        if status != 200 or finish_reason in ("abort", "error"):
            return
        ins.observe("kvrelay_e2e_request_latency_seconds", [now - r.start])
        ins.observe("kvrelay_inter_token_latency_seconds", r.gaps_s)
        num_tokens = max(r.tokens_by_choice.values())
        if num_tokens >= 2:
            ins.observe("kvrelay_tpot_seconds", [(now - r.first_token_at) / (num_tokens - 1)])

    def _record_paths(self, r: RequestRecord) -> dict[str, float | int | str]:
        """Its requests' prefix checks, and the TTFT split of the one whose first token came out
        first; returns them as trace attributes."""
        ins = self.instruments
        attributes: dict[str, float | int | str] = {}
        for path in r.paths:
            check = path.check
            if check is None:
                continue
            ins.inc("kvrelay_prefix_tokens_total", check.num_prompt_tokens, pool=check.pool, kind="prompt")
            ins.inc("kvrelay_prefix_tokens_total", check.num_predicted_tokens, pool=check.pool, kind="predicted")
            ins.inc("kvrelay_prefix_tokens_total", check.num_cached_tokens, pool=check.pool, kind="cached")
            ins.inc("kvrelay_prefix_predictions_total", pool=check.pool, outcome=check.outcome, reason=check.reason)
            if check.outcome != "exact":
                ins.observe("kvrelay_prefix_prediction_error_tokens", [check.error_tokens], pool=check.pool, outcome=check.outcome)
            if not attributes:  # the first prompt's (a completion of several prompts has one per prompt)
                attributes.update({
                    "kvrelay.prefix.pool": check.pool, "kvrelay.prefix.predicted_tokens": check.num_predicted_tokens,
                    "kvrelay.prefix.cached_tokens": check.num_cached_tokens, "kvrelay.prefix.outcome": check.outcome,
                    "kvrelay.prefix.reason": check.reason,
                })
        if r.first_token_at is None:
            return attributes
        timed = [path for path in r.paths if path.first_out_at is not None]
        if not timed:
            return attributes
        first = min(timed, key=lambda path: path.first_out_at)
        split = first.split(r.start, r.first_token_at)
        if split is not None:
            for component, seconds in split.items():
                ins.observe("kvrelay_ttft_split_seconds", [seconds], pool=first.pool, component=component)
                attributes[f"kvrelay.ttft.{component}_ms"] = seconds * 1000
            attributes["kvrelay.ttft.pool"] = first.pool
            attributes["kvrelay.ttft_ms"] = (r.first_token_at - r.start) * 1000
        decode = first.decode_split(r.second_token_at)
        if decode is not None:
            for component, seconds in decode.items():
                ins.observe("kvrelay_decode_start_seconds", [seconds], component=component)
                attributes[f"kvrelay.decode_start.{component}_ms"] = seconds * 1000
        return attributes

    def set_pool(self, pool: str, replica_states: Mapping[str, int], desired: int | None) -> None:
        """The controller's view of one pool: replicas by state, and its target count."""
        for state in {*_REPLICA_STATES, *replica_states}:
            self.instruments.set("kvrelay_replicas", float(replica_states.get(state, 0)), pool=pool, state=state)
        if desired is not None:
            self.instruments.set("kvrelay_desired_replicas", float(desired), pool=pool)
