"""The client of `kvrelay bench soak`: sends one SoakRequest, leaves where it was told to, and says
how the request ended. It never raises for a request; every request gets exactly one end:

    end        when
    finished   the full answer came: non-streamed 200 with its choices, or a stream through
               `data: [DONE]` with a finish_reason for every choice
    aborted    the client left on purpose (the request's AbortPoint) before the answer ended
    errored    the server ended it with an error: an HTTP status other than 200, an SSE `error`
               event, a connection the server broke, a stream that ended without [DONE], or an
               answer that is wrong (`bad_response:*`: a missing choice or finish_reason, a
               stop string in the text, invalid JSON)
    hung       no end within the request's deadline (`client_timeout`): the client gives up and
               closes the connection

`error_kind` names the error for counting: `http_<status>`, `sse_<code or type>`,
`connection`, `incomplete_stream`, `bad_response:<check>`, `client_timeout`. The deadline runs
from sending to the end, over everything (headers, every chunk, the body).

Leaving = closing the response before it is read to the end; httpx then closes the connection,
which is what the server sees when a browser tab closes.
"""

from __future__ import annotations

import asyncio
import enum
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from load_tests.soak.workload import AbortPoint, SoakRequest

__all__ = ["End", "SoakClient", "SoakOutcome"]


class End(enum.Enum):
    FINISHED = "finished"
    ABORTED = "aborted"
    ERRORED = "errored"
    HUNG = "hung"


@dataclass
class SoakOutcome:
    request_id: int
    started_s: float  # on the run's clock
    ended_s: float = 0.0
    end: End = End.HUNG
    error_kind: str | None = None
    error: str | None = None  # the message, cut to 300 characters
    left_at: str | None = None  # aborted: "before_first_token", "at_first_token", "mid_stream", "non_stream"
    first_token_s: float | None = None  # on the run's clock: the first content chunk (streamed)
    num_content_chunks: int = 0  # streamed
    finish_reasons: list[str | None] = field(default_factory=list)
    response_id: str | None = None  # the server's id of the request (chatcmpl-..., cmpl-...), once seen

    @property
    def is_success(self) -> bool:
        """Ended as planned: finished, or left by the client on purpose (for serve_load.Progress)."""
        return self.end in (End.FINISHED, End.ABORTED)

    def to_json(self) -> dict:
        return {
            "request_id": self.request_id, "started_s": self.started_s, "ended_s": self.ended_s, "end": self.end.value,
            "error_kind": self.error_kind, "error": self.error, "left_at": self.left_at,
            "first_token_s": self.first_token_s, "num_content_chunks": self.num_content_chunks,
            "finish_reasons": self.finish_reasons, "response_id": self.response_id,
        }


class _Errored(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _error_of(payload: object) -> tuple[str, str]:
    """(code or type, message) of an OpenAI error body `{"error": {...}}`."""
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict):
        return "unknown", str(payload)
    return str(error.get("code") or error.get("type") or "unknown"), str(error.get("message"))


def _texts_of(choice: dict) -> str:
    if "delta" in choice:
        return (choice.get("delta") or {}).get("content") or ""
    if "message" in choice:
        return (choice.get("message") or {}).get("content") or ""
    return choice.get("text") or ""


def check_answer(request: SoakRequest, texts: dict[int, str], finish_reasons: dict[int, str | None]) -> None:
    """Raise _Errored("bad_response:...") unless a finished answer has what was asked for."""
    if sorted(finish_reasons) != list(range(request.n)):
        raise _Errored("bad_response:choices", f"choices {sorted(finish_reasons)}, asked for n={request.n}")
    for index, reason in finish_reasons.items():
        if reason not in ("stop", "length"):
            raise _Errored("bad_response:finish_reason", f"choice {index} finished with {reason!r}")
        text = texts.get(index, "")
        for stop in request.stop:
            if stop in text:
                raise _Errored("bad_response:stop_string", f"choice {index} contains the stop string {stop!r}: {text[-80:]!r}")


