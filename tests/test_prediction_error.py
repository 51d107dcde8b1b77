"""The step-time truth (scheduler/prediction_error.py): presets, StepTruth's draws, the expected model, the fit, and
that the simulator and the emulated engine both step on it while every predictor keeps the plain model."""
from __future__ import annotations

import random
import statistics

import numpy as np
import pytest

from cluster.sim.calibration import write_emulated_model_folder
from cluster.sim.simulator import SimConfig, Simulator
from cluster.worker import parse_args
from engine import EngineConfig, SamplingParams, build_engine
from scheduler.chunking import largest_chunk
from scheduler.latency_model import ChunkSolvingModel
from scheduler.prediction_error import (EXACT, PREDICTION_ERRORS, ExpectedLatencyModel, PredictionError, StepTruth,
                                        expected_latency_model, fit_prediction_error, prediction_error)
from scheduler.roofline import emulated_latency_model

GPU_TYPICAL = PREDICTION_ERRORS["gpu-typical"]


class LinearModel:
    def predict(self, p, d, k):
        return 0.004 + 2e-5 * p + 1e-4 * d + 1e-8 * k


def shapes(n: int, seed: int = 0) -> list[tuple[int, int, int, int]]:
    """(prefill tokens, decode seqs, KV tokens, sequences) of n mixed batches."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.choice((0, 0, rng.randrange(1, 2048)))
        d = rng.randrange(0 if p else 1, 257)
        out.append((p, d, rng.randrange(d + p, 300_000), d + (1 if p else 0)))
    return out


# ---- presets and validation -------------------------------------------------------------------------------------
def test_presets_resolve_by_name_and_a_bad_name_lists_them():
    assert prediction_error("exact") is EXACT == PredictionError()
    assert prediction_error(GPU_TYPICAL) is GPU_TYPICAL
    assert set(PREDICTION_ERRORS) == {"exact", "cpu-measured", "gpu-typical"}
    with pytest.raises(ValueError, match="unknown prediction error 'gpu'.*exact, cpu-measured, gpu-typical"):
        prediction_error("gpu")
    with pytest.raises(ValueError, match="unknown prediction error"):
        EngineConfig(executor="emulated", prediction_error="gpu")


@pytest.mark.parametrize("bad", [dict(sigma=-0.1), dict(host_s=-1e-3), dict(stall_prob=1.5), dict(bias=-1.0),
                                 dict(bias=-0.9, instance_spread=0.2), dict(stall_s=float("nan"))])
def test_out_of_range_parameters_are_refused(bad):
    with pytest.raises(ValueError, match="prediction error"):
        PredictionError(**bad)


# ---- StepTruth ----------------------------------------------------------------------------------------------------
def test_exact_is_the_prediction_bit_for_bit():
    model = emulated_latency_model()
    truth = StepTruth(model, EXACT, seed=3)
    for p, d, k, n in shapes(2000):
        assert truth.duration(p, d, k, n) == model.predict(p, d, k)
    assert expected_latency_model(model, EXACT) is model


def test_mean_of_many_draws_matches_the_expected_model():
    """Over many instances (their own biases) and steps (noise, stalls), the mean is the expected model's."""
    model = LinearModel()
    expected = expected_latency_model(model, GPU_TYPICAL)
    for p, d, k, n in ((0, 64, 40_000, 64), (512, 8, 6_000, 9), (0, 1, 100, 1)):
        total = 0.0
        for instance in range(200):
            truth = StepTruth(model, GPU_TYPICAL, seed=f"mean/{instance}")
            total += sum(truth.duration(p, d, k, n) for _ in range(500))
        assert total / 100_000 == pytest.approx(expected.predict(p, d, k), rel=0.01)


def test_noise_has_mean_one_and_the_asked_spread():
    model = LinearModel()
    truth = StepTruth(model, PredictionError(sigma=0.3), seed=1)
    ratios = [truth.duration(0, 4, 0, 4) / model.predict(0, 4, 0) for _ in range(100_000)]
    assert statistics.fmean(ratios) == pytest.approx(1.0, abs=0.005)
    assert statistics.pstdev(np.log(ratios).tolist()) == pytest.approx(0.3, rel=0.02)


def test_stalls_come_at_their_frequency():
    model = LinearModel()
    truth = StepTruth(model, PredictionError(stall_prob=0.01, stall_s=0.5), seed=2)
    stalls = sum(truth.duration(0, 1, 0, 1) > 0.5 for _ in range(100_000))
    assert stalls == pytest.approx(1000, rel=0.1)
    always = StepTruth(model, PredictionError(stall_prob=1.0, stall_s=0.5), seed=2)
    assert all(always.duration(0, 1, 0, 1) == model.predict(0, 1, 0) + 0.5 for _ in range(600))


