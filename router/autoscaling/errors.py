"""The autoscaling policy's two error types, shared by the reactive schema (policy.py) and the
planner's (planner_policy.py): `PolicyError`, what a caller sees, and `FieldError`, a cross-field
check that failed on one field, which `policy.format_policy_error` reports under that field's path.

Not serving.config.ConfigError: this package stays free of torch (serving.config pulls in the
engine), because it is imported by the Serve controller and by `kvrelay policy`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PolicyError", "FieldError"]


class PolicyError(ValueError):
    """A policy file is invalid; the message names the file, field, value and allowed values."""


class FieldError(ValueError):
    """A cross-field check that failed on one field: reported under that field's path."""

    def __init__(self, field: str, value: Any, message: str):
        super().__init__(f"{field} = {value!r}: {message}")
        self.field, self.value, self.message = field, value, message
