"""Per-tier running mean of observed output lengths: the expected length the attainability test charges."""
from __future__ import annotations


class OutputLengthTracker:
    """Exact running mean over a tier's first `horizon` finished requests, then an exponential mean with weight
    1 / horizon, so the estimate follows a workload whose lengths shift (a phase change) instead of freezing."""

    def __init__(self, default_mean: float, horizon: int = 1000):
        if not default_mean >= 1:
            raise ValueError(f"default_mean must be at least 1 token, got {default_mean}")
        if horizon < 1:
            raise ValueError(f"horizon must be positive, got {horizon}")
        self.default_mean = float(default_mean)
        self.horizon = horizon
        self._means: dict[str, float] = {}
        self._counts: dict[str, int] = {}

    def observe(self, tier: str, num_output_tokens: int) -> None:
        if num_output_tokens < 0:
            raise ValueError(f"num_output_tokens must be non-negative, got {num_output_tokens}")
        n = min(self._counts.get(tier, 0) + 1, self.horizon)
        self._counts[tier] = n
        mean = self._means.get(tier, 0.0)
        self._means[tier] = mean + (num_output_tokens - mean) / n

    def mean(self, tier: str) -> float:
        """Expected output tokens of a request of `tier`; the default until one has finished."""
        return self._means.get(tier, self.default_mean)

    def count(self, tier: str) -> int:
        """Finished requests of `tier` the mean is made of, at most `horizon`."""
        return self._counts.get(tier, 0)
