"""The three latency-model sources: profile table, online least squares, roofline (checked against vidur's
measured GPU profiles in ../shared/profiles/)."""
import csv
import json
import math
import random
from itertools import combinations
from pathlib import Path

import pytest

from scheduler import (A100_SXM, H100_SXM, H200_SXM, LLAMA_3_1_8B, ModelShape, OnlineLatencyModel, ProfileTable,
                       RooflineLatencyModel, StepStats, largest_chunk)
from scheduler.build_profiles import PROFILE_DIR, SHIPPED, roofline_profile
from scheduler.online_fit import RIDGE, _nonnegative_least_squares, _solve_on, _spread

SHARED = Path(__file__).resolve().parents[2] / "shared"


class Linear:
    """time = base + per_prefill * P + per_decode * D + per_kv * K"""

    def __init__(self, base, per_prefill, per_decode, per_kv):
        self.c = (base, per_prefill, per_decode, per_kv)

    def predict(self, p, d, k):
        return self.c[0] + self.c[1] * p + self.c[2] * d + self.c[3] * k


# ---- profile table ----------------------------------------------------------------------------------------------

P_AXIS, D_AXIS, K_AXIS = [0, 64, 256, 1024], [0, 8, 32], [0, 1000, 10000]


def bilinear_cost(p, d, k):
    """Multilinear (linear in each input): trilinear interpolation must reproduce it everywhere, even past the grid."""
    return 0.004 + 2e-5 * p + 1e-4 * d + 3e-7 * k + 1e-7 * p * d


def curved_cost(p, d, k):
    """Monotone but not multilinear: interpolation is only exact on the grid."""
    return 0.004 + 2e-5 * p + 3e-9 * p * p + 1e-4 * d ** 1.5 + 3e-7 * k


def table_of(f):
    return ProfileTable(P_AXIS, D_AXIS, K_AXIS, [[[f(p, d, k) for k in K_AXIS] for d in D_AXIS] for p in P_AXIS],
                        model="test", device="cpu", source="synthetic")


def test_profile_exact_on_every_grid_point():
    table = table_of(curved_cost)
    for p in P_AXIS:
        for d in D_AXIS:
            for k in K_AXIS:
                assert table.predict(p, d, k) == curved_cost(p, d, k)


def test_profile_reproduces_multilinear_cost_between_and_past_grid_points():
    table = table_of(bilinear_cost)
    rng = random.Random(0)
    for _ in range(200):
        p, d, k = rng.uniform(0, 3000), rng.uniform(0, 100), rng.uniform(0, 30000)
        assert table.predict(p, d, k) == pytest.approx(bilinear_cost(p, d, k), rel=1e-12)


def test_profile_monotone_between_grid_points():
    table = table_of(curved_cost)
    rng = random.Random(1)
    for _ in range(50):
        # a random monotone path through the grid and past its end, 200 steps long
        point = [rng.uniform(0, 100), rng.uniform(0, 5), rng.uniform(0, 500)]
        step = [rng.uniform(0, 10), rng.uniform(0, 0.3), rng.uniform(0, 100)]
        last = table.predict(*point)
        for _ in range(200):
            point = [x + s for x, s in zip(point, step)]
            now = table.predict(*point)
            assert now >= last - 1e-15
            last = now
    # strictly between two grid points the value lies between theirs
    lo, hi = curved_cost(256, 8, 1000), curved_cost(1024, 8, 1000)
    assert lo < table.predict(640, 8, 1000) < hi


def test_profile_round_trips_through_json(tmp_path):
    table = table_of(curved_cost)
    path = tmp_path / "p.json"
    table.save(path)
    data = json.loads(path.read_text())
    assert data["version"] == 1 and data["model"] == "test" and data["device"] == "cpu"
    loaded = ProfileTable.load(path)
    assert loaded.to_dict() == table.to_dict()
    assert loaded.predict(300, 10, 2000) == table.predict(300, 10, 2000)


def test_profile_rejects_bad_files(tmp_path):
    good = table_of(curved_cost).to_dict()
    with pytest.raises(ValueError, match="version 2 is not supported"):
        ProfileTable.from_dict({**good, "version": 2})
    with pytest.raises(ValueError, match="lacks num_kv_tokens"):
        ProfileTable.from_dict({k: v for k, v in good.items() if k != "num_kv_tokens"})
    with pytest.raises(ValueError, match="strictly increasing"):
        ProfileTable.from_dict({**good, "num_decode_seqs": [0, 32, 8]})
    with pytest.raises(ValueError, match="nested as \\[4\\]\\[3\\]\\[3\\]"):
        ProfileTable.from_dict({**good, "time_s": good["time_s"][:3]})
    with pytest.raises(ValueError, match="finite and non-negative"):
        bad = json.loads(json.dumps(good))
        bad["time_s"][0][0][0] = -1.0
        ProfileTable.from_dict(bad)
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ProfileTable.load(path)


