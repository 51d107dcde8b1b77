"""Workloads (cluster/sim/workload.py) and the goodput arithmetic (cluster/sim/goodput.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cluster.sim.goodput import (EVERY_TIER, STRICT, fluid_bound, prefill_seconds_per_token, search_goodput,
                                 tier_capacity)
from cluster.sim.workload import (REFUSED, TierMix, Workload, WorkloadFactory, assign_tiers, default_tiers,
                                  load_trace, max_idle_prompts)
from scheduler.attainability import AttainabilityChecker
from scheduler.instance_state import RequestSnapshot
from scheduler.output_length import OutputLengthTracker
from scheduler.roofline import H200_SXM, LLAMA_3_1_8B, RooflineLatencyModel
from scheduler.tiers import Tier, TierSet

MODEL = RooflineLatencyModel(H200_SXM, LLAMA_3_1_8B)
KV = 800_000


class LinearModel:
    def __init__(self, a, b, c, e=0.0):
        self.a, self.b, self.c, self.e = a, b, c, e

    def predict(self, p, d, k):
        return self.a + self.b * p + self.c * d + self.e * k


@pytest.fixture(scope="module")
def conv():
    return load_trace("azure2023_conv")


@pytest.fixture(scope="module")
def factory(conv):
    return WorkloadFactory(conv, default_tiers(MODEL), MODEL, KV, 2048)


def test_trace_as_documented(conv):
    assert len(conv.arrivals) == 19366  # ../shared/traces/README.md
    assert conv.arrivals[0] == 0 and np.all(np.diff(conv.arrivals) >= 0)
    assert np.median(conv.prompt_lens) == 1020 and np.median(conv.output_lens) == 129
    assert (len(conv.arrivals) - 1) / conv.duration == pytest.approx(5.53, abs=0.01)  # requests per second


def test_bad_trace_is_refused(tmp_path):
    (tmp_path / "t.csv").write_text("time,prompt,output\n0,1,1\n")
    with pytest.raises(ValueError, match="header"):
        load_trace("t", tmp_path)
    with pytest.raises(FileNotFoundError):
        load_trace("missing", tmp_path)


def test_default_tiers_tight_to_loose_and_tightest_attainable_when_idle():
    tiers = default_tiers(MODEL)
    assert [t.name for t in tiers] == ["tight", "snug", "relaxed", "loose"]
    assert all(a.tpot_ms < b.tpot_ms and a.ttft_ms < b.ttft_ms for a, b in zip(tiers, tiers[1:]))
    checker = AttainabilityChecker(MODEL, OutputLengthTracker(211), 2048)
    median = RequestSnapshot(0.0, 1020, 129, tiers[0].slo, "tight")
    assert checker.check_idle(median, KV).ok


def test_poisson_rate_and_reproducibility(factory):
    w = factory.poisson(50.0, 200.0, seed=3)
    assert abs(len(w) - 10_000) < 5 * math.sqrt(10_000)
    assert w.arrivals.max() < 200.0
    again = factory.poisson(50.0, 200.0, seed=3)
    assert np.array_equal(w.arrivals, again.arrivals) and np.array_equal(w.tier_index, again.tier_index)
    other = factory.poisson(50.0, 200.0, seed=4)
    assert not np.array_equal(w.tier_index[:1000], other.tier_index[:1000])
    # lengths and tiers come from their own streams: a different rate keeps request i's lengths and tier
    faster = factory.poisson(80.0, 200.0, seed=3)
    n = min(len(w), len(faster))
    assert np.array_equal(w.prompt_lens[:n], faster.prompt_lens[:n])
    assert np.array_equal(w.tier_index[:n], faster.tier_index[:n])


def test_phase_change_inverts_the_mix(conv):
    tiers = default_tiers(MODEL)
    f = WorkloadFactory(conv, tiers, MODEL, KV, 2048, TierMix((0.4, 0.3, 0.2, 0.1)))
    w = f.poisson(100.0, 400.0, seed=1, phase_change_at=200.0)
    early, late = w.arrivals < 200.0, w.arrivals >= 200.0
    for k, (p_early, p_late) in enumerate(zip((0.4, 0.3, 0.2, 0.1), (0.1, 0.2, 0.3, 0.4))):
        assert np.mean(w.tier_index[early] == k) == pytest.approx(p_early, abs=0.02)
        assert np.mean(w.tier_index[late] == k) == pytest.approx(p_late, abs=0.02)


def test_slo_assigned_only_if_attainable_on_an_idle_instance():
    tiers = TierSet([Tier("tight", 10.0, 60.0), Tier("mid", 20.0, 200.0), Tier("loose", 50.0, 400.0)])
    limits = max_idle_prompts(tiers, MODEL, KV, 2048, 200.0)
    assert 0 < limits[0] < limits[1] < limits[2]
    checker = AttainabilityChecker(MODEL, OutputLengthTracker(200.0), 2048)
    for k, tier in enumerate(tiers):  # the limit is exact: one more token and the idle test fails
        assert checker.check_idle(RequestSnapshot(0.0, limits[k], 1 << 30, tier.slo, tier.name), KV).ok
        assert not checker.check_idle(RequestSnapshot(0.0, limits[k] + 1, 1 << 30, tier.slo, tier.name), KV).ok
    prompts = np.array([limits[0], limits[0] + 1, limits[1] + 1, limits[2] + 1])
    tier = assign_tiers(np.zeros(4), prompts, TierMix((1, 0, 0)), limits, np.random.default_rng(0))
    assert tier.tolist() == [0, 1, 2, REFUSED]


def test_replay_rescales_the_trace(factory, conv):
    w = factory.replay(seed=0, rate_scale=4.0, duration=100.0)
    n = int(np.searchsorted(conv.arrivals / 4.0, 100.0))
    assert len(w) == n
    np.testing.assert_allclose(w.arrivals, conv.arrivals[:n] / 4.0)
    assert np.array_equal(w.output_lens, conv.output_lens[:n])


def test_bad_inputs_named():
    with pytest.raises(ValueError, match="tier mix"):
        TierMix((0.0, 0.0))
    with pytest.raises(ValueError, match="different lengths"):
        Workload(np.zeros(2), np.ones(1, np.int64), np.ones(2, np.int64), np.zeros(2, np.int8), default_tiers(MODEL))


# ---- goodput --------------------------------------------------------------------------------------------------
def test_tier_capacity_by_hand():
    """T(B) = a + b * B * P / D + c * B: the largest B with T(B) <= allowance is floor((allowance - a) / (b P / D + c)),
    the allowance being the cumulative deadline's per-token average (ttft + (D - 1) * tpot) / D."""
    m = LinearModel(a=0.004, b=2e-5, c=5e-5)
    p, d, tpot = 1000.0, 200.0, 20.0
    cap = tier_capacity(m, "t", tpot, tpot, p, d, kv_capacity_tokens=10**9, max_batch=10_000)  # allowance = tpot
    assert cap.batch == math.floor((0.020 - 0.004) / (2e-5 * 5 + 5e-5))  # 106
    assert cap.requests_per_s == pytest.approx(cap.batch / (d * m.predict(round(cap.batch * 5), cap.batch, 0)))
    # a 1 s TTFT spread over 200 tokens: 24.9 ms per token on average
    loose = tier_capacity(m, "t", tpot, 1000.0, p, d, kv_capacity_tokens=10**9, max_batch=10_000)
    assert loose.batch == math.floor((0.0249 - 0.004) / 1.5e-4)  # 139
    kv_bound = tier_capacity(m, "t", tpot, tpot, p, d, kv_capacity_tokens=50 * 1100, max_batch=10_000)
    assert kv_bound.batch == 50  # 50 * (1000 + 100) tokens fill the pool
    assert tier_capacity(m, "t", 3.0, 3.0, p, d, 10**9, 10_000).requests_per_s == 0.0  # below the fixed cost


