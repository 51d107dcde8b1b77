"""Is a tier draining: do its requests leave faster than they come? (DESIGN.md §2, a draining tier's residents moved.)

A tier whose share of the arrivals fell (the mix turned) holds more instances than its arrivals need, for as long as
its residents stay, which for the loosest tier is many seconds; meanwhile a tier whose share rose waits for room.
Its completions then outrun its arrivals. Over the last `window_s` each count is a Poisson count, so their
difference has the variance of their sum: a tier drains when its completions exceed its arrivals by more than
`STANDARD_ERRORS` of it. A tier filling up (the warm-up, a rising share) shows the opposite sign, and a steady one a
difference within its noise.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

# Long enough for tens of completions of a loose tier on the smallest fleets, short beside a loose request's stay
# (the turn is seen while the residents it left behind still hold their instances).
WINDOW_S = 2.0
STANDARD_ERRORS = 2.0


@dataclass(slots=True)
class TierFlow:
    """One tier's arrivals and completions over the last `window_s` seconds (times on the caller's clock)."""
    window_s: float = WINDOW_S
    _arrivals: deque = field(default_factory=deque, init=False)
    _completions: deque = field(default_factory=deque, init=False)

    def __post_init__(self):
        if not self.window_s > 0:
            raise ValueError(f"window_s must be positive, got {self.window_s}")

    def arrived(self, now: float) -> None:
        self._arrivals.append(now)
        self._forget(now)

    def completed(self, now: float) -> None:
        self._completions.append(now)
        self._forget(now)

    def draining(self, now: float) -> bool:
        """Did more of the tier's requests complete than arrive over the window, beyond the counts' noise?"""
        self._forget(now)
        arrived, completed = len(self._arrivals), len(self._completions)
        return completed - arrived > STANDARD_ERRORS * math.sqrt(completed + arrived)

    def _forget(self, now: float) -> None:
        """Drops what left the window: kept as each event comes, a tier never asked holds no more than one."""
        since = now - self.window_s
        for times in (self._arrivals, self._completions):
            while times and times[0] < since:
                times.popleft()
