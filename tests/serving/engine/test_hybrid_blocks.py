"""Interleaved sliding-window and full-attention layers (Gemma 2/3, Qwen's layer_types): the
sliding layers' KV in a pool of its own whose blocks leave a sequence as its window moves
(block_manager.HybridBlockManager, kv_cache.py's two pools), exact block ids and counts first,
then a tiny Gemma 3 against transformers."""

from __future__ import annotations

import pytest
import torch

from serving.engine import EngineConfig, LLMEngine, SamplingParams
from serving.engine.kv.block_manager import NULL_BLOCK, BlockManager
from serving.engine.kv.cache import KVCache
from serving.engine.kv.hybrid_block_manager import HybridBlockManager
from tests.helpers import build_tiny_model
from tests.serving.engine.test_block_manager import make_seq
from tests.serving.engine.test_model_parity import engine_greedy, hf_greedy, windowed_run

WINDOW = 6  # block size 4: position p sees p - 5 .. p


def hybrid(full_blocks: int = 16, sliding_blocks: int = 8) -> HybridBlockManager:
    return HybridBlockManager(BlockManager(full_blocks, 4), BlockManager(sliding_blocks, 4), WINDOW)


def compute(bm: HybridBlockManager, seq, num_tokens: int) -> None:
    """What the scheduler and the engine do for one chunk: release what the window passed,
    allocate, compute, commit."""
    if not seq.forks_pending:  # a held sequence too: its importer takes only the window (allocate_import)
        bm.release_before(seq, seq.num_computed_tokens - WINDOW + 1)
    assert bm.allocate(seq, seq.num_computed_tokens + num_tokens)
    seq.num_computed_tokens += num_tokens
    bm.commit(seq)


def test_the_sliding_pool_gives_back_what_the_window_passed_and_the_full_pool_keeps_all():
    bm = hybrid()
    seq = make_seq(range(100, 124))  # 6 blocks of 4
    for _ in range(6):
        compute(bm, seq, 4)
    assert seq.block_ids == [0, 1, 2, 3, 4, 5]
    table = seq.sliding_table
    # before the last chunk, computed 20: positions from 15 on are seen, so blocks 0-2 went back
    assert table.num_released_blocks == 3 and table.block_ids[3:] == [3, 4, 5]
    assert (bm.full.num_free_blocks, bm.sliding.num_free_blocks) == (10, 5)
    assert bm.num_free_blocks == 10 and bm.usage == 6 / 16
    bm.free(seq)
    assert (bm.full.num_free_blocks, bm.sliding.num_free_blocks) == (16, 8)


def test_a_prefix_hit_takes_the_full_blocks_and_only_the_window_of_sliding_blocks():
    bm = hybrid()
    first = make_seq(range(100, 125))  # 25 tokens: 6 full blocks cached
    compute(bm, first, 25)  # one chunk: nothing released while it ran
    bm.free(first)
    second = make_seq([*range(100, 124), 7, 8, 9])
    hits = bm.lookup_prefix(second)
    # 6 blocks (24 tokens); position 24 sees back to 19: blocks 4 and 5 of the sliding pool
    assert list(hits) == [0, 1, 2, 3, 4, 5] and (hits.skip, hits.sliding_ids) == (4, [4, 5])
    assert bm.allocate(second, 24 + 3, hits)
    table = second.sliding_table
    assert table.block_ids == [NULL_BLOCK] * 4 + [4, 5, 6]  # the first's partial block 6 is reused first
    assert table.num_released_blocks == 4 and second.num_computed_tokens == 24
    assert bm.sliding.num_free_blocks == 5  # only the window's two blocks and the new one taken
    bm.free(second)
    assert (bm.full.num_free_blocks, bm.sliding.num_free_blocks) == (16, 8)


