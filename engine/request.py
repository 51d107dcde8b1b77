"""A request's state inside the engine. It satisfies `scheduler.types.SchedulableRequest` as is."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.sampler import TopLogprobs
from engine.sampling_params import SamplingParams
from scheduler.headroom import ON_TIME
from scheduler.slo import SLO, deadline_terms

if TYPE_CHECKING:
    import xgrammar as xgr


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    seq_id: int  # the block manager's key
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float
    slo: SLO  # made concrete at admission
    tier: str  # the SLO tier it was admitted under: its output lengths feed that tier's running mean
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    # every prompt token's log-probability, None for the first (nothing predicts it); filled chunk by chunk
    prompt_logprobs: list[float | None] = field(default_factory=lambda: [None])
    prompt_top_logprobs: list[TopLogprobs | None] = field(default_factory=lambda: [None])
    token_times: list[float] = field(default_factory=list)  # emit time of every output token
    first_scheduled_time: float | None = None  # when it first got a slot in a batch: arrival to here is queueing
    num_computed_tokens: int = 0
    num_blocks: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    generator: torch.Generator | None = None
    grammar: xgr.GrammarMatcher | None = None  # its structured output's matcher, advanced with every output token
    # counters read by the batch policy every step: plain attributes, kept by `append_output`
    num_prompt_tokens: int = field(init=False)
    num_output_tokens: int = field(init=False, default=0)
    num_tokens: int = field(init=False)
    first_token_due: float = field(init=False)  # the deadline terms (`scheduler.slo.deadline_terms`)
    tpot_s: float = field(init=False)
    standing: int = ON_TIME  # on time so far, or how it first went late (`scheduler.headroom`)
    # the share of its TPOT the batch policy keeps before each of its tokens' deadlines, its router's word (0: none)
    tpot_reserve: float = 0.0

    def __post_init__(self):
        self.num_prompt_tokens = self.num_tokens = len(self.prompt_token_ids)
        self.first_token_due, self.tpot_s = deadline_terms(self.arrival, self.slo)

    def append_output(self, token: int, now: float) -> None:
        self.output_token_ids.append(token)
        self.token_times.append(now)
        self.num_output_tokens += 1
        self.num_tokens += 1

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
