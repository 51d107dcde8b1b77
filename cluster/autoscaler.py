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
boundary). The other engines (decode engines) are planned as a co-located fleet's, their minimum being what
`min_instances` leaves beside the prefill minimum.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Container, Iterable, Mapping

from cluster.fleet import Fleet, InstanceStatus, InstanceView


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
    prefill_rate_window_s: float = 10.0  # the prefill token rate is the tokens placed over this many seconds

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

    @property
    def prefill_cap(self) -> int:
        """The most prefill engines."""
        return self.min_prefill_instances if self.max_prefill_instances is None else self.max_prefill_instances


@dataclass(slots=True)
class TokenRate:
    """Tokens counted with the time they were placed, and their rate over the last `window_s` seconds (times on
    the caller's clock, never earlier than the last one added)."""
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


@dataclass(slots=True, frozen=True)
class ScalePlan:
    num_to_start: int = 0  # engines that are not prefill engines: decode engines in a disaggregated fleet
    to_stop: tuple[str, ...] = ()  # idle, empty instances of either role: drain, then stop their processes
    num_prefill_to_start: int = 0


class Autoscaler:
    def __init__(self, limits: ScalingLimits):
        self.limits = limits
        self.prefill_tokens = TokenRate(limits.prefill_rate_window_s)  # prompts placed on prefill engines
        # prefill counts wanted, (time, count), the counts decreasing: their first is the largest of the recent
        self._recent_wants: deque[tuple[float, int]] = deque()
        self._prefill_busy_at: dict[str, float] = {}  # serving prefill engine -> when a plan last saw it busy

    def prefill_wanted(self, rate: float, seconds_per_token: float) -> int:
        """Prefill engines for `rate` prompt tokens a second, each taking `seconds_per_token`, busy the planned
        share of their time; within the prefill limits (which leave a decode engine under max_instances)."""
        lim = self.limits
        need = math.ceil(rate * seconds_per_token / lim.prefill_utilisation)
        return max(lim.min_prefill_instances, min(need, lim.prefill_cap))

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
             roles: Mapping[str, str] | None = None, prefill_seconds_per_token: float = 0.0) -> ScalePlan:
        """`waiting_tiers`: tiers with a request that no instance could take (the router's non-empty queues);
        `keep`: instances never stopped (a prefill engine still holding a hand-off's KV). A disaggregated fleet's:
        `roles`, every starting or serving instance's role as far as known (one not in it counts as a decode
        engine), and `prefill_seconds_per_token`, a prompt token's predicted work on a prefill engine."""
        lim = self.limits
        live = fleet.num_live()
        if lim.min_prefill_instances:
            roles = roles or {}
            prefill = [v for i, v in fleet.instances.items() if roles.get(i) == "prefill"
                       and v.status in (InstanceStatus.STARTING, InstanceStatus.READY)]
            prefill_start, prefill_stop = self._plan_prefill(fleet, len(prefill), live, now,
                                                             prefill_seconds_per_token, keep)
            prefill_starting = sum(1 for v in prefill if v.status is InstanceStatus.STARTING)
        else:
            prefill, prefill_start, prefill_stop, prefill_starting = [], 0, (), 0
        starting = fleet.count(InstanceStatus.STARTING) - prefill_starting
        others_live = live - len(prefill)
        idle = fleet.idle_empty()
        # every tier that waits (and may still grow) will take an idle instance; so will every tier under its minimum
        demand = sum(1 for tier in set(waiting_tiers) if self.can_join(fleet, tier))
        demand += sum(max(0, lim.min_per_tier - len(m)) for m in fleet.members)
        want_idle = lim.idle_pool + demand
        have_idle = len(idle) + starting
        others_min = lim.min_instances - lim.min_prefill_instances
        start = max(want_idle - have_idle, others_min - others_live, 0)
        start = max(0, min(start, lim.max_instances - live - prefill_start))
        if start > 0 or prefill_start:
            return ScalePlan(num_to_start=start, num_prefill_to_start=prefill_start)
        excess = min(have_idle - want_idle, others_live - others_min)
        if excess <= 0:
            return ScalePlan(to_stop=prefill_stop)
        stale = self._stale(idle, now, keep)
        return ScalePlan(to_stop=prefill_stop + tuple(v.instance_id for v in stale[:excess]))

    def _plan_prefill(self, fleet: Fleet, num_prefill: int, live: int, now: float, seconds_per_token: float,
                      keep: Container[str]) -> tuple[int, tuple[str, ...]]:
        """Prefill engines to start, and the idle ones to stop: see the module's doc."""
        lim = self.limits
        wanted = self.prefill_wanted(self.prefill_tokens.rate(now), seconds_per_token)
        wants = self._recent_wants
        while wants and wants[-1][1] <= wanted:
            wants.pop()
        wants.append((now, wanted))
        while now - wants[0][0] > lim.stop_after_idle_s:
            wants.popleft()
        busy_at = self._prefill_busy_at
        self._prefill_busy_at = busy_at = {v.instance_id: now if v.residents else busy_at.get(v.instance_id, v.since)
                                           for v in fleet.prefill}
        start = max(0, min(wanted - num_prefill, lim.max_instances - live))
        surplus = num_prefill - wants[0][1]  # the largest count wanted of late: kept
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
