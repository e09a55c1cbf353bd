"""The character prefix tree and CharPrefixTreePolicy (the Ray-style baseline): exact matches,
character counts and choices."""

from __future__ import annotations

import math

import pytest

from router.char_prefix_tree import CharPrefixTree, token_text
from router.policies import CharPrefixTreePolicy, ReplicaLoad, RouteRequest, build_policy


def test_insert_splits_edges_and_counts_characters_per_tenant():
    tree = CharPrefixTree()
    tree.insert("hello world", "a")
    tree.insert("hello there", "b")  # splits "hello world" after "hello "
    tree.insert("help", "a")  # splits "hello " after "hel"
    assert tree.num_chars == {"a": 11 + 1, "b": 6 + 5}  # a: "hel" "lo " "world" "p"; b: "hel" "lo " "there"
    assert tree.match("hello world!", ["a", "b"]) == (11, ["a"])
    assert tree.match("hello thermos", ["a", "b"]) == (10, ["b"])  # stops inside "there"
    assert tree.match("hello ", ["a", "b"]) == (6, ["a", "b"])
    assert tree.match("hello world", ["b"]) == (6, ["b"])  # a's branch is not a candidate's
    assert tree.match("xyz", ["a", "b"]) == (0, ["a", "b"])  # the root: every tenant
    assert tree.match("hello", ["c"]) == (0, [])  # unknown tenants own nothing
    tree.insert("hello world", "b")
    assert tree.num_chars["b"] == 11 + 5  # and now "world"
    assert tree.smallest_tenants(["a", "b", "c"]) == ["c"]
    assert tree.smallest_tenants(["a", "b"]) == ["a"]


def test_token_text_is_one_character_per_token():
    assert token_text([72, 105, 0xD800, 49151]) == "Hi\ud800\U0000bfff"
    assert len(token_text(range(1000))) == 1000


def loads(**queues) -> list[ReplicaLoad]:
    return [ReplicaLoad(name, num_running=1 if q else 0, num_waiting=max(0, q - 1)) for name, q in queues.items()]


def request(text: str) -> RouteRequest:
    return RouteRequest(text, num_prompt_tokens=len(text), text=text)


def test_policy_follows_the_longest_match_else_the_smallest_tenant():
    policy = CharPrefixTreePolicy(seed=0)
    state = loads(a=1, b=0, c=2)
    first = policy.choose(request("system prompt one: question 1"), state)
    # An empty tree: every tenant has 0 characters; the shortest queue among them.
    assert (first.chosen, first.reason, first.ranked) == ("b", "smallest_tenant", ["b", "a", "c"])
    again = policy.choose(request("system prompt one: question 2"), loads(a=0, b=3, c=0))
    assert (again.chosen, again.reason) == ("b", "prefix_match")  # 28 of 29 characters; no load check
    other = policy.choose(request("another prompt"), state)
    assert (other.chosen, other.reason) == ("a", "smallest_tenant")  # a and c have 0 characters
    # The deepest node's owners, then the shortest queue among them.
    policy.tree.insert("system prompt one: question 2", "c")
    choice = policy.choose(request("system prompt one: question 2"), loads(a=0, b=2, c=1))
    assert (choice.chosen, choice.reason) == ("c", "prefix_match")


def test_policy_ignores_a_short_match_and_falls_back_to_pow2_when_imbalanced():
    policy = CharPrefixTreePolicy(match_rate_threshold=0.5, seed=0)
    policy.tree.insert("abcdefgh", "a")
    policy.tree.insert("zz", "b")
    decision = policy.choose(request("abcXXXXXXX"), loads(a=0, b=0))  # 3 / 10 < 0.5
    assert (decision.chosen, decision.reason) == ("b", "smallest_tenant")  # b: 2 characters, a: 8
    imbalanced = CharPrefixTreePolicy(imbalanced_threshold=2, seed=0)
    imbalanced.tree.insert("abcdefgh", "a")
    decision = imbalanced.choose(request("abcdefgh"), loads(a=4, b=0))  # 4 - 0 > 2: pow2 of {a, b}
    assert (decision.chosen, decision.reason) == ("b", "imbalanced")
    # The pow2 choice went into the tree too: a and b own the text; 3 - 1 <= 2, the shorter queue.
    decision = imbalanced.choose(request("abcdefgh"), loads(a=1, b=3))
    assert (decision.chosen, decision.reason) == ("a", "prefix_match")


def test_policy_uses_token_ids_without_text_and_is_built_by_name():
    policy = build_policy("char_prefix_tree", seed=0)
    assert isinstance(policy, CharPrefixTreePolicy) and policy.imbalanced_threshold == math.inf
    ids = list(range(100, 164))
    first = policy.choose(RouteRequest("r1", 64, token_ids=ids), loads(a=0, b=0))
    second = policy.choose(RouteRequest("r2", 64, token_ids=ids[:60] + [1, 2, 3, 4]), loads(a=0, b=0))
    assert second.chosen == first.chosen and second.reason == "prefix_match"
    assert policy.tree.num_chars[first.chosen] == 68
    with pytest.raises(ValueError, match="match_rate_threshold must be <= 1, got 2"):
        build_policy("char_prefix_tree", match_rate_threshold=2)
