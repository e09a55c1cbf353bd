"""The suffix proposer (spec_suffix.py): exact proposals on hand-built token sequences (its own
text, a recent request's output, frequencies, eviction, depth), the global tree exactly the one
over the texts it holds after evictions, and on the tiny model a repeated request proposed from
the global tree with greedy output token-identical to decoding without speculation."""

from __future__ import annotations

import pydantic
import pytest
import torch

from serving.engine import SamplingParams
from serving.engine.config import SpeculativeConfig
from serving.engine.request import RequestStatus, Sequence
from serving.engine.spec.speculative import build_proposer
from serving.engine.spec.suffix import SuffixProposer, SuffixTree
from tests.serving.engine.test_engine import make_engine, random_prompts, tokens_of
from tests.serving.engine.test_speculative import spec_engine


def proposer(**overrides) -> SuffixProposer:
    config = dict(
        k=4, max_depth=8, max_cached_requests=8, max_cached_tokens=1000,
        min_probability=0.1, max_spec_factor=4.0, cache_prompts=False,
    )
    config.update(overrides)
    return SuffixProposer(**config)


def seq(prompt: list[int], output: list[int] = (), status: RequestStatus = RequestStatus.RUNNING) -> Sequence:
    s = Sequence(request_id="r", index=0, prompt_token_ids=list(prompt), params=SamplingParams(), max_tokens=64)
    s.token_ids += output
    s.status = status
    return s


def finish(p: SuffixProposer, output: list[int], prompt: list[int] = (99,), status=RequestStatus.FINISHED_STOPPED):
    p.release(seq(prompt, output, status))


def dump(tree: SuffixTree, node: int = 0) -> dict:
    """The tree below `node` as {token: (count, subtree)}."""
    return {tree.token[c]: (tree.count[c], dump(tree, c)) for c in tree.children(node)}


# ---- exact proposals ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "tokens, overrides, expected",
    [
        ([1, 2, 3, 4, 5, 6, 1, 2], {}, [3, 4, 5, 6]),  # "1 2" seen before: what followed it
        ([1, 2, 3, 4, 5, 6, 1, 2], {"max_spec_factor": 1.0}, [3, 4]),  # a 2-token match proposes 2
        ([1, 2, 3, 4, 5, 6, 1, 2], {"k": 4}, [3, 4, 5, 6]),
        ([1, 2, 3, 4], {}, []),  # nothing repeats
        # "1 2" was followed by 3 twice and 4 once: 3 (2/3), then "1 2 3" -> 1 (2/3), "1 2 3 1" ->
        # 2 (2/3), "1 2 3 1 2" -> 3 or 4 once each: the first seen, 3 (1/3)
        ([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2], {}, [3, 1, 2, 3]),
        ([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2], {"min_probability": 0.5}, [3, 1, 2]),
        ([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2], {"min_probability": 0.7}, []),
        # max_depth 4, k 2: the match is at most 2 tokens ("3 4"), the path stops at depth 4
        ([1, 2, 3, 4, 5, 9, 1, 2, 3, 4], {"max_depth": 4, "k": 2}, [5, 9]),
        # max_depth 4, k 3: at most a 1-token match ("4"), then 3 tokens to depth 4
        ([1, 2, 3, 4, 5, 9, 1, 2, 3, 4], {"max_depth": 4, "k": 3}, [5, 9, 1]),
        ([5, 6, 5, 6, 5], {}, [6, 5]),  # a loop: "5 6 5" -> 6 5, and the text ends (no period extension)
    ],
)
def test_proposes_the_most_frequent_continuation_of_the_longest_match_in_its_own_text(tokens, overrides, expected):
    p = proposer(**overrides)
    assert p.propose_batch([seq(tokens)], [8]) == [expected]
    assert p.num_matches == {"request": int(bool(expected)), "global": 0}


