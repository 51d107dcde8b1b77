"""Can instance s take request r and still attain every SLO on it? (DESIGN.md §2, attainability test.)

Conditions, in this order; the first that fails names the rejection:
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
- queue_behind: every queued prefill that r goes before (its next token due after r's first) still emits that token
  by its deadline with r's prompt work ahead of it, at the chunk the instance affords now. Without it a request
  queued on an instance of a tighter tier (promoted) is pushed back by every tighter request placed after it, and
  its first token comes seconds after the router predicted.

A prefill instance of a disaggregated fleet (its residents are prompts, each leaving at its first token for a decode
instance) is tested by `fits_prefill` instead: its whole queue of prompts and r's, at whole chunks, and the transfer of
r's KV end by r's first-token deadline; the prompts fit the KV. The whole queue, not the prompts due before r: an
instance packed to its residents' deadlines would have room for no tighter request in front of them, so an instance's
queue is kept within the TTFT of the tiers it serves, and a tier's requests go where the queue is that short. Its decode instance is tested as any instance, r's next token then due one TPOT after its first-token deadline.

The residents enter only through their `ResidentSummary` (scheduler/instance_state.py): on a summary kept current
by its owner (`fits`, the router's scan) a test is O(log n) for n residents plus the latency predictions of the
chunk searches; `check` counts one afresh.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from scheduler.chunking import largest_chunk
from scheduler.instance_state import InstanceState, RequestSnapshot, ResidentSummary, remaining_output
from scheduler.latency_model import LatencyModel
from scheduler.output_length import OutputLengthTracker


class Rejection(str, Enum):
    TTFT = "ttft"
    SECOND_TOKEN = "second_token"
    TPOT = "tpot"
    KV_CAPACITY = "kv_capacity"
    PREFILL_CONTINUITY = "prefill_continuity"
    QUEUE_BEHIND = "queue_behind"


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
    """`check` computes every figure and names the first condition that fails; `fits` (the router's scan) computes
    the same figures with the same step functions, in the order that refuses soonest in a busy fleet, and stops at
    the first that fails. Their verdicts are the same for any latency model that does not shrink as the batch or
    its KV grows (every shipped one): `fits` may accept on upper bounds of the steady-state peak."""

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
        summary = ResidentSummary(instance.residents, self.output_lengths)
        slo = request.slo
        budget_s = min(instance.tpot_ms, slo.tpot_ms) / 1000.0
        first_deadline = request.first_token_due
        start = max(now, instance.iteration_end)
        chunk, work, iterations, num_ahead, work_ahead, first, steady_kv = self._first_token(
            summary, budget_s, first_deadline, start, request)
        if chunk == 0:
            return Attainability(False, Rejection.TTFT, math.inf, math.inf, 0, 0, math.inf, 0, 0, 0, math.inf)
        second = self._second_token(summary, request, first, iterations, num_ahead, work_ahead)
        peak_kv, peak_batch = summary.peak(iterations + self._remaining(request), steady_kv)
        steady_s = self.model.predict(0, peak_batch, peak_kv)
        worst_chunk, worst_end = self._worst_prefill(summary, budget_s, start, request, chunk, work, iterations)
        if first > first_deadline:
            reason = Rejection.TTFT
        elif second > first_deadline + request.tpot_s:
            reason = Rejection.SECOND_TOKEN
        elif steady_s > budget_s:
            reason = Rejection.TPOT
        elif peak_kv > instance.kv_capacity_tokens:
            reason = Rejection.KV_CAPACITY
        elif worst_end > first_deadline:
            reason = Rejection.PREFILL_CONTINUITY
        elif not self._behind_on_time(summary, budget_s, start, num_ahead, work):
            reason = Rejection.QUEUE_BEHIND
        else:
            reason = None
        return Attainability(reason is None, reason, first, second, chunk, iterations, steady_s, peak_kv,
                             peak_batch, worst_chunk, worst_end)

    def fits(self, summary: ResidentSummary, kv_capacity_tokens: int, iteration_end: float, tpot_ms: float,
             request: RequestSnapshot, now: float, early_s: float = 0.0) -> bool:
        """`check(...).ok` for an instance given by its parts, `summary` describing its residents as they are now
        (the router keeps one current per instance) with this checker's output lengths, and r's first two tokens
        due `early_s` before their deadlines (the queue ahead of r is still the one its deadline puts it behind).
        Order: first token (no latency prediction when r's prefill spans whole chunks), the KV as r's first token
        is out (a floor of the peak), continuity (what refuses most instances that could start r's prefill in
        time), the steady state, the second token, the prefills queued behind r."""
        slo = request.slo
        budget_s = (slo.tpot_ms if slo.tpot_ms < tpot_ms else tpot_ms) / 1000.0
        first_deadline = request.first_token_due
        planned_first = first_deadline - early_s
        start = now if now > iteration_end else iteration_end
        chunk, work, iterations, num_ahead, work_ahead, first, steady_kv = self._first_token(
            summary, budget_s, first_deadline, start, request)
        if first > planned_first:  # inf when no chunk fits
            return False
        if summary.kv_residents + steady_kv > kv_capacity_tokens:
            return False
        if self._worst_prefill(summary, budget_s, start, request, chunk, work, iterations)[1] > planned_first:
            return False
        if not self._steady_fits(summary, iterations + self._remaining(request), steady_kv, kv_capacity_tokens,
                                 budget_s):
            return False
        second = self._second_token(summary, request, first, iterations, num_ahead, work_ahead)
        if second > planned_first + request.tpot_s:
            return False
        return self._behind_on_time(summary, budget_s, start, num_ahead, work)

    def first_token_time(self, summary: ResidentSummary, iteration_end: float, tpot_ms: float,
                         request: RequestSnapshot, now: float) -> float:
        """`check(...).first_token_time` for an instance given by its parts, as `fits` reads them."""
        budget_s = (request.slo.tpot_ms if request.slo.tpot_ms < tpot_ms else tpot_ms) / 1000.0
        start = now if now > iteration_end else iteration_end
        return self._first_token(summary, budget_s, request.first_token_due, start, request)[5]

    def fits_prefill(self, summary: ResidentSummary, kv_capacity_tokens: int, iteration_end: float,
                     request: RequestSnapshot, now: float, early_s: float = 0.0, transfer_s: float = 0.0) -> bool:
        """Can a prefill instance take r (see the module's doc)? Its prompts run in whole chunks of
        `max_prefill_chunk` with no decode beside them; `transfer_s`: r's KV to its decode instance."""
        if summary.kv_residents + request.num_prompt_tokens > kv_capacity_tokens:
            return False
        start = now if now > iteration_end else iteration_end
        work = sum(summary.queued_prefills()[1]) + request.num_prompt_tokens + request.num_output_tokens \
            - request.num_computed_tokens
        return start + self.prefill_seconds(work) + transfer_s <= request.first_token_due - early_s

    def prefill_seconds(self, tokens: int) -> float:
        """Prompt work alone, in whole chunks of the cap and the rest."""
        cap, predict = self.max_prefill_chunk, self.model.predict
        whole, rest = divmod(tokens, cap)
        return (whole * predict(cap, 0, cap) if whole else 0.0) + (predict(rest, 0, rest) if rest else 0.0)

    # ---- the step functions both compute the figures with ---------------------------------------------------------
    def _first_token(self, summary: ResidentSummary, budget_s: float, first_deadline: float, start: float,
                     request: RequestSnapshot) -> tuple[int, int, int, int, int, float, int]:
        """r's prefill: the chunk the decodes leave within `budget_s` (0: none, no first token), the prompt work
        until r's first token (the queued prefills due by its deadline go first), the iterations that takes, the
        residents that go first and their work, the first-token time; and r's KV at iteration 0 of the steady
        state, shifted so that it holds its prompt and output as its first token is out (with every resident's KV,
        what the batch holds then: a floor of the peak)."""
        chunk, chunk_s = summary.decode_chunk(self.model, budget_s, self.max_prefill_chunk)
        if chunk == 0:
            return 0, 0, 0, 0, 0, math.inf, 0
        # the residents not decoding queue a prefill; with none, nobody goes ahead
        num_ahead, work_ahead = (0, 0) if summary.num_residents == summary.num_decoding else \
            summary.ahead(first_deadline)
        r_tokens = request.num_prompt_tokens + request.num_output_tokens
        work = work_ahead + r_tokens - request.num_computed_tokens
        if work < chunk:  # one iteration with part of a chunk
            chunk_s = self.model.predict(work, summary.num_decoding, summary.kv_decoding + work)
        iterations = -(-work // chunk)
        return (chunk, work, iterations, num_ahead, work_ahead, start + iterations * chunk_s,
                r_tokens - iterations if r_tokens > iterations else 0)

    def _second_token(self, summary: ResidentSummary, request: RequestSnapshot, first: float, iterations: int,
                      num_ahead: int, work_ahead: int) -> float:
        """One decode iteration after the first token: the decodes, grown over r's prefill, the prefills that went
        before r, and r."""
        num_decoding = summary.num_decoding
        kv = summary.kv_decoding + num_decoding * iterations + work_ahead + request.num_prompt_tokens \
            + request.num_output_tokens
        return first + self.model.predict(0, num_decoding + num_ahead + 1, kv)

    def _behind_on_time(self, summary: ResidentSummary, budget_s: float, start: float, num_ahead: int,
                        work: int) -> bool:
        """Whether each queued prefill after the `num_ahead` that go before r still emits its next token by its
        deadline, `work` (r's prompt and the prefills before it) going first, at whole chunks of what the decodes
        leave now."""
        keys, works = summary.queued_prefills()
        if num_ahead == len(keys):
            return True
        chunk, chunk_s = summary.decode_chunk(self.model, budget_s, self.max_prefill_chunk)
        for i in range(num_ahead, len(keys)):
            work += works[i]
            if start + -(-work // chunk) * chunk_s > keys[i]:
                return False
        return True

    def _worst_prefill(self, summary: ResidentSummary, budget_s: float, start: float, request: RequestSnapshot,
                       chunk: int, work: int, iterations: int) -> tuple[int, float]:
        """The chunk the worst coming iteration affords (every resident decoding, grown over r's prefill, r's prompt
        cached but for one chunk), and when r's prefill ends at that chunk (inf: none fits)."""
        model, cap, n = self.model, self.max_prefill_chunk, summary.num_residents
        r_tokens = request.num_prompt_tokens + request.num_output_tokens
        kv = summary.kv_residents + n * iterations + (r_tokens - chunk if r_tokens > chunk else 0)
        worst = cap if n == 0 else largest_chunk(model, budget_s, n, kv, cap)
        if worst == 0:
            return 0, math.inf
        piece = worst if worst < work else work
        return worst, start + -(-work // worst) * model.predict(piece, n, kv + piece)

    def _steady_fits(self, summary: ResidentSummary, remaining: int, steady_kv: int, kv_capacity_tokens: int,
                     budget_s: float) -> bool:
        """The tpot and kv_capacity conditions at the peak (`summary.peak`), decided on its O(1) upper bounds
        where they suffice."""
        predict = self.model.predict
        bound = summary.peak_bound(remaining, steady_kv)
        if bound is not None and bound[0] <= kv_capacity_tokens and predict(0, bound[1], bound[0]) <= budget_s:
            return True
        peak_kv, peak_batch = summary.peak(remaining, steady_kv)
        return peak_kv <= kv_capacity_tokens and predict(0, peak_batch, peak_kv) <= budget_s

    def _remaining(self, request: RequestSnapshot) -> int:
        """Iterations r stays once its first token is out: its remaining expected output."""
        return remaining_output(request, math.ceil(self.output_lengths.mean(request.tier)))

