"""Greedy token-for-token parity with transformers, and last-position logits within 1e-3 (fp32)."""

from __future__ import annotations

import pytest
import torch

from serving.engine import EngineConfig, LLMEngine, ModelLoadError, SamplingParams
from tests.helpers import build_tiny_model

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child in two sentences.",
    "List three prime numbers greater than 100.",
    "def fibonacci(n):",
    "Translate 'good morning' into Spanish, French and German.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "写一首关于月亮的短诗。",
    "Summarise the plot of Romeo and Juliet 🎭 in one paragraph.",
    "What is 17 * 23? Show your work.",
]


def hf_greedy(model, prompt_ids: list[int], num_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Plain transformers greedy decoding with its KV cache, never stopping at EOS."""
    from transformers import DynamicCache

    past = DynamicCache(config=model.config)
    ids = torch.tensor([prompt_ids])
    out: list[int] = []
    first_logits = None
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = model(input_ids=ids, past_key_values=past, use_cache=True).logits[0, -1]
            if first_logits is None:
                first_logits = logits.float()
            token = int(logits.argmax())
            out.append(token)
            ids = torch.tensor([[token]])
    return out, first_logits


def engine_greedy(engine: LLMEngine, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in engine.generate(prompts, params)]


def engine_first_logits(engine: LLMEngine, prompt_ids: list[int]) -> torch.Tensor:
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0)
    engine.add_request("logits-probe", params=params, prompt_token_ids=prompt_ids)
    sched = engine.scheduler.schedule()
    step = engine.runner.prepare(sched.scheduled)
    logits = engine.runner.execute(step)[0]
    engine.abort_request("logits-probe")
    engine.step()
    return logits


def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if not isinstance(ids, list) else ids)


@pytest.mark.slow
def test_default_model_greedy_parity_fp32(default_model_dir):
    from transformers import AutoModelForCausalLM

    engine = LLMEngine(EngineConfig(dtype="float32", kv_cache_bytes=256 * 2**20))
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    prompts = [chat_ids(engine.tokenizer, p) for p in PROMPTS]
    ours = engine_greedy(engine, prompts, 64)
    for prompt, got in zip(prompts, ours):
        expected, hf_logits = hf_greedy(hf, prompt, 64)
        assert got == expected, engine.tokenizer.decode(prompt)
    # last-position logits of the prompt
    for prompt in prompts[:3]:
        _, hf_logits = hf_greedy(hf, prompt, 1)
        diff = (engine_first_logits(engine, prompt) - hf_logits).abs().max().item()
        assert diff < 1e-3


TINY_VARIANTS = {
    "llama-gqa-untied": dict(num_heads=4, num_kv_heads=2),
    "llama-mha-tied": dict(num_heads=4, num_kv_heads=4, tie_word_embeddings=True),
    "llama-mqa": dict(num_heads=4, num_kv_heads=1),
    "llama-rope-linear": dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "llama-rope-llama3": dict(
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
        }
    ),
    "qwen2-bias": dict(architecture="qwen2", num_heads=4, num_kv_heads=2),
    "qwen3-qk-norm": dict(architecture="qwen3", num_heads=4, num_kv_heads=2),
    "qwen3-mqa-tied": dict(architecture="qwen3", num_heads=4, num_kv_heads=1, tie_word_embeddings=True, head_dim=16),
    "phi3-fused": dict(architecture="phi3", num_heads=4, num_kv_heads=2),
    "phi3-mha": dict(architecture="phi3", num_heads=4, num_kv_heads=4),
    # RoPE over half of each head (Phi-4-mini turns 3/4): the engine reorders q/k head dims
    "phi3-partial-rotary": dict(architecture="phi3", rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    "phi3-partial-rotary-window-mqa": dict(architecture="phi3", sliding_window=40, num_kv_heads=1, rope_parameters={
        "rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.75}),
    # sliding windows shorter than the prompts and the 64 tokens generated (300 + 64 positions)
    "mistral-window-24": dict(architecture="mistral", sliding_window=24),
    "mistral-window-100": dict(architecture="mistral", sliding_window=100, num_kv_heads=1),
    "qwen2-window-layer-1": dict(architecture="qwen2", sliding_window=20, max_window_layers=1),
    "qwen3-window-all": dict(architecture="qwen3", sliding_window=33, max_window_layers=0),
    "phi3-window-40": dict(architecture="phi3", sliding_window=40),
    "gemma2-softcap": dict(architecture="gemma2", num_layers=3),
    "gemma3-local-global": dict(architecture="gemma3", num_layers=3),
    "gemma3-mqa-window-100": dict(architecture="gemma3", num_layers=3, num_kv_heads=1, sliding_window=100),
}


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_tiny_models_greedy_and_logits_parity(variant, tmp_path, default_model_dir):
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path / variant, default_model_dir, **TINY_VARIANTS[variant])
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", kv_cache_bytes=8 * 2**20))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 37, 300)]
    ours = engine_greedy(engine, prompts, 64)
    for prompt, got in zip(prompts, ours):
        expected, hf_logits = hf_greedy(hf, prompt, 64)
        assert got == expected
        diff = (engine_first_logits(engine, prompt) - hf_logits).abs().max().item()
        assert diff < 1e-3


def test_unknown_architecture_is_named(tmp_path, tiny_model_dir):
    import json
    import shutil

    model_dir = tmp_path / "gpt"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                       "MistralForCausalLM, Phi3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM"):
        LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", kv_cache_bytes=2**20))


def test_missing_model_says_what_is_accepted():
    with pytest.raises(ModelLoadError, match="neither a built-in name"):
        LLMEngine(EngineConfig(model="/nonexistent/model", kv_cache_bytes=2**20))


@pytest.mark.slow
def test_gguf_file_path_is_converted_once_and_cached(tmp_path, monkeypatch, default_model_dir):
    from serving.engine.modeling.loader import _builtin_gguf, resolve_model_dir

    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))
    gguf = _builtin_gguf("smollm2-135m-instruct")
    converted = resolve_model_dir(str(gguf))
    assert converted.parent == tmp_path / "models" and (converted / "model.safetensors").is_file()
    assert resolve_model_dir(str(gguf)) == converted  # second call: the cache, no conversion
    engine = LLMEngine(EngineConfig(model=str(gguf), dtype="float32", kv_cache_bytes=32 * 2**20))
    reference = LLMEngine(EngineConfig(model=str(default_model_dir), dtype="float32", kv_cache_bytes=32 * 2**20))
    prompt = chat_ids(engine.tokenizer, PROMPTS[0])
    assert engine_greedy(engine, [prompt], 16) == engine_greedy(reference, [prompt], 16)


@pytest.mark.slow
def test_default_model_bf16_answers_and_tracks_fp32(default_model_dir):
    """bf16 runs the native bf16 kernels (GEMV, decode attention where the CPU has them): its
    first-step logits stay within bf16 error of fp32's.

    Which token bf16 picks where fp32's two best are nearly tied is rounding, not correctness: the
    answer to PROMPTS[0] starts with such a tie (fp32: -1.88 against -1.96), and bf16 picks one or
    the other depending on the CPU's bf16 path (oneDNN packed on AVX-512, plain on AVX2)."""
    bf16 = LLMEngine(EngineConfig(dtype="bfloat16", kv_cache_bytes=64 * 2**20))
    fp32 = LLMEngine(EngineConfig(dtype="float32", kv_cache_bytes=64 * 2**20))
    prompt = chat_ids(bf16.tokenizer, PROMPTS[0])
    # decode steps (one token, batch of 1 and of 4) exercise the decode kernel and the GEMV
    batch = [prompt, chat_ids(bf16.tokenizer, PROMPTS[1]), chat_ids(bf16.tokenizer, PROMPTS[6]), prompt[:20]]
    lp_bf16 = [o.outputs[0].logprobs for o in bf16.generate(batch, SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True))]
    lp_fp32 = [o.outputs[0].logprobs for o in fp32.generate(batch, SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True))]
    for a, b in zip(lp_bf16, lp_fp32):
        (first, first_lp), (second, second_lp) = b[0].top[:2]
        if first_lp - second_lp > 0.3:
            assert a[0].token_id == first
        else:  # a near-tie: either of the two
            assert a[0].token_id in (first, second)
        # while the tokens agree, the chosen token's logprob agrees to bf16 accuracy: bf16's logits
        # lie on a grid of 0.125 between 16 and 32 (8 bits of mantissa), so their rounding alone
        # moves a logprob by up to one step (the logit half a step, the normaliser half), and the
        # 30 layers' bf16 arithmetic adds about as much again. Two steps: a near-tie at -1.88 read
        # -1.71 on one Xeon with AMX (0.17), where a wrong kernel is off by whole units.
        for x, y in zip(a, b):
            if x.token_id != y.token_id:
                break
            assert abs(x.logprob - y.logprob) < 0.25


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'.*supported: silu"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.1875}},
         "partial_rotary_factor 0.1875 .* gives a RoPE over 3 of 16 head dims; supported: an even number"),
    ],
    ids=["hidden_act", "partial_rotary_factor"],
)
def test_a_config_the_engine_cannot_run_is_refused_naming_the_field(tmp_path, default_model_dir, change, named):
    import json

    model_dir = build_tiny_model(tmp_path / "phi3", default_model_dir, architecture="phi3")
    config = json.loads((model_dir / "config.json").read_text())
    config.update(change)
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=named):
        LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", kv_cache_bytes=2**20))


