"""HTTP plumbing of the OpenAI API: parsing bodies into OpenAI-shaped errors, and streaming deltas
as server-sent events.

    read_json / parse_body    body bytes -> dict -> wire model; failures become APIErrors
                              (413 past the size limit, checked on Content-Length before reading
                              and while reading; 422 + `detail` for malformed JSON; 400 for
                              nesting too deep to parse, and naming the field otherwise)
    first_delta / chain_deltas
                              pull the first delta before answering, so a failure before any
                              token is an HTTP status and not an SSE event
    merge_deltas              interleave several prompts' streams (completions with a list prompt)
    sse_response              `data: {...}` events, an `error` event on a late failure, `[DONE]`
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from serving.api.errors import APIError, to_api_error, with_request_id
from serving.api.generation.pipeline import ChoiceDelta

__all__ = [
    "read_json", "parse_body", "param_name", "split_prompts", "error_response", "finite_logprob",
    "first_delta", "chain_deltas", "merge_deltas", "sse_response",
]

logger = logging.getLogger(__name__)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def read_json(request: Request, max_bytes: int) -> dict:
    """The body as a JSON object, read no further than `max_bytes`: a larger Content-Length is
    refused before a byte is read, and a body without one (chunked) as soon as it passes the limit,
    so a client cannot make the ingress buffer more than that."""
    declared = _content_length(request)
    if declared is not None and declared > max_bytes:
        raise APIError(413, f"The request body has {declared} bytes; the limit is {max_bytes}.", code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"The request body has more than {max_bytes} bytes, the limit.", code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        error = APIError(422, f"The request body is not valid JSON: {exc}", code="invalid_json")
        error.detail = [{"type": "json_invalid", "loc": ["body", getattr(exc, "pos", 0)], "msg": "JSON decode error", "input": {}, "ctx": {"error": str(exc)}}]
        raise error from exc
    except RecursionError:  # the C decoder's guard: about a thousand levels of [ or {
        raise APIError(400, "The request body nests arrays or objects too deeply to parse.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(422, f"The request body must be a JSON object, got {type(body).__name__}.", code="invalid_json")
    return body


def _content_length(request: Request) -> int | None:
    """The declared body size; None without the header (a chunked body)."""
    value = request.headers.get("content-length")
    if value is None:
        return None
    if not value.strip().isascii() or not value.strip().isdigit():
        raise APIError(400, f"The Content-Length header must be a number of bytes, got {value!r}.", code="invalid_content_length")
    return int(value)


def parse_body(model, body: dict):
    """The request as `model`; a 400 naming the first bad field. Unknown top-level fields are
    kept as the model's extras (serving/api/protocol/field_support.py names them in a response header) and
    in a debug log line."""
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = param_name(err["loc"])
        value = err.get("input")
        shown = "" if isinstance(value, (dict, list)) or err["type"] == "missing" else f" (got {value!r})"
        error = APIError(400, f"{param}: {err['msg']}{shown}", param=param, code="invalid_value")
        raise error from exc
    if request.model_extra:
        logger.debug("request fields ignored: %s", ", ".join(sorted(request.model_extra)))
    return request


def param_name(loc: tuple) -> str:
    # pydantic adds the union member's type to the path (`content.str`); keep only the fields.
    name = ""
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif part in ("str", "list[TextPart]", "list[str]", "list[int]", "list[list[int]]", "int", "float", "bool", "function-after", "literal"):
            continue
        else:
            name += ("." if name else "") + str(part)
    return name or "body"


def split_prompts(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt: must not be empty", param="prompt", code="invalid_value")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


def error_response(error: APIError) -> JSONResponse:
    body = error.body()
    detail = getattr(error, "detail", None)
    if detail is not None:
        body["detail"] = detail
    return JSONResponse(body, status_code=error.status, headers=error.headers)


def finite_logprob(value: float) -> float:
    return max(value, -9999.0)  # -inf is not valid JSON; OpenAI reports -9999.0


async def first_delta(deltas: AsyncIterator[ChoiceDelta]) -> ChoiceDelta | None:
    """The first delta, so failures before any token become an HTTP status, not an SSE event."""
    try:
        return await anext(deltas)
    except StopAsyncIteration:
        return None
    except BaseException:
        await deltas.aclose()
        raise


async def chain_deltas(first: ChoiceDelta | None, rest: AsyncIterator[ChoiceDelta]) -> AsyncIterator[ChoiceDelta]:
    if first is not None:
        yield first
        async for delta in rest:
            yield delta


async def merge_deltas(streams: list[AsyncIterator[ChoiceDelta]]) -> AsyncIterator[ChoiceDelta]:
    """Interleave several prompts' deltas as they come; closing it closes them all."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream):
        try:
            async for item in stream:
                await queue.put(item)
            await queue.put(done)
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        # A pump still inside its stream owns it (aclose() from here raises "already running");
        # cancelling the pump ends the stream, which aborts its request.
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


def sse_response(
    chunks: AsyncIterator[dict], deltas: AsyncIterator[ChoiceDelta], on_close: Callable[[int, str | None], None],
    request_id: str, *, typed_events: bool = False, failure_event: Callable[[dict], dict] | None = None,
) -> StreamingResponse:
    """`deltas` is closed explicitly: a disconnect can cancel us while `chunks` waits at a yield,
    and closing it would not reach the generator it iterates over. `on_close(200, error)` runs
    once the stream has ended, however it ended. A late failure's event is what a 5xx body would
    be (errors.py: no exception text, the request id); the log has the exception.

    `typed_events` (the Responses API's framing, serving/api/endpoints/responses.py): each event also
    gets an `event: <its type>` line, a late failure is `failure_event(error body)`, and there is no
    closing `data: [DONE]`."""

    def frame(chunk: dict) -> str:
        data = f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        return f"event: {chunk.get('type', 'error')}\n{data}" if typed_events else data

    async def body():
        failure = None
        try:
            async for chunk in chunks:
                yield frame(chunk)
        except asyncio.CancelledError:
            failure = "the client disconnected"
            raise
        except Exception as exc:
            error = to_api_error(exc)
            failure = f"{type(exc).__name__}: {exc}"
            logger.warning("request %s: its stream failed after its first token", request_id, exc_info=exc)
            error_body = with_request_id(error, request_id).body()
            yield frame(failure_event(error_body) if failure_event is not None else error_body)
        finally:
            await chunks.aclose()
            await deltas.aclose()
            on_close(200, failure)
        if not typed_events:
            yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers=_SSE_HEADERS)
