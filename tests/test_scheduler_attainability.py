"""The attainability test: each rejection reason and acceptance, on hand-computed figures; and the summary-based
test against the straightforward one-pass-over-the-residents computation it replaced (`reference_check`), on
many random instances, summaries kept current by add/remove/rebuild included."""
import math
import random

import pytest

from scheduler import (SLO, AttainabilityChecker, InstanceState, OutputLengthTracker, Rejection,
                       RequestSnapshot)
from scheduler.attainability import Attainability
from scheduler.chunking import largest_chunk
from scheduler.instance_state import ResidentSummary
from scheduler.slo import deadline_terms
from scheduler.roofline import H200_SXM, LLAMA_3_1_8B, RooflineLatencyModel


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


def test_rejects_pushing_a_queued_prefill_past_its_deadline():
    """r's first token is due before a queued prompt's, so r goes first: it is refused where that makes the queued one
    late (a request promoted onto an instance of a tighter tier is otherwise pushed back by every tighter request)."""
    tight = SLO(ttft_ms=200, tpot_ms=50)
    for due_ms, ok in ((380, False), (410, True)):
        queued = RequestSnapshot(arrival=NOW, num_prompt_tokens=30000, max_tokens=1000, slo=SLO(due_ms, 50), tier="t")
        # 30000 tokens alone take 7 iterations of 4415 (ends at +350 ms); with r's 2000 first, 8 (+400 ms)
        result = checker().check(instance(BASE + [queued]), candidate(slo=tight), NOW)
        assert result.first_token_time == pytest.approx(NOW + 0.0499935 * 2000 / 4415, rel=0.2)
        assert result.ok is ok and result.reason is (None if ok else Rejection.QUEUE_BEHIND)


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


def test_output_length_tracker_publishes_a_mean_only_once_it_drifted_past_the_tolerance():
    tracker = OutputLengthTracker(default_mean=100, horizon=10, tolerance=0.05)
    for _ in range(10):
        tracker.observe("gold", 100)
    assert tracker.mean("gold") == 100
    generation = tracker.generation
    tracker.observe("gold", 140)  # estimate 104: within 5 % of 100, not published
    assert tracker.mean("gold") == 100 and tracker.generation == generation
    tracker.observe("gold", 140)  # estimate 107.6: published
    assert tracker.mean("gold") == pytest.approx(107.6) and tracker.generation == generation + 1
    with pytest.raises(ValueError, match="tolerance"):
        OutputLengthTracker(100, tolerance=-0.1)


def test_snapshot_and_state_validate():
    with pytest.raises(ValueError, match="num_computed_tokens"):
        RequestSnapshot(arrival=0, num_prompt_tokens=10, max_tokens=5, slo=SLO_50, num_computed_tokens=11)
    with pytest.raises(ValueError, match="prompt"):
        RequestSnapshot(arrival=0, num_prompt_tokens=0, max_tokens=5, slo=SLO_50)
    with pytest.raises(ValueError, match="kv_capacity_tokens"):
        InstanceState(residents=(), kv_capacity_tokens=0, iteration_end=0, tpot_ms=50)
    with pytest.raises(ValueError, match="max_prefill_chunk"):
        AttainabilityChecker(MODEL, OutputLengthTracker(100), max_prefill_chunk=0)


def test_summary_peak_equals_the_departure_scan():
    rng = random.Random(11)
    for _ in range(300):
        n = rng.randint(0, 30)
        kv = [rng.randint(1, 400) for _ in range(n)]
        left = [rng.choice((1, 1, rng.randint(1, 8), rng.randint(1, 90))) for _ in range(n)]
        # out 0, max_tokens = the remaining length (under the mean), prompt = the KV: (KV, remaining) as drawn
        residents = [RequestSnapshot(0.0, k, m, SLO_50, "t") for k, m in zip(kv, left)]
        summary = ResidentSummary(residents, OutputLengthTracker(default_mean=1000))
        for _ in range(5):
            r_left, r_kv = rng.randint(1, 100), rng.randint(0, 300)
            assert summary.peak(r_left, r_kv) == _peak_kv(kv + [r_kv], left + [r_left])
    # small figures: many ties between departures, where the batch size at the peak depends on which one wins
    for _ in range(3000):
        n = rng.randint(0, 5)
        kv = [rng.randint(1, 6) for _ in range(n)]
        left = [rng.randint(1, 6) for _ in range(n)]
        summary = ResidentSummary([RequestSnapshot(0.0, k, m, SLO_50, "t") for k, m in zip(kv, left)],
                                  OutputLengthTracker(default_mean=1000))
        r_left, r_kv = rng.randint(1, 8), rng.randint(0, 6)
        assert summary.peak(r_left, r_kv) == _peak_kv(kv + [r_kv], left + [r_left])


