"""When a worker tells its router about its steps: step reports coalesced on the worker (DESIGN.md §5).

Every engine step's timing reaches the router, which fits its online latency model to each one; but a frame per
step costs the router a decode, a pass over the instance's residents and a rebuild of their summary, and a fleet of
hundreds of engines stepping tens of times a second saturates one router process with that alone. So a worker
holds its steps back and sends them together, in one StepReport, when

- something placement depends on changed since its last report: a resident joined or left (placed, finished,
  aborted), a resident's first token came out, or a resident was preempted (its computed tokens fell back); or
- `every_steps` steps have been held.

What is held back is only progress the router can do without for a few steps: decode tokens (each resident's
counts lag by fewer than `every_steps`) and prefill chunks under way. A report lists the residents whose progress
changed since the last report, as they are after the newest step (the router keeps the others as they were), and
the timing of every step since the last report, oldest first. `flush` sends what is held whatever the rule says
(the worker's heartbeat, so that an engine that stopped stepping is not left described by an older step).

`ReportRule` is that decision, step by step; the worker's `StepReportCoalescer` asks it, and so does the simulator
(cluster/sim/instance.py) for when its router hears of its instances' steps (SimConfig.report_every_steps).
"""
from __future__ import annotations

from cluster.protocol import Resident, StepReport, StepTiming

DEFAULT_REPORT_EVERY_STEPS = 8


class ReportRule:
    """When the steps held back are reported: counts the steps held since the last report."""
    __slots__ = ("every_steps", "num_held")

    def __init__(self, every_steps: int = DEFAULT_REPORT_EVERY_STEPS):
        """`every_steps`: the most steps held back before a report goes (1: a report every step)."""
        if not isinstance(every_steps, int) or every_steps < 1:
            raise ValueError(f"every_steps must be a positive integer, got {every_steps!r}")
        self.every_steps = every_steps
        self.num_held = 0

    def step(self, changed_materially: bool) -> bool:
        """One more step, after which something placement depends on changed or not: True when it and every step
        held before it are reported now (then none is held)."""
        self.num_held += 1
        if changed_materially or self.num_held >= self.every_steps:
            self.num_held = 0
            return True
        return False

    def clear(self) -> None:
        """What was held went out whatever the rule says (a flush), or the listener is new: none is held."""
        self.num_held = 0


class StepReportCoalescer:
    __slots__ = ("rule", "num_total_blocks", "_steps", "_residents", "_sent")

    def __init__(self, every_steps: int = DEFAULT_REPORT_EVERY_STEPS, num_total_blocks: int = 0):
        """`every_steps`: the most steps held back before a report goes (1: a report every step)."""
        self.rule, self.num_total_blocks = ReportRule(every_steps), num_total_blocks
        self._steps: list[StepTiming] = []  # held back, oldest first
        self._residents: list[Resident] = []  # after the newest held step
        self._sent: dict[str, tuple[int, int]] = {}  # request id -> (computed, output) as the router last heard

    def reset(self) -> None:
        """A new router: it has heard nothing yet, and hears nothing of steps before it came."""
        self._steps, self._residents, self._sent = [], [], {}
        self.rule.clear()

    def add(self, step: StepTiming, residents: list[Resident]) -> StepReport | None:
        """One more step, and the residents after it: the report to send now, or None while it is held."""
        self._steps.append(step)
        self._residents = residents
        return self._report() if self.rule.step(self._changed_materially(residents)) else None

    def flush(self) -> StepReport | None:
        """What is held back, at once (None when nothing is)."""
        if not self.rule.num_held:
            return None
        self.rule.clear()
        return self._report()

    def _changed_materially(self, residents: list[Resident]) -> bool:
        sent = self._sent
        if len(residents) != len(sent):
            return True
        for r in residents:
            last = sent.get(r.request_id)
            if last is None or r.num_computed_tokens < last[0] or (r.num_output_tokens and not last[1]):
                return True
        return False

    def _report(self) -> StepReport:
        sent, now_sent = self._sent, {}
        changed = []
        for r in self._residents:
            progress = (r.num_computed_tokens, r.num_output_tokens)
            now_sent[r.request_id] = progress
            if sent.get(r.request_id) != progress:
                changed.append(r)
        report = StepReport(self._steps, self.num_total_blocks, changed)
        self._steps, self._sent = [], now_sent
        return report
