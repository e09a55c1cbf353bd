"""The autoscaling policy's two error types, shared by the reactive schema (policy.py) and the
planner's (planner_policy.py): `PolicyError`, what a caller sees (a ConfigError, as every config
file's), and `FieldError`, a cross-field check that failed on one field, which the one config-error
formatter (serving/engine/config_file.py) reports under that field's path.

The shared types live in serving/engine/config_file.py, which is pydantic only: this package stays
free of torch (serving.config pulls in the engine), because the Serve controller and `kvrelay policy`
import it.
"""

from __future__ import annotations

from serving.engine.config_file import ConfigError, FieldError

__all__ = ["PolicyError", "FieldError"]


class PolicyError(ConfigError):
    """A policy file is invalid; the message names the file, field, value and allowed values."""
