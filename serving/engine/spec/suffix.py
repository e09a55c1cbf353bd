"""Suffix decoding: propose what most often followed the sequence's last tokens, in its own text
and in the outputs of recent requests (SuffixDecoding, arXiv 2411.04975).

Agentic loops, SQL and structured answers repeat what earlier requests said: the same tool call
with another argument, the same query shape, the same JSON keys. Prompt lookup (spec_ngram.py)
only sees the request itself; this proposer also remembers the requests that finished lately.

Two trees of the same kind, each a trie of every suffix of its text cut at `max_depth` tokens,
every node counting how many times its path occurred:

    text  a b c a b d   (max_depth 3; node = token, count)

    root ─┬─ a 2 ── b 2 ─┬─ c 1
          │              └─ d 1 *        *: the active nodes, the suffixes ending at the last
          ├─ b 2 ─┬─ c 1 ── a 1             token ("d", "b d", "a b d"); appending x gives the
          │       └─ d 1 *                  root and each above max_depth a child x (or counts it)
          ├─ c 1 ── a 1 ── b 1
          └─ d 1 *

    per request  one tree per live sequence, over its prompt and output, grown as tokens are
                 appended: the nodes of the suffixes that end at the last token (one per depth,
                 the "active" nodes) each get the new token as a child, so a token costs
                 max_depth dict updates. Dropped in `release`.
    global       one tree over the outputs (and, with cache_prompts, the prompts) of the requests
                 that finished normally (stop or length; aborted ones are not trusted), first in,
                 first out: at most `max_cached_requests` texts and `max_cached_tokens` tokens;
                 an evicted text's suffixes are walked again and their counts taken back (nodes
                 at 0 are deleted), so the tree is exactly the one over the texts it holds.

Proposing, for each tree: the longest suffix of the sequence (at most max_depth - k tokens, so k
proposals fit below it) whose node has children, i.e. that occurred before and was followed by
something. From there, the walk takes the most frequent child each step (ties: the one seen
first) while the path's probability, the product of count(child) / count(all children), stays
at least `min_probability`, and for at most max(1, max_spec_factor * match length) tokens: a
long, confident match proposes many tokens, a short or ambiguous one few or none. The two
trees' walks are scored by their expected number of accepted tokens (the sum of the path
probabilities, SuffixDecoding's score) and the better one is proposed; a tie goes to the request's
own tree. No match in either: no proposal. The model verifies every proposal (speculative.py),
so a wrong guess costs compute, never correctness.

Why a depth-bounded trie and not a suffix tree (Ukkonen) or a suffix automaton: it is the
simplest structure that answers both questions asked (where does the longest recent suffix
match, and how often was each continuation seen) with counts that are exact per node, that grows
one token at a time, and from which a text can be taken back out (the global tree's eviction),
which a suffix automaton cannot do. Its cost is memory: up to max_depth nodes per token of text
(fewer where text repeats: paths are shared). A suffix tree needs O(n) nodes; compressing the
single-occurrence chains of this trie into pointers into the text would give the same bound and
is the next step if memory matters.

Cost (AMD EPYC, AVX-512 BF16, no AMX; CPython, one core; max_depth 16, k 4, a global tree of 64
finished 128-token outputs; random text over 2000 distinct tokens; load_tests/engine/spec_suffix.py --cost):

    sequence of          300 tokens    3000 tokens
    a step (append 1,       33 us         31 us      (n-gram prompt lookup, same run: 13 / 91 us)
      match both, walk)
    its first proposal     3.3 ms         38 ms      (builds its tree from the prompt, once)
    its tree              4.7k nodes      46k nodes  (~155 bytes a node: 7.2 MB at 3000 tokens)

A step's cost does not grow with the length (the active nodes hold the match): ~0.4% of a
SmolLM2 step (~10 ms). Caching a finished 128-token output costs ~1 ms, once. Memory is bounded
by max_depth nodes per token: a live sequence's tree by its length, the global tree by
max_depth * max_cached_tokens nodes (<= 160 MB at the defaults, 16 * 65536; far less where
outputs repeat each other, which is when they are worth caching).
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field

from serving.engine.request import RequestStatus, Sequence

__all__ = ["SuffixProposer", "SuffixTree"]

logger = logging.getLogger(__name__)

_CACHED_STATUSES = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


_ROOT = 0
_NONE = -1
_KEY = 1 << 32  # an edge's key: parent * _KEY + token (token ids are below 2**32)


class SuffixTree:
    """A trie of a set of texts' suffixes, each cut at `max_depth` tokens, with occurrence counts.

    Nodes are ints indexing flat lists, children are one dict of edges and a linked list per node
    (first child, next sibling): a node is no Python object of its own, so a tree of a million
    nodes is not a million objects for the cyclic garbage collector to walk (with a dict and an
    object per node, the collections it triggered cost ~5 us per node created)."""

    def __init__(self, max_depth: int):
        assert max_depth >= 1, max_depth
        self.max_depth = max_depth
        self.count = [0]  # occurrences of the node's path
        self.token = [_NONE]  # the token on the edge into it
        self.first_child = [_NONE]
        self.next_sibling = [_NONE]  # children are linked newest first
        self.edges: dict[int, int] = {}  # parent * _KEY + token -> child
        self.free: list[int] = []  # ids of deleted nodes, reused

    @property
    def num_nodes(self) -> int:
        return len(self.count) - 1 - len(self.free)

    def child(self, node: int, token: int) -> int:
        return self.edges.get(node * _KEY + token, _NONE)

    def children(self, node: int) -> list[int]:
        """Oldest first."""
        out = []
        child = self.first_child[node]
        while child != _NONE:
            out.append(child)
            child = self.next_sibling[child]
        out.reverse()
        return out

    def count_child(self, node: int, token: int) -> int:
        """The child of `node` for `token` (made if missing), counted once more."""
        child = self.edges.get(node * _KEY + token, _NONE)
        if child == _NONE:
            if self.free:
                child = self.free.pop()
                self.count[child], self.token[child], self.first_child[child] = 0, token, _NONE
                self.next_sibling[child] = self.first_child[node]
            else:
                child = len(self.count)
                self.count.append(0)
                self.token.append(token)
                self.first_child.append(_NONE)
                self.next_sibling.append(self.first_child[node])
            self.first_child[node] = child
            self.edges[node * _KEY + token] = child
        self.count[child] += 1
        return child

    def add(self, tokens: list[int]) -> None:
        """Count every suffix of `tokens` (each cut at max_depth)."""
        for start in range(len(tokens)):
            node = _ROOT
            for token in tokens[start : start + self.max_depth]:
                node = self.count_child(node, token)

    def remove(self, tokens: list[int]) -> None:
        """Take back what `add(tokens)` counted; nodes left at 0 are deleted."""
        for start in range(len(tokens)):
            node = _ROOT
            for token in tokens[start : start + self.max_depth]:
                child = self.edges[node * _KEY + token]
                self.count[child] -= 1
                if self.count[child] == 0:
                    # Every path below passes through it: nothing below is counted any more.
                    self._unlink(node, child)
                    self._delete(node, child)
                    break
                node = child

    def _unlink(self, parent: int, child: int) -> None:
        if self.first_child[parent] == child:
            self.first_child[parent] = self.next_sibling[child]
            return
        prev = self.first_child[parent]
        while self.next_sibling[prev] != child:
            prev = self.next_sibling[prev]
        self.next_sibling[prev] = self.next_sibling[child]

    def _delete(self, parent: int, node: int) -> None:
        stack = [(parent, node)]
        while stack:
            parent, node = stack.pop()
            del self.edges[parent * _KEY + self.token[node]]
            self.free.append(node)
            child = self.first_child[node]
            while child != _NONE:
                stack.append((node, child))
                child = self.next_sibling[child]

    def find(self, tokens: list[int], max_len: int) -> tuple[int, int] | None:
        """The node of the longest suffix of `tokens` (at most max_len) that has children, and its
        length; None when no suffix of even one token was followed by anything."""
        edges = self.edges
        for length in range(min(max_len, len(tokens), self.max_depth - 1), 0, -1):
            node = _ROOT
            for token in tokens[len(tokens) - length :]:
                node = edges.get(node * _KEY + token, _NONE)
                if node == _NONE:
                    break
            if node != _NONE and self.first_child[node] != _NONE:
                return node, length
        return None


@dataclass
class _LiveTree:
    """One sequence's tree, and the nodes of its suffixes that end at its last token."""

    tree: SuffixTree
    num_tokens: int = 0  # of the sequence's tokens, how many are in the tree
    active: list[int] = field(default_factory=list)  # active[d]: the node of its last d + 1 tokens

    def extend(self, token_ids: list[int]) -> None:
        tree = self.tree
        for token in token_ids[self.num_tokens :]:
            self.active = [tree.count_child(node, token) for node in (_ROOT, *self.active[: tree.max_depth - 1])]
        self.num_tokens = len(token_ids)

    def find(self, max_len: int) -> tuple[int, int] | None:
        """SuffixTree.find for the sequence's own tokens, from the active nodes."""
        first_child = self.tree.first_child
        for length in range(min(max_len, len(self.active)), 0, -1):
            node = self.active[length - 1]
            if first_child[node] != _NONE:
                return node, length
        return None


