"""The plain-transformers peer of `kvrelay bench serve`: an OpenAI-compatible server around
Hugging Face `model.generate`, written the way a user without a serving engine would write it.

    python load_tests/peers/transformers_peer.py --model DIR --model-name NAME --port P \\
        [--host 127.0.0.1] [--max-batch-size 16] [--dtype bfloat16] [--num-threads N]

It is naive on purpose: it is the baseline the benchmark measures kvrelay against, so it does what
plain transformers does and nothing more.

    POST /v1/chat/completions ──▶ pending (FIFO) ──▶ batch thread: up to --max-batch-size requests
         ▲                                           with the same sampling settings, left-padded,
         │   one token per row per step              ONE model.generate(max_new_tokens = the batch's
         └────────────── _BatchStreamer.put ◀─────── largest max_tokens)

- Static batching: a batch runs until its longest request is done. A row that reached its own
  max_tokens (or EOS) stops streaming but is still computed; requests arriving meanwhile wait for
  the next batch. No continuous batching, and no waiting to fill a batch: the thread takes what
  is waiting when it is free, so the first request of a burst usually runs alone.
- No KV reuse: every request prefills its whole prompt in a fresh DynamicCache; no prefix cache,
  no paged KV.
- Greedy when temperature == 0, sampling (temperature, top_p, no top_k) otherwise. `ignore_eos`
  passes min_new_tokens = max_new_tokens, so generate never stops on EOS.
- Text per row by incremental decoding: decode the row's ids so far, send the new suffix, hold
  back a trailing U+FFFD (half a UTF-8 character).
- A client that disconnects leaves its row running (the batch is static); its output is dropped.
  A batch whose clients have all gone stops at the next step.

This file imports only torch, transformers, fastapi, uvicorn and the standard library: it runs in
the product venv, but must not use kvrelay's `serving` package.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.streamers import BaseStreamer

__all__ = ["BadRequest", "BatchRunner", "ChatParams", "GenRequest", "RowEvent", "build_app", "main", "parse_chat_body"]

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_KNOWN_FIELDS = {
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stream",
    "stream_options", "ignore_eos", "n", "stop",
}
_logged_unknown_fields: set[str] = set()


# ---- the request body ----------------------------------------------------------------------
class BadRequest(Exception):
    """A user mistake; rendered as OpenAI's error body, `param` naming the field."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400, code: str = "invalid_value"):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": "invalid_request_error", "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ChatParams:
    messages: list[dict]
    max_tokens: int | None  # None: up to the context length
    temperature: float
    top_p: float
    is_stream: bool
    include_usage: bool
    ignore_eos: bool


def _number(body: dict, name: str, default: float, low: float, high: float, *, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{name}: must be a number (got {value!r})", param=name)
    if value > high or value < low or (low_open and value == low):
        raise BadRequest(f"{name}: must be in {'(' if low_open else '['}{low}, {high}] (got {value!r})", param=name)
    return float(value)


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"{name}: must be a boolean (got {value!r})", param=name)
    return bool(value)


def _message(i: int, message) -> dict:
    if not isinstance(message, dict):
        raise BadRequest(f"messages[{i}]: must be an object", param=f"messages[{i}]")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str):
        raise BadRequest(f"messages[{i}].role: must be a string", param=f"messages[{i}].role")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise BadRequest(f"messages[{i}].content: only text parts are supported", param=f"messages[{i}].content")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise BadRequest(f"messages[{i}].content: must be a string or a list of text parts", param=f"messages[{i}].content")
    return {"role": role, "content": content}