def test_the_tree_grows_with_the_sequence_one_token_at_a_time():
    p, s = proposer(), seq([1, 2, 3, 4])
    assert p.propose_batch([s], [8]) == [[]]
    s.token_ids += [1, 2]
    assert p.propose_batch([s], [8]) == [[3, 4, 1, 2]]
    s.token_ids += [7]
    assert p.propose_batch([s], [8]) == [[]]  # "2 7" and "7" never seen before
    s.token_ids += [1]
    assert p.propose_batch([s], [8]) == [[2, 3, 4, 1]]  # "7 1" unseen; "1" -> 2 (2 of 2), 3 (1 of 2: the first seen)...
    assert p.propose_batch([s], [2]) == [[2, 3]]  # capped by max_k
    assert p.propose_batch([s], [0]) == [[]]
    # The incremental tree is the tree of the whole text.
    whole = SuffixTree(8)
    whole.add(s.token_ids)
    assert dump(p.live[s.seq_id].tree) == dump(whole)


def test_a_match_only_in_a_recent_requests_output_is_proposed_from_the_global_tree():
    p = proposer()
    finish(p, [10, 11, 12, 13, 14], prompt=[50, 51])
    assert p.propose_batch([seq([7, 10, 11])], [8]) == [[12, 13, 14]]
    assert p.num_matches == {"request": 0, "global": 1}
    assert p.propose_batch([seq([7, 50, 51])], [8]) == [[]]  # prompts are not cached by default
    with_prompts = proposer(cache_prompts=True)
    finish(with_prompts, [10, 11, 12], prompt=[50, 51])
    assert with_prompts.propose_batch([seq([7, 50, 51])], [8]) == [[10, 11, 12]]


def test_frequency_chooses_between_two_continuations_across_requests():
    p = proposer()
    for output in ([1, 2, 3], [1, 2, 4], [1, 2, 4]):
        finish(p, output)
    assert p.propose_batch([seq([9, 1, 2])], [8]) == [[4]]
    finish(p, [1, 2, 3])
    finish(p, [1, 2, 3])
    assert p.propose_batch([seq([9, 1, 2])], [8]) == [[3]]


def test_the_better_scored_tree_wins():
    """Own text: "1 2" -> 5 1 2 (score 3); recent outputs: "1 2" -> 3 4 6 7 every time (score 4)."""
    p = proposer()
    for _ in range(3):
        finish(p, [1, 2, 3, 4, 6, 7])
    assert p.propose_batch([seq([1, 2, 5, 1, 2])], [8]) == [[3, 4, 6, 7]]
    assert p.num_matches == {"request": 0, "global": 1}
    # Own text "7 1 2" -> 5 8 7 1 (score 4): a tie goes to the request's own tree.
    s = seq([1, 2, 5, 8, 7, 1, 2, 5, 8, 7, 1, 2])
    assert p.propose_batch([s], [8]) == [[5, 8, 7, 1]]
    assert p.num_matches == {"request": 1, "global": 1}


def test_only_normally_finished_requests_are_cached():
    p = proposer()
    live = seq([1, 2, 3, 1, 2])
    p.propose_batch([live], [8])
    assert live.seq_id in p.live
    live.status = RequestStatus.FINISHED_ABORTED
    p.release(live)
    assert p.live == {} and len(p.cached_texts) == 0
    finish(p, [4, 5, 6], status=RequestStatus.FINISHED_LENGTH)
    assert list(p.cached_texts) == [[4, 5, 6]]


def test_the_oldest_cached_request_is_evicted_first():
    p = proposer(max_cached_requests=2)
    finish(p, [1, 2, 3])
    finish(p, [4, 5, 6])
    assert p.propose_batch([seq([9, 1, 2])], [8]) == [[3]]
    finish(p, [7, 8, 9])
    assert list(p.cached_texts) == [[4, 5, 6], [7, 8, 9]]
    assert p.propose_batch([seq([9, 1, 2])], [8]) == [[]]
    assert p.propose_batch([seq([9, 4, 5])], [8]) == [[6]]
    by_tokens = proposer(max_cached_tokens=7)
    for output in ([1, 2, 3], [4, 5, 6], [7, 8]):
        finish(by_tokens, output)
    assert list(by_tokens.cached_texts) == [[4, 5, 6], [7, 8]] and by_tokens.num_cached_tokens == 5
    fresh = SuffixTree(8)
    for text in ([4, 5, 6], [7, 8]):
        fresh.add(text)
    assert dump(by_tokens.cached) == dump(fresh) and by_tokens.cached.num_nodes == fresh.num_nodes


