"""The costly share (scheduler/costly.py): which requests a tier under pressure refuses, and how many; when a
fleet is under pressure."""
from __future__ import annotations

import math
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


def spare_refusals(share: CostlyShare, arrivals_n: int, losses_every: int | None, spare: bool = True) -> int:
    """Every arrival long and asking, with a tighter tier shedding when `spare`; a loss of another kind every
    `losses_every` arrivals (None: none). The refusals over the last `recent` arrivals."""
    refused = []
    for i in range(arrivals_n):
        share.arrived(5000)
        if losses_every and i % losses_every == 0:
            share.lost()
        refused.append(share.refuse(spare))
    return sum(refused[-share.recent:])


def test_a_tier_spends_what_is_left_of_its_allowance_only_while_a_tighter_tier_sheds():
    """Share 0.08 of 1000 recent arrivals, the margins' 0.02: with no other losses it may refuse its whole tenth
    less one standard error of it (sqrt(0.1 * 0.9 / 1000) = 0.0095): 90 of 1000, not 80; without `spare`, 80."""
    spare = CostlyShare(0.08, 0.02, recent=1000)
    arrivals(spare, range(1, 1001))
    assert spare_refusals(spare, 3000, None) == 90
    assert spare.spare_share() == pytest.approx(0.1 - math.sqrt(0.1 * 0.9 / 1000))
    plain = CostlyShare(0.08, 0.02, recent=1000)
    arrivals(plain, range(1, 1001))
    assert spare_refusals(plain, 3000, None, spare=False) == 80


def test_other_losses_take_from_the_spare_never_from_the_share():
    """One loss in 50 (2 % of arrivals): what is left is 0.1 - 0.0095 - 0.02 < 0.08, so the share holds; one in
    200 (0.5 %): 0.0855 of arrivals are refused, and refusals and losses together stay within the allowance."""
    lossy = CostlyShare(0.08, 0.02, recent=1000)
    arrivals(lossy, range(1, 1001))
    assert spare_refusals(lossy, 3000, 50) == 80
    light = CostlyShare(0.08, 0.02, recent=1000)
    arrivals(light, range(1, 1001))
    refused = spare_refusals(light, 3000, 200)
    assert refused == 85
    assert refused + 1000 // 200 <= 0.1 * 1000


def test_losses_older_than_the_recent_arrivals_are_forgotten():
    share = CostlyShare(0.08, 0.02, recent=MIN_ARRIVALS)
    assert share.spare_share() == 0.0  # nothing to spare before a tier has been seen long enough
    arrivals(share, [100] * MIN_ARRIVALS)
    for _ in range(MIN_ARRIVALS):
        share.lost()  # a storm of late requests: nothing left to spare
    assert share.spare_share() < 0
    arrivals(share, [100] * MIN_ARRIVALS)
    assert share.spare_share() == pytest.approx(0.1 - math.sqrt(0.1 * 0.9 / MIN_ARRIVALS))


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
    with pytest.raises(ValueError, match="margins share"):
        CostlyShare(0.08, 0.95)
    with pytest.raises(ValueError, match="recent"):
        CostlyShare(0.1, recent=10)
