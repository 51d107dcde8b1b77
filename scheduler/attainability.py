"""Can instance s take request r and still attain every SLO on it? (DESIGN.md §2, attainability test.)

Checks, in this order; the first that fails names the rejection:
- ttft: r's prefill, behind the queued prefills with earlier first-token deadlines, chunked at the chunk the instance
  affords now (its decodes' per-token budget), starting when the iteration in flight ends, emits r's first token by
  arrival + ttft. Time already queued counts because deadlines run from r's arrival.
- second_token: one decode iteration later (the batch then holds r, the current decodes and the prefills that went
  before r) is within arrival + ttft + tpot.
- tpot: the batch simulated forward to its largest KV, r included, predicts an iteration within the TPOT (the
  instance's, or r's if tighter). Each request grows one token per iteration until it has produced its expected
  output (the tier's running mean, capped by its max_tokens; a resident is charged what REMAINS of it, at least one
  token), then leaves. Between departures the KV grows, so the peak is just before one.
- kv_capacity: that peak fits in the instance's KV pool.
- prefill_continuity: the chunk the instance can afford in the worst coming iteration (every resident decoding,
  each grown by the iterations r's prefill takes, r's prompt already in the cache) still finishes r's prefill by its
  first-token deadline.

Cost: the residents enter only through their `ResidentSummary` (scheduler/instance_state.py), which the router keeps
current as requests come and go; from it a test is O(log n) for n residents plus a few dozen latency predictions
(the binary searches of the chunk sizes; the one the decodes leave is cached per summary). A summary built afresh
(a state not seen before, or after a step report) costs one pass over the residents.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from scheduler.chunking import largest_chunk
from scheduler.instance_state import InstanceState, RequestSnapshot, ResidentSummary
from scheduler.latency_model import LatencyModel
from scheduler.output_length import OutputLengthTracker


class Rejection(str, Enum):
    TTFT = "ttft"
    SECOND_TOKEN = "second_token"
    TPOT = "tpot"
    KV_CAPACITY = "kv_capacity"
    PREFILL_CONTINUITY = "prefill_continuity"


@dataclass(slots=True, frozen=True)
class Attainability:
    """Verdict and the predicted figures behind it (absolute times in seconds on the caller's clock)."""
    ok: bool
    reason: Rejection | None  # None when ok
    first_token_time: float  # inf when no prefill chunk fits the budget now
    second_token_time: float
    prefill_chunk: int  # tokens per iteration the instance affords r's prefill now
    prefill_iterations: int
    steady_iteration_s: float  # predicted iteration at the KV peak
    peak_kv_tokens: int
    peak_batch_size: int  # requests in the batch at the peak
    worst_prefill_chunk: int
    worst_prefill_end: float  # inf when no chunk fits the worst iteration


class AttainabilityChecker:
    def __init__(self, model: LatencyModel, output_lengths: OutputLengthTracker, max_prefill_chunk: int):
        if max_prefill_chunk < 1:
            raise ValueError(f"max_prefill_chunk must be positive, got {max_prefill_chunk}")
        self.model = model
        self.output_lengths = output_lengths
        self.max_prefill_chunk = max_prefill_chunk

    def check_idle(self, request: RequestSnapshot, kv_capacity_tokens: int) -> Attainability:
        """Can r's SLO be met at all: on an empty instance held to r's own TPOT, placed the moment it arrives.
        A request that fails this is refused at admission."""
        idle = InstanceState(residents=(), kv_capacity_tokens=kv_capacity_tokens, iteration_end=request.arrival,
                             tpot_ms=request.slo.tpot_ms)
        return self.check(idle, request, request.arrival)

    def check(self, instance: InstanceState, request: RequestSnapshot, now: float) -> Attainability:
        model, cap = self.model, self.max_prefill_chunk
        summary = instance.resident_summary()
        summary.refresh(self.output_lengths)
        slo = request.slo
        start = now if now > instance.iteration_end else instance.iteration_end
        budget_s = min(instance.tpot_ms, slo.tpot_ms) / 1000.0
        first_deadline = request.arrival + slo.ttft_ms / 1000.0
        num_decoding, kv_decoding = summary.num_decoding, summary.kv_decoding
        num_residents, kv_residents = summary.num_residents, summary.kv_residents
        num_ahead, work_ahead = summary.ahead(first_deadline)

        r_tokens = request.num_prompt_tokens + request.num_output_tokens
        work = work_ahead + r_tokens - request.num_computed_tokens
        r_left = max(min(math.ceil(self.output_lengths.mean(request.tier)), request.max_tokens)
                     - request.num_output_tokens, 1)

        # ttft: chunked at what the current decodes' budget leaves (no decodes: no per-token budget, full chunks)
        chunk = summary.decode_chunk(model, budget_s, cap)
        if chunk == 0:
            return Attainability(False, Rejection.TTFT, math.inf, math.inf, 0, 0, math.inf, 0, 0, 0, math.inf)
        iterations = -(-work // chunk)
        piece = chunk if chunk < work else work
        first = start + iterations * model.predict(piece, num_decoding, kv_decoding + piece)

        # second token: one decode iteration with r and everything that was prefilled before it
        kv_then = kv_decoding + num_decoding * iterations + work_ahead + r_tokens
        second = first + model.predict(0, num_decoding + num_ahead + 1, kv_then)

        # steady state: r joins with its KV shifted so that it holds r_tokens when its first token is out
        peak_kv, peak_batch = summary.peak(iterations + r_left, max(r_tokens - iterations, 0))
        steady_s = model.predict(0, peak_batch, peak_kv)

        # continuity: the worst coming iteration holds every resident decoding, grown over r's prefill
        kv_worst = kv_residents + num_residents * iterations + max(r_tokens - chunk, 0)
        worst_chunk = cap if num_residents == 0 else largest_chunk(model, budget_s, num_residents, kv_worst, cap)
        if worst_chunk == 0:
            worst_end = math.inf
        else:
            worst_piece = worst_chunk if worst_chunk < work else work
            worst_end = start + -(-work // worst_chunk) * model.predict(worst_piece, num_residents,
                                                                        kv_worst + worst_piece)

        if first > first_deadline:
            reason = Rejection.TTFT
        elif second > first_deadline + slo.tpot_ms / 1000.0:
            reason = Rejection.SECOND_TOKEN
        elif steady_s > budget_s:
            reason = Rejection.TPOT
        elif peak_kv > instance.kv_capacity_tokens:
            reason = Rejection.KV_CAPACITY
        elif worst_end > first_deadline:
            reason = Rejection.PREFILL_CONTINUITY
        else:
            reason = None
        return Attainability(reason is None, reason, first, second, chunk, iterations, steady_s, peak_kv,
                             peak_batch, worst_chunk, worst_end)

    def attainable(self, instance: InstanceState, request: RequestSnapshot, now: float) -> bool:
        """`check(instance, request, now).ok`, sooner: see `fits`."""
        summary = instance.summary
        if summary.version != instance.summary_version:
            summary = instance.resident_summary()
        return self.fits(summary, instance.kv_capacity_tokens, instance.iteration_end, instance.tpot_ms, request, now)

    def fits(self, summary: ResidentSummary, kv_capacity_tokens: int, iteration_end: float, tpot_ms: float,
             request: RequestSnapshot, now: float) -> bool:
        """`attainable` on an instance given by its parts, `summary` describing its residents as they are now (the
        router's scan: it keeps each instance's summary current, so it needs no InstanceState). The figures stop
        at the first condition that fails, in the order that refuses soonest in a busy fleet: first token (no
        latency prediction when r's prefill spans whole chunks), the KV as r's first token is out, continuity, the
        steady state, the second token."""
        lengths = self.output_lengths
        if summary.built_with is not lengths:
            summary.refresh(lengths)
        model, cap, slo = self.model, self.max_prefill_chunk, request.slo
        if slo.tpot_ms < tpot_ms:
            tpot_ms = slo.tpot_ms
        budget_s = tpot_ms / 1000.0
        chunk, chunk_s = summary.decode_chunk_step(model, budget_s, cap)
        if chunk == 0:
            return False
        start = now if now > iteration_end else iteration_end
        first_deadline = request.arrival + slo.ttft_ms / 1000.0
        num_decoding, kv_decoding = summary.num_decoding, summary.kv_decoding
        num_residents, kv_residents = summary.num_residents, summary.kv_residents
        # residents not decoding wait for (part of) their prefill; with none, nobody goes ahead
        num_ahead, work_ahead = summary.ahead(first_deadline) if num_residents != num_decoding else (0, 0)
        r_tokens = request.num_prompt_tokens + request.num_output_tokens
        work = work_ahead + r_tokens - request.num_computed_tokens
        iterations = -(-work // chunk)
        first = start + iterations * (chunk_s if work >= chunk else model.predict(work, num_decoding,
                                                                                 kv_decoding + work))
        if first > first_deadline:
            return False
        r_kv = r_tokens - iterations if r_tokens > iterations else 0
        if kv_residents + r_kv > kv_capacity_tokens:  # what the batch holds as r's first token is out
            return False
        # continuity next: in a busy fleet it is what refuses most instances that could start r's prefill in time
        # (in the simulator at 64 instances, two checks in three), so the figures after it are mostly not needed
        kv_worst = kv_residents + num_residents * iterations + max(r_tokens - chunk, 0)
        worst_chunk = cap if num_residents == 0 else largest_chunk(model, budget_s, num_residents, kv_worst, cap)
        if worst_chunk == 0:
            return False
        worst_piece = worst_chunk if worst_chunk < work else work
        if start + -(-work // worst_chunk) * model.predict(worst_piece, num_residents,
                                                            kv_worst + worst_piece) > first_deadline:
            return False
        r_left = max(min(math.ceil(lengths.mean(request.tier)), request.max_tokens) - request.num_output_tokens, 1)
        bound = summary.peak_bound(iterations + r_left, r_kv)
        if bound is None or bound[0] > kv_capacity_tokens or model.predict(0, bound[1], bound[0]) > budget_s:
            peak_kv, peak_batch = summary.peak(iterations + r_left, r_kv)
            if peak_kv > kv_capacity_tokens or model.predict(0, peak_batch, peak_kv) > budget_s:
                return False
        kv_then = kv_decoding + num_decoding * iterations + work_ahead + r_tokens
        return not first + model.predict(0, num_decoding + num_ahead + 1, kv_then) \
            > first_deadline + slo.tpot_ms / 1000.0
