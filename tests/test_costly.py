"""The costly share (scheduler/costly.py): which requests a tier under pressure refuses, and how many; when a
fleet is under pressure."""
from __future__ import annotations

import random

import pytest

from scheduler.costly import MIN_ARRIVALS, CostlyShare, FleetPressure


def arrivals(share: CostlyShare, prompts) -> None:
    for p in prompts:
        share.arrived(p)


def test_refuses_only_prompts_among_the_costliest_share():
    share = CostlyShare(0.05)
    prompts = list(range(1, 1001))
    random.Random(0).shuffle(prompts)
    arrivals(share, prompts)
    share.arrived(400)
    assert not share.refuse()  # a median prompt is served whatever the load
    share.arrived(940)
    assert not share.refuse()  # the 94th percentile is not among the costliest 5 %
    share.arrived(990)
    assert share.refuse()


def test_refusals_stay_within_the_share_of_arrivals():
    """Every arrival asks (a tier that always queues), every one long: at most the share is refused."""
    share = CostlyShare(0.06, recent=1000)
    arrivals(share, range(1, 1001))
    refused = 0
    for _ in range(3000):
        share.arrived(5000)
        refused += share.refuse()
    assert 0 < refused
    # over any window of the last `recent` arrivals the refusals are at most the share of them
    assert refused <= 0.06 * 1000 * 3 + 1


def test_nothing_refused_without_a_share_or_before_enough_arrivals():
    none = CostlyShare(0.0)
    arrivals(none, range(1000))
    none.arrived(10**6)
    assert not none.refuse()
    early = CostlyShare(0.5)
    arrivals(early, range(MIN_ARRIVALS - 2))
    early.arrived(10**6)
    assert not early.refuse()
    early.arrived(10**6)
    assert early.refuse()  # the MIN_ARRIVALS-th arrival may be


def test_follows_the_tiers_recent_prompts():
    share = CostlyShare(0.1, recent=MIN_ARRIVALS)
    arrivals(share, [8000] * MIN_ARRIVALS)  # a burst of long prompts, then only short ones
    arrivals(share, [100] * MIN_ARRIVALS)
    share.arrived(2000)
    assert share.refuse()  # long against the last `recent` prompts, though short against the burst


def test_pressure_holds_from_the_latest_wait_for_one_stay_and_not_before_any():
    pressure = FleetPressure()
    assert not any(pressure.on(t, hold_s=5.0) for t in (0.0, 100.0, 1e6))  # nothing ever waited: a calm fleet
    pressure.waited(10.0)
    assert pressure.on(10.0, hold_s=5.0) and pressure.on(14.9, hold_s=5.0)
    assert not pressure.on(15.0, hold_s=5.0)  # a stay has passed since
    assert pressure.on(15.0, hold_s=8.0)  # the longer the stays, the longer it holds
    pressure.waited(20.0)
    pressure.waited(18.0)  # a later word of an earlier wait moves nothing back
    assert pressure.on(24.0, hold_s=5.0) and not pressure.on(25.0, hold_s=5.0)


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="costly share"):
        CostlyShare(1.0)
    with pytest.raises(ValueError, match="costly share"):
        CostlyShare(-0.1)
    with pytest.raises(ValueError, match="recent"):
        CostlyShare(0.1, recent=10)
