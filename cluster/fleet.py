"""The router's view of the fleet: each instance's status, tier label, residents, KV and load (pure data).

`Router` (cluster/router.py) is the only writer; `Autoscaler` and the simulator read. Times are seconds on the
caller's clock; nothing here reads one.
"""
from __future__ import annotations

import enum
from collections import Counter
from dataclasses import InitVar, dataclass, field

from scheduler.headroom import ON_TIME
from scheduler.instance_state import RequestSnapshot, ResidentSummary
from scheduler.output_length import OutputLengthTracker
from scheduler.slo import SLO, deadline_terms


class InstanceStatus(enum.Enum):
    STARTING = "starting"  # launched, not answering yet
    READY = "ready"  # serving: in a tier, or in the idle pool
    DRAINING = "draining"  # finishing its residents before it stops; takes nothing new
    DEAD = "dead"  # crashed, hung, or stopped


@dataclass(slots=True, eq=False)
class RoutedRequest:
    """A request as the router knows it. The progress fields follow the host's step reports.

    It has every field of `scheduler.types.ResidentRequest` under the same name, so an instance's residents go into
    its ResidentSummary as they are: no copy per resident."""
    request_id: str
    tier_index: int  # index into the router's TierSet: the tier whose queue and instances it belongs to
    tier: str  # its name: the key of the output-length mean it is charged
    slo: SLO
    arrival: float
    num_prompt_tokens: int
    max_tokens: int
    instance_id: str | None = None
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    late: bool = False  # its first token can no longer be on time: judged from now on as if it arrived now
    standing: int = ON_TIME  # on time so far, or how it first went late (`scheduler.headroom`)
    # the share of its TPOT its engine keeps before each token's deadline, as set where it was last placed
    # (`Router`'s token_reserve)
    tpot_reserve: float = 0.0
    placed_before: bool = False  # it ran on an instance that was lost: queued again, it is owed an answer
    # output it streamed on a lost instance, now the end of its prompt (`protocol.Submit.resumed_tokens`): its
    # client waits for its next token already
    resumed_tokens: int = 0
    # the other parallel samples of its request, placed with it on one instance (then each a resident of its own)
    companions: tuple["RoutedRequest", ...] = ()
    first_token_due: float = field(init=False)  # the deadline terms (`scheduler.slo.deadline_terms`)
    tpot_s: float = field(init=False)

    def __post_init__(self):
        self.first_token_due, self.tpot_s = deadline_terms(self.arrival, self.slo)

    def snapshot(self, arrival: float) -> RequestSnapshot:
        """As the attainability test sees it, dated `arrival` (its own, or now for a late candidate)."""
        tokens = self.num_prompt_tokens + self.num_output_tokens
        computed = self.num_computed_tokens if self.num_computed_tokens <= tokens else tokens
        return RequestSnapshot(arrival, self.num_prompt_tokens, self.max_tokens, self.slo, self.tier, computed,
                               self.num_output_tokens)


@dataclass(slots=True, eq=False)
class InstanceView:
    instance_id: str
    status: InstanceStatus
    since: float  # when it took its current status or tier label (the autoscaler's idle clock)
    output_lengths: InitVar[OutputLengthTracker]  # the router's: whose means `summary` charges the residents
    tier: int | None = None  # None: in the idle pool
    kv_capacity_tokens: int = 0
    block_size: int = 1  # tokens per KV block of its engine
    residents: dict[str, RoutedRequest] = field(default_factory=dict)
    # residents by tier index, tiers with none left out: the tightest tier among them is the least key
    residents_per_tier: Counter[int] = field(default_factory=Counter)
    kv_tokens: int = 0  # context tokens of the residents: prompt + output so far
    load: float = 0.0  # predicted iteration time of the current batch (every resident decoding)
    iteration_end: float = 0.0  # predicted end of the iteration in flight
    num_blocks_used: int = 0  # as last reported
    # its stand-ins (`Router._reserve`) by request id, each with when its place was taken, oldest first; and the
    # moving mean gap between the instants it let a request go (`Router._unseat`), the last one at `last_unseat`
    stand_ins: dict[str, float] = field(default_factory=dict)
    unseat_gap_s: float = 0.0
    last_unseat: float | None = None
    # the attainability test's aggregates of `residents` (read live: the dict is only ever changed in place); the
    # router adds and removes residents as it places and forgets them, and rebuilds it on step reports, so the
    # router's scan reads it as it is (AttainabilityChecker.fits)
    summary: ResidentSummary = field(init=False)

    def __post_init__(self, output_lengths: OutputLengthTracker):
        self.summary = ResidentSummary(self.residents.values(), output_lengths)

    @property
    def num_own_tier(self) -> int:
        """Residents of its own tier (the rest were promoted onto it); none while it has no tier."""
        return self.residents_per_tier[self.tier] if self.tier is not None else 0

    def tightest_resident_tpot_ms(self) -> float:
        return min((r.slo.tpot_ms for r in self.residents.values()), default=float("inf"))


class Fleet:
    """Instances by id, the members of each tier, the idle pool (serving instances with no tier label), and the
    prefill pool (serving prefill instances of a disaggregated fleet: they take no tier label)."""

    def __init__(self, num_tiers: int):
        self.instances: dict[str, InstanceView] = {}
        self.members: list[list[InstanceView]] = [[] for _ in range(num_tiers)]
        self.idle: list[InstanceView] = []
        self.prefill: list[InstanceView] = []

    def __getitem__(self, instance_id: str) -> InstanceView:
        view = self.instances.get(instance_id)
        if view is None:
            raise KeyError(f"unknown instance {instance_id!r}")
        return view

    def count(self, *statuses: InstanceStatus) -> int:
        return sum(1 for v in self.instances.values() if v.status in statuses)

    def num_live(self) -> int:
        """Starting or serving: what counts toward the instance limits (draining ones are on their way out)."""
        return self.count(InstanceStatus.STARTING, InstanceStatus.READY)

    def idle_empty(self) -> list[InstanceView]:
        return [v for v in self.idle if not v.residents]