def test_deterministic_for_a_seed_and_instances_differ():
    model = LinearModel()
    batches = shapes(1000)
    a, b = StepTruth(model, GPU_TYPICAL, "7/0"), StepTruth(model, GPU_TYPICAL, "7/0")
    c = StepTruth(model, GPU_TYPICAL, "7/1")
    times_a = [a.duration(*s) for s in batches]
    assert times_a == [b.duration(*s) for s in batches]
    assert times_a != [c.duration(*s) for s in batches]
    assert a.instance_bias == b.instance_bias != c.instance_bias
    assert abs(a.instance_bias) <= GPU_TYPICAL.instance_spread


def test_rewound_steps_are_drawn_again_the_same():
    """Steps given back repeat their randomness (the simulator lays out decode runs ahead and cuts them), across
    the boundary of a block of draws too."""
    model = LinearModel()
    truth = StepTruth(model, GPU_TYPICAL, seed=4)
    first = [truth.duration(0, 8, 1000, 8) for _ in range(300)]
    truth.rewind(100)
    assert [truth.duration(0, 8, 1000, 8) for _ in range(100)] == first[200:]
    truth.rewind(300)
    assert [truth.duration(0, 8, 1000, 8) for _ in range(300)] == first
    with pytest.raises(ValueError, match="only 300 were drawn"):
        truth.rewind(301)
    with pytest.raises(ValueError, match="negative"):
        truth.rewind(-1)


# ---- the expected model --------------------------------------------------------------------------------------------
def test_expected_model_is_the_mean_formula_and_solves_its_chunk():
    roofline = emulated_latency_model()
    expected = expected_latency_model(roofline, GPU_TYPICAL)
    mean_stall = GPU_TYPICAL.stall_prob * GPU_TYPICAL.stall_s
    assert expected.predict(0, 32, 20_000) == pytest.approx(
        1.1 * roofline.predict(0, 32, 20_000) + 1e-3 + mean_stall + 32 * 7e-6, rel=1e-12)
    assert expected.predict(256, 32, 20_000) == pytest.approx(
        1.1 * roofline.predict(256, 32, 20_000) + 1e-3 + mean_stall + 33 * 7e-6, rel=1e-12)
    assert isinstance(expected, ChunkSolvingModel)
    searched = ExpectedLatencyModel(roofline, GPU_TYPICAL)  # the same predictions, found by binary search
    assert not isinstance(searched, ChunkSolvingModel)
    for budget in (0.005, 0.012, 0.02, 0.05, 0.2):
        for d, kv, p in ((0, 0, 0), (16, 30_000, 0), (200, 400_000, 128)):
            assert largest_chunk(expected, budget, d, kv, 4096, p) == largest_chunk(searched, budget, d, kv, 4096, p)


# ---- the fit --------------------------------------------------------------------------------------------------------
def synthetic_steps(error: PredictionError, n: int, seed: int = 0):
    model = LinearModel()
    truth = StepTruth(model, error, seed)
    batches = shapes(n, seed)
    return ([model.predict(p, d, k) for p, d, k, _ in batches], [truth.duration(*s) for s in batches],
            [s[3] for s in batches])


def test_fit_recovers_the_parameters_of_synthetic_steps():
    known = PredictionError(host_s=1e-3, host_per_seq_s=7e-6, sigma=0.05, bias=0.1, stall_prob=0.01, stall_s=0.02)
    fit = fit_prediction_error(*synthetic_steps(known, 20_000))
    assert fit.host_s == pytest.approx(known.host_s, abs=1e-4)
    assert fit.host_per_seq_s == pytest.approx(known.host_per_seq_s, rel=0.1)
    assert fit.bias == pytest.approx(known.bias, abs=0.01)
    assert fit.sigma == pytest.approx(known.sigma, rel=0.1)
    assert fit.stall_prob == pytest.approx(known.stall_prob, rel=0.25)
    assert fit.stall_s == pytest.approx(known.stall_s, rel=0.1)
    assert fit.instance_spread == 0.0


def test_fit_of_exact_steps_is_exact():
    fit = fit_prediction_error(*synthetic_steps(EXACT, 500))
    assert fit.bias == pytest.approx(0.0, abs=1e-9)
    assert fit.host_s == pytest.approx(0.0, abs=1e-9) and fit.host_per_seq_s == pytest.approx(0.0, abs=1e-11)
    assert fit.sigma == pytest.approx(0.0, abs=1e-9) and fit.stall_prob == 0.0


