"""The ingress's request pipeline, independent of HTTP and of Ray.

    messages ─chat template─▶ prompt ids ─validate─▶ Backend.generate(GenerateRequest)
                                                          │ token ids (+ logprobs), per choice
                   ChoiceDelta (text, tokens) ◀─detokenize, stop strings─┘

Workers return token ids only (`SamplingParams.detokenize=False`, no stop strings). The ingress
owns the text: one IncrementalDetokenizer and StopChecker per choice, fed from the prompt on.
That is what makes stop strings correct across the prefill→decode hand-off, where the first
token comes from one engine and the rest from another. A stop string ends the choice here;
once every choice has ended the backend stream is closed, which aborts the request remotely.
An engine that refused the request after it waited past its `max_queue_wait_s` (finish_reason
"queue_timeout", no tokens) makes it a QueueTimeoutError: 503 with Retry-After.

A Backend is where the tokens come from (serving/api/backend.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Literal

from serving.api.backend import Backend, GenerateRequest
from serving.api.errors import QueueTimeoutError
from serving.api.generation.coalescing import coalesced
from serving.api.generation.tool_calls import ToolPlan, render_conversation, template_knows_tools
from serving.api.protocol.wire import ChatMessage
from serving.engine.errors import ContextLengthError, InvalidRequestError
from serving.engine.kv.block_hash import block_extra_keys, hash_blocks
from serving.engine.outputs import TokenLogprob
from serving.engine.params import GuidedSpec, SamplingParams
from serving.engine.request import RequestStatus
from serving.engine.sampling.detokenizer import IncrementalDetokenizer
from serving.engine.sampling.grammar import compiler_for
from serving.engine.sampling.stop_checker import StopChecker
from serving.engine.validation import ModelInfo, check_request
from serving.observability.ingress_metrics import RequestRecord
from serving.observability.tracing import RequestTrace

__all__ = ["ChoiceDelta", "Usage", "Frontend"]

logger = logging.getLogger(__name__)

_QUEUE_TIMEOUT = RequestStatus.FINISHED_QUEUE_TIMEOUT.value


@dataclass
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # params.prompt_logprobs: on each choice's first delta after the engine scored the prompt
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # What fitting the prompt into the context window dropped (serving/api/generation/context_budget.py);
    # None when the request asked for no fitting, and then not reported.
    dropped_messages: int | None = None
    dropped_tokens: int | None = None

    def add(self, other: Usage) -> None:
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.cached_tokens += other.cached_tokens
        for name in ("dropped_messages", "dropped_tokens"):
            theirs = getattr(other, name)
            if theirs is not None:
                setattr(self, name, (getattr(self, name) or 0) + theirs)

    def to_dict(self) -> dict:
        details = {"cached_tokens": self.cached_tokens}
        if self.dropped_messages is not None:
            details["dropped_messages"] = self.dropped_messages
        if self.dropped_tokens is not None:
            details["dropped_tokens"] = self.dropped_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": details,
        }


class _Choice:
    """Text state of one choice at the ingress."""

    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams):
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        # Only stop strings are checked here; stop tokens, EOS and length are the engine's.
        self.checker = StopChecker.for_text(params)
        self.num_tokens = 0
        self.finished = False
        self.prompt_logprobs: list[TokenLogprob] | None = None  # arrived, not yet on a delta


class Frontend:
    def __init__(self, tokenizer, backend: Backend, model_name: str, *, max_merged_tokens: int = 16):
        self.tokenizer = tokenizer
        self.backend = backend
        self.model_name = model_name
        self.max_merged_tokens = max_merged_tokens
        self._info: ModelInfo | None = None
        self._info_lock = asyncio.Lock()

    async def model_info(self) -> ModelInfo:
        if self._info is None:
            async with self._info_lock:
                if self._info is None:
                    self._info = await self.backend.model_info()
        return self._info

    # ---- prompts -----------------------------------------------------------------------------
    def encode_chat(
        self, messages: list[ChatMessage], *, add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None, add_special_tokens: bool = False, tools: ToolPlan | None = None,
        tool_prompt: Literal["auto", "template", "kvrelay"] = "auto",
    ) -> list[int]:
        """The prompt's token ids; `tools`: the request's tool plan, shown by the template or by
        kvrelay's tool prompt (`tool_prompt`, serving/api/generation/tool_calls.py)."""
        template = getattr(self.tokenizer, "chat_template", None)
        if template is None:
            raise InvalidRequestError(
                "messages", "this model has no chat template; use /v1/completions with a prompt"
            )
        knows_tools = tool_prompt == "template" or (tool_prompt == "auto" and template_knows_tools(template))
        conversation, tool_kwargs = render_conversation(messages, tools, knows_tools=knows_tools)
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=False,
                **tool_kwargs, **(chat_template_kwargs or {}),
            )
        except Exception as exc:  # jinja2 errors from a template's raise_exception(...)
            raise InvalidRequestError("messages", f"the chat template rejected them: {exc}") from exc
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt).input_ids
        return list(prompt)

    async def validate(self, prompt_ids: list[int], params: SamplingParams, *, prompt_param: str = "messages") -> None:
        """The request's one validation, against the workers' limits, before it is generated
        (the sampling parameters were checked as they were built). `prompt_param` is the request
        field the prompt came from, named in errors about it (the engine knows only token ids:
        it says "messages" or "prompt_token_ids")."""
        info = await self.model_info()
        try:
            check_request(
                prompt_ids, [], params, hold_kv=False, kv_payload=None, vocab_size=info.vocab_size,
                max_model_len=info.max_model_len, kv_layout=None,
            )
        except ContextLengthError as exc:
            if exc.param != "messages" or prompt_param == "messages":
                raise
            raise ContextLengthError(prompt_param, exc.message, num_tokens=exc.num_tokens, limit=exc.limit) from None
        except InvalidRequestError as exc:
            if exc.param not in ("prompt", "prompt_token_ids") or exc.param == prompt_param:
                raise
            raise InvalidRequestError(prompt_param, exc.message) from None

    async def check_guided(self, spec: GuidedSpec, param: str) -> None:
        """Compile a structured output's grammar before the request goes anywhere (off the event
        loop, in the grammar compiler's threads): InvalidRequestError naming `param` (the request's
        field) when it does not compile. The grammar stays in this process's cache, which an
        in-process engine shares (serving/engine/sampling/grammar.py)."""
        info = await self.model_info()
        compiler = compiler_for(self.tokenizer, info.vocab_size, info.eos_token_ids)
        try:
            await _shared_result(compiler.submit(spec))
        except InvalidRequestError as exc:
            raise InvalidRequestError(param, exc.message) from None

    # ---- generation --------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        usage: Usage,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        index_offset: int = 0,
        session: str | None = None,
        trace: RequestTrace | None = None,
        record: RequestRecord | None = None,
        lora_name: str | None = None,
        lora_path: str | None = None,
    ) -> AsyncIterator[ChoiceDelta]:
        """Run and detokenize one prompt that `validate` passed; `usage` is filled in as tokens
        arrive. The workers get the parameters without what the ingress does itself (stop
        strings, detokenizing): their one change of shape. `record`: the HTTP request's metrics
        record, which follows this prompt's path (its router's prediction, where its first
        token's time went: serving/observability/request_path.py)."""
        usage.prompt_tokens += len(prompt_ids)
        if record is not None:
            record.follow(request_id).needs_prompt_logprobs = params.prompt_logprobs is not None
        request = await self._request(request_id, prompt_ids, params, priority, cache_salt, session, trace, lora_name, lora_path)
        choices = [_Choice(self.tokenizer, prompt_ids, params) for _ in range(params.n)]
        stream = coalesced(self.backend.generate(request), self.max_merged_tokens)
        num_cached: int | None = None  # from the first output: where the prompt was computed
        detok = _DetokenizeTimer() if trace is not None else None
        try:
            async for out in stream:
                if num_cached is None:
                    num_cached = out.num_cached_tokens
                if out.prompt_logprobs is not None:
                    for choice in choices:
                        choice.prompt_logprobs = out.prompt_logprobs
                if any(c.finish_reason == _QUEUE_TIMEOUT for c in out.outputs):
                    raise QueueTimeoutError()  # refused before any token: the pool is overloaded
                for completion in out.outputs:
                    choice = choices[completion.index]
                    if choice.finished:
                        continue
                    if detok is not None:
                        delta = detok.time(self._advance, choice, completion)
                    else:
                        delta = self._advance(choice, completion)
                    usage.completion_tokens += len(delta.token_ids)
                    delta.index += index_offset
                    yield delta
                if all(c.finished for c in choices):
                    return
        finally:
            usage.cached_tokens += num_cached or 0
            await stream.aclose()
            if detok is not None:
                detok.record(trace, request_id)

    async def _request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, priority: int,
                       cache_salt: str | None, session: str | None, trace: RequestTrace | None,
                       lora_name: str | None, lora_path: str | None) -> GenerateRequest:
        """What the workers get: the parameters without what the ingress does itself, and the
        prompt's block hashes for routing (with the engines' block size and extra keys)."""
        worker_params = replace(params, stop=[], include_stop_str_in_output=False, detokenize=False)
        info = await self.model_info()
        return GenerateRequest(
            request_id, prompt_ids, worker_params, priority, cache_salt,
            block_hashes=hash_blocks(prompt_ids, info.block_size, block_extra_keys(cache_salt, lora_name, lora_path)),
            block_size=info.block_size, session=session,
            trace_context=trace.carrier() if trace is not None else None, lora_name=lora_name, lora_path=lora_path,
        )

    def _advance(self, choice: _Choice, completion) -> ChoiceDelta:
        texts: list[str] = []
        token_ids = completion.token_ids
        logprobs = completion.logprobs
        finish_reason = completion.finish_reason
        stop_reason = completion.stop_reason
        ends_on_stop_token = finish_reason == "stop" and not isinstance(stop_reason, str)
        for i, token_id in enumerate(token_ids):
            choice.num_tokens += 1
            if ends_on_stop_token and i == len(token_ids) - 1:
                break  # EOS / stop token: counted, not shown
            result = choice.checker.check(token_id, choice.detokenizer.step([token_id]), choice.num_tokens)
            texts.append(result.text)
            if result.finished:
                token_ids = token_ids[: i + 1]
                logprobs = logprobs[: i + 1] if logprobs else logprobs
                finish_reason, stop_reason = "stop", result.stop_reason
                choice.finished = True
                break
        if not choice.finished and finish_reason is not None:
            texts.append(choice.checker.flush() + choice.detokenizer.flush())
            choice.finished = True
        prompt_logprobs, choice.prompt_logprobs = choice.prompt_logprobs, None
        return ChoiceDelta(completion.index, "".join(texts), list(token_ids), logprobs, finish_reason, stop_reason, prompt_logprobs)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes. A token holding part of a character decodes to U+FFFD, whose
        UTF-8 (EF BF BD) is not its bytes; OpenAI's `bytes` exists to join such tokens."""
        text = self.token_text(token_id)
        if "\ufffd" not in text:
            return text.encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if _BYTE_FALLBACK_PIECE.fullmatch(piece):  # SentencePiece: <0xF0>
            return bytes([int(piece[3:5], 16)])
        if all(c in _BYTE_LEVEL_CHARS for c in piece):  # byte-level BPE: one character per byte
            return bytes(_BYTE_LEVEL_CHARS[c] for c in piece)
        return text.encode("utf-8")



