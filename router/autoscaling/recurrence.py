"""Recurring surges: the planner's seasonal component (planner.forecast.recurrence).

A Holt forecast sees a burst only once it is in the window: with replicas that take
cold_start_s to start and a window that averages the last 30 s, capacity asked for at a burst's
start arrives when much of a short burst is over. Load that surges at a fixed period (a batch
job every 10 minutes, a cron, a retry storm on a timer) can be met on time only by remembering
when it came: this is the seasonal part that Dynamo's planner gets from Prophet or ARIMA, reduced
to what a policy with a few floats of state can keep.

    onset     an up decision after a quiet of at least cold_start_s + 2 * interval_s without one
              (a new surge, not the next step of one); its peak is the highest count planned
              until the pool next moves down
    period    the last two gaps between three onsets agree within interval_s: the surge has
              recurred twice at the same gap, P = the last gap
    pre-warm  from next - cold_start_s - interval_s (next = the last onset + k * P) until next +
              interval_s, the pool holds at least the last surge's peak, so the replicas are up
              when it comes; a surge met that way is an onset at `next` (its peak updated from
              the plan), and one that does not come (no plan above the pre-warm's base within
              the window) forgets the period: a pattern that stops costs one pre-warm.

Why not simply hold the capacity (a longer downscale_delay_s): holding through the quiet costs
the whole gap in replica-seconds on every surge, recurring or not, where pre-warming costs
cold_start_s + interval_s per surge and only for surges that recurred; and a held pool still
misses a surge longer ago than the delay. Why two gaps, not one: one gap is any two surges.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["Surges", "observe", "prewarm"]


@dataclass(frozen=True)
class Surges:
    """A pool's surge history (kept in PoolPlanState)."""

    last_up_at: float | None = None
    onset_0: float | None = None  # oldest of the last three onsets
    onset_1: float | None = None
    onset_2: float | None = None  # newest
    peak: int = 0  # the highest count planned in the newest surge
    rising: bool = False  # no down decision since the newest onset
    warmed_for: float | None = None  # the onset a pre-warm is holding for
    warm_base: int = 0  # the count before that pre-warm


def _onset(s: Surges, at: float, count: int) -> Surges:
    return replace(s, onset_0=s.onset_1, onset_1=s.onset_2, onset_2=at, peak=count, rising=True)


def period(s: Surges, tolerance_s: float) -> float | None:
    if s.onset_0 is None or s.onset_1 is None or s.onset_2 is None:
        return None
    first, last = s.onset_1 - s.onset_0, s.onset_2 - s.onset_1
    return last if abs(last - first) <= tolerance_s and last > 0 else None


def next_onset(s: Surges, now: float, interval_s: float) -> float | None:
    """The next expected onset not over yet (its pre-warm ends interval_s after it)."""
    gap = period(s, interval_s)
    if gap is None or s.onset_2 is None:
        return None
    k = max(1, int((now - interval_s - s.onset_2) // gap) + 1)
    return s.onset_2 + k * gap


def prewarm(s: Surges, now: float, current: int, need: int, lead_s: float, interval_s: float) -> tuple[int, Surges]:
    """The count to hold now for a recurring surge (at least `need`), and the history."""
    expected = next_onset(s, now, interval_s)
    if s.warmed_for is not None and now > s.warmed_for + 2 * interval_s + 1e-9:
        # The window of a pre-warm is over: a surge that came was recorded by observe(); one
        # that did not breaks the pattern.
        s = replace(s, warmed_for=None, onset_0=None) if s.onset_2 != s.warmed_for else replace(s, warmed_for=None)
        expected = next_onset(s, now, interval_s)
    if expected is None or not expected - lead_s - 1e-9 <= now <= expected + interval_s + 1e-9:
        return need, s
    if s.warmed_for != expected:
        s = replace(s, warmed_for=expected, warm_base=current)
    return max(need, s.peak), s


def observe(s: Surges, now: float, current: int, need: int, quiet_s: float, interval_s: float) -> Surges:
    """Fold one plan's own need (before pre-warm and hysteresis) into the history."""
    if (s.warmed_for is not None and s.onset_2 != s.warmed_for and s.warmed_for - 1e-9 <= now
            <= s.warmed_for + 2 * interval_s + 1e-9 and need > s.warm_base):
        # The surge came as expected, onto the pre-warmed replicas: an onset at its time.
        s = _onset(s, s.warmed_for, need)
        return replace(s, last_up_at=now) if need > current else s
    if need > current:
        quiet = s.last_up_at is None or now - s.last_up_at >= quiet_s - 1e-9
        s = _onset(s, now, need) if quiet else replace(s, peak=max(s.peak, need))
        return replace(s, last_up_at=now)
    return replace(s, peak=max(s.peak, need)) if s.rising else s


def moved_down(s: Surges) -> Surges:
    return replace(s, rising=False)
