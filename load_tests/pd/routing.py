"""kvrelay's own routers inside the prefill/decode simulator (load_tests/pd/sim.py, router
"kvrelay"): the RouterState and policies a deployed kvrelay runs (router/routing_state.py,
router/policies.py), fed the routing stats each simulated replica would report.

    pool                       policy         (serving/deployments/app.py)
    prefill                    prefix_cost
    worker (colocated)         prefix_cost    the Worker pool takes the prefill router
    decode                     least_kv

A replica's stats are what its engine reports (serving/engine/engine.py `stats`, sent by the
worker every stats period): the prompt tokens it has still to compute, its measured prefill rate
(the median of its recent prefill steps, kept as the engine keeps it: `measure_step`), its running
and waiting sequences, the KV blocks it holds, the requests it took lately (RequestRate). The
simulator has no prefix reuse (each scenario run has its own cache salt), so no block hashes.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from router.policies import LeastKVPolicy, PrefixCostPolicy
from router.replica_stats import RoutingStats
from router.route_types import RouteRequest
from router.routing_state import RouterState
from serving.engine.prefill_rate import PrefillRate

__all__ = ["BLOCK_SIZE", "MIN_RATE_TOKENS", "KvrelayRouters", "measure_step", "routing_stats"]

BLOCK_SIZE = 16  # tokens per KV block, the engine's default
MIN_RATE_TOKENS = 32  # serving/engine/engine.py: steps with fewer prefill tokens do not update the measured rate


def measure_step(rate: PrefillRate, prefill_tokens: int, seconds: float) -> None:
    """A step of `prefill_tokens` prompt tokens, measured as the engine measures its steps."""
    if prefill_tokens >= MIN_RATE_TOKENS:
        rate.add(prefill_tokens, seconds)


def routing_stats(now: float, *, queued_prompt: int, prefill_rate: float, num_running: int, num_waiting: int,
                  kv_held: int, kv_capacity_tokens: int, requests_per_s: float) -> RoutingStats:
    """A replica's routing stats as its worker would send them at `now`."""
    num_blocks = kv_capacity_tokens // BLOCK_SIZE
    used = min(num_blocks, -(-kv_held // BLOCK_SIZE))
    return RoutingStats(
        wall_time_s=now, num_queued_prefill_tokens=queued_prompt, prefill_tokens_per_s=prefill_rate, num_running=num_running,
        num_waiting=num_waiting, num_blocks=num_blocks, num_free_blocks=num_blocks - used,
        kv_usage=used / num_blocks, requests_per_s=requests_per_s,
    )


class KvrelayRouters:
    """One router per pool, as the ingress holds them."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._routers: dict[str, RouterState] = {}

    def route(self, pool: str, request_id: int, prompt_tokens: int,
              candidates: Sequence[tuple[Hashable, RoutingStats | None]], now: float) -> Hashable:
        """The replica id `pool`'s router ("prefill" or "decode": the worker pool when colocated)
        picks among `candidates` (id, its last stats)."""
        if pool not in self._routers:
            prefix_cost = pool == "prefill" or self.mode == "colocated"
            self._routers[pool] = RouterState(PrefixCostPolicy() if prefix_cost else LeastKVPolicy())
        request = RouteRequest(str(request_id), num_prompt_tokens=prompt_tokens, block_size=BLOCK_SIZE)
        return self._routers[pool].route(request, candidates, now).chosen