# ---- the reference: the test as one pass over the residents, as it was before ResidentSummary -----------------------
def reference_check(checker: AttainabilityChecker, instance: InstanceState, request: RequestSnapshot,
                    now: float) -> Attainability:
    model, cap = checker.model, checker.max_prefill_chunk
    expected: dict[str, int] = {}
    means = checker.output_lengths.mean
    slo = request.slo
    start = now if now > instance.iteration_end else instance.iteration_end
    budget_s = min(instance.tpot_ms, slo.tpot_ms) / 1000.0
    first_deadline = request.arrival + slo.ttft_ms / 1000.0
    num_decoding = kv_decoding = 0
    num_ahead = work_ahead = 0
    behind: list[tuple[float, int]] = []  # queued prefills due after r's first token: (deadline, work)
    kv_lengths: list[int] = []
    remaining: list[int] = []
    for s in instance.residents:
        out = s.num_output_tokens
        tokens = s.num_prompt_tokens + out
        if out and s.num_computed_tokens >= tokens - 1:
            num_decoding += 1
            kv_decoding += tokens
        else:
            s_slo = s.slo
            due = s.arrival + (s_slo.ttft_ms + out * s_slo.tpot_ms) / 1000.0
            if due <= first_deadline:
                num_ahead += 1
                work_ahead += tokens - s.num_computed_tokens
            else:
                behind.append((due, tokens - s.num_computed_tokens))
        tier = s.tier
        e = expected.get(tier)
        if e is None:
            e = expected[tier] = math.ceil(means(tier))
        left = (e if e < s.max_tokens else s.max_tokens) - out
        kv_lengths.append(tokens)
        remaining.append(left if left > 1 else 1)
    num_residents = len(kv_lengths)
    kv_residents = sum(kv_lengths)
    r_tokens = request.num_prompt_tokens + request.num_output_tokens
    work = work_ahead + r_tokens - request.num_computed_tokens
    r_left = max(min(math.ceil(means(request.tier)), request.max_tokens) - request.num_output_tokens, 1)
    chunk = cap if num_decoding == 0 else largest_chunk(model, budget_s, num_decoding, kv_decoding, cap)
    if chunk == 0:
        return Attainability(False, Rejection.TTFT, math.inf, math.inf, 0, 0, math.inf, 0, 0, 0, math.inf)
    iterations = -(-work // chunk)
    piece = chunk if chunk < work else work
    first = start + iterations * model.predict(piece, num_decoding, kv_decoding + piece)
    kv_then = kv_decoding + num_decoding * iterations + work_ahead + r_tokens
    second = first + model.predict(0, num_decoding + num_ahead + 1, kv_then)
    kv_lengths.append(max(r_tokens - iterations, 0))
    remaining.append(iterations + r_left)
    peak_kv, peak_batch = _peak_kv(kv_lengths, remaining)
    steady_s = model.predict(0, peak_batch, peak_kv)
    kv_worst = kv_residents + num_residents * iterations + max(r_tokens - chunk, 0)
    worst_chunk = cap if num_residents == 0 else largest_chunk(model, budget_s, num_residents, kv_worst, cap)
    if worst_chunk == 0:
        worst_end = math.inf
    else:
        worst_piece = worst_chunk if worst_chunk < work else work
        worst_end = start + -(-work // worst_chunk) * model.predict(worst_piece, num_residents,
                                                                    kv_worst + worst_piece)
    if first > first_deadline:
        reason = Rejection.TTFT
    elif second > first_deadline + slo.tpot_ms / 1000.0:
        reason = Rejection.SECOND_TOKEN
    elif steady_s > budget_s:
        reason = Rejection.TPOT
    elif peak_kv > instance.kv_capacity_tokens:
        reason = Rejection.KV_CAPACITY
    elif worst_end > first_deadline:
        reason = Rejection.PREFILL_CONTINUITY
    elif any(start + -(-(work + w) // chunk) * model.predict(chunk, num_decoding, kv_decoding + chunk) > due
             for due, w in _running_sums(sorted(behind))):
        reason = Rejection.QUEUE_BEHIND
    else:
        reason = None
    return Attainability(reason is None, reason, first, second, chunk, iterations, steady_s, peak_kv, peak_batch,
                         worst_chunk, worst_end)


def _running_sums(behind: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """(deadline, work of it and of those before it) along a queue in deadline order."""
    out, total = [], 0
    for due, w in behind:
        total += w
        out.append((due, total))
    return out


def _peak_kv(kv_lengths: list[int], remaining: list[int]) -> tuple[int, int]:
    """Largest KV a batch reaches, and its batch size then, when request i holds kv_lengths[i] + t tokens at
    iteration t < remaining[i] and is gone after: the KV grows between departures, so the peak is at the last
    iteration before one (t = remaining[i] - 1)."""
    order = sorted(range(len(remaining)), key=remaining.__getitem__)
    peak = batch = 0
    kv_alive = num_alive = 0
    last = None
    # latest departure first: the alive set then only gains members
    for i in reversed(order):
        r = remaining[i]
        if r != last and num_alive:
            kv = kv_alive + (last - 1) * num_alive
            if kv > peak:
                peak, batch = kv, num_alive
        kv_alive += kv_lengths[i]
        num_alive += 1
        last = r
    kv = kv_alive + (last - 1) * num_alive
    if kv > peak:
        peak, batch = kv, num_alive
    return peak, batch


# ---- random instances: the summary-based test against the reference ------------------------------------------------
class Resident:
    """A mutable resident, as the router keeps them (progress changes in place)."""
    __slots__ = ("arrival", "num_prompt_tokens", "max_tokens", "slo", "tier", "num_computed_tokens",
                 "num_output_tokens", "first_token_due", "tpot_s")

    def __init__(self, arrival, prompt, max_tokens, slo, tier, computed, out):
        self.arrival, self.num_prompt_tokens, self.max_tokens = arrival, prompt, max_tokens
        self.slo, self.tier = slo, tier
        self.first_token_due, self.tpot_s = deadline_terms(arrival, slo)
        self.num_computed_tokens, self.num_output_tokens = computed, out


TIER_NAMES = ("gold", "silver", "bronze")
SLOS = [SLO(ttft_ms=t, tpot_ms=p) for t in (30, 200, 1000, 4000) for p in (8, 20, 50, 150)]


def random_resident(rng: random.Random, now: float) -> Resident:
    prompt = rng.choice((rng.randint(1, 64), rng.randint(1, 4000)))
    max_tokens = rng.choice((rng.randint(1, 30), rng.randint(1, 700)))
    # a few shared arrival times: equal next-token deadlines among the queued ones
    arrival = rng.choice((now - 0.25, now - 1.0, now - rng.uniform(0, 3)))
    kind = rng.random()
    if kind < 0.55:  # decoding (some past their tier's mean, some at their cap)
        out = rng.randint(1, max_tokens)
        computed = prompt + out - rng.choice((1, 1, 0))
    elif kind < 0.85:  # queued or mid-prefill
        out, computed = 0, rng.choice((0, 0, rng.randint(0, prompt)))
    else:  # preempted after some output: recomputing its context
        out = rng.randint(1, max_tokens)
        computed = rng.randint(0, prompt + out - 2) if prompt + out >= 2 else 0
    return Resident(arrival, prompt, max_tokens, rng.choice(SLOS), rng.choice(TIER_NAMES), computed, out)


def random_candidate(rng: random.Random, now: float) -> RequestSnapshot:
    prompt = rng.choice((rng.randint(1, 100), rng.randint(1, 6000)))
    out = 0 if rng.random() < 0.85 else rng.randint(1, 50)
    computed = 0 if rng.random() < 0.8 else rng.randint(0, prompt + out)
    return RequestSnapshot(arrival=now - rng.choice((0.0, 0.0, rng.uniform(0, 2))), num_prompt_tokens=prompt,
                           max_tokens=rng.randint(1, 800), slo=rng.choice(SLOS), tier=rng.choice(TIER_NAMES),
                           num_computed_tokens=computed, num_output_tokens=out)


class OddBatchesSlow(Linear):
    """Not monotone: a decode-only iteration of an odd number of sequences pays 30 ms more (the test must agree
    with the reference for any model, and this one lets each condition decide alone)."""

    def predict(self, p, d, k):
        return super().predict(p, d, k) + (0.03 if p == 0 and d % 2 else 0.0)


def random_checker(rng: random.Random, monotone: bool = False) -> AttainabilityChecker:
    """A checker on a random model; `monotone`: one that never shrinks as an input grows, as `fits` requires of a
    model to give `check`'s verdict on upper bounds of the peak."""
    linear = Linear(rng.choice((0.0, 0.004, 0.02)), rng.choice((0.0, 1e-5, 4e-5)), rng.choice((0.0, 2e-4, 1e-3)),
                    rng.choice((0.0, 1e-7, 1e-6)))
    models = [RooflineLatencyModel(H200_SXM, LLAMA_3_1_8B), linear]
    if not monotone:
        models.append(OddBatchesSlow(0.004, 1e-5, 2e-4, 1e-7))
    model = rng.choice(models)
    lengths = OutputLengthTracker(default_mean=rng.uniform(1, 300))
    for _ in range(rng.randint(0, 6)):
        lengths.observe(rng.choice(TIER_NAMES), rng.randint(0, 500))
    return AttainabilityChecker(model, lengths, max_prefill_chunk=rng.choice((16, 512, 2048, 8192)))


def fits(checker, state, request, now, summary=None):
    """`checker.fits` on `state` given by its parts, its residents described by `summary` (counted afresh by
    default)."""
    if summary is None:
        summary = ResidentSummary(state.residents, checker.output_lengths)
    return checker.fits(summary, state.kv_capacity_tokens, state.iteration_end, state.tpot_ms, request, now)


def assert_same_verdicts(checker, state, candidates, now, reasons, summary=None):
    """`check`, `fits` and `first_token_time` agree with the reference (`fits` and `first_token_time` reading
    `summary` when given: one read before, or one its owner kept)."""
    for request in candidates:
        expected = reference_check(checker, state, request, now)
        assert checker.check(state, request, now) == expected
        assert fits(checker, state, request, now, summary) is expected.ok
        read = summary or ResidentSummary(state.residents, checker.output_lengths)
        assert checker.first_token_time(read, state.iteration_end, state.tpot_ms, request, now) \
            == expected.first_token_time
        reasons[expected.reason] += 1


def assert_same_verdicts_at_the_bounds(checker, state, request, now, reasons, summary):
    """The same instance moved to each bound of the test: KV pool at the peak and one token under; the iteration
    in flight ending so that the first token, the second, or the worst prefill end lands 0.5 ms either side of its
    deadline."""
    expected = reference_check(checker, state, request, now)
    variants = [(max(expected.peak_kv_tokens + d, 1), state.iteration_end) for d in (0, -1)]
    start = max(now, state.iteration_end)
    deadline = request.arrival + request.slo.ttft_ms / 1000.0
    for time, bound in ((expected.first_token_time, deadline),
                        (expected.second_token_time, deadline + request.slo.tpot_ms / 1000.0),
                        (expected.worst_prefill_end, deadline)):
        for margin in (-0.0005, 0.0005):
            end = start + (bound - time) + margin
            if math.isfinite(end) and end >= now:
                variants.append((state.kv_capacity_tokens, end))
    for capacity, end in variants:
        moved = InstanceState(state.residents, capacity, end, state.tpot_ms)
        assert_same_verdicts(checker, moved, [request], now, reasons, summary)


def test_summary_based_test_equals_the_reference_on_random_instances():
    rng = random.Random(2024)
    reasons = {reason: 0 for reason in (None, *Rejection)}
    for _ in range(1000):
        checker = random_checker(rng)
        now = 100.0
        residents = tuple(random_resident(rng, now) for _ in range(rng.choice((0, 1, rng.randint(2, 12),
                                                                                rng.randint(2, 120)))))
        kv = sum(r.num_prompt_tokens + r.num_output_tokens for r in residents)
        state = InstanceState(residents, max(1, int(kv * rng.uniform(0.8, 2.5)) + rng.randint(0, 6000)),
                              now + rng.choice((-0.01, 0.0, 0.02)), rng.choice((8, 20, 50, 150)))
        # several candidates on one summary: its index and chunks are reused
        summary = ResidentSummary(residents, checker.output_lengths)
        candidates = [random_candidate(rng, now) for _ in range(6)]
        assert_same_verdicts(checker, state, candidates, now, reasons, summary)
        for request in candidates[:3]:
            assert_same_verdicts_at_the_bounds(checker, state, request, now, reasons, summary)
    assert all(reasons.values()), reasons  # every verdict was exercised


def test_summary_kept_current_by_its_owner_equals_the_reference():
    rng = random.Random(7)
    reasons = {reason: 0 for reason in (None, *Rejection)}
    for _ in range(12):
        checker = random_checker(rng, monotone=True)  # `fits` reads the owner's summary: peak bounds after changes
        lengths = checker.output_lengths
        live: dict[int, Resident] = {}
        summary = ResidentSummary(live.values(), lengths)
        serial = 0
        now = 100.0
        for _ in range(150):
            op = rng.random()
            if op < 0.4 or not live:  # a placement: a fresh request, as the router adds them
                r = random_resident(rng, now)
                if rng.random() < 0.8:
                    r.num_output_tokens = r.num_computed_tokens = 0
                live[serial] = r
                serial += 1
                summary.add(r)
            elif op < 0.65:  # a request leaves
                key = rng.choice(list(live))
                summary.remove(live.pop(key))
            elif op < 0.75:  # a step report: progress of some residents
                for r in rng.sample(list(live.values()), k=min(len(live), 3)):
                    r.num_output_tokens += 1
                    r.num_computed_tokens = r.num_prompt_tokens + r.num_output_tokens - 1
                summary.rebuild()
            elif op < 0.85:  # a finish moves a tier's mean: remaining lengths move with it
                lengths.observe(rng.choice(TIER_NAMES), rng.randint(0, 600))
            now += rng.uniform(0, 0.05)
            kv = sum(r.num_prompt_tokens + r.num_output_tokens for r in live.values())
            state = InstanceState(tuple(live.values()), max(1, int(kv * rng.uniform(0.9, 1.6)) + 2000), now,
                                  rng.choice((20, 50, 150)))
            assert_same_verdicts(checker, state, [random_candidate(rng, now) for _ in range(3)], now, reasons,
                                 summary)
        assert summary.num_residents == len(live)
    assert all(reasons.values()), reasons


def test_one_summary_serves_every_model_and_chunk_cap():
    """The decodes' chunk is kept per budget, latency model and chunk cap: checkers on other models and caps (one
    tracker) read one summary as the reference would."""
    lengths = OutputLengthTracker(100)
    state = instance(BASE)
    summary = ResidentSummary(state.residents, lengths)
    assert (summary.num_residents, summary.num_decoding, summary.kv_decoding) == (2, 2, 2020)
    for model, cap in ((MODEL, 8192), (SLOW_DECODE, 8192), (MODEL, 1000), (SLOW_DECODE, 1000), (MODEL, 8192)):
        chunk = largest_chunk(model, 0.05, 2, 2020, cap)
        assert summary.decode_chunk(model, 0.05, cap) == (chunk, model.predict(chunk, 2, 2020 + chunk))
        other = AttainabilityChecker(model, lengths, cap)
        for r in (candidate(), candidate(slo=SLO(ttft_ms=60, tpot_ms=25))):
            expected = reference_check(other, state, r, NOW)
            assert other.check(state, r, NOW) == expected and fits(other, state, r, NOW, summary) is expected.ok


def join_and_leave(rng: random.Random, live: list, summary: ResidentSummary, now: float, changes: int) -> None:
    """Residents join and leave `live` as the router places and forgets them, the summary told of each."""
    for _ in range(changes):
        if live and rng.random() < 0.4:
            summary.remove(live.pop(rng.randrange(len(live))))
        else:
            live.append(random_resident(rng, now))
            summary.add(live[-1])


def test_add_and_remove_keep_the_summary_without_a_recount():
    rng = random.Random(9)
    lengths = OutputLengthTracker(default_mean=150)
    for _ in range(40):
        now = 50.0
        live = [random_resident(rng, now) for _ in range(rng.randint(0, 40))]
        summary = ResidentSummary(live, lengths)
        join_and_leave(rng, live, summary, now, 30)
        # what add and remove kept, against a summary counted afresh
        fresh = ResidentSummary(list(live), lengths)
        for name in ("num_residents", "kv_residents", "num_decoding", "kv_decoding"):
            assert getattr(summary, name) == getattr(fresh, name)
        for deadline in (now - 2, now - 0.25, now, now + 1, now + 10):
            assert summary.ahead(deadline) == fresh.ahead(deadline)
        for _ in range(10):
            r_left, r_kv = rng.randint(1, 800), rng.randint(0, 3000)
            assert summary.peak(r_left, r_kv) == fresh.peak(r_left, r_kv)


def test_peak_bounds_after_joins_and_departures_hold_the_exact_peak():
    """Between counts, `peak_bound` answers in O(1) for the instance that took the last placement; its figures must
    never fall below the exact peak (a request admitted on them would then be admitted wrongly)."""
    rng = random.Random(11)
    lengths = OutputLengthTracker(default_mean=120)
    bounded = 0
    for _ in range(60):
        now = 50.0
        live = [random_resident(rng, now) for _ in range(rng.randint(0, 60))]
        summary = ResidentSummary(live, lengths)
        summary.rebuild()  # as at a report: exact peak figures, which the joins and departures degrade to bounds
        join_and_leave(rng, live, summary, now, rng.randint(1, 12))
        fresh = ResidentSummary(list(live), lengths)
        for _ in range(10):
            remaining, kv = rng.randint(1, 900), rng.randint(0, 5000)
            bound = summary.peak_bound(remaining, kv)
            exact = fresh.peak(remaining, kv)
            if bound is not None:
                bounded += 1
                assert bound[0] >= exact[0] and bound[1] >= exact[1]
    assert bounded > 100


# ---- a prefill instance of a disaggregated fleet ----------------------------------------------------------------
def test_a_prefill_instance_counts_its_whole_queue_chunks_and_the_transfer():
    """Its prompts run in whole chunks with nothing beside them: r's first token and KV transfer after every queued
    prompt, the ones due later included (a tighter request may not squeeze in front of a queue packed to its
    deadlines)."""
    chk = AttainabilityChecker(MODEL, OutputLengthTracker(default_mean=100), max_prefill_chunk=2048)
    later = RequestSnapshot(arrival=10.0, num_prompt_tokens=3000, max_tokens=100, slo=SLO(5000, 50), tier="t")
    summary = ResidentSummary([later], chk.output_lengths)
    r = candidate(prompt=1000)  # due 10.5
    # 4000 tokens: one chunk of 2048 (5 + 20.48 + 0.2048 ms) and 1952 (5 + 19.52 + 0.1952 ms)
    work_s = (0.005 + 2048 * 1e-5 + 2048 * 1e-7) + (0.005 + 1952 * 1e-5 + 1952 * 1e-7)
    assert chk.prefill_seconds(4000) == pytest.approx(work_s)
    slack = r.first_token_due - NOW - work_s
    assert chk.fits_prefill(summary, 100_000, NOW, r, NOW, transfer_s=slack - 1e-6)
    assert not chk.fits_prefill(summary, 100_000, NOW, r, NOW, transfer_s=slack + 1e-6)
    assert not chk.fits_prefill(summary, 100_000, NOW, r, NOW, early_s=slack + 1e-6)
    # the prompts held must fit the KV: 3000 + 1000 tokens
    assert chk.fits_prefill(summary, 4000, NOW, r, NOW)
    assert not chk.fits_prefill(summary, 3999, NOW, r, NOW)
    # the iteration in flight ends first
    assert not chk.fits_prefill(summary, 100_000, NOW + slack + 1e-6, r, NOW)
