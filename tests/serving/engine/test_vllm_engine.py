"""`backend: vllm` (serving/engine/vllm/engine.py): vLLM's AsyncLLM behind AsyncEngine's surface,
on the default model, fp32, against transformers; sampling values and structured outputs mapped,
aborts, stats. Runs in the environment `make test` builds for it (.venv-vllm); anywhere vLLM
cannot be imported it skips, and CI (CI set) fails instead."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from serving.engine import EngineConfig, SamplingParams
from serving.engine.contract import EngineRequest
from serving.engine.errors import InvalidRequestError
from serving.engine.params import GuidedSpec
from serving.engine.vllm.convert import vllm_sampling_params
from serving.engine.vllm.engine import VLLMEngine
from tests.serving.engine.test_model_parity import hf_greedy

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", autouse=True)
def _vllm(needs_vllm):
    """Every test here needs vLLM (tests/conftest.py's needs_vllm)."""

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def served(vllm_engines):
    """A vLLM engine (the package's decode engine: conftest.py) and the loop it runs on."""
    return vllm_engines[1], vllm_engines[2]


def collect(served, request_id: str, prompt: list[int], params: SamplingParams = GREEDY):
    """Every output of one request, run to its end on the engine's loop."""
    engine, loop = served

    async def run():
        return [out async for out in engine.generate(EngineRequest(request_id, params=params, prompt_token_ids=prompt))]

    return loop.run_until_complete(run())


def test_the_sampling_values_map_onto_vllms():
    params = SamplingParams(n=2, max_tokens=7, min_tokens=2, temperature=0.5, top_p=0.9, top_k=0, min_p=0.1,
                            repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.3,
                            logit_bias={5: 2.0}, seed=3, logprobs=2, stop=["x"], stop_token_ids=[9],
                            include_stop_str_in_output=True, ignore_eos=True, skip_special_tokens=False)
    v = vllm_sampling_params(params)
    assert (v.n, v.max_tokens, v.min_tokens, v.temperature, v.top_p, v.top_k, v.min_p) == (2, 7, 2, 0.5, 0.9, 0, 0.1)
    assert (v.repetition_penalty, v.presence_penalty, v.frequency_penalty, v.seed, v.logprobs) == (1.1, 0.2, 0.3, 3, 2)
    assert v.logit_bias == {5: 2.0} and v.stop == ["x"] and v.stop_token_ids == [9]
    assert v.include_stop_str_in_output and v.ignore_eos and not v.skip_special_tokens
    assert v.structured_outputs is None and v.output_kind.name == "DELTA"
    assert vllm_sampling_params(SamplingParams(guided=GuidedSpec.choice(["yes", "no"]))).structured_outputs.choice == ["yes", "no"]
    assert vllm_sampling_params(SamplingParams(guided=GuidedSpec("json_object"))).structured_outputs.json_object


def test_greedy_tokens_equal_transformers_and_arrive_as_deltas(served, default_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    for i, prompt in enumerate(([1, 504, 3458, 282, 4649, 314], list(range(100, 160)))):
        outputs = collect(served, f"greedy-{i}", prompt)
        tokens = [t for out in outputs for t in out.outputs[0].token_ids]
        assert tokens == hf_greedy(hf, prompt, 16)[0]
        assert [out.finished for out in outputs] == [False] * (len(outputs) - 1) + [True]
        assert outputs[-1].outputs[0].finish_reason == "length" and outputs[-1].num_prompt_tokens == len(prompt)
        if i == 0:  # words (random byte tokens decode differently after their prompt's bytes)
            text = "".join(out.outputs[0].text for out in outputs)
            assert text == served[0].tokenizer.decode(tokens, skip_special_tokens=True)


def test_logprobs_choices_and_a_structured_output(served):
    prompt = list(range(200, 232))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3, n=2)
    outputs = collect(served, "logprobs", prompt, params)
    by_choice = {}
    for out in outputs:
        for c in out.outputs:
            by_choice.setdefault(c.index, []).extend(c.logprobs)
    assert sorted(by_choice) == [0, 1]
    for entries in by_choice.values():
        assert len(entries) == 4
        for entry in entries:
            assert len(entry.top) == 3 and entry.top[0][0] == entry.token_id  # greedy: the top token was taken
            assert entry.logprob == entry.top[0][1]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    guided = SamplingParams(temperature=0.0, max_tokens=32, guided=GuidedSpec.json_schema(schema))
    words = served[0].tokenizer("Is the sky blue? Answer in JSON.").input_ids
    outputs = collect(served, "guided", words, guided)
    text = "".join(out.outputs[0].text for out in outputs)
    assert set(json.loads(text)) == {"ok"} and outputs[-1].outputs[0].finish_reason == "stop"


def test_an_abandoned_stream_is_aborted_and_the_engine_serves_on(served):
    engine, loop = served

    async def abandon():
        stream = engine.generate(EngineRequest("gone", params=SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True),
                                 prompt_token_ids=list(range(300, 340))))
        first = await stream.__anext__()
        await stream.aclose()  # what a vanished client's cancelled handler does
        return first

    assert loop.run_until_complete(abandon()).outputs[0].token_ids
    for _ in range(50):
        loop.run_until_complete(asyncio.sleep(0.05))
        if engine.stats().num_running == 0:
            break
    assert engine.stats().num_running == 0
    assert collect(served, "after", [1, 2, 3])[-1].finished