def test_a_hit_is_cut_where_the_sliding_pool_lost_a_window_block():
    bm = hybrid(sliding_blocks=6)
    first = make_seq(range(100, 124))
    compute(bm, first, 24)  # 6 blocks in each pool
    bm.free(first)  # tail first: sliding blocks 5, 4, ... are the first reused
    second = make_seq(range(100, 125))
    hits = bm.lookup_prefix(second)
    assert list(hits) == [0, 1, 2, 3, 4, 5] and (hits.skip, hits.sliding_ids) == (4, [4, 5])
    other = make_seq(range(500, 508))
    compute(bm, other, 8)
    assert other.sliding_table.block_ids == [5, 4] and other.block_ids == [6, 7]
    # 6 blocks need sliding 4-5, 5 blocks need 3-4 (position 20 sees back to 15); 4 blocks need
    # 2-3 (position 16 sees back to 11)
    hits = bm.lookup_prefix(second)
    assert list(hits) == [0, 1, 2, 3] and (hits.skip, hits.sliding_ids) == (2, [2, 3])


def test_a_held_sequence_exports_only_its_window_and_an_import_allocates_only_that():
    bm = hybrid()
    held = make_seq(range(100, 125))
    held.hold_kv = True
    for n in (8, 8, 8):
        compute(bm, held, n)
    # before the third chunk (computed 16) positions from 11 on are seen: blocks 0 and 1 went back
    assert held.sliding_table.num_released_blocks == 2
    assert bm.kv_tables(held, 6) == ([0, 1, 2, 3, 4, 5], [None, None, 2, 3, 4, 5])
    importer = make_seq(range(100, 126))
    assert bm.allocate_import(importer, 25, 24)  # position 24 sees back to 19: sliding blocks 4 on
    # three new blocks: the two never used, then block 0, the first the held one gave back
    assert importer.sliding_table.block_ids == [NULL_BLOCK] * 4 + [6, 7, 0]
    assert bm.kv_tables(importer, 6)[1] == [None, None, None, None, 6, 7]
    assert bm.sliding.num_free_blocks == 1 and importer.sliding_table.num_released_blocks == 4


def test_an_allocation_the_sliding_pool_cannot_hold_changes_nothing():
    bm = hybrid(full_blocks=16, sliding_blocks=2)
    seq = make_seq(range(12))
    assert not bm.allocate(seq, 12)  # 3 blocks: the full pool has them, the sliding pool not
    assert seq.block_ids == [] and seq.sliding_table.block_ids == []
    assert (bm.full.num_free_blocks, bm.sliding.num_free_blocks) == (16, 2)


def test_a_parent_with_forks_pending_keeps_its_window_and_shares_both_pools():
    bm = hybrid()
    parent = make_seq(range(100, 121))  # 21 tokens
    parent.forks_pending = True
    for n in (8, 8, 5):
        compute(bm, parent, n)
    assert parent.sliding_table.num_released_blocks == 0
    child = make_seq(range(100, 121))
    bm.fork(parent, child, 5)
    assert child.block_ids == parent.block_ids[:5] and child.num_computed_tokens == 20
    assert child.sliding_table.block_ids == parent.sliding_table.block_ids[:5]
    assert [bm.sliding.blocks[b].ref_count for b in parent.sliding_table.block_ids[:5]] == [2] * 5
    parent.forks_pending = False
    bm.release_before(parent, 21 - WINDOW + 1)  # blocks 0-3 leave the parent, stay the child's
    assert [bm.sliding.blocks[b].ref_count for b in parent.sliding_table.block_ids[:5]] == [1, 1, 1, 1, 2]
    bm.free(child)
    bm.free(parent)
    assert (bm.full.num_free_blocks, bm.sliding.num_free_blocks) == (16, 8)


