"""Recurring surges (router/autoscaling/recurrence.py): exact histories, step by step."""

from __future__ import annotations

from router.autoscaling.recurrence import Surges, moved_down, next_onset, observe, period, prewarm

QUIET, INTERVAL, LEAD = 90.0, 30.0, 90.0


def look(s: Surges, at: float, rise: int, size: int) -> Surges:
    return observe(s, at, rise, size, QUIET, INTERVAL)


def watched() -> Surges:
    return look(Surges(), 0.0, 0, 2)


def surge(s: Surges, at: float, base: int = 2, peak: int = 8) -> Surges:
    """One surge: the rate rises significantly at `at`, by twice that 10 s later (its size then
    `peak`), and the pool comes down later."""
    s = look(look(s, at, 1, base + 1), at + 10, 2, peak)
    return moved_down(look(s, at + 300, 0, base))


def test_one_gap_makes_a_period():
    s = surge(watched(), 300)
    assert (s.onset_2, period(s)) == (300, None)
    s = surge(s, 900)
    assert (s.onset_1, s.onset_2, period(s), next_onset(s, 1000, INTERVAL)) == (300, 900, 600, 1500)


def test_the_onset_is_the_first_of_a_run_of_rises_that_a_surge_confirms():
    s = look(look(watched(), 300, 1, 3), 305, 1, 4)  # significant rises: noise, or a surge's start
    assert s.onset_2 is None and s.rise_from == 300
    s = look(s, 310, 2, 6)  # twice the significance: a surge, which began with the run at 300
    assert (s.onset_2, s.peak, s.rising) == (300, 6, True)
    s = look(look(s, 330, 2, 9), 340, 0, 7)  # the same surge: its peak, no new onset
    assert (s.onset_1, s.onset_2, s.peak) == (None, 300, 9)
    # A run of rises more than an interval after the last is a new run; within QUIET of the
    # onset it is no new surge.
    s = look(s, 375, 2, 9)
    assert (s.rise_from, s.onset_2) == (375, 300)
    s = look(s, 500, 2, 8)
    assert (s.rise_from, s.onset_1, s.onset_2, s.peak) == (500, 300, 500, 8)


def test_the_load_s_first_quiet_s_make_no_onset():
    s = look(look(watched(), 50, 2, 8), 80, 2, 8)  # the windows are still filling
    assert (s.watched_from, s.onset_2) == (0.0, None)
    assert look(s, 95, 2, 8).onset_2 is None  # the run began at 50
    assert look(s, 200, 2, 8).onset_2 == 200


def test_prewarm_holds_the_peak_from_lead_before_the_expected_onset():
    s = surge(surge(watched(), 300), 900)
    assert prewarm(s, 1409, 2, LEAD, INTERVAL)[0] == 2  # 91 s before 1500
    count, s = prewarm(s, 1410, 2, LEAD, INTERVAL)
    assert (count, s.warmed_for) == (8, 1500)
    # The surge comes onto the warm replicas: its onset from the load, 5 s early.
    s = surge(s, 1495, peak=7)
    count, s = prewarm(s, 1561, 2, LEAD, INTERVAL)
    assert (count, s.warmed_for, s.onset_2, period(s)) == (2, None, 1495, 595)


def test_a_surge_that_does_not_come_forgets_the_period():
    s = surge(surge(watched(), 300), 900)
    _, s = prewarm(s, 1410, 2, LEAD, INTERVAL)
    s = look(s, 1530, 1, 3)  # a significant rise, not a surge
    count, s = prewarm(s, 1561, 2, LEAD, INTERVAL)
    assert (count, period(s), s.warmed_for, s.onset_2) == (2, None, None, 900)
