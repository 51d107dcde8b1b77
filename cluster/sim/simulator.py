"""Discrete-event simulator of a fleet (DESIGN.md §5): the live system's router (cluster/router.py), autoscaler
(cluster/autoscaler.py) and batch policies (scheduler/) driven in virtual time, the latency model with its prediction
error (scheduler/prediction_error.py: every instance steps on its own `StepTruth`, which no predictor sees) standing
in for the GPU. No sockets, no sleeping, no clock: deterministic for a seed.

It is what cluster/service.py does with messages, done with method calls:
- an arrival is `router.submit`; placed, it is queued on its instance (cluster/sim/instance.py runs the engine's
  step loop there); queued, it waits in the router; refused (queue full, no instance), it counts as not attained;
- after each engine step the router gets the instance's report (`on_report`), sent lazily: just before the router
  decides anything, for every instance that stepped since its last report; the router only ever reads the latest
  report, so it sees exactly what it would have seen from one report per step; with `report_every_steps` > 1 it
  hears what workers coalescing their reports so would have sent last (cluster/step_reports.py's rule), and of
  the steps since, nothing yet;
- prefill/decode disaggregation (`prefill_instances` > 0): a request's first token comes out on a prefill instance,
  which the router then hears it left (`on_finished`, not completed) and hands off (`router.hand_off`) as the service
  does on Prefilled; placed on a decode instance, that one takes the blocks of the prompt's KV at once or refuses
  (then the hand-off is tried again at the next tick, as the service does), the KV arrives after the link's transfer
  time (scheduler/transfer.py) and the request joins that instance's queue with its prompt computed; the prefill
  instance frees its blocks as the transfer ends; queued, the hand-off waits in the router's queue; with
  `autoscale`, every prompt placed on a prefill instance feeds the autoscaler's prefill token rate, every decode
  instance's reported steps its decode token rate and every hand-off its KV byte rate (both through the router),
  as the service's do, and its plan (the reports synced first, as the service hears them as they come) starts prefill
  instances and stops idle ones as it does decode instances (one holding a hand-off's KV is kept);
- a finish is `router.on_finished`, then `retry_queued`; a periodic tick (the service's 50 ms) retries the queues
  and asks the autoscaler for a plan: instances it starts are ready after `cold_start_s`, the ones it stops drain
  first and are removed once empty.
Events at the same instant run arrivals first, then transfer ends, then step boundaries, then ticks: a request
arriving (or imported) as a step ends joins the next step, as it would in the engine (it reads its queue between
steps).
"""
from __future__ import annotations

import heapq
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from cluster.autoscaler import Autoscaler, ScalingLimits
from cluster.fleet import InstanceStatus, RoutedRequest
from cluster.router import InstanceReport, Outcome, Router
from cluster.sim.instance import IDLE, MissTally, SimInstance, SimRequest
from scheduler.transfer import LINKS, transfer_model
from cluster.sim.workload import REFUSED, Workload
from scheduler.costly import check_costly_share
from scheduler.headroom import DEFAULT_TARGET, Headroom, check_headroom_target, handed_off
from scheduler.latency_model import LatencyModel
from scheduler.online_fit import online_latency_model
from scheduler.policy import BATCH_POLICIES, make_batch_policy
from scheduler.prediction_error import EXACT, PredictionError, StepTruth
from scheduler.roofline import kv_blocks_for_gpu
from scheduler.types import BatchPolicy

ARRIVAL, TRANSFER_END, STEP_EVENT, READY_EVENT, TICK = 0, 1, 2, 3, 4  # same-instant order


