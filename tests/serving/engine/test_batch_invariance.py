"""Batch-invariant mode (EngineConfig.deterministic): a request's numbers do not depend on how
its steps were put together. Per op (the linear kernel, row by row), then through the engine on
the tiny model (exact logprobs) and, marked slow, on the real default model in bf16: the issue's
20 prompts cold, prefix-cached, in a batch of 32, chunked and after a KV hand-off."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from serving.engine import EngineConfig, LLMEngine, SamplingParams
from tests.kernel_paths import native_kernels_or_skip
from tests.serving.engine.test_engine import random_prompts


@pytest.fixture(autouse=True)
def _native_kernels():
    """Batch-invariant mode needs the native CPU kernels: without them every test here skips,
    and the summary's kernel paths line says the path went untested."""
    native_kernels_or_skip()


# SmolLM2-135M's linear layers, [N, K]: qkv, o, gate|up, down, lm_head.
SMOLLM2_LINEARS = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


KERNELS = [
    pytest.param("packed", torch.bfloat16, id="packed-bf16"),
    pytest.param("small_m", torch.bfloat16, id="small_m-bf16"),
    pytest.param("small_m", torch.float32, id="small_m-fp32"),
]


@pytest.mark.parametrize(("kernel", "dtype"), KERNELS)
@pytest.mark.parametrize("shape", SMOLLM2_LINEARS + [(40, 33)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_linear_row_does_not_depend_on_the_other_rows(kernel, dtype, shape):
    """Row i of x @ W^T is bitwise the same computed alone or among M rows, for M across the row
    tiles (6 packed, 8 small_m) and 64-column weight blocks (and an odd K and N: the tails)."""
    kernels = native_kernels_or_skip(packed=kernel == "packed")
    n, k = shape
    gen = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if n == 40 else None
    x = torch.randn(70, k, generator=gen).to(dtype)
    if kernel == "packed":
        packed = kernels.pack_linear_weight(w)
        run = lambda rows: kernels.packed_linear(rows, packed, n, bias)  # noqa: E731
    else:
        run = lambda rows: kernels.small_m_linear(rows, w, bias)  # noqa: E731
    alone = torch.cat([run(x[i : i + 1]) for i in range(70)])
    for rows in (2, 5, 6, 7, 8, 9, 13, 17, 64, 70):
        assert torch.equal(run(x[:rows]), alone[:rows]), rows
    # the values are the product: within rounding of a float64 reference
    reference = x.double() @ w.double().T + (0 if bias is None else bias.double())
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert torch.allclose(alone.double(), reference, atol=tolerance, rtol=tolerance)


def _engine(model_dir, **overrides) -> LLMEngine:
    config = dict(model=str(model_dir), dtype="bfloat16", kv_cache_bytes=16 * 2**20, deterministic=True)
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


def _run(engine: LLMEngine, prompts, params) -> list[tuple[list[int], list[float]]]:
    outs = engine.generate(prompts, params)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


def _handed_off(prefill: LLMEngine, decode: LLMEngine, prompt, params: SamplingParams):
    """The P/D split: the prefill engine samples the first token and exports the prompt's KV;
    the decode engine imports it and continues."""
    prefill.add_request("x", params=dataclasses.replace(params, max_tokens=1), prompt_token_ids=prompt, hold_kv=True)
    (first,) = [o for o in prefill.step() if o.finished]
    payload = prefill.export_kv("x")
    decode.add_request(
        "x", params=params, prompt_token_ids=prompt, kv_payload=payload,
        prior_output_token_ids=first.outputs[0].token_ids,
    )
    tokens = list(first.outputs[0].token_ids)
    logprobs = [lp.logprob for lp in first.outputs[0].logprobs]
    while decode.has_unfinished_requests():
        for out in decode.step():
            tokens += out.outputs[0].token_ids
            logprobs += [lp.logprob for lp in out.outputs[0].logprobs or []]
    return tokens, logprobs


def _scenarios(model_dir, prompts, others, params_of, **engine_overrides) -> dict[str, list]:
    """Each prompt's (tokens, logprobs) in the five placements of the issue; `params_of(i)` gives
    prompt i's sampling parameters."""
    n = len(prompts)
    cold_engine = _engine(model_dir, enable_prefix_caching=False, **engine_overrides)
    results = {"cold": [_run(cold_engine, [p], params_of(i))[0] for i, p in enumerate(prompts)]}

    warm = _engine(model_dir, **engine_overrides)
    _run(warm, prompts, [params_of(i) for i in range(n)])  # the cache filled in one batch
    cached = []
    for i, p in enumerate(prompts):
        hits = warm.stats().prefix_cache_hit_tokens
        cached.append(_run(warm, [p], params_of(i))[0])
        assert warm.stats().prefix_cache_hit_tokens - hits >= 16, "the second run reads its prefix from the cache"
    results["prefix-cached"] = cached

    batch_engine = _engine(model_dir, enable_prefix_caching=False, **engine_overrides)
    batch = prompts + others
    results["batch"] = _run(batch_engine, batch, [params_of(i) for i in range(len(batch))])[:n]

    chunked_engine = _engine(model_dir, enable_prefix_caching=False, max_num_batched_tokens=13, **engine_overrides)
    results["chunked"] = _run(chunked_engine, prompts, [params_of(i) for i in range(n)])

    prefill = _engine(model_dir, enable_prefix_caching=False, **engine_overrides)
    decode = _engine(model_dir, enable_prefix_caching=False, **engine_overrides)
    results["kv-handoff"] = [_handed_off(prefill, decode, p, params_of(i)) for i, p in enumerate(prompts)]
    return results


def _greedy(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)


def _seeded(i: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=16, ignore_eos=True, logprobs=0)


@pytest.mark.parametrize("params_of", [_greedy, _seeded], ids=["greedy", "seeded"])
def test_tiny_model_logprobs_identical_in_every_placement(tiny_model_dir, params_of):
    """bf16, tiny model: the same tokens and bitwise the same logprobs cold, prefix-cached, in a
    batch with others, chunked 13 tokens a step, and after a KV hand-off."""
    prompts = random_prompts([40, 75, 33, 18], seed=3)
    others = random_prompts([5, 120, 64, 9], seed=4)
    results = _scenarios(tiny_model_dir, prompts, others, params_of)
    for name, got in results.items():
        assert got == results["cold"], name


def test_deterministic_off_or_unsupported_runs_the_usual_path(tiny_model_dir, caplog):
    assert _engine(tiny_model_dir).model.is_batch_invariant
    assert "batch-invariant" in _engine(tiny_model_dir).stats().linear_path
    assert not _engine(tiny_model_dir, deterministic=False).model.is_batch_invariant
    with caplog.at_level(logging.WARNING, logger="serving.engine.modeling.model"):
        engine = _engine(tiny_model_dir, dtype="float16")
    assert not engine.model.is_batch_invariant
    assert "native linear kernel runs bf16 and fp32, not torch.float16" in caplog.text


class _Kernels:
    def __init__(self, packed: bool):
        self.packed = packed

    def has_packed_linear(self) -> bool:
        return self.packed


@pytest.mark.parametrize(
    ("setting", "dtype", "packed", "amx", "speculative", "on", "why"),
    [
        ("auto", torch.bfloat16, True, False, False, True, "on (auto: bf16 with AVX512-BF16 and no AMX"),
        ("auto", torch.bfloat16, True, True, False, False, "off (auto: this CPU has AMX"),
        ("auto", torch.bfloat16, True, True, True, True, "on (auto: speculative decoding needs verify rows"),
        ("auto", torch.bfloat16, False, False, True, False, "off (auto: no AVX512-BF16 here"),
        ("auto", torch.float32, True, False, True, False, "off (auto: fp32 runs the usual path"),
        (True, torch.bfloat16, True, True, False, True, "on (deterministic: true)"),
        (True, torch.float32, False, False, False, True, "on (deterministic: true)"),
        (False, torch.bfloat16, True, False, True, False, "off (deterministic: false)"),
        ("auto", torch.float16, True, False, False, False, "off: the native linear kernel runs bf16 and fp32"),
    ],
)
def test_auto_is_on_only_where_it_was_measured_to_cost_nothing(monkeypatch, setting, dtype, packed, amx, speculative,
                                                                on, why):
    """deterministic: auto (the default) turns the mode on for bf16 on a CPU with AVX512-BF16 and
    no AMX (the packed kernel's cost there: docs/benchmarks.md), and on AMX too for an engine that
    speculates (greedy output must equal decoding without it); true forces it wherever the kernels
    run, false never. The reason is what the engine logs and reports (stats)."""
    from serving.engine.modeling import batch_invariance as invariance

    monkeypatch.setattr(invariance, "cpu_has_amx", lambda: amx)
    got_on, got_why = invariance.batch_invariance(setting, torch.device("cpu"), dtype, _Kernels(packed),
                                                  speculative=speculative)
    assert (got_on, got_why.startswith(why)) == (on, True), got_why


def _auto_is_on_here() -> bool:
    from serving.engine.modeling.batch_invariance import batch_invariance
    from serving.engine.modeling.cpu_kernels import native_kernels

    return batch_invariance("auto", torch.device("cpu"), torch.bfloat16, native_kernels())[0]


@pytest.mark.slow
@pytest.mark.parametrize("params_of", [_greedy, _seeded], ids=["greedy", "seeded"])
def test_default_model_bf16_same_tokens_in_every_placement(default_model_dir, params_of):
    """The issue's check on the real default model in bf16: 20 prompts cold, prefix-cached, in a
    batch of 32 (the 20 and 12 others), prefilled 13 tokens a step, and after a KV hand-off give
    identical greedy tokens and identical seeded samples (and bitwise logprobs). Where the default
    (deterministic: auto) turns the mode on, the engines run the default; elsewhere true."""
    from transformers import AutoTokenizer

    from tests.serving.engine.test_model_parity import PROMPTS, chat_ids

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    texts = PROMPTS + [f"Tell me one fact about the number {i}." for i in range(21)]
    ids = [chat_ids(tokenizer, t) for t in texts]
    prompts, others = ids[:20], ids[20:32]
    setting = "auto" if _auto_is_on_here() else True
    assert _engine(default_model_dir, kv_cache_bytes=16 * 2**20, deterministic=setting).model.is_batch_invariant
    results = _scenarios(default_model_dir, prompts, others, params_of, kv_cache_bytes=64 * 2**20,
                         deterministic=setting)
    for name, got in results.items():
        mismatched = [i for i, (a, b) in enumerate(zip(got, results["cold"])) if a != b]
        assert not mismatched, f"{name}: prompts {mismatched} differ from cold"


# ---- speculative decoding, bitwise ------------------------------------------------------------
def _spec(engine_overrides: dict | None = None, **spec) -> dict:
    return {"speculative": {"num_speculative_tokens": 4, "adaptive": False, **spec}, **(engine_overrides or {})}


@pytest.mark.parametrize("params_of", [_greedy, _seeded], ids=["greedy", "seeded"])
def test_tiny_model_speculation_gives_bitwise_the_tokens_and_logprobs_of_one_token_a_step(tiny_model_dir, params_of):
    """With deterministic on, a verify row is computed as the decode row of its position would be,
    so speculation changes no logit: in bf16 the tokens and logprobs are bitwise those without it
    (speculative.py: off deterministic, a near-tie can flip). The oracle proposes each output's
    continuation, its last guesses wrong."""
    from tests.serving.engine.test_speculative import OracleProposer

    prompts = random_prompts([40, 75, 33, 18], seed=3)
    params = [params_of(i) for i in range(len(prompts))]
    plain = _run(_engine(tiny_model_dir), prompts, params)
    engine = _engine(tiny_model_dir, **_spec())
    engine.speculator.proposer = OracleProposer(prompts, [tokens for tokens, _ in plain], k=4)
    assert _run(engine, prompts, params) == plain
    assert 0 < engine.speculator.num_accepted_tokens < engine.speculator.num_proposed_tokens


@pytest.mark.slow
@pytest.mark.parametrize("params_of", [_greedy, _seeded], ids=["greedy", "seeded"])
def test_default_model_bf16_speculation_changes_no_token(default_model_dir, params_of):
    """The real default model in bf16, n-gram speculation on vs off, deterministic on: a text to
    repeat (proposals accepted) and free-form questions, alone and in one batch: the same tokens
    and bitwise the same logprobs."""
    from transformers import AutoTokenizer

    from tests.serving.engine.test_model_parity import PROMPTS, chat_ids

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    text = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat by the door."
    prompts = [chat_ids(tokenizer, f"Repeat this text exactly: {text}")] + [chat_ids(tokenizer, t) for t in PROMPTS[:5]]
    params = [dataclasses.replace(params_of(i), max_tokens=32) for i in range(len(prompts))]
    plain = _run(_engine(default_model_dir, kv_cache_bytes=64 * 2**20), prompts, params)
    engine = _engine(default_model_dir, **_spec({"kv_cache_bytes": 64 * 2**20}))
    assert _run(engine, prompts, params) == plain  # one batch
    assert [_run(engine, [p], [q])[0] for p, q in zip(prompts, params)] == plain  # alone
    assert engine.speculator.num_accepted_tokens > 0
