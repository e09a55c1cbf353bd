"""POST /tokenize and POST /detokenize, in vLLM's shapes.

    /tokenize    {model?, prompt, add_special_tokens = true, return_token_strs = false}
                 {model?, messages, add_generation_prompt = true, add_special_tokens = false,
                  chat_template_kwargs?, return_token_strs = false}
                 ──▶ {count, max_model_len, tokens, token_strs}    (token_strs: null unless asked)
    /detokenize  {model?, tokens} ──▶ {prompt}

A body with `messages` is a chat request: rendered by the chat template exactly as
/v1/chat/completions renders it (same allow-listed `chat_template_kwargs`, in a thread with the
same time limit: serving/api/generation/chat_template.py), so `count` is what a chat completion's
`usage.prompt_tokens` will be. A prompt is tokenized as /v1/completions tokenizes it. Detokenizing
decodes special tokens too (vLLM's default); an id outside the tokenizer's vocabulary is a 400
naming `tokens`.

Like the completion routes: the caller's API key (401), its tier's model allow-list (404 for a
model it may not use), the body size limit (413), errors in OpenAI's shape (a field named in
`param`), a 5xx naming the request id its exception is logged under. Nothing is generated, so
nothing is billed or taken from the key's rate limits.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from serving.api.endpoints.context import EndpointContext
from serving.api.endpoints.http_io import error_response, parse_body, read_json
from serving.api.errors import to_api_error, with_request_id
from serving.api.generation.chat_template import render_off_loop, template_kwargs
from serving.api.generation.tool_calls import plan_tools
from serving.api.protocol.wire import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from serving.config.access import APIKey
from serving.engine.errors import InvalidRequestError

__all__ = ["add_tokenize_routes"]

logger = logging.getLogger(__name__)


def add_tokenize_routes(app: FastAPI, ctx: EndpointContext, authenticate: Callable[[Request], APIKey]) -> None:
    """Register /tokenize and /detokenize on the server's app."""

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await _answer(ctx, authenticate, request, _tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await _answer(ctx, authenticate, request, _detokenize)


async def _answer(ctx: EndpointContext, authenticate: Callable[[Request], APIKey], request: Request, handler) -> Response:
    request_id = f"tok-{uuid.uuid4().hex}"
    try:
        key = authenticate(request)
        body = await read_json(request, ctx.config.max_request_body_bytes)
        return JSONResponse(await handler(ctx, body, key))
    except Exception as exc:
        error = to_api_error(exc)
        if error.status >= 500:
            logger.exception("request %s failed (%d %s)", request_id, error.status, error.code or error.type)
        response = error_response(with_request_id(error, request_id))
        response.headers["x-request-id"] = request_id
        return response


async def _tokenize(ctx: EndpointContext, body: dict, key: APIKey) -> dict:
    frontend, api = ctx.frontend, ctx.config.api
    if "messages" in body:
        chat = parse_body(TokenizeChatRequest, body)
        await ctx.models.resolve(chat.model, key)
        kwargs = template_kwargs(chat.chat_template_kwargs, api)
        tooling = ctx.config.tool_calling
        tools = plan_tools(chat, parser=tooling.parser, max_tools=tooling.max_tools)
        ids = await render_off_loop(
            lambda: frontend.encode_chat(
                chat.messages, add_generation_prompt=chat.add_generation_prompt, chat_template_kwargs=kwargs,
                add_special_tokens=chat.add_special_tokens, tools=tools, tool_prompt=tooling.prompt,
            ),
            api.render_timeout_s,
            param="chat_template_kwargs.chat_template" if "chat_template" in kwargs else "messages",
        )
        want_strs = chat.return_token_strs
    else:
        plain = parse_body(TokenizeCompletionRequest, body)
        await ctx.models.resolve(plain.model, key)
        ids = await render_off_loop(
            lambda: frontend.tokenizer(plain.prompt, add_special_tokens=plain.add_special_tokens).input_ids,
            api.render_timeout_s, param="prompt",
        )
        want_strs = plain.return_token_strs
    info = await frontend.model_info()
    return {
        "count": len(ids), "max_model_len": info.max_model_len, "tokens": ids,
        "token_strs": frontend.tokenizer.convert_ids_to_tokens(ids) if want_strs else None,
    }


async def _detokenize(ctx: EndpointContext, body: dict, key: APIKey) -> dict:
    request = parse_body(DetokenizeRequest, body)
    await ctx.models.resolve(request.model, key)
    tokenizer = ctx.frontend.tokenizer
    vocab_size = len(tokenizer)
    for i, token_id in enumerate(request.tokens):
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError("tokens", f"tokens[{i}] = {token_id} is not in the vocabulary (0..{vocab_size - 1})")
    text = await render_off_loop(lambda: tokenizer.decode(request.tokens), ctx.config.api.render_timeout_s, param="tokens")
    return {"prompt": text}
