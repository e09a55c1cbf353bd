"""Structured outputs on the wire: the request fields that ask for one, and their translation to
the engine's GuidedSpec (serving/engine/params.py).

    field (either endpoint)                              GuidedSpec           compile errors name
    response_format {"type": "text"}                     none
    response_format {"type": "json_object"}              json_object          response_format
    response_format {"type": "json_schema",
                     "json_schema": {"name", "schema",
                                     "strict", ...}}     json_schema          response_format.json_schema.schema
    structured_outputs {"json": schema}   (vLLM)         json_schema          structured_outputs.json
    structured_outputs {"regex" | "choice" | "grammar"}  regex / choice / grammar   structured_outputs.<key>
    structured_outputs {"json_object": true}             json_object          structured_outputs.json_object
    guided_json, guided_regex, guided_choice,
    guided_grammar   (vLLM's older fields)               as their names say   the field

At most one may be set: two (say `response_format` and `guided_json`, or two keys of
`structured_outputs`) are a 400 naming the second. `strict` is accepted either way and the schema
is always enforced. A schema may be sent as an object or as JSON text (vLLM's `guided_json`).

Validated once, here and in the ingress's `Frontend.check_guided`, which compiles the grammar
(serving/engine/sampling/grammar.py) before anything is generated: a schema, regex or grammar that does
not compile is a 400 naming the field above. The compiled grammar stays in the process's cache
(an in-process engine uses it as it is; a worker compiles each spec once).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from serving.engine.errors import InvalidRequestError
from serving.engine.params import GuidedSpec

__all__ = ["AsksStructured", "JSONSchemaFormat", "ResponseFormat", "StructuredOutputs", "guided_param", "guided_spec"]


class _Lenient(BaseModel):
    # Unknown keys accepted and ignored, as the top-level request's (serving/api/protocol/wire.py).
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class JSONSchemaFormat(_Lenient):
    name: str | None = None
    description: str | None = None
    schema_: Any = Field(None, alias="schema")  # an object or a boolean: checked by guided_spec, naming the field
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(_Lenient):
    """vLLM's `structured_outputs` (its StructuredOutputsParams): one of these keys."""

    json_: Any = Field(None, alias="json")  # a schema, or its JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class AsksStructured(Protocol):
    """The fields a request asks for a structured output with: those of both endpoints' wire models
    (serving/api/protocol/wire.py), which this module reads and does not import."""

    response_format: ResponseFormat | None
    structured_outputs: StructuredOutputs | None
    guided_json: Any
    guided_regex: str | None
    guided_choice: list[str] | None
    guided_grammar: str | None


def guided_spec(request: AsksStructured) -> GuidedSpec | None:
    """The request's structured output, or None; InvalidRequestError naming the field."""
    asked = _asked(request)
    if not asked:
        return None
    if len(asked) > 1:
        first, second = asked[0][0], asked[1][0]
        raise InvalidRequestError(second, f"only one structured output may be set, got {first} and {second}; keep one")
    param, build = asked[0]
    try:
        return build()
    except InvalidRequestError as exc:  # GuidedSpec's own checks say "guided"
        raise InvalidRequestError(param, exc.message) from None


def guided_param(request: AsksStructured) -> str:
    """The field the request's structured output came from (guided_spec found exactly one)."""
    return _asked(request)[0][0]


def _asked(request: AsksStructured) -> list[tuple[str, Callable[[], GuidedSpec]]]:
    """(field, a builder of its GuidedSpec) for each structured output the request sets, in the
    order of the table above."""
    asked: list[tuple[str, Callable[[], GuidedSpec]]] = []
    fmt: ResponseFormat | None = request.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", lambda: GuidedSpec("json_object")))
    elif fmt is not None and fmt.type == "json_schema":
        param = "response_format.json_schema.schema"
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise InvalidRequestError(param, "is required with response_format type json_schema")
        schema = fmt.json_schema.schema_
        asked.append((param, lambda: _schema_spec(schema, text=False)))
    so: StructuredOutputs | None = request.structured_outputs
    vllm: list[tuple[str, str, Any]] = [] if so is None else [
        ("structured_outputs.json", "json", so.json_), ("structured_outputs.regex", "regex", so.regex),
        ("structured_outputs.choice", "choice", so.choice), ("structured_outputs.grammar", "grammar", so.grammar),
        ("structured_outputs.json_object", "json_object", so.json_object or None),
    ]
    vllm += [
        ("guided_json", "json", request.guided_json), ("guided_regex", "regex", request.guided_regex),
        ("guided_choice", "choice", request.guided_choice), ("guided_grammar", "grammar", request.guided_grammar),
    ]
    return asked + [(param, _builder(kind, value)) for param, kind, value in vllm if value is not None]


def _builder(kind: str, value: Any) -> Callable[[], GuidedSpec]:
    """The GuidedSpec of one of vLLM's fields or keys, built when called (so its errors name it)."""
    if kind == "json":
        return lambda: _schema_spec(value)
    if kind == "choice":
        return lambda: GuidedSpec.choice(value)
    if kind == "json_object":
        return lambda: GuidedSpec("json_object")
    return lambda: GuidedSpec(kind, value)


def _schema_spec(schema: Any, *, text: bool = True) -> GuidedSpec:
    """A json_schema spec of a schema sent as an object or a boolean, or (`text`) as JSON text."""
    if text and isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError("guided", f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError("guided", f"a JSON schema is an object or a boolean, got {type(schema).__name__}")
    return GuidedSpec.json_schema(schema)
