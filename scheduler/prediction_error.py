"""Prediction error (DESIGN.md §1): the step time that no latency model predicts exactly.

A latency model predicts one iteration's time from its batch shape; the hardware takes something else. The
simulator and the emulated engine step on a `StepTruth`, the predicted time distorted by a `PredictionError`:

    truth = ((1 + bias + instance bias) * predicted + host_s + host_per_seq_s * sequences) * noise + stall

- host time: what the step spends beyond the model's work, once per step and per sequence in the batch;
- bias: the model's systematic error across the fleet; instance bias: each instance's own, uniform in
  [-instance_spread, +instance_spread] and drawn once;
- noise: exp(sigma * z - sigma^2 / 2), z standard normal, so its mean is exactly 1 (the bias alone is systematic);
- stall: `stall_s` more, with probability `stall_prob` per step.

Every predictor (router, admission, dynamic chunking) keeps using the plain model: the truth is what it is judged
against, never what it reads. Bounds are computed on `expected_latency_model`, the truth's mean. The parameters
are fitted from measured steps by `fit_prediction_error` (bench.profile runs it on the engine's steps).

Presets (`PREDICTION_ERRORS`), and where each number comes from:
- exact: no error; the simulator and the emulated engine step exactly as predicted.
- cpu-measured: fitted by `python -m bench.profile --executor emulated --rounds 200` (its "prediction error fit"
  line) on the CPU host this repository is developed on: the emulated engine's steps against the latency model it
  sleeps, so its host time per step and per sequence, the sleep's overshoot (bias) and jitter (sigma), and the
  process' rare pauses (stalls); taken on a quiet host, as the stalls depend on what else it runs. One engine: no
  instance spread. Run the same command to refit it on another host.
- gpu-typical: a GPU engine as this repository's measurements and models place it. host_s 1 ms: the host work of
  a whole engine step at a full batch (`python -m bench.host_overhead`), which a GPU step does not hide.
  host_per_seq_s 7 us: the host time per sequence fitted to the emulated engines' steps (`cluster.sim.calibration`;
  bench/RESULTS.md). bias +10 %: the roofline under-predicts some measured GEMM timings (scheduler/roofline.py's
  comparison with vidur's GPU profiles), and an optimistic model is the direction that costs deadlines. sigma 5 %
  and instance_spread 5 %: the few-percent run-to-run and part-to-part variation of GPU kernel times (clocks,
  thermals); an assumption, not measured here. Stalls, 1 step in 1000 taking 20 ms more: a garbage-collection
  pause or a host preemption, of the order the calibration replays count as stalls; also an assumption.
"""
from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, fields
from typing import Sequence

from scheduler.latency_model import ChunkSolvingModel, LatencyModel


