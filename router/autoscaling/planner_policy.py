"""The planner's section of the policy YAML: size prefill and decode together from the workload.

    mode: planner                  # reactive (default) | planner: what drives the live P/D pools
    prefill: {min_replicas: 1, max_replicas: 16}   # the bounds (and Serve windows) of each pool
    decode:  {min_replicas: 1, max_replicas: 16}
    planner:
      interval_s: 30               # one plan per interval
      targets: {ttft_ms: 2000, tpot_ms: 100, attainment: 0.95}
      forecast: {alpha: 0.5, beta: 0.3, significance: 2, recurrence: false}   # Holt's linear trend (beta 0: plain EWMA)
      cold_start_s: 30             # a new replica's start: how far ahead the forecast looks
      profiles:                    # one replica's measured capacity
        prefill: {tokens_per_s: 296.4, time_cv: 0.3}
        decode: {tpot_base_ms: 27.7, tpot_ms_per_seq: 15.4}
        learn: true                # correct both from what the replicas report
      ratio: {min_prefill_per_decode: 0.25, max_prefill_per_decode: 4}
      downscale_delay_s: 120       # hysteresis: how long a lower plan must last ...
      dead_band: 0.1               # ... and by how much it must clear one replica fewer

The reactive sections (`prefill:`, `decode:`) stay: under `mode: planner` their min_replicas,
max_replicas, window_s, metrics_interval_s and stale_after_s bound the plan, and their targets
and delays are unused; `kvrelay policy simulate --workload` replays both policies from one file.
The arithmetic is router/autoscaling/planner.py.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from router.autoscaling.bounds import DEFAULT_DOWNSCALE_DELAY_S, DOWNSCALE_DELAY_S, TPOT_MS, TTFT_MS
from router.autoscaling.errors import FieldError
from serving.engine.strict import StrictModel

__all__ = ["PlannerTargets", "ForecastConfig", "PrefillProfile", "DecodeProfile", "CapacityProfiles",
           "RatioBound", "PlannerPolicy"]


class PlannerTargets(StrictModel):
    ttft_ms: float = Field(
        2000.0, **TTFT_MS,
        description="TTFT bound of a request in ms (arrival to first token): what the prefill pool is sized for.",
    )
    tpot_ms: float = Field(
        100.0, **TPOT_MS,
        description="TPOT bound of a request in ms ((finish - first token) / (tokens - 1)): what the "
        "decode pool is sized for.",
    )
    attainment: float = Field(
        0.95, ge=0.5, lt=1,
        description="Fraction of requests the plan keeps within each bound: the queueing headroom "
        "(prefill: the TTFT tail; decode: the concurrent-streams quantile).",
    )


class ForecastConfig(StrictModel):
    alpha: float = Field(
        0.5, gt=0, le=1, description="Holt's level weight: how much of each new interval's value the level takes."
    )
    beta: float = Field(
        0.3, ge=0, le=1,
        description="Holt's trend weight: how much of each level change the trend takes; 0 is plain EWMA (no trend).",
    )
    significance: float = Field(
        2.0, ge=0, le=10,
        description="How far, in standard deviations of its Poisson count, a window's request rate must "
        "rise above the smoothed level to be planned for at once; a smaller rise is noise and the level "
        "is planned for (a window of window_s seconds counts about rate x window_s arrivals). 0 plans "
        "for every window's rate that is above the level.",
    )
    recurrence: bool = Field(
        False,
        description="Learn surges that recur at a fixed period (the last two gaps between three surges "
        "agree within interval_s) and pre-warm the last surge's count cold_start_s + interval_s before "
        "the next (router/autoscaling/recurrence.py).",
    )


class PrefillProfile(StrictModel):
    tokens_per_s: float = Field(
        ..., gt=0, le=10_000_000,
        description="Prompt tokens one prefill replica computes per second while busy (measured: "
        "`kvrelay bench engine`, or scenario calibration's prefill_tokens_per_s).",
    )
    time_cv: float = Field(
        1.0, ge=0, le=4,
        description="Coefficient of variation of one request's prefill time (its prompt length's "
        "std / mean): 1 is exponential (the conservative default), 0 all prompts alike.",
    )


class DecodeProfile(StrictModel):
    tpot_base_ms: float = Field(
        ..., ge=0, le=60_000,
        description="A decode step's fixed cost in ms: TPOT at batch n is tpot_base_ms + n * tpot_ms_per_seq "
        "(fit it through two measured batch sizes).",
    )
    tpot_ms_per_seq: float = Field(
        ..., gt=0, le=60_000, description="A decode step's cost per running sequence, in ms."
    )

    def tpot_ms(self, num_seqs: float) -> float:
        return self.tpot_base_ms + num_seqs * self.tpot_ms_per_seq


class CapacityProfiles(StrictModel):
    prefill: PrefillProfile = Field(..., description="One prefill replica's measured prefill rate.")
    decode: DecodeProfile = Field(..., description="One decode replica's measured TPOT against its batch.")
    learn: bool = Field(
        True,
        description="Correct the profiles from what replicas report (prefill: the engine's measured "
        "prefill_tokens_per_s; decode: the step time at the observed batch).",
    )
    learn_weight: float = Field(
        0.2, gt=0, le=1, description="Weight of each new observation in the learnt correction (an EWMA)."
    )


class RatioBound(StrictModel):
    min_prefill_per_decode: float = Field(
        0.1, gt=0, le=64, description="Fewest prefill replicas per decode replica (raises prefill)."
    )
    max_prefill_per_decode: float = Field(
        10.0, gt=0, le=64, description="Most prefill replicas per decode replica (raises decode)."
    )

    @model_validator(mode="after")
    def _ordered(self):
        if self.max_prefill_per_decode < self.min_prefill_per_decode:
            raise FieldError(
                "max_prefill_per_decode", self.max_prefill_per_decode,
                f"below min_prefill_per_decode = {self.min_prefill_per_decode} "
                f"(allowed: >= {self.min_prefill_per_decode} and <= 64)",
            )
        return self


class PlannerPolicy(StrictModel):
    interval_s: float = Field(
        30.0, ge=1, le=3600,
        description="One plan per interval: the forecast's step, and the least time between two plans.",
    )
    targets: PlannerTargets = Field(default_factory=PlannerTargets, description="The SLO the plan is sized for.")
    forecast: ForecastConfig = Field(
        default_factory=ForecastConfig, description="The forecast of the next interval's load (Holt's linear trend)."
    )
    profiles: CapacityProfiles = Field(..., description="Each replica's measured capacity.")
    ratio: RatioBound = Field(default_factory=RatioBound, description="Bound on prefill replicas per decode replica.")
    downscale_delay_s: float = Field(
        DEFAULT_DOWNSCALE_DELAY_S, **DOWNSCALE_DELAY_S,
        description="A pool shrinks only after its plan has stayed lower this long; it then takes "
        "the highest plan of that time.",
    )
    cold_start_s: float = Field(
        0.0, ge=0, le=3600,
        description="Seconds a new replica takes before it takes work (model load, warm-up): the "
        "forecast looks this far ahead (a count decided now carries the load until a replica asked "
        "for later can; between plans the pool scales up as soon as its need outgrows it).",
    )
    dead_band: float = Field(
        0.1, ge=0, lt=1,
        description="A pool shrinks only if its need, grown by this fraction, still fits one replica "
        "fewer (hysteresis against flapping).",
    )

    @model_validator(mode="after")
    def _one_stream_fits(self):
        decode = self.profiles.decode
        if decode.tpot_ms(1) > self.targets.tpot_ms:
            raise FieldError(
                "targets.tpot_ms", self.targets.tpot_ms,
                f"below one sequence's TPOT in the decode profile ({decode.tpot_ms(1):g} ms = "
                f"tpot_base_ms + tpot_ms_per_seq): no batch meets it (allowed: >= {decode.tpot_ms(1):g})",
            )
        return self

    @property
    def horizon_steps(self) -> float:
        """How many intervals ahead the forecast looks: cold_start_s. A replica asked for now
        takes work cold_start_s from now, and between plans a pool whose need outgrows its count
        scales up at once, so a count decided now has to carry the load until a replica asked
        for at any later moment can: cold_start_s, not cold_start_s + interval_s."""
        return self.cold_start_s / self.interval_s

    def max_batch(self, correction: float = 1.0) -> float:
        """The largest mean batch whose TPOT (the profile's, times the learnt correction) meets the target."""
        decode = self.profiles.decode
        return max(1.0, (self.targets.tpot_ms / correction - decode.tpot_base_ms) / decode.tpot_ms_per_seq)