@dataclass(slots=True, frozen=True)
class SimConfig:
    """One simulated deployment. `num_instances` is the fixed fleet; with `autoscale` it is the starting fleet and
    the autoscaler's limits bound it."""
    router_policy: str = "polyserve"  # cluster.router.POLICIES
    engine_policy: str = "polyserve"  # scheduler.policy.BATCH_POLICIES
    num_instances: int = 8
    autoscale: ScalingLimits | None = None
    cold_start_s: float = 30.0  # spawn to ready: an H200 loading 16 GB of weights and capturing graphs
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: Llama-3.1-8B bf16 beside its weights on a 141 GB H200 at 90 %
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 4096
    max_prefill_chunk: int = 2048  # PolyServe's chunk cap; the static budget of FCFS and EDF
    queue_limit: int = 256
    shed_late: bool = True  # the router gives up a queued request that can no longer be on time (Router)
    headroom_target: float = DEFAULT_TARGET  # the share of requests each margin lets miss, router's and engines'
    costly_share: float = 0.0  # the share of each tier the router may refuse for cost when it has no place (Router)
    token_reserve: bool = False  # the router's margins kept by the engines before each token's deadline (Router)
    # the most steps an instance's report is held back while nothing placement depends on changed, as the worker's
    # --report-every-steps (cluster/step_reports.py); 1: a report every step
    report_every_steps: int = 1
    tick_s: float = 0.05
    fast_forward: bool = True
    # how every step's true time departs from the model's prediction (host time, bias, noise, stalls); the router
    # and the batch policies predict by the model alone
    prediction_error: PredictionError = EXACT
    record_token_times: bool = False
    reveal_output_len: bool = False  # max_tokens = the true output length (as the emulated engine needs)
    max_tokens_cap: int = 4096  # otherwise every request's max_tokens
    expected_output_tokens: float | None = None  # the router's prior; None: the workload's mean output
    seed: int = 0  # the router's own randomness (the random baseline) and, with the instance's index, its step times
    # prefill/decode disaggregation: the first `prefill_instances` instances run prompts and hand requests off at
    # their first token, the rest decode them; 0: every instance does both. With `autoscale`, the starting prefill
    # pool, within its prefill limits, which the autoscaler sizes from the prompt token rate
    prefill_instances: int = 0
    transfer: str = "nvlink"  # the link a hand-off's KV crosses: a preset of scheduler.transfer.LINKS

    def __post_init__(self):
        if self.engine_policy not in BATCH_POLICIES:
            raise ValueError(f"engine_policy must be one of {', '.join(BATCH_POLICIES)}, got {self.engine_policy!r}")
        if self.num_instances < 0 or (self.num_instances == 0 and self.autoscale is None):
            raise ValueError(f"a fixed fleet needs at least one instance, got {self.num_instances}")
        if not (self.cold_start_s >= 0 and self.tick_s > 0):
            raise ValueError("cold_start_s must be non-negative and tick_s positive")
        if not isinstance(self.prediction_error, PredictionError):
            raise ValueError(f"prediction_error must be a PredictionError (scheduler.prediction_error."
                             f"prediction_error resolves a preset name), got {self.prediction_error!r}")
        if self.max_prefill_chunk > self.max_num_batched_tokens:
            raise ValueError("max_prefill_chunk cannot exceed max_num_batched_tokens")
        if self.report_every_steps < 1:
            raise ValueError(f"report_every_steps must be positive, got {self.report_every_steps}")
        check_headroom_target(self.headroom_target)
        check_costly_share(self.costly_share)
        if self.transfer not in LINKS:
            raise ValueError(f"transfer must be one of {', '.join(LINKS)}, got {self.transfer!r}")
        if self.prefill_instances < 0:
            raise ValueError(f"prefill_instances must be non-negative, got {self.prefill_instances}")
        if self.autoscale is not None and (self.prefill_instances or self.autoscale.min_prefill_instances):
            low, high = self.autoscale.min_prefill_instances, self.autoscale.prefill_cap
            if not low or not low <= self.prefill_instances <= high:
                raise ValueError(f"prefill_instances {self.prefill_instances} (the starting prefill pool) and the "
                                 f"autoscaler's prefill limits {low}..{high} must both be set, the count within them")
        if self.prefill_instances:
            if self.prefill_instances >= self.num_instances:
                raise ValueError(f"prefill_instances {self.prefill_instances} leaves no decode instance among "
                                 f"{self.num_instances}")

    @property
    def kv_blocks(self) -> int:
        return self.num_kv_blocks if self.num_kv_blocks is not None else kv_blocks_for_gpu(self.block_size)

    def batch_policy(self, model: LatencyModel, headroom: Headroom | None = None) -> BatchPolicy:
        """One instance's batch policy, `engine_policy` over this deployment's batch limits."""
        return make_batch_policy(self.engine_policy, model, self.max_num_seqs, self.max_num_batched_tokens,
                                 self.max_prefill_chunk, headroom)


