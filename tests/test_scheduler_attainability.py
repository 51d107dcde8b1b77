"""The attainability test: each rejection reason and acceptance, on hand-computed figures."""
import random

import pytest

from scheduler import (SLO, AttainabilityChecker, InstanceState, OutputLengthTracker, Rejection,
                       RequestSnapshot)
from scheduler.attainability import _peak_kv


class Linear:
    def __init__(self, base, per_prefill, per_decode, per_kv):
        self.c = (base, per_prefill, per_decode, per_kv)

    def predict(self, p, d, k):
        return self.c[0] + self.c[1] * p + self.c[2] * d + self.c[3] * k


# 5 ms per step, 10 us per prefill token, 0.1 ms per decode, 0.1 us per KV token
MODEL = Linear(0.005, 1e-5, 1e-4, 1e-7)
SLO_50 = SLO(ttft_ms=500, tpot_ms=50)
NOW = 10.0


def checker(model=MODEL, mean=100):
    return AttainabilityChecker(model, OutputLengthTracker(default_mean=mean), max_prefill_chunk=8192)


def decoding_resident(prompt=1000, out=10, max_tokens=1000, slo=SLO_50):
    return RequestSnapshot(arrival=9.0, num_prompt_tokens=prompt, max_tokens=max_tokens, slo=slo, tier="t",
                           num_computed_tokens=prompt + out - 1, num_output_tokens=out)


def candidate(arrival=NOW, prompt=2000, slo=SLO_50):
    return RequestSnapshot(arrival=arrival, num_prompt_tokens=prompt, max_tokens=1000, slo=slo, tier="t")


def instance(residents, kv_capacity=100_000, tpot_ms=50):
    return InstanceState(residents=tuple(residents), kv_capacity_tokens=kv_capacity, iteration_end=NOW,
                         tpot_ms=tpot_ms)


BASE = [decoding_resident(), decoding_resident()]  # two decodes of 1010 tokens, 90 expected tokens left each


def test_accepts_when_everything_fits_with_predicted_figures():
    result = checker().check(instance(BASE), candidate(), NOW)
    assert result.ok and result.reason is None
    # chunk: 5 + 0.2 + 0.202 ms for the decodes, 10.1 us per prefill token, budget 50 ms: 4415.6 -> 4415
    assert result.prefill_chunk == 4415 and result.prefill_iterations == 1
    # the whole 2000-token prompt in one iteration: 5 + 20 + 0.2 + 0.402 ms
    assert result.first_token_time == pytest.approx(NOW + 0.025602)
    # then a decode of 3 over 2020 + 2 + 2000 KV tokens: 5 + 0.3 + 0.4022 ms
    assert result.second_token_time == pytest.approx(NOW + 0.025602 + 0.0057022)
    # peak: at t = 89 all three are in, r shifted to 1999 + t: 2 * 1010 + 1999 + 3 * 89 = 4286
    assert (result.peak_kv_tokens, result.peak_batch_size) == (4286, 3)
    assert result.steady_iteration_s == pytest.approx(0.005 + 0.0003 + 0.0004286)
    # worst iteration: both residents decoding over 2022 KV tokens: same chunk, same end
    assert result.worst_prefill_chunk == 4415
    assert result.worst_prefill_end == pytest.approx(NOW + 0.0256022)


def test_rejects_ttft_when_queueing_already_ate_the_budget():
    result = checker().check(instance(BASE), candidate(arrival=NOW - 0.5), NOW)  # first token due at NOW
    assert not result.ok and result.reason is Rejection.TTFT
    assert result.first_token_time == pytest.approx(NOW + 0.025602)


def test_rejects_ttft_when_no_prefill_chunk_fits_the_budget():
    tight = SLO(ttft_ms=500, tpot_ms=5)  # the two decodes alone take 5.402 ms
    result = checker().check(instance(BASE), candidate(slo=tight), NOW)
    assert result.reason is Rejection.TTFT and result.prefill_chunk == 0
    assert result.first_token_time == float("inf")