def test_shipped_profiles_are_the_roofline_of_llama_3_1_8b():
    for file_name, (gpu, model) in SHIPPED.items():
        shipped = ProfileTable.load(PROFILE_DIR / file_name)
        assert shipped.to_dict() == roofline_profile(gpu, model).to_dict(), \
            f"{file_name} is stale: run python -m scheduler.build_profiles"
        assert shipped.model == "meta-llama/Llama-3.1-8B" and shipped.device == gpu.name
        roofline = RooflineLatencyModel(gpu, model)
        # on grid points the table is the roofline itself
        assert shipped.predict(2048, 64, 65536) == roofline.predict(2048, 64, 65536)
    h100 = ProfileTable.load(PROFILE_DIR / "llama-3.1-8b_h100.json")
    h200 = ProfileTable.load(PROFILE_DIR / "llama-3.1-8b_h200.json")
    # same matrix rate, more bandwidth: never slower, and clearly faster where memory-bound (decode)
    assert h200.predict(0, 64, 131072) < 0.8 * h100.predict(0, 64, 131072)
    assert h200.predict(8192, 0, 8192) <= h100.predict(8192, 0, 8192)


# ---- roofline ---------------------------------------------------------------------------------------------------

def test_roofline_hand_computed_decode_step():
    gpu, m = H100_SXM, LLAMA_3_1_8B
    roofline = RooflineLatencyModel(gpu, m)
    bw, fl = gpu.memory_bandwidth * gpu.bandwidth_efficiency, gpu.matmul_flops * gpu.compute_efficiency
    h, i, v, L = 4096, 14336, 128256, 32
    layer_weights = h * (32 + 2 * 8) * 128 + 32 * 128 * h + h * 2 * i + i * h  # QKV, O, gate+up, down
    per_token_layer = 2 * layer_weights / fl + 2 * (h + 48 * 128 + 32 * 128 + h + h + 2 * i + i + h) / bw
    weights_s = (L * layer_weights + h * v) * 2 / bw
    one_decode = (weights_s + L * per_token_layer + 2 * h * v / fl + (h + v) * 2 / bw
                  + 1000 * L * 2 * 8 * 128 * 2 / bw + 1000 * L * 4 * 32 * 128 / fl)
    assert roofline.predict(0, 1, 1000) == pytest.approx(one_decode, rel=1e-12)
    # ~16 GB of bf16 weights at 3 TB/s: a single decode step is ~5 ms
    assert 0.004 < one_decode < 0.007


def test_roofline_grows_with_every_input():
    roofline = RooflineLatencyModel(H200_SXM, LLAMA_3_1_8B)
    base = roofline.predict(512, 32, 50000)
    assert roofline.predict(513, 32, 50000) > base
    assert roofline.predict(512, 33, 50000) > base
    assert roofline.predict(512, 32, 50001) > base


def test_model_shape_from_hf_config_and_errors():
    config = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
              "intermediate_size": 14336, "vocab_size": 128256}
    shape = ModelShape.from_hf_config(config, name="meta-llama/Llama-3.1-8B")
    assert shape == LLAMA_3_1_8B
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        ModelShape("bad", 2, 64, 6, 4, 16, 128, 100)
    with pytest.raises(ValueError, match="hidden_size must be positive"):
        ModelShape("bad", 2, 0, 4, 4, 16, 128, 100)


VIDUR_FILES = {"h100_llama2-7b_mlp_ops.csv": H100_SXM, "a100_llama3-8b_mlp_ops.csv": A100_SXM}
GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
ROOFLINE_FACTOR = 1.3  # measured / predicted must lie in [1/1.3, 1.3]; observed 0.78..1.16 on both files


