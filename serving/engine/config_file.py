"""The one loader and the one error formatter of every YAML file kvrelay reads: the serve config
(serving/config/loading.py), the autoscaling policy (router/autoscaling/policy.py) and the pricing
file (serving/api/usage.py). Beside StrictModel, in the lowest layer and pydantic only, so the
router and the CLI read files without torch.

    path ──read_yaml_mapping──▶ dict ──validate_model(Model)──▶ Model
          ConfigError:            ConfigError: format_validation_error, one line per problem:
          "<path>: cannot read     "<path>: invalid configuration"
           the pricing file"       "  models.tiny.currency = 'usd': String should match ..."

Every message names the file, the field, the bad value and the fix. A file's own checks across
fields raise FieldError from a validator, which the formatter reports under that field's path;
given the model, the formatter also says what a field allows (its bounds, or the keys a section has).
"""

from __future__ import annotations

import os
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import annotated_types
import yaml
from pydantic import BaseModel, ValidationError

__all__ = ["ConfigError", "FieldError", "read_yaml_mapping", "validate_model", "format_validation_error"]

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the source, field, value and fix."""


class FieldError(ValueError):
    """A cross-field check that failed on one field: reported under that field's path."""

    def __init__(self, field: str, value: Any, message: str):
        super().__init__(f"{field} = {value!r}: {message}")
        self.field, self.value, self.message = field, value, message


def read_yaml_mapping(
    path: str | os.PathLike, *, what: str, shape: str, allow_empty: bool = False,
    error: type[ConfigError] = ConfigError,
) -> dict[str, Any]:
    """The YAML mapping at the top of `path` (`what` names the file in errors, e.g. "pricing file";
    `shape` says what the mapping holds, e.g. "with `models:`"). An empty file is {} if `allow_empty`."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise error(f"{path}: cannot read the {what} ({exc.strerror})") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise error(f"{path}: not valid YAML: {exc}") from exc
    if data is None and allow_empty:
        return {}
    if not isinstance(data, dict):
        kind = "empty" if data is None else type(data).__name__
        raise error(f"{path}: the top level must be a mapping {shape}, got {kind}")
    return data


def validate_model(
    model: type[M], data: Any, where: str, *, title: str = "invalid configuration",
    error: type[ConfigError] = ConfigError, env_prefix: str | None = None, explain: bool = False,
) -> M:
    """`model.model_validate(data)`; a failure is `error` with format_validation_error's message."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise error(format_validation_error(
            exc, where, title=title, env_prefix=env_prefix, model=model if explain else None,
        )) from exc


def format_validation_error(
    exc: ValidationError, where: str, *, title: str = "invalid configuration",
    env_prefix: str | None = None, model: type[BaseModel] | None = None,
) -> str:
    """`<where>: <title>`, then `  field = value: what is wrong` per error. `env_prefix`: an unknown
    key also names its environment variable; `model`: each line says what the field allows."""
    lines = [f"{where}: {title}"]
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        field = ".".join(loc) or "(top level)"
        value = err.get("input")
        shown = "" if isinstance(value, dict) or err["type"] == "missing" else f" = {value!r}"
        cause = err.get("ctx", {}).get("error")
        if err["type"] == "extra_forbidden":
            hint = "unknown key; remove it or fix its spelling"
            if env_prefix:
                hint += f" (env: {env_prefix}{field.upper().replace('.', '__')})"
            keys = _field_names(model, loc[:-1]) if model is not None else []
            if keys:
                hint += f" (allowed keys: {', '.join(keys)})"
        elif err["type"] == "value_error" and isinstance(cause, FieldError):
            field = ".".join((*loc, cause.field))
            shown, hint = ("" if cause.value is None else f" = {cause.value!r}"), cause.message
        elif err["type"] == "value_error":
            hint = str(cause) if cause is not None else err["msg"].removeprefix("Value error, ")
        else:
            hint = err["msg"]
            allowed = _allowed(model, loc) if model is not None else ""
            if allowed:
                hint += f" (allowed: {allowed})"
        lines.append(f"  {field}{shown}: {hint}")
    return "\n".join(lines)


def _resolve(model: type[BaseModel] | None, loc: tuple[str, ...]):
    """The model class at `loc` and the FieldInfo of its last part (None where loc leaves models)."""
    info = None
    for part in loc:
        if model is None or part not in model.model_fields:
            return None, None
        info = model.model_fields[part]
        model = _model_in(info.annotation)
    return model, info


def _model_in(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def _field_names(model: type[BaseModel], loc: tuple[str, ...]) -> list[str]:
    inner, _ = _resolve(model, loc) if loc else (model, None)
    return list(inner.model_fields) if inner is not None else []


def _allowed(model: type[BaseModel], loc: tuple[str, ...]) -> str:
    # Pydantic appends the failing type to loc for unions ("prefill.targets.ttft_p95_ms.float").
    for end in range(len(loc), 0, -1):
        _, info = _resolve(model, loc[:end])
        if info is not None:
            break
    else:
        return ""
    bounds = []
    for meta in info.metadata:
        for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            value = getattr(meta, attr, None)
            if isinstance(meta, annotated_types.BaseMetadata) and value is not None:
                bounds.append(f"{op} {value}")
    if not bounds:
        return ""
    nullable = type(None) in typing.get_args(info.annotation)
    return " and ".join(bounds) + (", or null" if nullable else "")