class SoakClient:
    def __init__(self, http: httpx.AsyncClient, *, deadline_s: float, clock: Callable[[], float] = time.monotonic,
                 t0: float | None = None) -> None:
        self._http = http
        self.deadline_s = deadline_s
        self._clock = clock
        self.t0 = clock() if t0 is None else t0

    def now(self) -> float:
        return self._clock() - self.t0

    async def send(self, request: SoakRequest) -> SoakOutcome:
        outcome = SoakOutcome(request.request_id, self.now())
        try:
            async with asyncio.timeout(self.deadline_s):
                if request.is_streamed:
                    await self._stream(request, outcome)
                else:
                    await self._post(request, outcome)
        except TimeoutError:
            outcome.end, outcome.error_kind = End.HUNG, "client_timeout"
            outcome.error = f"no end within the {self.deadline_s:g} s deadline ({outcome.num_content_chunks} content chunks)"
        except _Errored as exc:
            outcome.end, outcome.error_kind, outcome.error = End.ERRORED, exc.kind, str(exc)[:300]
        except httpx.HTTPError as exc:  # the server broke the connection (a crash, a reset)
            outcome.end, outcome.error_kind = End.ERRORED, "connection"
            outcome.error = f"{type(exc).__name__}: {exc}"[:300]
        outcome.ended_s = self.now()
        return outcome

    async def _post(self, request: SoakRequest, outcome: SoakOutcome) -> None:
        leave = request.abort is AbortPoint.NON_STREAM
        try:
            async with asyncio.timeout(request.abort_after_s if leave else None) as abort_timer:
                response = await self._http.post(request.path, json=request.body)
        except TimeoutError:
            if not abort_timer.expired():
                raise  # the deadline's
            outcome.end, outcome.left_at = End.ABORTED, "non_stream"
            return
        payload = _json(response.content)
        if response.status_code != 200:
            raise _Errored(f"http_{response.status_code}", _error_of(payload)[1])
        if isinstance(payload, dict):
            outcome.response_id = payload.get("id")
        choices = payload.get("choices") if isinstance(payload, dict) else None
        if not isinstance(choices, list):
            raise _Errored("bad_response:body", f"no choices in {str(payload)[:200]}")
        texts = {c.get("index", 0): _texts_of(c) for c in choices}
        reasons = {c.get("index", 0): c.get("finish_reason") for c in choices}
        outcome.finish_reasons = [reasons[i] for i in sorted(reasons)]
        check_answer(request, texts, reasons)
        outcome.end = End.FINISHED

    async def _stream(self, request: SoakRequest, outcome: SoakOutcome) -> None:
        early = request.abort is AbortPoint.BEFORE_FIRST_TOKEN
        try:
            async with asyncio.timeout(request.abort_after_s if early else None) as abort_timer:
                await self._read_stream(request, outcome)
        except TimeoutError:
            if not abort_timer.expired():
                raise  # the deadline's
            outcome.end, outcome.left_at = End.ABORTED, "before_first_token"

    async def _read_stream(self, request: SoakRequest, outcome: SoakOutcome) -> None:
        texts: dict[int, str] = {}
        reasons: dict[int, str | None] = {}
        async with self._http.stream("POST", request.path, json=request.body) as response:
            if response.status_code != 200:
                raise _Errored(f"http_{response.status_code}", _error_of(_json(await response.aread()))[1])
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    outcome.finish_reasons = [reasons.get(i) for i in sorted(reasons)]
                    check_answer(request, texts, reasons)
                    outcome.end = End.FINISHED
                    return
                chunk = _json(data.encode())
                if not isinstance(chunk, dict):
                    raise _Errored("bad_response:json", f"not a JSON object: {data[:200]}")
                outcome.response_id = outcome.response_id or chunk.get("id")
                if "error" in chunk:
                    code, message = _error_of(chunk)
                    raise _Errored(f"sse_{code}", message)
                has_content = False
                for choice in chunk.get("choices") or []:
                    index = choice.get("index", 0)
                    text = _texts_of(choice)
                    texts[index] = texts.get(index, "") + text
                    has_content |= bool(text)
                    if choice.get("finish_reason") is not None:
                        reasons[index] = choice["finish_reason"]
                if not has_content:
                    continue
                outcome.num_content_chunks += 1
                if outcome.first_token_s is None:
                    outcome.first_token_s = self.now()
                # before_first_token whose first token beat the timer leaves right now, too
                if request.abort in (AbortPoint.BEFORE_FIRST_TOKEN, AbortPoint.HAND_OFF):
                    outcome.end, outcome.left_at = End.ABORTED, "at_first_token"
                    return
                if request.abort is AbortPoint.MID_STREAM and outcome.num_content_chunks >= request.abort_after_chunks:
                    outcome.end, outcome.left_at = End.ABORTED, "mid_stream"
                    return
        raise _Errored("incomplete_stream", f"the stream ended without [DONE] after {outcome.num_content_chunks} content chunks")


def _json(content: bytes) -> object:
    try:
        return json.loads(content)
    except ValueError:
        return None
