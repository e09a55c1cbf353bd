"""PrefillRate: a replica's prefill tokens/s as the routers weigh it (router/prefix_cost.py).

The median of the replica's last `window` measured prefills, once it has `min_samples`; 0 before
(not measured: a router then takes the pool's mean for it). A fresh engine's first prefills carry
one-time costs (allocations, lazy initialisation, a cold cache of weights) that make them several
times slower than a warm one's; an average seeded with them made a replica that had prefilled
once look up to 10x slower than its twin, and the router sent the next request of a prefix that
replica held to compute it again on the other (seen: a tiny model's prefixes, and vLLM's). A
median of a few recent prefills shrugs off such outliers and still follows a replica that really
is slower (a busier core, other hardware), which is what the rate is for.
"""

from __future__ import annotations

from collections import deque
from statistics import median

__all__ = ["PrefillRate"]


class PrefillRate:
    def __init__(self, window: int = 16, min_samples: int = 3):
        assert 1 <= min_samples <= window, (min_samples, window)
        self.min_samples = min_samples
        self._rates: deque[float] = deque(maxlen=window)

    def add(self, num_tokens: int, seconds: float) -> None:
        """One prefill (a step's prompt tokens, or a request's): `num_tokens` in `seconds`."""
        if num_tokens > 0 and seconds > 0:
            self._rates.append(num_tokens / seconds)

    @property
    def tokens_per_s(self) -> float:
        return median(self._rates) if len(self._rates) >= self.min_samples else 0.0
