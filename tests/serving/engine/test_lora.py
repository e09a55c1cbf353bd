"""Multi-LoRA (lora.py): PEFT adapters made here with `peft` on the tiny random model, served
mixed in one batch with the base model; each adapter's greedy output equals PEFT's merged model's.
Slots and eviction, prefix-cache isolation, and adapters refused at load naming file and field."""

from __future__ import annotations

import json
import time

import pytest
import torch

from serving.engine import EngineConfig, InvalidRequestError, LLMEngine, ModelLoadError, SamplingParams
from tests.helpers import wait_until
from tests.kernel_paths import native_kernels_or_skip
from tests.serving.engine.test_model_parity import hf_greedy

peft = pytest.importorskip("peft")

# name -> (rank, alpha, target modules, rslora)
ADAPTERS = {
    "attn-qv": (8, 16, ["q_proj", "v_proj"], False),
    "all-rslora": (4, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
    "mlp-r16": (16, 16, ["gate_proj", "up_proj", "down_proj"], False),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def assert_greedy_agrees(reference, prompt: list[int], tokens: list[int], tie: float = 1e-3) -> None:
    """`tokens` are the reference model's greedy tokens, followed token by token. The engine adds
    an adapter's product to the base output where PEFT's merged model adds it to the weight: the
    logits agree to ~1e-5 (not bitwise), so at a near-tie (top two within `tie`) either token is
    the model's, and past it the two continuations may part."""
    ids = list(prompt)
    with torch.no_grad():
        for j, token in enumerate(tokens):
            logits = reference(torch.tensor([ids])).logits[0, -1]
            top = logits.topk(2)
            if int(top.indices[0]) != token:
                gap = float(top.values[0] - top.values[1])
                assert token == int(top.indices[1]) and gap < tie, f"token {j}: {token} where the model's is {int(top.indices[0])} (gap {gap})"
                return
            ids.append(token)


def make_adapter(base_dir, out_dir, rank, alpha, targets, rslora, seed):
    """A PEFT LoRA adapter with random A and B (not PEFT's zero B), saved; and its merged model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False)
    model = get_peft_model(base, config)
    with torch.no_grad():  # large enough to change what the tiny model says
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.mul_(3.0)
    model.save_pretrained(out_dir)
    return model.merge_and_unload()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("loras")
    made = {}
    for seed, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        merged = make_adapter(tiny_model_dir, root / name, rank, alpha, targets, rslora, seed)
        made[name] = (str(root / name), merged)
    return made


def hand_off(prefill: LLMEngine, decode: LLMEngine, prompt: list[int], lora: str):
    """P/D with an adapter: `prefill` computes the prompt and its first token and exports its KV;
    `decode` imports it and continues greedily. The tokens, the payload and the first output."""
    prefill.add_request("x", params=SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                        prompt_token_ids=prompt, hold_kv=True, lora_name=lora)
    (first,) = [o for o in prefill.step() if o.finished]
    payload = prefill.export_kv("x")
    decode.add_request("x", params=GREEDY, prompt_token_ids=prompt, kv_payload=payload,
                       prior_output_token_ids=first.outputs[0].token_ids, lora_name=lora)
    tokens = list(first.outputs[0].token_ids)
    while decode.has_unfinished_requests():
        for out in decode.step():
            tokens += out.outputs[0].token_ids
    return tokens, payload, first


def engine_with(model_dir, adapters, **lora) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(model_dir), dtype="float32", kv_cache_bytes=8 * 2**20,
        lora={"adapters": {name: path for name, (path, _) in adapters.items()}, **lora},
    ))


def run(engine: LLMEngine, requests: list[tuple[str | None, list[int]]]) -> list[list[int]]:
    """All requests in one batch (added before the first step); tokens in request order."""
    for i, (name, prompt) in enumerate(requests):
        engine.add_request(f"r{i}", params=GREEDY, prompt_token_ids=prompt, lora_name=name)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    return [got[f"r{i}"] for i in range(len(requests))]


def test_three_adapters_and_the_base_model_in_one_batch_match_peft_merged(tiny_model_dir, adapters):
    from transformers import AutoModelForCausalLM

    engine = engine_with(tiny_model_dir, adapters)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (7, 40, 90, 23)]
    names = [None, *ADAPTERS]
    got = run(engine, list(zip(names, prompts)))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert got[0] == hf_greedy(base, prompts[0], 24)[0]  # the base model's rows: no adapter touches them
    for name, prompt, tokens in zip(names[1:], prompts[1:], got[1:]):
        assert_greedy_agrees(adapters[name][1], prompt, tokens)
        assert tokens[:4] != hf_greedy(base, prompt, 4)[0], name  # the adapter changes what the model says
    # the same adapter on two requests of different lengths, and in other company: its rows give
    # the tokens they gave in the first batch
    again = run(engine, [("attn-qv", prompts[0]), ("attn-qv", prompts[1]), ("mlp-r16", prompts[3])])
    assert_greedy_agrees(adapters["attn-qv"][1], prompts[0], again[0])
    assert again[1:] == [got[1], got[3]]
    assert engine.loras.num_loads == 3 and all(a.num_running == 0 for a in engine.loras.resident.values())


def test_prefix_cache_hits_never_cross_adapters(tiny_model_dir, adapters):
    engine = engine_with(tiny_model_dir, adapters)
    prompt = list(range(100, 164))  # 4 full blocks
    run(engine, [("attn-qv", prompt)])
    for name, hits in ((None, 0), ("mlp-r16", 0), ("attn-qv", 48)):
        before = engine.stats().prefix_cache_hit_tokens
        run(engine, [(name, prompt)])
        assert engine.stats().prefix_cache_hit_tokens - before == hits, name


def test_slots_evict_the_least_recently_used_idle_adapter_never_a_running_one(tiny_model_dir, adapters):
    """Two slots held by running requests: a request for a third adapter waits (counted as
    waiting, nothing loaded), then runs once a slot frees, evicting the idle adapter, with the
    tokens it gives alone; an abort of a waiting request leaves nothing behind."""
    engine = engine_with(tiny_model_dir, adapters, max_loras=2)
    long = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    engine.add_request("a", params=long, prompt_token_ids=[5, 6, 7], lora_name="attn-qv")
    engine.add_request("b", params=long, prompt_token_ids=[5, 6, 7], lora_name="all-rslora")
    engine.step()
    engine.add_request("c", params=GREEDY, prompt_token_ids=[5, 6, 7], lora_name="mlp-r16")
    engine.add_request("w", params=GREEDY, prompt_token_ids=[8, 9], lora_name="mlp-r16")
    engine.abort_request("w")  # gone from the wait, its use never taken
    got: dict[str, list[int]] = {}
    for out in engine.step():
        got.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    assert list(engine.lora_waiting) == ["c"] and engine.stats().num_waiting == 1
    assert list(engine.loras.resident) == ["attn-qv", "all-rslora"] and engine.loras.num_loads == 2
    engine.abort_request("a")
    with pytest.raises(InvalidRequestError, match="unknown adapter 'nope'; registered: all-rslora, attn-qv, mlp-r16"):
        engine.add_request("d", params=long, prompt_token_ids=[5], lora_name="nope")
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    assert list(engine.loras.resident) == ["all-rslora", "mlp-r16"] and engine.loras.num_evictions == 1
    assert got["c"] == run(engine_with(tiny_model_dir, adapters), [("mlp-r16", [5, 6, 7])])[0]
    assert engine.lora_waiting == {} and all(a.num_running == 0 for a in engine.loras.resident.values())


def test_a_base_only_engine_refuses_an_adapter_naming_the_config(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_bytes=2**20))
    with pytest.raises(InvalidRequestError, match="serves no LoRA adapters"):
        engine.add_request("x", params=GREEDY, prompt_token_ids=[5], lora_name="attn-qv")


def _broken(adapters, tmp_path, name, edit):
    import shutil

    path = tmp_path / name
    shutil.copytree(adapters["attn-qv"][0], path)
    edit(path)
    return str(path)


def _config_edit(**changes):
    def edit(path):
        config = json.loads((path / "adapter_config.json").read_text())
        config.update(changes)
        (path / "adapter_config.json").write_text(json.dumps(config))
    return edit


def _wrong_shape(path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "adapter_model.safetensors"))
    key = next(k for k in tensors if k.endswith("q_proj.lora_A.weight"))
    tensors[key] = torch.zeros(8, 33)
    save_file(tensors, str(path / "adapter_model.safetensors"))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda p: (p / "adapter_config.json").unlink(), r"adapter_config.json not found"),
        (lambda p: (p / "adapter_model.safetensors").unlink(), r"adapter_model.safetensors not found"),
        (_config_edit(target_modules=["q_proj", "lm_head"]), r"target_modules has \['lm_head'\]; supported: q_proj"),
        (_config_edit(use_dora=True), r"use_dora is true; not supported"),
        (_config_edit(peft_type="IA3"), r"peft_type is 'IA3'; supported: LORA"),
        (_config_edit(r=4), r"r is 4, but the weights have rank \[8\]"),
        (_wrong_shape, r"layers.0.q_proj: lora_A \(8, 33\) and lora_B \(64, 8\) do not fit the base model: "
                       r"expected \[r, 64\] and \[64, r\]"),
    ],
    ids=["no-config", "no-weights", "unknown-module", "dora", "not-lora", "rank", "shape"],
)
def test_a_bad_adapter_is_refused_at_load_naming_the_file_and_field(tiny_model_dir, adapters, tmp_path, edit, message):
    path = _broken(adapters, tmp_path, "broken", edit)
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_bytes=2**20,
                                    lora={"adapters": {"broken": path}}))
    with pytest.raises(InvalidRequestError, match=message) as info:  # the request's 400, naming model
        engine.add_request("x", params=GREEDY, prompt_token_ids=[5], lora_name="broken")
    assert info.value.param == "model" and isinstance(info.value.__cause__, ModelLoadError)
    assert engine.loras.resident == {} and not engine.has_unfinished_requests()  # nothing half-loaded


def test_an_evicted_adapter_finds_its_cached_prefix_again(tiny_model_dir, adapters):
    """The block hash holds the adapter's name and directory, not its load: after an eviction
    and a reload, its requests hit the blocks it cached before."""
    engine = engine_with(tiny_model_dir, adapters, max_loras=1)
    prompt = list(range(200, 264))
    first = run(engine, [("attn-qv", prompt)])
    run(engine, [("mlp-r16", [5, 6, 7])])  # evicts attn-qv
    before = engine.stats().prefix_cache_hit_tokens
    assert run(engine, [("attn-qv", prompt)]) == first
    assert engine.stats().prefix_cache_hit_tokens - before == 48
    assert engine.loras.num_loads == 3 and engine.loras.num_evictions == 2


def test_a_kv_hand_off_with_an_adapter_continues_as_one_engine_would(tiny_model_dir, adapters):
    """P/D: the prefill engine computes the prompt with the adapter and exports its KV; the decode
    engine imports it and continues with the same adapter: the tokens of one engine alone. A
    decode engine that cannot load the adapter refuses the request, naming `model`."""
    prompt = list(range(300, 340))
    alone = run(engine_with(tiny_model_dir, adapters), [("all-rslora", prompt)])[0]
    tokens, payload, first = hand_off(engine_with(tiny_model_dir, adapters), engine_with(tiny_model_dir, adapters),
                                      prompt, "all-rslora")
    assert tokens == alone
    base_only = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_bytes=8 * 2**20))
    with pytest.raises(InvalidRequestError, match="serves no LoRA adapters") as info:
        base_only.add_request("y", params=GREEDY, prompt_token_ids=prompt, kv_payload=payload,
                              prior_output_token_ids=first.outputs[0].token_ids, lora_name="all-rslora")
    assert info.value.param == "model"


@pytest.mark.parametrize("dtype, packed", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_the_segmented_kernel_adds_each_rows_own_adapter(dtype, packed):
    """lora_segmented (and its bf16 form with B^T packed by pairs) against float64: each listed
    row gets its own slot's (x A^T) B^T, a slot with an empty range and the unlisted rows keep y;
    a row's result does not depend on the other rows listed with it."""
    from serving.engine.modeling.lora import _pack_pairs

    kernels = native_kernels_or_skip(packed=packed)
    gen = torch.Generator().manual_seed(0)
    tokens, fan_in, fan_out = 37, 70, 45  # not multiples of the vector width
    ranks = [16, 0, 4, 33]  # slot 1 leaves this linear alone
    lo = [sum(ranks[:i]) for i in range(len(ranks))]
    ranges = torch.tensor([[start, start + r] for start, r in zip(lo, ranks)], dtype=torch.long)
    x = torch.randn(tokens, fan_in, generator=gen).to(dtype)
    a = (torch.randn(sum(ranks), fan_in, generator=gen) * 0.1).to(dtype)
    bt = (torch.randn(sum(ranks), fan_out, generator=gen) * 0.1).to(dtype)
    y0 = torch.randn(tokens, fan_out, generator=gen).to(dtype)
    rows = torch.tensor([1, 5, 6, 30, 2, 9, 0, 36, 11], dtype=torch.long)  # sorted by slot, below
    slots = torch.tensor([0, 0, 0, 1, 2, 2, 3, 3, 3], dtype=torch.long)

    bp, pair_starts = _pack_pairs([bt[start:end] for start, end in ranges.tolist()])

    def segmented(y, rows, slots):
        if packed:
            kernels.lora_segmented_packed(y, x, a, bp, rows, slots, ranges, pair_starts)
        else:
            kernels.lora_segmented(y, x, a, bt, rows, slots, ranges)

    y = y0.clone()
    segmented(y, rows, slots)
    expected = y0.double().clone()
    for row, slot in zip(rows.tolist(), slots.tolist()):
        start, end = ranges[slot].tolist()
        expected[row] += (x[row].double() @ a[start:end].double().T) @ bt[start:end].double()
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: y rounded once
    assert (y.double() - expected).abs().max().item() < tolerance
    untouched = [r for r in range(tokens) if r not in rows.tolist() or r == 30]
    assert torch.equal(y[untouched], y0[untouched])
    alone = y0.clone()  # row 9 listed alone gives the same bits
    segmented(alone, rows[5:6], slots[5:6])
    assert torch.equal(alone[9], y[9])
    with pytest.raises(RuntimeError, match="row or slot out of range"):
        segmented(y, torch.tensor([tokens]), torch.tensor([0]))


def test_a_request_carrying_an_adapters_path_registers_it_and_a_new_path_waits_for_running_ones(tiny_model_dir, adapters):
    """What a worker does with an adapter loaded at run time: the first request naming it brings
    its path; the same name with another path replaces it once no running request uses it."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_bytes=8 * 2**20, lora={}))
    prompt = list(range(40, 60))
    engine.add_request("a", params=GREEDY, prompt_token_ids=prompt, lora_name="late", lora_path=adapters["attn-qv"][0])
    assert engine.loras.paths == {"late": adapters["attn-qv"][0]} and engine.loras.resident["late"].num_running == 1
    with pytest.raises(InvalidRequestError, match="'late' is being replaced .* 1 running request") as info:
        engine.add_request("b", params=GREEDY, prompt_token_ids=prompt, lora_name="late", lora_path=adapters["mlp-r16"][0])
    assert info.value.param == "model"
    got = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            got += out.outputs[0].token_ids
    assert_greedy_agrees(adapters["attn-qv"][1], prompt, got)
    engine.add_request("c", params=GREEDY, prompt_token_ids=prompt, lora_name="late", lora_path=adapters["mlp-r16"][0])
    got = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            got += out.outputs[0].token_ids
    assert_greedy_agrees(adapters["mlp-r16"][1], prompt, got)
    with pytest.raises(InvalidRequestError, match="adapter_config.json not found") as info:
        engine.check_adapter("x", "/nonexistent")
    assert info.value.param == "lora_path"


@pytest.mark.slow
def test_the_default_model_with_three_adapters_and_the_base_in_one_batch_matches_peft_merged(tmp_path, default_model_dir):
    """The same check on the real SmolLM2-135M (fp32): 3 PEFT adapters with random weights (fixed
    seeds) and the base model in one batch, each following its merged model's greedy tokens."""
    from transformers import AutoModelForCausalLM

    from tests.serving.engine.test_model_parity import PROMPTS, chat_ids

    made = {}
    for seed, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        merged = make_adapter(default_model_dir, tmp_path / name, rank, alpha, targets, rslora, seed + 100)
        made[name] = (str(tmp_path / name), merged)
    engine = LLMEngine(EngineConfig(model=str(default_model_dir), dtype="float32", kv_cache_bytes=64 * 2**20,
                                    lora={"adapters": {name: path for name, (path, _) in made.items()}}))
    prompts = [chat_ids(engine.tokenizer, text) for text in PROMPTS[:4]]
    names = [None, *ADAPTERS]
    got = run(engine, list(zip(names, prompts)))
    base = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    assert got[0] == hf_greedy(base, prompts[0], 24)[0]
    for name, prompt, tokens in zip(names[1:], prompts[1:], got[1:]):
        assert_greedy_agrees(made[name][1], prompt, tokens)
        assert tokens != hf_greedy(base, prompt, 24)[0], name  # the adapter changes what the model says


def test_the_engine_reports_its_resident_adapters_and_load_time_for_the_routers(tiny_model_dir, adapters):
    engine = engine_with(tiny_model_dir, adapters, max_loras=2)
    assert (engine.stats().lora_resident, engine.stats().lora_load_s) == ((), 0.0)
    run(engine, [("attn-qv", [5, 6, 7]), ("mlp-r16", [8, 9])])
    run(engine, [("all-rslora", [5, 6, 7])])  # evicts attn-qv, the least recently used
    stats = engine.stats()
    assert set(stats.lora_resident) == {"mlp-r16", "all-rslora"} and stats.lora_load_s > 0


def test_an_adapter_on_a_partial_rope_model_follows_peft_merged(tmp_path, tokenizer_dir):
    """Phi-3 with RoPE over half of each head: the engine keeps q/k head dims in its own order
    (ModelSpec.rope_permutation), and an adapter's q/k outputs are reordered alike."""
    from tests.helpers import build_tiny_model
    from tests.serving.engine.test_model_parity import TINY_VARIANTS

    model_dir = build_tiny_model(tmp_path / "phi3", tokenizer_dir, **TINY_VARIANTS["phi3-partial-rotary"])
    merged = make_adapter(model_dir, tmp_path / "qkv", 8, 16, ["qkv_proj", "o_proj"], False, seed=16)
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", kv_cache_bytes=8 * 2**20,
                                    lora={"adapters": {"qkv": str(tmp_path / "qkv")}}))
    prompt = list(range(700, 760))
    (tokens,) = run(engine, [("qkv", prompt)])
    assert_greedy_agrees(merged, prompt, tokens)


