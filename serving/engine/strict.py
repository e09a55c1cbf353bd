"""StrictModel, the base of every config model of the project (the engine's, the app's, the
autoscaling policy's, the pricing file's). Pydantic only: the router and the CLI load configs
without torch."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["StrictModel"]


class StrictModel(BaseModel):
    """Unknown keys are errors (they name the key), and a loaded config never changes."""

    model_config = ConfigDict(extra="forbid", frozen=True)
