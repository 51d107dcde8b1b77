"""The fleet router as a pure policy object: placement of requests on instances by SLO tier (DESIGN.md §2).

No clock, no sockets, no asyncio: every method takes `now` (seconds, any monotonic clock the caller keeps) and
returns what it decided. The live service (cluster/service.py) and the discrete-event simulator drive the very same
object; the simulator calls these methods in virtual time.

Interface (the caller tells the router what happened; the router answers what to do):

  Instances
    add_instance(id, now)                    launched, not answering yet (STARTING: counts toward the limits)
    on_ready(id, kv_capacity_tokens, now)    answering: joins the idle pool (or a tier under its minimum), then
        -> list[Placement]                   queued requests are retried: send each Placement's request there
    start_draining(id, now)                  takes nothing new from now on; the caller drains it
    remove_instance(id, now)                 drained and stopped (no residents left)
    on_lost(id, now) -> list[RoutedRequest]  died or stopped answering: marked DEAD, its residents handed back
                                             unplaced; the caller re-submits (readmit=True) those that produced no
                                             token and ends the others' streams with an error
  Requests
    submit(request, now, readmit=False)      place, queue or refuse (a Decision). Placed: send it there.
        -> Decision                          readmit: an accepted request placed again; the queue bound is waived
    on_placed(request, id, now)              record a placement decided elsewhere (a restored state, a test's
                                             hand-built fleet); an idle instance joins the request's tier
    on_report(id, report, now)               after each engine step: progress of every resident, end of the step
    on_finished(request_id, n_out, now,      left its instance (finished, aborted, failed); completed=True adds
                completed=True)              n_out to its tier's output-length mean; may release the instance
    withdraw(request_id) -> bool             a queued request's client left
    retry_queued(now) -> list[Placement]     try the queues again (call after finishes and when instances join)
  Reading
    fleet (cluster.fleet.Fleet: InstanceView per instance with status, tier label, residents, kv_tokens, load),
    queue_length(tier), waiting_tiers(), events (recent decisions), counts (totals per event kind)
  A request is a cluster.fleet.RoutedRequest (id, tier index and name, SLO, arrival, prompt length, max_tokens);
  tiers are indices into the TierSet, tightest first. An InstanceReport carries the end of the reported step (on
  the caller's clock), the KV blocks in use and each resident's (request_id, num_computed_tokens,
  num_output_tokens). Processes are the autoscaler's: `autoscaler.plan(fleet, waiting_tiers(), now)`; the router
  asks it only for the limits of its label moves.

Submit assumes the request passed admission (`admissible`: its SLO can be met on an idle instance at all).

Placement, policy "polyserve", for a request of tier k:
  1. own tier: its instances from the highest load to the lowest, the first that passes the attainability test;
     packing the busiest builds a load gradient, so the least-loaded instance drains and can be released;
  2. scale up: an idle instance joins tier k (an empty one, or one whose residents all allow tier k's TPOT);
  3. lazy promotion, only if tier k and the idle pool refuse: tighter tiers, nearest first, each judged at its own
     tighter TPOT. After the idle pool, not before it (DESIGN.md §2 lists it before): a looser request on a tighter
     instance holds a slot of that instance's small batch for its whole, long output, so tight requests that come
     next find the tight tier full; in the simulator, 64 instances, promoting before scale-up gave up at a rate that
     promoting after it attains at 115 % of the fluid bound (bench/RESULTS.md);
  4. else wait in tier k's queue (FIFO, bounded: past the bound QUEUE_FULL with a Retry-After estimate).
  Load = predicted iteration time of the instance's batch, every resident decoding at its current context.
  The test reads an instance through its resident summary (InstanceView.summary), which the router keeps current as
  it places requests, takes step reports and forgets requests: a scan costs O(log n) per instance of n residents
  (plus the latency predictions), not a pass over them; a report pays that pass once and finds the decodes'
  prefill chunk that the next scan of the instance's tier reads, so a scan right after reports costs what a warm
  one does.
  A request that waited until its first token can no longer be on time is judged as if it arrived now: still
  served, first token as soon as no one else is hurt.
Scale down: when a tier's least-loaded instance holds no request of that tier, it returns to the idle pool.
Baselines "random", "round-robin", "least-loaded" (minimum load) ignore tiers: any serving instance, no test.
"""
from __future__ import annotations

