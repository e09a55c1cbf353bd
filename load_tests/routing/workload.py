"""The routing benchmark's workload: shared-prefix prompts with Poisson arrivals, seeded.

    group g:   [ prefix g: prefix_len tokens ][ suffix: suffix_len tokens, fresh per request ]
    arrivals:  exponential gaps at `request_rate_per_s`; each request picks its group with
               probability proportional to 1 / (g + 1) ** zipf_s (0: uniform)

Token ids are drawn from [100, vocab_size) (clear of the special tokens at the bottom of
Llama-family vocabularies), so suffixes never share a block with anything. Block hashes are the
engine's (`hash_blocks`, no extra keys), computed once per group prefix and once per suffix.
Only the suffix is stored per request; `token_ids` joins them on demand, so a 16k-request
workload does not hold 17M token ids.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from router.char_prefix_tree import token_text
from serving.engine.kv.block_hash import ROOT_HASH, hash_blocks

__all__ = ["WorkloadSpec", "WorkloadRequest", "Workload", "make_workload"]


@dataclass(frozen=True)
class WorkloadSpec:
    num_groups: int = 16
    prefix_len: int = 1024  # tokens
    suffix_len: int = 64  # tokens
    num_requests: int = 4000
    request_rate_per_s: float = 10.0
    zipf_s: float = 0.0  # popularity skew of the groups; 0: uniform
    block_size: int = 16
    vocab_size: int = 49152
    seed: int = 0

    @property
    def prompt_len(self) -> int:
        return self.prefix_len + self.suffix_len


@dataclass
class WorkloadRequest:
    request_id: str
    group: int
    arrival_s: float  # from the start of the run
    suffix_ids: list[int]
    block_hashes: list[int]  # of the whole prompt's full blocks
    workload: Workload

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.workload.prefixes[self.group]) + len(self.suffix_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.workload.prefixes[self.group] + self.suffix_ids

    @property
    def text(self) -> str:
        """`token_text(token_ids)`, from the group's cached prefix text."""
        return self.workload.prefix_texts[self.group] + token_text(self.suffix_ids)


@dataclass
class Workload:
    spec: WorkloadSpec
    prefixes: list[list[int]]
    prefix_texts: list[str]
    requests: list[WorkloadRequest]

    def group_counts(self) -> list[int]:
        counts = [0] * self.spec.num_groups
        for request in self.requests:
            counts[request.group] += 1
        return counts


def make_workload(spec: WorkloadSpec) -> Workload:
    if spec.num_groups < 1 or spec.prefix_len < 0 or spec.suffix_len < 1 or spec.num_requests < 1:
        raise ValueError(f"an empty workload: {spec}")
    if spec.request_rate_per_s <= 0:
        raise ValueError(f"request_rate_per_s must be > 0, got {spec.request_rate_per_s}")
    ids = np.random.default_rng([spec.seed, 1])
    prefixes = ids.integers(100, spec.vocab_size, (spec.num_groups, spec.prefix_len)).tolist()
    suffixes = ids.integers(100, spec.vocab_size, (spec.num_requests, spec.suffix_len)).tolist()
    bs = spec.block_size
    num_prefix_blocks = spec.prefix_len // bs  # blocks made of prefix tokens only
    prefix_hashes = [hash_blocks(prefix[: num_prefix_blocks * bs], bs) for prefix in prefixes]

    picks = random.Random(spec.seed)
    weights = [1.0 / (g + 1) ** spec.zipf_s for g in range(spec.num_groups)]
    groups = picks.choices(range(spec.num_groups), weights=weights, k=spec.num_requests)
    workload = Workload(spec, prefixes, [token_text(prefix) for prefix in prefixes], [])
    now = 0.0
    for i, (group, suffix) in enumerate(zip(groups, suffixes)):
        now += picks.expovariate(spec.request_rate_per_s)
        head = prefix_hashes[group]
        tail = hash_blocks(
            prefixes[group] + suffix, bs, start_block=num_prefix_blocks, parent_hash=head[-1] if head else ROOT_HASH,
        )
        workload.requests.append(WorkloadRequest(f"req-{i}", group, now, suffix, head + tail, workload))
    return workload
