"""Recurring surges: the planner's seasonal component (planner.forecast.recurrence).

A Holt forecast sees a burst only once it is in the window: with replicas that take
cold_start_s to start and a window that averages the last 30 s, capacity asked for at a burst's
start arrives when much of a short burst is over. Load that surges at a fixed period (a batch
job every 10 minutes, a cron, a retry storm on a timer) can be met on time only by remembering
when it came: this is the seasonal part that Dynamo's planner gets from Prophet or ARIMA, reduced
to what a policy with a few floats of state can keep.

    onset     the first of a run of significant rises of the pool's request rate (each
              planner.forecast.significance standard deviations of its window's count above the
              smoothed level, none more than interval_s after the last) that reaches twice the
              significance, at least cold_start_s + 2 * interval_s after the last onset: a new
              surge, not the next window of one. It is read from the load, not from the pool's scale-ups, so a surge
              that comes onto pre-warmed replicas is timed like one that does not, and a pool
              at its boundary that scales up on noise makes no onset. Its peak is the most
              replicas the surge's rate needs (without the backlog's drain: replicas up before
              a surge never see the backlog of a late pool) until the pool next moves down
    period    the gap between the last two onsets, P: a surge that came twice is expected again
              after the same gap
    pre-warm  from next - lead_s (the planner's: cold_start_s + interval_s + window_s, the
              onset being seen up to a window late; next = the last onset + k * P) until next +
              interval_s, the pool holds at least the last surge's peak, so the replicas are up
              when it comes; one that does not come (no onset within lead of `next` by the end
              of the window) forgets the period: a pattern that stops costs one pre-warm.

Why not simply hold the capacity (a longer downscale_delay_s): holding through the quiet costs
the whole gap in replica-seconds on every surge, recurring or not, where pre-warming costs
lead_s + interval_s per surge and only for surges that recurred; and a held pool still misses a
surge longer ago than the delay. Why one gap, not two that agree: a guess from any two surges
costs one pre-warm when it is wrong, and waiting for a third surge costs a whole surge's misses
when it is right (on the replays' burst traces, the third surge of six).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["Surges", "observe", "prewarm"]


@dataclass(frozen=True)
class Surges:
    """A pool's surge history (kept in PoolPlanState)."""

    last_up_at: float | None = None  # the last significant rise of the rate
    rise_from: float | None = None  # the first of the rises, none more than interval_s apart, up to it
    watched_from: float | None = None  # the first look at the load
    onset_1: float | None = None  # the one before the newest
    onset_2: float | None = None  # newest
    peak: int = 0  # the most replicas the newest surge's rate needed
    rising: bool = False  # no down decision since the newest onset
    warmed_for: float | None = None  # the onset a pre-warm is holding for


def _onset(s: Surges, at: float, count: int) -> Surges:
    return replace(s, onset_1=s.onset_2, onset_2=at, peak=count, rising=True)


def period(s: Surges) -> float | None:
    if s.onset_1 is None or s.onset_2 is None:
        return None
    return s.onset_2 - s.onset_1 if s.onset_2 > s.onset_1 else None


def next_onset(s: Surges, now: float, interval_s: float) -> float | None:
    """The next expected onset not over yet (its pre-warm ends interval_s after it)."""
    gap = period(s)
    if gap is None or s.onset_2 is None:
        return None
    k = max(1, int((now - interval_s - s.onset_2) // gap) + 1)
    return s.onset_2 + k * gap


def prewarm(s: Surges, now: float, need: int, lead_s: float, interval_s: float) -> tuple[int, Surges]:
    """The count to hold now for a recurring surge (at least `need`), and the history."""
    expected = next_onset(s, now, interval_s)
    if s.warmed_for is not None and now > s.warmed_for + 2 * interval_s + 1e-9:
        # The window of a pre-warm is over: a surge that came made an onset near it (observe());
        # one that did not breaks the pattern.
        came = s.onset_2 is not None and abs(s.onset_2 - s.warmed_for) <= lead_s + 1e-9
        s = replace(s, warmed_for=None) if came else replace(s, warmed_for=None, onset_1=None)
        expected = next_onset(s, now, interval_s)
    if expected is None or not expected - lead_s - 1e-9 <= now <= expected + interval_s + 1e-9:
        return need, s
    if s.warmed_for != expected:
        s = replace(s, warmed_for=expected)
    return max(need, s.peak), s


def observe(s: Surges, now: float, rise: int, size: int, quiet_s: float, interval_s: float) -> Surges:
    """Fold one look at the load into the history. `rise`: 0, the rate did not rise
    significantly; 1, it did; 2, by twice the significance (a surge, not noise). `size`: the
    replicas the rate needs now, without the backlog's drain (module docstring)."""
    if s.watched_from is None:
        s = replace(s, watched_from=now)
    if rise >= 1:
        if s.last_up_at is None or now - s.last_up_at > interval_s + 1e-9:
            s = replace(s, rise_from=now)  # a new run of rises
        s = replace(s, last_up_at=now)
        start = s.rise_from if s.rise_from is not None else now
        new = s.onset_2 is None or start - s.onset_2 >= quiet_s - 1e-9
        # The pool's first quiet_s are the load's start (its windows fill), not a surge.
        if rise >= 2 and new and start - s.watched_from >= quiet_s - 1e-9:
            return _onset(s, start, size)
    return replace(s, peak=max(s.peak, size)) if s.rising else s


def moved_down(s: Surges) -> Surges:
    return replace(s, rising=False)
