"""Service-level objectives and the cumulative per-token deadline (DESIGN.md §1)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(slots=True, frozen=True)
class SLO:
    ttft_ms: float
    tpot_ms: float

    def __post_init__(self):
        if not (self.ttft_ms > 0 and self.tpot_ms > 0):
            raise ValueError(f"SLO needs positive ttft_ms and tpot_ms, got {self.ttft_ms}, {self.tpot_ms}")

    def token_deadline(self, arrival: float, k: int) -> float:
        """Deadline (seconds) of output token k, k = 1 being the first: arrival + ttft + (k - 1) * tpot."""
        return arrival + (self.ttft_ms + (k - 1) * self.tpot_ms) / 1000.0


class Deadlined(Protocol):
    arrival: float  # seconds, on the clock deadlines are compared with
    slo: SLO  # made concrete at admission: never None past it
    num_output_tokens: int


def next_token_deadline(req: Deadlined) -> float:
    """Deadline (seconds) of the token `req` emits next: `req.slo.token_deadline(req.arrival, outputs + 1)`, the
    same float, written out because policies call it for every request every step."""
    slo = req.slo
    return req.arrival + (slo.ttft_ms + req.num_output_tokens * slo.tpot_ms) / 1000.0
