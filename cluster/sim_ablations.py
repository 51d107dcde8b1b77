"""PolyServe router ablations for the simulator: the placement of cluster/router.py with one ingredient changed.

`Router._place` has no switches for these, so this subclass restates its placement loop with two (the adapter the
issue allows until cluster/router.py takes `gradient` and `promotion` arguments; everything else, the test, the
queues, scaling and release, is the live router's own code):
- gradient=False: within a tier, least-loaded instance first instead of the busiest attainable one;
- promotion="none": never place on a tighter tier's instance; "eager": tighter tiers (nearest first) are tried
  before the request's own tier instead of after it.
"""
from __future__ import annotations

from cluster.fleet import InstanceStatus, InstanceView, RoutedRequest
from cluster.router import How, Router

PROMOTIONS = ("lazy", "none", "eager")


class AblationRouter(Router):
    def __init__(self, *args, gradient: bool = True, promotion: str = "lazy", **kwargs):
        if promotion not in PROMOTIONS:
            raise ValueError(f"promotion must be one of {', '.join(PROMOTIONS)}, got {promotion!r}")
        super().__init__(*args, **kwargs)
        if self.policy != "polyserve":
            raise ValueError("the ablations vary the polyserve placement")
        self.gradient, self.promotion = gradient, promotion

    def _tier_order(self, tier: int) -> list[int]:
        tighter = list(range(tier - 1, -1, -1))  # nearest first
        if self.promotion == "none":
            return [tier]
        return tighter + [tier] if self.promotion == "eager" else [tier] + tighter

    def _place(self, req: RoutedRequest, now: float) -> tuple[InstanceView, How] | None:
        snap = req.snapshot(now if req.late else req.arrival)
        attainable, tpots, members = self.checker.attainable, self._tier_tpot_ms, self.fleet.members
        for tier in self._tier_order(req.tier_index):
            tpot = tpots[tier]
            for view in sorted(members[tier], key=_load, reverse=self.gradient):
                if view.status is InstanceStatus.READY and attainable(view.snapshot(tpot), snap, now):
                    return view, How.OWN if tier == req.tier_index else How.PROMOTED
        if self.autoscaler is not None and not self.autoscaler.can_join(self.fleet, req.tier_index):
            return None
        tpot = tpots[req.tier_index]
        for view in sorted(self.fleet.idle, key=lambda v: len(v.residents)):
            if view.tightest_resident_tpot_ms() >= tpot and attainable(view.snapshot(tpot), snap, now):
                return view, How.SCALED_UP
        return None


def _load(view: InstanceView) -> float:
    return view.load
