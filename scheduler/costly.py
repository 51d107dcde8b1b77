"""Which requests a fleet past its capacity refuses first (DESIGN.md §2, the costly share).

A rule that lets each tier miss a share of its requests (the headline rule: every tier at 90 %) is met best by
missing the requests that cost the most, as the rule's own bound does (DESIGN.md §1: the costliest tenth of each
tier dropped). Left alone, a fleet at its edge misses whichever requests queue at the wrong moment, and serves the
costly ones that then crowd out several cheap ones each. What a request will cost is known at arrival only by its
prompt: its prefill, its transfer and the KV its decode holds all grow with it, and a long prompt is no more likely
to come with a long output (the conversation and code traces of the matrix).

So, per tier: a request whose prompt is among the tier's costliest `share` of recent prompts is refused at once
while the fleet is under pressure (`FleetPressure`: a request of any tier waited in a router queue within the
time a request placed now stays) or when it finds no place (it would queue), while the refusals this made stay within
`share` of the tier's recent arrivals. A fleet where nothing has waited lately places every request and refuses
none. Under pressure every tier spends its allowance, not only the one that queues: the instance time a looser
tier's costly request takes is what a tighter tier waits for (its instances come from the same fleet, and a looser
tier's overflow goes onto tighter tiers' instances), and the rule holds each tier to its own share, so a tier that
misses less than its share leaves unused the capacity that the worst tier needed. Never more than `share` of a
tier's arrivals are refused for cost. The operator sets `share` to what the rule lets a tier miss beyond what the
margins of prediction error already do (zero: none refused for cost, the default).

A tier whose tighter neighbour sheds (its queued requests could no longer start on time) spends what it has left
of its whole allowance, not only its share: the rule lets each tier miss `share` plus what the margins let miss
(`margins_share`), and a looser tier that misses less than that (few of its requests late, none shed) refuses up to
the rest, its costliest first, so that its instance time goes to the tier that is losing requests it cannot choose.
What it has left is its allowance less every loss it measured among its recent arrivals: refused for cost, shed,
refused with its queue full, first token late, a later token late. Less one standard error of that measured share
over as many arrivals: a tier never spends a spare it only seems to have, and its spare never takes it past its
allowance.
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field

# How many of a tier's latest arrivals its costliest share and its refusals are counted over: enough for a
# quantile near the tail, few enough to follow the mix of the last seconds of a busy tier.
RECENT_ARRIVALS = 2000
# Below this many arrivals seen, no quantile is trusted and nothing is refused for cost.
MIN_ARRIVALS = 200


def check_costly_share(share: float) -> None:
    """Refuses a share outside [0, 1)."""
    if not 0 <= share < 1:
        raise ValueError(f"costly share must lie in [0, 1), got {share}")


@dataclass(slots=True)
class CostlyShare:
    """One tier's recent prompts, and the refusals made for cost and the other losses among its recent arrivals."""
    share: float = 0.0
    margins_share: float = 0.0  # what the margins let miss: with `share`, the tier's whole allowance
    recent: int = RECENT_ARRIVALS
    _prompts: deque = field(default_factory=deque, init=False)  # (prompt tokens, refused) in arrival order
    _sorted: list = field(default_factory=list, init=False)  # the same prompt lengths, sorted
    _num_refused: int = field(default=0, init=False)
    _num_arrived: int = field(default=0, init=False)  # every arrival so far
    _losses: deque = field(default_factory=deque, init=False)  # the arrival count as each other loss was seen

    def __post_init__(self):
        check_costly_share(self.share)
        if not 0 <= self.margins_share < 1 - self.share:
            raise ValueError(f"margins share must lie in [0, 1 - share), got {self.margins_share}")
        if self.recent < MIN_ARRIVALS:
            raise ValueError(f"recent must be at least {MIN_ARRIVALS}, got {self.recent}")

    def arrived(self, prompt_tokens: int) -> None:
        """A new request of the tier (not one placed again after its instance was lost). Without a share nothing is
        kept: every request of a router passes here."""
        if not self.share:
            return
        if len(self._prompts) == self.recent:
            old, refused = self._prompts.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
            self._num_refused -= refused
        self._prompts.append((prompt_tokens, False))
        bisect.insort(self._sorted, prompt_tokens)
        self._num_arrived += 1
        while self._losses and self._losses[0] <= self._num_arrived - self.recent:
            self._losses.popleft()

    def lost(self) -> None:
        """A request of the tier was lost otherwise than refused for cost: shed, refused with its queue full, or
        a token of it late. Counted among the recent arrivals as of now (it arrived a little earlier)."""
        if self.share:
            self._losses.append(self._num_arrived)

    def refuse(self, spare: bool = False) -> bool:
        """The tier's latest arrival came under pressure: is it refused for its cost? It is when its prompt is
        at or above the tier's costliest `share` of recent prompts and the refusals stay within `share` of the recent
        arrivals with it; counted as one of them when so. With `spare` (a tighter tier sheds), up to what the tier
        has left of its whole allowance where that is more (`spare_share`)."""
        seen = len(self._sorted)
        if seen < MIN_ARRIVALS:
            return False
        share = max(self.share, self.spare_share()) if spare else self.share
        if self._num_refused + 1 > share * seen:
            return False
        prompt_tokens = self._prompts[-1][0]
        if prompt_tokens < self._sorted[min(seen - 1, int((1.0 - share) * seen))]:
            return False
        self._prompts[-1] = (prompt_tokens, True)
        self._num_refused += 1
        return True

    def spare_share(self) -> float:
        """The share of recent arrivals the tier may refuse for cost in all, its other losses and one standard
        error of their measured share kept back from its whole allowance; none before MIN_ARRIVALS arrivals."""
        seen = len(self._sorted)
        if seen < MIN_ARRIVALS:
            return 0.0
        allowance = self.share + self.margins_share
        error = math.sqrt(allowance * (1.0 - allowance) / seen)
        return allowance - error - len(self._losses) / seen


@dataclass(slots=True)
class FleetPressure:
    """Whether a fleet is at its capacity, as its router sees it: a request waited in a router queue within the last
    `hold_s` seconds, the time a request placed now is expected to hold its place. Until the residents that were
    there when the queue formed have left, the fleet has not shown room; a costly request placed in that time takes
    the place of cheaper ones for all of its own stay. A queue that forms now and then at the edge keeps it on between
    the waits; a fleet where nothing has waited that long is off."""
    _last_wait: float | None = field(default=None, init=False)  # when a request last waited (None: never)

    def waited(self, now: float) -> None:
        """A request waits in a queue at `now` (queued, or found waiting as another arrived)."""
        if self._last_wait is None or now > self._last_wait:
            self._last_wait = now

    def on(self, now: float, hold_s: float) -> bool:
        return self._last_wait is not None and now - self._last_wait < hold_s