def test_decode_stage_capacity_by_hand():
    """On a PD decode instance T(B) = a + c * B (no prefill folded in), over D - 1 iterations a request, each within
    (ttft + (D - 1) * tpot) / (D - 1); a one-token output decodes nothing; a prompt-only step's best cost per token
    is its largest chunk's on a model linear in the chunk."""
    m = LinearModel(a=0.004, b=2e-5, c=5e-5)
    p, d, tpot = 1000.0, 201.0, 20.0
    cap = tier_capacity(m, "t", tpot, 0.0, p, d, kv_capacity_tokens=10**9, max_batch=10_000, decode_only=True)
    assert cap.batch == math.floor((0.020 - 0.004) / 5e-5)  # 320
    assert cap.requests_per_s == pytest.approx(cap.batch / ((d - 1) * (0.004 + 5e-5 * cap.batch)))
    one_token = tier_capacity(m, "t", tpot, tpot, p, 1.0, 10**9, 10_000, decode_only=True)
    assert one_token.requests_per_s == math.inf
    assert prefill_seconds_per_token(m, 512) == pytest.approx(0.004 / 512 + 2e-5)


def test_disaggregated_bound_adds_the_prompts_prefill_time():
    """A PD fleet's request costs its prompt's prefill at the best per-token cost plus its decode stage."""
    m = LinearModel(a=0.004, b=2e-5, c=5e-5)
    tiers = TierSet([Tier("a", 20.0, 20.0)])
    n = 400
    w = Workload(np.zeros(n), np.full(n, 1000, np.int64), np.full(n, 201, np.int64), np.zeros(n, np.int8), tiers)
    bound = fluid_bound(m, w, 10**9, 10_000, prefill_chunk=512)
    decode = tier_capacity(m, "a", 20.0, 20.0, 1000.0, 201.0, 10**9, 10_000, decode_only=True)
    per_request_s = 1000 * prefill_seconds_per_token(m, 512) + 1.0 / decode.requests_per_s
    assert bound.rate(8) == pytest.approx(8 / per_request_s)
    # the fluid split: the prefill instances' share of that instance time
    assert bound.prefill_share == pytest.approx(1000 * prefill_seconds_per_token(m, 512) / per_request_s)
    assert fluid_bound(m, w, 10**9, 10_000).prefill_share == 0.0  # co-located: no prefill instances


