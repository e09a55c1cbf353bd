"""The engine contract (serving/engine/contract.py): both engines implement every member of
EngineClient with its signature, and the worker's EngineRequest is built from a WorkerRequest once.
Reads the classes only: needs no model and no vLLM."""

from __future__ import annotations

import inspect

import pytest

from serving.deployments.messages import WorkerRequest, engine_request
from serving.engine.async_engine import AsyncEngine
from serving.engine.contract import EngineClient, EngineRequest, KVExportTarget
from serving.engine.params import SamplingParams
from serving.engine.vllm.engine import VLLMEngine

MEMBERS = sorted(
    name for name in {*vars(EngineClient), *EngineClient.__annotations__}
    if not name.startswith("_")
)


def test_the_contract_names_what_the_worker_needs():
    assert MEMBERS == [
        "abort", "check_adapter", "export_kv", "generate", "is_alive", "kv_export_target", "kv_payload_bytes",
        "model_info", "release_kv", "release_kv_soon", "shutdown", "stats", "subscribe_kv_events", "tokenizer",
    ]


@pytest.mark.parametrize("engine", [AsyncEngine, VLLMEngine])
@pytest.mark.parametrize("name", [m for m in MEMBERS if callable(getattr(EngineClient, m, None))])
def test_each_engine_implements_each_method_with_its_signature(engine, name):
    ours, theirs = inspect.signature(getattr(EngineClient, name)), inspect.signature(getattr(engine, name))
    assert list(theirs.parameters) == list(ours.parameters)
    assert inspect.iscoroutinefunction(getattr(engine, name)) == inspect.iscoroutinefunction(getattr(EngineClient, name))


@pytest.mark.parametrize("engine", [AsyncEngine, VLLMEngine])
def test_each_engine_has_the_properties(engine):
    assert isinstance(engine.tokenizer, property) and isinstance(engine.is_alive, property)


def test_vllm_exports_into_ranges_by_name():
    assert VLLMEngine.kv_export_target is KVExportTarget.SHM_RANGE


def test_the_engine_request_carries_the_worker_request_and_what_the_worker_adds():
    params = SamplingParams(temperature=0.0, max_tokens=5)
    request = WorkerRequest("r1", [1, 2, 3], params, priority=2, cache_salt="s", lora_name="a", lora_path="/p",
                            keep_cached=False)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    assert engine_request(request, params=one, hold_kv=True, expected_cached_tokens=16) == EngineRequest(
        "r1", [1, 2, 3], one, priority=2, cache_salt="s", lora_name="a", lora_path="/p", keep_cached=False,
        hold_kv=True, expected_cached_tokens=16,
    )
    assert engine_request(request).params is params
    assert engine_request(request).arrival_mono_s is None  # the engine's own clock as it takes it
