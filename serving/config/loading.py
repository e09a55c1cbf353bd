"""Loading the app's config: a YAML file < overrides (`--set`, dotted keys) < `KVRELAY_*` env vars,
and errors that name the source, the field, the value and the fix. The file is read and its errors
formatted by the one loader of every file kvrelay reads (serving/engine/config_file.py, re-exported
here: ConfigError, format_validation_error)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from serving.config.serve_config import ENV_PREFIX, ServeConfig
from serving.engine.config_file import ConfigError, format_validation_error, read_yaml_mapping, validate_model

__all__ = ["ConfigError", "NON_CONFIG_ENV", "load_config", "format_validation_error", "parse_set_items", "apply_overrides"]

# KVRELAY_* variables that are not config fields.
NON_CONFIG_ENV = {"KVRELAY_CACHE_DIR", "KVRELAY_DISABLE_NATIVE", "KVRELAY_CONFIG", "KVRELAY_DEV_CLUSTER", "KVRELAY_FAULTS"}


def load_config(
    path: str | os.PathLike | None = None,
    *,
    overrides: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> ServeConfig:
    """File (optional) < `overrides` (nested dict) < `KVRELAY_*` environment variables."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        data = read_yaml_mapping(path, what="config file", shape="of fields", allow_empty=True)
        for key in ("autoscaling_policy", "pricing"):
            value = data.get(key)
            if isinstance(value, str) and value and not Path(value).is_absolute():
                # Relative to the config file, so a config and the files it names move together.
                data[key] = str(Path(path).parent / value)
    apply_overrides(data, overrides or {})
    env_used = []
    for name, raw in sorted((os.environ if env is None else env).items()):
        if not name.startswith(ENV_PREFIX) or name in NON_CONFIG_ENV:
            continue
        field_path = [part.lower() for part in name[len(ENV_PREFIX):].split("__")]
        _set_path(data, field_path, _parse_env_value(field_path, raw))
        env_used.append(name)
    extras = ([f"overrides {', '.join(sorted(overrides))}"] if overrides else []) + (
        [f"env {', '.join(env_used)}"] if env_used else []
    )
    where = source + (f" (with {'; '.join(extras)})" if extras else "")
    return validate_model(ServeConfig, data, where, env_prefix=ENV_PREFIX)


def parse_set_items(items: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` items -> {dotted key: YAML-parsed value}; ConfigError names a bad item."""
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set wants KEY=VALUE, got {item!r}")
        overrides[key] = yaml.safe_load(value) if value.strip() else value
    return overrides


def apply_overrides(data: dict, overrides: dict[str, Any]) -> dict:
    """Set each dotted key of `overrides` in the nested `data` (in place); returns `data`."""
    for key, value in overrides.items():
        _set_path(data, key.split("."), value)
    return data


def _set_path(data: dict, parts: list[str], value: Any) -> None:
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def _parse_env_value(field_path: list[str], raw: str) -> Any:
    if field_path in (["api_keys"], ["admin_api_keys"]) and not raw.lstrip().startswith("["):
        return [key.strip() for key in raw.split(",") if key.strip()]
    try:
        return yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        return raw
