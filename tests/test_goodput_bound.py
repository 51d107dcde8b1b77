"""The bound guard (DESIGN.md §1): no policy's goodput exceeds the fluid bound of its own rule.

A policy fails each rule at the rate of that rule's bound, on a small fleet. The bound is a steady state: a fleet
starting empty meets deadlines above it for as long as its queues and batches take to fill, which for the loosest
tier (whose outputs take many seconds to decode) is longer than a short window; hence the long warm-up.

Covered, to keep it to about a minute on two cores: PolyServe, the policy nearest the bound, on every workload of the
matrix, with the step time exact and with the gpu-typical prediction error, under both rules; and, so that its
failures are the bound's doing and not a broken run, PolyServe passing both rules at a fraction of the bound
(gpu-typical). The strongest baselines (mixed-deadline, mixed-deadline-admission), further below the bound on every
workload of the matrix, on the 4-tier conversation workload only, gpu-typical, under the
headline rule.
"""
from __future__ import annotations

import pytest

from bench.goodput import Setup, _score
from cluster.sim.goodput import EVERY_TIER, STRICT
from cluster.sim.workload import MATRIX_WORKLOADS, workload_spec

INSTANCES = 4
WARMUP_S, WINDOW_S = 20.0, 10.0
PASSING_SHARE = 0.3  # of the bound: well under PolyServe's goodput on a fleet of one instance a tier
RULES = (EVERY_TIER, STRICT)


def _score_at(setup: Setup, policy: str, rule, share_of_bound: float) -> tuple[float, float]:
    rate = share_of_bound * setup.bound(rule).rate(INSTANCES)
    return rate, _score(setup, policy, INSTANCES, 0, rule.name, rate, seed=1)


@pytest.mark.parametrize("error", ["gpu-typical", "exact"])
@pytest.mark.parametrize("workload", MATRIX_WORKLOADS, ids=lambda spec: spec.name)
def test_polyserve_fails_at_the_bound_of_each_rule(workload, error):
    setup = Setup(workload, None, WARMUP_S, WINDOW_S, error)
    for rule in RULES:
        rate, score = _score_at(setup, "polyserve", rule, 1.0)
        assert not rule.passes(score), f"polyserve scores {score:.3f} under {rule.name} at its bound {rate:.1f}"
        if error == "gpu-typical":
            rate, score = _score_at(setup, "polyserve", rule, PASSING_SHARE)
            assert rule.passes(score), f"polyserve scores {score:.3f} under {rule.name} at {rate:.1f}"


@pytest.mark.parametrize("policy", ["mixed-deadline", "mixed-deadline-admission"])
def test_the_strongest_baselines_fail_at_the_headline_bound(policy):
    setup = Setup(workload_spec("conv-4tier"), None, WARMUP_S, WINDOW_S, "gpu-typical")
    rate, score = _score_at(setup, policy, EVERY_TIER, 1.0)
    assert not EVERY_TIER.passes(score), f"{policy} scores {score:.3f} under every-tier at its bound {rate:.1f}"


@pytest.mark.parametrize("prefill_instances", [1, 2])
def test_polyserve_pd_fails_at_the_disaggregated_bound(prefill_instances):
    """The PD bound (the best split, fluidly) is above what any one split of the fleet serves: PolyServe in PD mode
    fails the headline rule at it, and passes at a fraction of it (a run that works)."""
    setup = Setup(workload_spec("conv-4tier"), None, WARMUP_S, WINDOW_S, "gpu-typical")
    bound = setup.bound(EVERY_TIER, disaggregated=True).rate(INSTANCES)
    for share in (1.0, PASSING_SHARE):
        score = _score(setup, "polyserve", INSTANCES, 0, EVERY_TIER.name, share * bound, seed=1,
                       prefill_instances=prefill_instances)
        assert EVERY_TIER.passes(score) == (share < 1.0), f"{prefill_instances}p: {score:.3f} at {share * bound:.1f}"
