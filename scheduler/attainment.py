"""Did a request attain its SLO? The cumulative-deadline view and the two common TPOT views (DESIGN.md §1).

- cumulative: every token k by `arrival + ttft + (k - 1) * tpot` (the SLO PolyServe schedules for);
- mean TPOT: first token by its deadline and (last - first) / (n - 1) <= tpot;
- max gap: first token by its deadline and every inter-token gap <= tpot.
Max gap attained implies cumulative attained; neither cumulative nor mean TPOT implies the other (an early first
token lets later gaps exceed tpot under the cumulative view; a late middle token can hide in a good mean).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from scheduler.slo import SLO, deadline_terms


@dataclass(slots=True, frozen=True)
class RequestLatency:
    """Measured latency of one finished request, times in seconds."""
    num_tokens: int
    ttft: float
    mean_tpot: float | None  # None with fewer than two tokens
    max_gap: float | None
    worst_lateness: float  # max over tokens of emit - deadline; <= 0 when attained
    attained: bool  # cumulative deadline view
    attained_mean_tpot: bool
    attained_max_gap: bool


def measure_request(slo: SLO, arrival: float, emit_times: Sequence[float]) -> RequestLatency:
    """Latency of a request from its arrival and the emit time of each output token, in order."""
    if not emit_times:
        raise ValueError("a request needs at least one emitted token to be measured")
    if emit_times[0] < arrival:
        raise ValueError(f"first token emitted at {emit_times[0]} before arrival {arrival}")
    first_token_due, tpot_s = deadline_terms(arrival, slo)
    worst = emit_times[0] - first_token_due
    max_gap = None
    previous = emit_times[0]
    for k in range(1, len(emit_times)):
        t = emit_times[k]
        gap = t - previous
        if gap < 0:
            raise ValueError(f"emit times must not decrease: token {k + 1} at {t} after token {k} at {previous}")
        max_gap = gap if max_gap is None or gap > max_gap else max_gap
        worst = max(worst, t - slo.token_deadline(arrival, k + 1))
        previous = t
    n = len(emit_times)
    ttft = emit_times[0] - arrival
    first_on_time = emit_times[0] <= first_token_due
    mean_tpot = (emit_times[-1] - emit_times[0]) / (n - 1) if n > 1 else None
    return RequestLatency(
        num_tokens=n, ttft=ttft, mean_tpot=mean_tpot, max_gap=max_gap, worst_lateness=worst,
        attained=worst <= 0,
        attained_mean_tpot=first_on_time and (mean_tpot is None or mean_tpot <= tpot_s),
        attained_max_gap=first_on_time and (max_gap is None or max_gap <= tpot_s),
    )


@dataclass(slots=True)
class AttainmentTally:
    """Counts of requests attaining under each view, for one tier (or any group a report chooses)."""
    num_requests: int = 0
    num_attained: int = 0
    num_attained_mean_tpot: int = 0
    num_attained_max_gap: int = 0

    def add(self, latency: RequestLatency) -> None:
        self.num_requests += 1
        self.num_attained += latency.attained
        self.num_attained_mean_tpot += latency.attained_mean_tpot
        self.num_attained_max_gap += latency.attained_max_gap

    def fraction(self, view: str = "cumulative") -> float:
        counts = {"cumulative": self.num_attained, "mean_tpot": self.num_attained_mean_tpot,
                  "max_gap": self.num_attained_max_gap}
        if view not in counts:
            raise ValueError(f"view must be one of {', '.join(counts)}, got {view!r}")
        if self.num_requests == 0:
            raise ValueError("no requests tallied")
        return counts[view] / self.num_requests
