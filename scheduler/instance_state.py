"""What the attainability test knows of an instance: a pure-data snapshot.

The engine builds one from its own requests (`RequestSnapshot.of`); the router keeps one per instance from the
engines' step reports plus the placements it made since the last report.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from scheduler.slo import SLO
from scheduler.types import SchedulableRequest


@dataclass(slots=True, frozen=True)
class RequestSnapshot:
    """One request as the test sees it: a resident of an instance, or the candidate being placed."""
    arrival: float  # seconds, the clock `now` is on
    num_prompt_tokens: int
    max_tokens: int  # output cap
    slo: SLO
    tier: str = ""  # key of the output-length mean this request is charged
    num_computed_tokens: int = 0  # tokens whose KV is cached
    num_output_tokens: int = 0

    def __post_init__(self):
        if self.num_prompt_tokens < 1 or self.max_tokens < 1:
            raise ValueError(f"a request needs a prompt and an output cap, got num_prompt_tokens "
                             f"{self.num_prompt_tokens}, max_tokens {self.max_tokens}")
        if not 0 <= self.num_computed_tokens <= self.num_prompt_tokens + self.num_output_tokens:
            raise ValueError(f"num_computed_tokens {self.num_computed_tokens} outside [0, prompt + output]")
        if self.num_output_tokens < 0:
            raise ValueError(f"num_output_tokens must be non-negative, got {self.num_output_tokens}")

    @classmethod
    def of(cls, req: SchedulableRequest, default_slo: SLO, tier: str = "") -> "RequestSnapshot":
        return cls(arrival=req.arrival, num_prompt_tokens=req.num_prompt_tokens, max_tokens=req.max_tokens,
                   slo=req.slo or default_slo, tier=tier, num_computed_tokens=req.num_computed_tokens,
                   num_output_tokens=req.num_output_tokens)


@dataclass(slots=True, frozen=True)
class InstanceState:
    residents: Sequence[RequestSnapshot]  # running and queued on the instance
    kv_capacity_tokens: int  # the instance's whole KV pool, in tokens
    iteration_end: float  # when the iteration in flight ends (<= now when idle)
    tpot_ms: float  # the TPOT its tier holds it to

    def __post_init__(self):
        if self.kv_capacity_tokens < 1:
            raise ValueError(f"kv_capacity_tokens must be positive, got {self.kv_capacity_tokens}")
        if not self.tpot_ms > 0:
            raise ValueError(f"tpot_ms must be positive, got {self.tpot_ms}")
