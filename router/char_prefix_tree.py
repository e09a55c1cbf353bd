"""An approximate prefix tree of the texts a router sent each replica, in the manner of Ray Serve
LLM's PrefixCacheAffinityRouter (its `PrefixTree`); the routing benchmark's fourth policy,
`CharPrefixTreePolicy` (router/policies.py), is built on it.

A radix tree over characters: an edge holds a run of characters, a node the replicas ("tenants")
that were sent a text passing through it.

    root ─"You are a helpful"─▶ {a, b} ─" bot. Q: 2+2?"─▶ {a}
                                        └" cat. Q: hi"──▶ {b}

`insert(text, tenant)` marks every node on the text's path with the tenant (splitting an edge
where the text leaves it). `match(text, tenants)` walks down while the next node has one of
`tenants`, and returns how many characters matched and which of `tenants` own the node it
stopped in. Each tenant's character count (the characters of the nodes it owns) is what
"smallest tenant" means.

It is approximate by construction: it records what the router sent, not what the engines hold,
so a replica that evicted a prefix still owns it here, and text is not tokens. Ray's version can
trim each tenant's least recently used nodes on a timer (off by default); that is left out, as
is removing tenants (the benchmark's pools do not change).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

__all__ = ["CharPrefixTree", "token_text"]


def token_text(token_ids: Sequence[int]) -> str:
    """A prompt as text when only its token ids are known: one character per token id, so a
    character match is a token match (every id is below 0x110000, Unicode's limit)."""
    return "".join(map(chr, token_ids))


def _shared_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n - 1  # a[:lo] == b[:lo] and a[:hi + 1] != b[:hi + 1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Node:
    __slots__ = ("text", "children", "tenants")

    def __init__(self, text: str, tenants: Iterable[Hashable] = ()) -> None:
        self.text = text  # the edge label leading here
        self.children: dict[str, _Node] = {}  # by the child's first character
        self.tenants: set[Hashable] = set(tenants)


class CharPrefixTree:
    def __init__(self) -> None:
        self._root = _Node("")
        self.num_chars: dict[Hashable, int] = {}  # tenant -> characters of the nodes it owns

    def add_tenant(self, tenant: Hashable) -> None:
        if tenant not in self.num_chars:
            self.num_chars[tenant] = 0
            self._root.tenants.add(tenant)

    def insert(self, text: str, tenant: Hashable) -> None:
        self.add_tenant(tenant)
        node, i = self._root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                node.children[text[i]] = _Node(text[i:], (tenant,))
                self.num_chars[tenant] += len(text) - i
                return
            shared = _shared_prefix_len(child.text, text[i:])
            if shared < len(child.text):  # the text leaves this edge: split it
                head = _Node(child.text[:shared], child.tenants)
                child.text = child.text[shared:]
                head.children[child.text[0]] = child
                node.children[text[i]] = head
                child = head
            if tenant not in child.tenants:
                child.tenants.add(tenant)
                self.num_chars[tenant] += len(child.text)
            node, i = child, i + shared

    def match(self, text: str, tenants: Iterable[Hashable]) -> tuple[int, list[Hashable]]:
        """(characters matched, the given tenants owning the node where the walk stopped)."""
        candidates = [tenant for tenant in tenants if tenant in self.num_chars]
        wanted = set(candidates)
        node, i = self._root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None or not (child.tenants & wanted):
                break
            shared = _shared_prefix_len(child.text, text[i:])
            node, i = child, i + shared
            if shared < len(child.text):
                break
        return i, [tenant for tenant in candidates if tenant in node.tenants]

    def smallest_tenants(self, tenants: Iterable[Hashable]) -> list[Hashable]:
        """The given tenants with the fewest characters (unknown ones count 0)."""
        counts = {tenant: self.num_chars.get(tenant, 0) for tenant in tenants}
        least = min(counts.values())
        return [tenant for tenant, count in counts.items() if count == least]