def test_prefills_queued_ahead_delay_the_first_token():
    ahead = RequestSnapshot(arrival=9.9, num_prompt_tokens=3000, max_tokens=1000, slo=SLO_50, tier="t")  # due 10.4
    behind = RequestSnapshot(arrival=10.0, num_prompt_tokens=3000, max_tokens=1000, slo=SLO(1000, 50), tier="t")
    result = checker().check(instance(BASE + [ahead, behind]), candidate(), NOW)
    # 3000 + 2000 tokens at 4415 per iteration: 2 iterations of 5 + 44.15 + 0.2 + 0.6435 ms
    assert result.prefill_iterations == 2
    assert result.first_token_time == pytest.approx(NOW + 2 * 0.0499935)
    # second token: decodes + the one ahead + r = 4 sequences over 2020 + 4 + 3000 + 2000 KV tokens
    assert result.second_token_time == pytest.approx(NOW + 2 * 0.0499935 + 0.005 + 0.0004 + 0.0007024)
    assert result.ok


# A slow decode (20 ms step + 1 ms per sequence) on an idle instance held to 10 ms
SLOW_DECODE = Linear(0.020, 1e-5, 1e-3, 0.0)
IDLE_TPOT10 = InstanceState(residents=(), kv_capacity_tokens=100_000, iteration_end=NOW, tpot_ms=10)


def test_rejects_second_token():
    # first token after 20 + 10 = 30 ms (due 35 ms); the next decode takes 21 ms: 51 ms > 35 + 10
    r = candidate(prompt=1000, slo=SLO(ttft_ms=35, tpot_ms=10))
    result = checker(SLOW_DECODE).check(IDLE_TPOT10, r, NOW)
    assert result.reason is Rejection.SECOND_TOKEN
    assert result.first_token_time == pytest.approx(NOW + 0.030)
    assert result.second_token_time == pytest.approx(NOW + 0.051)


def test_rejects_tpot_when_steady_state_is_too_slow():
    # second token at 51 ms is within 100 + 10 ms, but every decode step predicts 21 ms > 10 ms
    r = candidate(prompt=1000, slo=SLO(ttft_ms=100, tpot_ms=10))
    result = checker(SLOW_DECODE).check(IDLE_TPOT10, r, NOW)
    assert result.reason is Rejection.TPOT and result.steady_iteration_s == pytest.approx(0.021)


def test_rejects_kv_capacity_at_the_peak():
    assert checker().check(instance(BASE, kv_capacity=4286), candidate(), NOW).ok
    result = checker().check(instance(BASE, kv_capacity=4285), candidate(), NOW)
    assert result.reason is Rejection.KV_CAPACITY and result.peak_kv_tokens == 4286


def test_rejects_prefill_continuity():
    # a 30000-token prompt queued behind r (due later) does not delay r's prefill, but once it decodes its KV
    # slows every iteration that r's prefill chunks share
    behind = RequestSnapshot(arrival=NOW, num_prompt_tokens=30000, max_tokens=1000, slo=SLO(1000, 50), tier="t")
    r = candidate(slo=SLO(ttft_ms=27, tpot_ms=50))
    result = checker().check(instance(BASE + [behind]), r, NOW)
    assert result.first_token_time == pytest.approx(NOW + 0.025602)  # 25.6 ms: in time as things stand
    # peak at t = 89 with all four in: 2020 + 30000 + 1999 + 4 * 89 = 34375
    assert (result.peak_kv_tokens, result.peak_batch_size) == (34375, 4)
    # worst: 3 decodes over 32023 KV tokens: 8.5023 ms before any prefill: chunk 4108, 28.70 ms > 27 ms
    assert result.worst_prefill_chunk == 4108
    assert result.worst_prefill_end == pytest.approx(NOW + 0.005 + 0.02 + 0.0003 + 0.0034023)
    assert result.reason is Rejection.PREFILL_CONTINUITY
    assert checker().check(instance(BASE + [behind]), candidate(slo=SLO(ttft_ms=29, tpot_ms=50)), NOW).ok