def test_requests_still_waiting_past_max_queue_wait_s_end_with_queue_timeout_and_the_rest_run_on(served):
    """max_queue_wait_s as kvrelay's scheduler has it: with vLLM's 16 sequences all running, 8
    more requests wait, and end with queue_timeout and no tokens once the limit passes (the API's
    503); the 16 that started are never dropped, and the engine serves on."""
    engine, loop = served
    before = engine.stats().num_queue_timeouts
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)

    def prompt(i: int) -> list[int]:
        return list(range(5000 + 50 * i, 5040 + 50 * i))

    async def rest(stream, first):
        return [first] + [out async for out in stream]

    async def one(i: int):
        return [out async for out in engine.generate(EngineRequest(f"q-{i}", params=params, prompt_token_ids=prompt(i)))]

    config = engine.config

    async def crowd():
        running = [engine.generate(EngineRequest(f"r-{i}", params=params, prompt_token_ids=prompt(i))) for i in range(16)]
        firsts = await asyncio.gather(*(stream.__anext__() for stream in running))  # all 16 started
        engine.config = config.model_copy(update={"max_queue_wait_s": 0.5})  # read as each request arrives
        return await asyncio.gather(*(rest(s, f) for s, f in zip(running, firsts)), *(one(i) for i in range(16, 24)))

    try:
        results = loop.run_until_complete(crowd())
    finally:
        engine.config = config
    ends = [(outputs[-1].outputs[0].finish_reason, sum(len(o.outputs[0].token_ids) for o in outputs)) for outputs in results]
    assert ends == [("length", 120)] * 16 + [("queue_timeout", 0)] * 8
    assert all(outputs[-1].finished for outputs in results)
    assert engine.stats().num_queue_timeouts - before == 8
    assert collect(served, "after-timeouts", [1, 2, 3])[-1].outputs[0].finish_reason == "length"


def test_stats_count_tokens_and_prefix_hits_as_vllm_saw_them(served):
    engine, loop = served
    before = engine.stats()
    prompt = list(range(1000, 1128))
    started = time.perf_counter()
    collect(served, "p1", prompt)
    collect(served, "p2", prompt)
    wall = time.perf_counter() - started
    loop.run_until_complete(asyncio.sleep(1.5))  # vLLM's stat loggers run on its output loop
    after = engine.stats()
    assert after.num_generated_tokens - before.num_generated_tokens == 32
    # the second request reads the first's 3 full blocks of 32 (the last token is always computed)
    assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens == 96
    assert after.prefix_cache_query_tokens - before.prefix_cache_query_tokens == 256
    assert after.kernel_path == "vllm"
    # The decode step account: each request's 15 decode iterations after its prefill, one
    # sequence each; their periods lie within the two runs.
    assert (after.decode_steps - before.decode_steps, after.decode_step_rows - before.decode_step_rows) == (30, 30)
    assert 0 < after.decode_step_s - before.decode_step_s <= wall


