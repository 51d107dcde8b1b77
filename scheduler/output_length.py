"""Per-tier running mean of observed output lengths: the expected length the attainability test charges."""
from __future__ import annotations


class OutputLengthTracker:
    """Exact running mean over a tier's first `horizon` finished requests, then an exponential mean with weight
    1 / horizon, so the estimate follows a workload whose lengths shift (a phase change) instead of freezing.

    `mean` answers the estimate as last published, and a new one is published only once the estimate has drifted
    more than `tolerance` (relative) from it. The attainability test's resident summaries count residents by their
    expected remaining output and are counted again when a mean they used changes; an estimate that moves a fraction
    of a token at every finish crossed an integer every few finishes in a busy fleet, and every summary holding
    that tier was counted again at its next test (in the simulator at 64 instances, a fifth of the router's
    decision time). 2 % of an expected length is well inside the estimate's own noise. `generation` counts the
    publications, so a reader can tell in O(1) that nothing changed."""

    def __init__(self, default_mean: float, horizon: int = 1000, tolerance: float = 0.02):
        if not default_mean >= 1:
            raise ValueError(f"default_mean must be at least 1 token, got {default_mean}")
        if horizon < 1:
            raise ValueError(f"horizon must be positive, got {horizon}")
        if not tolerance >= 0:
            raise ValueError(f"tolerance must be non-negative, got {tolerance}")
        self.default_mean = float(default_mean)
        self.horizon, self.tolerance = horizon, tolerance
        self.generation = 0
        self._estimates: dict[str, float] = {}
        self._means: dict[str, float] = {}  # published
        self._counts: dict[str, int] = {}

    def observe(self, tier: str, num_output_tokens: int) -> None:
        if num_output_tokens < 0:
            raise ValueError(f"num_output_tokens must be non-negative, got {num_output_tokens}")
        n = min(self._counts.get(tier, 0) + 1, self.horizon)
        self._counts[tier] = n
        estimate = self._estimates.get(tier, 0.0)
        estimate = self._estimates[tier] = estimate + (num_output_tokens - estimate) / n
        published = self._means.get(tier)
        if published is None or abs(estimate - published) > self.tolerance * published:
            self._means[tier] = estimate
            self.generation += 1

    def mean(self, tier: str) -> float:
        """Expected output tokens of a request of `tier` (as published); the default until one has finished."""
        return self._means.get(tier, self.default_mean)

    def count(self, tier: str) -> int:
        """Finished requests of `tier` the mean is made of, at most `horizon`."""
        return self._counts.get(tier, 0)