@pytest.mark.parametrize("args,match", [(([0.01] * 20, [0.01] * 19, [1] * 20), "one entry per step"),
                                        (([0.01] * 5, [0.01] * 5, [1] * 5), "at least 10 steps"),
                                        (([0.01] * 20, [0.01] * 19 + [-1.0], [1] * 20), "positive"),
                                        (([0.0] * 20, [0.01] * 20, [1] * 20), "positive scale")])
def test_fit_refuses_what_cannot_be_fitted(args, match):
    with pytest.raises(ValueError, match=match):
        fit_prediction_error(*args)


# ---- the simulator steps on the truth ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def h200(h200_fleet):
    model, tiers, factory = h200_fleet
    return model, tiers, factory.poisson(90.0, 8.0, seed=1)


def simulate(h200, **kw):
    model, tiers, workload = h200
    return Simulator(SimConfig(num_instances=4, **kw), tiers, model).run(workload)


def test_simulator_steps_on_the_truth_deterministically(h200):
    exact = simulate(h200)
    noisy = simulate(h200, prediction_error=GPU_TYPICAL, seed=3)
    again = simulate(h200, prediction_error=GPU_TYPICAL, seed=3)
    other = simulate(h200, prediction_error=GPU_TYPICAL, seed=4)
    np.testing.assert_array_equal(noisy.ttft, again.ttft)
    np.testing.assert_array_equal(noisy.worst_lateness, again.worst_lateness)
    assert not np.array_equal(noisy.ttft, exact.ttft, equal_nan=True)
    assert not np.array_equal(noisy.ttft, other.ttft, equal_nan=True)
    # the model is optimistic by 10 % plus host time: decodes are slower than predicted
    assert np.nanmedian(noisy.mean_tpot) > 1.05 * np.nanmedian(exact.mean_tpot)


def test_fast_forward_changes_nothing_under_prediction_error(h200):
    fast = simulate(h200, prediction_error=GPU_TYPICAL, fast_forward=True)
    slow = simulate(h200, prediction_error=GPU_TYPICAL, fast_forward=False)
    assert fast.num_policy_calls < slow.num_policy_calls
    assert fast.num_steps == slow.num_steps
    assert np.array_equal(fast.attained, slow.attained)
    np.testing.assert_allclose(fast.ttft, slow.ttft, rtol=0, atol=1e-9)
    np.testing.assert_allclose(fast.max_gap, slow.max_gap, rtol=0, atol=1e-9)
    np.testing.assert_allclose(fast.worst_lateness, slow.worst_lateness, rtol=0, atol=1e-9)


def test_sim_config_takes_a_prediction_error_value():
    with pytest.raises(ValueError, match="prediction_error must be a PredictionError"):
        SimConfig(prediction_error="gpu-typical")


# ---- the emulated engine sleeps the truth ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def emulated_folder(tmp_path_factory):
    return write_emulated_model_folder(tmp_path_factory.mktemp("emulated"))


def test_emulated_engine_sleeps_the_truth_and_predicts_by_the_model(emulated_folder):
    model = LinearModel()
    config = EngineConfig(model=emulated_folder, executor="emulated", num_kv_blocks=256,
                          prediction_error="gpu-typical", step_seed=5)
    engine = build_engine(config, latency_model=model, instance_id="engine-2")
    slept = []
    engine.executor.sleep = slept.append
    for i in range(6):
        engine.add_request(f"r{i}", [(i * 31 + j) % 1000 for j in range(40 + 30 * i)],
                           SamplingParams(max_tokens=12, ignore_eos=True))
    steps = []
    engine.step_hooks.append(steps.append)
    while engine.has_unfinished():
        engine.step()
    truth = StepTruth(model, GPU_TYPICAL, "5/engine-2")
    assert slept == [truth.duration(s.num_prefill_tokens, s.num_decode_seqs, s.num_kv_tokens, s.num_seqs)
                     for s in steps]
    assert slept != [model.predict(s.num_prefill_tokens, s.num_decode_seqs, s.num_kv_tokens) for s in steps]
    assert engine.latency_model.prior is model  # the predictors never see the truth


def test_prediction_error_flags_reach_the_workers():
    config = EngineConfig(executor="emulated", prediction_error="gpu-typical", step_seed=9)
    args = config.to_args()
    assert args[args.index("--prediction-error") + 1] == "gpu-typical"
    assert args[args.index("--step-seed") + 1] == "9"
    assert EngineConfig.from_args(parse_args(args)) == config
    assert "--prediction-error" not in EngineConfig(executor="emulated").to_args()
    with pytest.raises(ValueError, match="emulated executor only"):
        EngineConfig(executor="model", prediction_error="gpu-typical")
