"""The simulator against the engine, in virtual time: the calibration benchmark's engine comparison
(bench/calibration_replay.py: its workload, latency model and batch policy) with the live engine stepping on the
virtual clock agrees with the simulator to rounding, with no host time and no stall; the host-time fit recovers what
synthetic steps were given and counts as stall only what it cannot explain; and the simulator adds a fitted host
time to every step. The same comparisons in real time depend on how busy the machine is, which no test controls:
they are the benchmark (`python -m bench.calibration_replay`). A short replay through a live prefill/decode fleet
(emulated engine processes behind the router service) serves every request whole, its first token from a prefill
engine and the rest from one decode engine, and the simulator replays it in the same split; a burst through a live
fleet with a costly share is refused only its costliest prompts."""
from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from bench.calibration_replay import engine_policy, engine_setup
from cluster.sim.calibration import (STALL_THRESHOLD_S, busy_gaps, EngineReplay, attained, host_time, live_latencies,
                                     replay_on_engine, replay_on_fleet, simulated_with_host_time, write_emulated_model_folder)
from cluster.sim.simulator import SimConfig
from cluster.sim.workload import Workload
from scheduler.costly import MIN_ARRIVALS
from scheduler.prediction_error import PredictionError
from scheduler.roofline import emulated_latency_model
from scheduler.tiers import Tier, TierSet
from scheduler.types import StepStats


@pytest.fixture(scope="module")
def virtual_runs(tmp_path_factory):
    setup = engine_setup()
    folder = write_emulated_model_folder(tmp_path_factory.mktemp("m"))
    live = replay_on_engine(setup.workload, setup.model, engine_policy(setup), folder, setup.config.kv_blocks,
                            clock="virtual")
    config = dataclasses.replace(setup.config, record_token_times=True)
    sim = simulated_with_host_time(config, setup.tiers, setup.model, setup.workload, live,
                                   lambda *_: engine_policy(setup))
    return setup, live, sim


def test_virtual_replay_of_the_benchmark_agrees_with_the_simulator(virtual_runs):
    setup, live, sim = virtual_runs
    w = setup.workload
    assert all(t is not None and len(t) == n for t, n in zip(live.token_times, w.output_lens)) and sim.served.all()
    assert live.stall_s == 0.0  # the virtual clock moves by the model alone: nothing to explain
    assert live.step_overhead_s == pytest.approx(0.0, abs=1e-12)
    assert live.step_overhead_per_seq_s == pytest.approx(0.0, abs=1e-12)
    for i, (mine, theirs) in enumerate(zip(sim.token_times, live.token_times)):
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-9, err_msg=f"request {i}")
    assert attained(w, live.token_times).tolist() == attained(w, sim.token_times).tolist()
    assert attained(w, live.token_times).mean() == sim.attainment()
    assert len(set(w.tier_index.tolist())) == len(w.tiers) and live.num_steps > len(w)  # every tier, real batching


def steps(extra: list[float], seqs: list[int], slept: float = 0.01) -> tuple[list[StepStats], list[float]]:
    """Steps that slept `slept` each and took `extra` more, with `seqs` sequences."""
    stats = [StepStats(start=float(i), duration=slept + e, num_prefill_tokens=0, num_decode_seqs=n, num_kv_tokens=0,
                       num_blocks_used=0, num_running=n, num_waiting=0, num_seqs=n)
             for i, (e, n) in enumerate(zip(extra, seqs))]
    return stats, [slept] * len(stats)


def test_host_time_fit_recovers_a_constant_and_a_part_per_sequence():
    seqs = [1, 4, 9, 16, 32, 2, 7, 64]
    stats, slept = steps([3e-4 + 8e-6 * n for n in seqs], seqs)
    const, per_seq, stall = host_time(stats, slept)
    assert const == pytest.approx(3e-4, abs=1e-12) and per_seq == pytest.approx(8e-6, abs=1e-13)
    assert stall == pytest.approx(0.0, abs=1e-12)


