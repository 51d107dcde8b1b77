"""Configured SLO tiers and how a request's SLO maps onto one (DESIGN.md §1)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

from scheduler.slo import SLO


@dataclass(slots=True, frozen=True)
class Tier:
    name: str
    tpot_ms: float
    ttft_ms: float
    slo: SLO = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if not self.name:
            raise ValueError("a tier needs a non-empty name")
        object.__setattr__(self, "slo", SLO(ttft_ms=self.ttft_ms, tpot_ms=self.tpot_ms))


# Four tiers from interactive to batch, tightest first. Round figures chosen to span the range, not measured.
DEFAULT_TIERS = "tight:20:250,standard:50:500,relaxed:100:1000,batch:250:5000"


class TierSet:
    """The ordered tiers, tightest TPOT first, and the default tier of a request that names no SLO.

    A request names a tier, or carries its own SLO; an own SLO joins the loosest tier that is still at least as
    tight as its TPOT (the tighter neighbour when it lies between two), so the host instances meet it.
    """

    def __init__(self, tiers: Sequence[Tier], default: str | None = None):
        if not tiers:
            raise ValueError("a TierSet needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        for tighter, looser in zip(tiers, tiers[1:]):
            if not tighter.tpot_ms < looser.tpot_ms:
                raise ValueError(f"tiers must be ordered tightest TPOT first with distinct TPOTs: "
                                 f"{tighter.name} ({tighter.tpot_ms} ms) before {looser.name} ({looser.tpot_ms} ms)")
        self._tiers = tuple(tiers)
        self._by_name = {t.name: t for t in tiers}
        self.default = self.by_name(default) if default is not None else self._tiers[-1]  # the loosest

    def __len__(self) -> int:
        return len(self._tiers)

    def __iter__(self) -> Iterator[Tier]:
        return iter(self._tiers)

    def __getitem__(self, index: int) -> Tier:
        return self._tiers[index]

    def index(self, tier: Tier | str) -> int:
        return self._tiers.index(self.by_name(tier if isinstance(tier, str) else tier.name))

    def by_name(self, name: str) -> Tier:
        tier = self._by_name.get(name)
        if tier is None:
            raise ValueError(f"unknown tier {name!r}; configured tiers: {', '.join(self._by_name)}")
        return tier

    def for_tpot(self, tpot_ms: float) -> Tier:
        """The tier a request with this TPOT joins: the loosest tier whose TPOT is not looser than it."""
        if not tpot_ms > 0:
            raise ValueError(f"tpot_ms must be positive, got {tpot_ms}")
        if tpot_ms < self._tiers[0].tpot_ms:
            raise ValueError(f"tpot_ms {tpot_ms} is tighter than the tightest tier "
                             f"{self._tiers[0].name} ({self._tiers[0].tpot_ms} ms)")
        joined = self._tiers[0]
        for tier in self._tiers:
            if tier.tpot_ms > tpot_ms:
                break
            joined = tier
        return joined

    def resolve(self, spec: SLO | str | None) -> tuple[Tier, SLO]:
        """(tier, SLO) of a request that names a tier (its SLO is the tier's), carries its own SLO (kept) or names
        neither (the default tier's). The one place a request's SLO is made concrete."""
        if spec is None:
            return self.default, self.default.slo
        if isinstance(spec, str):
            tier = self.by_name(spec)
            return tier, tier.slo
        if isinstance(spec, SLO):
            return self.for_tpot(spec.tpot_ms), spec
        raise TypeError(f"an SLO spec is a tier name or an SLO, got {type(spec).__name__}")


def parse_tiers(spec: str, default: str | None = None) -> TierSet:
    """"name:tpot_ms:ttft_ms,..." (tightest TPOT first) -> TierSet; `default`: a tier name (None: the loosest)."""
    tiers = []
    for item in spec.split(","):
        parts = item.strip().split(":")
        if len(parts) != 3:
            raise ValueError(f"a tier is name:tpot_ms:ttft_ms, got {item!r}")
        try:
            tiers.append(Tier(parts[0], float(parts[1]), float(parts[2])))
        except ValueError as e:
            raise ValueError(f"tier {item!r}: {e}") from None
    return TierSet(tiers, default)
