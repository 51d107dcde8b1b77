"""What the engine and a batch policy exchange every step.

Pure data: no torch, no clock. The engine's own request objects satisfy `SchedulableRequest` directly, so a
policy reads live state without a copy per step; the router's and the simulator's requests satisfy it too, so the
attainability test reads an instance's residents as they are.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from scheduler.slo import SLO


class ResidentRequest(Protocol):
    """A request as the attainability test reads it, its SLO made concrete at admission: the engine's, the
    router's and the simulator's requests all have these fields, so an instance's residents are read as they are."""
    arrival: float  # seconds, on the clock the caller passes as `now`
    slo: SLO
    first_token_due: float  # seconds: `scheduler.slo.deadline_terms(arrival, slo)`, taken at admission
    tpot_s: float
    tier: str  # the tier it was admitted under: the key of the output-length mean it is charged
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens whose KV is in the cache
    num_output_tokens: int
    max_tokens: int  # output cap of this request


class SchedulableRequest(ResidentRequest, Protocol):
    """A request as the batch policy reads it: a resident, and what it holds of the KV pool."""
    num_tokens: int  # prompt + output so far
    num_blocks: int  # KV blocks held
    # the share of its TPOT planned as reserve before each of its tokens' deadlines, as its router placed it (0: none)
    tpot_reserve: float


@dataclass(slots=True, frozen=True)
class KvState:
    block_size: int
    num_free_blocks: int  # free now, evictable prefix-cache blocks included
    num_total_blocks: int


@dataclass(slots=True)
class StepPlan:
    """The batch of one step: (request, tokens to compute now) in batch order, and who gives up its KV first."""
    scheduled: list[tuple[SchedulableRequest, int]] = field(default_factory=list)
    preempted: list[SchedulableRequest] = field(default_factory=list)


@dataclass(slots=True, frozen=True)
class StepStats:
    """One engine step as measured: the shape that the latency model maps to `duration`."""
    start: float
    duration: float  # seconds of wall time for the whole step
    num_prefill_tokens: int
    num_decode_seqs: int
    num_kv_tokens: int  # context tokens attended over, summed across the batch
    num_blocks_used: int
    num_running: int
    num_waiting: int
    num_seqs: int = 0  # sequences in the batch


class BatchPolicy(Protocol):
    """Chooses each step's batch. Never reads a clock: `now` comes in."""

    def schedule(self, now: float, running: Sequence[SchedulableRequest],
                 waiting: Sequence[SchedulableRequest], kv: KvState) -> StepPlan: ...


def blocks_needed(req: SchedulableRequest, num_new_tokens: int, block_size: int) -> int:
    """Extra KV blocks `req` must hold to compute `num_new_tokens` more tokens."""
    total = -(-(req.num_computed_tokens + num_new_tokens) // block_size)
    return max(0, total - req.num_blocks)


def is_decoding(req: ResidentRequest) -> bool:
    """Output started and everything but the newest token cached: its next step computes one token."""
    out = req.num_output_tokens
    return out > 0 and req.num_computed_tokens >= req.num_prompt_tokens + out - 1


def is_decode(req: SchedulableRequest, num_new_tokens: int) -> bool:
    """A step item that is a decode: one new token of a decoding request."""
    return num_new_tokens == 1 and is_decoding(req)
