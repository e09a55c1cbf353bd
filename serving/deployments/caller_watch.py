"""CallerWatch: a worker aborts the requests of an ingress replica that died.

Ray does not cancel an actor call when its caller's process dies: a decode call streams on,
into nothing, until `max_tokens`, holding its blocks. So each WorkerRequest names the ingress
replica that sent it (its Ray actor name and namespace, `Caller`), and while a worker has requests
in flight it checks those callers every `period_s`: a caller whose named actor is gone (a dead
actor's name is released) has its requests aborted, which frees their blocks.

    ingress replica ──WorkerRequest(caller=("SERVE_REPLICA::app#OpenAIIngress#x", "serve"))──▶ worker
    (resolved once at the ingress's start: the name must find the ingress itself)
                                                                      │ watch(caller, request id)
                                          every period_s: ray.get_actor(name) ──ValueError──▶ abort

One lookup per distinct caller per period (a GCS round trip, in a thread), not per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator

import ray

from serving.deployments.messages import Caller

__all__ = ["CallerWatch", "this_actor"]

_SERVE_NAMESPACE = "serve"  # where Serve names its replica actors (ray.serve._private.constants)

logger = logging.getLogger(__name__)


def this_actor() -> Caller | None:
    """The calling process's named actor (a Serve replica), or None outside a named actor."""
    if not ray.is_initialized():  # not in a Ray worker (tests with stub handles): never start one
        return None
    context = ray.get_runtime_context()
    name = context.get_actor_name()
    if not name:
        return None
    # A Serve replica is named in Serve's namespace, not in the job's (which is what the runtime
    # context reports): find the namespace that resolves the name to this very actor, so a
    # caller is never taken for dead while it lives. None (no watch) if neither does.
    for namespace in (_SERVE_NAMESPACE, context.namespace):
        try:
            actor = ray.get_actor(name, namespace=namespace)
        except ValueError:
            continue
        if actor._actor_id.hex() == context.get_actor_id():
            return Caller(name, namespace)
    logger.warning("cannot resolve this actor's name %r: workers will not watch it", name)
    return None


def is_alive(caller: Caller) -> bool:
    """Whether the caller's actor is still alive (blocking: a GCS lookup)."""
    try:
        ray.get_actor(caller.actor_name, namespace=caller.namespace)
    except ValueError:  # no live actor holds the name
        return False
    return True


class CallerWatch:
    def __init__(
        self, abort: Callable[[str], Awaitable[object]], *, period_s: float = 1.0,
        is_alive: Callable[[Caller], bool] = is_alive,
    ):
        self._abort = abort
        self._period_s = period_s
        self._is_alive = is_alive
        self._requests: dict[Caller, set[str]] = {}
        self._task: asyncio.Task | None = None
        self.num_aborted = 0  # requests aborted because their caller died

    @contextlib.contextmanager
    def watch(self, caller: Caller | None, request_id: str) -> Iterator[None]:
        """Abort `request_id` if `caller` dies while the block runs."""
        if caller is None:
            yield
            return
        self._requests.setdefault(caller, set()).add(request_id)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        try:
            yield
        finally:
            ids = self._requests.get(caller)
            if ids is not None:
                ids.discard(request_id)
                if not ids:
                    del self._requests[caller]

    async def _run(self) -> None:
        while self._requests:
            await asyncio.sleep(self._period_s)
            for caller in list(self._requests):
                try:
                    alive = await asyncio.to_thread(self._is_alive, caller)
                except Exception as exc:  # noqa: BLE001 - the GCS is slow or away: assume alive
                    logger.warning("could not check caller %s (%s)", caller.actor_name, exc)
                    continue
                if alive:
                    continue
                ids = self._requests.pop(caller, set())
                logger.warning("caller %s died: aborting its %d request(s)", caller.actor_name, len(ids))
                for request_id in ids:
                    self.num_aborted += 1
                    await self._abort(request_id)
