"""The simulator against the live engine in real time: one emulated engine (engine.llm.build_engine, executor
"emulated", sleeping the latency model's step time) and the simulator serve the same workload; with the engine's
measured host time per step added (a constant plus a part per sequence, fitted to the engine's own step records:
on this CPU about 0.2-0.3 ms + 5-10 us per sequence), the simulator's attainment and latency are close to the engine's.

The latency model is Llama-3.1-8B on an H200 scaled by 0.5, so the run takes seconds.

Then a fleet: four emulated engine processes behind the live router service (cluster/service.py, the PolyServe
router, sockets and all) serve a mixed-tier workload in real time, and the simulator with four instances serves the
same one: attainment within a few points, per-tier latency distributions alike."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cluster.sim.calibration import (attained, replay_on_engine, replay_on_fleet, simulated_with_host_time,
                                     write_emulated_model_folder)
from cluster.sim.simulator import SimConfig
from cluster.sim.workload import TierMix, WorkloadFactory, default_tiers, load_trace
from scheduler.polyserve import PolyServePolicy
from scheduler.roofline import emulated_latency_model

# Real time: the live engine sleeps and is measured on the wall clock (see pyproject.toml's `realtime` marker).
pytestmark = pytest.mark.realtime

TIME_SCALE = 0.5
RATE = 36.0  # requests per second of scaled time: 18/s on the real H200, near one mixed instance's limit
DURATION = 6.0
# A run in which the CPU was taken from the engine for more than this share of its time (another process on a
# shared machine) is run again, up to ATTEMPTS times: such stalls are no property of the engine that a simulator
# could model. Quiet runs here stall ~0.2 %; two CPU hogs on this 2-core machine ~2.5 % (the figures still agree);
# six hogs ~11 % (they do not).
MAX_STALL_SHARE = 0.03
ATTEMPTS = 3


def _quietest(replay):
    """`replay()` run until one run is undisturbed, at most ATTEMPTS times: the quietest run."""
    attempts = []
    for _ in range(ATTEMPTS):
        attempts.append(replay())
        if attempts[-1].stall_s <= MAX_STALL_SHARE * attempts[-1].wall_s:
            break
    return min(attempts, key=lambda r: r.stall_s / r.wall_s)


def _compared(cfg: SimConfig, tiers, model, w, replay, policy_factory=None):
    """The quietest live run, and the simulator on the same workload with the run's host time per step."""
    live = _quietest(replay)
    return w, live, simulated_with_host_time(cfg, tiers, model, w, live, policy_factory)


def _workload(model, tiers, cfg: SimConfig, rate: float, duration: float):
    factory = WorkloadFactory(load_trace("azure2023_conv"), tiers, model, cfg.kv_blocks * cfg.block_size,
                              cfg.max_prefill_chunk, TierMix((1, 1, 1, 1)))
    return factory.poisson(rate, duration, seed=7)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model = emulated_latency_model(TIME_SCALE)
    tiers = default_tiers(model)
    cfg = SimConfig(num_instances=1, router_policy="round-robin", reveal_output_len=True)
    w = _workload(model, tiers, cfg, RATE, DURATION)
    folder = write_emulated_model_folder(tmp_path_factory.mktemp("m"))

    def policy(*_):  # the same on both sides: the model as given, no headroom
        return PolyServePolicy(model, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_prefill_chunk)

    def replay():
        return replay_on_engine(w, model, policy(), folder, cfg.kv_blocks, clock="real")

    return _compared(cfg, tiers, model, w, replay, policy)


def test_every_request_served_by_both(runs):
    w, live, sim = runs
    assert all(t is not None and len(t) == n for t, n in zip(live.token_times, w.output_lens))
    assert sim.served.all()
    assert 0 < live.step_overhead_s + 32 * live.step_overhead_per_seq_s < 0.005  # a CPU's host time per step


@pytest.mark.parametrize("compared", ["runs", "fleet_runs"])
def test_the_kept_run_was_not_disturbed(compared, request):
    w, live, sim = request.getfixturevalue(compared)
    assert live.stall_s <= MAX_STALL_SHARE * live.wall_s, \
        f"every attempt lost over {MAX_STALL_SHARE:.0%} of its time to stalls (best {live.stall_s:.3f} s)"


