"""The discrete-event simulator (cluster/sim/simulator.py, cluster/sim/instance.py): hand-computed cases, equality with the
engine's own step loop, fast-forward equivalence, determinism, and that it drives the live system's objects."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import cluster.router
import cluster.sim.simulator
import scheduler.edf
import scheduler.fcfs
import scheduler.polyserve
from cluster.sim.calibration import replay_on_engine, write_emulated_model_folder
from cluster.sim.simulator import SimConfig, Simulator
from cluster.sim.workload import Workload
from scheduler.attainability import AttainabilityChecker
from scheduler.attainment import measure_request
from scheduler.edf import EDFPolicy
from scheduler.fcfs import FCFSPolicy
from scheduler.polyserve import PolyServePolicy
from scheduler.prediction_error import prediction_error
from scheduler.tiers import Tier, TierSet


class LinearModel:
    """a + b * prefill tokens + c * decode seqs + e * KV tokens: step times a test can add up by hand."""

    def __init__(self, a=0.01, b=0.001, c=0.0001, e=0.0):
        self.a, self.b, self.c, self.e = a, b, c, e

    def predict(self, p, d, k):
        return self.a + self.b * p + self.c * d + self.e * k


ONE_TIER = TierSet([Tier("only", tpot_ms=50.0, ttft_ms=1000.0)])


def workload(arrivals, prompts, outputs, tiers=ONE_TIER, tier_index=None) -> Workload:
    n = len(arrivals)
    return Workload(np.asarray(arrivals, float), np.asarray(prompts, np.int64), np.asarray(outputs, np.int64),
                    np.zeros(n, np.int8) if tier_index is None else np.asarray(tier_index, np.int8), tiers)


def one_instance(model, policy_factory, num_kv_blocks=100_000, fast_forward=True, tiers=ONE_TIER, **kw):
    cfg = SimConfig(router_policy="round-robin", num_instances=1, num_kv_blocks=num_kv_blocks,
                    fast_forward=fast_forward, record_token_times=True, reveal_output_len=True, **kw)
    return Simulator(cfg, tiers, model, policy_factory=policy_factory)


def fcfs(budget=4096):
    return lambda model, headroom: FCFSPolicy(budget, 256)


# ---- hand-computed cases: one instance, one tier, constant lengths --------------------------------------------
def test_single_request_prefill_then_decodes():
    m = LinearModel()
    res = one_instance(m, fcfs()).run(workload([0.0], [100], [5]))
    first = 0.01 + 0.1  # one prefill step of 100 tokens
    decode = 0.01 + 0.0001  # one decode sequence
    assert res.token_times[0] == pytest.approx([first + k * decode for k in range(5)], abs=1e-12)
    assert res.ttft[0] == pytest.approx(first)


def test_second_request_waits_for_the_step_in_flight():
    m = LinearModel()
    res = one_instance(m, fcfs()).run(workload([0.0, 0.05], [100, 100], [3, 3]))
    s0 = 0.11  # r0's prefill
    s1 = s0 + 0.01 + 0.1 + 0.0001  # r0 decode + r1 prefill (r1 arrived mid-step, joins the next one)
    s2 = s1 + 0.01 + 0.0002  # both decode
    s3 = s2 + 0.01 + 0.0001  # r1 alone
    assert res.token_times[0] == pytest.approx([s0, s1, s2], abs=1e-12)
    assert res.token_times[1] == pytest.approx([s1, s2, s3], abs=1e-12)
    assert res.ttft[1] == pytest.approx(s1 - 0.05)


def test_arrival_at_the_instant_a_step_ends_joins_the_next_step():
    m = LinearModel(a=1 / 64, b=1 / 1024, c=1 / 4096)  # binary fractions: sums are exact
    s0 = m.predict(128, 0, 128)
    res = one_instance(m, fcfs()).run(workload([0.0, s0], [128, 128], [2, 1]))
    s1 = s0 + m.predict(128, 1, 0)  # r0's decode and r1's whole prefill, together
    assert res.token_times[1] == [s1]
    assert res.token_times[0] == [s0, s1]


def test_simultaneous_requests_share_every_step():
    m = LinearModel()
    n, p, d = 4, 50, 10
    res = one_instance(m, fcfs()).run(workload([0.0] * n, [p] * n, [d] * n))
    first = 0.01 + 0.001 * n * p
    step = 0.01 + 0.0001 * n
    for times in res.token_times:
        assert times == pytest.approx([first + k * step for k in range(d)], abs=1e-12)


def test_fcfs_queue_one_prefill_per_step():
    """Budget of one prompt per step, one output token each: request i leaves after i + 1 service times, less its
    arrival (a deterministic single-server queue)."""
    m = LinearModel()
    p, spacing, n = 200, 0.1, 6
    service = 0.01 + 0.001 * p
    assert spacing < service  # arrivals outpace service: a queue builds
    res = one_instance(m, fcfs(budget=p)).run(workload([i * spacing for i in range(n)], [p] * n, [1] * n))
    assert res.ttft == pytest.approx([(i + 1) * service - i * spacing for i in range(n)], abs=1e-12)


def test_decode_steps_grow_with_the_kv():
    m = LinearModel(e=1e-6)
    p, d = 300, 40
    res = one_instance(m, fcfs()).run(workload([0.0], [p], [d]))
    t = m.predict(p, 0, p)
    expected = [t]
    for k in range(1, d):  # decode k reads the prompt and k tokens of output
        t += m.predict(0, 1, p + k)
        expected.append(t)
    assert res.token_times[0] == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("fast_forward", [True, False])
def test_lateness_builds_up_over_slow_decodes(fast_forward):
    """TPOT 5 ms against 10.1 ms decode steps: token k is (k - 1) * 5.1 ms later against its deadline than the
    first, so with 200 ms of TTFT the 19th token is the first one late."""
    m = LinearModel()
    tiers = TierSet([Tier("only", tpot_ms=5.0, ttft_ms=200.0)])
    res = one_instance(m, fcfs(), tiers=tiers, fast_forward=fast_forward).run(
        workload([0.0, 5.0], [100, 100], [18, 19], tiers))
    first_slack = 0.11 - 0.2
    assert res.worst_lateness[0] == pytest.approx(first_slack + 17 * 0.0051, abs=1e-12)
    assert res.worst_lateness[1] == pytest.approx(first_slack + 18 * 0.0051, abs=1e-12)
    assert res.attained.tolist() == [True, False]
    assert res.max_gap == pytest.approx([0.0101, 0.0101], abs=1e-12)


def test_attainment_views_on_a_known_case():
    """SLO 50 ms TPOT, TTFT 1 s; a lone request (TTFT 0.11 s, 10.1 ms per token) attains under every view; with
    a prefill longer than the TTFT, none."""
    m = LinearModel()
    res = one_instance(m, fcfs()).run(workload([0.0, 10.0], [100, 1100], [5, 5]))
    assert res.attained.tolist() == [True, False]
    assert res.attained_mean_tpot.tolist() == [True, False]
    assert res.attained_max_gap.tolist() == [True, False]


# ---- the engine's step loop, bit for bit ----------------------------------------------------------------------
POLICIES = {
    "fcfs": lambda model, slo: FCFSPolicy(512, 64),
    "edf": lambda model, slo: EDFPolicy(64, 512),
    "polyserve": lambda model, slo: PolyServePolicy(model, 64, 512),
}


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return write_emulated_model_folder(tmp_path_factory.mktemp("emulated"))


def small_mixed_workload(seed: int, n: int = 60) -> Workload:
    rng = np.random.default_rng(seed)
    tiers = TierSet([Tier("tight", 15.0, 300.0), Tier("loose", 60.0, 1500.0)])
    arrivals = np.sort(rng.uniform(0, 3.0, n))
    return workload(arrivals, rng.integers(20, 400, n), rng.integers(1, 60, n), tiers, rng.integers(0, 2, n))


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("num_kv_blocks", [60, 4000])  # 60 blocks of 16: preemptions happen
def test_same_emit_times_as_the_engine(policy, num_kv_blocks, model_folder):
    m = LinearModel(a=0.005, b=5e-5, c=2e-4, e=1e-7)
    w = small_mixed_workload(seed=3)
    slo = w.tiers[1].slo
    engine = replay_on_engine(w, m, POLICIES[policy](m, slo), model_folder, num_kv_blocks, clock="virtual")
    sim = one_instance(m, lambda model, headroom: POLICIES[policy](m, slo), num_kv_blocks=num_kv_blocks, tiers=w.tiers)
    res = sim.run(w)
    assert res.served.all()
    for i, (mine, theirs) in enumerate(zip(res.token_times, engine.token_times)):
        assert mine == theirs, f"request {i}: emit times differ"
    if num_kv_blocks == 60 and policy != "polyserve":
        assert res.preemptions.sum() > 0  # the case exercises recompute preemption


# ---- a fleet: the live system's objects, fast-forward, determinism --------------------------------------------
@pytest.fixture(scope="module")
def h200(h200_fleet):
    return h200_fleet


def fleet_run(h200, seed=1, rate=70.0, duration=12.0, **kw):
    model, tiers, factory = h200
    sim = Simulator(SimConfig(num_instances=4, **kw), tiers, model)
    return sim, sim.run(factory.poisson(rate, duration, seed))


def test_drives_the_live_router_and_policies(h200):
    sim, res = fleet_run(h200, duration=4.0)
    assert type(sim.router) is cluster.router.Router
    assert cluster.sim.simulator.Router is cluster.router.Router  # imported, not a copy
    assert type(sim.router.checker) is AttainabilityChecker
    for inst in sim.instances.values():
        assert type(inst.policy) is scheduler.polyserve.PolyServePolicy
    assert res.served.all()
    assert sum(res.counts.get(k, 0) for k in ("own", "promoted", "scaled_up")) == len(res.arrival)
    for engine_policy, cls in (("fcfs", scheduler.fcfs.FCFSPolicy), ("edf", scheduler.edf.EDFPolicy)):
        sim, _ = fleet_run(h200, duration=1.0, router_policy="least-loaded", engine_policy=engine_policy)
        assert all(type(i.policy) is cls for i in sim.instances.values())


@pytest.mark.parametrize("router_policy,engine_policy", [("polyserve", "polyserve"), ("least-loaded", "fcfs"),
                                                         ("random", "edf")])
def test_fast_forward_changes_nothing(h200, router_policy, engine_policy):
    kw = dict(router_policy=router_policy, engine_policy=engine_policy, rate=90.0, duration=8.0)
    _, fast = fleet_run(h200, fast_forward=True, **kw)
    _, slow = fleet_run(h200, fast_forward=False, **kw)
    assert fast.num_policy_calls < slow.num_policy_calls  # it did skip work
    assert fast.num_steps == slow.num_steps
    assert np.array_equal(fast.attained, slow.attained)
    assert np.array_equal(fast.attained_max_gap, slow.attained_max_gap)
    np.testing.assert_allclose(fast.ttft, slow.ttft, rtol=0, atol=1e-9)
    np.testing.assert_allclose(fast.mean_tpot, slow.mean_tpot, rtol=0, atol=1e-9)
    np.testing.assert_allclose(fast.max_gap, slow.max_gap, rtol=0, atol=1e-9)
    np.testing.assert_allclose(fast.worst_lateness, slow.worst_lateness, rtol=0, atol=1e-9)
    assert fast.counts == slow.counts


def test_deterministic_for_a_seed(h200):
    _, a = fleet_run(h200, seed=5, router_policy="random", engine_policy="polyserve")
    _, b = fleet_run(h200, seed=5, router_policy="random", engine_policy="polyserve")
    _, c = fleet_run(h200, seed=6, router_policy="random", engine_policy="polyserve")
    for field in ("ttft", "mean_tpot", "max_gap"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert a.counts == b.counts
    assert len(a.ttft) != len(c.ttft) or not np.array_equal(a.ttft, c.ttft, equal_nan=True)


def test_incremental_latency_record_matches_measure_request(h200):
    _, res = fleet_run(h200, rate=260.0, duration=6.0, record_token_times=True, shed_late=False)
    model, tiers, _ = h200
    checked = 0
    for i, times in enumerate(res.token_times):
        if times is None:
            continue
        slo = tiers[int(res.tier[i])].slo
        ref = measure_request(slo, float(res.arrival[i]), times)
        assert res.attained[i] == ref.attained
        assert res.attained_mean_tpot[i] == ref.attained_mean_tpot
        assert res.attained_max_gap[i] == ref.attained_max_gap
        assert res.ttft[i] == pytest.approx(ref.ttft, abs=1e-9)
        assert res.worst_lateness[i] == pytest.approx(ref.worst_lateness, abs=1e-9)
        if ref.max_gap is not None:
            assert res.max_gap[i] == pytest.approx(ref.max_gap, abs=1e-9)
        checked += 1
    assert checked == len(res.arrival)
    assert 0 < res.attained.sum() < len(res.arrival)  # the load is high enough that some miss


def test_overload_is_counted_not_hidden(h200):
    """Far past capacity, with a short router queue: requests are refused (429) or miss, and all are accounted."""
    _, res = fleet_run(h200, rate=400.0, duration=4.0, queue_limit=8)
    assert res.counts["rejected"] > res.counts["queue_full"] > 0  # refused at the door, or given up once late
    assert res.counts["rejected"] == res.counts["queue_full"] + res.counts["shed"]
    assert res.attainment() < 0.9
    assert (~res.served).sum() >= res.counts["rejected"]


def test_gives_up_only_when_the_target_is_out_of_reach(h200):
    model, tiers, factory = h200
    window = (2.0, 8.0)
    for rate in (60.0, 200.0):
        w = factory.poisson(rate, 8.0, seed=4)
        full = Simulator(SimConfig(num_instances=4), tiers, model).run(w)
        cut = Simulator(SimConfig(num_instances=4), tiers, model).run(w, window=window, give_up_below=0.9)
        assert cut.aborted == (full.attainment(window) < 0.9)
        if cut.aborted:
            assert cut.end_time < full.end_time
        else:
            np.testing.assert_array_equal(cut.attained, full.attained)


def test_gives_up_at_the_first_token_deadlines_a_queue_lets_pass(h200):
    """A request still without its first token at its deadline has missed, whenever that token comes: one instance
    that places everything at once, taking long prompts one after another, is given up by the tick after the
    second-token deadline of the window's request that puts the misses over the allowance, not when that request's
    late token finally comes out."""
    model, tiers, _ = h200
    n, window = 40, (2.0, 8.0)
    arrivals = 2.0 + 0.01 * np.arange(n)
    w = workload(arrivals, [8000] * n, [4] * n, tiers)
    config = SimConfig(num_instances=1, router_policy="least-loaded", engine_policy="fcfs")
    full = Simulator(config, tiers, model).run(w)
    cut = Simulator(config, tiers, model).run(w, window=window, give_up_below=0.9)
    due = arrivals + tiers[0].ttft_ms / 1000.0
    missed_first = np.sort(due[~(full.ttft <= tiers[0].ttft_ms / 1000.0)])
    allowed = int(0.1 * n)
    assert len(missed_first) > allowed and full.attainment(window) < 0.9
    known = missed_first[allowed]  # the deadline that puts the misses over the allowance
    given_up_by = known + tiers[0].tpot_ms / 1000.0 + config.tick_s
    first_out = arrivals + np.nan_to_num(full.ttft, nan=np.inf)
    assert first_out[due == known].min() > given_up_by  # its token comes later than the give-up
    assert cut.aborted and known < cut.end_time <= given_up_by


def test_gives_up_on_hand_offs_a_full_decode_pool_refuses(h200):
    """PD mode: hand-offs whose decode instance has no room are tried again at every tick, their first token out;
    once their second token's deadline passes they have missed, and the run is given up by the tick after the one
    that puts the misses over the allowance."""
    model, tiers, _ = h200
    n, window = 40, (2.0, 8.0)
    arrivals = 2.0 + 0.01 * np.arange(n)
    w = workload(arrivals, [64] * n, [400] * n, tiers)
    config = SimConfig(num_instances=2, prefill_instances=1, router_policy="least-loaded", engine_policy="fcfs",
                       num_kv_blocks=256)
    full = Simulator(replace(config, record_token_times=True), tiers, model).run(w)
    cut = Simulator(config, tiers, model).run(w, window=window, give_up_below=0.9)
    assert full.counts["import_refused"] > 0 and full.attainment(window) < 0.9
    second_due = arrivals + (tiers[0].ttft_ms + tiers[0].tpot_ms) / 1000.0
    second_out = np.array([times[1] if times is not None and len(times) > 1 else np.inf
                           for times in full.token_times])
    late = np.sort(second_due[second_out > second_due])  # the deadlines of the second tokens that came late
    allowed = int(0.1 * n)
    assert len(late) > allowed
    assert cut.aborted and cut.end_time <= late[allowed] + config.tick_s < second_out[second_due == late[allowed]].min()


def test_autoscaled_fleet_follows_a_phase_change(h200):
    from cluster.autoscaler import ScalingLimits

    model, tiers, factory = h200
    w = factory.poisson(60.0, 40.0, seed=2, phase_change_at=20.0)
    limits = ScalingLimits(min_instances=2, max_instances=12, idle_pool=1, stop_after_idle_s=2.0)
    sim = Simulator(SimConfig(num_instances=2, autoscale=limits, cold_start_s=5.0), tiers, model)
    res = sim.run(w)
    live = [s[3] for s in res.samples]
    assert max(live) > 2  # it scaled up
    assert res.instance_seconds == pytest.approx(sum(live) * sim.sample_s, rel=0.1)
    tight_before = np.mean([s[1][0] for s in res.samples if 10 <= s[0] < 20])
    tight_after = np.mean([s[1][0] for s in res.samples if 30 <= s[0] < 40])
    assert tight_after > tight_before  # the inverted mix sends far more tight requests
    assert res.attainment() > 0.8


def test_costly_share_refuses_long_prompts_past_capacity_and_none_with_room(h200):
    """Past capacity, a tier that queues refuses some of its longest prompts at once, within its share; with room,
    the share changes nothing."""
    model, tiers, factory = h200
    w = factory.poisson(400.0, 4.0, 1)
    sim = Simulator(SimConfig(num_instances=4, costly_share=0.06), tiers, model)
    res = sim.run(w)
    refused = np.array([int(e.request_id[1:]) for e in sim.router.events if e.kind == "costly"])
    assert len(refused) and res.counts["costly"] == len(refused)
    assert res.counts["rejected"] == res.counts["queue_full"] + res.counts["shed"] + res.counts["costly"]
    assert not res.served[refused].any()
    for k in range(len(tiers)):
        of_tier = w.tier_index == k
        mine = refused[w.tier_index[refused] == k]
        assert len(mine) <= 0.06 * of_tier.sum()
        if len(mine):
            assert w.prompt_lens[mine].min() >= np.quantile(w.prompt_lens[of_tier], 0.85)
    _, calm = fleet_run(h200, costly_share=0.06)
    _, calm_plain = fleet_run(h200)
    assert calm.counts.get("costly", 0) == 0
    assert (calm.attained == calm_plain.attained).all() and (calm.ttft == calm_plain.ttft).all()


class ReserveRecorder:
    """A batch policy that notes, as it schedules, the reserve each running request carries."""

    def __init__(self, policy, seen: dict):
        self.policy, self.seen = policy, seen

    def schedule(self, now, running, waiting, kv):
        for r in running:
            self.seen.setdefault(r.request_id, set()).add(r.tpot_reserve)
        return self.policy.schedule(now, running, waiting, kv)


def test_token_reserve_reaches_the_simulated_engines_from_the_router(h200):
    """With token_reserve the router's margins, raised by the misses of a fleet past its capacity under prediction
    error, ride each placement onto the instance's requests, as they were then; without it none does."""
    model, tiers, factory = h200
    w = factory.poisson(400.0, 4.0, 1)

    def reserves(token_reserve: bool) -> dict:
        cfg = SimConfig(num_instances=4, prediction_error=prediction_error("gpu-typical"), token_reserve=token_reserve)
        seen: dict = {}
        sim = Simulator(cfg, tiers, model, policy_factory=lambda m, h: ReserveRecorder(cfg.batch_policy(m, h), seen))
        sim.run(w)
        assert max(h.margin for h in sim.router.headroom) > 0
        return seen

    with_reserve = reserves(True)
    values = [v for vs in with_reserve.values() for v in vs]
    assert len(set(values)) > 2 and max(values) > 0 and all(0 <= v < 1 for v in values)
    assert {v for vs in reserves(False).values() for v in vs} == {0.0}