class SlowPastFifty(LinearModel):
    """A batch past 50 costs a fixed extra 12 ms (another kernel, say): the largest batch is not the best."""

    def predict(self, p, d, k):
        return super().predict(p, d, k) + (0.012 if d > 50 else 0.0)


def test_tier_capacity_takes_the_best_batch_not_the_largest():
    m = SlowPastFifty(a=0.004, b=0.0, c=5e-5)
    cap = tier_capacity(m, "t", 20.0, 20.0, 1000.0, 200.0, 10**9, 10_000)
    # 50 / 6.5 ms = 7692 tokens/s beats 80 / 20 ms = 4000 (the largest within 20 ms)
    assert cap.batch == 50 and cap.requests_per_s == pytest.approx(50 / (200.0 * 0.0065))


def test_fluid_bound_mixes_tiers_harmonically():
    m = LinearModel(a=0.004, b=2e-5, c=5e-5)
    tiers = TierSet([Tier("a", 10.0, 1000.0), Tier("b", 40.0, 1000.0)])
    w = Workload(np.arange(4.0), np.full(4, 1000, np.int64), np.full(4, 200, np.int64),
                 np.array([0, 1, 1, 1], np.int8), tiers)
    bound = fluid_bound(m, w, 10**9, 10_000)
    ca, cb = (c.requests_per_s for c in bound.tiers)
    assert bound.shares == (0.25, 0.75)
    assert bound.rate(10) == pytest.approx(10 / (0.25 / ca + 0.75 / cb))


def test_tier_capacity_at_a_shared_pace():
    """pace_premium holds every output's allowance to tpot x (1 + premium), the TTFT and the class's output
    counting for nothing: the largest B of `test_tier_capacity_by_hand` at that allowance."""
    m = LinearModel(a=0.004, b=2e-5, c=5e-5)
    p, d, tpot = 1000.0, 200.0, 20.0
    at_tpot = tier_capacity(m, "t", tpot, 1000.0, p, d, 10**9, 10_000, pace_premium=0.0)
    assert at_tpot == tier_capacity(m, "t", tpot, tpot, p, d, 10**9, 10_000)  # as though the TTFT were one TPOT
    paced = tier_capacity(m, "t", tpot, 1000.0, p, d, 10**9, 10_000, allowance_output=20.0, pace_premium=0.1)
    assert paced.batch == 120  # floor((22 ms - 4 ms) / 0.15 ms): the short class's own allowance is not used
    with pytest.raises(ValueError, match="pace premium"):
        tier_capacity(m, "t", tpot, tpot, p, d, 10**9, 10_000, pace_premium=-0.1)


def test_the_shared_pace_reference_needs_every_tier_and_grows_with_the_premium():
    m = LinearModel(a=0.004, b=2e-5, c=5e-5)
    tiers = TierSet([Tier("a", 10.0, 1000.0), Tier("b", 40.0, 1000.0)])
    w = Workload(np.arange(4.0), np.full(4, 1000, np.int64), np.array([20, 200, 300, 400], np.int64),
                 np.array([0, 1, 1, 1], np.int8), tiers)
    with pytest.raises(ValueError, match=r"no premium for tiers \['b'\]"):
        fluid_bound(m, w, 10**9, 10_000, pace_premium={"a": 0.0})
    rates = [fluid_bound(m, w, 10**9, 10_000, pace_premium={"a": x, "b": x}).rate(8) for x in (0.0, 0.05, 0.1)]
    assert rates[0] < rates[1] < rates[2] < fluid_bound(m, w, 10**9, 10_000).rate(8)  # the TTFT credits far more


