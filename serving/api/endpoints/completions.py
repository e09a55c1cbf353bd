"""POST /v1/completions: one or several prompts (text or token ids), each fitted by
`truncate_prompt_tokens`, answered as text_completion or its stream; with `echo` each choice
starts with its prompt and, with `logprobs`, the prompt's scores from the prefill pass
(serving/api/protocol/prompt_scores.py). The ingress's checks before it are serving/api/endpoints/routes.py's."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi.responses import Response

from serving.api.admission import limits
from serving.api.endpoints.calls import Call
from serving.api.endpoints.collect import Choices, answer
from serving.api.endpoints.context import EndpointContext
from serving.api.endpoints.http_io import chain_deltas, finite_logprob, first_delta, merge_deltas, parse_body, split_prompts, sse_response
from serving.api.generation import context_budget
from serving.api.generation.chat_template import render_off_loop
from serving.api.generation.pipeline import ChoiceDelta, Usage
from serving.api.protocol.field_support import COMPLETION_FIELDS, screen
from serving.api.protocol.prompt_scores import echoed_logprobs, joined, legacy_top, vllm_prompt_logprobs
from serving.api.protocol.structured import guided_param
from serving.api.protocol.wire import CompletionRequest, sampling_params
from serving.engine.outputs import TokenLogprob
from serving.engine.params import SamplingParams
from serving.observability import tracing

__all__ = ["CompletionsEndpoint"]


@dataclass
class _Batch:
    """One completion request's prompts as the engine was given them, and its choices' shape:
    `n` choices per prompt, choice i answering prompt i // n."""

    request: CompletionRequest
    params: SamplingParams
    prompt_ids: list[list[int]]
    prompt_texts: list[str]  # with echo: each prompt's text, which its choices start with; else []
    base: dict  # every chunk's and the response's id, object, created, model

    @property
    def num_choices(self) -> int:
        return self.params.n * len(self.prompt_ids)

    def prompt_of(self, choice: int) -> int:
        return choice // self.params.n


