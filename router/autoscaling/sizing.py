"""How many replicas carry a pool's load at the planner's targets, and how the planner learns the
replicas' real capacity: the arithmetic of router/autoscaling/planner.py.

Prefill at the TTFT target. A request waits for a replica, then takes s = prompt / tokens_per_s.
With the router placing each prompt where it starts first, c replicas form one M/G/c queue;
its waiting time is approximated by Erlang C with the Allen-Cunneen factor for the variability of
s (time_cv):  P(wait > t) = C(c, a) * exp(-(c - a) / s * t * 2 / (1 + time_cv^2)),  a = rate * s.
The plan is the fewest c with P(wait > ttft - s) <= 1 - attainment: pooling makes the throughput
one replica can carry at the target grow with c, which a fixed "tokens/s per replica" misses.

Decode at the TPOT target. TPOT at batch n is tpot_base_ms + n * tpot_ms_per_seq, so a replica
keeps the target up to a batch of b_max = (tpot_ms - base) / per_seq. With speculative decoding
a step gives a sequence m tokens (its replicas measure m, PoolLoad.tokens_per_step): the profile
is then a step's time, a request needs tokens / m steps and b_max = (tpot_ms * m - base) / per_seq. A stream's TPOT is the mean
step over the tokens it decodes, and tokens are decoded where the batch is: more of them at a
large batch than the mean batch says (tokens/s is concave in the batch). So the plan does not
use Little's law at the mean batch (which planned too few replicas: 0.954 of the ramp's requests
met at attainment 0.97). It takes the stationary law of the pool's streams, a birth-death chain
with the router's even placement (decode_model.py), and the batch each decoded token sees under
it, averaged over a stream's life (its TPOT is its mean step: the spread narrows by the life
against the count's correlation time, decode_model.life_average); the plan is the fewest c at
which that batch's mean + z(attainment) * its std fits b_max. Sequences running now stay on
their replicas (their KV cache is there), so replicas added now serve only new arrivals: the
running ones keep one replica at least and size nothing else (sizing for them overshot every cold
start: the first streams pile onto the first replica while the next ones start).

Learning. With profiles.learn, each plan folds what replicas report into a correction of the
profile (an EWMA, weight learn_weight): prefill, the engine's measured prefill tokens/s over the
profile's; decode, the seconds of the decode steps the engines ran back to back over what the
profile gives the same steps, base x steps + per_seq x the sequences they decoded (each
engine's DecodeSteps account, serving/engine/engine.py). A step's time is linear in its batch, so
that ratio is the multiplier whatever the batch did, and it assumes nothing of how streams are
placed (vLLM's replicas keep it from its iterations' stats). Where no replica reports one (an
older worker), the correction is the TPOT multiplier at which the pool's stream law, at the
tokens/s its replicas made, holds the mean streams they held (decode_model.fit_correction). That
law assumes streams split evenly over the replicas, and a pool just scaled up is not even (the
running streams stay where their KV is): in the replays it read 1.003-1.061 on replicas running
exactly at the profile, where the step account reads 1. The tokens/s predicted at each replica's
mean batch read 1.06-1.18 there, since a moving batch makes fewer tokens than its mean (Jensen's
inequality).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

from router.autoscaling.decode_model import fit_correction, life_average, relaxation_s, stream_law, token_batch
from router.autoscaling.planner_policy import PlannerPolicy

__all__ = ["PoolLoad", "prefill_replicas", "decode_replicas", "replicas_for", "learn_correction"]

_EPS = 1e-9
_CORRECTION_RANGE = (0.1, 10.0)


@dataclass(frozen=True)
class PoolLoad:
    """One pool's workload and capacity, as its replicas reported them over the window."""

    requests_per_s: float
    tokens_per_request: float  # prefill: prompt tokens; decode: tokens decoded per request
    backlog: float = 0.0  # prefill: prompt tokens queued; decode: sequences running or waiting
    measured_tokens_per_s: float | None = None  # prefill: the engines' measured prefill rate
    # decode, per replica: (mean running + waiting sequences, sequence-steps per second: tokens
    # generated per second / that replica's tokens per step)
    measured_decode: tuple[tuple[float, float], ...] = ()
    # decode: tokens a sequence gains per step, the pool's (speculative decoding; 1 without)
    tokens_per_step: float = 1.0
    # (replica, requests arrived there since it started), every running replica's, where all
    # report the counter: the planner counts the pool's arrivals from them (`count_arrivals`)
    request_totals: tuple[tuple[str, float], ...] = ()
    # decode, the pool's: (engine steps/s, sequences they decoded/s, their seconds/s) of the decode
    # steps its engines ran back to back (DecodeSteps), summed over the replicas that counted
    # some; None where none did
    decode_steps: tuple[float, float, float] | None = None



def _erlang_c(c: int, a: float) -> float:
    """Probability that an arrival waits in an M/M/c queue with offered load a (< c)."""
    b = 1.0  # Erlang B by its recursion, stable for large c
    for k in range(1, c + 1):
        b = a * b / (k + a * b)
    return c * b / (c - a * (1 - b))


