"""One simulated engine instance: the engine's step semantics (engine/engine.py) in virtual time, driven by the real
batch policy object, with a step-time truth (scheduler/prediction_error.py: the latency model's prediction and the
error no predictor sees) standing in for the GPU.

Per step, as the engine does: ask `policy.schedule(now, running, waiting, KvState)`; preempt what it names (recompute:
the KV is dropped, the tokens kept, the request goes back to the queue in arrival order); give every planned request
its blocks, ceil(tokens / block_size) each, skipping one that does not fit; the step lasts `truth.duration(prefill
tokens, decode seqs, KV tokens, sequences)`; at its end every request whose whole context is computed emits a token,
and those with their output complete leave and free their blocks.

Decode runs. With nothing waiting, a policy that schedules every running request for one decode token is asked
again next step with the same residents one token longer, and makes the same choice (every policy of scheduler/
does: they only ever withhold a decode for lack of budget or KV). So from such a step on, the instance runs
without asking the policy until a resident finishes, a request arrives, or the next step's blocks would not fit;
the steps' emit times are applied to all residents at once (the per-token deadline check is a running max per
distinct TPOT, not a loop over requests per step). The run's steps are drawn from the truth as they are laid out;
when a run is cut short, the steps laid out past the cut are given back to it (`StepTruth.rewind`), so every step
gets the same time as when drawn one by one. `fast_forward=False` asks the policy every step; the tests check the
two give identical results.

Coalesced reports (`report_every` > 1): the instance keeps what its worker would last have sent (`report`), asking
the worker's own rule (cluster/step_reports.py's ReportRule) at the end of every step whether that step is reported,
told whether a resident joined or left, emitted its first token or was preempted. A decode run asks it for each of
its steps as they are applied; every resident gains one token a step, so a report sent at a step the run applied
later is the residents as they are, that many tokens back.
"""
from __future__ import annotations

import math
from bisect import bisect_left, insort
from dataclasses import dataclass, field
from typing import Callable

from cluster.protocol import Resident
from cluster.step_reports import ReportRule
from scheduler.headroom import ON_TIME, Headroom
from scheduler.latency_model import LearningLatencyModel
from scheduler.prediction_error import StepTruth
from scheduler.slo import SLO, deadline_terms, next_token_deadline
from scheduler.types import BatchPolicy, KvState, StepStats, is_decode

RUN_CHUNK_STEPS = 64  # steps of a decode run laid out at a time: bounds the work thrown away when one is cut


@dataclass(slots=True, eq=False)
class SimRequest:
    """A request inside the simulator. Satisfies scheduler.types.SchedulableRequest (plain fields, no properties:
    policies read them every step) and carries its own latency record."""
    request_id: str
    arrival: float
    slo: SLO
    tier: str
    num_prompt_tokens: int
    max_tokens: int  # the output cap policies see
    output_len: int  # the true output length: the request ends after this many tokens (the emulated engine's EOS)
    num_tokens: int = 0  # prompt + output so far
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    num_blocks: int = 0
    # latency record, seconds of virtual time
    first_token_time: float = math.nan
    last_token_time: float = math.nan
    worst_lateness: float = -math.inf  # max over tokens of emit - deadline
    max_gap: float = 0.0
    num_preemptions: int = 0
    host_tier: str = ""  # the tier of that instance when placed (differs from `tier` when promoted)
    token_times: list[float] | None = None  # every emit time, kept only when asked (tests, calibration)
    token_instances: list[str] | None = None  # with token_times: the instance that emitted each token
    tally: "MissTally | None" = None  # where it is counted missed, once (`count_missed`)
    standing: int = ON_TIME  # as its instance's headroom reads it (`scheduler.headroom`)
    tpot_reserve: float = 0.0  # as its router placed it (`scheduler.types.SchedulableRequest`)
    first_token_due: float = field(init=False)  # the deadline terms (`scheduler.slo.deadline_terms`)
    tpot_s: float = field(init=False)

    def __post_init__(self):
        if self.num_prompt_tokens < 1 or self.output_len < 1 or self.max_tokens < self.output_len:
            raise ValueError(f"request {self.request_id}: needs a prompt, an output, and max_tokens >= output_len")
        self.num_tokens = self.num_prompt_tokens
        self.first_token_due, self.tpot_s = deadline_terms(self.arrival, self.slo)

    @property
    def finished(self) -> bool:
        return self.num_output_tokens >= self.output_len

    def emit(self, t: float) -> float:
        """Its next token came out at `t`; answers how late (seconds past its deadline; negative: early)."""
        late = t - next_token_deadline(self)
        self.note_lateness(late)
        if self.num_output_tokens == 0:
            self.first_token_time = t
        elif t - self.last_token_time > self.max_gap:
            self.max_gap = t - self.last_token_time
        self.last_token_time = t
        self.num_output_tokens += 1
        self.num_tokens += 1
        if self.token_times is not None:
            self.token_times.append(t)
        return late

    def note_lateness(self, late: float) -> None:
        """A token emitted `late` seconds after its deadline (negative: early): keep the worst, and count the
        request as missed the first time one is late."""
        if late > self.worst_lateness:
            if late > 0 >= self.worst_lateness:
                self.count_missed()
            self.worst_lateness = late

    def count_missed(self) -> None:
        """It missed its SLO (a token late, refused, given up, or its first or second token not out by its
        deadline): counted in its tally the first time, and never again."""
        if self.tally is not None:
            self.tally.missed += 1
            self.tally = None