class CompletionsEndpoint:
    """The completions handler of one OpenAIServer, over its EndpointContext."""

    def __init__(self, ctx: EndpointContext):
        self.ctx = ctx

    async def __call__(self, body: dict, call: Call) -> Response:
        ctx = self.ctx
        request = parse_body(CompletionRequest, body)
        call.headers.update(screen(request, COMPLETION_FIELDS))
        lora = await ctx.models.resolve(request.model, call.key)
        ctx.set_deadline(call, request.timeout)
        prompts = split_prompts(request.prompt)
        limits.check_request(request, len(prompts), ctx.config.api)
        params = sampling_params(request)
        with tracing.stage(call.trace, "tokenize"):
            budget, fitted, max_model_len = await self._tokenized(request, prompts, params)
        prompt_ids = [f.prompt_ids for f in fitted]
        per_prompt = limits.fit_max_tokens(params, [len(ids) for ids in prompt_ids], max_model_len, ctx.config.api, param="max_tokens")
        ctx.admit(call, prompt_ids, per_prompt)
        ctx.traced(call)
        base = {"id": call.request_id, "object": "text_completion", "created": int(time.time()), "model": ctx.model_name, "system_fingerprint": None}
        usages = [Usage(dropped_tokens=f.dropped_tokens) for f in fitted]
        if budget.is_fitting:
            call.headers[context_budget.DROPPED_TOKENS_HEADER] = str(sum(f.dropped_tokens for f in fitted))
        deltas = self._generate(call, request, lora, prompt_ids, per_prompt, usages, params.n)
        # echo: each choice's text starts with its prompt, and its logprobs with the prompt's tokens
        # (a prompt cut by truncate_prompt_tokens echoes what the model was given)
        prompt_texts = [
            p if isinstance(p, str) and not f.dropped_tokens else ctx.frontend.tokenizer.decode(f.prompt_ids)
            for p, f in zip(prompts, fitted)
        ] if request.echo else []
        batch = _Batch(request, params, prompt_ids, prompt_texts, base)
        call.account.track(lambda: _total(usages))
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            first = await first_delta(deltas)
            return sse_response(self._chunks(batch, first, deltas, call, include_usage), deltas, call.finish, call.request_id)
        choices = Choices.starting_with([self._echoed(batch, i) for i in range(batch.num_choices)])
        return await answer(deltas, choices, call, lambda usage: self._completion(batch, choices, usage))

    async def _tokenized(self, request: CompletionRequest, prompts: list,
                         params: SamplingParams) -> tuple[context_budget.Budget, list[context_budget.Fitted], int]:
        """Each prompt's ids (text tokenized off the loop), fitted by truncate_prompt_tokens and
        validated; its structured output compiled. Its budget and the context window with them."""
        frontend, api = self.ctx.frontend, self.ctx.config.api
        if any(isinstance(p, str) for p in prompts):  # token ids need no tokenizer
            prompt_ids = await render_off_loop(lambda: [frontend.encode_prompt(p) for p in prompts], api.render_timeout_s, param="prompt")
        else:
            prompt_ids = [frontend.encode_prompt(p) for p in prompts]
        info = await frontend.model_info()
        budget = context_budget.budget_for(
            truncation="disabled", truncate_prompt_tokens=request.truncate_prompt_tokens, max_tokens=params.max_tokens,
            max_tokens_param="max_tokens", max_model_len=info.max_model_len, config=api.context_budget,
        )
        fitted = [context_budget.fit_prompt(budget, ids) for ids in prompt_ids]
        for f in fitted:
            await frontend.validate(f.prompt_ids, params, prompt_param="prompt")
        if params.guided is not None:
            await frontend.check_guided(params.guided, guided_param(request))
        return budget, fitted, info.max_model_len

    def _generate(self, call: Call, request: CompletionRequest, lora: str | None, prompt_ids: list[list[int]],
                  per_prompt: list[SamplingParams], usages: list[Usage], n: int) -> AsyncIterator[ChoiceDelta]:
        """Every prompt's deltas, merged, as one stream: prompt i's choices are i*n..i*n+n-1."""
        ctx = self.ctx
        streams = [
            ctx.frontend.generate(
                f"{call.request_id}-{i}", ids, per_prompt[i], usages[i], priority=call.priority,
                cache_salt=request.cache_salt, index_offset=i * n, session=request.user, trace=call.trace,
                record=call.record, lora_name=lora, lora_path=ctx.models.path_of(lora),
            )
            for i, ids in enumerate(prompt_ids)
        ]
        deltas = streams[0] if len(streams) == 1 else merge_deltas(streams)
        return ctx.watched(call, deltas, prompt_tokens=sum(map(len, prompt_ids)))

    @staticmethod
    def _echoed(batch: _Batch, choice: int) -> str:
        return batch.prompt_texts[batch.prompt_of(choice)] if batch.request.echo else ""

    async def _chunks(self, batch: _Batch, first: ChoiceDelta | None, deltas: AsyncIterator[ChoiceDelta], call: Call,
                      include_usage: bool) -> AsyncIterator[dict]:
        """The text_completion chunks of a stream: a choice's prompt (echo) before its first text."""
        request, params, base = batch.request, batch.params, batch.base
        want_logprobs = params.logprobs is not None
        extra = {"usage": None} if include_usage else {}
        offsets = [0] * batch.num_choices
        echoed = [not request.echo] * batch.num_choices
        async for delta in chain_deltas(first, deltas):
            lp = None
            text = delta.text
            if not echoed[delta.index]:  # the choice's first delta: its prompt goes first
                echoed[delta.index] = True
                i = batch.prompt_of(delta.index)
                text = batch.prompt_texts[i] + text
                if want_logprobs:
                    lp = echoed_logprobs(self.ctx.frontend, batch.prompt_ids[i], delta.prompt_logprobs, params.logprobs)
                    offsets[delta.index] = len(batch.prompt_texts[i])
            if want_logprobs and delta.logprobs:
                generated = self._completion_logprobs(delta.logprobs, offsets[delta.index])
                offsets[delta.index] = generated["text_offset"][-1] + len(generated["tokens"][-1])
                lp = generated if lp is None else joined(lp, generated)
            if not text and delta.finish_reason is None and lp is None:
                continue  # held back by the detokenizer or a possible stop string
            yield {**base, "choices": [{"index": delta.index, "text": text, "logprobs": lp, "finish_reason": delta.finish_reason}], **extra}
        if include_usage:
            yield {**base, "choices": [], "usage": call.account.settle()}

    def _completion(self, batch: _Batch, choices: Choices, usage: dict | None) -> dict:
        """The text_completion of what the choices hold."""
        request, params = batch.request, batch.params
        out = []
        for i in range(batch.num_choices):
            prompt_ids = batch.prompt_ids[batch.prompt_of(i)]
            logprobs = None
            if params.logprobs is not None:
                logprobs = self._completion_logprobs(choices.logprobs[i], len(self._echoed(batch, i)))
                if request.echo:
                    logprobs = joined(echoed_logprobs(self.ctx.frontend, prompt_ids, choices.prompt_scores[i], params.logprobs), logprobs)
            choice = {"index": i, "text": choices.texts[i], "logprobs": logprobs, "finish_reason": choices.finish[i]}
            if request.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(self.ctx.frontend, prompt_ids, choices.prompt_scores[i], request.prompt_logprobs)
            out.append(choice)
        return {**batch.base, "choices": out, "usage": usage}

    def _completion_logprobs(self, logprobs: list[TokenLogprob], offset: int) -> dict:
        tokens, token_logprobs, top, text_offset = [], [], [], []
        for lp in logprobs:
            text = self.ctx.frontend.token_text(lp.token_id)
            tokens.append(text)
            token_logprobs.append(finite_logprob(lp.logprob))
            top.append(legacy_top(self.ctx.frontend, lp, len(lp.top)))
            text_offset.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": text_offset}


def _total(usages: list[Usage]) -> Usage:
    """The request's usage: its prompts' added up."""
    total = Usage()
    for u in usages:
        total.add(u)
    return total
