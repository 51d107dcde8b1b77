"""The fleet router: places requests on instances by SLO tier, as a pure policy object (DESIGN.md §2 for the
policy and scale-down).

Beside PolyServe ("polyserve"), baselines that ignore tiers (no tier labels, no scale-up, promotion or release):
"random", "round-robin", "least-loaded" and "lmetric" place at once on a serving instance; "least-loaded-admission"
places on the least-loaded instance that passes PolyServe's attainability test, and otherwise queues as PolyServe
does.

No clock, no sockets: every method takes `now` (seconds on a monotonic clock the caller keeps) and returns what it
decided, so the live service (cluster/service.py) and the fleet simulator drive the very same object. The caller
tells it what happened, it answers what to do:
  instances  add_instance, on_ready (-> placements of queued requests), start_draining, remove_instance,
             on_lost (-> the residents, unplaced, for the caller to readmit or end)
  requests   submit (-> Decision: placed, queued, queue full, refused for its cost, no instance), on_report (a
             step's progress),
             on_load (KV in use between steps), on_finished, withdraw, retry_queued (-> placements),
             take_migrations (-> residents to move, each with the instance to let go of it), moved (-> Decision)
  reading    fleet (cluster.fleet.Fleet), queue_length, waiting_tiers, events, counts
Submit assumes the request passed admission (`admissible`: an idle instance could meet its SLO at all); one whose
prompt is among its tier's costliest `costly_share` is refused (scheduler/costly.py), not placed, while the fleet is
under pressure (`under_pressure`: a request waited in a queue within the time a request placed now stays), and
refused rather than queued when it finds no place; up to what is left of its tier's whole allowance while a tighter
tier sheds. A request with companions (the other parallel samples of its
request) is placed with them, all on one instance, the test counting each; a stream resumed after its instance
was lost goes where its next token is predicted soonest. The test reads an instance through the resident summary the
router keeps current (InstanceView.summary), so a scan costs O(log n) per instance of n residents; a step report
pays the pass over them. A tier whose requests wait while it holds no instance and none is idle takes one from the
loosest tier that holds any (`_take_from_loosest`); one that holds some takes the least-loaded of a looser tier that
drains, that instance's residents of looser tiers moved onto their own tier's other instances (`_drain_into`).

Prefill/decode disaggregation (`set_role`): prefill instances form a pool of their own, outside the tiers. PolyServe
places a new request whole on a decode instance of its tier whose steps have time to spare (its KV bounds its batch
before its TPOT does: `_compute_spare`) where it attains; else on the prefill instance with the least queued prompt
work of those whose queue runs its prompt and the transfer of its KV by its first-token deadline
(`AttainabilityChecker.fits_prefill`); when none does, on a decode instance that serves a tier already, by the tier
rules, as a whole request that instance prefills itself ("convertible": a burst does not wait for the prefill pool
to grow), never on one scaled up from the idle pool for it nor on the least-loaded of a looser tier's several; else
it waits in its tier's queue. The hand-off (`hand_off`) is placed on decode instances by the tier rules, tested from
the moment its KV arrives with its next token due one TPOT after its first-token deadline. A prompt sent to prefill
holds its hand-off's place as a stand-in resident (`_reserve`); a decode instance's tests count its stand-ins only
beyond the places it is expected to free before they land (`_landing_after_departures`).
"""
from __future__ import annotations

import enum
import math
import random
from collections import Counter, deque
from dataclasses import dataclass
from itertools import islice
from operator import attrgetter
from typing import Callable, Iterable, Sequence

from cluster.autoscaler import Autoscaler, decode_seconds_per_token
from cluster.fleet import Fleet, InstanceStatus, InstanceView, RoutedRequest
from cluster.protocol import Resident
from engine.config import ROLES
from scheduler.attainability import Attainability, AttainabilityChecker
from scheduler.costly import CostlyShare, FleetPressure
from scheduler.instance_state import InstanceState, RequestSnapshot
from scheduler.headroom import DEFAULT_TARGET, Headroom, handed_off
from scheduler.latency_model import LatencyModel
from scheduler.online_fit import online_latency_model
from scheduler.output_length import OutputLengthTracker
from scheduler.tier_flow import TierFlow
from scheduler.tiers import TierSet
from scheduler.transfer import TransferModel
from scheduler.types import StepStats

# The most instances whose outcomes a margin takes at its full step: the largest tiers the step was measured on (those
# of 64-instance fleets) hold fewer; a tier of a few hundred at full step swings from misses to refusals and back
# (bench/RESULTS.md).
POOLED_AT_FULL_STEP = 32
# The weight of a new sample in the moving means of stand-ins' holds and of the gaps between a decode instance's
# departures: they follow a change within some fifty samples, and one long gap or hold moves them little.
MOVING_MEAN_WEIGHT = 0.02
POLICIES = ("polyserve", "random", "round-robin", "least-loaded", "least-loaded-admission", "lmetric")
PROMOTIONS = ("lazy", "before-scale-up", "none", "eager")


class Outcome(enum.Enum):
    PLACED = "placed"
    QUEUED = "queued"
    QUEUE_FULL = "queue_full"  # answer 429 with retry_after_s
    COSTLY = "costly"  # no place now, and among its tier's costliest (`CostlyShare`): answer 429 with retry_after_s
    NO_INSTANCE = "no_instance"  # none serving or starting, none can be started: answer 503


class How(enum.Enum):
    OWN = "own"  # an instance of its own tier
    PROMOTED = "promoted"  # an instance of a tighter tier
    DEMOTED = "demoted"  # an instance of a looser tier, held to this request's tier while it is there
    SCALED_UP = "scaled_up"  # an idle instance that joined its tier for it
    PREFILL = "prefill"  # a prefill instance, which hands it off at its first token
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
    kind: str  # a How value, "queued", "queue_full", "no_instance", "joined" (tier minimum), "released",
    # "retiered" (taken by a tighter tier that held none), "lost"
    request_id: str | None
    instance_id: str | None
    tier: int | None


@dataclass(slots=True, frozen=True)
class InstanceReport:
    iteration_end: float  # when the reported step ended, on the router's clock
    num_blocks_used: int
    residents: Iterable[Resident]  # each resident's progress after the step
    steps: Sequence[StepStats] = ()  # the steps measured since the instance's last report, oldest first


