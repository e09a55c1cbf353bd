"""Prompt logprobs from the prefill pass (serving/engine/sampling/prompt_logprobs.py), and max_tokens=0.

The reference is a direct full forward of the tiny model in transformers (fp32): the logits of
positions 0..n-2, log_softmax, gathered at tokens 1..n-1. The engine's figures, computed chunk by
chunk in its own forward passes, must equal it to 1e-4 whatever the chunking, the batch, the
prefix cache or a preemption did.
"""

from __future__ import annotations

import pytest
import torch

from serving.engine import LLMEngine, SamplingParams
from serving.engine.outputs import merge_outputs
from tests.helpers import tiny_engine_config

TOLERANCE = 1e-4


def make_engine(model_dir, **overrides) -> LLMEngine:
    return LLMEngine(tiny_engine_config(model_dir, **overrides))


def random_prompts(lengths, seed=0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def full_forward(tiny_model_dir):
    """prompt ids -> [n - 1, vocab] log_softmax of positions 0..n-2, from transformers."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def run(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt])).logits[0].float()
        return torch.log_softmax(logits[:-1], dim=-1)

    return run


def run_all(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Every request to its end: (merged output, how many of its outputs carried prompt logprobs)."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, params=params, prompt_token_ids=prompt)
    merged, carried = {}, dict.fromkeys(requests, 0)
    while engine.has_unfinished_requests():
        for out in engine.step():
            merged[out.request_id] = merge_outputs(merged.get(out.request_id), out)
            carried[out.request_id] += out.prompt_logprobs is not None
    assert engine.take_failures() == []
    return merged, carried


def assert_matches_reference(prompt_logprobs, prompt: list[int], reference: torch.Tensor, k: int) -> None:
    assert [lp.token_id for lp in prompt_logprobs] == prompt[1:]
    expected = reference.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor([lp.logprob for lp in prompt_logprobs]), expected, atol=TOLERANCE, rtol=0)
    # A rank counts the tokens strictly more likely; those within the tolerance of the prompt
    # token's logprob may fall either side of it in another implementation's rounding.
    surely_above = (reference > expected[:, None] + TOLERANCE).sum(-1) + 1
    maybe_above = (reference > expected[:, None] - TOLERANCE).sum(-1) + 1
    ranks = torch.tensor([lp.rank for lp in prompt_logprobs])
    assert bool(((surely_above <= ranks) & (ranks <= maybe_above)).all())
    values, ids = reference.topk(k, dim=-1)
    for lp, row_ids, row_values in zip(prompt_logprobs, ids.tolist(), values.tolist()):
        assert [t for t, _ in lp.top] == row_ids
        assert [v for _, v in lp.top] == pytest.approx(row_values, abs=TOLERANCE)


def test_prompt_logprobs_equal_a_full_forward(tiny_model_dir, full_forward):
    prompt = random_prompts([57], seed=1)[0]
    engine = make_engine(tiny_model_dir)

    merged, carried = run_all(engine, {"p": (prompt, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3))})

    out = merged["p"]
    assert len(out.prompt_logprobs) == 56 and carried["p"] == 1
    assert_matches_reference(out.prompt_logprobs, prompt, full_forward(prompt), k=3)
    assert len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize("max_num_batched_tokens", [7, 16, 64])
def test_chunked_prefill_scores_each_chunk_the_same(tiny_model_dir, full_forward, max_num_batched_tokens):
    prompt = random_prompts([100], seed=2)[0]
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=max_num_batched_tokens)

    merged, carried = run_all(engine, {"p": (prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))})

    assert carried["p"] == 1  # once, when the last chunk is scored
    assert_matches_reference(merged["p"].prompt_logprobs, prompt, full_forward(prompt), k=1)


def test_a_cached_prefix_is_not_read_by_a_request_for_prompt_logprobs(tiny_model_dir, full_forward):
    prompt = random_prompts([80], seed=3)[0]
    engine = make_engine(tiny_model_dir, enable_prefix_caching=True)
    run_all(engine, {"warm": (prompt, SamplingParams(temperature=0, max_tokens=1))})
    hits = engine.stats().prefix_cache_hit_tokens

    merged, _ = run_all(engine, {"p": (prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))})

    assert merged["p"].num_cached_tokens == 0 and engine.stats().prefix_cache_hit_tokens == hits
    assert_matches_reference(merged["p"].prompt_logprobs, prompt, full_forward(prompt), k=0)
    # Its blocks are cached for the next request that needs no logits.
    run_all(engine, {"after": (prompt, SamplingParams(temperature=0, max_tokens=1))})
    assert engine.stats().prefix_cache_hit_tokens == hits + 64


def test_beside_other_requests_and_through_preemption(tiny_model_dir, full_forward):
    """Scoring requests in a batch of plain ones, with a KV cache so small that sequences are
    preempted and recomputed: every score equals the reference, the plain requests' tokens equal
    their solo tokens, and only the requests that asked carry prompt logprobs."""
    prompts = random_prompts([150, 90, 130, 40, 120, 70], seed=4)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    scoring = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=2)
    solo = {f"r{i}": run_all(make_engine(tiny_model_dir), {"x": (p, greedy)})[0]["x"].outputs[0].token_ids for i, p in enumerate(prompts)}
    tight = make_engine(tiny_model_dir, kv_cache_bytes=40 * 16 * 512, max_num_batched_tokens=64)

    merged, carried = run_all(tight, {f"r{i}": (p, scoring if i % 2 == 0 else greedy) for i, p in enumerate(prompts)})

    assert tight.stats().num_preemptions > 0
    for i, prompt in enumerate(prompts):
        out = merged[f"r{i}"]
        assert out.outputs[0].token_ids == solo[f"r{i}"]
        if i % 2 == 0:
            assert carried[f"r{i}"] == 1
            assert_matches_reference(out.prompt_logprobs, prompt, full_forward(prompt), k=2)
        else:
            assert carried[f"r{i}"] == 0 and out.prompt_logprobs is None
    assert tight.stats().num_free_blocks == tight.stats().num_blocks


def test_a_step_without_scoring_requests_runs_the_lm_head_on_sampling_rows_only(tiny_model_dir, monkeypatch):
    engine = make_engine(tiny_model_dir)
    rows: list[int] = []
    compute_logits = engine.model.compute_logits
    monkeypatch.setattr(engine.model, "compute_logits", lambda hidden: rows.append(hidden.shape[0]) or compute_logits(hidden))
    prompts = random_prompts([30, 20], seed=5)

    run_all(engine, {"a": (prompts[0], SamplingParams(temperature=0, max_tokens=3)), "b": (prompts[1], SamplingParams(temperature=0, max_tokens=3))})
    plain = list(rows)
    rows.clear()
    run_all(engine, {"a": (prompts[0], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0)),
                     "b": (prompts[1], SamplingParams(temperature=0, max_tokens=3))})

    assert plain == [2, 2, 2]  # one row per sequence that samples
    assert rows == [2 + 29, 2, 2]  # the scoring prompt's positions 0..28 join its first step


def test_max_tokens_0_scores_the_prompt_and_generates_nothing(tiny_model_dir, full_forward):
    prompt = random_prompts([33], seed=6)[0]
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=16)

    merged, carried = run_all(engine, {
        "one": (prompt, SamplingParams(max_tokens=0, prompt_logprobs=1)),
        "two": (prompt, SamplingParams(max_tokens=0, n=2, prompt_logprobs=1)),
        "bare": (prompt, SamplingParams(max_tokens=0)),
    })

    for request_id, n in (("one", 1), ("two", 2), ("bare", 1)):
        out = merged[request_id]
        assert out.finished
        assert [(c.index, c.token_ids, c.text, c.finish_reason) for c in out.outputs] == [(i, [], "", "length") for i in range(n)]
    for request_id in ("one", "two"):
        assert_matches_reference(merged[request_id].prompt_logprobs, prompt, full_forward(prompt), k=1)
        assert carried[request_id] == 1
    assert merged["bare"].prompt_logprobs is None
    assert engine.stats().num_generated_tokens == 0
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_a_one_token_prompt_has_no_scores_and_a_continued_request_computes_none(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1, ignore_eos=True)
    merged, carried = run_all(engine, {"one": ([17], params)})
    assert merged["one"].prompt_logprobs == [] and carried["one"] == 1

    prompt = random_prompts([20], seed=7)[0]
    engine.add_request("continued", params=params, prompt_token_ids=prompt, prior_output_token_ids=[5])
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.prompt_logprobs for o in outs] == [None] * len(outs)
