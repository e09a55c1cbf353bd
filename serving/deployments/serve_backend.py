"""ServeBackend: the ingress's path to the worker pools, through Serve deployment handles.

    disaggregated:  prefill.prefill(req) ──first token, KVHandle──▶ decode.generate(req, kv, prior=[first])
                    placed on a decode replica ──▶ yield the first token (the client sees it now)
                                               ──▶ the decode's tokens ──▶ yield ...
    colocated, n > 1, or fewer uncached prompt tokens than min_remote_prefill_tokens (auto:
    where the decode replica's sequences would wait less for the prefill than a KV hand-off
    takes, router/disaggregation.py):
                    decode.generate(req)  (the pool's engine prefills and decodes)

A prompt's uncached tokens are those the decode pool would compute: its length less the prefix
every decode replica holds, per the decode router's prefix index (router/index.py; a turn of a
conversation finds the turns before it there). Every replica, because the decode policies place
by load, not by prefix. Before the router has seen the pool's stats nothing counts as cached.

Failures, each with one outcome (what a handle call's errors mean: handle_calls.py):
- a pool's queues are full (Serve's BackPressureError)        → QueueFullError (429). The
  prefill's first token is held until Serve has placed the decode call on a replica, so a full
  decode pool refuses a disaggregated stream before its first byte: the same 429 as colocated,
  not a 200 and an SSE error event
- a pool has no running replica (controller status)           → NoWorkerError (503)
- the controller's status cannot be read (a read fails, or takes longer than status_timeout_s)
                                                              → requests go on with the last view
  (a slow controller must not fail them); /health says unknown (HealthUnknownError, 503), never ok
- the decode replica dies mid-stream (n = 1)                  → resumed once on a replica from the
  tokens streamed so far (its prompt is recomputed); if that fails too, the error is raised and
  the client gets an SSE error event
- the prefill replica dies before the first token            → the decode pool computes the prompt
  (both counted by `on_recovery`: kvrelay_recoveries_total)
- the client goes away                                        → the open handle call is
  cancelled (the replica's engine aborts and frees blocks) and unclaimed KV is released

Each request's path (serving/observability/request_path.py) learns here when the output of the
engine that computed its prompt came back, with what that worker saw as it arrived, and, when
disaggregated, when its decode call was placed and when the decode engine started: the ingress's
prefix check and TTFT split.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import ray
from ray.serve.exceptions import BackPressureError

from router.disaggregation import PrefillPlace, choose_prefill_place
from router.replica_stats import RoutingStats
from serving.api.backend import GenerateRequest
from serving.api.errors import HealthUnknownError, NoWorkerError, QueueFullError
from serving.config import ServeConfig
from serving.deployments import faults
from serving.deployments.caller_watch import this_actor
from serving.deployments.handle_calls import await_call, cancel, placed, replica_lost, routed
from serving.deployments.kv_handoff import KVHandoff
from serving.deployments.messages import KVHandle, PrefillResult, WorkerError, WorkerOutput, WorkerRequest
from serving.engine.outputs import RequestOutput
from serving.engine.validation import ModelInfo
from serving.observability.export import serve_pool_status
from serving.observability.metrics import live_routers
from serving.observability.request_path import PATHS, RequestPath

__all__ = ["ServeBackend"]

logger = logging.getLogger(__name__)


def _serve_status(app_name: str) -> dict[str, dict[str, int]]:
    """This app's deployment name → replica states, from the Serve controller (blocking; call in a
    thread). Only this app's: every kvrelay app has a DecodeWorker (or Worker), and a fallback
    app's (serving/api/admission/degradation.py) must not stand for ours. Read from the controller's details
    as they come (`serve_pool_status`), not through `serve.status()`, which counts the same replicas
    after validating the details into pydantic models: 12.8 ms of the ingress's CPU a call against
    1.4 (and 4.0 ms of the controller's against 2.8), once a second while requests flow."""
    return {name: states for name, (states, _) in serve_pool_status(app_name).items()}


LOCAL_SENT_HORIZON_S = 30.0  # far longer than the stats period: older sends show in the stats

class ServeBackend:
    def __init__(
        self,
        config: ServeConfig,
        *,
        prefill=None,
        decode,
        status_fn: Callable[[], dict[str, dict[str, int]]] | None = None,
        status_ttl_s: float = 1.0,
        status_timeout_s: float = 5.0,
        on_recovery: Callable[[str], None] | None = None,
        cached_tokens_fn: Callable[[WorkerRequest], int] | None = None,
        pool_stats_fn: Callable[[], tuple[list[RoutingStats], list[RoutingStats]]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.prefill = prefill  # None in colocated mode
        self.decode = decode
        self._pools = {"prefill": prefill, "decode": decode} if prefill is not None else {"worker": decode}
        self._status_fn = status_fn or functools.partial(_serve_status, config.app_name)
        # prompt tokens a decode replica already holds (its router's prefix index)
        self._cached_tokens = cached_tokens_fn or self._decode_cached_tokens
        # the newest routing stats of the decode and prefill pools (their routers), for auto
        self._pool_stats = pool_stats_fn or self._routers_pool_stats
        # when prompts were sent to prefill on the decode pool (wall clock; auto counts those newer
        # than a replica's stats on it), the last LOCAL_SENT_HORIZON_S of them
        self._local_sent_at: collections.deque[float] = collections.deque()
        self._status_ttl_s = status_ttl_s
        self._status_timeout_s = status_timeout_s
        self._status: dict[str, dict[str, int]] | None = None
        self._status_time = 0.0
        self._status_error: str | None = None  # why the latest read of the controller failed; None: it was read
        self._status_read: asyncio.Future | None = None  # the read in flight (its thread), one at a time
        self._status_lock = asyncio.Lock()
        self._refresh_task: asyncio.Task | None = None
        self.on_recovery = on_recovery  # (kind) for each request that survived a replica's death
        self.kv = KVHandoff(config.app_name, config.kv_transfer)
        self._caller = this_actor()  # named in each request: workers abort it if we die
        self._releases: set[asyncio.Task] = set()  # background lookups of abandoned prefills
        self._kv_nodes: set[str] = set()  # nodes whose KVTransfer actor has held our requests' KV
        # When outputs come back and decode calls are placed, for the requests' paths
        # (serving/observability/request_path.py): the ingress's metrics clock.
        self._clock = clock

    # ---- Backend protocol --------------------------------------------------------------------
    async def model_info(self) -> ModelInfo:
        for pool, handle in self._pools.items():  # a handle call waits for a replica that may never come
            await self._check_alive(pool, handle)
        infos = [await await_call(handle.model_info.remote(), pool) for pool, handle in self._pools.items()]
        limit = min(info.max_model_len for info in infos)
        return replace(infos[0], max_model_len=limit)

    async def check_adapter(self, name: str, path: str) -> None:
        """Whether the PEFT adapter at `path` loads in each pool (one replica of each reads and
        checks it; every replica registers it from the first request that names it)."""
        for pool, handle in self._pools.items():
            await self._check_alive(pool, handle)
            error = await await_call(handle.check_adapter.remote(name, path), pool)
            if isinstance(error, WorkerError):
                raise error.to_exception()

    async def health(self) -> dict[str, Any]:
        """Per pool, its replica states, from the controller's view. Raises HealthUnknownError when
        the latest read of it failed or did not finish in status_timeout_s, NoWorkerError when a
        pool has no running replica or the controller lists none of its deployment."""
        status = await self._replica_states()
        if self._status_error is not None:
            raise HealthUnknownError(f"the Serve controller's replica states could not be read ({self._status_error})")
        pools = {}
        for pool, handle in self._pools.items():
            states = status.get(handle.deployment_name)
            if states is None:
                raise NoWorkerError(pool, f"the Serve controller lists no {handle.deployment_name} deployment")
            pools[pool] = _running(pool, states)
        return pools

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        request = WorkerRequest.sent_by(request, self._caller)
        num_tokens = 0
        async for out in self._generate(request):
            yield out
            num_tokens += sum(len(c.token_ids) for c in out.outputs)
            faults.reached("ingress.after_tokens", num_tokens)

    async def _generate(self, request: WorkerRequest) -> AsyncIterator[RequestOutput]:
        path = PATHS.find(request.request_id)  # None: nobody follows this request's path
        local = self.prefill is None or request.params.n > 1 or self._prefills_locally(request)
        if local:
            if self.prefill is not None:
                self._local_sent_at.append(time.time())
            async for out in self._decode(request, None, [], path=path):
                yield out
            return

        await self._check_alive("prefill", self.prefill)
        response = self.prefill.prefill.remote(routed(request))
        try:
            result = await await_call(response, "prefill", on_cancel=lambda r: self._abandon_prefill(r, request.request_id))
        except NoWorkerError as exc:
            if not replica_lost(exc.__cause__):
                raise
            # The replica died with the request, before its first token: the decode pool
            # computes the prompt (its engine prefills as in colocated mode).
            logger.warning("prefill replica died before the first token of %s (%s); prefilling on the decode pool",
                           request.request_id, type(exc.__cause__).__name__)
            self._recovered("prefill_on_decode")
            async for out in self._decode(request, None, [], path=path):
                yield out
            return
        if isinstance(result, WorkerError):
            raise result.to_exception()
        if path is not None:
            path.computed("prefill", result.output, result.admission, self._clock())
        kv = result.kv
        if kv is not None:
            self._kv_nodes.add(kv.node_id)
        claimed = False
        try:
            first = result.output
            if first.finished:
                yield first
                return
            # The first token leaves once the decode call is placed, before the KV moves.
            async for out in self._decode(request, kv, list(first.outputs[0].token_ids), first=first, path=path):
                claimed = out is not first
                yield out
            claimed = True
        finally:
            if kv is not None and not claimed:
                # Aborted before the decode worker took it: do not hold it until the lease ends.
                # In the background: this may run in a cancelled stream's cleanup, and must never
                # fail it (the request's billing and metrics come after).
                self.kv.release_soon(kv)

    # ---- internals ---------------------------------------------------------------------------
    def _prefills_locally(self, request: WorkerRequest) -> bool:
        """Disaggregated mode: whether the decode pool prefills this prompt itself."""
        threshold = self.config.min_remote_prefill_tokens
        if threshold == "auto":
            decode, prefill = self._pool_stats()
            sent, horizon = self._local_sent_at, time.time() - LOCAL_SENT_HORIZON_S
            while sent and sent[0] < horizon:
                sent.popleft()
            choice = choose_prefill_place(self._uncached_tokens(request), decode, prefill, local_sent_at=sent)
            return choice.place is PrefillPlace.LOCAL
        return self._uncached_tokens_below_threshold(request)

    def _uncached_tokens(self, request: WorkerRequest) -> int:
        prompt_len = len(request.prompt_token_ids)
        return prompt_len - min(self._cached_tokens(request), prompt_len - 1)  # the last token is always computed

    def _uncached_tokens_below_threshold(self, request: WorkerRequest) -> bool:
        threshold = self.config.min_remote_prefill_tokens
        if threshold <= 0:
            return False
        if len(request.prompt_token_ids) < threshold:
            return True
        return self._uncached_tokens(request) < threshold

    def _routers_pool_stats(self) -> tuple[list[RoutingStats], list[RoutingStats]]:
        """The newest routing stats of the decode and prefill pools, from this process's routers
        of this app (router/request_router.py); empty before they exist."""
        by_name: dict[str, list[RoutingStats]] = {}
        for router in live_routers():
            if router.app_name == self.config.app_name:
                by_name[router.deployment_name] = router.replica_stats()
        return by_name.get(self.decode.deployment_name, []), by_name.get(self.prefill.deployment_name, [])

    def _decode_cached_tokens(self, request: WorkerRequest) -> int:
        """The prefix of the prompt every decode replica holds, from the decode router of this
        app in this process (router/request_router.py); 0 before it exists."""
        name = self.decode.deployment_name
        for router in live_routers():
            if router.deployment_name == name and router.app_name == self.config.app_name:
                return router.state.cached_prefix_everywhere(request.block_hashes) * request.block_size
        return 0

    def _recovered(self, kind: str) -> None:
        if self.on_recovery is not None:
            self.on_recovery(kind)

    async def _decode(
        self, request: WorkerRequest, kv: KVHandle | None, prior: list[int], first: RequestOutput | None = None,
        path: RequestPath | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The decode pool's outputs; `first` (the prefill's first token) is yielded ahead of them
        as soon as Serve has placed the call on a replica (a full pool refuses it before then).
        `path`: the request's, which learns of the placement and of the worker's first output."""
        pool = "decode" if self.prefill is not None else "worker"
        await self._check_alive(pool, self.decode)
        generated: list[int] = []
        attempts = 2 if request.params.n == 1 else 1
        for attempt in range(attempts):
            stream = self.decode.options(stream=True).generate.remote(routed(request), kv, prior + generated)
            is_open = True  # the handle call has not ended on its own: cancel it when we leave
            try:
                if first is not None:
                    await placed(stream)
                    if path is not None:
                        path.placed(self._clock())
                    yield first
                    first = None
                async for item in stream:
                    if isinstance(item, WorkerError):
                        raise item.to_exception()
                    if path is not None and isinstance(item, WorkerOutput):
                        self._first_output(path, pool, item)
                    if request.params.n == 1:
                        generated += item.outputs[0].token_ids if item.outputs else []
                    yield item
                is_open = False
                return
            except BackPressureError as exc:
                is_open = False
                raise QueueFullError(pool) from exc
            except Exception as exc:
                if not replica_lost(exc):
                    raise
                is_open = False
                if attempt + 1 == attempts:
                    raise NoWorkerError(pool, f"the replica serving this request died ({type(exc).__name__})") from exc
                logger.warning("%s replica died mid-stream for %s; resuming from %d tokens", pool, request.request_id, len(prior) + len(generated))
                self._recovered("decode_resumed")
                if kv is not None:
                    # The dead replica may have died before claiming it: released, it does not
                    # wait out its lease (a release of a claimed KV only leaves a tombstone).
                    self.kv.release_soon(kv)
                kv = None  # recompute from the tokens
            finally:
                if is_open:
                    cancel(stream)

    def _first_output(self, path: RequestPath, pool: str, output: WorkerOutput) -> None:
        """A decode or colocated worker's first output: after a KV import it starts the second
        token's path; otherwise this pool's engine computed the prompt (only the first counts)."""
        if output.admission is not None and output.admission.imported:
            path.decode_started(output, output.admission)
        else:
            path.computed(pool, output, output.admission, self._clock())

    def _abandon_prefill(self, response, request_id: str) -> None:
        """The client left while its prefill ran. Cancelling aborts it if it still runs (the
        worker then frees its KV). If it had finished, its KV is on offer, and only its result
        says where; a cancelled response may not give the result back. So, in the background:
        release it where the result says, or else under its id at every node's actor this
        ingress has seen KV on (a release that comes first drops the offer when it comes)."""
        cancel(response)

        async def release_if_finished() -> None:
            try:
                result = await response
            except Exception:  # noqa: BLE001 - cancelled: in time, or with its result lost
                result = None
            if isinstance(result, PrefillResult) and result.kv is not None:
                await self.kv.release(result.kv.node_id, result.kv.request_id)
                return
            nodes = self._kv_nodes or ({ray.get_runtime_context().get_node_id()} if ray.is_initialized() else set())
            # At every node at once: a release at a restarting actor is made again for seconds
            # (kv_handoff.py), and must not hold up the one at the node that holds the KV.
            await asyncio.gather(*(self.kv.release(node_id, request_id) for node_id in nodes))

        # Outside the cancelled request's context, as KVHandoff's releases (kv_handoff.py).
        task = asyncio.get_running_loop().create_task(release_if_finished(), context=contextvars.Context())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _check_alive(self, pool: str, handle) -> dict[str, int]:
        status = await self._replica_states()
        states = status.get(handle.deployment_name)
        if states is None:
            return {}  # unknown to the controller (e.g. tests with stub handles): do not block
        return _running(pool, states)

    async def _replica_states(self) -> dict[str, dict[str, int]]:
        """The controller's view, refreshed in the background once older than the TTL: a request
        waits for the controller (~17 ms) only when there is no view yet."""
        if self._status is None:
            async with self._status_lock:
                if self._status is None:
                    await self._refresh_status()
        elif time.monotonic() - self._status_time >= self._status_ttl_s and (
            self._refresh_task is None or self._refresh_task.done()
        ):
            self._refresh_task = asyncio.create_task(self._refresh_status())
        return self._status

    async def _refresh_status(self) -> None:
        """Read the controller's view, waiting at most status_timeout_s. A read that times out
        keeps its thread until the controller answers, and no second read starts beside it (each
        would hold a thread of the loop's default executor)."""
        if self._status_read is None or self._status_read.done():
            self._status_read = asyncio.ensure_future(asyncio.to_thread(self._status_fn))
        try:
            self._status = await asyncio.wait_for(asyncio.shield(self._status_read), self._status_timeout_s)
            self._status_error = None
        except Exception as exc:  # noqa: BLE001 - the controller being slow must not fail requests
            timed_out = isinstance(exc, TimeoutError)
            logger.warning("could not read Serve status (%s); assuming pools are up",
                           f"no answer in {self._status_timeout_s:g} s" if timed_out else repr(exc))
            self._status = self._status or {}
            self._status_error = f"no answer in {self._status_timeout_s:g} s" if timed_out else "the read failed"
        self._status_time = time.monotonic()


def _running(pool: str, states: dict[str, int]) -> dict[str, int]:
    """A pool's replica states, if one of them is running; else NoWorkerError naming them."""
    if states.get("RUNNING", 0) == 0:
        detail = ", ".join(f"{n} {s.lower()}" for s, n in sorted(states.items())) or "no replicas"
        raise NoWorkerError(pool, detail)
    return states