def test_host_time_stall_is_what_the_fit_leaves_over_the_threshold():
    seqs = [1, 2, 3, 4, 5, 6, 7, 8] * 4
    extra = [2e-4 + 1e-5 * n for n in seqs]
    extra[5] += 0.05  # one step held up: the CPU taken away
    stats, slept = steps(extra, seqs)
    gaps = [1e-4, 0.02, STALL_THRESHOLD_S / 2]  # only the middle one is a stall
    const, per_seq, stall = host_time(stats, slept, gaps)
    # the held step pulls the least-squares fit a little; what it leaves unexplained is the stall
    residual = np.array(extra) - const - per_seq * np.array(seqs)
    over = residual[residual > STALL_THRESHOLD_S] - STALL_THRESHOLD_S
    assert len(over) == 1 and stall == pytest.approx(over.sum() + 0.02 - STALL_THRESHOLD_S, abs=1e-12)
    assert 0.04 < stall < 0.07


def test_the_engines_time_between_busy_steps_is_host_time():
    """What an engine does after a step is measured and before its next step starts (its bookkeeping, its loop) is
    host time too, while requests are left to run; the time an idle engine waits for work is not."""
    seqs = [1, 2, 4, 8, 16, 32]
    stats, slept = steps([1e-4 + 5e-6 * n for n in seqs], seqs)
    stats = [dataclasses.replace(s, start=i * 0.1) for i, s in enumerate(stats)]  # each 0.1 s after the last
    idle = dataclasses.replace(stats[2], num_running=0, num_waiting=0)  # nothing left after it: the engine waits
    stats[2] = idle
    between = busy_gaps(stats)
    assert between[2] == 0.0 and between[-1] == 0.0
    assert between[0] == pytest.approx(0.1 - stats[0].duration) and between[3] == pytest.approx(0.1 - stats[3].duration)
    const, per_seq, _ = host_time(stats, slept, between=between)
    alone, _, _ = host_time(stats, slept)
    assert const > alone + 0.05  # the time before each busy step's successor counts


def test_host_time_fit_never_goes_negative():
    seqs = [1, 2, 4, 8, 16]
    falling = [1e-3 - 5e-5 * n for n in seqs]  # more sequences, less time: no part per sequence
    stats, slept = steps(falling, seqs)
    const, per_seq, _ = host_time(stats, slept)
    assert per_seq == 0.0 and const == pytest.approx(np.mean(falling), abs=1e-15)
    rising = [2e-5 * n for n in seqs]  # a fit through the origin: no constant
    stats, slept = steps([e - 1e-4 for e in rising], seqs)
    const, per_seq, _ = host_time(stats, slept)
    assert const == 0.0 and per_seq > 0
    assert host_time(*steps([5e-3], [1])) == (0.0, 0.0, 0.0)  # one step fits nothing


class LinearModel:
    def predict(self, p, d, k):
        return 0.01 + 1e-4 * p + 1e-3 * d


def test_simulator_adds_the_fitted_host_time_to_every_step():
    """A lone request, prefill then decodes: each step takes the fitted host time (constant plus one sequence's)
    on top of the model and of the config's own prediction error."""
    tiers = TierSet([Tier("only", tpot_ms=1000.0, ttft_ms=10_000.0)])
    w = Workload(np.array([0.0]), np.array([100]), np.array([6]), np.zeros(1, np.int8), tiers)
    config = SimConfig(num_instances=1, router_policy="round-robin", reveal_output_len=True, record_token_times=True,
                       prediction_error=PredictionError(host_s=1e-3))
    fitted = EngineReplay([], 0, 0.0, step_overhead_s=2e-3, step_overhead_per_seq_s=5e-4)
    nothing = dataclasses.replace(fitted, step_overhead_s=0.0, step_overhead_per_seq_s=0.0)
    plain = simulated_with_host_time(config, tiers, LinearModel(), w, nothing).token_times[0]
    added = simulated_with_host_time(config, tiers, LinearModel(), w, fitted).token_times[0]
    per_step = 2e-3 + 5e-4  # one sequence in every step
    np.testing.assert_allclose(np.diff(added), np.diff(plain) + per_step, rtol=0, atol=1e-12)
    assert np.diff(plain) == pytest.approx(0.01 + 1e-3 + 1e-3, abs=1e-12)  # the model's decode plus the config's
    assert added[0] == pytest.approx(plain[0] + per_step, abs=1e-12)