import enum
import math
import random
from collections import Counter, deque
from dataclasses import dataclass
from operator import attrgetter
from typing import Iterable, Protocol

from cluster.autoscaler import Autoscaler
from cluster.fleet import Fleet, InstanceStatus, InstanceView, RoutedRequest
from scheduler.attainability import Attainability, AttainabilityChecker
from scheduler.instance_state import InstanceState, RequestSnapshot
from scheduler.latency_model import LatencyModel
from scheduler.output_length import OutputLengthTracker
from scheduler.tiers import TierSet

POLICIES = ("polyserve", "random", "round-robin", "least-loaded")
PROMOTIONS = ("lazy", "before-scale-up", "none", "eager")


class Outcome(enum.Enum):
    PLACED = "placed"
    QUEUED = "queued"
    QUEUE_FULL = "queue_full"  # answer 429 with retry_after_s
    NO_INSTANCE = "no_instance"  # none serving or starting, none can be started: answer 503


class How(enum.Enum):
    OWN = "own"  # an instance of its own tier
    PROMOTED = "promoted"  # an instance of a tighter tier
    SCALED_UP = "scaled_up"  # an idle instance that joined its tier for it
    BASELINE = "baseline"  # chosen by a baseline policy


@dataclass(slots=True, frozen=True)
class Decision:
    outcome: Outcome
    instance_id: str | None = None
    how: How | None = None
    retry_after_s: float = 0.0


@dataclass(slots=True, frozen=True)
class Placement:
    request: RoutedRequest
    instance_id: str
    how: How


@dataclass(slots=True, frozen=True)
class Event:
    """One entry of the router's decision log."""
    time: float
    kind: str  # a How value, "queued", "queue_full", "no_instance", "joined" (tier minimum), "released", "lost"
    request_id: str | None
    instance_id: str | None
    tier: int | None


class ResidentProgress(Protocol):
    """What a step report says of one resident (cluster.protocol.Resident has these fields)."""
    request_id: str
    num_computed_tokens: int
    num_output_tokens: int


@dataclass(slots=True, frozen=True)
class InstanceReport:
    iteration_end: float  # when the reported step ended, on the router's clock
    num_blocks_used: int
    residents: Iterable[ResidentProgress]