def prefill_replicas(policy: PlannerPolicy, rate: float, prompt_tokens: float, correction: float = 1.0,
                     queued_tokens: float = 0.0, limit: int = 4096) -> int:
    """Fewest prefill replicas keeping P(TTFT > target) <= 1 - attainment (module docstring), with
    the queued tokens drained within one interval on top."""
    if prompt_tokens <= 0:
        return 0
    rate += queued_tokens / (prompt_tokens * policy.interval_s)
    if rate <= 0:
        return 0
    profile = policy.profiles.prefill
    service_s = prompt_tokens / (profile.tokens_per_s * correction)
    offered = rate * service_s
    # A mean prompt that alone takes longer than the target misses it at any count: plan as if
    # the budget for waiting were one service time (the pool stays stable and drains its queue).
    budget_s = max(policy.targets.ttft_ms / 1000 - service_s, service_s)
    shape = 2 / (1 + profile.time_cv**2)
    miss = 1 - policy.targets.attainment
    for c in range(max(1, math.floor(offered) + 1), limit + 1):
        if _erlang_c(c, offered) * math.exp(-(c - offered) / service_s * budget_s * shape) <= miss + _EPS:
            return c
    return limit


def decode_replicas(policy: PlannerPolicy, rate: float, decode_tokens: float, correction: float = 1.0,
                    num_seqs: float = 0.0, limit: int = 4096, tokens_per_step: float = 1.0) -> int:
    """Fewest decode replicas at which the batch the decoded tokens see, at its attainment
    quantile, stays within the TPOT target; at least one while sequences run (module docstring;
    the law is router/autoscaling/decode_model.py).

    With speculative decoding a sequence gains `tokens_per_step` tokens per step (measured), so
    the law runs in steps: a request takes decode_tokens / tokens_per_step of them, and its TPOT
    is the step time / tokens_per_step, which lets a step take tokens_per_step times the target.
    The step's cost of verifying the proposals is the profile's times the learnt correction."""
    assert tokens_per_step >= 1.0, tokens_per_step
    decode = policy.profiles.decode
    base_s = decode.tpot_base_ms * correction / 1000
    per_seq_s = decode.tpot_ms_per_seq * correction / 1000
    max_batch = policy.max_batch(correction / tokens_per_step)
    z = NormalDist().inv_cdf(policy.targets.attainment)
    decode_tokens = decode_tokens / tokens_per_step  # steps per request, from here on
    work = max(0.0, rate * decode_tokens)  # sequence-steps/s to run
    if work <= 0:
        return 0 if num_seqs <= 0 else 1
    for c in range(max(1, math.floor(work * per_seq_s) + 1), limit + 1):
        law = stream_law(work, c, base_s, per_seq_s)
        if law is None:
            continue
        seen = token_batch(law, base_s, per_seq_s)
        # A stream's TPOT is its mean step over its life, not one step's: the batch's spread
        # narrows by how long a life is against how long the batch stays where it is.
        life_s = decode_tokens * (base_s + per_seq_s * seen.mean)
        seen = life_average(seen, life_s, relaxation_s(law, rate))
        if seen.mean + z * seen.std <= max_batch + _EPS:
            return c
    return limit


def replicas_for(policy: PlannerPolicy, pool: str, rate: float, tokens: float, correction: float, backlog: float,
                 tokens_per_step: float = 1.0) -> int:
    """`pool`'s replicas for `rate` requests/s of `tokens` each, its backlog drained on top."""
    if pool == "prefill":
        return prefill_replicas(policy, rate, tokens, correction, backlog)
    return decode_replicas(policy, rate, tokens, correction, backlog, tokens_per_step=tokens_per_step)


def learn_correction(policy: PlannerPolicy, pool: str, load: PoolLoad, correction: float) -> float:
    """The profile's correction with what `load` reports folded in (module docstring: Learning)."""
    profiles = policy.profiles
    sample = None
    if pool == "prefill" and load.measured_tokens_per_s:
        sample = load.measured_tokens_per_s / profiles.prefill.tokens_per_s
    elif pool == "decode" and load.decode_steps is not None:
        # A step takes correction x (base + per_seq x its sequences): over the steps counted,
        # their seconds over the profile's for the same steps (no law, no placement assumed).
        steps, rows, seconds = load.decode_steps
        decode = profiles.decode
        sample = seconds / (decode.tpot_base_ms / 1000 * steps + decode.tpot_ms_per_seq / 1000 * rows)
    elif pool == "decode" and load.measured_decode:
        # The TPOT multiplier at which the pool's law holds, at the tokens/s its replicas made,
        # the mean streams they held (decode_model.fit_correction).
        decode = profiles.decode
        sample = fit_correction(sum(b for b, _ in load.measured_decode), sum(t for _, t in load.measured_decode),
                                len(load.measured_decode), decode.tpot_base_ms / 1000, decode.tpot_ms_per_seq / 1000)
    if not profiles.learn or sample is None:
        return correction
    learnt = (1 - profiles.learn_weight) * correction + profiles.learn_weight * sample
    return min(max(learnt, _CORRECTION_RANGE[0]), _CORRECTION_RANGE[1])