def test_waiting_for_a_slot_is_first_come_first_served_and_ends_after_max_queue_wait(tiny_model_dir, adapters):
    """While a request waits for a slot, a later one for a resident adapter goes behind it (so
    the slots drain to it); a wait past max_queue_wait_s ends the request as the queue's does."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_bytes=8 * 2**20,
                                    max_queue_wait_s=0.5,
                                    lora={"adapters": {n: p for n, (p, _) in adapters.items()}, "max_loras": 1}))
    long = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
    engine.add_request("a", params=long, prompt_token_ids=[5, 6, 7], lora_name="attn-qv")
    engine.step()
    queued_at = time.monotonic()
    engine.add_request("c", params=GREEDY, prompt_token_ids=[5, 6, 7], lora_name="mlp-r16")
    engine.add_request("a2", params=GREEDY, prompt_token_ids=[8, 9], lora_name="attn-qv")  # resident, but behind c
    engine.step()
    assert list(engine.lora_waiting) == ["c", "a2"] and engine.stats().lora_slots_free == 0
    assert engine.stats().num_queued_prefill_tokens >= 5  # the waiting prompts count for the routers
    finished: dict[str, str] = {}

    def waited_out() -> bool:
        finished.update({out.request_id: out.outputs[0].finish_reason for out in engine.step() if out.finished})
        return not engine.lora_waiting

    wait_until(waited_out, 30, "the requests waiting for a slot to end", interval_s=0.05)
    assert time.monotonic() - queued_at >= 0.5  # not before max_queue_wait_s
    assert finished == {"c": "queue_timeout", "a2": "queue_timeout"}
    assert engine.loras.resident["attn-qv"].num_running == 1  # a runs on
    engine.abort_request("a")
    engine.step()
    assert engine.stats().lora_slots_free == 1


def test_an_adapter_whose_files_went_bad_while_its_request_waited_ends_it_with_a_400_naming_the_file(
        tiny_model_dir, adapters, tmp_path):
    """The request waits for a slot; its adapter's weights vanish meanwhile: when a slot frees it
    ends alone with the InvalidRequestError (field `model`, the file named) a request arriving
    then would have had, not as an engine failure; the running request is untouched."""
    import shutil

    late = tmp_path / "late"
    shutil.copytree(adapters["mlp-r16"][0], late)
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_bytes=8 * 2**20,
                                    lora={"adapters": {"attn-qv": adapters["attn-qv"][0], "late": str(late)},
                                          "max_loras": 1}))
    engine.add_request("a", params=SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                       prompt_token_ids=[5, 6, 7], lora_name="attn-qv")
    engine.step()
    engine.add_request("c", params=GREEDY, prompt_token_ids=[5, 6, 7], lora_name="late")
    assert list(engine.lora_waiting) == ["c"]
    (late / "adapter_model.safetensors").unlink()
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o.outputs[0].finish_reason for o in engine.step() if o.finished})
    (failure,) = engine.take_failures()
    assert isinstance(failure, InvalidRequestError) and failure.param == "model" and failure.request_id == "c"
    assert "adapter 'late' cannot be loaded here" in failure.message and "adapter_model.safetensors" in failure.message
    assert finished == {"a": "length"} and engine.lora_waiting == {}