@pytest.mark.parametrize("placement", ["chunked", "prefix-cached", "deterministic"])
def test_sliding_window_holds_across_chunks_and_the_prefix_cache(tmp_path, default_model_dir, placement):
    """A windowed model (Mistral, window 24) prefilled 13 tokens a step, or reading 288 of its 300
    prompt tokens from the prefix cache, gives transformers' greedy tokens: each chunk's mask and
    each decode row see exactly the window, wherever the keys came from. In batch-invariant mode
    every token attends through the decode kernel's window."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path / "mistral", default_model_dir, architecture="mistral", sliding_window=24)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 49152, (300,), generator=gen).tolist()
    expected, _ = hf_greedy(hf, prompt, 32)
    config = dict(model=str(model_dir), dtype="float32", kv_cache_bytes=8 * 2**20)
    if placement == "chunked":
        engine = LLMEngine(EngineConfig(**config, max_num_batched_tokens=13))
    elif placement == "prefix-cached":
        engine = LLMEngine(EngineConfig(**config))
        engine_greedy(engine, [prompt[:290] + [7] * 10], 1)
        hits = engine.stats().prefix_cache_hit_tokens
        assert engine_greedy(engine, [prompt], 32)[0] == expected
        assert engine.stats().prefix_cache_hit_tokens - hits == 288  # 18 full blocks of 16
        return
    else:
        engine = LLMEngine(EngineConfig(**config, deterministic=True))
        assert engine.model.is_batch_invariant
    assert engine_greedy(engine, [prompt], 32)[0] == expected


def windowed_run(engine: LLMEngine, prompt: list[int]) -> tuple[list[int], int]:
    """64 greedy tokens after `prompt`, and the most blocks in use at the end of any step."""
    engine.add_request("w", params=SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), prompt_token_ids=prompt)
    got, most_used = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            got += out.outputs[0].token_ids
        stats = engine.stats()
        most_used = max(most_used, stats.num_blocks - stats.num_free_blocks)
    return got, most_used


def test_a_windowed_model_keeps_only_its_window_of_blocks(tmp_path, default_model_dir):
    """Every layer windowed (Mistral, 24 tokens): a sequence gives back the blocks its window has
    passed, so a 300-token prompt and 64 generated tokens run in a KV cache of 8 blocks (128
    tokens), prefilled 32 tokens a step, with transformers' greedy tokens; the context window is
    not capped to the cache, and every block is free at the end."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path / "mistral", default_model_dir, architecture="mistral", sliding_window=24)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt = torch.randint(3, 49152, (300,), generator=torch.Generator().manual_seed(9)).tolist()
    expected, _ = hf_greedy(hf, prompt, 64)
    # 2 layers x 2 KV heads x 16 dims x K and V x 4 bytes = 512 bytes a token: 8 blocks of 16
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", kv_cache_bytes=8 * 16 * 512,
                                    max_num_batched_tokens=32))
    assert engine.stats().num_blocks == 8 and engine.max_model_len == 2048
    got, most_used = windowed_run(engine, prompt)
    assert got == expected
    assert engine.stats().num_preemptions == 0
    assert most_used <= 5  # (24 + 32) / 16 rounded up, plus the block a window starts in
    assert engine.stats().num_free_blocks == 8


