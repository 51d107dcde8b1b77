"""SLO deadlines, tiers, and the three attainment views, on hand-computed numbers.

Times use binary fractions (0.0625 s = 62.5 ms, ...) so every deadline and gap is exact in floating point.
"""
import pytest

from types import SimpleNamespace

from scheduler import SLO, AttainmentTally, Tier, TierSet, measure_request, next_token_deadline
from scheduler.slo import deadline_terms
from scheduler.tiers import parse_tiers


def test_cumulative_token_deadline():
    slo = SLO(ttft_ms=200, tpot_ms=50)
    assert slo.token_deadline(10.0, 1) == pytest.approx(10.2)
    assert slo.token_deadline(10.0, 3) == pytest.approx(10.3)
    # the next token of a request that has 2 outputs is token 3
    first_token_due, tpot_s = deadline_terms(10.0, slo)
    request = SimpleNamespace(first_token_due=first_token_due, tpot_s=tpot_s, num_output_tokens=2)
    assert next_token_deadline(request) == slo.token_deadline(10.0, 3)


@pytest.mark.parametrize("ttft, tpot", [(0, 50), (200, 0), (-1, 50)])
def test_slo_rejects_non_positive(ttft, tpot):
    with pytest.raises(ValueError, match="positive"):
        SLO(ttft_ms=ttft, tpot_ms=tpot)


TIERS = TierSet([Tier("gold", tpot_ms=20, ttft_ms=200), Tier("silver", tpot_ms=50, ttft_ms=500),
                 Tier("bronze", tpot_ms=100, ttft_ms=1000)])


@pytest.mark.parametrize("tpot, tier", [(20, "gold"), (35, "gold"), (50, "silver"), (70, "silver"),
                                        (100, "bronze"), (5000, "bronze")])
def test_tpot_between_tiers_joins_the_tighter(tpot, tier):
    assert TIERS.for_tpot(tpot).name == tier


def test_resolve_by_name_and_by_value():
    tier, slo = TIERS.resolve("silver")
    assert tier.name == "silver" and slo == SLO(ttft_ms=500, tpot_ms=50)
    own = SLO(ttft_ms=300, tpot_ms=70)
    tier, slo = TIERS.resolve(own)
    assert tier.name == "silver" and slo is own  # binned into silver, still held to its own SLO


def test_tier_errors_name_the_problem():
    with pytest.raises(ValueError, match="tighter than the tightest tier gold"):
        TIERS.for_tpot(10)
    with pytest.raises(ValueError, match="unknown tier 'platinum'.*gold, silver, bronze"):
        TIERS.resolve("platinum")
    with pytest.raises(ValueError, match="tightest TPOT first"):
        TierSet([Tier("slow", 100, 1000), Tier("fast", 20, 200)])
    with pytest.raises(ValueError, match="unique"):
        TierSet([Tier("a", 20, 200), Tier("a", 50, 500)])
    with pytest.raises(TypeError):
        TIERS.resolve(50)


def test_default_tier_and_tier_specs():
    assert TIERS.resolve(None) == (TIERS.by_name("bronze"), TIERS.by_name("bronze").slo)  # the loosest by default
    chosen = TierSet(list(TIERS), default="silver")
    assert chosen.resolve(None)[0].name == "silver"
    parsed = parse_tiers("gold:20:200, silver:50:500", default="gold")
    assert [(t.name, t.tpot_ms, t.ttft_ms) for t in parsed] == [("gold", 20.0, 200.0), ("silver", 50.0, 500.0)]
    assert parsed.default.name == "gold"
    with pytest.raises(ValueError, match="name:tpot_ms:ttft_ms"):
        parse_tiers("gold:20")
    with pytest.raises(ValueError, match="unknown tier 'platinum'"):
        parse_tiers("gold:20:200", default="platinum")


# SLO: ttft 125 ms, tpot 62.5 ms, arrival 1.0 -> token deadlines 1.125, 1.1875, 1.25, 1.3125
SLO_EXACT = SLO(ttft_ms=125, tpot_ms=62.5)


def test_all_three_views_attained():
    m = measure_request(SLO_EXACT, 1.0, [1.0, 1.0625, 1.125, 1.1875])
    assert (m.attained, m.attained_mean_tpot, m.attained_max_gap) == (True, True, True)
    assert m.ttft == 0.0 and m.mean_tpot == 0.0625 and m.max_gap == 0.0625
    assert m.worst_lateness == -0.125


def test_cumulative_lets_a_late_gap_be_made_up():
    # first token early; a 125 ms gap, then fast tokens: every token still by its deadline
    m = measure_request(SLO_EXACT, 1.0, [1.0625, 1.1875, 1.1953125, 1.25])
    assert m.attained and m.attained_mean_tpot and not m.attained_max_gap
    assert m.max_gap == 0.125 and m.mean_tpot == 0.0625 and m.worst_lateness == 0.0


def test_mean_tpot_hides_a_late_token():
    # token 2 at 1.25 misses its deadline 1.1875 by 62.5 ms; the mean over the three gaps is exactly 62.5 ms
    m = measure_request(SLO_EXACT, 1.0, [1.0625, 1.25, 1.25, 1.25])
    assert not m.attained and m.attained_mean_tpot and not m.attained_max_gap
    assert m.worst_lateness == 0.0625


def test_early_first_token_attains_cumulative_but_not_mean():
    # every token exactly on its deadline after an instant first token: mean gap 104 ms > 62.5 ms
    m = measure_request(SLO_EXACT, 1.0, [1.0, 1.1875, 1.25, 1.3125])
    assert m.attained and not m.attained_mean_tpot and not m.attained_max_gap
    assert m.mean_tpot == pytest.approx(0.3125 / 3)


def test_late_first_token_fails_every_view():
    m = measure_request(SLO_EXACT, 1.0, [1.25])
    assert m.num_tokens == 1 and m.mean_tpot is None and m.max_gap is None
    assert (m.attained, m.attained_mean_tpot, m.attained_max_gap) == (False, False, False)
    assert m.ttft == 0.25 and m.worst_lateness == 0.125


def test_measure_rejects_bad_timelines():
    with pytest.raises(ValueError, match="at least one"):
        measure_request(SLO_EXACT, 1.0, [])
    with pytest.raises(ValueError, match="before arrival"):
        measure_request(SLO_EXACT, 1.0, [0.5])
    with pytest.raises(ValueError, match="must not decrease"):
        measure_request(SLO_EXACT, 1.0, [1.1, 1.05])


def test_tally_fractions_per_view():
    tally = AttainmentTally()
    for emits in ([1.0, 1.0625, 1.125, 1.1875], [1.0625, 1.1875, 1.1953125, 1.25], [1.0625, 1.25, 1.25, 1.25],
                  [1.0, 1.1875, 1.25, 1.3125]):
        tally.add(measure_request(SLO_EXACT, 1.0, emits))
    assert tally.fraction("cumulative") == 0.75
    assert tally.fraction("mean_tpot") == 0.75
    assert tally.fraction("max_gap") == 0.25
    with pytest.raises(ValueError, match="view must be one of"):
        tally.fraction("p99")
    with pytest.raises(ValueError, match="no requests"):
        AttainmentTally().fraction()