def test_residents_are_charged_their_remaining_expected_output():
    near_done = decoding_resident(prompt=100, out=95)  # mean 100: 5 tokens left, 195 tokens now
    capped = decoding_resident(prompt=100, out=10, max_tokens=20)  # its cap leaves 10 tokens, 110 now
    past_mean = decoding_resident(prompt=100, out=150)  # past the mean: charged one more token
    r = candidate(prompt=50)  # one prefill iteration: it holds 49 + t tokens for 101 iterations
    result = checker().check(instance([near_done, capped, past_mean]), r, NOW)
    # t = 0: 604 with all four; t = 4 (past_mean gone): 49 + 110 + 195 + 3 * 4 = 366; t = 9: 177; t = 100: 149
    assert (result.peak_kv_tokens, result.peak_batch_size) == (604, 4)
    result = checker().check(instance([near_done, capped]), r, NOW)
    assert (result.peak_kv_tokens, result.peak_batch_size) == (366, 3)


def test_peak_kv_matches_token_by_token_simulation():
    rng = random.Random(5)
    for _ in range(200):
        n = rng.randint(1, 12)
        lengths = [rng.randint(0, 500) for _ in range(n)]
        remaining = [rng.randint(1, 60) for _ in range(n)]
        best = (0, 0)
        for t in range(max(remaining)):
            alive = [i for i in range(n) if t < remaining[i]]
            kv = sum(lengths[i] + t for i in alive)
            if kv > best[0]:
                best = (kv, len(alive))
        assert _peak_kv(lengths, remaining)[0] == best[0]


def test_idle_test_refuses_impossible_slos():
    check = checker()
    # on an empty instance one decode step is 5 + 0.1 + 0.02 ms: a 4 ms TPOT can never be met
    impossible = RequestSnapshot(arrival=NOW, num_prompt_tokens=100, max_tokens=1000, slo=SLO(1000, 4))
    assert check.check_idle(impossible, kv_capacity_tokens=100_000).reason is Rejection.TPOT
    fine = RequestSnapshot(arrival=NOW, num_prompt_tokens=100, max_tokens=1000, slo=SLO(1000, 10))
    assert check.check_idle(fine, kv_capacity_tokens=100_000).ok
    too_long = RequestSnapshot(arrival=NOW, num_prompt_tokens=100_000, max_tokens=1000, slo=SLO(100_000, 50))
    assert check.check_idle(too_long, kv_capacity_tokens=65_536).reason is Rejection.KV_CAPACITY


def test_output_length_tracker_running_mean_then_follows_shifts():
    tracker = OutputLengthTracker(default_mean=200, horizon=4)
    assert tracker.mean("gold") == 200 and tracker.count("gold") == 0
    for n in (10, 20, 30):
        tracker.observe("gold", n)
    assert tracker.mean("gold") == 20 and tracker.count("gold") == 3
    tracker.observe("gold", 40)
    assert tracker.mean("gold") == 25  # exact mean of the first 4
    tracker.observe("gold", 125)
    assert tracker.mean("gold") == 50  # past the horizon: 25 + (125 - 25) / 4
    assert tracker.mean("silver") == 200  # per tier
    with pytest.raises(ValueError, match="non-negative"):
        tracker.observe("gold", -1)


def test_snapshot_and_state_validate():
    with pytest.raises(ValueError, match="num_computed_tokens"):
        RequestSnapshot(arrival=0, num_prompt_tokens=10, max_tokens=5, slo=SLO_50, num_computed_tokens=11)
    with pytest.raises(ValueError, match="prompt"):
        RequestSnapshot(arrival=0, num_prompt_tokens=0, max_tokens=5, slo=SLO_50)
    with pytest.raises(ValueError, match="kv_capacity_tokens"):
        InstanceState(residents=(), kv_capacity_tokens=0, iteration_end=0, tpot_ms=50)
    with pytest.raises(ValueError, match="max_prefill_chunk"):
        AttainabilityChecker(MODEL, OutputLengthTracker(100), max_prefill_chunk=0)