@dataclass(slots=True, frozen=True)
class HeardReport:
    """What the router would have heard last of an instance reporting coalesced: sent after step `num_steps`."""
    num_steps: int
    iteration_end: float
    num_blocks_used: int
    residents: list[Resident]


@dataclass(slots=True)
class MissTally:
    """Requests (of a measured window) that have missed their SLO so far: a run can stop once too many have."""
    missed: int = 0


IDLE, STEP, RUN = 0, 1, 2


class SimInstance:
    """The engine's step loop for one instance. The simulator owns the clock: it calls `on_event(t)` at the time
    `event_time` it was told (whenever `version` is unchanged), and `enqueue` when a request is placed here."""

    def __init__(self, index: int, policy: BatchPolicy, truth: StepTruth, latency_model: LearningLatencyModel,
                 headroom: Headroom, num_blocks: int, block_size: int,
                 schedule_event: Callable[["SimInstance", float], None],
                 on_finish: Callable[["SimInstance", list[SimRequest], float], None], fast_forward: bool = True,
                 instance_id: str = "", report_every: int = 1,
                 on_prefilled: Callable[["SimInstance", list[SimRequest], float], None] | None = None):
        """`truth` gives every step's time; as the engine does, the instance feeds each measured step to
        `latency_model` and each request's outcome to `headroom` (what its policy plans with, if it plans).
        `report_every` > 1: keep `report`, what a worker coalescing its reports so would last have sent.
        With `on_prefilled` it is a prefill instance: a request leaves at its first token (unless that is its last)
        and is handed to `on_prefilled`, its KV blocks still held here until `release_blocks`."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        if report_every < 1:
            raise ValueError(f"report_every must be positive, got {report_every}")
        # None: a report every step, and the simulator reads the instance as it is
        self._report_rule = ReportRule(report_every) if report_every > 1 else None
        self.report: HeardReport | None = None
        self._material = False  # a resident joined or was preempted since `report` was sent
        self.index, self.policy, self.truth = index, policy, truth
        self.latency_model, self.headroom = latency_model, headroom
        self._unreported: list[StepStats] = []  # measured steps the router has not been told of
        self.instance_id = instance_id or f"i{index}"
        self.block_size, self.num_total_blocks = block_size, num_blocks
        self.free_blocks = num_blocks
        self.schedule_event, self.on_finish, self.on_prefilled = schedule_event, on_finish, on_prefilled
        self.fast_forward = fast_forward
        self.waiting: list[SimRequest] = []  # arrival order, as the engine keeps it
        self.running: list[SimRequest] = []  # admission order
        self.state = IDLE
        self.event_time = math.inf
        self.version = 0  # bumped whenever the pending event moves, so stale heap entries are skipped
        # the regular step in flight
        self._items: list[tuple[SimRequest, int]] = []
        self._step_start = 0.0
        self._step_shape = (0, 0, 0, 0)  # prefill tokens, decodes, KV tokens, sequences
        # the decode run in flight: steps [0, _run_len) from _run_start; emit times of the laid-out chunk in _ends
        self._run_len = 0
        self._run_base = 0  # run step index of _ends[0]
        self._run_applied = 0  # entries of _ends already applied to the residents
        self._run_start = self._chunk_start = 0.0
        self._run_kv0 = 0  # KV tokens of the run's first step
        self._ends: list[float] = []
        self._tpots: list[float] = []  # distinct TPOTs (s) among the run's residents
        # figures
        self.last_end = 0.0  # end of the last step applied: what its latest report describes
        self.num_steps = 0
        self.num_policy_calls = 0
        self.num_preemptions = 0

    # ---- what the router sees -------------------------------------------------------------------------------
    @property
    def num_residents(self) -> int:
        return len(self.running) + len(self.waiting)

    def sync(self, now: float) -> None:
        """Apply every step that ended before `now` to the residents (a decode run applies lazily)."""
        if self.state == RUN:
            self._apply_run_until(now)

    def take_unreported_steps(self, through: int | None = None) -> list[StepStats]:
        """The steps measured since the last call, oldest first; with `through`, only those up to that step (a
        count of `num_steps`)."""
        if through is None or through == self.num_steps:
            steps, self._unreported = self._unreported, []
            return steps
        n = len(self._unreported) - (self.num_steps - through)
        steps, self._unreported = self._unreported[:n], self._unreported[n:]
        return steps

    # ---- driven by the simulator ----------------------------------------------------------------------------
    def enqueue(self, req: SimRequest, now: float) -> None:
        if self.state == RUN:
            self._cut_run(now)  # the next step boundary must see the newcomer
        insort(self.waiting, req, key=_arrival)
        self._material = True
        if self.state == IDLE:
            self._set_event(now)  # at `now`, after every other arrival at `now` (the simulator orders them so)

    def let_go(self, req: SimRequest, now: float) -> bool:
        """A running request leaves for another instance (its blocks stay taken until the caller releases them):
        a decode run in flight is cut, and the step in flight goes on without it. False when it is not running
        here."""
        if req not in self.running:
            return False
        if self.state == RUN:
            self._cut_run(now)
        self.running.remove(req)
        self._items = [(r, n) for r, n in self._items if r is not req]
        self._material = True
        return True

    def reserve_blocks(self, num_blocks: int, now: float) -> bool:
        """Blocks for a request's imported KV, taken now if free (a decode run in flight is cut first: its steps
        were laid out against the blocks free when it started)."""
        if self.state == RUN:
            self._cut_run(now)
        if num_blocks > self.free_blocks:
            return False
        self.free_blocks -= num_blocks
        return True

    def release_blocks(self, num_blocks: int, now: float) -> None:
        """A handed-off request's KV has been pulled: its blocks are free, and a request that did not fit may now."""
        self.free_blocks += num_blocks
        if self.state == IDLE and self.waiting:
            self._set_event(now)

    def on_event(self, t: float) -> None:
        if self.state == STEP:
            self._finish_step(t)
        elif self.state == RUN:
            self._apply_run_until(math.inf)
            if self._run_base + len(self._ends) < self._run_len:
                self._lay_out_chunk()
                return
            self._end_run(t)
        self._start_step(t)

    # ---- regular steps --------------------------------------------------------------------------------------
    def _set_event(self, t: float) -> None:
        self.event_time = t
        self.version += 1
        self.schedule_event(self, t)

    def _start_step(self, now: float) -> None:
        if not self.running and not self.waiting:
            self.state, self.event_time = IDLE, math.inf
            return
        bs = self.block_size
        self.num_policy_calls += 1
        plan = self.policy.schedule(now, self.running, self.waiting, KvState(bs, self.free_blocks,
                                                                            self.num_total_blocks))
        for req in plan.preempted:
            self._preempt(req)
        items = []
        num_decode = num_new = num_kv = 0
        free = self.free_blocks
        for req, n in plan.scheduled:
            if n <= 0:
                continue
            computed = req.num_computed_tokens
            need = -(-(computed + n) // bs) - req.num_blocks
            if need > 0:
                if need > free:
                    continue  # the engine's _admit skips what does not fit
                free -= need
                req.num_blocks += need
            items.append((req, n))
            num_new += n
            num_kv += computed + n
            if is_decode(req, n):
                num_decode += 1
        self.free_blocks = free
        if not items:
            # nothing fits: the live engine would spin until something changes; here the next placement wakes it
            self.state, self.event_time = IDLE, math.inf
            rule = self._report_rule
            if rule is not None and rule.num_held:  # the worker's next heartbeat flushes what it held
                rule.clear()
                self._send_report()
            return
        self._admit_newcomers(items)
        if (self.fast_forward and num_decode == len(items) == len(self.running) and not self.waiting
                and not plan.preempted):
            self._start_run(now, num_kv)
            return
        shape = self._step_shape = (num_new - num_decode, num_decode, num_kv, len(items))
        duration = self.truth.duration(*shape)
        self.state = STEP
        self._items = items
        self._step_start = now
        self._set_event(now + duration)

    def _admit_newcomers(self, items: list[tuple[SimRequest, int]]) -> None:
        waiting = self.waiting
        if not waiting:
            return
        running_ids = {id(r) for r in self.running}
        newcomers = [r for r, _ in items if id(r) not in running_ids]
        if newcomers:
            gone = {id(r) for r in newcomers}
            self.waiting = [r for r in waiting if id(r) not in gone]
            self.running.extend(newcomers)

    def _preempt(self, req: SimRequest) -> None:
        self.free_blocks += req.num_blocks
        req.num_blocks = req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._material = True
        if req in self.running:
            self.running.remove(req)
            insort(self.waiting, req, key=_arrival)

    def _finish_step(self, t: float) -> None:
        finished = []
        prefilled = []
        note_token = self.headroom.note_token
        material = self._material
        hands_off = self.on_prefilled is not None
        for req, n in self._items:
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens:
                first = req.num_output_tokens == 0
                material |= first
                req.standing = note_token(req.standing, first, req.emit(t) > 0)
                if req.token_instances is not None:
                    req.token_instances.append(self.instance_id)
                if req.num_output_tokens >= req.output_len:
                    finished.append(req)
                elif hands_off:
                    prefilled.append(req)
        self._items = []
        self._record_step(self._step_start, t - self._step_start, *self._step_shape)
        if prefilled:
            gone = {id(r) for r in prefilled}
            self.running = [r for r in self.running if id(r) not in gone]
        if finished:
            self._release(finished)
            self._step_reported(True)
            self.on_finish(self, finished, t)
        else:
            self._step_reported(material or bool(prefilled))
        if prefilled:
            self.on_prefilled(self, prefilled, t)

    def _step_reported(self, material: bool) -> None:
        """One more step: sent now under the rule, or held."""
        if self._report_rule is not None and self._report_rule.step(material):
            self._send_report()

    def _send_report(self, behind: int = 0) -> None:
        """The report sent after the step `behind` steps of a decode run before the newest applied."""
        self._material = False
        self.report = HeardReport(
            self.num_steps - behind, self.last_end if not behind else self._ends[self._run_applied - 1 - behind],
            self.num_total_blocks - self.free_blocks,
            [Resident(r.request_id, r.num_prompt_tokens, r.num_computed_tokens - behind, r.num_output_tokens - behind)
             for group in (self.running, self.waiting) for r in group])

    def _release(self, finished: list[SimRequest]) -> None:
        gone = set()
        for req in finished:
            self.headroom.note_finished(req.standing)
            self.free_blocks += req.num_blocks
            req.num_blocks = 0
            gone.add(id(req))
        self.running = [r for r in self.running if id(r) not in gone]

    def _record_step(self, start: float, duration: float, num_prefill_tokens: int, num_decode_seqs: int,
                     num_kv_tokens: int, num_seqs: int) -> None:
        self.num_steps += 1
        self.last_end = start + duration
        running, waiting = len(self.running), len(self.waiting)
        stats = StepStats(start, duration, num_prefill_tokens, num_decode_seqs, num_kv_tokens,
                          self.num_total_blocks - self.free_blocks, running, waiting, num_seqs)
        self.latency_model.observe(stats)
        self._unreported.append(stats)

    # ---- decode runs ----------------------------------------------------------------------------------------
    def _start_run(self, now: float, kv0: int) -> None:
        residents = self.running
        bs = self.block_size
        finish_in = min(r.output_len - r.num_output_tokens for r in residents)
        # steps 1.. need ceil((c + i + 1) / bs) blocks each; the first step's are already held
        free = self.free_blocks

        def extra_blocks(i: int) -> int:
            return sum(max(0, -(-(r.num_computed_tokens + i + 1) // bs) - r.num_blocks) for r in residents)

        lo, hi = 0, finish_in - 1  # step lo fits; find the last step index that fits
        if extra_blocks(hi) <= free:
            lo = hi
        else:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if extra_blocks(mid) <= free else (lo, mid)
        self.state = RUN
        self._run_len = lo + 1
        self._run_start = now
        self._run_kv0 = kv0
        self._run_base = 0
        self._tpots = sorted({r.tpot_s for r in residents})
        self._ends = []
        self._run_applied = 0
        self._chunk_start = now
        self._lay_out_chunk()

    def _lay_out_chunk(self) -> None:
        """Emit times of the run's next chunk of steps; the event goes at the chunk's last one."""
        base = self._run_base + len(self._ends)
        t = self._ends[-1] if self._ends else self._run_start
        self._chunk_start = t
        count = min(self._run_len - base, RUN_CHUNK_STEPS)
        duration = self.truth.duration
        b = len(self.running)
        kv = self._run_kv0 + b * base
        ends = []
        for i in range(base, base + count):
            t += duration(0, b, kv, b)  # the first step's too: the same sum _start_step would make
            ends.append(t)
            kv += b
        self._ends = ends
        self._run_base = base
        self._run_applied = 0
        self._set_event(ends[-1])

    def _apply_run_until(self, now: float) -> None:
        """Apply to the residents every laid-out step that ended before `now`."""
        ends = self._ends
        a = self._run_applied
        k = bisect_left(ends, now, lo=a)
        if k == len(ends) and now != math.inf:
            k = len(ends) - 1  # the chunk's last step ends at the event time; it is applied by on_event
        if k <= a:
            return
        self._apply_steps(a, k)

    def _apply_steps(self, a: int, k: int) -> None:
        """Steps a..k-1 of the current chunk happened: every resident emitted one token at each."""
        ends = self._ends
        prev = ends[a - 1] if a else self._chunk_start
        # per distinct TPOT, the worst of (emit - step offset * tpot); per-step gaps are shared
        worst = {}
        for tau in self._tpots:
            w = -math.inf
            for j in range(a, k):
                v = ends[j] - (j - a) * tau
                if v > w:
                    w = v
            worst[tau] = w
        gap = 0.0
        for j in range(a + 1, k):
            g = ends[j] - ends[j - 1]
            if g > gap:
                gap = g
        steps = k - a
        last = ends[k - 1]
        in_flight = 1 if (self._run_base + k < self._run_len) else 0
        bs = self.block_size
        free = self.free_blocks
        note_token = self.headroom.note_token
        for r in self.running:
            late = worst[r.tpot_s] - next_token_deadline(r)
            r.note_lateness(late)
            r.standing = note_token(r.standing, False, late > 0)
            g = ends[a] - r.last_token_time
            if gap > g:
                g = gap
            if g > r.max_gap:
                r.max_gap = g
            r.last_token_time = last
            r.num_output_tokens += steps
            r.num_tokens += steps
            r.num_computed_tokens += steps
            need = -(-(r.num_computed_tokens + in_flight) // bs) - r.num_blocks
            if need > 0:
                r.num_blocks += need
                free -= need
            if r.token_times is not None:
                r.token_times.extend(ends[a:k])
                if r.token_instances is not None:
                    r.token_instances.extend([self.instance_id] * steps)
        self.free_blocks = free
        record = self._record_step
        b = len(self.running)
        kv = self._run_kv0 + b * (self._run_base + a)
        for j in range(a, k):
            record(prev, ends[j] - prev, 0, b, kv, b)
            prev = ends[j]
            kv += b
        self._run_applied = k
        rule = self._report_rule
        if rule is not None:
            # the run's last step goes to the rule from _end_run, once its finishers have left
            sent = None
            for j in range(a, k if in_flight else k - 1):
                if rule.step(self._material):
                    self._material = False
                    sent = j
            if sent is not None:
                self._send_report(k - 1 - sent)

    def _end_run(self, t: float) -> None:
        """The run's last step ended at t: its finishers leave."""
        finished = [r for r in self.running if r.num_output_tokens >= r.output_len]
        self.state = IDLE
        self._ends = []
        if finished:
            self._release(finished)
        self._step_reported(self._material or bool(finished))
        if finished:
            self.on_finish(self, finished, t)

    def _cut_run(self, now: float) -> None:
        """A request arrives mid-run: the step in flight becomes a regular step, and the policy decides the next."""
        self._apply_run_until(now)
        i = self._run_applied
        start = self._ends[i - 1] if i else self._chunk_start
        end = self._ends[i]
        self.truth.rewind(len(self._ends) - i - 1)  # the steps laid out past the one in flight never run
        self.state = STEP
        b = len(self.running)
        self._items = [(r, 1) for r in self.running]
        self._step_shape = (0, b, self._run_kv0 + b * (self._run_base + i), b)
        self._step_start = start
        self._ends = []
        if end != self.event_time:
            self._set_event(end)


def _arrival(req: SimRequest) -> float:
    return req.arrival