def test_attainment_within_a_few_points(runs):
    w, live, sim = runs
    assert abs(attained(w, live.token_times).mean() - sim.attainment()) <= 0.06


def test_latency_distributions_alike(runs):
    w, live, sim = runs
    live_ttft = np.array([t[0] - a for t, a in zip(live.token_times, w.arrivals)])
    live_tpot = np.array([(t[-1] - t[0]) / (len(t) - 1) for t in live.token_times if len(t) > 1])
    sim_tpot = sim.mean_tpot[~np.isnan(sim.mean_tpot)]
    for q in (50, 90):
        assert np.percentile(sim_tpot, q) == pytest.approx(np.percentile(live_tpot, q), rel=0.15)
    # first tokens queue near this load: the tail is the most sensitive figure, so it gets the widest margin
    assert np.percentile(sim.ttft, 50) == pytest.approx(np.percentile(live_ttft, 50), rel=0.3)
    assert np.percentile(sim.ttft, 90) == pytest.approx(np.percentile(live_ttft, 90), rel=0.5)


# ---- a fleet through the live router --------------------------------------------------------------------------
FLEET_TIME_SCALE = 2.0  # iterations twice the H200's: host time (sockets, reports) stays small beside them
FLEET_SIZE = 4
FLEET_RATE = 36.0  # requests per second of scaled time: 0.8 x the fluid bound of four instances (11.4/s each)
FLEET_DURATION = 8.0


@pytest.fixture(scope="module")
def fleet_runs(tmp_path_factory):
    model = emulated_latency_model(FLEET_TIME_SCALE)
    tiers = default_tiers(model)
    cfg = SimConfig(num_instances=FLEET_SIZE, reveal_output_len=True, shed_late=False)  # every request served
    w = _workload(model, tiers, cfg, FLEET_RATE, FLEET_DURATION)
    folder = write_emulated_model_folder(tmp_path_factory.mktemp("fleet"))

    def replay():
        return asyncio.run(replay_on_fleet(
            w, FLEET_TIME_SCALE, FLEET_SIZE, folder, cfg.kv_blocks, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens, max_prefill_chunk=cfg.max_prefill_chunk, model=model,
            shed_late=cfg.shed_late))

    return _compared(cfg, tiers, model, w, replay)


def test_fleet_every_request_served_by_both(fleet_runs):
    w, live, sim = fleet_runs
    assert live.failed == 0 and sim.served.all()
    assert all(t is not None and len(t) == n for t, n in zip(live.token_times, w.output_lens))
    assert sorted(live.steps) == [f"engine-{k}" for k in range(FLEET_SIZE)]  # the router used every engine
    assert all(n > 100 for n in live.steps.values())


def test_fleet_attainment_within_a_few_points(fleet_runs):
    w, live, sim = fleet_runs
    assert abs(attained(w, live.token_times).mean() - sim.attainment()) <= 0.05


def test_fleet_latency_distributions_alike_per_tier(fleet_runs):
    w, live, sim = fleet_runs
    print(f"fleet replay: stall {live.stall_s:.3f} s of {live.wall_s:.1f} s, host time {live.step_overhead_s * 1e3:.2f} ms"
          f" + {live.step_overhead_per_seq_s * 1e6:.1f} us per sequence")
    for k, tier in enumerate(w.tiers):
        idx = np.flatnonzero(w.tier_index == k)
        times = [live.token_times[i] for i in idx]
        live_ttft = np.array([t[0] - w.arrivals[i] for i, t in zip(idx, times)])
        live_tpot = np.array([(t[-1] - t[0]) / (len(t) - 1) for t in times if len(t) > 1])
        sim_tpot = sim.mean_tpot[idx][~np.isnan(sim.mean_tpot[idx])]
        assert np.percentile(sim_tpot, 50) == pytest.approx(np.percentile(live_tpot, 50), rel=0.15), tier.name
        assert np.percentile(sim_tpot, 90) == pytest.approx(np.percentile(live_tpot, 90), rel=0.2), tier.name
        assert np.percentile(sim.ttft[idx], 50) == pytest.approx(np.percentile(live_ttft, 50), rel=0.3), tier.name
        assert np.percentile(sim.ttft[idx], 90) == pytest.approx(np.percentile(live_ttft, 90), rel=0.5), tier.name
