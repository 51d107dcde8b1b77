"""The simulator against the live engine in real time: one emulated engine (engine.llm.build_engine, executor
"emulated", sleeping the latency model's step time) and the simulator serve the same workload; with the engine's
measured host time per step added (a constant plus a part per sequence, fitted to the engine's own step records:
on this CPU about 0.2-0.3 ms + 5-10 us per sequence), the simulator's attainment and latency are close to the engine's.

The latency model is Llama-3.1-8B on an H200 scaled by 0.5, so the run takes seconds."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cluster.calibration import attained, replay_on_engine, write_emulated_model_folder
from cluster.emulation import ScaledLatencyModel, emulated_latency_model
from cluster.simulator import SimConfig, Simulator
from cluster.workload import TierMix, WorkloadFactory, default_tiers, load_trace
from scheduler.polyserve import PolyServePolicy

TIME_SCALE = 0.5
RATE = 36.0  # requests per second of scaled time: 18/s on the real H200, near one mixed instance's limit
DURATION = 6.0
# A run in which the CPU was taken from the engine for more than this share of its time (another process on a
# shared machine) is run again, up to ATTEMPTS times: such stalls are no property of the engine that a simulator
# could model. Quiet runs here stall ~0.2 %; two CPU hogs on this 2-core machine ~2.5 % (the figures still agree);
# six hogs ~11 % (they do not).
MAX_STALL_SHARE = 0.03
ATTEMPTS = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model = ScaledLatencyModel(emulated_latency_model().base, TIME_SCALE)
    tiers = default_tiers(model)
    cfg = SimConfig(num_instances=1, router_policy="round-robin", reveal_output_len=True)
    factory = WorkloadFactory(load_trace("azure2023_conv"), tiers, model, cfg.kv_blocks * cfg.block_size,
                              cfg.max_prefill_chunk, TierMix((1, 1, 1, 1)))
    w = factory.poisson(RATE, DURATION, seed=7)
    folder = write_emulated_model_folder(tmp_path_factory.mktemp("m"))
    attempts = []
    for _ in range(ATTEMPTS):
        policy = PolyServePolicy(model, tiers[3].slo, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                 cfg.max_prefill_chunk)
        attempts.append(replay_on_engine(w, model, policy, folder, cfg.kv_blocks, clock="real"))
        if attempts[-1].stall_s <= MAX_STALL_SHARE * attempts[-1].wall_s:
            break
    live = min(attempts, key=lambda r: r.stall_s / r.wall_s)
    sim = Simulator(dataclasses.replace(cfg, step_overhead_s=live.step_overhead_s,
                                        step_overhead_per_seq_s=live.step_overhead_per_seq_s), tiers, model).run(w)
    return w, live, sim


def test_every_request_served_by_both(runs):
    w, live, sim = runs
    assert all(t is not None and len(t) == n for t, n in zip(live.token_times, w.output_lens))
    assert sim.served.all()
    assert 0 < live.step_overhead_s + 32 * live.step_overhead_per_seq_s < 0.005  # a CPU's host time per step


def test_the_kept_run_was_not_disturbed(runs):
    w, live, sim = runs
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