async def _shared_result(future: concurrent.futures.Future):
    """A concurrent future's result, awaited without cancelling it when the awaiting task is
    cancelled (asyncio.wrap_future would: the future is the compile cache's, shared by others)."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def settle(_: concurrent.futures.Future) -> None:
        if not waiter.done():
            waiter.set_result(None)

    def done(_: concurrent.futures.Future) -> None:
        try:
            loop.call_soon_threadsafe(settle, future)
        except RuntimeError:  # the loop closed: nobody waits
            pass

    future.add_done_callback(done)
    await waiter
    return future.result()


class _DetokenizeTimer:
    """The detokenize stage of one prompt (only when tracing): detokenization runs a little after
    every engine step, so the span covers the first output to the last delta and
    `kvrelay.detokenize.busy_ms` says how much of that was spent in it."""

    def __init__(self):
        self.start_ns: int | None = None
        self.end_ns = 0
        self.busy_ns = 0
        self.num_tokens = 0

    def time(self, advance, choice: _Choice, completion) -> ChoiceDelta:
        start = time.time_ns()
        if self.start_ns is None:
            self.start_ns = start
        delta = advance(choice, completion)
        self.end_ns = time.time_ns()
        self.busy_ns += self.end_ns - start
        self.num_tokens += len(delta.token_ids)
        return delta

    def record(self, trace: RequestTrace, request_id: str) -> None:
        if self.start_ns is not None:
            trace.record("detokenize", self.start_ns, self.end_ns, {
                "kvrelay.request_id": request_id, "kvrelay.detokenize.busy_ms": self.busy_ns / 1e6,
                "kvrelay.detokenize.num_tokens": self.num_tokens,
            })

def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable bytes stand for themselves, the other
    bytes are written as chr(256 + k) in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(others)}


_BYTE_LEVEL_CHARS = _byte_level_chars()
_BYTE_FALLBACK_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