def test_a_rule_that_lets_requests_miss_is_bounded_without_its_costliest():
    m = LinearModel(a=0.004, b=2e-5, c=5e-5)
    tiers = TierSet([Tier("a", 20.0, 1000.0), Tier("b", 50.0, 2000.0)])
    # tier a: nine 100-token outputs and one of 1000; tier b: twenty outputs of 100 to 2000 tokens
    outputs = np.array([100] * 9 + [1000] + list(range(100, 2001, 100)), np.int64)
    w = Workload(np.arange(30.0), np.full(30, 500, np.int64), outputs, np.array([0] * 10 + [1] * 20, np.int8), tiers)
    full = fluid_bound(m, w, 10**9, 10_000)
    every = fluid_bound(m, w, 10**9, 10_000, EVERY_TIER)
    # every tier drops its costliest tenth: a's 1000-token request, b's two longest
    assert [c.mean_output for c in every.tiers] == [100.0, pytest.approx(np.arange(100, 1801, 100).mean())]
    assert every.shares == (9 / 30, 18 / 30)
    assert every.rate(8) > full.rate(8)
    # strict drops the costliest 1 % of all 30 requests: none (floor of 0.3)
    assert fluid_bound(m, w, 10**9, 10_000, STRICT).rate(8) == pytest.approx(full.rate(8))


def test_a_rule_that_lets_requests_miss_drops_those_whose_drop_leaves_least_time():
    """A long prompt's marginal prefill is cheap here, but its KV weighs on every iteration of its class: the bound
    drops it rather than the request costliest by its marginal time at the tier's batch (the longest output)."""
    m = LinearModel(a=0.004, b=1e-6, c=1e-5, e=1e-7)
    tiers = TierSet([Tier("a", 20.0, 20.0)])
    prompts = np.array([500] * 8 + [20_000, 500], np.int64)
    outputs = np.array([100] * 8 + [100, 400], np.int64)
    w = Workload(np.arange(10.0), prompts, outputs, np.zeros(10, np.int8), tiers)
    every = fluid_bound(m, w, 10**9, 10_000, EVERY_TIER)
    assert every.tiers[0].mean_prompt == 500.0 and every.tiers[0].mean_output == pytest.approx(1200 / 9)
    # the drop of the longest output, as the bound took it before: the same rate computed with that one refused
    without_longest_output = Workload(np.arange(10.0), prompts, outputs, np.array([0] * 9 + [REFUSED], np.int8), tiers)
    other = fluid_bound(m, without_longest_output, 10**9, 10_000).rate(1) * 10 / 9
    assert every.rate(1) > 1.5 * other


def test_rules_score_the_worst_tier_or_the_pool():
    tiers = {"a": 0.95, "b": 0.85}
    assert EVERY_TIER.score(0.93, tiers) == 0.85 and not EVERY_TIER.passes(0.85)
    assert STRICT.score(0.993, tiers) == 0.993 and STRICT.passes(0.993) and not STRICT.passes(math.nan)


def test_search_finds_the_threshold_and_confirms_it():
    calls = []

    def score(rate, seed):
        calls.append((rate, seed))
        return 0.95 if rate <= 123.0 else 0.5

    found = search_goodput(score, seeds=(1, 2), low=50.0, high=100.0, rule=EVERY_TIER, rel_tol=0.01)
    assert 123.0 / 1.01 <= found.goodput <= 123.0 < found.next_failing <= found.goodput * 1.01
    assert found.confirmed
    assert {s for _, s in calls} == {1, 2} and len(calls) == 2 * len(found.probes)
    given_up = search_goodput(lambda r, s: 0.97 if r <= 80.0 else math.nan, seeds=(1,), low=50.0, high=100.0,
                              rule=EVERY_TIER, rel_tol=0.01)  # NaN: a run stopped once certain to miss the target
    assert 80.0 / 1.01 <= given_up.goodput <= 80.0 and not given_up.confirmed  # one seed confirms nothing
    nothing = search_goodput(lambda r, s: 0.0, seeds=(1,), low=1.0, high=2.0, rule=EVERY_TIER, max_probes=4)
    assert nothing.goodput == 0.0 and not nothing.confirmed


