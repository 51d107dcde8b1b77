"""Online least-squares latency model: refits to the engine's own step timings as it runs.

time = b0 + b1 * P + b2 * P^2 + b3 * D + b4 * log(1 + D) + b5 * K + b6 * prior(P, D, K)
(P prefill tokens, D decode sequences, K KV tokens)
- b0: per-step fixed cost (weights read once per step when the batch is small, launches, host work);
- b1: GEMM work per prefill token (weights are shared across tokens, so linear once compute-bound);
- b2: causal attention of a chunk within itself, ~P^2 / 2 (query, key) pairs;
- b3: per decode sequence: its GEMM row plus per-sequence host work (sampling, metadata), which prefill tokens
  do not pay, so it is fitted apart from b1;
- b4: decode cost that flattens as the batch grows: on a CPU the first few decodes cost several times what later
  ones do (bench.profile measures it), which no straight line in D follows;
- b5: attention reading the KV cache, memory-bound: bytes grow with K;
- b6: the prior itself, so that a measured profile is corrected (scaled, plus the terms above) rather than
  replaced by its projection onto straight lines: a profile holds the shape of the cost, the fit its drift.
Every coefficient is constrained >= 0 (more work never makes a step faster), so predictions grow with every input
(the prior must too) and the dynamic-chunking search stays exact.

The fit minimises squared *relative* error (each step weighted by 1 / time^2): the target is a mean absolute
percentage error, and with absolute errors a few long prefill steps would outweigh many short decode steps.
Weighted by recency (forgetting factor per step) so the fit follows drift, and anchored by the prior: a fixed set
of pseudo-observations of `prior.predict` over the expected ranges, with a small total weight. Data dominate the
directions they cover; the prior fills the ones they do not (an engine that has only run decodes still predicts a
sensible prefill cost). Before any step the model is the prior.
"""
from __future__ import annotations

import math
import operator

from scheduler.latency_model import ChunkSolvingModel, LatencyModel, quadratic_root
from scheduler.types import StepStats

NUM_FEATURES = 7
# Relative weights 1 / time^2 are capped here: below ~0.1 ms, timer resolution and host jitter are the error.
MIN_WEIGHTED_TIME_S = 1e-4
# Ridge on the scaled normal equations, relative to their trace: the prior can be a combination of the other
# features (a roofline is affine in P, D, K plus P^2), which would leave the equations singular.
RIDGE = 1e-9


