"""The streaming client of `kvrelay bench serve`: one request to any OpenAI-compatible server, timed.

    send ──▶ POST /v1/chat/completions (or /v1/completions), stream=true, include_usage
     │          data: {"choices":[{"delta":{"role":"assistant"}}]}        no content: not a token
     │  TTFT    data: {"choices":[{"delta":{"content":"Hel"}}]}           first content chunk
     │  ITL[0]  data: {"choices":[{"delta":{"content":"lo"}}]}            every later content chunk
     │   ...
     │  E2E     data: {"choices":[{"delta":{"content":"!"}}]}             the last content chunk
     ▼          data: {"choices":[],"usage":{"completion_tokens":5,...}}  exact token count
                data: [DONE]

Definitions (shared/DESIGN.md, as in the standard serving benchmarks):
    TTFT  request sent -> first chunk carrying content (text, or reasoning text)
    ITL   every gap between consecutive content chunks (a chunk holding several tokens is one gap)
    E2E   request sent -> the last content chunk
    TPOT  (E2E - TTFT) / (output tokens - 1); None for a one-token answer

Output tokens are counted by the first rule that applies:
    1. `usage.completion_tokens` of the stream (we always ask for `stream_options.include_usage`);
       "usage" in `RequestRecord.token_count_source`
    2. otherwise one content chunk = one token (servers that stream token by token, without
       usage); "chunks"

Every time comes from an injectable `Clock`, so a scripted server on a virtual clock gives exact
figures in tests (tests/load_tests/test_bench_serve.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import httpx

__all__ = ["Clock", "RealClock", "RequestRecord", "RequestSpec", "ServeClient", "ServeClientError"]

logger = logging.getLogger(__name__)


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class RealClock:
    """Wall time: `time.perf_counter` and `asyncio.sleep`."""

    def now(self) -> float:
        return time.perf_counter()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class ServeClientError(Exception):
    """The server could not be asked at all (for example GET /v1/models failed)."""


@dataclass
class RequestSpec:
    """One request of a dataset. Chat requests carry `messages` (for a multi-turn session only the
    new user turn: the client prepends the session's history); completions requests carry
    `prompt`, text or token ids."""

    request_id: int
    max_tokens: int
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    approx_prompt_tokens: int = 0  # what the dataset aimed at; the server's count is in the record
    session_id: int | None = None  # multi-turn: turns of one session go in order
    turn: int = 0
    arrival_s: float | None = None  # a dataset's own schedule (bursts); None: the arrival process decides
    kind: str = "chat"  # a label for the report: "chat", "long", "turn", ...


@dataclass
class RequestRecord:
    request_id: int
    kind: str
    scheduled_s: float  # arrival time given by the schedule, from the start of the run
    sent_s: float  # when it was actually sent (later than scheduled under a concurrency cap)
    is_success: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    num_prompt_tokens: int | None = None  # from usage, when the server sent it
    approx_prompt_tokens: int = 0
    token_count_source: str = "chunks"  # "usage" or "chunks" (module docstring)
    session_id: int | None = None
    turn: int = 0
    output_text: str = field(default="", repr=False)

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)

    def to_json(self) -> dict:
        return {
            "request_id": self.request_id, "kind": self.kind, "session_id": self.session_id, "turn": self.turn,
            "scheduled_s": self.scheduled_s, "sent_s": self.sent_s, "is_success": self.is_success,
            "error": self.error, "ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "e2e_s": self.e2e_s,
            "itl_s": self.itl_s, "num_output_tokens": self.num_output_tokens,
            "num_prompt_tokens": self.num_prompt_tokens, "approx_prompt_tokens": self.approx_prompt_tokens,
            "token_count_source": self.token_count_source,
        }


def _content_of(choice: dict) -> str:
    if "delta" in choice:  # chat
        delta = choice["delta"] or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


class ServeClient:
    """Sends `RequestSpec`s to one server and times them. Multi-turn histories live here: a
    session's next turn is sent with every earlier user turn and answer before it."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        *,
        model: str,
        endpoint: str = "chat",
        clock: Clock | None = None,
        temperature: float = 0.0,
        ignore_eos: bool = False,
        extra_body: dict | None = None,
    ) -> None:
        assert endpoint in ("chat", "completions"), endpoint
        self._http = http
        self.model = model
        self.endpoint = endpoint
        self.clock = clock or RealClock()
        self._temperature = temperature
        self._ignore_eos = ignore_eos
        self._extra_body = extra_body or {}
        self._histories: dict[int, list[dict]] = {}

    @staticmethod
    async def first_model(http: httpx.AsyncClient) -> str:
        """The first model GET /v1/models lists (what `--model` defaults to)."""
        try:
            response = await http.get("/v1/models")
            response.raise_for_status()
            return response.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise ServeClientError(f"could not read the model name from {str(http.base_url).rstrip('/')}/v1/models: {exc!r}") from exc

    def body(self, spec: RequestSpec) -> dict:
        body = {
            "model": self.model, "max_tokens": spec.max_tokens, "temperature": self._temperature,
            "stream": True, "stream_options": {"include_usage": True},
        }
        if self._ignore_eos:
            body["ignore_eos"] = True  # vLLM, SGLang and kvrelay accept it; OpenAI itself does not
        if self.endpoint == "chat":
            assert spec.messages is not None, f"request {spec.request_id}: the chat endpoint needs messages"
            history = self._histories.get(spec.session_id, []) if spec.session_id is not None else []
            body["messages"] = [*history, *spec.messages]
        else:
            prompt = spec.prompt
            if prompt is None:
                assert spec.messages is not None and spec.session_id is None, "multi-turn needs the chat endpoint"
                prompt = "\n".join(m["content"] for m in spec.messages)
            body["prompt"] = prompt
        return {**body, **self._extra_body}

    async def send(self, spec: RequestSpec, *, scheduled_s: float, t0: float) -> RequestRecord:
        """Send one request; `t0` is the run's start on `self.clock`. Never raises for a failed
        request: the error is in the record."""
        body = self.body(spec)
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        start = self.clock.now()
        record = RequestRecord(
            spec.request_id, spec.kind, scheduled_s, start - t0, approx_prompt_tokens=spec.approx_prompt_tokens,
            session_id=spec.session_id, turn=spec.turn,
        )
        texts: list[str] = []
        num_chunks, last_content = 0, None
        usage = None
        try:
            async with self._http.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    record.error = f"HTTP {response.status_code}: {response.text[:500]}"
                    return record
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        break
                    now = self.clock.now()
                    chunk = json.loads(data)
                    if "error" in chunk:
                        record.error = f"stream error: {chunk['error']}"
                        return record
                    content = "".join(_content_of(c) for c in chunk.get("choices") or [])
                    if content:
                        if last_content is None:
                            record.ttft_s = now - start
                        else:
                            record.itl_s.append(now - last_content)
                        last_content = now
                        num_chunks += 1
                        texts.append(content)
                    if chunk.get("usage"):
                        usage = chunk["usage"]
        except (httpx.HTTPError, ValueError) as exc:  # ValueError: a chunk that is not JSON
            record.error = f"{type(exc).__name__}: {exc}"
            return record
        if last_content is None:
            record.error = "the stream ended without content"
            return record
        record.e2e_s = last_content - start
        record.output_text = "".join(texts)
        if usage and usage.get("completion_tokens") is not None:
            record.num_output_tokens = usage["completion_tokens"]
            record.num_prompt_tokens = usage.get("prompt_tokens")
            record.token_count_source = "usage"
        else:
            record.num_output_tokens = num_chunks
        record.is_success = True
        if self.endpoint == "chat" and spec.session_id is not None:
            self._histories[spec.session_id] = [
                *body["messages"], {"role": "assistant", "content": record.output_text},
            ]
        return record
