"""What a routing policy sees and says: the request (`RouteRequest`), each candidate replica's
figures (`ReplicaLoad`, from its routing stats plus the router's own accounting,
router/routing_state.py) and the answer (`Decision`). Shared by every policy
(router/policies.py, router/prefix_cost.py)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

__all__ = ["ReplicaLoad", "RouteRequest", "Decision"]


@dataclass
class ReplicaLoad:
    """What a policy knows of one replica (from its routing stats, plus local accounting)."""

    replica_id: Hashable
    num_queued_prefill_tokens: int = 0
    prefill_tokens_per_s: float = 0.0  # 0: not measured yet
    queue_wait_s: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    kv_usage: float = 0.0
    requests_per_s: float = 0.0  # requests the replica took lately (RoutingStats.requests_per_s); 0: unknown
    # Cumulative counters from its stats (RoutingStats; router/pool_load.py); -1: not reported.
    num_computed_tokens: int = -1
    num_requests: int = -1
    # What this router sent the replica after its stats were taken, net of what it saw complete
    # that the stats still count (router/routing_state.py): num_queued_prefill_tokens already includes
    # their prompt tokens; these are their KV blocks and their number, for policies that rank on
    # held KV and sequences (least_kv); negative where the stats overcount.
    unreported_blocks: int = 0
    unreported_sequences: int = 0
    # Prompt tokens it computed for this router's requests that its counters (num_computed_tokens)
    # do not show yet, completed requests left out of its queue: part of its recent load
    unreported_done_tokens: int = 0
    # LoRA adapters resident in its engine, and its cost of loading one (RoutingStats)
    lora_resident: frozenset[str] = frozenset()
    lora_load_s: float = 0.0
    lora_slots_free: int = -1  # -1: unknown


@dataclass
class RouteRequest:
    request_id: str
    num_prompt_tokens: int
    block_hashes: Sequence[int] = ()
    block_size: int = 16
    session: str | None = None
    token_ids: Sequence[int] = ()  # the prompt, for policies that match text (char_prefix_tree)
    text: str | None = None  # the prompt's text if known; else such policies use token_text(token_ids)
    lora_name: str | None = None  # the LoRA adapter it runs with; None: the base model

    @property
    def num_blocks_needed(self) -> int:
        return -(-(self.num_prompt_tokens + 1) // self.block_size)


@dataclass
class Decision:
    ranked: list[Hashable]  # best first
    reason: str  # for metrics: prefix_hit | least_cost | load_bound | tie_break | imbalance_guard | session_affinity | ...
    estimated_ttft_s: dict[Hashable, float] = field(default_factory=dict)
    num_matched_tokens: int = 0
    # PrefixCostPolicy's other terms, per replica where not 0 (router/prefix_cost.py)
    delay_s: dict[Hashable, float] = field(default_factory=dict)
    eviction_s: dict[Hashable, float] = field(default_factory=dict)
    # The prompt tokens the chosen replica holds by the router's index, whatever the policy, capped
    # as the engine caps a hit (RouterState.route): what the request should find cached there.
    num_predicted_tokens: int = 0
    # Whether the chosen replica should keep the prompt's new blocks cached as its most recently
    # used (True), or free them to its eviction end because what they would push out is worth
    # more (PrefixCostPolicy's admission, router/prefix_cost.py).
    retain: bool = True

    @property
    def chosen(self) -> Hashable:
        return self.ranked[0]
