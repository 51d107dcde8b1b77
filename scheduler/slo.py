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
        first_token_due, tpot_s = deadline_terms(arrival, self)
        return first_token_due + (k - 1) * tpot_s


def deadline_terms(arrival: float, slo: SLO) -> tuple[float, float]:
    """(first_token_due, tpot_s): the two terms every deadline of a request arriving at `arrival` (seconds) is
    computed from. Requests take them once, at admission, so that a policy's per-step deadlines are a multiply-add."""
    return arrival + slo.ttft_ms / 1000.0, slo.tpot_ms / 1000.0


class Deadlined(Protocol):
    first_token_due: float  # seconds, on the clock deadlines are compared with (`deadline_terms`)
    tpot_s: float
    num_output_tokens: int


def next_token_deadline(req: Deadlined) -> float:
    """Deadline (seconds) of the token `req` emits next: `req.slo.token_deadline(req.arrival, outputs + 1)`, the
    same float."""
    return req.first_token_due + req.num_output_tokens * req.tpot_s