class OnlineLatencyModel:
    def __init__(self, prior: LatencyModel, max_prefill_tokens: int = 2048, max_decode_seqs: int = 256,
                 max_kv_tokens: int = 1 << 20, prior_weight: float = 0.01, forgetting: float = 0.999):
        if min(max_prefill_tokens, max_decode_seqs, max_kv_tokens) < 1:
            raise ValueError("max_prefill_tokens, max_decode_seqs and max_kv_tokens must be positive")
        if not prior_weight > 0:
            raise ValueError(f"prior_weight must be positive, got {prior_weight}")
        if not 0 < forgetting <= 1:
            raise ValueError(f"forgetting must lie in (0, 1], got {forgetting}")
        self.prior = prior
        self.forgetting = forgetting
        self.num_observations = 0
        grid = [(p, d, k) for p in (0, max_prefill_tokens // 2, max_prefill_tokens)
                for d in (0, max_decode_seqs // 2, max_decode_seqs) for k in (0, max_kv_tokens // 2, max_kv_tokens)]
        prior_times = [prior.predict(p, d, k) for p, d, k in grid]
        # features are scaled to ~[0, 1] over the expected ranges: the normal equations stay well conditioned
        self._scale = (1.0, 1.0 / max_prefill_tokens, 1.0 / max_prefill_tokens ** 2, 1.0 / max_decode_seqs,
                       1.0 / math.log1p(max_decode_seqs), 1.0 / max_kv_tokens,
                       1.0 / max(max(prior_times), MIN_WEIGHTED_TIME_S))
        self._prior_a = [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)]
        self._prior_b = [0.0] * NUM_FEATURES
        w = prior_weight / len(grid)
        for (p, d, k), t in zip(grid, prior_times):
            self._accumulate(self._prior_a, self._prior_b, self._features(p, d, k, t), t, w)
        self._data_a = [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)]
        self._data_b = [0.0] * NUM_FEATURES
        self._data_scale = 1.0  # the data's normal equations are _data_a and _data_b times this
        self._coef: list[float] | None = None  # unscaled; None: data changed since the last fit
        self._positive: list[int] = []  # the coefficients the last fit left above 0: where the next one starts

    def _features(self, p: float, d: float, k: float, prior_time: float) -> list[float]:
        s = self._scale
        return [1.0, p * s[1], p * p * s[2], d * s[3], math.log1p(d) * s[4], k * s[5], prior_time * s[6]]

    @staticmethod
    def _accumulate(a: list[list[float]], b: list[float], x: list[float], y: float, w: float) -> None:
        """Adds w * (x x', x y) to the normal equations, the upper triangle of a only (`_refit` mirrors it)."""
        w /= max(y, MIN_WEIGHTED_TIME_S) ** 2  # relative error
        for i in range(NUM_FEATURES):
            wxi = w * x[i]
            b[i] += wxi * y
            row = a[i]
            for j in range(i, NUM_FEATURES):
                row[j] += wxi * x[j]

    def observe(self, stats: StepStats) -> None:
        if not stats.duration >= 0:
            raise ValueError(f"step duration must be non-negative, got {stats.duration}")
        # forgetting without touching the sums: they hold data / scale, and the scale shrinks instead
        self._data_scale *= self.forgetting
        if self._data_scale < 1e-100:
            self._data_a = [[v * self._data_scale for v in row] for row in self._data_a]
            self._data_b = [v * self._data_scale for v in self._data_b]
            self._data_scale = 1.0
        p, d, k = stats.num_prefill_tokens, stats.num_decode_seqs, stats.num_kv_tokens
        self._accumulate(self._data_a, self._data_b, self._features(p, d, k, self.prior.predict(p, d, k)),
                         stats.duration, 1.0 / self._data_scale)
        self.num_observations += 1
        self._coef = None  # refit lazily, on the next predict

    def coefficients(self) -> tuple[float, ...]:
        """(b0, ..., b6) in seconds per unit of (1, P, P^2, D, log(1 + D), K) and per second of the prior."""
        if self._coef is None:
            self._refit()
        return tuple(self._coef)

    def predict(self, num_prefill_tokens: int, num_decode_seqs: int, num_kv_tokens: int) -> float:
        c = self._coef
        if c is None:
            self._refit()
            c = self._coef
        p, d = num_prefill_tokens, num_decode_seqs
        t = c[0] + p * (c[1] + p * c[2]) + d * c[3] + num_kv_tokens * c[5]
        if c[4]:
            t += math.log1p(d) * c[4]
        if c[6]:
            t += self.prior.predict(p, d, num_kv_tokens) * c[6]
        return t

    def _refit(self) -> None:
        data_scale = self._data_scale
        a = [[pa + da * data_scale for pa, da in zip(pr, dr)] for pr, dr in zip(self._prior_a, self._data_a)]
        for i in range(NUM_FEATURES):
            for j in range(i):
                a[i][j] = a[j][i]
        b = [pb + db * data_scale for pb, db in zip(self._prior_b, self._data_b)]
        ridge = RIDGE * sum(a[i][i] for i in range(NUM_FEATURES))
        for i in range(NUM_FEATURES):
            a[i][i] += ridge
        coef, self._positive = _nonnegative_least_squares(a, b, self._positive)
        self._coef = [value * scale for value, scale in zip(coef, self._scale)]


class OnlineChunkSolvingModel(OnlineLatencyModel):
    """`OnlineLatencyModel` over a prior that solves for its chunk: every term of the fit is then a quadratic in the
    chunk too, so the fit solves for it as well (`scheduler.chunking.largest_chunk` starts from its root)."""

    def chunk_polynomial(self, num_prefill_tokens: int, num_decode_seqs: int,
                         num_kv_tokens: int) -> tuple[float, float, float]:
        c = self._coef
        if c is None:
            self._refit()
            c = self._coef
        p, d = num_prefill_tokens, num_decode_seqs
        quadratic, linear = c[2], c[1] + 2 * p * c[2] + c[5]
        constant = c[0] + p * (c[1] + p * c[2]) + d * c[3] + num_kv_tokens * c[5]
        if c[4]:
            constant += math.log1p(d) * c[4]
        if c[6]:
            q, l, k = self.prior.chunk_polynomial(p, d, num_kv_tokens)
            quadratic, linear, constant = quadratic + q * c[6], linear + l * c[6], constant + k * c[6]
        return quadratic, linear, constant

    def chunk_within(self, budget_s: float, num_prefill_tokens: int, num_decode_seqs: int,
                     num_kv_tokens: int) -> float:
        quadratic, linear, constant = self.chunk_polynomial(num_prefill_tokens, num_decode_seqs, num_kv_tokens)
        return quadratic_root(quadratic, linear, constant - budget_s)


def online_latency_model(prior: LatencyModel, **limits) -> OnlineLatencyModel:
    """An `OnlineLatencyModel` over `prior` (`limits`: its keyword arguments), one that solves for its chunk when
    the prior does."""
    return (OnlineChunkSolvingModel if isinstance(prior, ChunkSolvingModel) else OnlineLatencyModel)(prior, **limits)


def _nonnegative_least_squares(a: list[list[float]], b: list[float],
                               start: list[int] = ()) -> tuple[list[float], list[int]]:
    """argmin x'ax - 2b'x over x >= 0, for a symmetric positive definite: Lawson and Hanson's active-set method
    (Solving Least Squares Problems, 1974, ch. 23) on the normal equations. Returns x and its positive
    coordinates. `start`: the positive coordinates of a previous, nearby problem (the last fit, one step ago): when
    the solution on them is positive and no other coordinate would lower the objective (the KKT conditions), it is
    the answer, one solve instead of one per coordinate."""
    n = len(b)
    tolerance = 1e-12 * max(map(abs, b), default=0.0)
    if start:
        z = _solve_on(a, b, start)
        if all(v > 0 for v in z):
            x = _spread(start, z, n)
            if all(b[i] - sum(a[i][j] * x[j] for j in start) <= tolerance for i in range(n) if i not in start):
                return x, list(start)
    x, passive = [0.0] * n, []
    for _ in range(3 * n):  # Lawson and Hanson's own bound on the outer loop
        gradient = [b[i] - sum(a[i][j] * x[j] for j in range(n)) for i in range(n)]  # of the objective, negated
        entering = max((i for i in range(n) if i not in passive), key=gradient.__getitem__, default=None)
        if entering is None or gradient[entering] <= tolerance:
            break
        passive.append(entering)
        while True:
            z = _solve_on(a, b, passive)
            if all(v > 0 for v in z):
                x = _spread(passive, z, n)
                break
            # step from x towards z as far as feasibility allows; the variable that blocks the step leaves, set to
            # exactly 0: rounding can leave it a denormal whose next step underflows to 0, and the loop would never
            # end (the entering variable, still at 0, blocks a step of 0)
            step, blocking = min((x[i] / (x[i] - v) if x[i] > 0 else 0.0, i) for i, v in zip(passive, z) if v <= 0)
            for i, v in zip(passive, z):
                x[i] += step * (v - x[i])
            x[blocking] = 0.0
            passive = [i for i in passive if x[i] > 0]
            if not passive:
                break
    return x, passive


def _solve_on(a: list[list[float]], b: list[float], coords: list[int]) -> list[float]:
    """The unconstrained optimum over `coords` alone (the others held at 0)."""
    return _solve([[a[i][j] for j in coords] for i in coords], [b[i] for i in coords])


def _spread(coords: list[int], values: list[float], n: int) -> list[float]:
    x = [0.0] * n
    for i, v in zip(coords, values):
        x[i] = v
    return x


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting of a small symmetric positive definite system."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot, largest = col, abs(m[col][col])
        for r in range(col + 1, n):
            v = abs(m[r][col])
            if v > largest:
                pivot, largest = r, v
        if largest == 0:
            raise ArithmeticError("singular normal equations")  # the ridge rules this out
        m[col], m[pivot] = m[pivot], m[col]
        prow = m[col]
        diagonal, tail = prow[col], prow[col:]
        for r in range(col + 1, n):
            row = m[r]
            f = row[col] / diagonal
            if f:
                row[col:] = [v - f * w for v, w in zip(row[col:], tail)]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        row = m[r]
        x[r] = (row[n] - sum(map(operator.mul, row[r + 1:n], x[r + 1:n]))) / row[r]
    return x