def parse_chat_body(body, model_name: str) -> ChatParams:
    """Check a /v1/chat/completions body; unknown fields are ignored (logged once per name)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object", param="body")
    for name in body.keys() - _KNOWN_FIELDS - _logged_unknown_fields:
        _logged_unknown_fields.add(name)
        logger.info("ignoring the unknown request field %r", name)
    if body.get("model") not in (None, model_name):
        raise BadRequest(f"The model {body['model']!r} does not exist; this server has {model_name!r}.",
                         param="model", status=404, code="model_not_found")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: a non-empty list of messages is required", param="messages",
                         code="missing" if messages is None else "invalid_value")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(name)
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise BadRequest(f"{name}: must be an integer >= 1 (got {max_tokens!r})", param=name)
    if body.get("n") not in (None, 1):
        raise BadRequest("n: only n = 1 is supported", param="n")
    if body.get("stop"):
        raise BadRequest("stop: stop sequences are not supported by this server", param="stop")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise BadRequest("stream_options: must be an object", param="stream_options")
    return ChatParams(
        messages=[_message(i, m) for i, m in enumerate(messages)],
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        is_stream=_flag(body, "stream"),
        include_usage=_flag(stream_options, "include_usage"),
        ignore_eos=_flag(body, "ignore_eos"),
    )


# ---- the batch thread ----------------------------------------------------------------------
@dataclass
class RowEvent:
    """What the batch thread sends a request: new text, and at the end a finish reason or an error."""

    text: str = ""
    num_completion_tokens: int = 0
    finish_reason: str | None = None  # "stop" (EOS) or "length" (max_tokens)
    error: str | None = None


@dataclass(eq=False)
class GenRequest:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    ignore_eos: bool
    emit: Callable[[RowEvent], None]  # called from the batch thread; must be thread-safe
    is_cancelled: bool = False  # the client left: its output is dropped

    @property
    def sampling_key(self) -> tuple:
        """Requests in one batch share one generate call, hence these settings."""
        return (0.0, 1.0, self.ignore_eos) if self.temperature == 0 else (self.temperature, self.top_p, self.ignore_eos)


class _Row:
    def __init__(self, request: GenRequest) -> None:
        self.request = request
        self.ids: list[int] = []  # generated ids, EOS excluded
        self.num_tokens = 0
        self.num_chars_sent = 0
        self.is_done = False

    def send(self, event: RowEvent) -> None:
        if not self.request.is_cancelled:
            self.request.emit(event)


class _BatchStreamer(BaseStreamer):
    """generate's first `put` is the prompt; every later one holds one new token per row."""

    def __init__(self, rows: list[_Row], tokenizer, eos_ids: set[int]) -> None:
        self.rows, self.tokenizer, self.eos_ids = rows, tokenizer, eos_ids
        self.is_prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.is_prompt_seen:
            self.is_prompt_seen = True
            return
        for row, token in zip(self.rows, value.reshape(-1).tolist()):
            if row.is_done:
                continue
            row.num_tokens += 1
            is_eos = token in self.eos_ids and not row.request.ignore_eos
            if not is_eos:
                row.ids.append(token)
            finish = "stop" if is_eos else "length" if row.num_tokens >= row.request.max_tokens else None
            text = self.tokenizer.decode(row.ids, skip_special_tokens=True)
            if finish is None and text.endswith("\ufffd"):
                continue  # the rest of a multi-byte character comes with a later token
            delta, row.num_chars_sent = text[row.num_chars_sent:], max(row.num_chars_sent, len(text))
            if finish is not None:
                row.is_done = True
            if delta or finish is not None:
                row.send(RowEvent(delta, row.num_tokens, finish_reason=finish))

    def end(self) -> None:
        pass

    def fail(self, message: str) -> None:
        for row in self.rows:
            if not row.is_done:
                row.is_done = True
                row.send(RowEvent(num_completion_tokens=row.num_tokens, error=message))


class _StopWhen(StoppingCriteria):
    def __init__(self, predicate: Callable[[], bool]) -> None:
        self.predicate = predicate

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.predicate(), dtype=torch.bool, device=input_ids.device)