def test_a_payload_holds_the_full_layers_blocks_then_the_sliding_layers():
    cache = KVCache(num_layers=3, num_blocks=4, block_size=2, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                    device=torch.device("cpu"), sliding_layers=(0, 1), num_sliding_blocks=3)
    assert cache.data.shape == (1, 2, 4, 1, 2, 2) and cache.sliding_data.shape == (2, 2, 3, 1, 2, 2)
    assert cache.layers[2][0].data_ptr() == cache.data[0, 0].data_ptr()
    assert cache.layers[1][1].data_ptr() == cache.sliding_data[1, 1].data_ptr()
    cache.data.copy_(torch.arange(cache.data.numel(), dtype=torch.float32).view_as(cache.data))
    cache.sliding_data.copy_(-torch.arange(cache.sliding_data.numel(), dtype=torch.float32).view_as(cache.sliding_data))
    payload = cache.read_blocks([3, 1], sliding_block_ids=[0, 2])
    assert payload.shape == (3, 2, 2, 1, 2, 2)
    assert torch.equal(payload[0], cache.data[0][:, [3, 1]])
    assert torch.equal(payload[1:], cache.sliding_data[:, :, [0, 2]])
    out = torch.empty(payload.numel() * 4, dtype=torch.uint8)
    assert torch.equal(cache.read_blocks([3, 1], out=out, sliding_block_ids=[0, 2]), payload)
    other = KVCache(num_layers=3, num_blocks=4, block_size=2, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                    device=torch.device("cpu"), sliding_layers=(0, 1), num_sliding_blocks=3)
    other.write_blocks([0, 2], payload, sliding_block_ids=[1, 0])
    assert torch.equal(other.read_blocks([0, 2], sliding_block_ids=[1, 0]), payload)
    before = other.sliding_data.clone()
    other.write_blocks([1, 3], payload * 2, sliding_block_ids=[None, 2])  # a block the window passed: not written
    assert torch.equal(other.sliding_data[:, :, [0, 1]], before[:, :, [0, 1]])
    assert torch.equal(other.sliding_data[:, :, 2], payload[1:, :, 1] * 2) and torch.equal(other.data[0][:, [1, 3]], payload[0] * 2)
    with pytest.raises(ValueError, match="the payload holds 32 values, 2 blocks take 48"):
        other.write_blocks([0, 1], payload[1:], sliding_block_ids=[0, 1])
    assert cache.num_bytes == (32 + 48) * 4 and cache.fewest_blocks == 3