@dataclass(slots=True)
class SimResult:
    """Per request (in workload order) and per run figures. Times in seconds of virtual time."""
    tier: np.ndarray  # tier index; REFUSED for requests refused at admission
    arrival: np.ndarray
    served: np.ndarray  # bool: placed and finished
    attained: np.ndarray  # bool, cumulative deadlines (DESIGN.md §1)
    attained_mean_tpot: np.ndarray
    attained_max_gap: np.ndarray
    ttft: np.ndarray  # nan when not served
    mean_tpot: np.ndarray  # nan with fewer than two tokens
    max_gap: np.ndarray
    worst_lateness: np.ndarray  # max over tokens of emit - deadline (<= 0: attained); nan when not served
    promoted: np.ndarray  # bool: served on an instance of a tighter tier
    preemptions: np.ndarray
    tier_names: tuple[str, ...]
    end_time: float
    instance_seconds: float  # live instances (starting, serving, draining) integrated over the run
    # (time, instances per tier, idle, live, live prefill instances) every sample_s; live counts draining ones
    samples: list[tuple[float, tuple[int, ...], int, int, int]]
    counts: dict[str, int]
    num_steps: int
    num_policy_calls: int
    wall_s: float
    aborted: bool = False  # stopped by give_up_below: the window's attainment is below it (unfinished = missed)
    token_times: list[list[float]] | None = None
    token_instances: list[list[str]] | None = None  # with token_times: the instance that emitted each token
    handed_off: np.ndarray | None = None  # PD mode, bool: its KV moved from a prefill to a decode instance

    def attainment(self, window: tuple[float, float] | None = None, view: str = "cumulative") -> float:
        """Fraction of requests arriving in `window` that attained their SLO (refused ones count as missed)."""
        flags = {"cumulative": self.attained, "mean_tpot": self.attained_mean_tpot,
                 "max_gap": self.attained_max_gap}.get(view)
        if flags is None:
            raise ValueError(f"view must be cumulative, mean_tpot or max_gap, got {view!r}")
        mask = self._window(window)
        n = int(mask.sum())
        if n == 0:
            raise ValueError("no request arrived in the window")
        return float(flags[mask].sum()) / n

    def tier_attainment(self, window: tuple[float, float] | None = None, view: str = "cumulative") -> dict[str, float]:
        flags = {"cumulative": self.attained, "mean_tpot": self.attained_mean_tpot,
                 "max_gap": self.attained_max_gap}[view]
        mask = self._window(window)
        out = {}
        for k, name in enumerate(self.tier_names):
            m = mask & (self.tier == k)
            if m.any():
                out[name] = float(flags[m].mean())
        return out

    def _window(self, window: tuple[float, float] | None) -> np.ndarray:
        if window is None:
            return np.ones(len(self.arrival), dtype=bool)
        return (self.arrival >= window[0]) & (self.arrival < window[1])


