"""Fault injection: a replica process dies at a named point, as a crash or an OOM kill ends it.

For tests and chaos runs only. `KVRELAY_FAULTS`, a JSON list, in the environment of the process
that builds the app (`build_app` forwards it to every replica):

    KVRELAY_FAULTS='[{"point": "decode.after_tokens", "count": 2, "once": "/tmp/run1/decode"}]'

    point                         where the process exits
    prefill.before_first_token    a PrefillWorker, once its engine has computed a prompt, before
                                  its first token goes back to the ingress
    decode.after_tokens           a DecodeWorker, once it has streamed `count` tokens of a request
    worker.after_tokens           the same in a colocated Worker
    ingress.after_tokens          the OpenAIIngress, once `count` tokens of a request reached it

`once` names a file created (atomically) the first time the fault fires, in whichever process:
while it exists the fault does not fire again, so a restarted replica or its peers live on.
Without `once` the fault fires every time.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

__all__ = ["ENV", "POINTS", "Fault", "parse", "reached"]

logger = logging.getLogger(__name__)

ENV = "KVRELAY_FAULTS"
POINTS = ("prefill.before_first_token", "decode.after_tokens", "worker.after_tokens", "ingress.after_tokens")


@dataclass(frozen=True)
class Fault:
    point: str
    count: int = 0
    once: str | None = None

    def claim(self) -> bool:
        """True if the fault fires now (and, with `once`, never again)."""
        if self.once is None:
            return True
        try:
            os.close(os.open(self.once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True


def parse(text: str) -> tuple[Fault, ...]:
    if not text.strip():
        return ()
    try:
        items = json.loads(text)
        if not isinstance(items, list):
            raise TypeError("not a list")
        faults = tuple(Fault(**item) for item in items)
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"{ENV}: expected a JSON list like "
            '[{"point": "decode.after_tokens", "count": 2, "once": "/tmp/marker"}]; '
            f"got {text!r} ({exc})"
        ) from None
    for fault in faults:
        if fault.point not in POINTS:
            raise ValueError(f"{ENV}: unknown point {fault.point!r}; one of {', '.join(POINTS)}")
    return faults


_faults: tuple[Fault, ...] | None = None


def reached(point: str, count: int = 0) -> None:
    """Exit the process now if a fault is set at `point` for `count` (tokens so far)."""
    global _faults
    if _faults is None:
        _faults = parse(os.environ.get(ENV, ""))
    for fault in _faults:
        if fault.point == point and count >= fault.count and fault.claim():
            logger.error("fault injection (%s): exiting at %s after %d tokens", ENV, point, count)
            os._exit(70)