@pytest.mark.parametrize("file_name", sorted(VIDUR_FILES))
def test_roofline_gemms_match_vidur_measurements(file_name):
    path = SHARED / "profiles" / file_name
    if not path.exists():
        pytest.skip(f"{path} absent: the shared reference profiles sit beside the repository clone")
    with open(path) as f:
        rows = [r for r in csv.DictReader(f) if r["num_tensor_parallel_workers"] == "1"]
    assert rows, f"{file_name} has no single-GPU rows"
    first = rows[0]
    heads, kv_heads, hidden = int(first["n_head"]), int(first["n_kv_head"]), int(first["n_embd"])
    assert first["use_gated_mlp"] == "True"
    shape = ModelShape(file_name, num_layers=32, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
                       head_dim=hidden // heads, intermediate_size=int(first["n_expanded_embd"]),
                       vocab_size=int(first["vocab_size"]))
    roofline = RooflineLatencyModel(VIDUR_FILES[file_name], shape)
    ratios = []
    for r in rows:
        tokens = int(r["num_tokens"])
        measured_s = sum(float(r[f"time_stats.{op}.median"]) for op in GEMM_OPS) * 1e-3 * shape.num_layers
        ratios.append((measured_s / (roofline.layer_gemm_time(tokens) * shape.num_layers), tokens))
    worst_low, worst_high = min(ratios), max(ratios)
    assert len(ratios) > 200 and min(t for _, t in ratios) == 1 and max(t for _, t in ratios) >= 4096
    assert worst_low[0] > 1 / ROOFLINE_FACTOR, f"roofline over-predicts {1 / worst_low[0]:.2f}x at {worst_low[1]}"
    assert worst_high[0] < ROOFLINE_FACTOR, f"roofline under-predicts {worst_high[0]:.2f}x at {worst_high[1]}"


# ---- online least squares ---------------------------------------------------------------------------------------

TRUE = (0.003, 3e-5, 2e-9, 5e-5, 2e-8)  # seconds per (1, P, P^2, D, K)


def true_time(p, d, k, coef=TRUE):
    return coef[0] + coef[1] * p + coef[2] * p * p + coef[3] * d + coef[4] * k


def synthetic_step(rng, coef=TRUE, noise=0.02, prefill=True):
    p = rng.randint(1, 2048) if prefill and rng.random() < 0.5 else 0
    d = rng.randint(0, 256)
    k = d * rng.randint(100, 4000) + p
    return StepStats(start=0.0, duration=true_time(p, d, k, coef) * (1 + rng.gauss(0, noise)), num_prefill_tokens=p,
                     num_decode_seqs=d, num_kv_tokens=k, num_blocks_used=0, num_running=d, num_waiting=0)


def test_online_fit_recovers_known_cost_from_noisy_steps():
    rng = random.Random(42)
    wrong_prior = Linear(0.006, 6e-5, 1e-4, 4e-8)  # twice the truth, and no P^2 term at all
    model = OnlineLatencyModel(wrong_prior, max_prefill_tokens=2048, max_decode_seqs=256, max_kv_tokens=1 << 20,
                               forgetting=1.0)  # stationary: every step counts the same
    for _ in range(3000):
        model.observe(synthetic_step(rng))
    assert min(model.coefficients()) >= 0
    # the prior is a combination of the other features, so the coefficients are not unique: the predictions are
    for _ in range(200):
        p, d = rng.choice((0, rng.randint(1, 2048))), rng.randint(0, 256)
        k = d * rng.randint(100, 4000) + p
        assert model.predict(p, d, k) == pytest.approx(true_time(p, d, k), rel=0.02), (p, d, k)


def test_online_fit_recovers_known_coefficients_when_the_prior_adds_nothing():
    rng = random.Random(5)
    prior = ProfileTable([0, 4096], [0, 512], [0, 1 << 21], [[[0.01, 0.01], [0.01, 0.01]]] * 2)  # a constant
    model = OnlineLatencyModel(prior, forgetting=1.0)
    for _ in range(3000):
        model.observe(synthetic_step(rng))
    fitted = model.coefficients()
    names = ("1", "P", "P^2", "D", "log(1+D)", "K", "prior")
    # b0 and the constant prior share one direction: their sum is the fixed cost. P^2 adds at most 8 ms to a
    # 2048-token chunk next to 61 ms of P: the hardest to pin down.
    fitted = (fitted[0] + 0.01 * fitted[6], *fitted[1:6])
    for name, got, want, tolerance in zip(names[:4] + names[5:6], fitted[:4] + fitted[5:], TRUE,
                                          (0.05, 0.05, 0.15, 0.05, 0.05)):
        assert got == pytest.approx(want, rel=tolerance), f"{name}: {got} vs {want}"
    assert fitted[4] * math.log1p(256) < 2e-4  # a term the truth lacks stays under 0.2 ms across the whole range


