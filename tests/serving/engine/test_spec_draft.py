"""Draft-model proposals (spec_draft.py) on tiny random models (fp32), built here with the default
model's tokenizer: the model as its own draft (every proposal kept), its first layer alone (a
draft that is right often, not always), and a smaller random model (rarely right). Output is
token-identical to decoding without speculation, greedy and seeded; the draft's KV follows the
accepted tokens exactly and goes back to its pool; a full pool costs proposals, never requests;
a draft with another tokenizer is refused at start-up, naming the field.
"""

from __future__ import annotations

import json
import shutil

import pydantic
import pytest
from safetensors.torch import load_file, save_file

from serving.engine import SamplingParams
from serving.engine.config import SpeculativeConfig
from serving.engine.errors import ModelLoadError
from serving.engine.request import Sequence
from tests.helpers import build_tiny_model
from tests.serving.engine.test_engine import make_engine, random_prompts, tokens_of
from tests.serving.engine.test_speculative import GREEDY, run_steps, workload

K = 4


def draft_engine(model_dir, draft_dir, *, draft_num_blocks: int = 256, **overrides):
    # adaptive off: these tests check the draft's proposals and their verification, every step
    speculative = {"method": "draft", "draft_model": str(draft_dir), "num_speculative_tokens": K, "draft_num_blocks": draft_num_blocks,
                   "adaptive": False}
    return make_engine(model_dir, speculative=speculative, **overrides)


def copy_model(src, dst, **config_updates):
    """`src`'s files in `dst`, its config.json updated."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **config_updates}))
    return dst


@pytest.fixture(scope="module")
def small_draft_dir(tmp_path_factory, default_model_dir):
    """A smaller random model (1 layer, hidden 32, 1 KV head): a KV cache of another shape."""
    return build_tiny_model(
        tmp_path_factory.mktemp("draft-small"), default_model_dir, seed=5, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
    )


@pytest.fixture(scope="module")
def truncated_draft_dir(tmp_path_factory, tiny_model_dir):
    """The model's first layer alone, with its embeddings, final norm and head (a 'layer-skip'
    draft): it agrees with the model often but not always."""
    out = tmp_path_factory.mktemp("draft-truncated")
    copy_model(tiny_model_dir, out, num_hidden_layers=1)
    state = load_file(str(tiny_model_dir / "model.safetensors"))
    save_file({k: v for k, v in state.items() if not k.startswith("model.layers.1.")}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def plain_outputs(tiny_model_dir) -> list[list[int]]:
    return tokens_of(make_engine(tiny_model_dir).generate(workload(), GREEDY))


# ---- config ------------------------------------------------------------------------------------
def test_draft_config_needs_a_draft_model_and_only_draft_takes_one():
    config = SpeculativeConfig(method="draft", draft_model="/models/small")
    assert (config.draft_model, config.draft_num_blocks) == ("/models/small", 256)
    with pytest.raises(pydantic.ValidationError, match="method 'draft' needs draft_model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(pydantic.ValidationError, match="draft_model is only used by method 'draft', the method is 'ngram'"):
        SpeculativeConfig(draft_model="/models/small")
    with pytest.raises(pydantic.ValidationError, match="draft_num_blocks"):
        SpeculativeConfig(method="draft", draft_model="/models/small", draft_num_blocks=0)


def test_a_draft_with_another_vocabulary_eos_or_tokenizer_is_refused(tmp_path, tiny_model_dir, small_draft_dir, default_model_dir):
    other_vocab = build_tiny_model(tmp_path / "vocab", default_model_dir, vocab_size=1000, hidden_size=32, num_layers=1)
    refused = r"^speculative.draft_model '.*vocab': its vocabulary has 1000 tokens, the model's 49152\. A draft model must use the model's tokenizer"
    with pytest.raises(ModelLoadError, match=refused):
        draft_engine(tiny_model_dir, other_vocab)
    other_eos = copy_model(small_draft_dir, tmp_path / "eos", eos_token_id=3)
    (other_eos / "generation_config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"speculative.draft_model '.*eos': its eos token ids are \[3\], the model's \[2\]"):
        draft_engine(tiny_model_dir, other_eos)
    other_tokenizer = copy_model(small_draft_dir, tmp_path / "tokenizer")
    tokenizer = json.loads((other_tokenizer / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]
    (other_tokenizer / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ModelLoadError, match=r"its tokenizer maps 4 \(token, id\) pairs differently from the model's"):
        draft_engine(tiny_model_dir, other_tokenizer)
    with pytest.raises(ModelLoadError, match=r"^speculative.draft_model: model '.*missing' is neither"):
        draft_engine(tiny_model_dir, tmp_path / "missing")


# ---- the engine with a draft ---------------------------------------------------------------------
def test_the_model_as_its_own_draft_has_every_proposal_accepted(tiny_model_dir):
    """Acceptance exactly 1: each step adds 1 + k tokens, but the last, capped by max_tokens (48 =
    1 from the prefill + 9 x 5 + 2). The output is the one without speculation."""
    prompts = random_prompts([3, 17, 64, 45, 90], seed=13)  # one prefill step for all: 219 tokens
    plain = tokens_of(make_engine(tiny_model_dir).generate(prompts, GREEDY))
    engine = draft_engine(tiny_model_dir, tiny_model_dir)
    deltas = run_steps(engine, prompts, GREEDY)
    assert [[t for d in deltas[f"r{i}"] for t in d.token_ids] for i in range(len(prompts))] == plain
    assert all([len(d.token_ids) for d in deltas[f"r{i}"]] == [1] + [1 + K] * 9 + [2] for i in range(len(prompts)))
    stats = engine.stats()
    assert stats.spec_method == "draft"
    assert stats.spec_accepted_tokens == stats.spec_proposed_tokens == len(prompts) * (9 * K + 1)
    assert stats.spec_verify_steps == len(prompts) * 10
    assert stats.num_free_blocks == stats.num_blocks
    proposer = engine.speculator.proposer
    assert proposer.block_manager.num_free_blocks == 256 and not proposer._drafts
    # Each sequence: its prompt and first token once, then per step the model's token and the
    # last proposal (never fed: it was the k-th) plus k - 1 proposals; the last step proposes one.
    assert proposer.num_computed_tokens == sum(len(p) + 1 + (K - 1) + 8 * (2 + K - 1) + 2 for p in prompts)


@pytest.mark.parametrize("draft", ["small_draft_dir", "truncated_draft_dir"])
@pytest.mark.parametrize("max_num_batched_tokens", [512, 48], ids=["one-step-prefill", "chunked-prefill"])
def test_greedy_output_with_a_draft_is_token_identical(request, tiny_model_dir, plain_outputs, draft, max_num_batched_tokens):
    engine = draft_engine(tiny_model_dir, request.getfixturevalue(draft), max_num_batched_tokens=max_num_batched_tokens)
    assert tokens_of(engine.generate(workload(), GREEDY)) == plain_outputs
    stats = engine.stats()
    assert stats.spec_accepted_tokens < stats.spec_proposed_tokens
    if draft == "truncated_draft_dir":
        assert stats.spec_accepted_tokens > 0
    assert stats.num_free_blocks == stats.num_blocks
    assert engine.speculator.proposer.block_manager.num_free_blocks == 256


def test_seeded_sampled_output_with_a_draft_is_the_one_without(tiny_model_dir, truncated_draft_dir, small_draft_dir):
    """Greedy drafts are one-hot: "sample, then compare" keeps a seeded request's tokens (up to the
    rounding speculative.py describes; fp32, and these prompts don't hit it)."""
    prompts = workload()[-3:]
    seeded = SamplingParams(temperature=0.7, max_tokens=32, seed=5, ignore_eos=True, frequency_penalty=0.3)
    plain = tokens_of(make_engine(tiny_model_dir).generate(prompts, seeded))
    small = draft_engine(tiny_model_dir, small_draft_dir)
    assert tokens_of(small.generate(prompts, seeded)) == plain
    assert small.stats().spec_proposed_tokens > 0
    truncated = draft_engine(tiny_model_dir, truncated_draft_dir)
    assert tokens_of(truncated.generate(prompts, seeded)) == plain
    assert 0 < truncated.stats().spec_accepted_tokens < truncated.stats().spec_proposed_tokens


