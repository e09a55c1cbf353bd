"""The API's OpenAPI 3.1 document, built from the wire models (serving/api/protocol/wire.py), served at
GET /openapi.json: what clients generate code from, and what the property-based tests
(schemathesis) generate requests from. Bodies are parsed by http_io, not by FastAPI, so FastAPI's
own document would describe none of them."""

from __future__ import annotations

from typing import Any

from serving.api.endpoints.responses import ResponsesRequest
from serving.api.protocol.wire import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)

__all__ = ["openapi_document"]

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]},
        },
    }},
}


def _body_schema(model, components: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(s): {"description": "OpenAI's error shape", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
            for s in statuses}


def openapi_document(model_name: str, *, has_keys: bool) -> dict[str, Any]:
    components: dict[str, Any] = {"Error": _ERROR}
    generation_errors = _errors(400, 401, 404, 408, 413, 422, 429, 503) if has_keys else _errors(400, 404, 408, 413, 422, 429, 503)

    def post(model, summary: str) -> dict[str, Any]:
        return {"post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": _body_schema(model, components)}}},
            "responses": {"200": {"description": "the completion (JSON, or SSE when `stream`)"}, **generation_errors},
        }}

    def post_tokens(models, summary: str, *statuses: int) -> dict[str, Any]:
        schemas = [_body_schema(m, components) for m in models]
        schema = schemas[0] if len(schemas) == 1 else {"oneOf": schemas}
        return {"post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            "responses": {"200": {"description": summary}, **_errors(*statuses, *((401,) if has_keys else ()))},
        }}

    def get(summary: str, *statuses: int) -> dict[str, Any]:
        return {"get": {"summary": summary, "responses": {"200": {"description": summary}, **_errors(*statuses)}}}

    paths = {
        "/v1/chat/completions": post(ChatCompletionRequest, "chat completion"),
        "/v1/completions": post(CompletionRequest, "text completion"),
        "/v1/responses": post(ResponsesRequest, "response (OpenAI's Responses API, text in and out)"),
        "/v1/models": get("the served models", *((401,) if has_keys else ())),
        "/tokenize": post_tokens(
            [TokenizeCompletionRequest, TokenizeChatRequest], "a prompt's or chat's token ids (vLLM's shape)", 400, 404, 413, 422, 503,
        ),
        "/detokenize": post_tokens([DetokenizeRequest], "token ids' text (vLLM's shape)", 400, 404, 413, 422),
        "/health": get("whether every pool has a live replica", 503),
    }
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "kvrelay", "version": "1", "description": f"OpenAI-compatible API serving {model_name}"},
        "paths": paths,
        "components": {"schemas": components},
    }
    if has_keys:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        document["security"] = [{"bearer": []}]
    return document
