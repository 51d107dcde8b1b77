"""Service-level objectives and the cumulative per-token deadline (DESIGN.md §1)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class SLO:
    ttft_ms: float
    tpot_ms: float

    def __post_init__(self):
        if not (self.ttft_ms > 0 and self.tpot_ms > 0):
            raise ValueError(f"SLO needs positive ttft_ms and tpot_ms, got {self.ttft_ms}, {self.tpot_ms}")

    def token_deadline(self, arrival: float, k: int) -> float:
        """Deadline (seconds) of output token k, k = 1 being the first."""
        return arrival + (self.ttft_ms + (k - 1) * self.tpot_ms) / 1000.0


def next_token_deadline(slo: SLO, arrival: float, num_output_tokens: int) -> float:
    """Deadline (seconds) of the token a request with `num_output_tokens` outputs emits next.

    Same value as `slo.token_deadline(arrival, num_output_tokens + 1)`, written out because policies call it for
    every running request every step.
    """
    return arrival + (slo.ttft_ms + num_output_tokens * slo.tpot_ms) / 1000.0
