"""The `kvrelay` command."""

from serving.cli.dispatch import main

__all__ = ["main"]