def test_live_pd_fleet_hands_every_request_from_a_prefill_to_a_decode_engine(tmp_path):
    """One prefill and two decode engine processes: every request comes back whole, its first token from the
    prefill engine and every later one from a single decode engine; the one-token requests end on the prefill
    engine. Judged by where tokens came from, never by when (every request is served, however late). First-token
    deadlines far past the prefill's: on a busy machine the router learns slow steps, and a prompt the prefill
    engine could not start on time would go whole to a decode engine ("convertible"), as it should."""
    model = emulated_latency_model(1.0)
    tiers = TierSet([Tier("tight", tpot_ms=50.0, ttft_ms=5000.0), Tier("loose", tpot_ms=200.0, ttft_ms=20_000.0)])
    output_lens = np.array([6, 1, 12, 3, 9, 1, 4, 7])
    n = len(output_lens)
    w = Workload(0.04 * np.arange(n), np.array([40, 300, 120, 900, 64, 17, 500, 230]), output_lens,
                 np.array([0, 1] * (n // 2), np.int8), tiers)
    live = asyncio.run(replay_on_fleet(w, 1.0, 3, write_emulated_model_folder(tmp_path), 1024, max_num_seqs=64,
                                       max_num_batched_tokens=2048, max_prefill_chunk=2048, model=model,
                                       shed_late=False, prefill_instances=1))
    assert live.failed == 0 and live.refused == 0
    assert sorted(live.roles.values()) == ["decode", "decode", "prefill"] and live.prefill_instances == 1
    for i, (times, where) in enumerate(zip(live.token_times, live.token_instances)):
        assert times is not None and len(times) == len(where) == output_lens[i], f"request {i}"
        assert live.roles[where[0]] == "prefill", f"request {i}"
        assert len(set(where[1:])) <= 1 and all(live.roles[x] == "decode" for x in where[1:]), f"request {i}"
    assert live.counts.get("handed_off") == int((output_lens > 1).sum())
    assert not live.counts.get("transfer_failed") and not live.counts.get("migrated")

    config = SimConfig(num_instances=3, shed_late=False, reveal_output_len=True, max_num_seqs=64,
                       max_num_batched_tokens=2048, num_kv_blocks=1024)
    sim = simulated_with_host_time(config, tiers, model, w, live)
    assert sim.served.all() and sim.handed_off.tolist() == (output_lens > 1).tolist()
    with pytest.raises(ValueError, match="not the replayed fleet's"):
        simulated_with_host_time(dataclasses.replace(config, prefill_instances=2), tiers, model, w, live)


def test_live_fleet_refuses_only_the_costliest_prompts_of_a_burst_it_cannot_place(tmp_path):
    """A burst far past one engine's first-token deadlines, through the live router with a costly share and no
    shedding: every request it refuses is among the longest prompts of those that came before it, none comes before
    the share has enough arrivals to judge, they stay within the share, and every other request is served whole."""
    model = emulated_latency_model(1.0)
    tiers = TierSet([Tier("tight", tpot_ms=50.0, ttft_ms=300.0)])
    n, share = MIN_ARRIVALS + 60, 0.1
    prompts = 64 + (np.arange(n) * 97) % 900  # distinct lengths (97 and 900 are coprime) spread over 64-963
    w = Workload(0.0005 * np.arange(n), prompts, np.full(n, 2), np.zeros(n, np.int8), tiers)
    live = asyncio.run(replay_on_fleet(w, 1.0, 1, write_emulated_model_folder(tmp_path), 4096, max_num_seqs=64,
                                       max_num_batched_tokens=2048, max_prefill_chunk=2048, model=model,
                                       shed_late=False, costly_share=share))
    refused = [i for i, times in enumerate(live.token_times) if times is None]
    assert live.failed == 0 and live.refused == len(refused) > 0
    assert min(refused) >= MIN_ARRIVALS and len(refused) <= share * n
    for i in refused:
        assert prompts[i] >= np.quantile(prompts[:i + 1], 1.0 - share, method="lower"), f"request {i}"
    assert all(len(times) == 2 for times in live.token_times if times is not None)


def test_live_latencies_of_the_requests_that_emitted_tokens():
    arrivals = np.array([0.0, 1.0, 2.0, 3.0])
    token_times = [[0.5, 0.7, 1.1], None, [2.25], [3.5, 4.5]]
    ttft, tpot = live_latencies(arrivals, token_times)
    assert ttft.tolist() == pytest.approx([0.5, 0.25, 0.5]) and tpot.tolist() == pytest.approx([0.3, 1.0])
    ttft, tpot = live_latencies(arrivals, token_times, np.array([1, 2]))
    assert ttft.tolist() == pytest.approx([0.25]) and tpot.size == 0