def test_target_preemption_with_a_draft_gives_identical_output_and_every_block_back(tiny_model_dir, truncated_draft_dir, plain_outputs):
    # 24 target blocks of 16 tokens: far less than the batch needs at once (the longest needs 248)
    engine = draft_engine(tiny_model_dir, truncated_draft_dir, kv_cache_bytes=24 * 16 * 512, max_num_batched_tokens=256)
    assert engine.block_manager.num_blocks == 24
    assert tokens_of(engine.generate(workload(), GREEDY)) == plain_outputs
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_accepted_tokens > 0
    assert stats.num_free_blocks == 24
    assert engine.speculator.proposer.block_manager.num_free_blocks == 256


def test_a_full_draft_pool_costs_proposals_not_requests(tiny_model_dir, truncated_draft_dir, plain_outputs):
    """8 draft blocks of 16 tokens: the short sequences fit, the long ones decode without proposals."""
    engine = draft_engine(tiny_model_dir, truncated_draft_dir, draft_num_blocks=8)
    assert tokens_of(engine.generate(workload(), GREEDY)) == plain_outputs
    stats = engine.stats()
    assert stats.spec_accepted_tokens > 0 and stats.num_free_blocks == stats.num_blocks
    proposer = engine.speculator.proposer
    assert proposer.num_unfit > 0 and proposer.block_manager.num_free_blocks == 8


