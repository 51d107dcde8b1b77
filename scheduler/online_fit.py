"""Online least-squares latency model: refits to the engine's own step timings as it runs.

time = b0 + b1 * P + b2 * P^2 + b3 * D + b4 * K   (P prefill tokens, D decode sequences, K KV tokens)
- b0: per-step fixed cost (weights read once per step when the batch is small, launches, host work);
- b1: GEMM work per prefill token (weights are shared across tokens, so linear once compute-bound);
- b2: causal attention of a chunk within itself, ~P^2 / 2 (query, key) pairs;
- b3: per decode sequence: its GEMM row plus per-sequence host work (sampling, metadata), which prefill tokens
  do not pay, so it is fitted apart from b1;
- b4: attention reading the KV cache, memory-bound: bytes grow with K.
Every coefficient is constrained >= 0 (more work never makes a step faster), so predictions grow with every input
and the dynamic-chunking search stays exact.

Weighted by recency (forgetting factor per step) so the fit follows drift, and anchored by a prior model: a fixed
set of pseudo-observations of `prior.predict` over the expected ranges, with a small total weight. Data dominate
the directions they cover; the prior fills the ones they do not (an engine that has only run decodes still
predicts a sensible prefill cost). The fit weighs absolute squared error, so a prior far off (it predicts
hundreds of ms where steps take tens) pulls harder than its weight suggests: give it a roofline or a profile.
"""
from __future__ import annotations

from scheduler.latency_model import LatencyModel
from scheduler.types import StepStats

NUM_FEATURES = 5


class OnlineLatencyModel:
    def __init__(self, prior: LatencyModel, max_prefill_tokens: int = 2048, max_decode_seqs: int = 256,
                 max_kv_tokens: int = 1 << 20, prior_weight: float = 1.0, forgetting: float = 0.999):
        if min(max_prefill_tokens, max_decode_seqs, max_kv_tokens) < 1:
            raise ValueError("max_prefill_tokens, max_decode_seqs and max_kv_tokens must be positive")
        if not prior_weight > 0:
            raise ValueError(f"prior_weight must be positive, got {prior_weight}")
        if not 0 < forgetting <= 1:
            raise ValueError(f"forgetting must lie in (0, 1], got {forgetting}")
        self.forgetting = forgetting
        self.num_observations = 0
        # features are scaled to ~[0, 1] over the expected ranges: the normal equations stay well conditioned
        self._scale = (1.0, 1.0 / max_prefill_tokens, 1.0 / max_prefill_tokens ** 2,
                       1.0 / max_decode_seqs, 1.0 / max_kv_tokens)
        self._prior_a = [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)]
        self._prior_b = [0.0] * NUM_FEATURES
        grid = [(p, d, k) for p in (0, max_prefill_tokens // 2, max_prefill_tokens)
                for d in (0, max_decode_seqs // 2, max_decode_seqs) for k in (0, max_kv_tokens // 2, max_kv_tokens)]
        w = prior_weight / len(grid)
        for p, d, k in grid:
            self._accumulate(self._prior_a, self._prior_b, self._features(p, d, k), prior.predict(p, d, k), w)
        self._data_a = [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)]
        self._data_b = [0.0] * NUM_FEATURES
        self._coef: list[float] | None = None  # unscaled; None: data changed since the last fit
        # The engine and a policy holding the same model both pass each step on: a step counts once.
        self._last_stats: StepStats | None = None

    def _features(self, p: float, d: float, k: float) -> list[float]:
        s = self._scale
        return [1.0, p * s[1], p * p * s[2], d * s[3], k * s[4]]

    @staticmethod
    def _accumulate(a: list[list[float]], b: list[float], x: list[float], y: float, w: float) -> None:
        for i in range(NUM_FEATURES):
            wxi = w * x[i]
            b[i] += wxi * y
            row = a[i]
            for j in range(NUM_FEATURES):
                row[j] += wxi * x[j]

    def observe(self, stats: StepStats) -> None:
        if stats is self._last_stats:
            return
        if not stats.duration >= 0:
            raise ValueError(f"step duration must be non-negative, got {stats.duration}")
        self._last_stats = stats
        g = self.forgetting
        if g != 1.0:
            for row in self._data_a:
                for j in range(NUM_FEATURES):
                    row[j] *= g
            self._data_b = [v * g for v in self._data_b]
        self._accumulate(self._data_a, self._data_b,
                         self._features(stats.num_prefill_tokens, stats.num_decode_seqs, stats.num_kv_tokens),
                         stats.duration, 1.0)
        self.num_observations += 1
        self._coef = None  # refit lazily, on the next predict

    def coefficients(self) -> tuple[float, ...]:
        """(b0, b1, b2, b3, b4) in seconds per unit of (1, P, P^2, D, K)."""
        if self._coef is None:
            self._refit()
        return tuple(self._coef)

    def predict(self, num_prefill_tokens: int, num_decode_seqs: int, num_kv_tokens: int) -> float:
        c = self._coef
        if c is None:
            self._refit()
            c = self._coef
        p = num_prefill_tokens
        return c[0] + p * (c[1] + p * c[2]) + num_decode_seqs * c[3] + num_kv_tokens * c[4]

    def _refit(self) -> None:
        a = [[pa + da for pa, da in zip(pr, dr)] for pr, dr in zip(self._prior_a, self._data_a)]
        b = [pb + db for pb, db in zip(self._prior_b, self._data_b)]
        # active set (a heuristic, not exact NNLS): pin the most negative coefficient at 0, solve again, until all
        # remaining ones are >= 0
        free = list(range(NUM_FEATURES))
        while True:
            solution = _solve([[a[i][j] for j in free] for i in free], [b[i] for i in free])
            worst = min(range(len(free)), key=solution.__getitem__)
            if solution[worst] >= 0:
                break
            del free[worst]
            if not free:
                solution = []
                break
        coef = [0.0] * NUM_FEATURES
        for i, value in zip(free, solution):
            coef[i] = value * self._scale[i]
        self._coef = coef


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting of a small symmetric positive definite system."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if m[pivot][col] == 0:
            raise ArithmeticError("singular normal equations")  # the prior's positive weight rules this out
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                row, prow = m[r], m[col]
                for c in range(col, n + 1):
                    row[c] -= f * prow[c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x
