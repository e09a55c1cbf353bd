"""LLMEngine behaviour on a tiny random model (fp32): batching, caching, sampling, stopping, KV moves."""

from __future__ import annotations

import time

import pytest
import torch

from serving.engine import (
    ContextLengthError,
    InvalidRequestError,
    LLMEngine,
    SamplingParams,
)
from serving.engine.kv.events import BlockStored
from serving.engine.kv.payload import KVPayload
from serving.engine.sampling.sampler import LogitBias
from tests.helpers import tiny_engine_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def make_engine(model_dir, **overrides) -> LLMEngine:
    return LLMEngine(tiny_engine_config(model_dir, **overrides))


def random_prompts(lengths, seed=0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in lengths]


def tokens_of(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return make_engine(tiny_model_dir)


MIXED_LENGTHS = [3, 200, 17, 64, 1, 129, 45, 300, 8, 90, 33, 250, 16, 15, 77, 160] * 2


@pytest.fixture(scope="module")
def alone_outputs(engine) -> list[list[int]]:
    """Each of 32 mixed-length prompts run alone."""
    return [tokens_of(engine.generate([p], GREEDY))[0] for p in random_prompts(MIXED_LENGTHS)]


def test_batch_invariance_32_mixed_requests(engine, alone_outputs):
    assert tokens_of(engine.generate(random_prompts(MIXED_LENGTHS), GREEDY)) == alone_outputs


def test_batch_invariance_with_chunked_prefill(tiny_model_dir, alone_outputs):
    chunked = make_engine(tiny_model_dir, max_num_batched_tokens=48)
    assert tokens_of(chunked.generate(random_prompts(MIXED_LENGTHS), GREEDY)) == alone_outputs
    assert chunked.stats().num_free_blocks == chunked.stats().num_blocks


def test_batch_invariance_with_preemption(tiny_model_dir, alone_outputs):
    # 2 layers x 2 KV heads x 16 dims x 4 bytes x 2 = 512 bytes/token; 40 blocks of 16 = 640 tokens,
    # far less than the 32 requests need at once (the longest alone needs 324).
    tight = make_engine(tiny_model_dir, kv_cache_bytes=40 * 16 * 512, max_num_batched_tokens=256)
    assert tight.block_manager.num_blocks == 40
    assert tokens_of(tight.generate(random_prompts(MIXED_LENGTHS), GREEDY)) == alone_outputs
    stats = tight.stats()
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == 40


def test_prefix_cache_on_and_off_give_identical_tokens(tiny_model_dir):
    shared = random_prompts([150], seed=3)[0]
    prompts = [shared + tail for tail in random_prompts([5, 40, 1, 77], seed=4)] + [shared]
    on = make_engine(tiny_model_dir, enable_prefix_caching=True)
    off = make_engine(tiny_model_dir, enable_prefix_caching=False)
    first_on = tokens_of(on.generate(prompts, GREEDY))
    second_on = tokens_of(on.generate(prompts, GREEDY))  # now mostly cache hits
    assert on.stats().prefix_cache_hit_tokens > 0
    assert first_on == second_on == tokens_of(off.generate(prompts, GREEDY))
    assert off.stats().prefix_cache_hit_tokens == 0


def test_shared_1k_prefix_computes_only_the_suffix(engine):
    prefix, tail_a, tail_b = random_prompts([1024, 64, 64], seed=5)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    engine.generate([prefix + tail_a], one)
    before = engine.stats()
    (out,) = engine.generate([prefix + tail_b], one)
    after = engine.stats()
    assert out.num_cached_tokens == 1024
    assert after.num_computed_tokens - before.num_computed_tokens == 64
    assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens == 1024
    assert after.prefix_cache_query_tokens - before.prefix_cache_query_tokens == 1088


def test_a_queued_prefix_hit_counts_only_its_uncached_tail_as_queued_prefill(tiny_model_dir):
    # What the routers read as the replica's queue: a waiting prompt whose first 1024 tokens are
    # cached is 64 tokens of prefill, as the router counted it when it sent it there.
    eng = make_engine(tiny_model_dir)
    prefix, tail_a, tail_b, cold = random_prompts([1024, 64, 64, 100], seed=5)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    eng.generate([prefix + tail_a], one)
    eng.add_request("hit", prompt_token_ids=prefix + tail_b, params=one)
    eng.add_request("cold", prompt_token_ids=cold, params=one)
    assert eng.stats().num_queued_prefill_tokens == 64 + 100
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.stats().num_queued_prefill_tokens == 0
    # The worker's expectation counts prompts still being computed ahead of it, which the
    # engine's own lookup cannot see yet: 1024 of a new prefix's second prompt.
    other, tail_c, tail_d = random_prompts([1024, 64, 64], seed=6)
    eng.add_request("first", prompt_token_ids=other + tail_c, params=one)
    eng.add_request("second", prompt_token_ids=other + tail_d, params=one, expected_cached_tokens=1024)
    assert eng.stats().num_queued_prefill_tokens == 1088 + 64


def test_kv_events_report_stored_prompt_blocks(tiny_model_dir):
    eng = make_engine(tiny_model_dir)
    prompt = random_prompts([40], seed=6)[0]
    eng.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    events = eng.take_kv_events()
    assert events and all(isinstance(e, BlockStored) for e in events)
    stored = [h for e in events for h in e.block_hashes]
    from serving.engine.kv.block_hash import hash_blocks

    assert stored == hash_blocks(prompt, 16)  # 2 full blocks of the 40-token prompt


def test_seeded_sampling_is_reproducible_alone_and_batched(engine):
    prompt = random_prompts([30], seed=7)[0]
    seeded = SamplingParams(temperature=2.0, top_p=0.95, max_tokens=16, seed=1234, ignore_eos=True)
    alone = tokens_of(engine.generate([prompt], seeded))[0]
    others = random_prompts([12, 50, 7], seed=8)
    unseeded = SamplingParams(temperature=2.0, max_tokens=16, ignore_eos=True)
    batch = engine.generate(
        others[:2] + [prompt] + others[2:], [unseeded, seeded, seeded, unseeded]
    )
    assert tokens_of(batch)[2] == alone
    other_seed = SamplingParams(temperature=2.0, top_p=0.95, max_tokens=16, seed=99, ignore_eos=True)
    assert tokens_of(engine.generate([prompt], other_seed))[0] != alone


def test_top_k_1_equals_greedy(engine):
    prompts = random_prompts([10, 60], seed=9)
    top1 = SamplingParams(temperature=1.3, top_k=1, max_tokens=24, ignore_eos=True)
    assert tokens_of(engine.generate(prompts, top1)) == tokens_of(engine.generate(prompts, GREEDY))


def test_n_choices_share_prompt_blocks(engine):
    prompt = random_prompts([100], seed=10)[0]
    before = engine.stats().num_computed_tokens
    params = SamplingParams(n=3, temperature=2.0, max_tokens=4, seed=5, ignore_eos=True)
    (out,) = engine.generate([prompt], params)
    computed = engine.stats().num_computed_tokens - before
    # choice 0 computes 100 prompt tokens; choices 1, 2 share its 6 full blocks (96 tokens) and
    # compute the last 4; each choice then computes 3 more tokens to sample tokens 2..4.
    assert computed == 100 + 2 * 4 + 3 * 3
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 4 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_logit_bias_tensors_are_built_once_per_request_not_per_step(engine, monkeypatch):
    built = []
    build = LogitBias.of

    def counting_of(bias, device="cpu"):
        built.append(dict(bias) if bias else None)
        return build(bias, device)

    monkeypatch.setattr(LogitBias, "of", staticmethod(counting_of))
    prompt = random_prompts([20], seed=12)[0]
    (out,) = engine.generate([prompt], SamplingParams(n=2, temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={7: 100.0}))

    assert [c.token_ids for c in out.outputs] == [[7] * 6, [7] * 6]  # 12 rows sampled over 6 steps
    assert built == [{7: 100.0}]


def test_eos_min_tokens_and_max_tokens(engine):
    prompt = random_prompts([20], seed=11)[0]
    force_eos = {2: 100.0}
    (out,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, logit_bias=force_eos))
    assert out.outputs[0].token_ids == [2] and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].text == ""
    (out,) = engine.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=10, min_tokens=3, logit_bias=force_eos)
    )
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].token_ids[-1] == 2
    (out,) = engine.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logit_bias=force_eos)
    )
    assert out.outputs[0].token_ids == [2] * 5 and out.outputs[0].finish_reason == "length"
    (out,) = engine.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[2], ignore_eos=True,
                                 logit_bias=force_eos)
    )
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == 2


