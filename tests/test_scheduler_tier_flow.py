"""A tier drains when its completions outrun its arrivals beyond the noise of both counts (scheduler/tier_flow.py)."""
from __future__ import annotations

import pytest

from scheduler.tier_flow import WINDOW_S, TierFlow


def flow(arrivals: list[float], completions: list[float]) -> TierFlow:
    f = TierFlow()
    for t in arrivals:
        f.arrived(t)
    for t in completions:
        f.completed(t)
    return f


def every(n: int, start: float, end: float) -> list[float]:
    return [start + (end - start) * i / n for i in range(n)]


def test_completions_outrunning_arrivals_beyond_two_standard_errors_drain():
    # 10 arrivals against 30 completions: 20 > 2 sqrt(40) = 12.6
    assert flow(every(10, 8.0, 10.0), every(30, 8.0, 10.0)).draining(10.0)
    # 20 against 30: 10 < 2 sqrt(50) = 14.1, within the counts' noise
    assert not flow(every(20, 8.0, 10.0), every(30, 8.0, 10.0)).draining(10.0)
    # a tier filling up, or one with nothing going on, does not drain
    assert not flow(every(30, 8.0, 10.0), every(10, 8.0, 10.0)).draining(10.0)
    assert not TierFlow().draining(5.0)


def test_only_the_last_window_counts():
    # many arrivals long ago and completions now: the arrivals have left the window
    f = flow(every(50, 0.0, 1.0), every(30, 9.0, 10.0))
    assert f.draining(10.0)
    # and once the completions are older than the window too, nothing is left to drain
    assert not f.draining(10.0 + WINDOW_S + 1.0)
    # completions 4 s ago are out of the default window, within a 6 s one
    assert not flow(every(5, 9.0, 10.0), every(30, 5.0, 6.0)).draining(10.0)
    long = TierFlow(window_s=6.0)
    for t in every(30, 5.0, 6.0):
        long.completed(t)
    for t in every(5, 9.0, 10.0):
        long.arrived(t)
    assert long.draining(10.0)


@pytest.mark.parametrize("window", [0.0, -1.0, float("nan")])
def test_a_window_that_is_not_positive_is_refused(window):
    with pytest.raises(ValueError, match="window_s"):
        TierFlow(window_s=window)


def test_a_tier_never_asked_keeps_only_its_last_window():
    f = TierFlow()
    for i in range(10_000):
        f.arrived(i * 0.01)
        f.completed(i * 0.01)
    assert len(f._arrivals) <= WINDOW_S / 0.01 + 1 and len(f._completions) <= WINDOW_S / 0.01 + 1
