"""The shared-pace fluid model (bench/shared_pace.py) against cases worked by hand, and its reference between the
TPOT's pace and the every-tier bound."""
from __future__ import annotations

import numpy as np
import pytest

from bench.goodput import Setup
from bench.shared_pace import shared_pace, shared_pace_reference
from cluster.sim.goodput import EVERY_TIER
from cluster.sim.workload import workload_spec

TPOT, TTFT = 10.0, 500.0


def test_a_known_length_spreads_the_bank_evenly():
    """One resident of 101 tokens starts with a bank of 400 ms and 100 steps to go: 4 ms a step, every step."""
    outcome = shared_pace(np.array([101]), TPOT, TTFT, 100.0, 1, "known-length", steps=1000)
    assert outcome.premium == pytest.approx(4.0 / TPOT)
    assert outcome.missed == 0.0


def test_the_least_bank_decays_geometrically():
    """Over the mean output (101): each step spends 1/101 of what is left, 100 steps a resident, none late."""
    bank, mean, n = 400.0, 101.0, 100
    spent_per_life = bank * (1 - (1 - 1 / mean) ** n)
    outcome = shared_pace(np.array([101]), TPOT, TTFT, 100.0, 1, "least-bank", steps=10_000)
    assert outcome.premium == pytest.approx(spent_per_life / n / TPOT, rel=1e-3)
    assert outcome.missed == 0.0


def test_mixed_lengths_hold_the_pace_back_and_the_tenth_bank_lets_some_miss():
    outputs = np.random.default_rng(1).geometric(1 / 200, 5000)
    lone = shared_pace(outputs, TPOT, TTFT, 60.0, 1, "least-bank", steps=20_000).premium
    least = shared_pace(outputs, TPOT, TTFT, 60.0, 30, "least-bank", steps=20_000)
    tenth = shared_pace(outputs, TPOT, TTFT, 60.0, 30, "tenth-bank", steps=20_000)
    assert least.premium < lone  # the longest-lived resident, its bank spent, paces the batch
    assert least.missed == 0.0 and tenth.premium > least.premium and 0 < tenth.missed < 0.1


def test_bad_arguments_named():
    with pytest.raises(ValueError, match="rule"):
        shared_pace(np.array([10]), TPOT, TTFT, 0.0, 1, "fastest")
    with pytest.raises(ValueError, match="first_token_ms"):
        shared_pace(np.array([10]), TPOT, TTFT, 600.0, 1, "least-bank")
    with pytest.raises(ValueError, match="two tokens"):
        shared_pace(np.array([1, 1]), TPOT, TTFT, 0.0, 1, "least-bank")


def test_the_reference_lies_between_the_tpot_pace_and_the_bound():
    setup = Setup(workload_spec("conv-4tier"), None, 8.0, 12.0)
    tiers = [t.name for t in setup.bound_sample().tiers]
    tpot_pace = setup.bound(EVERY_TIER, pace_premium=dict.fromkeys(tiers, 0.0)).rate(1)
    ref = shared_pace_reference(setup, "least-bank", 60.0, steps=4000)
    assert tpot_pace < ref.rate_per_instance < setup.bound(EVERY_TIER).rate(1)
    assert all(0 < o.premium < 0.2 and o.missed == 0.0 for o in ref.outcomes.values())
    at_batches = setup.bound(EVERY_TIER, pace_premium={k: o.premium for k, o in ref.outcomes.items()})
    assert {c.tier: c.batch for c in at_batches.tiers} == ref.batches  # the premiums are those of the batches taken


def test_a_tier_without_requests_takes_no_batch_and_a_tier_no_batch_serves_is_named():
    three = shared_pace_reference(Setup(workload_spec("conv-3tier"), None, 8.0, 12.0), "least-bank", 60.0, steps=2000)
    assert set(three.batches) == set(three.outcomes) == {"tight", "relaxed", "loose"}  # no snug request in its mix
    # the code trace's tight prompts, folded into the steps, fit no batch at the pace a shared bank affords
    with pytest.raises(ValueError, match="tier tight: no batch"):
        shared_pace_reference(Setup(workload_spec("code-4tier"), None, 8.0, 12.0), "least-bank", 60.0, steps=2000)