@dataclass(slots=True, frozen=True)
class PredictionError:
    """How the true step time departs from the latency model's prediction (module docstring for the formula)."""
    host_s: float = 0.0  # host time per step, seconds
    host_per_seq_s: float = 0.0  # host time per sequence in the batch, seconds
    sigma: float = 0.0  # log-normal multiplicative noise, mean exactly 1
    bias: float = 0.0  # fleet-wide: truth = predicted * (1 + bias); positive: the model is optimistic
    instance_spread: float = 0.0  # each instance's own extra bias, uniform in [-spread, +spread]
    stall_prob: float = 0.0  # probability that a step stalls
    stall_s: float = 0.0  # extra time of a stalled step, seconds

    def __post_init__(self):
        for f in fields(self):
            if not math.isfinite(getattr(self, f.name)):
                raise ValueError(f"prediction error {f.name} must be finite, got {getattr(self, f.name)}")
        for name in ("host_s", "host_per_seq_s", "sigma", "instance_spread", "stall_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"prediction error {name} must be non-negative, got {getattr(self, name)}")
        if not 0 <= self.stall_prob <= 1:
            raise ValueError(f"prediction error stall_prob must lie in [0, 1], got {self.stall_prob}")
        if not self.bias - self.instance_spread > -1:
            raise ValueError(f"prediction error bias - instance_spread must exceed -1 (a step takes positive time), "
                             f"got bias {self.bias} and instance_spread {self.instance_spread}")


EXACT = PredictionError()

PREDICTION_ERRORS: dict[str, PredictionError] = {
    "exact": EXACT,
    "cpu-measured": PredictionError(host_s=0.18e-3, host_per_seq_s=19e-6, sigma=0.031, bias=0.031,
                                    stall_prob=7.5e-4, stall_s=2.6e-3),
    "gpu-typical": PredictionError(host_s=1e-3, host_per_seq_s=7e-6, sigma=0.05, bias=0.10, instance_spread=0.05,
                                   stall_prob=1e-3, stall_s=20e-3),
}


def prediction_error(name_or_value: str | PredictionError) -> PredictionError:
    """A preset by name, or the value itself."""
    if isinstance(name_or_value, PredictionError):
        return name_or_value
    error = PREDICTION_ERRORS.get(name_or_value)
    if error is None:
        raise ValueError(f"unknown prediction error {name_or_value!r}: the presets are "
                         f"{', '.join(PREDICTION_ERRORS)}")
    return error


# Steps whose randomness is drawn at once, from a generator seeded by (seed, block): step k's draw is a function of
# the seed and k alone, so steps laid out ahead and given back (`StepTruth.rewind`) are drawn again the same.
DRAW_BLOCK_STEPS = 256


class StepTruth:
    """One instance's true step times: `model`'s prediction under `error`, deterministic for a `seed` (an instance
    of a fleet takes its own: seeds are mixed as strings, e.g. "7/3" for instance 3 of run seed 7).

    `duration` is called once per step, millions of times per simulation: it is bound at construction to the
    cheapest form `error` allows (`exact`: the prediction itself, one call deeper)."""

    __slots__ = ("duration", "model", "error", "seed", "instance_bias", "_predict", "_scale", "_host_s",
                 "_host_per_seq_s", "_drawn", "_next_step", "_block", "_block_start", "_noise", "_stall",
                 "_other_block", "_other_noise", "_other_stall")

    def __init__(self, model: LatencyModel, error: PredictionError, seed: int | str = 0):
        self.model, self.error, self.seed = model, error, seed
        spread = error.instance_spread
        self.instance_bias = random.Random(f"{seed}/instance").uniform(-spread, spread) if spread else 0.0
        self._predict = model.predict
        self._scale = 1.0 + error.bias + self.instance_bias
        self._host_s, self._host_per_seq_s = error.host_s, error.host_per_seq_s
        self._drawn = error.sigma > 0 or (error.stall_prob > 0 and error.stall_s > 0)
        self._next_step = 0
        self._block = self._other_block = -1
        self._block_start = -DRAW_BLOCK_STEPS  # step 0 lies outside it: the first draw enters block 0
        self._noise = self._stall = self._other_noise = self._other_stall = ()
        if self._drawn:
            self.duration = self._drawn_duration
        elif self._scale != 1.0 or self._host_s or self._host_per_seq_s:
            self.duration = self._fixed_duration
        else:
            self.duration = self._predicted_duration

    # The three forms of `duration(num_prefill_tokens, num_decode_seqs, num_kv_tokens, num_seqs) -> seconds`:
    # num_seqs is the batch's sequences, prefills included.
    def _predicted_duration(self, num_prefill_tokens: int, num_decode_seqs: int, num_kv_tokens: int,
                            num_seqs: int) -> float:
        return self._predict(num_prefill_tokens, num_decode_seqs, num_kv_tokens)

    def _fixed_duration(self, num_prefill_tokens: int, num_decode_seqs: int, num_kv_tokens: int,
                        num_seqs: int) -> float:
        return (self._predict(num_prefill_tokens, num_decode_seqs, num_kv_tokens) * self._scale + self._host_s
                + self._host_per_seq_s * num_seqs)

    def _drawn_duration(self, num_prefill_tokens: int, num_decode_seqs: int, num_kv_tokens: int,
                        num_seqs: int) -> float:
        k = self._next_step
        self._next_step = k + 1
        i = k - self._block_start
        if not 0 <= i < DRAW_BLOCK_STEPS:
            self._enter_block(k // DRAW_BLOCK_STEPS)
            i = k - self._block_start
        return ((self._predict(num_prefill_tokens, num_decode_seqs, num_kv_tokens) * self._scale + self._host_s
                 + self._host_per_seq_s * num_seqs) * self._noise[i] + self._stall[i])

    def rewind(self, num_steps: int) -> None:
        """The last `num_steps` durations drawn never ran (steps laid out ahead, then cut short): the next steps
        get the randomness those had, as if they had been drawn one at a time."""
        if num_steps < 0:
            raise ValueError(f"cannot rewind a negative number of steps, got {num_steps}")
        if not self._drawn:
            return  # nothing random: a step's time depends on its shape alone
        if num_steps > self._next_step:
            raise ValueError(f"cannot rewind {num_steps} steps: only {self._next_step} were drawn")
        self._next_step -= num_steps

    def _enter_block(self, block: int) -> None:
        """Makes `block` current; the one it replaces is kept, as a rewind may step back into it."""
        if block == self._other_block:
            noise, stall = self._other_noise, self._other_stall
        else:
            noise, stall = self._draw_block(block)
        self._other_block, self._other_noise, self._other_stall = self._block, self._noise, self._stall
        self._block, self._noise, self._stall = block, noise, stall
        self._block_start = block * DRAW_BLOCK_STEPS

    def _draw_block(self, block: int) -> tuple[list[float], list[float]]:
        """The noise factors and stall times of the block's steps. Normals by Box-Muller, two per pair of uniforms,
        and stalls by the geometric gaps between them: a draw per stall rather than per step."""
        rng = random.Random(f"{self.seed}/steps/{block}")
        uniform = rng.random
        sigma, prob, stall_s = self.error.sigma, self.error.stall_prob, self.error.stall_s
        if sigma > 0:
            exp, log, sqrt, cos, sin = math.exp, math.log, math.sqrt, math.cos, math.sin
            shift, turn = 0.5 * sigma * sigma, 2.0 * math.pi
            noise = []
            for _ in range(DRAW_BLOCK_STEPS // 2):
                radius, angle = sigma * sqrt(-2.0 * log(1.0 - uniform())), turn * uniform()
                noise.append(exp(radius * cos(angle) - shift))
                noise.append(exp(radius * sin(angle) - shift))
        else:
            noise = [1.0] * DRAW_BLOCK_STEPS
        stall = [0.0] * DRAW_BLOCK_STEPS
        if prob > 0 and stall_s > 0:
            log_no_stall = math.log1p(-prob) if prob < 1 else -math.inf  # -inf: every gap is 0
            i = -1
            while True:
                gap = math.log(1.0 - uniform()) / log_no_stall  # steps up to the next stall; inf when prob ~ 0
                if i + 1 + gap >= DRAW_BLOCK_STEPS:
                    break
                i += 1 + int(gap)
                stall[i] = stall_s
        return noise, stall


class ExpectedLatencyModel:
    """The mean of a `StepTruth` over its noise, stalls and instances: `base` scaled by (1 + bias), plus host time
    and the mean stall. The batch's sequences are its decodes plus one when it holds prefill tokens (the shape
    does not say how many prompts they come from; a chunk is most often one)."""

    __slots__ = ("base", "scale", "fixed_s", "per_seq_s")

    def __init__(self, base: LatencyModel, error: PredictionError):
        self.base = base
        self.scale = 1.0 + error.bias
        self.fixed_s = error.host_s + error.stall_prob * error.stall_s
        self.per_seq_s = error.host_per_seq_s

    def predict(self, num_prefill_tokens: int, num_decode_seqs: int, num_kv_tokens: int) -> float:
        num_seqs = num_decode_seqs + 1 if num_prefill_tokens else num_decode_seqs
        return (self.scale * self.base.predict(num_prefill_tokens, num_decode_seqs, num_kv_tokens) + self.fixed_s
                + self.per_seq_s * num_seqs)


class ExpectedChunkSolvingModel(ExpectedLatencyModel):
    """`ExpectedLatencyModel` of a model that solves for its chunk: with a chunk in the batch it holds one more
    sequence, so the root at budget b is the base model's root at the budget left for its prediction."""

    __slots__ = ()

    def chunk_within(self, budget_s: float, num_prefill_tokens: int, num_decode_seqs: int,
                     num_kv_tokens: int) -> float:
        left = (budget_s - self.fixed_s - self.per_seq_s * (num_decode_seqs + 1)) / self.scale
        return self.base.chunk_within(left, num_prefill_tokens, num_decode_seqs, num_kv_tokens)

    def chunk_polynomial(self, num_prefill_tokens: int, num_decode_seqs: int,
                         num_kv_tokens: int) -> tuple[float, float, float]:
        q, l, k = self.base.chunk_polynomial(num_prefill_tokens, num_decode_seqs, num_kv_tokens)
        return (self.scale * q, self.scale * l,
                self.scale * k + self.fixed_s + self.per_seq_s * (num_decode_seqs + 1))


def expected_latency_model(model: LatencyModel, error: PredictionError) -> LatencyModel:
    """The truth's mean step time under `error`: what bounds are computed on. `model` itself when the error
    leaves the mean unchanged (no wrapper call on hot paths)."""
    if error.bias == 0 and error.host_s == 0 and error.host_per_seq_s == 0 and error.stall_prob * error.stall_s == 0:
        return model
    if isinstance(model, ChunkSolvingModel):
        return ExpectedChunkSolvingModel(model, error)
    return ExpectedLatencyModel(model, error)


# A step counts as a stall when it exceeds the fit by more than this many robust standard deviations of the
# relative residuals (1.4826 MADs each: the standard deviation of a normal), and by at least STALL_FLOOR_S: a
# pause shorter than that is host jitter, which the noise describes.
STALL_ROBUST_SDS = 5.0
STALL_FLOOR_S = 1e-3
MAD_TO_SD = 1.4826
MIN_FIT_STEPS = 10
MAX_FIT_ROUNDS = 8  # refits without the stalls found until the set of stalls settles


def fit_prediction_error(predicted: Sequence[float], measured: Sequence[float],
                         num_seqs: Sequence[int]) -> PredictionError:
    """The `PredictionError` of one engine's measured steps: per step, the model's prediction, the measured
    duration and the sequences in the batch.

    Least squares of measured on (predicted, 1, sequences) over the steps that did not stall gives bias, host_s and
    host_per_seq_s (host times constrained non-negative), each step weighted by 1 / its fitted time squared after
    the first round, as the noise is relative; a stall is a step over the fit by STALL_ROBUST_SDS robust standard
    deviations and STALL_FLOOR_S; stall_prob is their share of the steps, stall_s their mean excess; sigma is the
    standard deviation of the log of measured / fitted over the rest. instance_spread is 0: one engine."""
    n = len(predicted)
    if not n == len(measured) == len(num_seqs):
        raise ValueError(f"predicted, measured and num_seqs must have one entry per step, got {n}, {len(measured)}, "
                         f"{len(num_seqs)}")
    if n < MIN_FIT_STEPS:
        raise ValueError(f"a prediction-error fit needs at least {MIN_FIT_STEPS} steps, got {n}")
    predicted = [float(p) for p in predicted]
    measured = [float(m) for m in measured]
    seqs = [float(s) for s in num_seqs]
    if not all(math.isfinite(p) and p >= 0 for p in predicted):
        raise ValueError("predicted step times must be finite and non-negative")
    if not all(math.isfinite(m) and m > 0 for m in measured):
        raise ValueError("measured step times must be finite and positive")
    if not all(s >= 1 for s in seqs):
        raise ValueError("every step must hold at least one sequence")
    stalled = [False] * n
    weights = [1.0] * n
    for fit_round in range(MAX_FIT_ROUNDS):
        kept = [i for i in range(n) if not stalled[i]]
        slope, host_s, per_seq_s = _nonnegative_host_fit([predicted[i] for i in kept], [measured[i] for i in kept],
                                                         [seqs[i] for i in kept], [weights[i] for i in kept])
        fitted = [slope * p + host_s + per_seq_s * s for p, s in zip(predicted, seqs)]
        if not all(f > 0 for f in fitted):
            raise ValueError("the fitted step time is not positive for every step: the steps do not determine it")
        relative = [m / f - 1.0 for m, f in zip(measured, fitted)]
        centre = statistics.median(relative)
        spread = MAD_TO_SD * statistics.median(abs(r - centre) for r in relative)
        now_stalled = [r - centre > STALL_ROBUST_SDS * spread and m - f > STALL_FLOOR_S
                       for r, m, f in zip(relative, measured, fitted)]
        if fit_round > 0 and now_stalled == stalled:
            break
        stalled, weights = now_stalled, [1.0 / (f * f) for f in fitted]
    stalls = [measured[i] - fitted[i] for i in range(n) if stalled[i]]
    logs = [math.log(measured[i] / fitted[i]) for i in range(n) if not stalled[i]]
    sigma = statistics.pstdev(logs) if len(logs) > 1 else 0.0
    return PredictionError(host_s=host_s, host_per_seq_s=per_seq_s, sigma=sigma, bias=slope - 1.0,
                           stall_prob=len(stalls) / n, stall_s=statistics.fmean(stalls) if stalls else 0.0)


def _nonnegative_host_fit(predicted: list[float], measured: list[float], seqs: list[float],
                          weights: list[float]) -> tuple[float, float, float]:
    """(slope, host_s, host_per_seq_s) minimising the weighted squared error of measured ~ slope * predicted +
    host_s + host_per_seq_s * seqs with both host terms >= 0: the best of the fits that leave out each negative
    term (two terms: every subset)."""
    best, best_error = None, math.inf
    for with_host, with_per_seq in ((True, True), (True, False), (False, True), (False, False)):
        columns = [predicted] + ([[1.0] * len(predicted)] if with_host else []) + ([seqs] if with_per_seq else [])
        coef = _least_squares(columns, measured, weights)
        if coef is None:
            continue
        slope = coef[0]
        host_s = coef[1] if with_host else 0.0
        per_seq_s = coef[-1] if with_per_seq else 0.0
        if host_s < 0 or per_seq_s < 0 or not slope > 0:
            continue
        error = sum(w * (m - slope * p - host_s - per_seq_s * s) ** 2
                    for p, m, s, w in zip(predicted, measured, seqs, weights))
        if error < best_error:
            best, best_error = (slope, host_s, per_seq_s), error
    if best is None:
        raise ValueError("the steps do not determine a positive scale of the prediction (are the predictions all 0?)")
    return best


def _least_squares(columns: list[list[float]], target: list[float], weights: list[float]) -> list[float] | None:
    """The weighted least-squares coefficients of `target` on `columns` (normal equations of the columns scaled to
    unit weighted norm, so that seconds and sequence counts compare; Gaussian elimination with partial pivoting);
    None when the columns are (numerically) dependent."""
    k = len(columns)
    norms = [math.sqrt(math.fsum(w * u * u for u, w in zip(column, weights))) for column in columns]
    if not all(norm > 0 for norm in norms):
        return None
    scaled = [[u / norm for u in column] for column, norm in zip(columns, norms)]
    weighted = [[w * u for u, w in zip(column, weights)] for column in scaled]
    a = [[math.fsum(u * v for u, v in zip(weighted[i], scaled[j])) for j in range(k)]
         + [math.fsum(u * t for u, t in zip(weighted[i], target))] for i in range(k)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) <= 1e-12:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(k):
            if r != col:
                factor = a[r][col] / a[col][col]
                a[r] = [v - factor * w for v, w in zip(a[r], a[col])]
    return [a[i][k] / a[i][i] / norms[i] for i in range(k)]
