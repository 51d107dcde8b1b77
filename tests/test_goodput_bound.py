"""The bound guard (DESIGN.md §1): no policy's goodput exceeds the fluid bound of its own rule.

A policy fails each rule at the rate of that rule's bound, on a small fleet. The bound is a steady state: a fleet
starting empty meets deadlines above it for as long as its queues and batches take to fill, which for the loosest
tier (whose outputs take many seconds to decode) is longer than a short window; hence the long warm-up.

Covered, to keep it to about a minute on two cores: PolyServe, the policy nearest the bound, on every workload of the
matrix, with the step time exact and with the gpu-typical prediction error, under both rules; and, so that its
failures are the bound's doing and not a broken run, PolyServe passing both rules at a fraction of the bound
(gpu-typical). The strongest baselines (mixed-deadline, mixed-deadline-admission), further below the bound on every
workload of the matrix, on the 4-tier conversation workload only, gpu-typical, under the
headline rule. And, in the fluid computation itself, that the requests each rule lets miss, dropped in orders the
bound does not try, leave no more than the bound.
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from bench.goodput import CellRuns, Setup, build_setup
from cluster.sim.goodput import EVERY_TIER, STRICT, fluid_bound
from cluster.sim.simulator import SimConfig
from cluster.sim.workload import MATRIX_WORKLOADS, REFUSED, workload_spec
from scheduler.prediction_error import expected_latency_model

INSTANCES = 4
WARMUP_S, WINDOW_S = 20.0, 10.0
PASSING_SHARE = 0.3  # of the bound: well under PolyServe's goodput on a fleet of one instance a tier
RULES = (EVERY_TIER, STRICT)


def _score_at(setup: Setup, policy: str, rule, share_of_bound: float) -> tuple[float, float]:
    rate = share_of_bound * setup.bound(rule).rate(INSTANCES)
    return rate, CellRuns(setup.for_rule(rule), policy, INSTANCES, 0).score(rule, rate, seed=1)


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
        runs = CellRuns(setup.for_rule(EVERY_TIER), "polyserve", INSTANCES, 0, prefill_instances=prefill_instances)
        score = runs.score(EVERY_TIER, share * bound, seed=1)
        assert EVERY_TIER.passes(score) == (share < 1.0), f"{prefill_instances}p: {score:.3f} at {share * bound:.1f}"


def _rate_with_drop(setup: Setup, rule, key: np.ndarray, instances: int) -> float:
    """What the fluid computation of the bounds serves of all admitted requests when those `rule` lets miss are the
    first in descending `key`, each tier's own tenth (every-tier) or the pool's hundredth (strict): they are taken
    as refused, the rest bounded as all attaining, and the rate counts them all."""
    sample = setup.bound_sample()
    tier_index = sample.tier_index.copy()
    admitted = tier_index >= 0
    for group in [tier_index == k for k in range(len(sample.tiers))] if rule.per_tier else [admitted]:
        idx = np.flatnonzero(group)
        drop = math.floor((1.0 - rule.target) * len(idx) + 1e-9)
        tier_index[idx[np.argsort(key[idx], kind="stable")[len(idx) - drop:]]] = REFUSED
    config = SimConfig()
    served = fluid_bound(expected_latency_model(build_setup(setup).model, setup.error),
                         replace(sample, tier_index=tier_index), config.kv_blocks * config.block_size,
                         config.max_num_seqs)
    return served.rate(instances) * int(admitted.sum()) / int((tier_index >= 0).sum())


@pytest.mark.parametrize("workload", ["conv-4tier", "code-4tier"])
def test_no_order_of_dropping_serves_more_than_the_bound(workload):
    """The requests a rule lets miss, chosen in orders the bound does not try itself (and, for strict, all from
    the tightest tier), leave no more capacity than the rule's bound: dropping the longest prompts beat it once."""
    setup = Setup(workload_spec(workload), None, WARMUP_S, WINDOW_S, "gpu-typical")
    sample = setup.bound_sample()
    prompts, outputs = sample.prompt_lens.astype(float), sample.output_lens.astype(float)
    orders = {"random": np.random.default_rng(0).random(len(prompts)), "prompt x output": prompts * outputs,
              "prompt + 3 output": prompts + 3 * outputs, "prompt + 6 output": prompts + 6 * outputs,
              "prompt^2 + output": prompts ** 2 + outputs}
    tightest = sample.tier_index == 0
    for rule in RULES:
        bound = setup.bound(rule).rate(64)
        keys = dict(orders)
        if not rule.per_tier:
            keys["tightest tier's prompt + 4 output"] = np.where(tightest, prompts + 4 * outputs, -np.inf)
        for name, key in keys.items():
            served = _rate_with_drop(setup, rule, key, 64)
            assert served <= bound * (1 + 1e-9), f"{rule.name}: dropping by {name} serves {served:.1f} > {bound:.1f}"
