"""Structured outputs in the engine, on a tiny random model (fp32): the mask is the only reason its
sampled gibberish is valid JSON, which is exactly what these tests rely on.

Compiles are made to wait on an Event where a test needs a request to be caught compiling: the
engine's compiler is replaced by one whose compile blocks until the test lets it go.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import replace

import jsonschema
import pytest

from serving.engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from serving.engine.async_engine import AsyncEngine
from serving.engine.contract import EngineRequest
from serving.engine.params import GuidedSpec
from serving.engine.sampling.grammar import GrammarCompiler
from tests.serving.engine.test_engine import random_prompts, tokens_of

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "active": {"type": "boolean"},
        "kind": {"enum": ["person", "robot", "cat"]},
        "nickname": {"type": ["string", "null"], "maxLength": 6},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]},
    },
    "required": ["name", "age", "active", "kind", "address"],
}
SPEC = GuidedSpec.json_schema(SCHEMA)
FREE = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def make_engine(model_dir, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(**{"model": str(model_dir), "dtype": "float32", "kv_cache_bytes": 8 * 2**20, **overrides}))


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return make_engine(tiny_model_dir)


def sampled(seed: int, **params) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "seed": seed, "max_tokens": 128, "guided": SPEC, **params})


def gated_compiler(engine: LLMEngine) -> threading.Event:
    """Give `engine` a compiler of its own whose compiles wait for the returned Event."""
    gate = threading.Event()
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, tuple(engine.eos_token_ids))
    compile_now = compiler._compile
    compiler._compile = lambda spec: gate.wait() and compile_now(spec)
    engine.intake._grammars = compiler
    return gate


def run(engine: LLMEngine) -> dict[str, list]:
    """Step until every request has finished: request id -> its outputs, in order."""
    outputs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        if engine.is_stalled:
            engine.compiling.wait()
    return outputs


def test_sampled_json_schema_outputs_validate_100_times_out_of_100(engine):
    prompts = random_prompts([5, 40, 17, 90] * 25, seed=3)
    outputs = engine.generate(prompts, [sampled(seed) for seed in range(100)])
    texts = [o.outputs[0].text for o in outputs]
    assert [o.outputs[0].finish_reason for o in outputs] == ["stop"] * 100
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) == 100  # sampled: every seed its own document
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_free_rows_in_a_batch_with_structured_ones_decode_exactly_as_alone(engine):
    free_prompts = random_prompts([3, 60, 17, 33], seed=11)
    alone = [tokens_of(engine.generate([p], FREE))[0] for p in free_prompts]
    structured_prompts = random_prompts([8, 25, 70, 12], seed=12)
    prompts = [p for pair in zip(free_prompts, structured_prompts) for p in pair]
    params = [p for i in range(4) for p in (FREE, sampled(i))]
    outputs = engine.generate(prompts, params)
    assert tokens_of(outputs[0::2]) == alone
    for out in outputs[1::2]:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


def test_a_greedy_structured_output_is_the_same_alone_and_in_a_batch(engine):
    prompt = random_prompts([21], seed=5)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=128, guided=SPEC)
    alone = tokens_of(engine.generate([prompt], greedy))[0]
    batch = engine.generate([prompt, *random_prompts([9, 50], seed=6)], [greedy, FREE, sampled(1)])
    assert tokens_of(batch)[0] == alone
    jsonschema.validate(json.loads(engine.tokenizer.decode(alone[:-1])), SCHEMA)
    assert alone[-1] == 2  # ends with EOS, the only token a complete grammar allows


def test_each_of_n_choices_follows_the_grammar_on_its_own(engine):
    (out,) = engine.generate(random_prompts([30], seed=8), sampled(4, n=4))
    texts = [c.text for c in out.outputs]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) == 4


def test_max_tokens_cuts_a_structured_output_with_finish_reason_length(engine):
    prompt = random_prompts([12], seed=9)[0]
    (whole,) = engine.generate([prompt], sampled(7))
    (cut,) = engine.generate([prompt], sampled(7, max_tokens=6))
    assert whole.outputs[0].finish_reason == "stop"
    assert cut.outputs[0].finish_reason == "length"
    assert cut.outputs[0].token_ids == whole.outputs[0].token_ids[:6]
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.outputs[0].text)  # incomplete, and the finish_reason says so


def test_a_structured_output_continues_across_the_prefill_decode_hand_off(tiny_model_dir, engine):
    """The prefill engine samples the first token under the grammar; the decode engine imports
    the KV and replays that token into a fresh matcher: the same tokens as one engine alone."""
    prompt = random_prompts([75], seed=17)[0]
    params = sampled(21)
    expected = tokens_of(engine.generate([prompt], params))[0]

    prefill = make_engine(tiny_model_dir)
    decode = make_engine(tiny_model_dir)
    prefill.add_request("x", params=replace(params, max_tokens=1), prompt_token_ids=prompt, hold_kv=True)
    first = run(prefill)["x"][-1].outputs[0].token_ids
    decode.add_request("x", params=params, prompt_token_ids=prompt, kv_payload=prefill.export_kv("x"), prior_output_token_ids=first)
    rest = [t for out in run(decode)["x"] for t in out.outputs[0].token_ids]
    assert first + rest == expected


def test_prior_tokens_the_grammar_does_not_allow_are_refused(engine, tokenizer):
    engine.grammars.compile(SPEC)  # compiled already: the replay runs as the request is added
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("bad-prior", params=sampled(0), prompt_token_ids=[5, 6], prior_output_token_ids=tokenizer("hello").input_ids)
    assert info.value.param == "prior_output_token_ids"
    assert not engine.has_unfinished_requests()


def test_a_request_waits_compiling_while_the_batch_goes_on(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    gate = gated_compiler(engine)
    engine.add_request("structured", params=sampled(3), prompt_token_ids=[5, 6, 7])
    engine.add_request("free", params=FREE, prompt_token_ids=[8, 9])
    assert engine.stats().num_waiting == 2
    outputs: dict[str, list] = {}
    while "free" not in outputs or not outputs["free"][-1].finished:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert "structured" not in outputs and engine.stats().num_waiting == 1  # still compiling
    engine.step()
    assert engine.is_stalled  # nothing to run until the grammar is ready
    gate.set()
    rest = run(engine)
    assert rest["structured"][-1].finished and rest["structured"][-1].outputs[0].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(o.outputs[0].text for o in rest["structured"])), SCHEMA)


def test_aborting_a_request_while_it_compiles_ends_it_at_once(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    gate = gated_compiler(engine)
    engine.add_request("x", params=sampled(3), prompt_token_ids=[5, 6, 7])
    assert engine.abort_request("x")
    (out,) = engine.step()
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert len(engine.compiling) == 0 and not engine.has_unfinished_requests()
    gate.set()


def test_a_spec_that_does_not_compile_fails_its_request(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    gate = gated_compiler(engine)
    bad = SamplingParams(guided=GuidedSpec("regex", "a("), max_tokens=8)
    engine.add_request("compiling", params=bad, prompt_token_ids=[5, 6])
    gate.set()
    engine.compiling.wait()
    assert engine.step() == []
    (failure,) = engine.take_failures()
    assert isinstance(failure, InvalidRequestError) and failure.request_id == "compiling" and failure.param == "guided"
    assert "cannot be compiled: Regex parsing error at position 3" in str(failure)
    # Now cached with its error: refused as it is added.
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("cached", params=bad, prompt_token_ids=[5, 6])
    assert info.value.param == "guided" and not engine.has_unfinished_requests()


@pytest.mark.asyncio
async def test_the_async_engine_wakes_when_a_grammar_is_ready(tiny_model_dir):
    """The step loop, idle but for a compiling request, sleeps on its inbox: the compile's end
    must wake it."""
    engine = AsyncEngine(make_engine(tiny_model_dir))
    try:
        gate = gated_compiler(engine.engine)

        async def collect(request_id, params, prompt):
            return [out async for out in engine.generate(EngineRequest(request_id, prompt_token_ids=prompt, params=params))]

        structured = asyncio.create_task(collect("structured", sampled(5), [5, 6, 7]))
        free = await collect("free", FREE, [8, 9])
        assert free[-1].finished and not structured.done()
        gate.set()
        outputs = await asyncio.wait_for(structured, timeout=60)  # a hang guard, not a timing
        jsonschema.validate(json.loads("".join(o.outputs[0].text for o in outputs)), SCHEMA)
    finally:
        engine.shutdown()
