"""Recurring surges (router/autoscaling/recurrence.py): exact histories, step by step."""

from __future__ import annotations

from router.autoscaling.recurrence import Surges, moved_down, next_onset, observe, period, prewarm

QUIET, INTERVAL, LEAD = 90.0, 30.0, 60.0


def surge(s: Surges, at: float, base: int = 2, peak: int = 8) -> Surges:
    """One surge: the plan wants `peak` at `at` (from `base`), the pool comes down later."""
    s = observe(s, at, base, peak, QUIET, INTERVAL)
    return moved_down(observe(s, at + 300, peak, base, QUIET, INTERVAL))


def test_two_equal_gaps_make_a_period_and_one_does_not():
    s = surge(surge(Surges(), 300), 900)
    assert (s.onset_1, s.onset_2, period(s, INTERVAL)) == (300, 900, None)
    s = surge(s, 1510)  # 610 s after 600: within one interval
    assert (period(s, INTERVAL), next_onset(s, 1600, INTERVAL)) == (610, 2120)
    assert surge(s, 1900).onset_2 == 1900 and period(surge(s, 1900), INTERVAL) is None


def test_the_next_step_of_a_surge_is_not_an_onset():
    s = observe(Surges(), 300, 2, 5, QUIET, INTERVAL)
    s = observe(s, 330, 5, 9, QUIET, INTERVAL)  # 30 s after the last up: the same surge
    assert (s.onset_2, s.peak, s.last_up_at) == (300, 9, 330)


def test_prewarm_holds_the_peak_from_lead_before_the_expected_onset():
    s = surge(surge(surge(Surges(), 300), 900), 1500)
    assert prewarm(s, 2039, 2, 2, LEAD, INTERVAL)[0] == 2  # 61 s before 2100
    count, s = prewarm(s, 2040, 2, 2, LEAD, INTERVAL)
    assert (count, s.warmed_for, s.warm_base) == (8, 2100, 2)
    # The surge comes onto the warm replicas (its need, 7, above the base 2): an onset at 2100,
    # and the period goes on.
    s = observe(s, 2110, 8, 7, QUIET, INTERVAL)
    assert (s.onset_2, s.peak, period(s, INTERVAL)) == (2100, 7, 600)
    assert prewarm(s, 2170, 8, 2, LEAD, INTERVAL)[1].warmed_for is None


def test_a_surge_that_does_not_come_forgets_the_period():
    s = surge(surge(surge(Surges(), 300), 900), 1500)
    _, s = prewarm(s, 2040, 2, 2, LEAD, INTERVAL)
    s = observe(s, 2130, 8, 2, QUIET, INTERVAL)  # nothing above the base
    count, s = prewarm(s, 2161, 8, 2, LEAD, INTERVAL)
    assert (count, period(s, INTERVAL), s.warmed_for) == (2, None, None)
