"""The decode pool's streams as a birth-death chain: what the planner sizes decode with, and
what it learns the decode profile's correction from.

    step(n) = base + per_seq * n                (a replica's decode step at batch n, seconds)
    m streams on c replicas, balanced (the router places each on the fewest sequences):
        s = m mod c replicas hold q + 1 = m // c + 1, the others q
    token_rate(m) = sum over replicas of n / step(n)          (tokens/s the pool decodes at m)

Streams arrive at rate lambda, each decoding L tokens: at m streams one leaves at
token_rate(m) / L, so the stationary law is P(m) ~ prod_{i<=m} work / token_rate(i), work =
lambda * L tokens/s (processor sharing with a state-dependent rate: the law does not depend on
the output lengths' distribution, only on their mean). For c = 1 it is negative binomial.

Why not the mean batch. tokens/s is concave in the batch, so a pool whose batch moves decodes
fewer tokens than its mean batch predicts, and a stream decodes most of its tokens where the
batch is larger than the mean: the tokens decoded at m are work * P(m - 1) (each is the state
an arrival saw, plus itself). The planner sizes decode by the batch its tokens see
(`token_batch`), and the learnt correction compares the mean batch the replicas held with the
one this law predicts at the tokens/s they made (`learn_correction`), so it reads 1 on replicas
that run at the profile, whatever their batch did.
"""

from __future__ import annotations

import math
from typing import NamedTuple

__all__ = ["token_rate", "stream_law", "StreamLaw", "TokenBatch", "token_batch", "relaxation_s", "life_average",
           "fit_correction"]

_TAIL = 1e-10  # stop the law where what is left is below this fraction
_RESCALE = 1e150


def token_rate(m: int, c: int, base_s: float, per_seq_s: float) -> float:
    """Tokens/s c replicas decode with m streams placed evenly."""
    q, s = divmod(m, c)
    rate = s * (q + 1) / (base_s + per_seq_s * (q + 1))
    if q:
        rate += (c - s) * q / (base_s + per_seq_s * q)
    return rate


class StreamLaw(NamedTuple):
    probabilities: tuple[float, ...]  # P(m streams in the pool), m = 0, 1, ...
    c: int

    @property
    def mean(self) -> float:
        return math.fsum(m * p for m, p in enumerate(self.probabilities))


def stream_law(work: float, c: int, base_s: float, per_seq_s: float) -> StreamLaw | None:
    """The stationary law of the pool's stream count; None when c replicas cannot decode `work`
    tokens/s at all (work * per_seq >= c)."""
    assert c >= 1 and base_s >= 0 and per_seq_s > 0, (c, base_s, per_seq_s)
    if work * per_seq_s >= c * (1 - 1e-9):
        return None
    if work <= 0:
        return StreamLaw((1.0,), c)
    weights = [1.0]
    total, m = 1.0, 0
    while True:
        m += 1
        ratio = work / token_rate(m, c, base_s, per_seq_s)
        weights.append(weights[-1] * ratio)
        total += weights[-1]
        if total > _RESCALE:
            weights = [w / total for w in weights]
            total = 1.0
        # The ratio falls towards work * per_seq / c < 1: what is left is below a geometric tail.
        if ratio < 1 and weights[-1] * ratio / (1 - ratio) < _TAIL * total:
            break
    return StreamLaw(tuple(w / total for w in weights), c)


class TokenBatch(NamedTuple):
    """The batch at which the pool's tokens are decoded: its mean and standard deviation."""

    mean: float
    std: float


def token_batch(law: StreamLaw, base_s: float, per_seq_s: float) -> TokenBatch:
    """The batch each decoded token sees, over the stationary law: the tokens decoded at m
    streams are proportional to P(m - 1), split between the replicas holding q + 1 and q by the
    tokens each decodes."""
    c = law.c
    first = second = 0.0
    for m in range(1, len(law.probabilities) + 1):
        weight = law.probabilities[m - 1]
        q, s = divmod(m, c)
        high = s * (q + 1) / (base_s + per_seq_s * (q + 1))
        low = (c - s) * q / (base_s + per_seq_s * q) if q else 0.0
        share = high / (high + low)
        mean_here = q + share
        first += weight * mean_here
        second += weight * (share * (q + 1) ** 2 + (1 - share) * q**2)
    return TokenBatch(first, math.sqrt(max(0.0, second - first * first)))


def relaxation_s(law: StreamLaw, arrivals_per_s: float) -> float:
    """The integrated autocorrelation time of the pool's stream count under the chain, seconds:
    how long the count remembers where it was. For a birth-death chain with birth rate lambda the
    time average of f over a long window T has variance 2 * sum_k F_k^2 / (pi_k * lambda) / T,
    F_k = sum_{j<=k} pi_j (f(j) - mean); with f(m) = m this over 2 * Var(m) is the time. (For
    M/M/infinity, streams that each last T, it is T exactly.)"""
    probabilities = law.probabilities
    mean = law.mean
    variance = math.fsum(p * (m - mean) ** 2 for m, p in enumerate(probabilities))
    if arrivals_per_s <= 0 or variance <= 0:
        return 0.0
    partial = 0.0
    total = 0.0
    for m, p in enumerate(probabilities[:-1]):  # the last state's F is the whole sum: zero
        partial += p * (m - mean)
        if p > 0:
            total += partial * partial / (p * arrivals_per_s)
    return total / variance


def life_average(seen: TokenBatch, life_s: float, relaxation: float) -> TokenBatch:
    """The law of the batch averaged over one stream's life: the same mean, a narrower spread.
    A stream's TPOT is its mean step over its tokens, and the batch it sees at its tokens is
    correlated over `relaxation` seconds; with an exponential correlation the variance of the
    mean over a life of T is Var * 2 (x - 1 + e^-x) / x^2, x = T / relaxation (1 for a life
    much shorter than the correlation, 2 / x for a much longer one)."""
    if relaxation <= 0 or life_s <= 0:
        return seen
    x = life_s / relaxation
    factor = 2 * (x - 1 + math.exp(-x)) / (x * x) if x > 1e-6 else 1.0
    return TokenBatch(seen.mean, seen.std * math.sqrt(factor))


def fit_correction(mean_streams: float, tokens_per_s: float, c: int, base_s: float, per_seq_s: float) -> float | None:
    """The TPOT multiplier k at which the law's mean stream count, at the tokens/s the pool made,
    is the mean it held (`mean_streams`, summed over its c replicas); None if nothing was decoded.

    The mean grows with k (a slower step holds each stream longer), so k is found by bisection."""
    if tokens_per_s <= 0 or mean_streams <= 0:
        return None

    def mean_at(k: float) -> float:
        law = stream_law(tokens_per_s, c, base_s * k, per_seq_s * k)
        return math.inf if law is None else law.mean

    lo, hi = 0.05, 20.0
    if mean_at(lo) >= mean_streams:
        return lo
    if mean_at(hi) <= mean_streams:
        return hi
    for _ in range(50):
        mid = math.sqrt(lo * hi)
        if mean_at(mid) < mean_streams:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)
