"""ServeBackend's pool checks, without Ray: a pool with no running replica answers 503 at once."""

from __future__ import annotations

import asyncio

import pytest

from serving.config import ServeConfig
from serving.engine.params import SamplingParams
from serving.errors import NoWorkerError, to_api_error
from serving.frontend import WorkerRequest
from serving.serve_backend import ServeBackend


class StubHandle:
    def __init__(self, deployment_name: str):
        self.deployment_name = deployment_name


def backend(states: dict, *, colocated: bool = False) -> tuple[ServeBackend, list]:
    calls = []

    def status_fn():
        calls.append(1)
        return states

    if colocated:
        b = ServeBackend(ServeConfig(mode="colocated"), decode=StubHandle("Worker"), status_fn=status_fn)
    else:
        b = ServeBackend(ServeConfig(), prefill=StubHandle("PrefillWorker"), decode=StubHandle("DecodeWorker"), status_fn=status_fn)
    return b, calls


async def first(iterator):
    async for item in iterator:
        return item


def test_health_reports_replica_states():
    b, _ = backend({"PrefillWorker": {"RUNNING": 2}, "DecodeWorker": {"RUNNING": 1, "STARTING": 1}})
    assert asyncio.run(b.health()) == {"prefill": {"RUNNING": 2}, "decode": {"RUNNING": 1, "STARTING": 1}}


def test_no_running_decode_replica_is_503_naming_the_pool():
    b, _ = backend({"PrefillWorker": {"RUNNING": 1}, "DecodeWorker": {"STARTING": 1, "UNHEALTHY": 1}})
    with pytest.raises(NoWorkerError) as info:
        asyncio.run(b.health())
    error = to_api_error(info.value)
    assert error.status == 503 and error.code == "no_worker"
    assert error.message == (
        "No decode replica is alive to serve this request: 1 starting, 1 unhealthy; "
        "retry once the pool has recovered."
    )


def test_generate_fails_fast_when_the_prefill_pool_is_down():
    b, _ = backend({"PrefillWorker": {}, "DecodeWorker": {"RUNNING": 1}})
    request = WorkerRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(NoWorkerError, match="No prefill replica is alive to serve this request: no replicas;"):
        asyncio.run(first(b.generate(request)))


def test_colocated_pool_is_called_worker():
    b, _ = backend({"Worker": {}}, colocated=True)
    with pytest.raises(NoWorkerError, match="No worker replica"):
        asyncio.run(b.health())


def test_status_is_cached_between_requests():
    b, calls = backend({"PrefillWorker": {"RUNNING": 1}, "DecodeWorker": {"RUNNING": 1}})

    async def twice():
        await b.health()
        await b.health()

    asyncio.run(twice())
    assert len(calls) == 1


def test_unreadable_status_does_not_fail_requests():
    def broken():
        raise ConnectionError("controller unreachable")

    b = ServeBackend(ServeConfig(), prefill=StubHandle("PrefillWorker"), decode=StubHandle("DecodeWorker"), status_fn=broken)
    assert asyncio.run(b.health()) == {"prefill": {}, "decode": {}}