def test_a_failing_draft_forward_costs_that_steps_proposals_only(tiny_model_dir, truncated_draft_dir, plain_outputs):
    """The Speculator turns a proposer's exception into no proposals for that step; the draft's
    views, left half-advanced, are rolled back at the next step like after any rejection."""
    engine = draft_engine(tiny_model_dir, truncated_draft_dir)
    proposer = engine.speculator.proposer
    execute, num_calls = proposer.runner.execute, []

    def flaky(step):
        num_calls.append(1)
        if len(num_calls) in (1, 7, 8):  # the first (catch-up chunks, with blocks taken) and two later ones
            raise RuntimeError("draft forward failed")
        return execute(step)

    proposer.runner.execute = flaky
    assert tokens_of(engine.generate(workload(), GREEDY)) == plain_outputs
    stats = engine.stats()
    assert len(num_calls) > 8 and stats.spec_accepted_tokens > 0
    assert stats.num_free_blocks == stats.num_blocks and proposer.block_manager.num_free_blocks == 256


# ---- the proposer's KV -------------------------------------------------------------------------
def test_the_draft_rolls_its_kv_back_to_the_accepted_tokens(tiny_model_dir, small_draft_dir):
    """Exact counts of the draft's computed tokens and blocks (4 tokens each) after each kind of
    verification outcome; the proposals after a rollback are those of a draft that starts fresh."""
    engine = draft_engine(tiny_model_dir, small_draft_dir, block_size=4, draft_num_blocks=16)
    proposer = engine.speculator.proposer
    pool = proposer.block_manager
    seq = Sequence("a", 0, random_prompts([10], seed=21)[0], GREEDY, max_tokens=48)

    def fresh_proposals(token_ids: list[int], k: int) -> list[int]:
        other = Sequence("fresh", 0, token_ids, GREEDY, max_tokens=48)
        (proposed,) = proposer.propose_batch([other], [k])
        proposer.release(other)
        return proposed

    (first,) = proposer.propose_batch([seq], [K])
    view = proposer.draft_seq(seq)
    # 10 known tokens and 3 proposals fed back (the 4th is not): 13 tokens, 4 blocks
    assert len(first) == K and view.token_ids == seq.token_ids + first
    assert (view.num_computed_tokens, len(view.block_ids), pool.num_free_blocks, proposer.num_computed_tokens) == (13, 4, 12, 13)

    # 2 kept, then the model's own token: KV for 12 tokens kept, the model's token computed, 3 fed
    for token in first[:2] + [(first[2] + 1) % 49152]:
        seq.append_token(token)
    (second,) = proposer.propose_batch([seq], [K])
    assert view.token_ids == seq.token_ids + second and second == fresh_proposals(seq.token_ids, K)
    assert (view.num_computed_tokens, len(view.block_ids), proposer.num_computed_tokens - 13 - 16) == (16, 4, 1 + 3)

    # all 4 kept, and the model's token: the 4th proposal and the model's token are computed
    for token in second + [7]:
        seq.append_token(token)
    computed = proposer.num_computed_tokens
    (third,) = proposer.propose_batch([seq], [K])
    assert seq.num_tokens == 18 and view.token_ids == seq.token_ids + third
    assert (view.num_computed_tokens, len(view.block_ids), proposer.num_computed_tokens - computed) == (21, 6, 2 + 3)

    # none kept, one proposal asked for: KV for the 18 known tokens, and the blocks past them go back
    seq.append_token((third[0] + 1) % 49152)
    (fourth,) = proposer.propose_batch([seq], [1])
    assert len(fourth) == 1 and view.token_ids == seq.token_ids + fourth
    assert (view.num_computed_tokens, len(view.block_ids), pool.num_free_blocks) == (19, 5, 11)

    proposer.release(seq)
    assert pool.num_free_blocks == 16 and proposer.draft_seq(seq) is None


def test_a_sequence_that_does_not_fit_the_draft_pool_gets_nothing_and_holds_nothing(tiny_model_dir, small_draft_dir):
    engine = draft_engine(tiny_model_dir, small_draft_dir, block_size=4, draft_num_blocks=4)
    proposer = engine.speculator.proposer
    pool = proposer.block_manager
    a, b, huge = (Sequence(name, 0, prompt, GREEDY, max_tokens=48) for name, prompt in zip("abh", random_prompts([10, 5, 14], seed=3)))
    # a needs 10 + 3 tokens (4 blocks, the whole pool); b then finds none free
    proposed_a, proposed_b = proposer.propose_batch([a, b], [K, K])
    assert len(proposed_a) == K and proposed_b == [] and proposer.draft_seq(b) is None and pool.num_free_blocks == 0
    assert proposer.num_unfit == 1
    proposer.release(a)
    assert len(proposer.propose_batch([b], [K])[0]) == K and pool.num_free_blocks == 2
    # 14 + 3 tokens need 5 blocks: never fit; b, first, keeps its blocks
    assert proposer.propose_batch([b, huge], [K, K])[1] == [] and proposer.draft_seq(huge) is None
    assert pool.num_free_blocks == 2 and proposer.num_unfit == 2
    # no room left in the context or max_tokens: nothing run, nothing held
    assert proposer.propose_batch([huge], [0]) == [[]] and proposer.draft_seq(huge) is None
    proposer.release(b)
    assert pool.num_free_blocks == 4
