"""Autoscaling policy (pure): which tier may take an idle instance or give one back, and how many engine processes
to start or stop so that a warm idle pool stays ready (DESIGN.md §2).

Two levels. Tier labels move at once and cost nothing: the router takes an idle instance into a tier when a request
of that tier fits nowhere else (scale up) and returns a tier's least-loaded instance to the idle pool once it holds
no request of that tier (scale down); this class only sets the per-tier limits of those moves. Processes are slow:
`plan` says how many to start (a tier has a request waiting, the pool is short, the fleet is under its minimum, an
instance died) and which idle ones to stop (the pool holds more than it should, for `stop_after_idle_s`). The
launcher carries the plan out; nothing here reads a clock or starts anything.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Container, Iterable

from cluster.fleet import Fleet, InstanceStatus


@dataclass(slots=True, frozen=True)
class ScalingLimits:
    min_instances: int = 1  # starting or serving, all tiers and the idle pool together
    max_instances: int = 4
    idle_pool: int = 1  # warm idle instances to keep beyond what the tiers hold
    min_per_tier: int = 0
    max_per_tier: int | None = None  # None: only max_instances bounds a tier
    stop_after_idle_s: float = 5.0  # an idle instance beyond the pool is stopped only after this long (no flapping)

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


@dataclass(slots=True, frozen=True)
class ScalePlan:
    num_to_start: int = 0
    to_stop: tuple[str, ...] = ()  # idle, empty instances: drain, then stop their processes


class Autoscaler:
    def __init__(self, limits: ScalingLimits):
        self.limits = limits

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

    def plan(self, fleet: Fleet, waiting_tiers: Iterable[int], now: float, keep: Container[str] = ()) -> ScalePlan:
        """`waiting_tiers`: tiers with a request that no instance could take (the router's non-empty queues);
        `keep`: instances never stopped (a disaggregated fleet's prefill instances, a pool of fixed size)."""
        lim = self.limits
        live = fleet.num_live()
        starting = fleet.count(InstanceStatus.STARTING)
        idle = fleet.idle_empty()
        # every tier that waits (and may still grow) will take an idle instance; so will every tier under its minimum
        demand = sum(1 for tier in set(waiting_tiers) if self.can_join(fleet, tier))
        demand += sum(max(0, lim.min_per_tier - len(m)) for m in fleet.members)
        want_idle = lim.idle_pool + demand
        have_idle = len(idle) + starting
        start = max(want_idle - have_idle, lim.min_instances - live, 0)
        start = min(start, lim.max_instances - live)
        if start > 0:
            return ScalePlan(num_to_start=start)
        excess = min(have_idle - want_idle, live - lim.min_instances)
        if excess <= 0:
            return ScalePlan()
        stale = sorted((v for v in idle if now - v.since >= lim.stop_after_idle_s and v.instance_id not in keep),
                       key=lambda v: v.since)
        return ScalePlan(to_stop=tuple(v.instance_id for v in stale[:excess]))
