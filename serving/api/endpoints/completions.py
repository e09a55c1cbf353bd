"""POST /v1/completions: one or several prompts (text or token ids), each fitted by
`truncate_prompt_tokens`, answered as text_completion or its stream; with `echo` each choice
starts with its prompt and, with `logprobs`, the prompt's scores from the prefill pass
(serving/api/protocol/prompt_scores.py). The ingress's checks before it are serving/api/endpoints/routes.py's."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse, Response

from serving.api.generation import context_budget
from serving.api.admission import limits
from serving.api.endpoints.calls import Call, with_partial
from serving.api.generation.chat_template import render_off_loop
from serving.api.admission.deadlines import bounded, deadline_for
from serving.api.errors import RequestTimeoutError, error_status
from serving.api.protocol.field_support import COMPLETION_FIELDS, screen
from serving.api.endpoints.http_io import chain_deltas, finite_logprob, first_delta, merge_deltas, parse_body, split_prompts, sse_response
from serving.api.generation.pipeline import Usage
from serving.api.protocol.prompt_scores import echoed_logprobs, joined, legacy_top, vllm_prompt_logprobs
from serving.api.protocol.wire import CompletionRequest, sampling_params
from serving.api.protocol.structured import guided_param
from serving.engine.outputs import TokenLogprob
from serving.observability import tracing

if TYPE_CHECKING:
    from serving.api.endpoints.routes import OpenAIServer

__all__ = ["CompletionsEndpoint"]


class CompletionsEndpoint:
    """The completions handler of one OpenAIServer (its frontend, config, limits and metrics)."""

    def __init__(self, server: OpenAIServer):
        self.server = server

    async def __call__(self, body: dict, call: Call) -> Response:
        request = parse_body(CompletionRequest, body)
        call.headers.update(screen(request, COMPLETION_FIELDS))
        lora = await self.server.resolve_model(request.model, call.key)
        call.deadline = deadline_for(request.timeout, self.server.config, call.key.tier, call.received_at, self.server.clock)
        prompts = split_prompts(request.prompt)
        limits.check_request(request, len(prompts), self.server.config.api)
        params = sampling_params(request)
        with tracing.stage(call.trace, "tokenize"):
            if any(isinstance(p, str) for p in prompts):  # token ids need no tokenizer
                prompt_ids = await render_off_loop(
                    lambda: [self.server.frontend.encode_prompt(p) for p in prompts], self.server.config.api.render_timeout_s, param="prompt",
                )
            else:
                prompt_ids = [self.server.frontend.encode_prompt(p) for p in prompts]
            info = await self.server.frontend.model_info()
            budget = context_budget.budget_for(
                truncation="disabled", truncate_prompt_tokens=request.truncate_prompt_tokens, max_tokens=params.max_tokens,
                max_tokens_param="max_tokens", max_model_len=info.max_model_len, config=self.server.config.api.context_budget,
            )
            fitted = [context_budget.fit_prompt(budget, ids) for ids in prompt_ids]
            prompt_ids = [f.prompt_ids for f in fitted]
            for ids in prompt_ids:
                await self.server.frontend.validate(ids, params, prompt_param="prompt")
            if params.guided is not None:
                await self.server.frontend.check_guided(params.guided, guided_param(request))
        per_prompt = limits.fit_max_tokens(params, [len(ids) for ids in prompt_ids], info.max_model_len, self.server.config.api, param="max_tokens")
        self.server.admit(call, prompt_ids, per_prompt)
        request_id = call.request_id
        if call.trace is not None:
            call.trace.set({"kvrelay.request_id": request_id, "gen_ai.request.model": self.server.model_name})
        created = int(time.time())
        usages = [Usage(dropped_tokens=f.dropped_tokens) for f in fitted]
        if budget.is_fitting:
            call.headers[context_budget.DROPPED_TOKENS_HEADER] = str(sum(f.dropped_tokens for f in fitted))
        streams = [
            self.server.frontend.generate(
                f"{request_id}-{i}", ids, per_prompt[i], usages[i], priority=call.priority,
                cache_salt=request.cache_salt, index_offset=i * params.n, session=request.user, trace=call.trace,
                record=call.record, lora_name=lora, lora_path=self.server.adapters.get(lora),
            )
            for i, ids in enumerate(prompt_ids)
        ]
        deltas = bounded(streams[0] if len(streams) == 1 else merge_deltas(streams), call.deadline)
        deltas = self.server.metrics.track(call.record, deltas, prompt_tokens=sum(map(len, prompt_ids)), status_of=error_status)
        base = {"id": request_id, "object": "text_completion", "created": created, "model": self.server.model_name, "system_fingerprint": None}
        num_choices = params.n * len(prompts)
        want_logprobs = params.logprobs is not None
        # echo: each choice's text starts with its prompt, and its logprobs with the prompt's tokens
        # (a prompt cut by truncate_prompt_tokens echoes what the model was given)
        prompt_texts = [
            p if isinstance(p, str) and not f.dropped_tokens else self.server.frontend.tokenizer.decode(ids)
            for p, ids, f in zip(prompts, prompt_ids, fitted)
        ] if request.echo else []

        def total_usage() -> Usage:
            total = Usage()
            for u in usages:
                total.add(u)
            return total

        call.account.track(total_usage)

        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            first = await first_delta(deltas)

            async def chunks():
                extra = {"usage": None} if include_usage else {}
                offsets = [0] * num_choices
                echoed = [not request.echo] * num_choices
                async for delta in chain_deltas(first, deltas):
                    lp = None
                    text = delta.text
                    if not echoed[delta.index]:  # the choice's first delta: its prompt goes first
                        echoed[delta.index] = True
                        i = delta.index // params.n
                        text = prompt_texts[i] + text
                        if want_logprobs:
                            lp = echoed_logprobs(self.server.frontend, prompt_ids[i], delta.prompt_logprobs, params.logprobs)
                            offsets[delta.index] = len(prompt_texts[i])
                    if want_logprobs and delta.logprobs:
                        generated = self._completion_logprobs(delta.logprobs, offsets[delta.index])
                        offsets[delta.index] = generated["text_offset"][-1] + len(generated["tokens"][-1])
                        lp = generated if lp is None else joined(lp, generated)
                    if not text and delta.finish_reason is None and lp is None:
                        continue  # held back by the detokenizer or a possible stop string
                    yield {**base, "choices": [{"index": delta.index, "text": text, "logprobs": lp, "finish_reason": delta.finish_reason}], **extra}
                if include_usage:
                    yield {**base, "choices": [], "usage": call.account.settle()}

            return sse_response(chunks(), deltas, call.finish, request_id)

        echoed = [prompt_texts[i // params.n] if request.echo else "" for i in range(num_choices)]
        texts = list(echoed)
        finish: list[str | None] = [None] * num_choices
        logprobs: list[list[TokenLogprob]] = [[] for _ in range(num_choices)]
        prompt_scores: list[list[TokenLogprob] | None] = [None] * num_choices

        def choice_logprobs(i: int) -> dict:
            generated = self._completion_logprobs(logprobs[i], len(echoed[i]))
            if not request.echo:
                return generated
            return joined(echoed_logprobs(self.server.frontend, prompt_ids[i // params.n], prompt_scores[i], params.logprobs), generated)

        def response(usage: dict | None) -> dict:
            choices = [
                {
                    "index": i,
                    "text": texts[i],
                    "logprobs": choice_logprobs(i) if want_logprobs else None,
                    "finish_reason": finish[i],
                }
                for i in range(num_choices)
            ]
            if request.prompt_logprobs is not None:
                for i, choice in enumerate(choices):
                    choice["prompt_logprobs"] = vllm_prompt_logprobs(
                        self.server.frontend, prompt_ids[i // params.n], prompt_scores[i], request.prompt_logprobs,
                    )
            return {**base, "choices": choices, "usage": usage}

        try:
            async for delta in deltas:
                if delta.prompt_logprobs is not None:
                    prompt_scores[delta.index] = delta.prompt_logprobs
                texts[delta.index] += delta.text
                finish[delta.index] = delta.finish_reason or finish[delta.index]
                if delta.logprobs:
                    logprobs[delta.index] += delta.logprobs
        except RequestTimeoutError as exc:
            with_partial(exc, call.account, response)
            raise
        return JSONResponse(response(call.account.settle()), headers=call.account.headers())

    def _completion_logprobs(self, logprobs: list[TokenLogprob], offset: int) -> dict:
        tokens, token_logprobs, top, text_offset = [], [], [], []
        for lp in logprobs:
            text = self.server.frontend.token_text(lp.token_id)
            tokens.append(text)
            token_logprobs.append(finite_logprob(lp.logprob))
            top.append(legacy_top(self.server.frontend, lp, len(lp.top)))
            text_offset.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": text_offset}