def test_queued_prefill_tokens_the_prefill_rate_and_the_ttft_split_come_from_the_replica(served):
    """What vLLM's stats lack, the replica measures: a prompt counts as queued prefill until its
    first output; vLLM's own timestamps (its EngineCore's monotonic clock) give the TTFT's queue
    and prefill parts and the prefill rate."""
    engine, loop = served
    prompt = list(range(3000, 3150))

    async def first_then_rest(request_id: str, **hint):
        stream = engine.generate(EngineRequest(request_id, params=GREEDY, prompt_token_ids=prompt, **hint))
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # the request is in vLLM's hands, its first output not back
        queued = engine.stats().num_queued_prefill_tokens
        outputs = [await first] + [out async for out in stream]
        return queued, outputs

    queued, outputs = loop.run_until_complete(first_then_rest("queued"))
    assert queued == 150 and engine.stats().num_queued_prefill_tokens == 0
    # The worker expects 128 of them cached (its view of vLLM's blocks): 22 are queued work; a
    # hint past the prompt leaves the last token, which is always computed.
    assert loop.run_until_complete(first_then_rest("hinted", expected_cached_tokens=128))[0] == 22
    assert loop.run_until_complete(first_then_rest("over", expected_cached_tokens=999))[0] == 1
    m = outputs[-1].metrics
    assert m.arrival_mono_s <= m.first_scheduled_mono_s <= m.first_token_mono_s <= m.finished_mono_s
    for i in range(3):  # the rate is the median of a few prefills (prefill_rate.py)
        collect(served, f"rate-{i}", list(range(4000 + 200 * i, 4150 + 200 * i)))
    assert engine.stats().prefill_tokens_per_s > 0


def test_what_it_cannot_do_is_refused_naming_the_field(served):
    engine, loop = served

    async def ask(engine=engine, **kwargs):
        return [o async for o in engine.generate(EngineRequest("no", params=GREEDY, prompt_token_ids=[1, 2], **kwargs))]

    colocated = VLLMEngine.__new__(VLLMEngine)  # a colocated pool's engine: its checks come before vLLM's
    colocated._handoffs = None
    with pytest.raises(InvalidRequestError, match=r"hold_kv: this vLLM engine hands no KV over: only a prefill or "
                                                  r"decode pool's \(mode: disaggregated\) does"):
        loop.run_until_complete(ask(colocated, hold_kv=True))
    with pytest.raises(InvalidRequestError, match="export_into: needs hold_kv"):
        loop.run_until_complete(ask(colocated, export_into=object()))
    with pytest.raises(InvalidRequestError, match="model: adapter 'a': this engine serves no LoRA adapters"):
        loop.run_until_complete(ask(lora_name="a"))


def test_vllms_kv_events_fill_the_routers_index_in_kvrelays_hashes_and_predict_its_hits(served):
    """A replay: before each request, the hit the router's index (fed only by the relayed events)
    predicts from the ingress's prompt hashes (block_hash.py, the cache salt included) equals the
    hit vLLM then reports (num_cached_tokens)."""
    import threading

    from router.index import CachedBlockSet
    from serving.engine.kv.block_hash import block_extra_keys, hash_blocks

    engine, loop = served
    index, lock = CachedBlockSet(), threading.Lock()

    def apply(events):
        with lock:
            index.apply(events)

    engine.subscribe_kv_events(apply)
    assert engine.model_info().block_size == 32  # vLLM's CPU attention: the 16 asked, rounded up
    base = list(range(2000, 2128))  # 4 blocks of 32
    replay = [("a", base, None), ("b", base, None), ("c", base[:80] + list(range(5000, 5060)), None),
              ("d", base + list(range(6000, 6040)), None), ("e", base, "salt"), ("f", base, "salt")]
    predicted, seen = [], []
    for request_id, prompt, salt in replay:
        hashes = hash_blocks(prompt, 32, block_extra_keys(salt))
        with lock:
            held, _ = index.num_leading(hashes, (len(prompt) - 1) // 32)
        predicted.append(held * 32)

        async def run(prompt=prompt, request_id=request_id, salt=salt):
            return [o async for o in engine.generate(EngineRequest(request_id, params=GREEDY, prompt_token_ids=prompt, cache_salt=salt))]

        seen.append(loop.run_until_complete(run())[-1].num_cached_tokens)
        loop.run_until_complete(asyncio.sleep(0.5))  # the events cross a socket
    assert seen == [0, 96, 64, 128, 0, 96]  # vLLM's own hits: a salt keeps its blocks apart
    assert predicted == seen


def test_a_prompt_only_scored_gets_kvrelays_prompt_logprobs_and_a_resumed_stream_continues(served, default_model_dir):
    """max_tokens 0 (which vLLM refuses) scores the prompt: no token, finish length, the logprob of
    each prompt token after the first with its rank and top alternatives, as kvrelay's engine
    gives them (fp32 both). A stream resumed with the tokens generated before continues with
    exactly the greedy tokens it would have had."""
    from serving.engine import LLMEngine

    engine, loop = served
    prompt = served[0].tokenizer("The quick brown fox jumps over the lazy dog.").input_ids
    outputs = collect(served, "score", prompt, SamplingParams(max_tokens=0, prompt_logprobs=2))
    (out,) = outputs
    assert out.finished and out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    ours = LLMEngine(EngineConfig(model=str(default_model_dir), dtype="float32", kv_cache_bytes=2**26)).generate(
        [prompt], SamplingParams(max_tokens=0, prompt_logprobs=2))[0].prompt_logprobs
    assert [e.token_id for e in out.prompt_logprobs] == prompt[1:] == [e.token_id for e in ours]
    assert [e.rank for e in out.prompt_logprobs] == [e.rank for e in ours]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(out.prompt_logprobs, ours)) < 2e-3
    assert all(len(e.top) == 2 for e in out.prompt_logprobs)

    whole = [t for o in collect(served, "whole", prompt) for t in o.outputs[0].token_ids]

    async def resume():
        return [o async for o in engine.generate(EngineRequest("resumed", params=GREEDY, prompt_token_ids=prompt,
                                                 prior_output_token_ids=whole[:5]))]

    resumed = loop.run_until_complete(resume())
    assert [t for o in resumed for t in o.outputs[0].token_ids] == whole[5:]
    assert resumed[-1].num_prompt_tokens == len(prompt) and resumed[-1].outputs[0].finish_reason == "length"