def test_search_needs_every_seed_and_ignores_a_pass_above_a_failure():
    # seed 2 fails from 100 up, seed 1 passes everywhere: a rate passes only when both do
    found = search_goodput(lambda r, s: 0.95 if s == 1 or r < 100.0 else 0.5, seeds=(1, 2), low=50.0, high=400.0,
                           rule=EVERY_TIER, rel_tol=0.01)
    assert 100.0 / 1.01 <= found.goodput < 100.0 and found.confirmed
    # 120 fails, then 200 passes (a queue that refuses requests can score higher at a heavier load): the answer
    # stays below the failure
    failing = {120.0}

    def scripted_map(fn, jobs):
        return [0.5 if rate in failing else 0.95 for _, rate, _ in jobs]

    found = search_goodput(lambda r, s: 0.0, seeds=(1, 2), low=50.0, high=120.0, rule=EVERY_TIER, rel_tol=0.2,
                           width=2, map_fn=scripted_map)
    assert found.goodput < 120.0 < found.next_failing + 1e-9


def test_search_probes_several_rates_per_round():
    rounds = []

    def batch_map(fn, jobs):  # a pool's map: records which runs go out together
        jobs = list(jobs)
        rounds.append(sorted({rate for _, rate, _ in jobs}))
        return [fn(j) for j in jobs]

    def attainment(rate, seed):
        return 0.95 if rate <= 123.0 else 0.5

    found = search_goodput(attainment, seeds=(1, 2), low=50.0, high=200.0, rule=EVERY_TIER, rel_tol=0.01, width=3,
                           map_fn=batch_map)
    assert 123.0 / 1.01 <= found.goodput <= 123.0
    assert rounds[0] == [50.0, 200.0] and all(len(r) == 3 for r in rounds[1:])
    assert len(found.probes) == 2 + 3 * (len(rounds) - 1)
    # each later round splits the bracket into four equal parts (log scale) around what the rounds before found
    lo, hi = 50.0, 200.0
    for rates in rounds[1:]:
        assert rates == pytest.approx([lo * (hi / lo) ** (i / 4) for i in (1, 2, 3)])
        lo = max([lo] + [r for r in rates if r <= 123.0])
        hi = min([hi] + [r for r in rates if r > 123.0])
    bisection = search_goodput(attainment, seeds=(1, 2), low=50.0, high=200.0, rule=EVERY_TIER, rel_tol=0.01)
    assert len(rounds) < len(bisection.probes)  # fewer rounds than bisection's one probe per round
    with pytest.raises(ValueError, match="width"):
        search_goodput(attainment, seeds=(1,), low=1.0, high=2.0, rule=EVERY_TIER, width=0)


def test_search_widens_its_bracket_by_the_factor_given():
    probed = []

    def attainment(rate, seed):
        probed.append(rate)
        return 0.95 if rate <= 60.0 else 0.5

    found = search_goodput(attainment, seeds=(1,), low=100.0, high=120.0, rule=EVERY_TIER, rel_tol=0.01, widen=1.25)
    assert probed[:3] == pytest.approx([100.0, 80.0, 64.0])  # the low end fails: divided by 1.25 until one passes
    assert 60.0 / 1.01 <= found.goodput <= 60.0
    probed.clear()
    search_goodput(attainment, seeds=(1,), low=10.0, high=20.0, rule=EVERY_TIER, rel_tol=0.01, widen=1.25)
    assert probed[:3] == pytest.approx([10.0, 20.0, 25.0])  # both pass: the best passing rate times 1.25
    with pytest.raises(ValueError, match="widen"):
        search_goodput(attainment, seeds=(1,), low=1.0, high=2.0, rule=EVERY_TIER, widen=1.0)


def test_a_tier_is_bounded_class_by_class_of_output_length():
    """Short outputs may spend more per token (the TTFT spread over fewer tokens): each class is bounded at its own
    allowance and lengths, and the tier's rate is their harmonic mean, above the bound on the tier's means."""
    m = LinearModel(a=0.004, b=2e-5, c=5e-5)
    tiers = TierSet([Tier("a", 20.0, 2000.0)])
    w = Workload(np.arange(2.0), np.full(2, 500, np.int64), np.array([50, 350], np.int64), np.zeros(2, np.int8), tiers)
    short, long = (tier_capacity(m, "a", 20.0, 2000.0, 500.0, d, 10**9, 10_000) for d in (50.0, 350.0))
    assert short.iteration_s > long.iteration_s  # allowances of 59 ms and 25.7 ms per token
    bound = fluid_bound(m, w, 10**9, 10_000)
    per_class = 1 / (0.5 / short.requests_per_s + 0.5 / long.requests_per_s)
    assert bound.rate(1) == pytest.approx(per_class)
    on_means = tier_capacity(m, "a", 20.0, 2000.0, 500.0, 200.0, 10**9, 10_000)
    assert bound.tiers[0].batch == on_means.batch and bound.rate(1) > on_means.requests_per_s