def test_online_fit_learns_concave_decode_cost():
    """CPU decode: the first sequences cost far more than later ones; a straight line in D misses both ends."""
    def cpu_time(d, k):
        return 0.03 + 0.012 * math.log1p(d) + 0.0015 * d + 2e-6 * k

    rng = random.Random(11)
    model = OnlineLatencyModel(Linear(0.02, 1e-4, 4e-3, 1e-6), max_prefill_tokens=512, max_decode_seqs=32,
                               max_kv_tokens=32768)
    for _ in range(500):
        d = rng.randint(1, 32)
        k = d * rng.randint(50, 400)
        model.observe(StepStats(0.0, cpu_time(d, k) * (1 + rng.gauss(0, 0.03)), 0, d, k, 0, d, 0))
    for d in (1, 2, 4, 8, 16, 32):
        assert model.predict(0, d, 220 * d) == pytest.approx(cpu_time(d, 220 * d), rel=0.02), d


def test_online_fit_corrects_a_profile_instead_of_replacing_it():
    """A measured profile with the right shape and the wrong scale (the machine is slower today): the fit keeps the
    shape, which no combination of its straight-line terms could follow, and learns the scale."""
    table = table_of(curved_cost)
    model = OnlineLatencyModel(table, max_prefill_tokens=1024, max_decode_seqs=32, max_kv_tokens=10000)
    rng = random.Random(2)
    for _ in range(300):
        p, d, k = rng.choice((0, rng.randint(1, 1024))), rng.randint(1, 32), rng.randint(100, 10000)
        model.observe(StepStats(0.0, 1.3 * table.predict(p, d, k) * (1 + rng.gauss(0, 0.03)), p, d, k, 0, d, 0))
    assert model.coefficients()[6] == pytest.approx(1.3, rel=0.05)
    for p, d, k in ((0, 1, 500), (0, 32, 9000), (1024, 8, 5000), (300, 3, 2000)):
        assert model.predict(p, d, k) == pytest.approx(1.3 * table.predict(p, d, k), rel=0.02), (p, d, k)


def test_online_fit_follows_drift():
    rng = random.Random(7)
    model = OnlineLatencyModel(Linear(0.01, 1e-5, 1e-4, 1e-8), forgetting=0.995)
    for _ in range(1000):
        model.observe(synthetic_step(rng))
    slower = tuple(2 * c for c in TRUE)  # e.g. the GPU clocks down
    for _ in range(1500):
        model.observe(synthetic_step(rng, slower))
    assert model.predict(1024, 128, 300_000) == pytest.approx(true_time(1024, 128, 300_000, slower), rel=0.01)


def test_online_fit_keeps_forgetting_past_the_rescaling_of_its_sums():
    """Forgetting shrinks a scale instead of every sum; after ~2,200 steps at 0.9 the scale is renormalised into the
    sums, and the fit must carry on as if nothing happened: the same as a fit that saw only the recent steps (the
    older ones weigh 0.9^300 ~ 1e-14 of them)."""
    rng = random.Random(3)
    steps = [synthetic_step(rng) for _ in range(2000)] + \
        [synthetic_step(rng, tuple(3 * c for c in TRUE)) for _ in range(1000)]
    prior = Linear(0.01, 1e-5, 1e-4, 1e-8)
    everything, recent = OnlineLatencyModel(prior, forgetting=0.9), OnlineLatencyModel(prior, forgetting=0.9)
    for stats in steps:
        everything.observe(stats)
    for stats in steps[-300:]:
        recent.observe(stats)
    for shape in ((1024, 128, 300_000), (0, 16, 20_000), (512, 0, 512)):
        assert everything.predict(*shape) == pytest.approx(recent.predict(*shape), rel=1e-6)


def test_online_fit_falls_back_on_prior_where_data_say_nothing():
    rng = random.Random(3)
    prior = Linear(0.003, 4e-5, 1e-4, 1e-8)  # decode twice the truth, KV half of it
    model = OnlineLatencyModel(prior, prior_weight=2.0)
    for _ in range(2000):  # decodes only: the data say nothing about prefill cost
        model.observe(synthetic_step(rng, prefill=False))
    assert min(model.coefficients()) >= 0
    for d, k in ((1, 500), (64, 100_000), (256, 800_000)):
        assert model.predict(0, d, k) == pytest.approx(true_time(0, d, k), rel=0.02), (d, k)
    # the prefill cost comes from the prior (4e-5 per token), not from nothing
    assert model.predict(2048, 0, 2048) - model.predict(0, 0, 0) == pytest.approx(2048 * 4e-5, rel=0.05)