@dataclass(eq=False, kw_only=True)
class SuffixProposer:
    """Proposes up to `k` tokens per sequence from its own tree and the recent requests' tree
    (the parameters: SpeculativeConfig's suffix_* fields)."""

    name = "suffix"

    k: int
    max_depth: int
    max_cached_requests: int
    max_cached_tokens: int
    min_probability: float
    max_spec_factor: float
    cache_prompts: bool
    live: dict[int, _LiveTree] = field(default_factory=dict, init=False, repr=False)  # by seq_id
    cached: SuffixTree = field(init=False, repr=False)
    cached_texts: collections.deque[list[int]] = field(default_factory=collections.deque, init=False, repr=False)
    num_cached_tokens: int = field(default=0, init=False)
    # proposals made from each tree
    num_matches: dict[str, int] = field(default_factory=lambda: {"request": 0, "global": 0}, init=False)

    def __post_init__(self) -> None:
        assert self.k >= 1 and self.max_depth > self.k, (self.k, self.max_depth)
        self.cached = SuffixTree(self.max_depth)

    def propose_batch(self, seqs: list[Sequence], max_ks: list[int]) -> list[list[int]]:
        return [self.propose(seq, max_k) for seq, max_k in zip(seqs, max_ks)]

    def propose(self, seq: Sequence, max_k: int) -> list[int]:
        live = self.live.get(seq.seq_id)
        if live is None or live.num_tokens > seq.num_tokens:  # new, or its tokens were replaced
            live = self.live[seq.seq_id] = _LiveTree(SuffixTree(self.max_depth))
        live.extend(seq.token_ids)
        k = min(self.k, max_k)
        if k <= 0:
            return []
        max_len = self.max_depth - self.k
        best: tuple[float, list[int], str] = (0.0, [], "")
        for source, tree, match in (
            ("request", live.tree, live.find(max_len)),
            ("global", self.cached, self.cached.find(seq.token_ids, max_len)),
        ):
            if match is not None:
                score, tokens = self._walk(tree, *match, k)
                if score > best[0]:
                    best = (score, tokens, source)
        if best[1]:
            self.num_matches[best[2]] += 1
        return best[1]

    def _walk(self, tree: SuffixTree, node: int, match_len: int, k: int) -> tuple[float, list[int]]:
        """The most frequent path below `node` while its probability stays >= min_probability:
        (expected accepted tokens, the path's tokens)."""
        num = min(k, max(1, int(self.max_spec_factor * match_len)))
        tokens: list[int] = []
        probability, score = 1.0, 0.0
        count = tree.count
        while len(tokens) < num:
            children = tree.children(node)
            if not children:
                break
            best = max(children, key=count.__getitem__)  # the first (oldest) of equals
            probability *= count[best] / sum(count[c] for c in children)
            if probability < self.min_probability:
                break
            tokens.append(tree.token[best])
            score += probability
            node = best
        return score, tokens

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's tree; a sequence that finished normally joins the global tree."""
        self.live.pop(seq.seq_id, None)
        if seq.status not in _CACHED_STATUSES or self.max_cached_requests == 0:
            return
        text = seq.token_ids if self.cache_prompts else seq.output_token_ids
        text = text[: self.max_cached_tokens]
        if not text:
            return
        self.cached.add(text)
        self.cached_texts.append(text)
        self.num_cached_tokens += len(text)
        while len(self.cached_texts) > self.max_cached_requests or self.num_cached_tokens > self.max_cached_tokens:
            oldest = self.cached_texts.popleft()
            self.cached.remove(oldest)
            self.num_cached_tokens -= len(oldest)

