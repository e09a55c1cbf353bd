"""Hugging Face libraries kept off the network: kvrelay reads models from local files only, and a
load never waits on (or depends on) a hub."""

from __future__ import annotations

import contextlib
import logging
import os

__all__ = ["environment", "offline"]

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def environment(variables: dict[str, str]):
    """`variables` set in this process's environment for the block, then as they were."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def offline():
    """Hugging Face libraries kept off the network for the block: nothing downloads at run time."""
    return environment({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