def test_removing_texts_leaves_exactly_the_tree_of_the_rest():
    gen = torch.Generator().manual_seed(0)
    texts = [torch.randint(0, 4, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen).tolist() for _ in range(12)]
    tree = SuffixTree(5)
    for text in texts:
        tree.add(text)
    for text in texts[:7]:
        tree.remove(text)
    fresh = SuffixTree(5)
    for text in texts[7:]:
        fresh.add(text)
    assert dump(tree) == dump(fresh) and tree.num_nodes == fresh.num_nodes > 50
    for text in texts[:7]:  # into the freed node ids
        tree.add(text)
    fresh_all = SuffixTree(5)
    for text in texts:
        fresh_all.add(text)
    assert dump(tree) == dump(fresh_all) and tree.num_nodes == fresh_all.num_nodes and tree.free == []
    for text in texts:
        tree.remove(text)
    assert tree.edges == {} and tree.children(0) == [] and tree.num_nodes == 0


def test_no_node_is_deeper_than_max_depth():
    p = proposer(max_depth=3, k=2)
    s = seq([1, 2, 3, 4, 5, 6, 7])
    p.propose_batch([s], [8])
    finish(p, [1, 2, 3, 4, 5, 6, 7])

    def depth(tree: SuffixTree, node: int = 0) -> int:
        return max((1 + depth(tree, c) for c in tree.children(node)), default=0)

    assert depth(p.live[s.seq_id].tree) == 3 and depth(p.cached) == 3
    assert p.cached.num_nodes == 3 + 3 + 3 + 3 + 3 + 2 + 1  # each suffix's first 3 tokens, no sharing


# ---- config ----------------------------------------------------------------------------------------
def test_config_builds_the_suffix_proposer_and_checks_its_depth():
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=3, suffix_max_depth=6, suffix_cache_prompts=True)
    p = build_proposer(config)
    assert isinstance(p, SuffixProposer) and p.name == "suffix"
    assert (p.k, p.max_depth, p.max_cached_requests, p.max_cached_tokens, p.min_probability, p.max_spec_factor, p.cache_prompts) == (
        3, 6, 256, 65_536, 0.1, 1.0, True,
    )
    assert build_proposer(SpeculativeConfig()).name == "ngram"
    with pytest.raises(pydantic.ValidationError, match=r"suffix_max_depth \(4\) must exceed num_speculative_tokens \(4\)"):
        SpeculativeConfig(method="suffix", suffix_max_depth=4)
    with pytest.raises(pydantic.ValidationError, match="suffix_min_probability"):
        SpeculativeConfig(method="suffix", suffix_min_probability=1.5)


# ---- on the engine ---------------------------------------------------------------------------------
def test_a_repeated_request_is_proposed_from_the_global_tree_and_decodes_the_same_tokens(tiny_model_dir):
    """A random model's output does not repeat its prompt, so the first run gets few proposals; the
    second run of the same prompt is the first one's output, word for word, from the global tree."""
    prompts = random_prompts([40, 25], seed=21)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = tokens_of(make_engine(tiny_model_dir).generate(prompts, greedy))
    engine = spec_engine(tiny_model_dir, speculative={"method": "suffix", "num_speculative_tokens": 4, "adaptive": False})
    proposer_ = engine.speculator.proposer
    assert tokens_of(engine.generate(prompts, greedy)) == plain
    first = (proposer_.num_matches["global"], engine.speculator.num_accepted_tokens)
    assert list(proposer_.cached_texts) == plain and proposer_.live == {}
    for _ in range(2):
        assert tokens_of(engine.generate(prompts, greedy)) == plain
    assert proposer_.num_matches["global"] > first[0]
    # Each rerun is proposed from its earlier output: most tokens arrive as accepted proposals.
    accepted = engine.speculator.num_accepted_tokens - first[1]
    assert accepted > 0.6 * 2 * sum(map(len, plain)), accepted
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