@pytest.mark.slow
def test_gemma3_270m_checkpoint_greedy_and_logits_parity(tmp_path):
    """The real Gemma 3 270M (Q4_K_M GGUF, dequantised on conversion), where `make gemma3` put it:
    greedy tokens and last logits against transformers on the same converted weights."""
    from transformers import AutoModelForCausalLM

    from tests.helpers import gemma3_270m_gguf

    gguf = gemma3_270m_gguf(tmp_path)
    if gguf is None:
        pytest.skip("the optional Gemma 3 270M checkpoint is not installed (make gemma3)")
    engine = LLMEngine(EngineConfig(model=str(gguf), dtype="float32", kv_cache_bytes=64 * 2**20))
    assert engine.spec.architecture == "Gemma3ForCausalLM" and sum(w == 0 for w in engine.spec.layer_windows) == 3
    hf = AutoModelForCausalLM.from_pretrained(engine.spec.path, dtype=torch.float32)
    texts = ["The capital of France is", "def fibonacci(n):",
             "<start_of_turn>user\nWrite a haiku about the sea.<end_of_turn>\n<start_of_turn>model\n"]
    for text in texts:
        ids = engine.tokenizer(text)["input_ids"]
        expected, hf_logits = hf_greedy(hf, ids, 32)
        assert engine_greedy(engine, [ids], 32)[0] == expected, text
        assert (engine_first_logits(engine, ids) - hf_logits).abs().max().item() < 1e-3

