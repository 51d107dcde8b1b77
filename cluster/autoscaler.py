"""Autoscaling policy (pure): which tier may take an idle instance or give one back, and how many engine processes
to start or stop so that a warm idle pool stays ready (DESIGN.md §2).

Two levels. Tier labels move at once and cost nothing: the router takes an idle instance into a tier when a request
of that tier fits nowhere else (scale up) and returns a tier's least-loaded instance to the idle pool once it holds
no request of that tier (scale down); this class only sets the per-tier limits of those moves. Processes are slow:
`plan` says how many to start (a tier has a request waiting, the pool is short, the fleet is under its minimum, an
instance died) and which idle ones to stop (the pool holds more than it should, for `stop_after_idle_s`). The
launcher carries the plan out; nothing here reads a clock or starts anything.

A disaggregated fleet (`min_prefill_instances` > 0) sizes its prefill pool from its token rate, as TokenScale does
(arXiv 2512.03416): the caller feeds `prefill_tokens` every prompt it places on a prefill engine, and the plan wants
ceil(rate x seconds per prompt token / `prefill_utilisation`) prefill engines, within their limits. It starts the
missing ones at once; it stops one only while the fleet holds more than the largest count wanted over the last
`stop_after_idle_s`, and only an empty one that has been idle that long (no flapping on a rate that hovers at a
boundary).

The decode engines are sized from their own token rate the same way, within what `min_instances` and
`max_instances` leave beside the prefill minimum: the caller feeds `decode_tokens` the tokens the decode engines'
steps decoded, and passes `decode_seconds_per_token`, a decoded token's predicted share of a step at the largest
batch a decode engine's TPOT and KV allow. Not its share at the batch the engines run now: an engine steps whenever
it holds a request, so that share times the rate only counts the engines holding one; an engine's room is the batch
its TPOT still allows. The plan wants ceil(rate x that share / `decode_utilisation`) decode engines and starts the
missing ones before a tier's request has to wait (a waiting tier, the idle pool and a dead engine's replacement stay
the backstop); idle ones go by the co-located rule, never below the largest count wanted over `stop_after_idle_s`.

The KV hand-off is a third stage: each engine moves KV over a link of its own (the TransferModel's bandwidth), the
prefill engine sending, the decode engine receiving, so the caller feeds `transfer_bytes` each hand-off's bytes and
both pools want enough engines that their links carry the byte rate at `transfer_utilisation` at most: a queue on a
link delays the second token by whole transfers.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Container, Iterable, Mapping

from cluster.fleet import Fleet, InstanceStatus, InstanceView
from scheduler.latency_model import LatencyModel
from scheduler.transfer import TransferModel


@dataclass(slots=True, frozen=True)
class ScalingLimits:
    min_instances: int = 1  # starting or serving, all tiers and the idle pool together
    max_instances: int = 4
    idle_pool: int = 1  # warm idle instances to keep beyond what the tiers hold
    min_per_tier: int = 0
    max_per_tier: int | None = None  # None: only max_instances bounds a tier
    stop_after_idle_s: float = 5.0  # an idle instance beyond the pool is stopped only after this long (no flapping)
    # prefill/decode disaggregation: 0 prefill engines at least means none (every engine does both); the prefill
    # engines count in min_instances and max_instances, and leave a decode engine in both
    min_prefill_instances: int = 0
    max_prefill_instances: int | None = None  # None: min_prefill_instances, a pool of fixed size
    prefill_utilisation: float = 0.7  # the share of its time a prefill engine is planned busy
    # every stage's rate (prompt tokens placed, tokens decoded, KV bytes handed off) is over this many seconds
    prefill_rate_window_s: float = 10.0
    # the share of its TPOT-bound batch capacity a decode engine is planned to carry: above the prefill share, as a
    # batch takes a new request without a queue until it is full; the rest covers the rate's rise over a cold start
    decode_utilisation: float = 0.8
    # the share of its bandwidth an engine's KV link is planned to carry: a transfer that queues delays its second
    # token, and a link's queue grows fast past half its bandwidth
    transfer_utilisation: float = 0.5

    def __post_init__(self):
        if self.min_instances < 0 or self.max_instances < self.min_instances:
            raise ValueError(f"need 0 <= min_instances <= max_instances, got {self.min_instances}, "
                             f"{self.max_instances}")
        if self.idle_pool < 0 or self.min_per_tier < 0:
            raise ValueError("idle_pool and min_per_tier must be non-negative")
        if self.max_per_tier is not None and self.max_per_tier < max(1, self.min_per_tier):
            raise ValueError(f"max_per_tier {self.max_per_tier} must be at least 1 and at least min_per_tier")
        if self.stop_after_idle_s < 0:
            raise ValueError(f"stop_after_idle_s must be non-negative, got {self.stop_after_idle_s}")
        low, high = self.min_prefill_instances, self.prefill_cap
        if low < 0 or high < low:
            raise ValueError(f"need 0 <= min_prefill_instances <= max_prefill_instances, got {low}, {high}")
        if low and (low >= self.min_instances or high >= self.max_instances):
            raise ValueError(f"min_prefill_instances {low} and max_prefill_instances {high} must each leave a decode "
                             f"engine: below min_instances {self.min_instances} and max_instances "
                             f"{self.max_instances}")
        if not low and self.max_prefill_instances:
            raise ValueError("max_prefill_instances needs min_prefill_instances (a disaggregated fleet)")
        if not 0.0 < self.prefill_utilisation <= 1.0:
            raise ValueError(f"prefill_utilisation must be in (0, 1], got {self.prefill_utilisation}")
        if not self.prefill_rate_window_s > 0:
            raise ValueError(f"prefill_rate_window_s must be positive, got {self.prefill_rate_window_s}")
        for name in ("decode_utilisation", "transfer_utilisation"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")

    @property
    def prefill_cap(self) -> int:
        """The most prefill engines."""
        return self.min_prefill_instances if self.max_prefill_instances is None else self.max_prefill_instances

    @property
    def decode_floor(self) -> int:
        """The fewest engines that are not prefill engines: what min_instances leaves beside the prefill minimum."""
        return self.min_instances - self.min_prefill_instances

    @property
    def decode_cap(self) -> int:
        """The most engines that are not prefill engines: what max_instances leaves beside the prefill minimum."""
        return self.max_instances - self.min_prefill_instances


@dataclass(slots=True)
class TokenRate:
    """Tokens (or bytes) counted with the time they were placed, and their rate over the last `window_s` seconds
    (times on the caller's clock, never earlier than the last one added)."""
    window_s: float
    _added: deque[tuple[float, int]] = field(default_factory=deque, init=False, repr=False)
    _total: int = field(default=0, init=False, repr=False)

    def __post_init__(self):
        if not self.window_s > 0:
            raise ValueError(f"window_s must be positive, got {self.window_s}")

    def add(self, now: float, tokens: int) -> None:
        if tokens < 0:
            raise ValueError(f"tokens must be non-negative, got {tokens}")
        if self._added and now < self._added[-1][0]:
            raise ValueError(f"time went back: {now} after {self._added[-1][0]}")
        self._added.append((now, tokens))
        self._total += tokens

    def rate(self, now: float) -> float:
        """Tokens per second placed in (now - window_s, now]."""
        added, start = self._added, now - self.window_s
        while added and added[0][0] <= start:
            self._total -= added.popleft()[1]
        return self._total / self.window_s


@dataclass(slots=True)
class RecentMax:
    """The largest of the counts noted over the last `span_s` seconds (times on the caller's clock)."""
    span_s: float
    # (time, count), the counts decreasing: the first is the largest of the span
    _noted: deque[tuple[float, int]] = field(default_factory=deque, init=False, repr=False)

    def note(self, now: float, count: int) -> int:
        """Notes `count` at `now`; the largest noted over (now - span_s, now]."""
        noted = self._noted
        while noted and noted[-1][1] <= count:
            noted.pop()
        noted.append((now, count))
        while now - noted[0][0] > self.span_s:
            noted.popleft()
        return noted[0][1]


def decode_seconds_per_token(model: LatencyModel, budget_s: float, context: int, max_batch: int) -> float:
    """A decoded token's share of a step at the largest batch (of `max_batch` at most) whose decode step, every
    sequence at `context` tokens, `model` predicts within `budget_s`: a decode engine's capacity is that batch per
    step. One sequence's whole step when even that one is over the budget."""
    if context < 1 or max_batch < 1:
        raise ValueError(f"context and max_batch must be positive, got {context}, {max_batch}")
    low, high = 1, max_batch
    while low < high:  # the step grows with the batch
        mid = (low + high + 1) // 2
        if model.predict(0, mid, mid * context) <= budget_s:
            low = mid
        else:
            high = mid - 1
    return model.predict(0, low, low * context) / low


@dataclass(slots=True, frozen=True)
class ScalePlan:
    num_to_start: int = 0  # engines that are not prefill engines: decode engines in a disaggregated fleet
    to_stop: tuple[str, ...] = ()  # idle, empty instances of either role: drain, then stop their processes
    num_prefill_to_start: int = 0


class Autoscaler:
    def __init__(self, limits: ScalingLimits):
        self.limits = limits
        window = limits.prefill_rate_window_s
        self.prefill_tokens = TokenRate(window)  # prompts placed on prefill engines
        self.decode_tokens = TokenRate(window)  # tokens the decode engines' steps decoded
        self.transfer_bytes = TokenRate(window)  # KV bytes of the hand-offs from prefill to decode engines
        self._prefill_held = RecentMax(limits.stop_after_idle_s)  # prefill counts wanted
        self._decode_held = RecentMax(limits.stop_after_idle_s)  # decode counts wanted
        self._prefill_busy_at: dict[str, float] = {}  # serving prefill engine -> when a plan last saw it busy

    def prefill_wanted(self, rate: float, seconds_per_token: float, links: int = 0) -> int:
        """Prefill engines for `rate` prompt tokens a second, each taking `seconds_per_token`, busy the planned
        share of their time, and at least `links` (`links_wanted`); within the prefill limits (which leave a decode
        engine under max_instances)."""
        lim = self.limits
        need = max(math.ceil(rate * seconds_per_token / lim.prefill_utilisation), links)
        return max(lim.min_prefill_instances, min(need, lim.prefill_cap))

    def decode_wanted(self, rate: float, seconds_per_token: float, links: int = 0) -> int:
        """Decode engines for `rate` tokens decoded a second, each token `seconds_per_token` of an engine's step at
        its TPOT-bound batch (`decode_seconds_per_token`), the engines carrying the planned share of that capacity,
        and at least `links` (`links_wanted`); within the decode limits (`decode_floor`, `decode_cap`)."""
        lim = self.limits
        need = max(math.ceil(rate * seconds_per_token / lim.decode_utilisation), links)
        return max(lim.decode_floor, min(need, lim.decode_cap))

    def links_wanted(self, bytes_rate: float, transfer: TransferModel | None) -> int:
        """Engines on each side of the hand-off whose links, one an engine, carry `bytes_rate` KV bytes a second
        within the planned share of `transfer`'s bandwidth (0 without a transfer model)."""
        if transfer is None:
            return 0
        return math.ceil(bytes_rate / (transfer.link.bandwidth * self.limits.transfer_utilisation))

    @property
    def can_start(self) -> bool:
        """Can the fleet ever grow from nothing (else a request with no instance at all is answered 503)?"""
        return self.limits.max_instances > 0

    def can_join(self, fleet: Fleet, tier: int) -> bool:
        cap = self.limits.max_per_tier
        return cap is None or len(fleet.members[tier]) < cap

    def can_release(self, fleet: Fleet, tier: int) -> bool:
        return len(fleet.members[tier]) > self.limits.min_per_tier

    def tier_below_minimum(self, fleet: Fleet) -> int | None:
        """The tightest tier holding fewer instances than min_per_tier: where a new idle instance goes first."""
        for tier, members in enumerate(fleet.members):
            if len(members) < self.limits.min_per_tier:
                return tier
        return None

    def plan(self, fleet: Fleet, waiting_tiers: Iterable[int], now: float, keep: Container[str] = (),
             roles: Mapping[str, str] | None = None, prefill_seconds_per_token: float = 0.0,
             decode_seconds_per_token: float = 0.0, transfer: TransferModel | None = None) -> ScalePlan:
        """`waiting_tiers`: tiers with a request that no instance could take (the router's non-empty queues);
        `keep`: instances never stopped (a prefill engine still holding a hand-off's KV). A disaggregated fleet's:
        `roles`, every starting or serving instance's role as far as known (one not in it counts as a decode
        engine), `prefill_seconds_per_token`, a prompt token's predicted work on a prefill engine,
        `decode_seconds_per_token`, a decoded token's predicted share of a decode engine's step at its TPOT-bound
        batch, and `transfer`, the hand-offs' KV link (None: the transfer is not sized)."""
        lim = self.limits
        live = fleet.num_live()
        if lim.min_prefill_instances:
            roles = roles or {}
            prefill = [v for i, v in fleet.instances.items() if roles.get(i) == "prefill"
                       and v.status in (InstanceStatus.STARTING, InstanceStatus.READY)]
            links = self.links_wanted(self.transfer_bytes.rate(now), transfer)
            prefill_start, prefill_stop = self._plan_prefill(fleet, len(prefill), live, now,
                                                             prefill_seconds_per_token, links, keep)
            prefill_starting = sum(1 for v in prefill if v.status is InstanceStatus.STARTING)
            decode_wanted = self.decode_wanted(self.decode_tokens.rate(now), decode_seconds_per_token, links)
            decode_held = self._decode_held.note(now, decode_wanted)  # the largest count wanted of late: kept
        else:
            prefill, prefill_start, prefill_stop, prefill_starting = [], 0, (), 0
            decode_wanted = decode_held = 0
        starting = fleet.count(InstanceStatus.STARTING) - prefill_starting
        others_live = live - len(prefill)
        idle = fleet.idle_empty()
        # every tier that waits (and may still grow) will take an idle instance; so will every tier under its minimum
        demand = sum(1 for tier in set(waiting_tiers) if self.can_join(fleet, tier))
        demand += sum(max(0, lim.min_per_tier - len(m)) for m in fleet.members)
        want_idle = lim.idle_pool + demand
        have_idle = len(idle) + starting
        others_min = lim.decode_floor
        start = max(want_idle - have_idle, others_min - others_live, decode_wanted - others_live, 0)
        start = max(0, min(start, lim.max_instances - live - prefill_start))
        if start > 0 or prefill_start:
            return ScalePlan(num_to_start=start, num_prefill_to_start=prefill_start)
        excess = min(have_idle - want_idle, others_live - max(others_min, decode_held))
        if excess <= 0:
            return ScalePlan(to_stop=prefill_stop)
        stale = self._stale(idle, now, keep)
        return ScalePlan(to_stop=prefill_stop + tuple(v.instance_id for v in stale[:excess]))

    def _plan_prefill(self, fleet: Fleet, num_prefill: int, live: int, now: float, seconds_per_token: float,
                      links: int, keep: Container[str]) -> tuple[int, tuple[str, ...]]:
        """Prefill engines to start, and the idle ones to stop: see the module's doc."""
        lim = self.limits
        wanted = self.prefill_wanted(self.prefill_tokens.rate(now), seconds_per_token, links)
        held = self._prefill_held.note(now, wanted)  # the largest count wanted of late: kept
        busy_at = self._prefill_busy_at
        self._prefill_busy_at = busy_at = {v.instance_id: now if v.residents else busy_at.get(v.instance_id, v.since)
                                           for v in fleet.prefill}
        start = max(0, min(wanted - num_prefill, lim.max_instances - live))
        surplus = num_prefill - held
        if start or surplus <= 0:
            return start, ()
        stale = self._stale(fleet.prefill, now, keep, busy_at)  # the prefill pool holds serving instances only
        return 0, tuple(v.instance_id for v in stale[:surplus])

    def _stale(self, views: Iterable[InstanceView], now: float, keep: Container[str],
               busy_at: Mapping[str, float] | None = None) -> list[InstanceView]:
        """The empty ones of `views` idle for stop_after_idle_s, not kept, the longest idle first."""
        def idle_since(v: InstanceView) -> float:
            return max(v.since, busy_at.get(v.instance_id, v.since)) if busy_at is not None else v.since
        return sorted((v for v in views if not v.residents and now - idle_since(v) >= self.limits.stop_after_idle_s
                       and v.instance_id not in keep), key=idle_since)