class _Stored:  # the shape of vLLM's BlockStored (the relay reads its fields by name)
    def __init__(self, block_hashes, parent_block_hash, token_ids, extra_keys=None, lora_name=None):
        self.block_hashes, self.parent_block_hash, self.token_ids = block_hashes, parent_block_hash, token_ids
        self.extra_keys, self.lora_name, self.group_idx = extra_keys, lora_name, None


_Stored.__name__ = "BlockStored"


class _Removed:
    def __init__(self, block_hashes):
        self.block_hashes, self.group_idx = block_hashes, None


_Removed.__name__ = "BlockRemoved"


def test_the_relay_hashes_adapters_and_salts_as_the_ingress_does_and_counts_duplicate_blocks():
    """No vLLM needed: vLLM's events as it sends them (extra keys untagged, the adapter's name
    before the salt) become blocks with the ingress's hashes; a hash vLLM holds twice goes only
    when its last block does."""
    from serving.engine.kv.block_hash import block_extra_keys, hash_blocks
    from serving.engine.kv.events import BlockRemoved, BlockStored
    from serving.engine.vllm.events import KVEventRelay

    relay = KVEventRelay.__new__(KVEventRelay)  # its translation alone, no socket
    relay.block_size, relay._lora_paths, relay._ours = 4, {"tone": "/adapters/tone"}, {}
    tokens = list(range(8))
    (stored,) = relay.translate([_Stored([11, 12], None, tokens, [("tone", "s1"), None], lora_name="tone")])
    expected = hash_blocks(tokens, 4, block_extra_keys("s1", "tone", "/adapters/tone"))
    assert stored == BlockStored(tuple(expected), stored.parent_hash, tuple(tokens), 4)
    (more,) = relay.translate([_Stored([13], 12, list(range(8, 12)))])  # chained from its parent's keys
    assert more.block_hashes == tuple(hash_blocks(list(range(12)), 4, block_extra_keys("s1", "tone", "/adapters/tone"))[2:])
    relay.translate([_Stored([11], None, tokens[:4], [("tone", "s1")], lora_name="tone")])  # block 11 twice
    assert relay.translate([_Removed([11])]) == []  # one copy left
    assert relay.translate([_Removed([11, 99])]) == [BlockRemoved((expected[0],))]
    salted = relay.translate([_Stored([21], None, tokens[:4], [("s2",)])])[0]
    assert salted.block_hashes == tuple(hash_blocks(tokens[:4], 4, block_extra_keys("s2")))