@pytest.fixture(scope="module")
def gemma(tmp_path_factory, default_model_dir):
    """Gemma 3, 3 layers: sliding (window 24), sliding, full."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path_factory.mktemp("gemma3"), default_model_dir, architecture="gemma3",
                                 num_layers=3, sliding_window=24)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt = torch.randint(3, 49152, (300,), generator=torch.Generator().manual_seed(9)).tolist()
    return model_dir, prompt, hf_greedy(hf, prompt, 64)[0]


def test_gemma_sliding_layers_keep_only_their_window_and_the_pools_split_the_budget(gemma):
    """300 prompt tokens and 64 generated, prefilled 32 a step: the full layer holds all 23
    blocks, the sliding layers at most the window's 4, and the tokens are transformers'."""
    model_dir, prompt, expected = gemma
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", kv_cache_bytes=2**20,
                                    max_num_batched_tokens=32, max_num_seqs=2))
    spec = engine.spec
    assert spec.sliding_layers == (0, 1) and spec.hybrid_window == 24
    per_layer_block = 2 * spec.num_kv_heads * spec.head_dim * 4 * 16
    # the sliding pool: 2 sequences x (2 window blocks + 2) + one step's 2 blocks; the full pool the rest
    assert engine.kv_cache.num_sliding_blocks == 10
    assert engine.kv_cache.num_blocks == (2**20 - 10 * 2 * per_layer_block) // per_layer_block
    bm = engine.block_manager
    most_sliding = 0
    original_commit = bm.commit

    def commit(seq):
        nonlocal most_sliding
        original_commit(seq)
        most_sliding = max(most_sliding, bm.sliding.num_blocks - bm.sliding.num_free_blocks)

    bm.commit = commit
    got, most_full = windowed_run(engine, prompt)
    assert got == expected
    # a chunk of 32 from position 32k sees back to 32k - 23: blocks 2k - 2 .. 2k + 1
    assert most_full == 23 and most_sliding == 4
    assert engine.stats().num_preemptions == 0
    assert (bm.full.num_free_blocks, bm.sliding.num_free_blocks) == (bm.full.num_blocks, 10)


def test_gemma_prefix_hits_hand_offs_and_parallel_samples_give_transformers_tokens(gemma):
    model_dir, prompt, expected = gemma
    config = dict(model=str(model_dir), dtype="float32", kv_cache_bytes=2**20, max_num_batched_tokens=64)
    engine = LLMEngine(EngineConfig(**config))
    engine_greedy(engine, [prompt[:290] + [7] * 10], 1)
    hits = engine.stats().prefix_cache_hit_tokens
    assert engine_greedy(engine, [prompt], 64)[0] == expected
    assert engine.stats().prefix_cache_hit_tokens - hits == 288  # 18 blocks: the window's 2 sliding ones cached

    # n = 2: chunks of 299 and 1, so the last starts past the window of the children's first
    # position (288): the parent keeps its blocks until they are forked
    engine = LLMEngine(EngineConfig(**{**config, "max_num_batched_tokens": 299}))
    engine.add_request("n", params=SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, n=2),
                       prompt_token_ids=[5, *prompt[1:]])
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for choice in out.outputs:
                outputs.setdefault(choice.index, []).extend(choice.token_ids)
    assert outputs[0] == outputs[1] == engine_greedy(LLMEngine(EngineConfig(**config)), [[5, *prompt[1:]]], 64)[0]

    # P/D: the prefill side holds every block of both pools; the decode side continues from them
    prefill, decode = LLMEngine(EngineConfig(**config)), LLMEngine(EngineConfig(**config))
    prefill.add_request("x", params=SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                        prompt_token_ids=prompt, hold_kv=True)
    finished = []
    while not finished:
        finished = [o for o in prefill.step() if o.finished]
    (first,) = finished
    payload = prefill.export_kv("x")
    assert payload.kv.shape[:3] == (3, 2, 19)
    decode.add_request("x", params=SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
                       prompt_token_ids=prompt, kv_payload=payload, prior_output_token_ids=first.outputs[0].token_ids)
    tokens = list(first.outputs[0].token_ids)
    while decode.has_unfinished_requests():
        for out in decode.step():
            tokens += out.outputs[0].token_ids
    assert tokens == expected
    bm = decode.block_manager
    assert (bm.full.num_free_blocks, bm.sliding.num_free_blocks) == (bm.full.num_blocks, bm.sliding.num_blocks)


@pytest.mark.parametrize("path", ["pytorch", "deterministic"])
def test_qwen_layer_types_with_two_pools_on_every_attention_path(path, tmp_path, default_model_dir, monkeypatch):
    """Qwen2 with its second layer windowed (20 tokens) and its first full: the PyTorch ops path
    (CUDA's) and batch-invariant mode (each token a decode row of the native kernel) write and
    read the sliding layer's KV through its own pool's tables; transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM

    from serving.engine.modeling import attention, model

    model_dir = build_tiny_model(tmp_path / "qwen2", default_model_dir, architecture="qwen2", sliding_window=20,
                                 max_window_layers=1)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt = torch.randint(3, 49152, (120,), generator=torch.Generator().manual_seed(3)).tolist()
    if path == "pytorch":
        monkeypatch.setattr(model, "native_kernels", lambda: None)
        monkeypatch.setattr(attention, "native_kernels", lambda: None)
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", kv_cache_bytes=2**20,
                                    max_num_batched_tokens=32, deterministic=path == "deterministic"))
    assert engine.spec.sliding_layers == (1,) and engine.model.is_batch_invariant == (path == "deterministic")
    assert engine_greedy(engine, [prompt], 32)[0] == hf_greedy(hf, prompt, 32)[0]
    assert engine.block_manager.sliding.num_free_blocks == engine.kv_cache.num_sliding_blocks