class BatchRunner:
    """One thread; takes up to `max_batch_size` waiting requests and runs one generate for them."""

    def __init__(self, model, tokenizer, *, max_batch_size: int) -> None:
        assert max_batch_size >= 1, max_batch_size
        self.model, self.tokenizer, self.max_batch_size = model, tokenizer, max_batch_size
        eos = model.generation_config.eos_token_id
        eos = tokenizer.eos_token_id if eos is None else eos
        self.eos_ids = set(eos) if isinstance(eos, list) else {eos}
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else model.generation_config.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids)
        self._pending: deque[GenRequest] = deque()
        self._cond = threading.Condition()
        self._is_stopping = False
        self._thread: threading.Thread | None = None

    def submit(self, request: GenRequest) -> None:
        with self._cond:
            self._pending.append(request)
            self._cond.notify()

    def start(self) -> None:
        assert self._thread is None, "the batch thread is already running"
        self._thread = threading.Thread(target=self._run, name="peer-transformers-batch", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ends the running batch at its next step and fails everything still waiting."""
        with self._cond:
            self._is_stopping = True
            self._cond.notify()
            waiting, self._pending = list(self._pending), deque()
        for request in waiting:
            _Row(request).send(RowEvent(error="the server is shutting down"))
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _take_batch(self) -> list[GenRequest] | None:
        with self._cond:
            while True:
                self._pending = deque(r for r in self._pending if not r.is_cancelled)
                if self._is_stopping:
                    return None
                if self._pending:
                    break
                self._cond.wait()
            key = self._pending[0].sampling_key
            batch, rest = [], deque()
            for request in self._pending:
                (batch if len(batch) < self.max_batch_size and request.sampling_key == key else rest).append(request)
            self._pending = rest
            return batch

    def _run(self) -> None:
        while (batch := self._take_batch()) is not None:
            self._run_batch(batch)

    def _run_batch(self, batch: list[GenRequest]) -> None:
        rows = [_Row(r) for r in batch]
        width = max(len(r.prompt_ids) for r in batch)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, request in enumerate(batch):  # left padding: every row's last prompt token in the last column
            input_ids[i, width - len(request.prompt_ids):] = torch.tensor(request.prompt_ids)
            attention_mask[i, width - len(request.prompt_ids):] = 1
        max_new_tokens = max(r.max_tokens for r in batch)
        kwargs: dict = {"max_new_tokens": max_new_tokens, "pad_token_id": self.pad_id}
        if batch[0].ignore_eos:
            kwargs["min_new_tokens"] = max_new_tokens
        if batch[0].temperature == 0:
            kwargs["do_sample"] = False
        else:
            kwargs.update(do_sample=True, temperature=batch[0].temperature, top_p=batch[0].top_p, top_k=0)
        streamer = _BatchStreamer(rows, self.tokenizer, self.eos_ids)
        stop = _StopWhen(lambda: self._is_stopping or all(r.request.is_cancelled or r.is_done for r in rows))
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                self.model.generate(
                    input_ids=input_ids, attention_mask=attention_mask, streamer=streamer,
                    stopping_criteria=StoppingCriteriaList([stop]), **kwargs,
                )
        except Exception as exc:  # the rows get the error; the thread goes on to the next batch
            logger.exception("generate failed for a batch of %d", len(batch))
            streamer.fail(f"generation failed: {type(exc).__name__}: {exc}")
        streamer.fail("generation stopped before this request was done")  # shutdown: rows left unfinished
        logger.info("batch of %d: prompts %d-%d tokens, %d new tokens, %.2f s", len(batch),
                    min(len(r.prompt_ids) for r in batch), width, max_new_tokens, time.perf_counter() - start)


# ---- the HTTP side ---------------------------------------------------------------------------
def _threadsafe_put(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> Callable[[RowEvent], None]:
    def emit(event: RowEvent) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, event)
        except RuntimeError:  # the loop has closed (shutdown): nobody is listening
            pass

    return emit


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _internal_error(message: str) -> dict:
    return {"error": {"message": message, "type": "internal_error", "param": None, "code": None}}


def build_app(model_dir, model_name: str, *, max_batch_size: int = 16, dtype: str = "bfloat16",
              num_threads: int | None = None) -> FastAPI:
    """Loads the model and returns the app; the batch thread runs for the app's lifespan."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if tokenizer.chat_template is None:
        raise ValueError(f"{model_dir}: the tokenizer has no chat template")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=_DTYPES[dtype]).eval()
    # Its own tokenizer: a fast tokenizer used from two threads at once can fail with "Already borrowed".
    runner = BatchRunner(model, AutoTokenizer.from_pretrained(str(model_dir)), max_batch_size=max_batch_size)
    max_context_tokens = model.config.max_position_embeddings

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        runner.start()
        yield
        await asyncio.to_thread(runner.stop)

    app = FastAPI(title="peer-transformers", lifespan=lifespan)
    app.state.runner, app.state.model, app.state.tokenizer = runner, model, tokenizer

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "peer-transformers"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadRequest(f"the request body is not valid JSON: {exc}", param="body", code="invalid_json") from exc
        params = parse_chat_body(body, model_name)
        # Tokenized here, on the event loop: well under a millisecond for benchmark prompts, and a
        # thread pool would share one fast tokenizer between threads.
        text = tokenizer.apply_chat_template(params.messages, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        max_tokens = params.max_tokens if params.max_tokens is not None else max_context_tokens - len(prompt_ids)
        if max_tokens < 1 or len(prompt_ids) + max_tokens > max_context_tokens:
            param = "messages" if params.max_tokens is None else "max_tokens"
            raise BadRequest(f"{param}: {len(prompt_ids)} prompt tokens + max_tokens {max(max_tokens, 1)} exceed the "
                             f"context length {max_context_tokens}", param=param, code="context_length_exceeded")
        queue: asyncio.Queue[RowEvent] = asyncio.Queue()
        gen = GenRequest(prompt_ids, max_tokens, params.temperature, params.top_p, params.ignore_eos,
                         emit=_threadsafe_put(asyncio.get_running_loop(), queue))
        runner.submit(gen)
        request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def usage(num_completion_tokens: int) -> dict:
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": num_completion_tokens,
                    "total_tokens": len(prompt_ids) + num_completion_tokens}

        if not params.is_stream:
            texts = []
            try:
                while (event := await queue.get()).error is None and event.finish_reason is None:
                    texts.append(event.text)
            finally:
                gen.is_cancelled = True
            if event.error is not None:
                return JSONResponse(_internal_error(event.error), status_code=500)
            return {
                "id": request_id, "object": "chat.completion", "created": created, "model": model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(texts) + event.text},
                             "finish_reason": event.finish_reason}],
                "usage": usage(event.num_completion_tokens),
            }

        def chunk(delta: dict, finish_reason: str | None = None) -> str:
            return _sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model_name,
                         "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]})

        async def events() -> AsyncIterator[str]:
            try:
                yield chunk({"role": "assistant", "content": ""})
                while True:
                    event = await queue.get()
                    if event.error is not None:
                        yield _sse(_internal_error(event.error))
                        break
                    if event.text:
                        yield chunk({"content": event.text})
                    if event.finish_reason is not None:
                        yield chunk({}, event.finish_reason)
                        if params.include_usage:
                            yield _sse({"id": request_id, "object": "chat.completion.chunk", "created": created,
                                        "model": model_name, "choices": [], "usage": usage(event.num_completion_tokens)})
                        break
                yield "data: [DONE]\n\n"
            finally:
                gen.is_cancelled = True  # a disconnect closes us here: the row runs on, its output is dropped

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a local Hugging Face model directory")
    parser.add_argument("--model-name", required=True, help="the name /v1/models lists and requests use")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-batch-size", type=int, default=16, help="requests per generate call")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    parser.add_argument("--num-threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.max_batch_size < 1:
        parser.error(f"--max-batch-size must be >= 1 (got {args.max_batch_size})")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(args.model, args.model_name, max_batch_size=args.max_batch_size, dtype=args.dtype,
                    num_threads=args.num_threads)
    logger.info("serving %s from %s on %s:%d (%d torch threads)", args.model_name, args.model, args.host, args.port,
                torch.get_num_threads())
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