class Simulator:
    def __init__(self, config: SimConfig, tiers, model: LatencyModel,
                 policy_factory: Callable[[LatencyModel, Headroom], BatchPolicy] | None = None,
                 router_kwargs: dict | None = None, sample_s: float = 1.0):
        """`model` is what every predictor starts from; each instance steps on its own `StepTruth` of it under
        `config.prediction_error`, and refines its own copy from the steps it measures, as an engine does.
        `policy_factory(instance's model, instance's headroom)` (one batch policy per instance) defaults to what
        `config` names; `router_kwargs` reach the Router (the ablations' gradient and promotion switches)."""
        self.config, self.tiers, self.model = config, tiers, model
        self.policy_factory = policy_factory or config.batch_policy
        self.router_kwargs = router_kwargs or {}
        self.sample_s = sample_s
        self.instances: dict[str, SimInstance] = {}
        self.router: Router | None = None

    # ---- setup ---------------------------------------------------------------------------------------------
    def _build_router(self, expected_output: float) -> Router:
        cfg = self.config
        autoscaler = Autoscaler(cfg.autoscale) if cfg.autoscale is not None else None
        transfer = {"transfer": self._transfer} if cfg.prefill_instances else {}
        return Router(self.tiers, self.model, policy=cfg.router_policy, autoscaler=autoscaler,
                      queue_limit=cfg.queue_limit, shed_late=cfg.shed_late, max_prefill_chunk=cfg.max_prefill_chunk,
                      expected_output_tokens=expected_output, seed=cfg.seed, headroom_target=cfg.headroom_target,
                      costly_share=cfg.costly_share, token_reserve=cfg.token_reserve, **transfer, **self.router_kwargs)

    def _new_instance(self, now: float, prefill: bool = False) -> str:
        instance_id = f"i{self._next_instance}"
        self._next_instance += 1
        index = len(self._by_index)
        cfg = self.config
        truth = StepTruth(self.model, cfg.prediction_error, f"{cfg.seed}/{index}")
        # as build_engine builds an engine's
        learned = online_latency_model(self.model, max_prefill_tokens=cfg.max_num_batched_tokens,
                                       max_decode_seqs=cfg.max_num_seqs, max_kv_tokens=cfg.kv_blocks * cfg.block_size)
        headroom = Headroom(cfg.headroom_target)
        inst = SimInstance(index, self.policy_factory(learned, headroom), truth, learned, headroom, cfg.kv_blocks,
                           cfg.block_size, self._push_step_event, self._on_finish, fast_forward=cfg.fast_forward,
                           instance_id=instance_id, report_every=cfg.report_every_steps,
                           on_prefilled=self._on_prefilled if prefill else None)
        self._by_index.append(inst)
        self.instances[instance_id] = inst
        self._reported.append(-1)
        self.router.add_instance(instance_id, now)
        if self.config.prefill_instances:
            self.router.set_role(instance_id, "prefill" if prefill else "decode")
        self._live_since[instance_id] = now
        return instance_id

    # ---- the event loop --------------------------------------------------------------------------------------
    def run(self, workload: Workload, until: float | None = None, window: tuple[float, float] | None = None,
            give_up_below: float | None = None) -> SimResult:
        """Simulates `workload` until every request has finished (or `until`, when given).

        With `give_up_below`, the run stops (`aborted`) as soon as so many requests arriving in `window` have missed
        their SLO (a token late, refused, rejected, or its first or second token not out by its deadline) that their
        attainment can no longer reach it: a goodput search only needs to know that, and an overloaded fleet is the
        slowest thing to simulate (its queues, and the hand-offs a full decode pool refuses, hold the requests that
        will miss)."""
        if give_up_below is not None and window is None:
            raise ValueError("give_up_below needs the window it is measured over")
        wall0 = time.perf_counter()
        cfg = self.config
        self._heap: list = []
        self._seq = 0
        self._by_index: list[SimInstance] = []
        self._reported: list[int] = []
        self._live_since: dict[str, float] = {}
        self._instance_seconds = 0.0
        self._next_instance = 0
        self._draining: set[str] = set()
        self._now = 0.0
        self._rejected: set[str] = set()
        self._unfinished = 0
        self._pending_ready = 0
        self._tally = MissTally()
        # PD mode: per request id, the routed request (what a hand-off places again) and, once prefilled until its
        # KV has arrived, the prefill instance holding its blocks and how many
        self._routed: dict[str, RoutedRequest] = {}
        self._prefilled: dict[str, tuple[SimInstance, int]] = {}
        self._refused_imports: list[SimRequest] = []
        self._handed_off: set[str] = set()
        self._transfers = 0
        self._num_refused_imports = 0
        self._transfer = transfer_model(cfg.transfer)
        if window is not None:
            in_window = (workload.arrivals >= window[0]) & (workload.arrivals < window[1])
            self._tally.missed = int(np.count_nonzero(in_window & (workload.tier_index == REFUSED)))
            allowed = math.inf if give_up_below is None else (1.0 - give_up_below) * int(in_window.sum())
        else:
            allowed = math.inf
        aborted = False
        # with give_up_below, the window's requests by tier in arrival order (so in deadline order): at a tick, those
        # whose first or second token is past its deadline and not out are counted missed (`_count_overdue`)
        awaiting: dict[str, deque[SimRequest]] | None = {} if math.isfinite(allowed) else None
        expected = cfg.expected_output_tokens or (float(workload.output_lens.mean()) if len(workload) else 128.0)
        self.router = router = self._build_router(expected)
        capacity = cfg.kv_blocks * cfg.block_size
        for k in range(cfg.num_instances):
            instance_id = self._new_instance(0.0, prefill=k < cfg.prefill_instances)
            self._dispatch(router.on_ready(instance_id, capacity, 0.0, cfg.block_size))
        if cfg.autoscale is not None:
            self._autoscale(0.0)
        self._push(0.0, TICK, None)

        n = len(workload)
        requests: list[SimRequest | None] = [None] * n
        self._requests_by_id: dict[str, SimRequest] = {}
        arrivals = workload.arrivals.tolist()
        prompts = workload.prompt_lens.tolist()
        outputs = workload.output_lens.tolist()
        tier_idx = workload.tier_index.tolist()
        tiers = self.tiers
        samples: list = []
        next_sample = 0.0
        heap = self._heap
        pop = heapq.heappop
        stop = math.inf if until is None else until
        i = 0
        while True:
            t_arrival = arrivals[i] if i < n else math.inf
            from_heap = bool(heap) and heap[0][0] < t_arrival  # same instant: the arrival first
            t = heap[0][0] if from_heap else t_arrival
            if t == math.inf or t > stop:
                break
            while next_sample <= t:
                samples.append(self._sample(next_sample))
                next_sample += self.sample_s
            self._accrue(t)
            self._now = t
            if not from_heap:
                k = tier_idx[i]
                i += 1
                if k == REFUSED:
                    continue
                tier = tiers[k]
                out = outputs[i - 1]
                max_tokens = out if cfg.reveal_output_len else max(cfg.max_tokens_cap, out)
                sreq = SimRequest(f"r{i - 1}", t, tier.slo, tier.name, prompts[i - 1], max_tokens, out)
                if cfg.record_token_times:
                    sreq.token_times = []
                    sreq.token_instances = []
                if window is not None and window[0] <= t < window[1]:
                    sreq.tally = self._tally
                    if awaiting is not None:
                        awaiting.setdefault(sreq.tier, deque()).append(sreq)
                requests[i - 1] = sreq
                self._requests_by_id[sreq.request_id] = sreq
                self._arrive(sreq, k, t)
                continue
            _, kind, _, payload = pop(heap)
            if kind == STEP_EVENT:
                inst, version = payload
                if version == inst.version:
                    inst.on_event(t)
            elif kind == TRANSFER_END:
                self._import(*payload, t)
            elif kind == TICK:
                if awaiting is not None:
                    _count_overdue(awaiting, t)
                if self._tally.missed > allowed:
                    aborted = True
                    break
                self._tick(t)
                if i < n or (self._unfinished and not self._stalled()):
                    self._push(t + cfg.tick_s, TICK, None)
            else:  # READY_EVENT
                self._pending_ready -= 1
                if payload in self.instances:
                    self._sync_reports(t)
                    self._dispatch(self.router.on_ready(payload, capacity, t, cfg.block_size))
        return self._result(workload, requests, samples, time.perf_counter() - wall0, aborted)

    def _stalled(self) -> bool:
        """Nothing can move any more: no instance steps, none is starting, and the queues found no place (a
        request whose KV cannot fit anywhere). Its requests stay unfinished and count as missed."""
        return self._pending_ready == 0 and self._transfers == 0 and not self._refused_imports \
            and all(inst.event_time == math.inf for inst in self._by_index)

    def _push(self, t: float, kind: int, payload) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, payload))

    def _push_step_event(self, inst: SimInstance, t: float) -> None:
        self._push(t, STEP_EVENT, (inst, inst.version))

    def _accrue(self, t: float) -> None:
        """Instance-seconds of every live instance up to t."""
        live = len(self._live_since)
        self._instance_seconds += live * (t - self._now)

    # ---- requests --------------------------------------------------------------------------------------------
    def _arrive(self, sreq: SimRequest, tier_index: int, now: float) -> None:
        routed = RoutedRequest(request_id=sreq.request_id, tier_index=tier_index, tier=sreq.tier, slo=sreq.slo,
                               arrival=sreq.arrival, num_prompt_tokens=sreq.num_prompt_tokens,
                               max_tokens=sreq.max_tokens)
        self._routed[sreq.request_id] = routed
        self._sync_reports(now)
        decision = self.router.submit(routed, now)
        if decision.outcome is Outcome.PLACED:
            self._unfinished += 1
            self._place(sreq, decision.instance_id, now)
        elif decision.outcome is Outcome.QUEUED:
            self._unfinished += 1
        else:
            self._rejected.add(sreq.request_id)
            sreq.count_missed()

    def _place(self, sreq: SimRequest, instance_id: str, now: float) -> None:
        view = self.router.fleet.instances[instance_id]
        sreq.host_tier = self.tiers[view.tier].name if view.tier is not None else ""
        sreq.tpot_reserve = self._routed[sreq.request_id].tpot_reserve
        if sreq.request_id in self._prefilled:
            self._start_transfer(sreq, instance_id, now)
            return
        if self.config.autoscale is not None and self.router.roles.get(instance_id) == "prefill":
            self.router.autoscaler.prefill_tokens.add(now, sreq.num_prompt_tokens)
        self.instances[instance_id].enqueue(sreq, now)

    # ---- prefill/decode hand-offs ------------------------------------------------------------------------------
    def _on_prefilled(self, inst: SimInstance, prefilled: list[SimRequest], now: float) -> None:
        """Requests that left prefill instance `inst` at their first token, their KV still held there."""
        self._sync_reports(now)
        router = self.router
        for sreq in prefilled:
            self._prefilled[sreq.request_id] = (inst, sreq.num_blocks)
            self._handed_off.add(sreq.request_id)
            sreq.num_blocks = 0  # the blocks it will hold are the decode instance's
            router.on_finished(sreq.request_id, sreq.num_output_tokens, now, completed=False)
            self._hand_off(sreq, now)
        if router.waiting_tiers():
            self._dispatch(router.retry_queued(now))

    def _hand_off(self, sreq: SimRequest, now: float, *, retry: bool = False) -> None:
        decision = self.router.hand_off(self._routed[sreq.request_id], now, retry=retry,
                                        num_output_tokens=sreq.num_output_tokens)
        self._handed(sreq, decision, now)

    def _move(self, request_id: str, instance_id: str, now: float) -> None:
        """The router chose to move a resident: its instance lets go of it between steps, its KV held there until
        the pull, and the router places it as a hand-off (one that finished or left meanwhile stays where it is)."""
        sreq, inst = self._requests_by_id[request_id], self.instances[instance_id]
        if not inst.let_go(sreq, now):
            return
        self._prefilled[request_id] = (inst, sreq.num_blocks)
        sreq.num_blocks = 0
        self._handed(sreq, self.router.moved(request_id, sreq.num_output_tokens, now), now)

    def _handed(self, sreq: SimRequest, decision, now: float) -> None:
        if decision.outcome is Outcome.PLACED:
            self._place(sreq, decision.instance_id, now)
        elif decision.outcome is not Outcome.QUEUED:  # no decode instance at all: the stream ends in an error
            self._free_prefill_blocks(sreq, now)
            self._unfinished -= 1
            self._rejected.add(sreq.request_id)
            sreq.count_missed()

    def _start_transfer(self, sreq: SimRequest, instance_id: str, now: float) -> None:
        """Placed on instance `instance_id`: it takes the blocks of the computed KV (a prompt's, or a moved
        resident's prompt and output), or refuses (then the router hears the request left it, and the hand-off is
        tried again at the next tick)."""
        need = -(-sreq.num_computed_tokens // self.config.block_size)
        decode = self.instances[instance_id]
        if not decode.reserve_blocks(need, now):
            self.router.on_finished(sreq.request_id, sreq.num_output_tokens, now, completed=False)
            self._refused_imports.append(sreq)
            self._num_refused_imports += 1
            return
        sreq.num_blocks = need
        self._transfers += 1
        self._push(now + self._transfer.seconds(sreq.num_computed_tokens), TRANSFER_END, (sreq, decode))

    def _import(self, sreq: SimRequest, decode: SimInstance, now: float) -> None:
        """The KV arrived: the prefill instance frees its blocks, and the request joins the decode instance."""
        self._transfers -= 1
        self._free_prefill_blocks(sreq, now)
        sreq.standing = handed_off(sreq.standing)
        decode.enqueue(sreq, now)

    def _free_prefill_blocks(self, sreq: SimRequest, now: float) -> None:
        """The prefill instance holding `sreq`'s KV frees it and says so, as a worker does after a step-less
        change."""
        prefill, held = self._prefilled.pop(sreq.request_id)
        prefill.release_blocks(held, now)
        self.router.on_load(prefill.instance_id, prefill.num_total_blocks - prefill.free_blocks)

    def _dispatch(self, placements) -> None:
        for p in placements:
            self._place(self._requests_by_id[p.request.request_id], p.instance_id, self._now)
        for routed in self.router.take_shed():
            sreq = self._requests_by_id[routed.request_id]
            self._unfinished -= 1
            self._rejected.add(sreq.request_id)
            sreq.count_missed()
        for request_id, instance_id in self.router.take_migrations():
            self._move(request_id, instance_id, self._now)

    def _on_finish(self, inst: SimInstance, finished: list[SimRequest], now: float) -> None:
        self._sync_reports(now)
        router = self.router
        for req in finished:
            router.on_finished(req.request_id, req.num_output_tokens, now)
            self._unfinished -= 1
        if router.waiting_tiers():
            self._dispatch(router.retry_queued(now))
        if self._draining and inst.instance_id in self._draining and inst.num_residents == 0:
            self._remove(inst.instance_id, now)

    def _sync_reports(self, now: float) -> None:
        """Every instance that stepped since its last report reports now (see the module docstring)."""
        router, reported = self.router, self._reported
        if self.config.report_every_steps > 1:
            for inst in self._by_index:
                inst.sync(now)
                heard = inst.report
                if heard is not None and heard.num_steps != reported[inst.index]:
                    reported[inst.index] = heard.num_steps
                    router.on_report(inst.instance_id, InstanceReport(
                        heard.iteration_end, heard.num_blocks_used, heard.residents,
                        inst.take_unreported_steps(heard.num_steps)), now)
            return
        for inst in self._by_index:
            if inst.state == IDLE and inst.num_steps == reported[inst.index]:
                continue
            inst.sync(now)
            if inst.num_steps != reported[inst.index]:
                reported[inst.index] = inst.num_steps
                router.on_report(inst.instance_id, InstanceReport(inst.last_end,
                                                                  inst.num_total_blocks - inst.free_blocks,
                                                                  inst.running + inst.waiting,
                                                                  inst.take_unreported_steps()), now)

    # ---- fleet -----------------------------------------------------------------------------------------------
    def _tick(self, now: float) -> None:
        router = self.router
        if self._refused_imports:
            self._sync_reports(now)
            refused, self._refused_imports = self._refused_imports, []
            for sreq in refused:
                self._hand_off(sreq, now, retry=True)
        if router.waiting_tiers():
            self._sync_reports(now)
            self._dispatch(router.retry_queued(now))
        if self.config.autoscale is not None:
            self._autoscale(now)

    def _autoscale(self, now: float) -> None:
        router = self.router
        holding = {inst.instance_id for inst, _ in self._prefilled.values()}  # a hand-off's KV, not yet pulled
        stages = {}  # what only a disaggregated fleet's plan reads
        if self.config.prefill_instances:
            self._sync_reports(now)
            stages = dict(decode_seconds_per_token=router.decode_seconds_per_token, transfer=router.transfer)
        plan = router.autoscaler.plan(router.fleet, router.waiting_tiers(), now, keep=holding, roles=router.roles,
                                      prefill_seconds_per_token=router.prefill_seconds_per_token, **stages)
        for k in range(plan.num_prefill_to_start + plan.num_to_start):
            instance_id = self._new_instance(now, prefill=k < plan.num_prefill_to_start)
            self._pending_ready += 1
            self._push(now + self.config.cold_start_s, READY_EVENT, instance_id)
        for instance_id in plan.to_stop:
            view = router.fleet.instances.get(instance_id)
            if view is None or view.status is not InstanceStatus.READY:
                continue
            router.start_draining(instance_id, now)
            if self.instances[instance_id].num_residents == 0:
                self._remove(instance_id, now)
            else:
                self._draining.add(instance_id)

    def _remove(self, instance_id: str, now: float) -> None:
        self._draining.discard(instance_id)
        self.router.remove_instance(instance_id, now)
        del self._live_since[instance_id]
        del self.instances[instance_id]

    def _sample(self, t: float) -> tuple[float, tuple[int, ...], int, int, int]:
        fleet, roles = self.router.fleet, self.router.roles
        return (t, tuple(len(m) for m in fleet.members), len(fleet.idle), len(self._live_since),
                sum(1 for instance_id in self._live_since if roles.get(instance_id) == "prefill"))

    # ---- results ---------------------------------------------------------------------------------------------
    def _result(self, workload: Workload, requests: list[SimRequest | None], samples, wall_s: float,
                aborted: bool) -> SimResult:
        n = len(workload)
        served = np.zeros(n, dtype=bool)
        attained = np.zeros(n, dtype=bool)
        attained_mean = np.zeros(n, dtype=bool)
        attained_gap = np.zeros(n, dtype=bool)
        ttft = np.full(n, np.nan)
        mean_tpot = np.full(n, np.nan)
        max_gap = np.full(n, np.nan)
        lateness = np.full(n, np.nan)
        promoted = np.zeros(n, dtype=bool)
        preemptions = np.zeros(n, dtype=np.int64)
        for i, r in enumerate(requests):
            if r is None or not r.finished:
                continue
            served[i] = True
            attained[i] = r.worst_lateness <= 0
            lateness[i] = r.worst_lateness
            ttft[i] = r.first_token_time - r.arrival
            first_ok = r.first_token_time <= r.first_token_due
            if r.num_output_tokens > 1:
                mean_tpot[i] = (r.last_token_time - r.first_token_time) / (r.num_output_tokens - 1)
                max_gap[i] = r.max_gap
                attained_mean[i] = first_ok and mean_tpot[i] <= r.tpot_s
                attained_gap[i] = first_ok and r.max_gap <= r.tpot_s
            else:
                attained_mean[i] = attained_gap[i] = first_ok
            promoted[i] = r.host_tier != "" and r.host_tier != r.tier and \
                self.tiers.index(r.host_tier) < self.tiers.index(r.tier)
            preemptions[i] = r.num_preemptions
        insts = self._by_index
        return SimResult(
            tier=workload.tier_index.astype(np.int64), arrival=workload.arrivals, served=served, attained=attained,
            attained_mean_tpot=attained_mean, attained_max_gap=attained_gap, ttft=ttft, mean_tpot=mean_tpot,
            max_gap=max_gap, worst_lateness=lateness, promoted=promoted, preemptions=preemptions,
            tier_names=tuple(t.name for t in self.tiers), end_time=self._now,
            instance_seconds=self._instance_seconds, samples=samples,
            counts={**dict(self.router.counts), "rejected": len(self._rejected),
                    "refused_at_admission": workload.num_refused,
                    **({"handed_off": len(self._handed_off), "import_refused": self._num_refused_imports}
                       if self.config.prefill_instances else {})},
            num_steps=sum(i.num_steps for i in insts), num_policy_calls=sum(i.num_policy_calls for i in insts),
            wall_s=wall_s, aborted=aborted,
            token_times=[(r.token_times if r is not None else None) for r in requests]
            if self.config.record_token_times else None,
            token_instances=[(r.token_instances if r is not None else None) for r in requests]
            if self.config.record_token_times else None,
            handed_off=np.array([r is not None and r.request_id in self._handed_off for r in requests],
                                dtype=bool) if self.config.prefill_instances else None)


def _count_overdue(awaiting: dict[str, deque[SimRequest]], now: float) -> None:
    """Takes off `awaiting` the requests whose second token is due before `now`, and counts missed, once, those
    whose first or second token is not out and would have had to be (their output is longer): they can no longer
    attain (their tokens, when they come, are not counted again). The second token covers a hand-off that waits
    for room on a decode instance, its first token out on the prefill instance."""
    for waiting in awaiting.values():
        while waiting and waiting[0].first_token_due + waiting[0].tpot_s < now:
            sreq = waiting.popleft()
            if sreq.num_output_tokens < 2 and not sreq.finished:
                sreq.count_missed()