def test_stop_string_across_tokens_is_removed(engine):
    prompt = random_prompts([25], seed=12)[0]
    (full,) = engine.generate([prompt], GREEDY)
    ids = full.outputs[0].token_ids
    pieces = [engine.tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    # a stop string spanning the boundary between output tokens 3 and 4
    cut = len(pieces[2])
    stop = pieces[4][cut - 2 : cut + 2] if cut >= 2 else pieces[4][:4]
    assert len(stop) >= 2
    expected_text = full.outputs[0].text[: full.outputs[0].text.index(stop)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    (out,) = engine.generate([prompt], params)
    assert out.outputs[0].text == expected_text
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    params.include_stop_str_in_output = True
    (out,) = engine.generate([prompt], params)
    assert out.outputs[0].text == expected_text + stop


def test_streamed_text_concatenates_to_the_full_decode(engine):
    prompt = random_prompts([25], seed=13)[0]
    engine.add_request("stream", params=GREEDY, prompt_token_ids=prompt)
    pieces, ids = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces += [c.text for c in out.outputs]
            ids += [t for c in out.outputs for t in c.token_ids]
    assert "".join(pieces) == engine.tokenizer.decode(ids, skip_special_tokens=True)


def test_logprobs_are_returned_per_token(engine):
    prompt = random_prompts([10], seed=14)[0]
    (out,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, ignore_eos=True))
    lps = out.outputs[0].logprobs
    assert [lp.token_id for lp in lps] == out.outputs[0].token_ids
    for lp in lps:
        assert len(lp.top) == 2 and lp.top[0][1] >= lp.top[1][1]
        assert lp.top[0][0] == lp.token_id  # greedy picks the most likely token
        assert lp.logprob == pytest.approx(lp.top[0][1])


def test_abort_returns_every_block_and_leaves_others_intact(engine):
    prompts = random_prompts([40, 70, 20], seed=15)
    expected = tokens_of(engine.generate([prompts[0], prompts[2]], GREEDY))
    baseline = engine.stats().num_free_blocks
    for i, p in enumerate(prompts):
        engine.add_request(f"ab-{i}", params=GREEDY, prompt_token_ids=p)
    collected: dict[str, list[int]] = {"ab-0": [], "ab-2": []}
    finish: dict[str, str] = {}
    for step in range(30):
        if step == 3:
            assert engine.abort_request("ab-1")
        for out in engine.step():
            for c in out.outputs:
                if out.request_id in collected:
                    collected[out.request_id] += c.token_ids
                if c.finish_reason:
                    finish[out.request_id] = c.finish_reason
    assert finish == {"ab-0": "length", "ab-1": "abort", "ab-2": "length"}
    assert [collected["ab-0"], collected["ab-2"]] == expected
    assert engine.stats().num_free_blocks == baseline == engine.stats().num_blocks
    assert not engine.abort_request("ab-1")  # already gone


def test_priority_runs_first(tiny_model_dir):
    eng = make_engine(tiny_model_dir, max_num_seqs=1)
    prompts = random_prompts([8, 8, 8], seed=16)
    one = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    eng.add_request("low", params=one, prompt_token_ids=prompts[0], priority=5)
    eng.add_request("fcfs", params=one, prompt_token_ids=prompts[1], priority=5)
    eng.add_request("high", params=one, prompt_token_ids=prompts[2], priority=-1)
    order = []
    while eng.has_unfinished_requests():
        order += [o.request_id for o in eng.step() if o.finished]
    assert order == ["high", "low", "fcfs"]


@pytest.mark.parametrize("seeded", [False, True])
def test_export_import_continues_identically(tiny_model_dir, seeded):
    prompt = random_prompts([75], seed=17)[0]
    params = dict(max_tokens=20, ignore_eos=True)
    params.update(temperature=1.5, seed=77) if seeded else params.update(temperature=0.0)
    expected = tokens_of(make_engine(tiny_model_dir).generate([prompt], SamplingParams(**params)))[0]

    prefill = make_engine(tiny_model_dir)
    decode = make_engine(tiny_model_dir)
    # The prefill side runs the same request asked for one token, keeping its KV.
    prefill.add_request(
        "x", params=SamplingParams(**{**params, "max_tokens": 1}), prompt_token_ids=prompt, hold_kv=True
    )
    (out,) = [o for o in prefill.step() if o.finished]
    first = out.outputs[0].token_ids
    assert prefill.stats().num_held_exports == 1
    payload = prefill.export_kv("x")
    assert payload.num_tokens == 75 and payload.kv.is_contiguous()
    assert payload.kv.shape == (2, 2, 5, 2, 16, 16)
    assert prefill.stats().num_free_blocks == prefill.stats().num_blocks

    decode.add_request(
        "x", params=SamplingParams(**params), prompt_token_ids=prompt, kv_payload=payload,
        prior_output_token_ids=first,
    )
    rest: list[int] = []
    while decode.has_unfinished_requests():
        for out in decode.step():
            rest += out.outputs[0].token_ids
    assert first + rest == expected
    # only the first token's KV was computed on the decode side before sampling continued
    assert decode.stats().num_computed_tokens == 19
    assert decode.stats().num_free_blocks == decode.stats().num_blocks


def test_export_into_a_given_buffer_reads_the_payload_out_there(tiny_model_dir):
    """A prefill's payload can be read out straight into a buffer it is given (an arena range):
    the payload is a view of that buffer, with the same values as a payload of its own."""
    prompt = random_prompts([75], seed=17)[0]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    plain = make_engine(tiny_model_dir)
    plain.add_request("x", params=params, prompt_token_ids=prompt, hold_kv=True)
    plain.step()
    expected = plain.export_kv("x").kv

    engine = make_engine(tiny_model_dir)
    buffer = torch.full((engine.kv_payload_bytes(75),), 255, dtype=torch.uint8)
    engine.add_request("x", params=params, prompt_token_ids=prompt, hold_kv=True, export_into=buffer)
    engine.step()
    payload = engine.export_kv("x")
    assert payload.kv.data_ptr() == buffer.data_ptr() and payload.kv.shape == (2, 2, 5, 2, 16, 16)
    assert torch.equal(payload.kv, expected)

    for bad, why in ((torch.empty(10, dtype=torch.uint8), "got 10 bytes"), (buffer, "needs hold_kv")):
        with pytest.raises(InvalidRequestError, match=why) as info:
            engine.add_request("y", params=params, prompt_token_ids=prompt, hold_kv=bad is not buffer, export_into=bad)
        assert info.value.param == "export_into"


def test_an_arena_range_is_written_and_read_only_before_its_leases_end(tiny_model_dir):
    """A shared-memory range may be another request's once its lease ran out: the exporting
    engine then reads its payload out into a tensor of its own (the buffer keeps its bytes), and
    an importing engine computes the prompt instead of reading it, with the same tokens."""
    prompt = random_prompts([75], seed=17)[0]
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    expected = tokens_of(make_engine(tiny_model_dir).generate([prompt], params))[0]

    prefill = make_engine(tiny_model_dir)
    buffer = torch.full((prefill.kv_payload_bytes(75),), 255, dtype=torch.uint8)
    prefill.add_request("x", params=SamplingParams(max_tokens=1, temperature=0.0), prompt_token_ids=prompt,
                        hold_kv=True, export_into=buffer, export_until_mono_s=time.monotonic() - 1.0)
    (out,) = [o for o in prefill.step() if o.finished]
    payload = prefill.export_kv("x")
    assert payload.kv.data_ptr() != buffer.data_ptr() and bool((buffer == 255).all())

    late = KVPayload(payload.request_id, payload.token_ids, payload.layout, payload.kv,
                     readable_until=time.monotonic() - 1.0)
    decode = make_engine(tiny_model_dir)
    decode.add_request("x", params=params, prompt_token_ids=prompt, kv_payload=late,
                       prior_output_token_ids=out.outputs[0].token_ids)
    rest: list[int] = []
    while decode.has_unfinished_requests():
        for o in decode.step():
            rest += o.outputs[0].token_ids
    assert out.outputs[0].token_ids + rest == expected
    assert decode.stats().num_expired_imports == 1
    assert decode.stats().num_computed_tokens == 75 + 11  # the prompt (and the first token) computed here


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=0.0), "top_p"),
        (dict(temperature=-0.1), "temperature"),
        (dict(n=0), "n"),
        (dict(top_k=-3), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(logit_bias={7: 101.0}), "logit_bias"),
        (dict(logprobs=21), "logprobs"),
        (dict(prompt_logprobs=21), "prompt_logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(min_tokens=10, max_tokens=5), "min_tokens"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_sampling_params_are_valid_by_construction(kwargs, param):
    """Checked once, where they are built (the ingress); no later layer checks the ranges again."""
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


@pytest.mark.parametrize(
    "kwargs, param", [(dict(logit_bias={10**6: 1.0}), "logit_bias"), (dict(stop_token_ids=[-1]), "stop_token_ids")],
)
def test_token_ids_outside_the_vocabulary_are_refused_by_the_engine(engine, kwargs, param):
    params = SamplingParams(**kwargs)  # valid in itself: only the model knows its vocabulary
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("bad", params=params, prompt_token_ids=[5, 6, 7])
    assert info.value.param == param
    assert engine.stats().num_waiting == 0


def test_prompt_longer_than_context_names_both_numbers(tiny_model_dir):
    eng = make_engine(tiny_model_dir, max_model_len=100)
    with pytest.raises(ContextLengthError, match="150 tokens but the context window is 100") as info:
        eng.add_request("long", params=GREEDY, prompt_token_ids=[5] * 150)
    assert (info.value.num_tokens, info.value.limit) == (150, 100)
    with pytest.raises(ContextLengthError, match="max_tokens"):
        eng.add_request("long", params=SamplingParams(max_tokens=60), prompt_token_ids=[5] * 50)
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        eng.add_request("oov", params=GREEDY, prompt_token_ids=[5, 49152])
    with pytest.raises(InvalidRequestError, match="must not be empty"):
        eng.add_request("empty", params=GREEDY, prompt_token_ids=[])


def test_pytorch_path_matches_native_kernels(tiny_model_dir, monkeypatch, alone_outputs):
    """The plain PyTorch forward (CUDA, or no C++ compiler) gives the same greedy tokens."""
    import serving.engine.modeling.attention as attention
    import serving.engine.modeling.model as model

    monkeypatch.setattr(model, "native_kernels", lambda: None)
    monkeypatch.setattr(attention, "native_kernels", lambda: None)
    plain = make_engine(tiny_model_dir, max_num_batched_tokens=64)
    assert tokens_of(plain.generate(random_prompts(MIXED_LENGTHS), GREEDY)) == alone_outputs


def test_a_request_that_waited_past_max_queue_wait_s_ends_with_queue_timeout_and_no_tokens(tiny_model_dir):
    """Every choice of the refused request ends, nothing was generated or allocated for it, and
    the request that held the only running slot is not disturbed."""
    eng = make_engine(tiny_model_dir, max_num_seqs=1, max_queue_wait_s=1.0)
    prompts = random_prompts([8, 8], seed=18)
    expected = tokens_of(eng.generate([prompts[0]], GREEDY))
    eng.add_request("runs", params=GREEDY, prompt_token_ids=prompts[0])
    # Waiting for 10 s already (lower priority: it does not take the slot).
    eng.add_request("waits", params=SamplingParams(max_tokens=4, n=2), prompt_token_ids=prompts[1],
                    priority=1, arrival_mono_s=time.monotonic() - 10.0)
    first = eng.step()
    assert [(o.request_id, o.finished, [(c.index, c.token_ids, c.finish_reason) for c in o.outputs]) for o in first if o.request_id == "waits"] == [
        ("waits", True, [(0, [], "queue_timeout"), (1, [], "queue_timeout")]),
    ]
    collected = [t for o in first if o.request_id == "runs" for c in o.outputs for t in c.token_ids]
    while eng.has_unfinished_requests():
        collected += [t for o in eng.step() for c in o.outputs for t in c.token_ids]
    assert collected == expected[0]
    stats = eng.stats()
    assert stats.num_queue_timeouts == 1 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_blocks


def test_a_request_not_kept_cached_leaves_its_blocks_first_to_be_reused(tiny_model_dir):
    """keep_cached=False (the router's admission): its computed blocks are freed to the
    eviction end, still findable; a kept request's go to the recent end."""
    eng = make_engine(tiny_model_dir)
    kept, cold = random_prompts([48, 48], seed=8)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    for request_id, prompt, keep in (("kept", kept, True), ("cold", cold, False)):
        eng.add_request(request_id, params=one, prompt_token_ids=prompt, keep_cached=keep)
        while eng.has_unfinished_requests():
            eng.step()
    bm = eng.block_manager
    cached = {bm.blocks[b].block_hash: position for position, b in enumerate(bm._free) if bm.blocks[b].block_hash is not None}
    from serving.engine.kv.block_hash import hash_blocks

    cold_hashes, kept_hashes = hash_blocks(cold, 16), hash_blocks(kept, 16)
    assert len(cold_hashes) == len(kept_hashes) == 3
    # The cold request's three blocks are the first hashed ones out, tail first; the kept one's
    # are the most recent, its head last.
    order = sorted(cached, key=cached.__getitem__)
    assert order[:3] == cold_hashes[::-1]
    assert order[-3:] == kept_hashes[::-1]
    (again,) = eng.generate([cold[:32] + [7] * 16], one)
    assert again.num_cached_tokens == 32  # findable until taken