class Router:
    def __init__(self, tiers: TierSet, latency_model: LatencyModel, *, policy: str = "polyserve",
                 autoscaler: Autoscaler | None = None, queue_limit: int = 256, max_prefill_chunk: int = 2048,
                 expected_output_tokens: float = 128.0, seed: int = 0, event_log: int = 100_000,
                 gradient: bool = True, promotion: str = "lazy", shed_late: bool = True,
                 transfer: TransferModel | None = None, headroom_target: float = DEFAULT_TARGET,
                 demotion: bool = True, costly_share: float = 0.0, token_reserve: bool = False):
        """`latency_model` is where the router's predictions start: it refines them from the steps the instances
        report (`OnlineLatencyModel`), and holds each tier's instances to the tier's TPOT less a margin fed back
        from its requests' outcomes (`Headroom`), as each engine does for its chunks (DESIGN.md §2, learning under
        error). A second margin per tier, fed back from the first tokens of the requests it placed on time, asks a
        placement for the first token that share of the TTFT early: the queue of prefills that an instance packed to
        its deadlines runs behind a slow step would otherwise make them late together.

        `shed_late`: a queued request whose first token can no longer be on time is given up (`take_shed`, for
        the caller to answer) rather than served late: serving it would spend capacity that requests still on time
        need, and a fleet past its capacity would then miss them all. A request queued again after its instance
        was lost is served all the same. False serves every one, judged as if it arrived then.

        `gradient` and `promotion` are PolyServe's ablations: gradient=False tries a tier's least-loaded
        instance first instead of its busiest; promotion "before-scale-up" tries the tighter tiers before the idle
        pool (the paper's order, DESIGN.md §2), "none" never places on a tighter tier, "eager" tries the tighter
        tiers (nearest first) before the request's own.

        `demotion`: a request that fits on no instance of its own tier, the idle pool or a tighter tier goes on a
        looser tier's instance that attains it, nearest tier first and the least loaded first, rather than wait:
        that instance is then held to the request's tighter TPOT while it is there (the test reads every
        instance's pace from its tightest resident), which costs it batch for its own tier. Partitioning pays when
        a tier fills its instances; where it holds too few to absorb its bursts (a small fleet, a tier with a small
        share), its requests would queue beside room on looser instances that mixing would have used.
        `transfer`: how long a hand-off's KV takes from a prefill to a decode instance (None: no time), which the
        prefill placement reserves before the first-token deadline and the decode placement waits for.

        `headroom_target`: the share of requests each margin lets miss (`Headroom.target`): both margins of every
        tier, the TPOT one and the first-token one, settle where that share of their requests miss.

        `costly_share`: the share of each tier's requests that may be refused for their cost while the fleet is
        under pressure (`CostlyShare`, `under_pressure`): a new request whose prompt is among its tier's costliest
        that share is refused at once, placed nowhere, when a request waited in a queue within the time a request
        placed now is expected to stay, or when it would queue itself. While a tighter tier sheds, a tier refuses up
        to what it has left of its whole allowance, `costly_share` and `headroom_target` together, less the losses it
        measured (`CostlyShare.spare_share`). Zero refuses none for cost.

        `token_reserve`: each placement tells the request's engine to keep, before each of its tokens' deadlines, the
        share of its TPOT that is this router's margin of the tier the instance is held to then
        (`RoutedRequest.tpot_reserve`). An engine's own margin reserves a share of the time since arrival, little
        for the first tokens, and a greedy prefill budget spends the rest of a new resident's bank; the router's
        margin is what the tier's misses say a step needs. The reserve takes prefill from every step it trims, so
        it pays where misses are dear and capacity does not bind (a rule that lets few requests miss) and costs
        where a tenth of each tier may miss and capacity binds (bench/RESULTS.md)."""
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if promotion not in PROMOTIONS:
            raise ValueError(f"promotion must be one of {', '.join(PROMOTIONS)}, got {promotion!r}")
        self.gradient, self.promotion, self.shed_late = gradient, promotion, shed_late
        self.token_reserve = token_reserve
        self.shed: list[RoutedRequest] = []  # queued requests given up, for the caller to answer (`take_shed`)
        if queue_limit < 0:
            raise ValueError(f"queue_limit must be non-negative, got {queue_limit}")
        self.model = online_latency_model(latency_model, max_prefill_tokens=max_prefill_chunk)
        self.tiers, self.policy, self.autoscaler = tiers, policy, autoscaler
        self.queue_limit, self.max_prefill_chunk = queue_limit, max_prefill_chunk
        self.output_lengths = OutputLengthTracker(expected_output_tokens)
        self.checker = AttainabilityChecker(self.model, self.output_lengths, max_prefill_chunk)
        self.headroom = [Headroom(headroom_target) for _ in tiers]  # by the tier whose TPOT an instance is held to
        # by request tier: the share of TTFT planned
        self.first_token_headroom = [Headroom(headroom_target) for _ in tiers]
        self.costly = [CostlyShare(costly_share, headroom_target) for _ in tiers]
        self.pressure = FleetPressure()
        self._last_shed = [-math.inf] * len(tiers)  # per tier: when it last shed a request
        self.fleet = Fleet(len(tiers))
        # one queue per tier under every policy: "least-loaded-admission" ignores tiers in placement only, and
        # waiting as PolyServe's requests wait (the same bound per tier, retried soonest due first, each tier in
        # arrival order) keeps a comparison of the two about placement; a head that fits nowhere holds back its own
        # tier only, not every request behind it
        self.queues: list[deque[RoutedRequest]] = [deque() for _ in tiers]
        self.requests: dict[str, RoutedRequest] = {}  # placed or queued
        self.events: deque[Event] = deque(maxlen=event_log)
        self.counts: Counter[str] = Counter()  # totals of every event kind
        self._tier_tpot_ms = [t.tpot_ms for t in tiers]
        # per tier: the tiers to scan before the idle pool, and after it (tighter ones nearest first)
        self._tier_orders = [_scan_orders(k, len(tiers), promotion, demotion) for k in range(len(tiers))]
        self._rng = random.Random(seed)
        self._round_robin = 0
        # prefill/decode disaggregation: the instances of role prefill or decode (the rest do both), and the
        # requests whose prompt a prefill instance ran, to be placed on a decode instance
        self.roles: dict[str, str] = {}
        self.handoffs: set[str] = set()
        # a request on a prefill instance, by the decode instance its hand-off was promised: a stand-in there (its
        # prompt computed, its first token out) counts it in that instance's batch and KV until it hands off
        self.reserved: dict[str, InstanceView] = {}
        self.hold_s = 0.0  # the moving mean of how long a stand-in holds its place (0 until one gave way)
        self.transfer = transfer
        # moving a draining tier's residents (`_drain_into`): each tier's arrivals and completions; the residents
        # chosen to leave their instance, by that instance, their new place held (`_reserve`) until the caller
        # says they left it (`moved`); the moves not yet taken by the caller; hand-offs of moved requests not yet
        # placed; when each waiting tier last looked for a drain
        self.flows = [TierFlow() for _ in tiers]
        self.leaving: dict[str, str] = {}
        self.migrations: list[tuple[str, str]] = []
        self.moving: set[str] = set()
        self._last_drain = [-math.inf] * len(tiers)

    # ---- instances -------------------------------------------------------------------------------------------
    def add_instance(self, instance_id: str, now: float) -> None:
        if instance_id in self.fleet.instances and self.fleet.instances[instance_id].status is not InstanceStatus.DEAD:
            raise ValueError(f"instance {instance_id!r} is already in the fleet")
        self.fleet.instances[instance_id] = InstanceView(instance_id, InstanceStatus.STARTING, now,
                                                            self.output_lengths, iteration_end=now)

    def set_role(self, instance_id: str, role: str) -> None:
        """An instance's engine role: "prefill" ones take new requests and hand them off at their first token,
        "decode" ones take only those hand-offs (`hand_off`), "both" (the default) new requests whole."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if role == "both":
            self.roles.pop(instance_id, None)
        else:
            self.roles[instance_id] = role
        view = self.fleet.instances.get(instance_id)
        if view is not None and view.status is InstanceStatus.READY and (view in self.fleet.prefill) != (
                role == "prefill"):
            self._unlabel(view)
            self._pool(view, now=view.since)

    def on_ready(self, instance_id: str, kv_capacity_tokens: int, now: float, block_size: int = 1) -> list[Placement]:
        """`instance_id` serves, with KV for `kv_capacity_tokens` tokens in blocks of `block_size`."""
        view = self.fleet[instance_id]
        if view.status is not InstanceStatus.STARTING:
            raise ValueError(f"instance {instance_id!r} is {view.status.value}, not starting")
        if kv_capacity_tokens < 1:
            raise ValueError(f"kv_capacity_tokens must be positive, got {kv_capacity_tokens}")
        if not 1 <= block_size <= kv_capacity_tokens:
            raise ValueError(f"block_size must lie in [1, kv_capacity_tokens], got {block_size}")
        view.status, view.since, view.kv_capacity_tokens, view.block_size, view.iteration_end = \
            InstanceStatus.READY, now, kv_capacity_tokens, block_size, now
        self._pool(view, now)
        return self.retry_queued(now)

    def _pool(self, view: InstanceView, now: float) -> None:
        """A serving instance with no place yet: the prefill pool, a tier under its minimum, or the idle pool."""
        if self.roles.get(view.instance_id) == "prefill":
            self.fleet.prefill.append(view)
            return
        tier = self.autoscaler.tier_below_minimum(self.fleet) if self.autoscaler is not None else None
        if tier is not None and self.policy == "polyserve":
            self._join(view, tier, now)
            self._log(now, "joined", None, view.instance_id, tier)
        else:
            self.fleet.idle.append(view)

    def start_draining(self, instance_id: str, now: float) -> None:
        view = self.fleet[instance_id]
        self._unlabel(view)
        view.status, view.since = InstanceStatus.DRAINING, now

    def remove_instance(self, instance_id: str, now: float) -> None:
        view = self.fleet.instances.pop(instance_id, None)
        self.roles.pop(instance_id, None)
        if view is None:
            return
        self._unlabel(view)
        for req in self._leaving(view, now):
            self.requests.pop(req.request_id, None)
            self.handoffs.discard(req.request_id)

    def on_lost(self, instance_id: str, now: float) -> list[RoutedRequest]:
        view = self.fleet[instance_id]
        self._unlabel(view)
        view.status, view.since = InstanceStatus.DEAD, now
        lost = self._leaving(view, now)
        for req in lost:
            req.instance_id = None
            req.num_computed_tokens = 0
            del self.requests[req.request_id]
            self.handoffs.discard(req.request_id)
        view.residents.clear()
        view.stand_ins.clear()
        view.residents_per_tier.clear()
        view.kv_tokens = 0
        view.summary.rebuild()
        self._log(now, "lost", None, instance_id, None)
        return lost

    def _leaving(self, view: InstanceView, now: float) -> list[RoutedRequest]:
        """The requests of an instance that goes away, each one's decode place given back; its stand-ins are not
        among them (their requests run on prefill instances), their places forgotten."""
        leaving = []
        for req in view.residents.values():
            if self.reserved.get(req.request_id) is view:
                del self.reserved[req.request_id], view.stand_ins[req.request_id]
            else:
                leaving.append(req)
                self.leaving.pop(req.request_id, None)
                self._unreserve(req.request_id, now)
        return leaving

    # ---- requests --------------------------------------------------------------------------------------------
    def admissible(self, request: RequestSnapshot) -> Attainability | None:
        """Could an idle instance attain `request` at all? None while no instance has said how large its KV is."""
        capacity = max((v.kv_capacity_tokens for v in self.fleet.instances.values()), default=0)
        return self.checker.check_idle(request, capacity) if capacity else None

    def submit(self, req: RoutedRequest, now: float, readmit: bool = False) -> Decision:
        """Place, queue or refuse. `readmit`: an accepted request placed again (its instance was lost): it waits
        at the head of its queue, past the queue's bound."""
        if not readmit:
            for r in (req, *req.companions):
                if r.request_id in self.requests:
                    raise ValueError(f"request {r.request_id!r} is already placed or queued")
            self.costly[req.tier_index].arrived(req.num_prompt_tokens)
            self.flows[req.tier_index].arrived(now)
        if readmit and not req.late:
            # a resumed stream's first token from here is not its first: it has no TTFT of its own to keep
            req.late = req.resumed_tokens > 0 or not self._on_time_possible(req, now)
        if any(self.queues):
            self.pressure.waited(now)
        spare = not readmit and self._tighter_shedding(req.tier_index, now)
        if not readmit and self.under_pressure(now) and self.costly[req.tier_index].refuse(spare):
            self._log(now, "costly", req.request_id, None, req.tier_index)
            return Decision(Outcome.COSTLY, retry_after_s=self.retry_after(req.tier_index))
        placed = self._place(req, now)
        if placed is not None:
            view, how, decode = placed
            self._apply(req, view, how, now, decode)
            return Decision(Outcome.PLACED, view.instance_id, how)
        fleet = self.fleet
        if not any(v.status in (InstanceStatus.READY, InstanceStatus.STARTING) for v in fleet.instances.values()) \
                and (self.autoscaler is None or not self.autoscaler.can_start):
            self._log(now, "no_instance", req.request_id, None, req.tier_index)
            return Decision(Outcome.NO_INSTANCE)
        queue = self.queues[req.tier_index]
        if not readmit and self.costly[req.tier_index].refuse(spare):
            self._log(now, "costly", req.request_id, None, req.tier_index)
            return Decision(Outcome.COSTLY, retry_after_s=self.retry_after(req.tier_index))
        if not readmit and len(queue) >= self.queue_limit:
            self.costly[req.tier_index].lost()
            self._log(now, "queue_full", req.request_id, None, req.tier_index)
            return Decision(Outcome.QUEUE_FULL, retry_after_s=self.retry_after(req.tier_index))
        self.pressure.waited(now)
        if readmit:
            queue.appendleft(req)  # it has waited longest of all
        else:
            queue.append(req)
        self.requests[req.request_id] = req
        self._log(now, "queued", req.request_id, None, req.tier_index)
        return Decision(Outcome.QUEUED)

    def under_pressure(self, now: float) -> bool:
        """Is the fleet at its capacity (`FleetPressure`: a request waited in a queue within the time a request
        placed now is expected to stay, the longest of the tiers')? Then a costly request served takes the place
        of cheaper ones."""
        return self.pressure.on(now, max(map(self._expected_stay_s, range(len(self.tiers)))))

    def _tighter_shedding(self, tier: int, now: float) -> bool:
        """Did a tier tighter than `tier` shed a request within the time one of `tier` placed now would stay? Then
        `tier` may refuse for cost what it has left of its allowance (`CostlyShare.refuse`)."""
        return now - max(self._last_shed[:tier], default=-math.inf) < self._expected_stay_s(tier)

    def hand_off(self, req: RoutedRequest, now: float, *, retry: bool = False, num_output_tokens: int = 1) -> Decision:
        """A request a prefill instance ran to its first token, or one that left its instance to be moved with
        `num_output_tokens` out (`moved`), to be placed with its KV imported (left already: `on_finished`):
        placed, queued at the head of its queue, or refused as `submit` readmits a request. Its KV joins the
        autoscaler's transfer byte rate once: a `retry`, the same hand-off placed anew after an instance refused or
        failed its import, adds nothing."""
        if num_output_tokens < 1:
            raise ValueError(f"a hand-off has its first token out, got {num_output_tokens} output tokens")
        tokens = req.num_prompt_tokens + num_output_tokens - 1  # the KV it brings: its last token is computed there
        if not retry and self.autoscaler is not None and self.transfer is not None:
            self.autoscaler.transfer_bytes.add(now, tokens * self.transfer.bytes_per_token)
        self.handoffs.add(req.request_id)
        req.num_computed_tokens, req.num_output_tokens = tokens, num_output_tokens
        decision = self.submit(req, now, readmit=True)
        if decision.outcome is Outcome.NO_INSTANCE:
            self.handoffs.discard(req.request_id)
        return decision

    def moved(self, request_id: str, num_output_tokens: int, now: float) -> Decision:
        """A resident the router chose to move (`take_migrations`) left its instance with `num_output_tokens` out,
        its KV held there for the pull: placed as a hand-off, its own tier's instances tried first (where its new
        place was held), then as any hand-off. KeyError for a request the router did not choose to move."""
        if request_id not in self.leaving:
            raise KeyError(f"request {request_id!r} was not chosen to move")
        req = self.requests[request_id]
        self.on_finished(request_id, num_output_tokens, now, completed=False)
        self.moving.add(request_id)
        decision = self.hand_off(req, now, num_output_tokens=num_output_tokens)
        if decision.outcome is not Outcome.QUEUED:
            self.moving.discard(request_id)
        return decision

    def take_migrations(self) -> list[tuple[str, str]]:
        """The residents chosen to move since the last call, each with the instance it leaves: the caller has that
        instance let go of it between steps, its KV held for the pull, and then says so (`moved`)."""
        migrations, self.migrations = self.migrations, []
        return migrations

    def on_report(self, instance_id: str, report: InstanceReport, now: float) -> None:
        if self.autoscaler is not None and self.roles.get(instance_id) == "decode":
            self.autoscaler.decode_tokens.add(now, sum(step.num_decode_seqs for step in report.steps))
        view = self.fleet.instances.get(instance_id)
        if view is None or view.status is InstanceStatus.DEAD:
            return
        for step in report.steps:
            self.model.observe(step)
        residents, end = view.residents, report.iteration_end
        # of the tier the instance is held to, the same for each of its residents, and an outcome's weight there
        headroom, weight = None, 1.0
        for r in report.residents:
            req = residents.get(r.request_id)
            if req is not None:
                out = r.num_output_tokens
                if out > req.num_output_tokens:  # its newest token came out as the step ended
                    if req.num_output_tokens == 0 and not req.late:
                        first_token, first_weight = (self.first_token_headroom[req.tier_index],
                                                     self._pooled(req.tier_index))
                        if end > req.first_token_due:
                            first_token.missed(first_weight)
                        else:
                            first_token.attained(first_weight)
                    if headroom is None:
                        held = self._held_tier(view)
                        headroom, weight = self.headroom[held], self._pooled(held)
                    standing = headroom.note_token(req.standing, req.num_output_tokens == 0,
                                                   end > req.first_token_due + (out - 1) * req.tpot_s, weight)
                    if standing != req.standing:  # late, for the first time
                        self.costly[req.tier_index].lost()
                    req.standing = standing
                req.num_output_tokens = out
                req.num_computed_tokens = min(r.num_computed_tokens, req.num_prompt_tokens + out)
        view.num_blocks_used = report.num_blocks_used
        self._refresh(view)
        view.iteration_end = report.iteration_end + view.load  # the next step started as the reported one ended

    def on_load(self, instance_id: str, num_blocks_used: int) -> None:
        """What an instance holds as it said between steps (an abort or a finish that no step followed, or its
        periodic word while idle): the KV blocks in use, so that an idle instance does not keep its last busy
        step's figure."""
        view = self.fleet.instances.get(instance_id)
        if view is not None and view.status is not InstanceStatus.DEAD:
            view.num_blocks_used = num_blocks_used

    def on_finished(self, request_id: str, num_output_tokens: int, now: float, completed: bool = True) -> None:
        """Left its instance (finished, aborted, failed); a `completed` one's output joins its tier's mean."""
        req = self.requests.pop(request_id, None)
        self.handoffs.discard(request_id)
        self.moving.discard(request_id)
        self.leaving.pop(request_id, None)
        self._unreserve(request_id, now)
        if req is None:
            return
        if completed:
            self.flows[req.tier_index].completed(now)
        view = self.fleet.instances.get(req.instance_id) if req.instance_id is not None else None
        if completed:
            self.output_lengths.observe(req.tier, num_output_tokens)
            if view is not None:
                held = self._held_to(view, req)
                self.headroom[held].note_finished(req.standing, self._pooled(held))
        if view is not None:
            self._unseat(view, req, now)

    def withdraw(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.instance_id is not None:
            return False
        self.queues[req.tier_index].remove(req)
        del self.requests[request_id]
        self.handoffs.discard(request_id)
        self.moving.discard(request_id)
        return True

    def retry_queued(self, now: float) -> list[Placement]:
        """Heads of the queues, the one due soonest (its first token, a hand-off's next) first, each queue in order
        until its head fits nowhere. Not the tightest tier first: where the tiers share the room that frees (a
        decode pool of one or two instances), a looser tier's head would wait behind every tighter arrival until its
        own deadline passed, though its slack was the longer. A late head is due as the placement test dates it
        (`_as_placed`: from now)."""
        placements = []
        due: dict[int, float] = {}  # by tier, its head's; a head's depends on it and `now` alone, not on placements
        for tier in range(len(self.queues)):
            self._date_head(tier, now, due)
        while due:
            tier = min(due, key=lambda k: (due[k], k))
            req = self.queues[tier][0]
            placed = self._place(req, now)
            if placed is None and self._take_from_loosest(tier, now):
                placed = self._place(req, now)
            if placed is None:
                self._drain_into(tier, now)
                del due[tier]  # fits nowhere now
                continue
            self.queues[tier].popleft()
            view, how, decode = placed
            self._apply(req, view, how, now, decode)
            placements.append(Placement(req, view.instance_id, how))
            self._date_head(tier, now, due)
        return placements

    def _date_head(self, tier: int, now: float, due: dict[int, float]) -> None:
        """Sets `due[tier]` to when `tier`'s head is due as placed now, or drops it where the queue is empty."""
        req = self._queue_head(tier, now)
        if req is None:
            due.pop(tier, None)
        else:
            due[tier] = self._as_placed(req, now, req.late)[0].first_token_due

    def _queue_head(self, tier: int, now: float) -> RoutedRequest | None:
        """The head of `tier`'s queue, marked late once its first token can no longer be on time; with `shed_late`,
        such heads never placed before are given up first."""
        queue = self.queues[tier]
        while queue:
            req = queue[0]
            if not req.late:
                req.late = not self._on_time_possible(req, now)
                if req.late and self.shed_late and not req.placed_before:
                    queue.popleft()
                    del self.requests[req.request_id]
                    self.shed.append(req)
                    self._last_shed[tier] = now
                    self.costly[tier].lost()
                    self._log(now, "shed", req.request_id, None, tier)
                    continue
            return req
        return None

    def take_shed(self) -> list[RoutedRequest]:
        """The queued requests given up since the last call: their first token could no longer be on time."""
        shed, self.shed = self.shed, []
        return shed

    def queue_length(self, tier: int) -> int:
        return len(self.queues[tier])

    def waiting_tiers(self) -> list[int]:
        return [k for k, q in enumerate(self.queues) if q]

    # ---- placement -------------------------------------------------------------------------------------------
    def _place(self, req: RoutedRequest,
               now: float) -> tuple[InstanceView, How, tuple[InstanceView, How] | None] | None:
        """Where `req` goes and how, and for a prompt sent to a prefill instance, the decode instance its hand-off
        is promised (`_reserve`)."""
        if self.policy not in ("polyserve", "least-loaded-admission"):
            view = self._baseline_choice(req)
            return None if view is None else (view, How.BASELINE, None)
        snap, now = self._as_placed(req, now, req.late)
        early = self._early_s(req)
        if self.policy == "least-loaded-admission":
            view = self._least_loaded_attaining(req, snap, early, now)
            return None if view is None else (view, How.BASELINE, None)
        if req.request_id in self.moving:
            placed = self._place_in((req.tier_index,), req, snap, early, now)
            if placed is not None:
                return (*placed, None)
        if self.fleet.prefill and req.request_id not in self.handoffs:
            if not req.resumed_tokens:
                # whole where its tier's steps have time to spare: the prompt runs in that time, and the prefill
                # pool's goes to the tiers whose decodes use all of theirs (its hand-off would most often come to
                # such an instance anyway)
                placed = self._place_in((req.tier_index,), req, snap, early, now, where=self._compute_spare)
                if placed is not None:
                    return (*placed, None)
            # to the prefill pool with a place for its hand-off (none yet while no decode instance serves); else
            # (a burst, a pool still growing, a transfer too slow) whole on a decode instance whose tier test passes
            # with the prompt's chunks among its decodes
            decode = self._decode_place(req, early, now)
            if decode is not None or not self._decode_pool_serves():
                placed = self._least_queued_prefill(req, snap, early, now)
                if placed is not None:
                    return (*placed, decode)
            if not req.resumed_tokens:
                placed = self._convertible(req, snap, early, now)
                return None if placed is None else (*placed, None)
        placed = self._soonest_next_token(req, snap, early, now) if req.resumed_tokens else \
            self._place_in_order(req, snap, early, now)
        return None if placed is None else (*placed, None)

    def _place_in_order(self, req: RoutedRequest, snap: RequestSnapshot, early: float,
                        now: float) -> tuple[InstanceView, How] | None:
        """The first instance that attains `req` in its tier's scan order: its own tier's and the tighter ones'
        before the idle pool, then the rest (`_scan_orders`)."""
        before_scale_up, after_scale_up = self._tier_orders[req.tier_index]
        return self._place_in(before_scale_up, req, snap, early, now) or self._scale_up(req, snap, early, now) \
            or self._place_in(after_scale_up, req, snap, early, now)

    def _convertible(self, req: RoutedRequest, snap: RequestSnapshot, early: float,
                     now: float) -> tuple[InstanceView, How] | None:
        """A new request the prefill pool cannot take in time: whole on a decode instance that serves a tier
        already, in its tier's scan order without the idle pool, and on a looser tier's (demoted) never the
        least-loaded of several. Not on one scaled up for it: the tier it joined would be sized by a burst of
        prompts, each such instance prefilling one at its tier's small chunk, and under load a tier keeps what it
        took (its instances fill with promoted requests and none drains to be released), while the tiers that need
        the decode pool for hand-offs find it empty. Not on a looser tier's least-loaded instance: once the tier's
        busier ones are packed its own requests go there, and the prompt would hold it to the tighter TPOT for its
        stay, so the tier stops growing just as it needs to."""
        own = req.tier_index
        before_scale_up, after_scale_up = self._tier_orders[own]
        return self._place_in(before_scale_up, req, snap, early, now) or \
            self._place_in(after_scale_up, req, snap, early, now, spare_growing=True)

    def _compute_spare(self, view: InstanceView, budget_ms: float) -> bool:
        """Would `view`'s batch, grown at its residents' mean context until its KV is full, still step within
        `budget_ms`? Then its KV bounds its batch and its steps have time to spare (a loose tier's long contexts);
        unknown (False) while it holds no request."""
        if not view.residents or not view.kv_tokens:
            return False
        full = view.kv_capacity_tokens
        batch = max(1, len(view.residents) * full // view.kv_tokens)
        return self.model.predict(0, batch, full) * 1000.0 <= budget_ms

    def _decode_pool_serves(self) -> bool:
        ready = InstanceStatus.READY
        return any(self.roles.get(v.instance_id) == "decode" and v.status is ready
                   for v in self.fleet.instances.values())

    def _decode_place(self, req: RoutedRequest, early: float, now: float) -> tuple[InstanceView, How] | None:
        """The instance that would take `req`'s hand-off were its prompt done now, as `hand_off` places it. A
        prompt goes to the prefill pool only with such a place, which it then holds (`_reserve`): else a prefill
        pool that keeps pace with the arrivals hands the decode pool more than it holds, and the hand-offs wait for
        room past their next token's deadline, every tier's together, where a request held back here waits in its
        queue and is given up alone once its first token can no longer be on time."""
        arrives = now + self._transfer_s(req)  # dated as `_as_placed` dates a hand-off
        snap = RequestSnapshot(arrives if req.late else req.arrival + req.tpot_s, req.num_prompt_tokens,
                               req.max_tokens, req.slo, req.tier, req.num_prompt_tokens, 1)
        return self._place_in_order(req, snap, early, arrives)

    def _as_placed(self, req: RoutedRequest, now: float, late: bool) -> tuple[RequestSnapshot, float]:
        """`req` as the test sees it, and the time its placement starts from: a `late` request dated then; a
        hand-off from when its KV arrives, its next token (the one the test calls first) due as its cumulative
        deadline has it, one TPOT after its first token's deadline for each token out."""
        if req.request_id not in self.handoffs:
            return req.snapshot(now if late else req.arrival), now
        return self._as_handed_off(req, now, late)

    def _as_handed_off(self, req: RoutedRequest, now: float, late: bool) -> tuple[RequestSnapshot, float]:
        """`_as_placed` of `req` as a hand-off (its KV moving now), whether or not it is one yet."""
        arrives = now + self._transfer_s(req)
        return req.snapshot(arrives if late else req.arrival + req.num_output_tokens * req.tpot_s), arrives

    def _early_s(self, req: RoutedRequest) -> float:
        """How early its placement plans its first token: its tier's first-token margin of its TTFT."""
        return self.first_token_headroom[req.tier_index].margin * req.slo.ttft_ms / 1000.0

    @property
    def prefill_seconds_per_token(self) -> float:
        """A prompt token's predicted time on a prefill instance, in whole chunks (the autoscaler's prefill sizing)."""
        return self.checker.prefill_seconds(self.max_prefill_chunk) / self.max_prefill_chunk

    @property
    def decode_seconds_per_token(self) -> float:
        """A decoded token's predicted share of a decode instance's step at the largest batch its tier's TPOT (less
        its headroom) and its KV allow, at the decode residents' mean context, the tiers weighted by their residents
        (the autoscaler's decode sizing); 0 while no decode instance holds a request."""
        held: Counter[int] = Counter()  # residents by the tier whose TPOT their instance is held to
        kv_tokens = capacity = 0
        for view in self.fleet.instances.values():
            if view.residents and self.roles.get(view.instance_id) == "decode":
                held[view.tier if view.tier is not None else min(view.residents_per_tier)] += len(view.residents)
                kv_tokens += view.kv_tokens
                capacity = max(capacity, view.kv_capacity_tokens)
        residents = sum(held.values())
        if not residents:
            return 0.0
        context = max(1, kv_tokens // residents)
        return sum(n * decode_seconds_per_token(self.model, self._budget_ms(tier) / 1000.0, context,
                                                max(1, capacity // context)) for tier, n in held.items()) / residents

    def _transfer_s(self, req: RoutedRequest) -> float:
        """Its KV's time on the link: its prompt's, and for a resident that moves, its output's but the last
        token."""
        if self.transfer is None:
            return 0.0
        return self.transfer.seconds(req.num_prompt_tokens + max(0, req.num_output_tokens - 1))

    def _least_queued_prefill(self, req: RoutedRequest, snap: RequestSnapshot, early: float,
                              now: float) -> tuple[InstanceView, How] | None:
        """The prefill instance with the least queued work of those whose queue attains `req`'s first token and
        transfer. Not the busiest, as in a tier: a prompt gains nothing from company (a chunk fills the GPU alone),
        so packing a queue to its deadlines only makes its prompts late together under a slow step, and leaves no
        room for a tighter tier's; the prefill pool is sized from its token rate instead."""
        ready = InstanceStatus.READY
        for view in sorted(self.fleet.prefill, key=_load):
            if view.status is ready and self._fits(view, 0.0, req, snap, now, early):
                return view, How.PREFILL
        return None

    def _place_in(self, tiers: tuple[int, ...], req: RoutedRequest, snap: RequestSnapshot, early: float,
                  now: float, spare_growing: bool = False,
                  where: Callable[[InstanceView, float], bool] | None = None) -> tuple[InstanceView, How] | None:
        """The first instance of `tiers` (scanned in order) that attains `req`; `spare_growing`: never a looser
        tier's least-loaded instance while it has others (see `_convertible`); `where(view, its TPOT budget in ms)`:
        only instances it holds true of."""
        fits, members, own = self._fits, self.fleet.members, req.tier_index
        ready = InstanceStatus.READY
        for tier in tiers:
            if tier != own and self._withholds(tier, req):
                continue
            how = How.OWN if tier == own else How.PROMOTED if tier < own else How.DEMOTED
            # demoted: the least loaded first, whose batch the request's tighter pace cuts least
            views = sorted(members[tier], key=_load, reverse=self.gradient and how is not How.DEMOTED)
            if spare_growing and how is How.DEMOTED and len(views) > 1:
                views = views[1:]
            for view in views:
                if view.status is not ready:
                    continue
                budget = self._budget_ms(self._held_tier(view, own))
                if (where is None or where(view, budget)) and fits(view, budget, req, snap, now, early):
                    return view, how
        return None

    def _scale_up(self, req: RoutedRequest, snap: RequestSnapshot, early: float,
                  now: float) -> tuple[InstanceView, How] | None:
        if self.autoscaler is not None and not self.autoscaler.can_join(self.fleet, req.tier_index):
            return None
        tpot, budget = self._tier_tpot_ms[req.tier_index], self._budget_ms(req.tier_index)
        for view in sorted(self.fleet.idle, key=lambda v: len(v.residents)):  # empty ones first
            if view.tightest_resident_tpot_ms() >= tpot and self._fits(view, budget, req, snap, now, early):
                return view, How.SCALED_UP
        return None

    def _soonest_next_token(self, req: RoutedRequest, snap: RequestSnapshot, early: float,
                            now: float) -> tuple[InstanceView, How] | None:
        """A resumed stream: of the instances it may go on (its tier's, the idle pool's, the tighter tiers' under
        the promotion rule), those that attain it, and of these the one where the test predicts its next token
        soonest (the first in scan order on a tie).

        Not the busiest, as for a new request: its client has waited since its instance was lost, so the delay is
        what counts, and the gradient's gain (a last instance that drains and can be released) is small beside
        it. The streams of a lost instance come back together, and packed onto the busiest that attains them,
        each judged against a whole TTFT from now, they would re-prefill one behind the other; here each placement
        is in its instance's state before the next stream is placed, so the next sees its prefill ahead of its own
        and goes elsewhere when that comes sooner: they spread, and re-prefill side by side."""
        own = req.tier_index
        before_scale_up, after_scale_up = self._tier_orders[own]
        candidates = self._members_of(before_scale_up, req)  # (view, how, budget ms)
        if self.autoscaler is None or self.autoscaler.can_join(self.fleet, own):
            tpot, budget = self._tier_tpot_ms[own], self._budget_ms(own)
            candidates += [(v, How.SCALED_UP, budget) for v in self.fleet.idle if v.tightest_resident_tpot_ms() >= tpot]
        candidates += self._members_of(after_scale_up, req)
        best = None
        for view, how, budget in candidates:
            if view.status is not InstanceStatus.READY or not self._fits(view, budget, req, snap, now, early):
                continue
            first = self.checker.first_token_time(view.summary, view.iteration_end, budget, snap, now)
            if best is None or first < best[0]:
                best = (first, view, how)
        return None if best is None else best[1:]

    def _members_of(self, tiers: tuple[int, ...], req: RoutedRequest) -> list[tuple[InstanceView, How, float]]:
        """The instances of `tiers` that `req` may go on (as `_place_in` scans them), each with how it would go
        there and the TPOT budget it would be held to."""
        out, own = [], req.tier_index
        for tier in tiers:
            if tier == own or not self._withholds(tier, req):
                how = How.OWN if tier == own else How.PROMOTED if tier < own else How.DEMOTED
                out += [(view, how, self._budget_ms(self._held_tier(view, own))) for view in self.fleet.members[tier]]
        return out

    def _withholds(self, tier: int, req: RoutedRequest) -> bool:
        """Does `tier` keep its instances from `req`, a request of another tier? It lends none while its own
        requests wait for room; but to a hand-off, only while a hand-off heads its queue (requests placed again wait
        at the front): a hand-off's prompt is computed and its next token due a TPOT after its first, so it goes
        before the prompts a tier's queue holds for the prefill pool or a place of their own."""
        queue = self.queues[tier]
        return bool(queue) and (req.request_id not in self.handoffs or queue[0].request_id in self.handoffs)

    def _least_loaded_attaining(self, req: RoutedRequest, snap: RequestSnapshot, early: float,
                                now: float) -> InstanceView | None:
        """The least-loaded serving instance that can attain `req` (instance order on a tie). Each is held to the
        TPOT of the tightest tier among its residents and `req`, as PolyServe holds an instance to its tier's TPOT
        (a tier's residents being of that tier or looser ones promoted onto it)."""
        fits, own = self._fits, req.tier_index
        ready = InstanceStatus.READY
        for view in sorted((v for v in self.fleet.instances.values() if v.status is ready), key=_load):
            if fits(view, self._budget_ms(self._held_tier(view, own)), req, snap, now, early):
                return view
        return None

    def _fits(self, view: InstanceView, budget_ms: float, req: RoutedRequest, snap: RequestSnapshot, now: float,
              early: float) -> bool:
        """The attainability test of `req` (as `snap`) on `view` held to `budget_ms`; its companions, if any,
        counted in as residents (seated for the test, then taken out again), each one more sequence in the batch
        and its own KV. An instance whose role does not take the request's stage fits it not; a prefill instance
        is tested by its own rule, whatever the budget. First of all its KV must have room for the prompt now
        (`_has_room`). A decode instance's latest stand-ins, as many as it is expected to let requests go while one
        holds its place (`_landing_after_departures`), are left out of it."""
        left_out = self._landing_after_departures(view, req) if view.stand_ins else ()
        for stand_in in left_out:
            del view.residents[stand_in.request_id]
            view.summary.remove(stand_in)
            view.kv_tokens -= stand_in.num_prompt_tokens + stand_in.num_output_tokens
        try:
            return self._fits_as_seated(view, budget_ms, req, snap, now, early)
        finally:
            for stand_in in left_out:
                view.residents[stand_in.request_id] = stand_in
                view.summary.add(stand_in)
                view.kv_tokens += stand_in.num_prompt_tokens + stand_in.num_output_tokens

    def _landing_after_departures(self, view: InstanceView, req: RoutedRequest) -> list[RoutedRequest]:
        """The stand-ins of decode instance `view` a test of `req` there leaves out: its latest but `req`'s own, as
        many as the instants it is expected to let a request go (a resident finishing or a stand-in giving way) while
        a stand-in holds its place: the fleet's mean hold over its mean gap between such instants. A stand-in counts
        from when its prompt is placed and a resident until it leaves, so in steady state, where the stand-ins land
        about as fast as the residents leave, counting both from now counts that room twice; most where prompts are
        long beside the outputs (a hold a good part of a stay). Each instant frees at least one place."""
        if not view.unseat_gap_s or self.roles.get(view.instance_id) != "decode":
            return []
        count = int(self.hold_s / view.unseat_gap_s)
        latest = islice((rid for rid in reversed(view.stand_ins) if rid != req.request_id), count)
        return [view.residents[rid] for rid in latest]

    def _fits_as_seated(self, view: InstanceView, budget_ms: float, req: RoutedRequest, snap: RequestSnapshot,
                        now: float, early: float) -> bool:
        """`_fits` on `view`'s residents as they are."""
        if not self._has_room(view, req):
            return False
        if self.roles:
            if not self._serves(view, req):
                return False
            if self.roles.get(view.instance_id) == "prefill":
                return self.checker.fits_prefill(view.summary, view.kv_capacity_tokens, view.iteration_end, snap,
                                                 now, early, self._transfer_s(req))
        for sample in req.companions:
            self._seat(view, sample)
        try:
            return self.checker.fits(view.summary, view.kv_capacity_tokens, view.iteration_end, budget_ms, snap,
                                     now, early)
        finally:
            for sample in req.companions:
                del view.residents[sample.request_id]
                view.summary.remove(sample)

    @staticmethod
    def _has_room(view: InstanceView, req: RoutedRequest) -> bool:
        """The blocks of `req`'s prompt free on `view` now, beside a block of growth for each resident (what an
        engine keeps free before it takes a prompt: scheduler/polyserve.py): the attainability test counts KV in
        tokens and at its steady state, so on an instance of many residents it misses their blocks' last partial
        block (up to one each) and the long outputs past their tier's mean that fill the pool now. The blocks held
        are the larger of the instance's last report (it counts what the router does not see: a handed-off
        prompt's KV held until pulled) and the router's own count of its residents (each one's context, plus a
        partial block)."""
        size = view.block_size
        residents = len(view.residents)
        held = max(view.num_blocks_used, -(-view.kv_tokens // size) + residents)
        return held + residents + -(-req.num_prompt_tokens // size) <= view.kv_capacity_tokens // size

    def _baseline_choice(self, req: RoutedRequest) -> InstanceView | None:
        """The instance a baseline that places at once picks (None while none serves).

        "lmetric": LMetric (Zhang et al., "LMetric: Simple is Better - Multiplication May Be All You Need for LLM
        Request Scheduling", arXiv 2603.15202) scores an instance by the product of two indicators, the new prefill
        tokens if the request is routed to it (KV-cache aware) and its current batch size (load balancing aware),
        and takes the lowest. Here the first is the request's prompt, none of which the router can know to be cached
        (it sees no prompt contents), and the batch size the instance's residents; ties go to the lower load, then
        instance order."""
        serving = [v for v in self.fleet.instances.values()
                   if v.status is InstanceStatus.READY and (not self.roles or self._serves(v, req))]
        if not serving:
            return None
        if self.policy == "random":
            return self._rng.choice(serving)
        if self.policy == "round-robin":
            self._round_robin += 1
            return serving[self._round_robin % len(serving)]
        if self.policy == "lmetric":
            new_prefill_tokens = req.num_prompt_tokens
            return min(serving, key=lambda v: (new_prefill_tokens * len(v.residents), v.load))
        return min(serving, key=_load)

    def _serves(self, view: InstanceView, req: RoutedRequest) -> bool:
        """A hand-off goes to decode instances only; a new request to prefill or whole-request instances, and under
        PolyServe to a decode instance too, which then prefills it itself (tried after the prefill pool)."""
        role = self.roles.get(view.instance_id, "both")
        if req.request_id in self.handoffs:
            return role == "decode"
        return role != "decode" or self.policy == "polyserve"

    def _on_time_possible(self, req: RoutedRequest, now: float) -> bool:
        """Could its first token (a hand-off's next) still be on time on an idle instance starting now (a
        hand-off's once its KV arrived)?"""
        capacity = max((v.kv_capacity_tokens for v in self.fleet.instances.values()), default=0)
        if not capacity:
            return True
        snap, start = self._as_placed(req, now, late=False)
        idle = InstanceState((), capacity, start, req.slo.tpot_ms)
        return self.checker.check(idle, snap, start).first_token_time <= snap.first_token_due

    def _apply(self, req: RoutedRequest, view: InstanceView, how: How, now: float,
               decode: tuple[InstanceView, How] | None = None) -> None:
        self.moving.discard(req.request_id)
        if decode is not None:
            self._reserve(req, *decode, now)
        self._take(view, how, req.tier_index, now)
        if req.request_id not in self.handoffs:  # a hand-off's prompt is computed there by its import
            req.num_computed_tokens = req.num_output_tokens = 0
        elif now + self._transfer_s(req) > req.first_token_due:
            # its KV lands after the first token's deadline, from when the test promises the next token a TPOT:
            # what it waited on was the prefill or a queue, so its next token is a start, not a test of packing
            req.standing = handed_off(req.standing)
        view.residents[req.request_id] = req
        view.summary.add(req)
        for sample in req.companions:
            self._seat(view, sample)
        held = self._held_to(view, req) if self.token_reserve else None
        for sample in (req, *req.companions):
            if held is not None:
                sample.tpot_reserve = self.headroom[held].margin
            sample.instance_id = view.instance_id
            sample.placed_before = True
            view.residents_per_tier[sample.tier_index] += 1
            view.kv_tokens += sample.num_prompt_tokens + sample.num_output_tokens
            self.requests[sample.request_id] = sample
            self._log(now, how.value, sample.request_id, view.instance_id, sample.tier_index)
        req.companions = ()  # placed, each is a request of its own: lost, each is placed again alone
        self._update_load(view)

    def _reserve(self, req: RoutedRequest, view: InstanceView, how: How, now: float) -> None:
        """Hold `req`'s place on `view` until it leaves the instance it is on (`_unreserve`): a prompt's on a
        decode instance while a prefill instance runs it, a moving resident's where it goes. A stand-in resident
        there, as it will arrive (its prompt computed, its first token or its output so far out), so that the
        requests in flight count in the batches and KV they go to, and the next placement sees the room they will
        take."""
        self._take(view, how, req.tier_index, now)
        out = max(1, req.num_output_tokens)
        stand_in = RoutedRequest(req.request_id, req.tier_index, req.tier, req.slo, req.arrival,
                                 req.num_prompt_tokens, req.max_tokens, view.instance_id,
                                 req.num_prompt_tokens + out - 1, out)
        view.residents[req.request_id] = stand_in
        view.summary.add(stand_in)
        view.residents_per_tier[req.tier_index] += 1
        view.kv_tokens += req.num_prompt_tokens + out
        view.stand_ins[req.request_id] = now
        self.reserved[req.request_id] = view
        self._update_load(view)

    def _unreserve(self, request_id: str, now: float) -> None:
        """The stand-in of `request_id` off its decode instance, if it holds one: its hand-off is then placed as any
        other, most often where the stand-in was."""
        view = self.reserved.pop(request_id, None)
        if view is not None:
            self.hold_s = _moving_mean(self.hold_s, now - view.stand_ins.pop(request_id))
            self._unseat(view, view.residents[request_id], now)

    def _unseat(self, view: InstanceView, req: RoutedRequest, now: float) -> None:
        """`req` off `view`'s residents, and `view` back to the idle pool if its tier can spare it."""
        if view.residents.pop(req.request_id, None) is not None:
            if req.request_id not in self.reserved and self.roles.get(view.instance_id) == "decode":
                if view.last_unseat is not None and now > view.last_unseat:
                    view.unseat_gap_s = _moving_mean(view.unseat_gap_s, now - view.last_unseat)
                view.last_unseat = now
            per_tier = view.residents_per_tier
            per_tier[req.tier_index] -= 1
            if not per_tier[req.tier_index]:
                del per_tier[req.tier_index]
            view.summary.remove(req)
            view.kv_tokens -= req.num_prompt_tokens + req.num_output_tokens
            self._update_load(view)
        if view.tier is not None:
            self._maybe_release(view.tier, now)

    @staticmethod
    def _seat(view: InstanceView, companion: RoutedRequest) -> None:
        """A companion among `view`'s residents, as it will be there: sent once the first sample's prompt is
        cached, it prefills only what that cache does not share with it, the prompt's last partial block at most
        (charged its last token here: the router does not know the block size). Its KV counts whole, prompt and
        output, as every resident's does: the blocks it shares are counted again, which errs on the safe side."""
        companion.num_computed_tokens = companion.num_prompt_tokens - 1
        companion.num_output_tokens = 0
        view.residents[companion.request_id] = companion
        view.summary.add(companion)

    def _take(self, view: InstanceView, how: How, tier: int, now: float) -> None:
        """An idle instance a placement scaled up joins `tier`."""
        if how is How.SCALED_UP:
            self.fleet.idle.remove(view)
            self._join(view, tier, now)

    def _join(self, view: InstanceView, tier: int, now: float) -> None:
        view.tier, view.since = tier, now
        self.fleet.members[tier].append(view)

    def _unlabel(self, view: InstanceView) -> None:
        if view.tier is not None:
            self.fleet.members[view.tier].remove(view)
            view.tier = None
        elif view in self.fleet.idle:
            self.fleet.idle.remove(view)
        elif view in self.fleet.prefill:
            self.fleet.prefill.remove(view)

    def _take_from_loosest(self, tier: int, now: float) -> bool:
        """`tier`, whose requests wait and which holds no instance while none is idle, takes the least-loaded
        instance of the loosest tier that holds any (its tier's floor allowing); True when it did. The loosest
        tier's requests may still go on every other instance by promotion, while the waiting tier's could go on a
        looser tier's instance only by demotion: that holds the instance to their pace only while they are there,
        its own tier refills it at its own pace as soon as they leave, and they queue behind its batch (a small
        decode pool, fewer instances than tiers, whose instances went to the tiers whose requests came first)."""
        autoscaler = self.autoscaler
        if self.policy != "polyserve" or self.fleet.members[tier] or self.fleet.idle or \
                (autoscaler is not None and not autoscaler.can_join(self.fleet, tier)):
            return False
        view = self._loosest_giving(tier, lambda looser: True)
        if view is not None:
            self._retier(view, tier, now)
        return view is not None

    def _loosest_giving(self, tier: int, gives: Callable[[int], bool]) -> InstanceView | None:
        """The least-loaded serving instance of the loosest tier looser than `tier` that `gives` (by its index) and
        whose floor allows its release."""
        members, autoscaler = self.fleet.members, self.autoscaler
        ready = InstanceStatus.READY
        for looser in range(len(members) - 1, tier, -1):
            if not gives(looser) or (autoscaler is not None and not autoscaler.can_release(self.fleet, looser)):
                continue
            view = min((v for v in members[looser] if v.status is ready), key=_load, default=None)
            if view is not None:
                return view
        return None

    def _retier(self, view: InstanceView, tier: int, now: float) -> None:
        self._unlabel(view)
        self._join(view, tier, now)
        self._log(now, "retiered", None, view.instance_id, tier)

    def _drain_into(self, tier: int, now: float) -> None:
        """`tier`'s head fits nowhere, no instance is idle and none of its own is past its budget: a looser tier
        that drains (its completions outrun its arrivals: `TierFlow`) and holds two or more instances, its own
        requests not waiting, gives its least-loaded one to `tier`, and that instance's residents of looser tiers
        are moved to their own tiers' other instances where the test attains them as hand-offs (their KV over the
        link, their next token due at its cumulative deadline), the furthest along first, their places held there
        (`_reserve`) until they leave (`moved`). Until that instance is within `tier`'s budget, `tier` moves more
        of them as room appears rather than take another. At most once per `tier`'s TPOT (the room a step frees).

        Without it, a tier whose share fell keeps its instances for as long as its residents stay (a loose tier's
        for many seconds), while the tier whose share rose waits for room; by demotion onto such an instance it
        would hold the whole batch to its pace, which that batch cannot keep until it is almost empty. Moving them
        onto their own tier's other instances keeps their pace and frees the instance."""
        members = self.fleet.members
        tpot_s = self._tier_tpot_ms[tier] / 1000.0
        if self.policy != "polyserve" or not members[tier] or self.fleet.idle or now - self._last_drain[tier] < tpot_s:
            return
        self._last_drain[tier] = now
        budget_s = self._budget_ms(tier) / 1000.0
        over = [v for v in members[tier] if v.load > budget_s]
        source = next((v for v in over if any(k > tier for k in v.residents_per_tier)), None)
        if source is None:
            if over:
                return
            # a looser tier that drains, holds two or more and has none of its requests waiting
            source = self._loosest_giving(tier, lambda looser: not self.queues[looser] and len(members[looser]) >= 2
                                          and self.flows[looser].draining(now))
            if source is None:
                return
            self._retier(source, tier, now)
        for req in sorted(source.residents.values(), key=lambda r: r.num_output_tokens, reverse=True):
            rid = req.request_id
            if req.tier_index <= tier or rid in self.reserved or rid in self.leaving or req.num_output_tokens < 1:
                continue
            snap, arrives = self._as_handed_off(req, now, False)
            placed = self._place_in((req.tier_index,), req, snap, self._early_s(req), arrives)
            if placed is None:
                continue
            self._reserve(req, *placed, now)
            self.leaving[rid] = source.instance_id
            self.migrations.append((rid, source.instance_id))
            self._log(now, "moving", rid, source.instance_id, req.tier_index)

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
        search, once its decodes' KV moved) found here too, where the scan would ask it."""
        summary = view.summary
        summary.rebuild()
        if view.tier is not None:
            summary.decode_chunk(self.model, self._budget_ms(self._held_tier(view)) / 1000.0, self.max_prefill_chunk)
        view.kv_tokens = summary.kv_residents
        self._update_load(view)

    def _pooled(self, tier: int) -> float:
        """The weight of one outcome in `tier`'s margins (scheduler/headroom.py): full while they pool the outcomes
        of at most POOLED_AT_FULL_STEP instances (those held to the tier, or every serving one where tiers label
        none), so that beyond it the margins move per second as fast as over that many, and no faster."""
        pool = self.fleet.members[tier] if self.policy == "polyserve" else self.fleet.idle
        return min(1.0, POOLED_AT_FULL_STEP / max(1, len(pool)))

    def _budget_ms(self, tier: int) -> float:
        """The TPOT an instance held to `tier`'s is packed to: the tier's, less its headroom."""
        return self.headroom[tier].budget_ms(self._tier_tpot_ms[tier])

    def _held_to(self, view: InstanceView, req: RoutedRequest) -> int:
        """The tier whose TPOT (and headroom) `view` is held to while it hosts `req`."""
        return self._held_tier(view, req.tier_index)

    @staticmethod
    def _held_tier(view: InstanceView, tier: int | None = None) -> int | None:
        """The tier whose TPOT `view` is held to (with a request of `tier` on it, if given): the tightest of its
        tier label and its residents' tiers (a demoted request's is tighter than the label); None with none."""
        held = min(view.residents_per_tier, default=tier)
        if view.tier is not None and (held is None or view.tier < held):
            held = view.tier
        if tier is not None and tier < held:
            held = tier
        return held

    def _update_load(self, view: InstanceView) -> None:
        """Load: the predicted iteration of the instance's residents, every one decoding at its current context; a
        prefill instance's, the predicted time of its queued prompts."""
        if self.roles.get(view.instance_id) == "prefill":
            view.load = self.checker.prefill_seconds(sum(view.summary.queued_prefills()[1]))
        else:
            view.load = self.model.predict(0, len(view.residents), view.kv_tokens) if view.residents else 0.0

    def retry_after(self, tier: int) -> float:
        """Seconds until a tier slot is likely free: one expected stay (at least 1 s)."""
        return max(1.0, math.ceil(self._expected_stay_s(tier)))

    def _expected_stay_s(self, tier: int) -> float:
        """How long a request of `tier` placed now is expected to hold its place: its tier's expected output at
        the tier's TPOT."""
        return self.output_lengths.mean(self.tiers[tier].name) * self._tier_tpot_ms[tier] / 1000.0

    def _log(self, now: float, kind: str, request_id: str | None, instance_id: str | None, tier: int | None) -> None:
        self.counts[kind] += 1
        self.events.append(Event(now, kind, request_id, instance_id, tier))


_load = attrgetter("load")


def _moving_mean(mean: float, sample: float) -> float:
    """`mean` moved toward `sample` by MOVING_MEAN_WEIGHT; the first sample (a mean of 0) taken whole."""
    return mean + MOVING_MEAN_WEIGHT * (sample - mean) if mean else sample


def _scan_orders(tier: int, num_tiers: int, promotion: str,
                 demotion: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The tiers a request of `tier` is tried on before the idle pool, and after it."""
    own, tighter = (tier,), tuple(range(tier - 1, -1, -1))
    before, after = {"lazy": (own, tighter), "before-scale-up": (own + tighter, ()), "none": (own, ()),
                     "eager": (tighter + own, ())}[promotion]
    return before, after + (tuple(range(tier + 1, num_tiers)) if demotion else ())