class Router:
    def __init__(self, tiers: TierSet, latency_model: LatencyModel, *, policy: str = "polyserve",
                 autoscaler: Autoscaler | None = None, queue_limit: int = 256, max_prefill_chunk: int = 2048,
                 expected_output_tokens: float = 128.0, seed: int = 0, event_log: int = 100_000,
                 gradient: bool = True, promotion: str = "lazy"):
        """`gradient` and `promotion` are PolyServe's ablations: gradient=False tries a tier's least-loaded
        instance first instead of its busiest; promotion "before-scale-up" tries the tighter tiers before the idle
        pool (DESIGN.md §2's order), "none" never places on a tighter tier, "eager" tries the tighter tiers
        (nearest first) before the request's own."""
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if promotion not in PROMOTIONS:
            raise ValueError(f"promotion must be one of {', '.join(PROMOTIONS)}, got {promotion!r}")
        self.gradient, self.promotion = gradient, promotion
        if queue_limit < 0:
            raise ValueError(f"queue_limit must be non-negative, got {queue_limit}")
        self.tiers, self.model, self.policy, self.autoscaler = tiers, latency_model, policy, autoscaler
        self.queue_limit, self.max_prefill_chunk = queue_limit, max_prefill_chunk
        self.output_lengths = OutputLengthTracker(expected_output_tokens)
        self.checker = AttainabilityChecker(latency_model, self.output_lengths, max_prefill_chunk)
        self.fleet = Fleet(len(tiers))
        self.queues: list[deque[RoutedRequest]] = [deque() for _ in tiers]
        self.requests: dict[str, RoutedRequest] = {}  # placed or queued
        self.events: deque[Event] = deque(maxlen=event_log)
        self.counts: Counter[str] = Counter()  # totals of every event kind
        self._tier_tpot_ms = [t.tpot_ms for t in tiers]
        # per tier: the tiers to scan before the idle pool, and after it (tighter ones nearest first)
        self._tier_orders = [_scan_orders(k, promotion) for k in range(len(tiers))]
        self._rng = random.Random(seed)
        self._round_robin = 0

    # ---- instances -------------------------------------------------------------------------------------------
    def add_instance(self, instance_id: str, now: float) -> None:
        if instance_id in self.fleet.instances and self.fleet.instances[instance_id].status is not InstanceStatus.DEAD:
            raise ValueError(f"instance {instance_id!r} is already in the fleet")
        self.fleet.instances[instance_id] = InstanceView(instance_id, InstanceStatus.STARTING, now, iteration_end=now)

    def on_ready(self, instance_id: str, kv_capacity_tokens: int, now: float) -> list[Placement]:
        view = self.fleet[instance_id]
        if view.status is not InstanceStatus.STARTING:
            raise ValueError(f"instance {instance_id!r} is {view.status.value}, not starting")
        if kv_capacity_tokens < 1:
            raise ValueError(f"kv_capacity_tokens must be positive, got {kv_capacity_tokens}")
        view.status, view.since, view.kv_capacity_tokens, view.iteration_end = \
            InstanceStatus.READY, now, kv_capacity_tokens, now
        tier = self.autoscaler.tier_below_minimum(self.fleet) if self.autoscaler is not None else None
        if tier is not None and self.policy == "polyserve":
            self._join(view, tier, now)
            self._log(now, "joined", None, instance_id, tier)
        else:
            self.fleet.idle.append(view)
        return self.retry_queued(now)

    def start_draining(self, instance_id: str, now: float) -> None:
        view = self.fleet[instance_id]
        self._unlabel(view)
        view.status, view.since = InstanceStatus.DRAINING, now

    def remove_instance(self, instance_id: str, now: float) -> None:
        view = self.fleet.instances.pop(instance_id, None)
        if view is None:
            return
        self._unlabel(view)
        for rid in view.residents:
            self.requests.pop(rid, None)

    def on_lost(self, instance_id: str, now: float) -> list[RoutedRequest]:
        view = self.fleet[instance_id]
        self._unlabel(view)
        view.status, view.since = InstanceStatus.DEAD, now
        lost = list(view.residents.values())
        for req in lost:
            req.instance_id = None
            req.num_computed_tokens = 0
            del self.requests[req.request_id]
        view.residents.clear()
        view.num_own_tier = view.kv_tokens = 0
        view.summary.rebuild(self.output_lengths)
        self._log(now, "lost", None, instance_id, None)
        return lost

    # ---- requests --------------------------------------------------------------------------------------------
    def admissible(self, request: RequestSnapshot) -> Attainability | None:
        """Could an idle instance attain `request` at all? None while no instance has said how large its KV is."""
        capacity = max((v.kv_capacity_tokens for v in self.fleet.instances.values()), default=0)
        return self.checker.check_idle(request, capacity) if capacity else None

    def submit(self, req: RoutedRequest, now: float, readmit: bool = False) -> Decision:
        if not readmit and req.request_id in self.requests:
            raise ValueError(f"request {req.request_id!r} is already placed or queued")
        if readmit and not req.late:
            req.late = not self._on_time_possible(req, now)
        placed = self._place(req, now)
        if placed is not None:
            view, how = placed
            self._apply(req, view, how, now)
            return Decision(Outcome.PLACED, view.instance_id, how)
        fleet = self.fleet
        if not any(v.status in (InstanceStatus.READY, InstanceStatus.STARTING) for v in fleet.instances.values()) \
                and (self.autoscaler is None or not self.autoscaler.can_start):
            self._log(now, "no_instance", req.request_id, None, req.tier_index)
            return Decision(Outcome.NO_INSTANCE)
        queue = self.queues[req.tier_index]
        if not readmit and len(queue) >= self.queue_limit:
            self._log(now, "queue_full", req.request_id, None, req.tier_index)
            return Decision(Outcome.QUEUE_FULL, retry_after_s=self._retry_after(req.tier_index))
        if readmit:
            queue.appendleft(req)  # it has waited longest of all
        else:
            queue.append(req)
        self.requests[req.request_id] = req
        self._log(now, "queued", req.request_id, None, req.tier_index)
        return Decision(Outcome.QUEUED)

    def on_placed(self, req: RoutedRequest, instance_id: str, now: float) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request {req.request_id!r} is already placed or queued")
        view = self.fleet[instance_id]
        if view.status is not InstanceStatus.READY:
            raise ValueError(f"instance {instance_id!r} is {view.status.value}, not serving")
        how = How.BASELINE if self.policy != "polyserve" else \
            How.SCALED_UP if view.tier is None else How.OWN if view.tier == req.tier_index else How.PROMOTED
        self._apply(req, view, how, now)

    def on_report(self, instance_id: str, report: InstanceReport, now: float) -> None:
        view = self.fleet.instances.get(instance_id)
        if view is None or view.status is InstanceStatus.DEAD:
            return
        residents = view.residents
        for r in report.residents:
            req = residents.get(r.request_id)
            if req is not None:
                out = r.num_output_tokens
                req.num_output_tokens = out
                req.num_computed_tokens = min(r.num_computed_tokens, req.num_prompt_tokens + out)
        view.num_blocks_used = report.num_blocks_used
        self._refresh(view)
        view.iteration_end = report.iteration_end + view.load  # the next step started as the reported one ended

    def on_finished(self, request_id: str, num_output_tokens: int, now: float, completed: bool = True) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        if completed:
            self.output_lengths.observe(req.tier, num_output_tokens)
        view = self.fleet.instances.get(req.instance_id) if req.instance_id is not None else None
        if view is None:
            return
        if view.residents.pop(request_id, None) is not None:
            if req.tier_index == view.tier:
                view.num_own_tier -= 1
            view.summary.remove(req)
            view.kv_tokens -= req.num_prompt_tokens + req.num_output_tokens
            self._update_load(view)
        if view.tier is not None:
            self._maybe_release(view.tier, now)

    def withdraw(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.instance_id is not None:
            return False
        self.queues[req.tier_index].remove(req)
        del self.requests[request_id]
        return True

    def retry_queued(self, now: float) -> list[Placement]:
        """Heads of the queues, tightest tier first, each queue in order until its head fits nowhere."""
        placements = []
        for queue in self.queues:
            while queue:
                req = queue[0]
                if not req.late:
                    req.late = not self._on_time_possible(req, now)
                placed = self._place(req, now)
                if placed is None:
                    break
                queue.popleft()
                view, how = placed
                self._apply(req, view, how, now)
                placements.append(Placement(req, view.instance_id, how))
        return placements

    def queue_length(self, tier: int) -> int:
        return len(self.queues[tier])

    def waiting_tiers(self) -> list[int]:
        return [k for k, q in enumerate(self.queues) if q]

    # ---- placement -------------------------------------------------------------------------------------------
    def _place(self, req: RoutedRequest, now: float) -> tuple[InstanceView, How] | None:
        if self.policy != "polyserve":
            view = self._baseline_choice()
            return None if view is None else (view, How.BASELINE)
        snap = req.snapshot(now if req.late else req.arrival)
        before_scale_up, after_scale_up = self._tier_orders[req.tier_index]
        return self._place_in(before_scale_up, req, snap, now) or self._scale_up(req, snap, now) \
            or self._place_in(after_scale_up, req, snap, now)

    def _place_in(self, tiers: tuple[int, ...], req: RoutedRequest, snap: RequestSnapshot,
                  now: float) -> tuple[InstanceView, How] | None:
        fits, tpots, members = self.checker.fits, self._tier_tpot_ms, self.fleet.members
        ready = InstanceStatus.READY
        for tier in tiers:
            tpot = tpots[tier]
            for view in sorted(members[tier], key=_load, reverse=self.gradient):
                if view.status is ready and fits(view.summary, view.kv_capacity_tokens, view.iteration_end, tpot,
                                                 snap, now):
                    return view, How.OWN if tier == req.tier_index else How.PROMOTED
        return None

    def _scale_up(self, req: RoutedRequest, snap: RequestSnapshot, now: float) -> tuple[InstanceView, How] | None:
        if self.autoscaler is not None and not self.autoscaler.can_join(self.fleet, req.tier_index):
            return None
        tpot = self._tier_tpot_ms[req.tier_index]
        for view in sorted(self.fleet.idle, key=lambda v: len(v.residents)):  # empty ones first
            if view.tightest_resident_tpot_ms() >= tpot and self.checker.fits(
                    view.summary, view.kv_capacity_tokens, view.iteration_end, tpot, snap, now):
                return view, How.SCALED_UP
        return None

    def _baseline_choice(self) -> InstanceView | None:
        serving = [v for v in self.fleet.instances.values() if v.status is InstanceStatus.READY]
        if not serving:
            return None
        if self.policy == "random":
            return self._rng.choice(serving)
        if self.policy == "round-robin":
            self._round_robin += 1
            return serving[self._round_robin % len(serving)]
        return min(serving, key=_load)

    def _on_time_possible(self, req: RoutedRequest, now: float) -> bool:
        """Could its first token still be on time on an idle instance starting now?"""
        capacity = max((v.kv_capacity_tokens for v in self.fleet.instances.values()), default=0)
        if not capacity:
            return True
        idle = InstanceState((), capacity, now, req.slo.tpot_ms)
        return self.checker.check(idle, req.snapshot(req.arrival), now).first_token_time \
            <= req.arrival + req.slo.ttft_ms / 1000.0

    def _apply(self, req: RoutedRequest, view: InstanceView, how: How, now: float) -> None:
        if how is How.SCALED_UP:
            self.fleet.idle.remove(view)
            self._join(view, req.tier_index, now)
        req.instance_id = view.instance_id
        req.num_computed_tokens = req.num_output_tokens = 0
        view.residents[req.request_id] = req
        view.summary.add(req)
        if req.tier_index == view.tier:
            view.num_own_tier += 1
        view.kv_tokens += req.num_prompt_tokens
        self._update_load(view)
        self.requests[req.request_id] = req
        self._log(now, how.value, req.request_id, view.instance_id, req.tier_index)

    def _join(self, view: InstanceView, tier: int, now: float) -> None:
        view.tier, view.since = tier, now
        view.num_own_tier = sum(1 for r in view.residents.values() if r.tier_index == tier)
        self.fleet.members[tier].append(view)

    def _unlabel(self, view: InstanceView) -> None:
        if view.tier is not None:
            self.fleet.members[view.tier].remove(view)
            view.tier = None
        elif view in self.fleet.idle:
            self.fleet.idle.remove(view)

    def _maybe_release(self, tier: int, now: float) -> None:
        members = self.fleet.members[tier]
        if not members or self.policy != "polyserve":
            return
        if self.autoscaler is not None and not self.autoscaler.can_release(self.fleet, tier):
            return
        view = min(members, key=_load)
        if view.num_own_tier == 0:
            self._unlabel(view)
            view.since = now
            self.fleet.idle.append(view)
            self._log(now, "released", None, view.instance_id, tier)

    def _refresh(self, view: InstanceView) -> None:
        """After residents' progress changed: their summary counted again here, off the path of the next
        placement, which then reads it as it is, and the prefill chunk its decodes leave at its tier's TPOT (a
        search of a dozen predictions, once its decodes' KV moved) found here too, where the scan would ask it."""
        summary = view.summary
        summary.rebuild(self.output_lengths)
        if view.tier is not None:
            summary.decode_chunk(self.model, self._tier_tpot_ms[view.tier] / 1000.0, self.max_prefill_chunk)
        view.kv_tokens = summary.kv_residents
        self._update_load(view)

    def _update_load(self, view: InstanceView) -> None:
        """Load: the predicted iteration of the instance's residents, every one decoding at its current context."""
        view.load = self.model.predict(0, len(view.residents), view.kv_tokens) if view.residents else 0.0

    def _retry_after(self, tier: int) -> float:
        """Seconds until a tier slot is likely free: one expected output at the tier's TPOT (at least 1 s)."""
        expected = self.output_lengths.mean(self.tiers[tier].name)
        return max(1.0, math.ceil(expected * self._tier_tpot_ms[tier] / 1000.0))

    def _log(self, now: float, kind: str, request_id: str | None, instance_id: str | None, tier: int | None) -> None:
        self.counts[kind] += 1
        self.events.append(Event(now, kind, request_id, instance_id, tier))


_load = attrgetter("load")


def _scan_orders(tier: int, promotion: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    own, tighter = (tier,), tuple(range(tier - 1, -1, -1))
    return {"lazy": (own, tighter), "before-scale-up": (own + tighter, ()), "none": (own, ()),
            "eager": (tighter + own, ())}[promotion]