def test_online_fit_before_any_step_is_the_prior():
    for prior in (Linear(0.003, 4e-5, 5e-5, 2e-8), table_of(curved_cost)):
        model = OnlineLatencyModel(prior, max_prefill_tokens=1024, max_decode_seqs=32, max_kv_tokens=10000)
        assert model.num_observations == 0
        for p, d, k in ((500, 20, 4000), (0, 1, 300), (1024, 32, 10000), (100, 5, 7000)):
            assert model.predict(p, d, k) == pytest.approx(prior.predict(p, d, k), rel=1e-4)


def test_online_fit_rejects_bad_settings():
    with pytest.raises(ValueError, match="forgetting"):
        OnlineLatencyModel(Linear(0, 0, 0, 0), forgetting=0)
    with pytest.raises(ValueError, match="prior_weight"):
        OnlineLatencyModel(Linear(0, 0, 0, 0), prior_weight=0)
    with pytest.raises(ValueError, match="duration"):
        OnlineLatencyModel(Linear(0.01, 0, 0, 0)).observe(StepStats(0.0, -1.0, 0, 1, 1, 1, 1, 0))


# ---- dynamic chunk search ---------------------------------------------------------------------------------------

def test_largest_chunk_for_given_budgets():
    # 4 decodes, 4000 KV tokens: 10 ms + 0.4 ms + 0.4 ms = 10.8 ms before any prefill; a prefill token costs
    # 10 us of GEMM plus 0.1 us of attention
    model = Linear(0.010, 1e-5, 1e-4, 1e-7)
    assert largest_chunk(model, 0.020, 4, 4000, cap=4096) == 910  # (20 - 10.8) / 0.0101 = 910.9
    assert largest_chunk(model, 0.025, 4, 4000, cap=4096) == 1405  # 14.2 / 0.0101 = 1405.9
    assert largest_chunk(model, 0.025, 4, 4000, cap=1000) == 1000  # capped
    assert largest_chunk(model, 0.0108555, 4, 4000, cap=4096) == 5  # 0.0555 / 0.0101 = 5.5
    assert largest_chunk(model, 0.0108, 4, 4000, cap=4096) == 0  # decodes alone fill the budget
    # 300 prefill tokens already in the batch: 3.03 ms less for this chunk
    assert largest_chunk(model, 0.020, 4, 4300, cap=4096, num_prefill_tokens=300) == 610


def nearly_dependent_problem(rng, n=7):
    """Normal equations (with the fit's ridge) of a random least-squares problem whose columns are sometimes equal
    to nine digits: the ill-conditioned kind a fit meets when two features move together."""
    rows = []
    for _ in range(rng.randint(2, 30)):
        row = [rng.gauss(0, 1) * 10 ** rng.uniform(-3, 0) for _ in range(n)]
        if rng.random() < 0.5:
            row[rng.randrange(n)] = row[rng.randrange(n)] * (1 + 1e-9 * rng.gauss(0, 1))
        rows.append(row)
    y = [rng.gauss(0, 1) for _ in rows]
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    b = [sum(r[i] * t for r, t in zip(rows, y)) for i in range(n)]
    ridge = RIDGE * sum(a[i][i] for i in range(n))
    for i in range(n):
        a[i][i] += ridge
    return a, b


@pytest.mark.timeout(60)
def test_nonnegative_least_squares_ends_and_is_optimal_on_ill_conditioned_problems():
    """Among these problems are some where a step's rounding left a coordinate at a denormal, and the active-set
    loop then stepped by 0 forever (it stalled an engine's first generate). Each must end, at the optimum that
    trying every set of positive coordinates finds."""
    def objective(a, b, x):
        n = len(b)
        return sum(x[i] * a[i][j] * x[j] for i in range(n) for j in range(n)) - 2 * sum(map(float.__mul__, b, x))

    rng = random.Random(1)
    for trial in range(4000):
        a, b = nearly_dependent_problem(rng)
        x, positive = _nonnegative_least_squares(a, b)
        assert min(x) >= 0 and all(x[i] > 0 for i in positive), trial
        if trial % 20 == 0:  # trial 600 is one that never ended
            best = 0.0
            for size in range(1, len(b) + 1):
                for coords in map(list, combinations(range(len(b)), size)):
                    z = _solve_on(a, b, coords)
                    if min(z) >= 0:
                        best = min(best, objective(a, b, _spread(coords, z, len(b))))
            assert objective(a, b, x) <= best + 1e-9 * abs(best), trial
