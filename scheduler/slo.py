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
