"""Headroom under prediction error (DESIGN.md §2, learning under error): the share of each TPOT that packing leaves
unplanned, fed back from measured outcomes.

No latency model is exact on a real fleet: host time, noise and stalls make some steps slower than predicted, and
an instance packed to exactly its predicted TPOT then misses whenever a step runs slow. The owner (the router for
its placements, an engine for its chunks) plans against `tpot * (1 - margin)` and reports the outcome of every
request whose first token was on time (a late first token is queueing or prefill, not packing: counting it would
shrink capacity exactly when load is what misses; a handed-off request's first token where it goes is such a first
token too): a later token late raises the margin by `step`, every token on time lowers it by
`step * target / (1 - target)`. In equilibrium the increases and decreases balance exactly when a share `target` of
requests miss, so the margin settles at the smallest headroom that holds the miss rate at `target` whatever the
error's size: a stochastic approximation of the quantile the error calls for (Robbins-Monro), with no constant fitted
to a workload.

An outcome shows only a request's life after the placement it judges, so the loop reacts late; the more outcomes
reach one margin per second, the further it overshoots in that time. An owner that pools the outcomes of many
instances in one margin (the router, one per tier) weighs each by less than one once they are many: the margin then
moves per second no faster than over the pool the step was measured on, and the loop's gain stops growing with the
fleet (at full weight a tier of a few hundred instances swings from misses to refusals and back, below the rate that
a smaller fleet holds per instance). The weights change how fast the margin moves, not where it settles.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# The share of requests a margin lets miss unless the operator says otherwise: well inside a rule of 99 % attaining,
# where refused requests count against the rule too (bench/RESULTS.md compares shares against both goodput rules).
DEFAULT_TARGET = 0.005

# A request's standing, as the headroom reads it: kept on the request by its owner, advanced by `note_token`.
ON_TIME = 0  # every token so far on time
LATE_START = 1  # its first token was late: queueing or prefill, not packing; the headroom ignores it
MISSED = 2  # a later token was late: counted once
HANDED_OFF = 3  # on time on the instance that handed it off: its next token is its first where it goes, a start


def handed_off(standing: int) -> int:
    """The standing a request takes to the instance its KV is handed to: its first token there waited on the
    prefill, the transfer and a queue, as a first token does, so a late one is a late start, not packing. (The
    router, whose test promises that token to a hand-off whose KV lands by its first token's deadline, gives this
    standing only to one that lands later.)"""
    return HANDED_OFF if standing == ON_TIME else standing


def check_headroom_target(target: float) -> None:
    """Refuses a target outside (0, 1): `Headroom`'s own check, and a config's that holds a target before any
    `Headroom` is built from it."""
    if not 0 < target < 1:
        raise ValueError(f"headroom target must lie in (0, 1), got {target}")


@dataclass(slots=True)
class Headroom:
    target: float = DEFAULT_TARGET
    step: float = 0.01  # margin added by one miss
    max_margin: float = 0.5  # never plan less than half the TPOT: past that, error is not what misses
    margin: float = 0.0
    num_missed: int = field(default=0, init=False)
    num_attained: int = field(default=0, init=False)

    def __post_init__(self):
        check_headroom_target(self.target)
        if not 0 < self.step < self.max_margin < 1:
            raise ValueError(f"need 0 < step < max_margin < 1, got step {self.step}, max_margin {self.max_margin}")
        if not 0 <= self.margin <= self.max_margin:
            raise ValueError(f"margin must lie in [0, max_margin], got {self.margin}")

    def missed(self, weight: float = 1.0) -> None:
        """A token after an on-time first one was late (counted once per request, when first seen late); `weight`:
        the outcome's share of a step (under one where the margin pools the outcomes of many instances)."""
        self.num_missed += 1
        self.margin = min(self.max_margin, self.margin + weight * self.step)

    def attained(self, weight: float = 1.0) -> None:
        """A request finished with every token on time."""
        self.num_attained += 1
        self.margin = max(0.0, self.margin - weight * self.step * self.target / (1.0 - self.target))

    def budget_ms(self, tpot_ms: float) -> float:
        """The TPOT to plan against."""
        return tpot_ms * (1.0 - self.margin)

    def note_token(self, standing: int, first: bool, late: bool, weight: float = 1.0) -> int:
        """A request in `standing` emitted a token (its `first`), on time or `late`: counts a miss of packing the
        first time one shows, and answers the request's new standing."""
        if standing == HANDED_OFF:
            standing, first = ON_TIME, True
        if standing != ON_TIME or not late:
            return standing
        if first:
            return LATE_START
        self.missed(weight)
        return MISSED

    def note_finished(self, standing: int, weight: float = 1.0) -> None:
        """A request ended with every token emitted (not aborted) in `standing`."""
        if standing == ON_TIME:
            self.attained(weight)
