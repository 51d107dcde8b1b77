"""What the attainability test knows of an instance: its residents, and a summary of them kept for speed.

The router keeps one `ResidentSummary` per instance current as requests come and go, so a test reads aggregates
instead of every resident; an `InstanceState` is a snapshot of an instance, for a test with every figure.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field
from itertools import islice
from typing import Collection

from scheduler.chunking import largest_chunk
from scheduler.latency_model import LatencyModel
from scheduler.output_length import OutputLengthTracker
from scheduler.slo import SLO, deadline_terms, next_token_deadline
from scheduler.types import ResidentRequest, is_decoding


@dataclass(slots=True, frozen=True)
class RequestSnapshot:
    """One request as the test sees it: a resident of an instance, or the candidate being placed."""
    arrival: float  # seconds, the clock `now` is on
    num_prompt_tokens: int
    max_tokens: int  # output cap
    slo: SLO
    tier: str = ""  # key of the output-length mean this request is charged
    num_computed_tokens: int = 0  # tokens whose KV is cached
    num_output_tokens: int = 0
    first_token_due: float = field(init=False)  # the deadline terms (`scheduler.slo.deadline_terms`)
    tpot_s: float = field(init=False)

    def __post_init__(self):
        first_token_due, tpot_s = deadline_terms(self.arrival, self.slo)
        object.__setattr__(self, "first_token_due", first_token_due)  # derived once: the value stays frozen
        object.__setattr__(self, "tpot_s", tpot_s)
        if self.num_prompt_tokens < 1 or self.max_tokens < 1:
            raise ValueError(f"a request needs a prompt and an output cap, got num_prompt_tokens "
                             f"{self.num_prompt_tokens}, max_tokens {self.max_tokens}")
        if not 0 <= self.num_computed_tokens <= self.num_prompt_tokens + self.num_output_tokens:
            raise ValueError(f"num_computed_tokens {self.num_computed_tokens} outside [0, prompt + output]")
        if self.num_output_tokens < 0:
            raise ValueError(f"num_output_tokens must be non-negative, got {self.num_output_tokens}")


def remaining_output(req: ResidentRequest, expected: int) -> int:
    """Output tokens `req` is charged still to produce: `expected` (its tier's mean, rounded up) capped by its
    max_tokens, less its output so far, at least one."""
    left = (expected if expected < req.max_tokens else req.max_tokens) - req.num_output_tokens
    return left if left > 1 else 1


class ResidentSummary:
    """The residents of one instance as the attainability test uses them, each figure exact:
    - counts and KV tokens (prompt + output so far) of all residents and of the decoding ones (output started,
      whole context cached but the newest token);
    - the others, a prefill queued or under way: the deadline of their next token, sorted, with the prompt work
      each has left (who goes before a candidate is a binary search);
    - residents by remaining output (`remaining_output` at their tier's mean): per remaining length, the count and
      the KV, from which the steady-state KV peak with one more request follows (`peak`).

    Two rules keep it current, and nothing else:
    1. The counts are taken from `residents` (a live collection) at construction, and follow them through their
       owner: `add` after a resident joined, `remove` after one left (its fields as they were counted; one they
       do not hold has them taken again), `rebuild` after residents' progress changed (a step report). Remaining
       lengths follow the means of `output_lengths`: `peak` and `peak_bound` take the counts again once a tier
       mean they used has moved to another integer (the tracker's `generation` tells in O(1) that none moved).
    2. Figures derived from the counts are memos, dropped when the counts they derive from change: the prefill
       chunk the decodes leave and the time of an iteration with it, per (budget, latency model, chunk cap),
       dropped when the decodes change (a model is taken to be fixed while the summary lives: the router's is);
       and the peak figures, dropped on every change, except those for a newcomer that outlasts every resident
       (the usual one), which joins and departures degrade to upper bounds instead (`peak_bound`), so the scan
       right after a placement needs no pass over the lengths.
    """
    __slots__ = ("residents", "output_lengths", "num_residents", "kv_residents", "num_decoding", "kv_decoding",
                 "_generation", "_expected", "_wait_keys", "_wait_work", "_counts", "_kvs", "_chunks", "_outlast",
                 "_outlast_exact", "_index")

    def __init__(self, residents: Collection[ResidentRequest], output_lengths: OutputLengthTracker):
        self.residents = residents
        self.output_lengths = output_lengths  # whose means the residents' remaining lengths follow
        self.num_residents = self.kv_residents = self.num_decoding = self.kv_decoding = 0
        self._chunks: dict[tuple[float, LatencyModel, int], tuple[int, float]] = {}
        self._recount()

    # ---- the owner's side --------------------------------------------------------------------------------------
    def add(self, r: ResidentRequest) -> None:
        self._count(r, 1)

    def remove(self, r: ResidentRequest) -> None:
        self._count(r, -1)

    def rebuild(self) -> None:
        """Counts everything again from `residents`, and the figures `peak` needs for a newcomer that outlasts
        every resident (the owner's pass, not the next test's)."""
        self._recount()
        self._exact_outlast()

    # ---- the test's side ---------------------------------------------------------------------------------------
    def ahead(self, first_deadline: float) -> tuple[int, int]:
        """Residents not decoding whose next token is due by `first_deadline`, and their prompt work left."""
        keys = self._wait_keys
        if not keys:
            return 0, 0
        n = bisect_right(keys, first_deadline)
        return n, sum(islice(self._wait_work, n))

    def queued_prefills(self) -> tuple[list[float], list[int]]:
        """The residents not decoding: their next tokens' deadlines, sorted, and the prompt work each has left
        (read-only: the summary's own lists)."""
        return self._wait_keys, self._wait_work

    def decode_chunk(self, model: LatencyModel, budget_s: float, cap: int) -> tuple[int, float]:
        """Largest prefill chunk beside the decodes within `budget_s` (`largest_chunk`; cap with no decode), and
        the predicted time of an iteration of the decodes with a whole such chunk (a test whose prefill spans
        several chunks needs no prediction of its own for them)."""
        key = (budget_s, model, cap)
        step = self._chunks.get(key)
        if step is None:
            num_decoding, kv_decoding = self.num_decoding, self.kv_decoding
            chunk = cap if num_decoding == 0 else largest_chunk(model, budget_s, num_decoding, kv_decoding, cap)
            step = self._chunks[key] = (chunk, model.predict(chunk, num_decoding, kv_decoding + chunk))
        return step

    def peak(self, remaining: int, kv: int) -> tuple[int, int]:
        """Largest KV the batch reaches with one more request that holds kv + t tokens at iteration t < remaining,
        each resident holding its KV + t while t < its remaining length; and the batch size then (the latest such
        iteration on a tie; (0, 0) when it never exceeds 0): the figures of a scan departure by departure
        (tests/test_scheduler_attainability.py holds one).

        With S(v) = KV_{>=v} + (v - 1) * N_{>=v} over residents of remaining length >= v, the KV just before a
        departure at v is S(v) for v > remaining, S(remaining) + kv + (remaining - 1) with the request in, and
        S(v) + kv + (v - 1) for v < remaining: a prefix maximum of S and a suffix maximum of S(v) + v - 1, both
        over the lengths present, plus one term."""
        self._follow_means()
        longest, best, best_n = self._exact_outlast()
        if remaining > longest:  # no resident outlasts the request (the usual newcomer): O(1)
            return _outlasting_peak(remaining, kv, best, best_n + 1)
        index = self._index
        if index is None:
            index = self._index = self._build_index()
        neg_lengths, above, low = index
        # p lengths exceed `remaining`, q reach it
        p = q = bisect_right(neg_lengths, -remaining - 1)
        if q < len(neg_lengths) and neg_lengths[q] == -remaining:
            q += 1
        if p:
            peak, batch, _, _ = above[p - 1]
        else:
            peak = batch = 0
        if q:
            _, _, n_ge, kv_ge = above[q - 1]
        else:
            n_ge = kv_ge = 0
        with_r = kv_ge + kv + (remaining - 1) * (n_ge + 1)
        if with_r > peak:
            peak, batch = with_r, n_ge + 1
        if q < len(low):
            best, n = low[q]
            if best + kv > peak:
                peak, batch = best + kv, n + 1
        return peak, batch

    def peak_bound(self, remaining: int, kv: int) -> tuple[int, int] | None:
        """Upper bounds of `peak(remaining, kv)`'s two figures in O(1) while `peak` would need a pass over the
        lengths (residents joined or left since the last: the instance that took the last placement); None when
        `peak` itself costs no pass, or when no bound is known. A request that fits within the bounds fits (the
        latency model grows with KV and batch); only one that does not needs `peak`.

        The bounds follow each change: a resident of remaining length L and KV x raises S(v) + v - 1 by
        x + v - 1 <= x + L - 1 where v <= L, and puts a new length L whose figure is at most the max of the old
        ones plus that (some length >= L was present) or x + 2 (L - 1) (none was); one leaving lowers them."""
        self._follow_means()
        outlast = self._outlast
        if outlast is None or self._outlast_exact or remaining <= outlast[0]:
            return None
        return _outlasting_peak(remaining, kv, outlast[1], self.num_residents + 1)

    # ---- internals ---------------------------------------------------------------------------------------------
    def _follow_means(self) -> None:
        lengths = self.output_lengths
        if lengths.generation == self._generation:
            return
        means = lengths.mean
        if all(math.ceil(means(tier)) == e for tier, e in self._expected.items()):
            self._generation = lengths.generation
        else:
            self._recount()

    def _exact_outlast(self) -> tuple[int, int, int]:
        if not self._outlast_exact:
            self._outlast, self._outlast_exact = self._longest_and_best(), True
        return self._outlast

    def _recount(self) -> None:
        lengths = self.output_lengths
        means = lengths.mean
        expected: dict[str, int] = {}
        counts: dict[int, int] = {}
        kvs: dict[int, int] = {}
        waiting: list[tuple[float, int]] = []
        kv_all = num_decoding = kv_decoding = 0
        expected_get, counts_get, kvs_get = expected.get, counts.get, kvs.get
        for s in self.residents:  # `is_decoding` and `remaining_output` written out: this loop runs over every
            # resident per report
            out = s.num_output_tokens
            tokens = s.num_prompt_tokens + out
            kv_all += tokens
            if out and s.num_computed_tokens >= tokens - 1:
                num_decoding += 1
                kv_decoding += tokens
            else:
                waiting.append((next_token_deadline(s), tokens - s.num_computed_tokens))
            e = expected_get(s.tier)
            if e is None:
                e = expected[s.tier] = math.ceil(means(s.tier))
            cap = s.max_tokens
            left = (e if e < cap else cap) - out
            if left < 1:
                left = 1
            counts[left] = counts_get(left, 0) + 1
            kvs[left] = kvs_get(left, 0) + tokens
        waiting.sort()
        self.num_residents, self.kv_residents = len(self.residents), kv_all
        if num_decoding != self.num_decoding or kv_decoding != self.kv_decoding:
            self.num_decoding, self.kv_decoding, self._chunks = num_decoding, kv_decoding, {}
        self._wait_keys = [k for k, _ in waiting]
        self._wait_work = [w for _, w in waiting]
        self._expected, self._counts, self._kvs = expected, counts, kvs  # _expected: tier -> its mean, rounded up
        self._generation = lengths.generation  # the publication of the means the counts were last found current at
        # (longest remaining length, max of S(v) + v - 1, its N_{>=v}): see `peak`; upper bounds of the first two
        # unless exact; None: not known
        self._outlast: tuple[int, int, int] | None = None
        self._outlast_exact = False
        self._index: tuple[list[int], list[tuple[int, int, int, int]], list[tuple[int, int]]] | None = None

    def _count(self, r: ResidentRequest, sign: int) -> None:
        """Adds (sign 1) or takes out (sign -1) one resident's share; taking out one the counts do not hold has
        them taken again."""
        out = r.num_output_tokens
        tokens = r.num_prompt_tokens + out
        e = self._expected.get(r.tier)
        if e is None:
            if sign < 0:
                self._recount()
                return
            e = self._expected[r.tier] = math.ceil(self.output_lengths.mean(r.tier))
        left = remaining_output(r, e)
        count = self._counts.get(left, 0) + sign
        if count < 0:
            self._recount()
            return
        if is_decoding(r):
            self.num_decoding += sign
            self.kv_decoding += sign * tokens
            self._chunks = {}
        else:
            key = next_token_deadline(r)
            work = tokens - r.num_computed_tokens
            keys, works = self._wait_keys, self._wait_work
            i = bisect_right(keys, key)
            if sign > 0:
                keys.insert(i, key)
                works.insert(i, work)
            else:
                while i and keys[i - 1] == key and works[i - 1] != work:
                    i -= 1
                if not i or keys[i - 1] != key:
                    self._recount()
                    return
                del keys[i - 1], works[i - 1]
        self.num_residents += sign
        self.kv_residents += sign * tokens
        if count:
            self._counts[left] = count
            self._kvs[left] = self._kvs.get(left, 0) + sign * tokens
        else:
            del self._counts[left], self._kvs[left]
        outlast = self._outlast
        if outlast is not None:
            if sign > 0:
                longest, best, _ = outlast
                self._outlast = (longest if longest > left else left,
                                 max(best + tokens + left - 1, tokens + 2 * (left - 1)), 0)
            self._outlast_exact = False
        self._index = None

    def _longest_and_best(self) -> tuple[int, int, int]:
        """The longest remaining length present (0: none), and the max of S(v) + v - 1 over all of them with its
        N_{>=v}, the longest on a tie (-1 when there are none): what `peak` needs when no resident outlasts."""
        counts, kvs = self._counts, self._kvs
        n, kv = self.num_residents, self.kv_residents
        v = 0
        best, best_n = -1, 0
        for v in sorted(counts):
            s = kv + (v - 1) * n + v - 1
            if s >= best:
                best, best_n = s, n
            n -= counts[v]
            kv -= kvs[v]
        return v, best, best_n

    def _build_index(self) -> tuple[list[int], list[tuple[int, int, int, int]], list[tuple[int, int]]]:
        """Over the remaining lengths v present, longest first: -v; (max of S over lengths >= v and its N, the
        longest on a tie; N_{>=v}; KV_{>=v}); and (max of S(u) + u - 1 over lengths u <= v and its N_{>=u}, the
        longest on a tie)."""
        counts, kvs = self._counts, self._kvs
        order = sorted(counts, reverse=True)
        above: list[tuple[int, int, int, int]] = []
        n = kv = best = best_n = 0
        for v in order:
            n += counts[v]
            kv += kvs[v]
            s = kv + (v - 1) * n
            if s > best:
                best, best_n = s, n
            above.append((best, best_n, n, kv))
        low: list[tuple[int, int]] = [(0, 0)] * len(order)
        best, best_n = -1, 0
        for i in range(len(order) - 1, -1, -1):
            v = order[i]
            _, _, n, kv = above[i]
            s = kv + (v - 1) * n + v - 1
            if s >= best:
                best, best_n = s, n
            low[i] = (best, best_n)
        return [-v for v in order], above, low


def _outlasting_peak(remaining: int, kv: int, best: int, batch_at_best: int) -> tuple[int, int]:
    """`ResidentSummary.peak` for a request that outlasts every resident: alone at its last iteration, or at the
    departure where S(v) + v - 1 is `best`, with `batch_at_best` requests in."""
    peak, batch = (kv + remaining - 1, 1) if kv + remaining > 1 else (0, 0)
    if best + kv > peak:
        peak, batch = best + kv, batch_at_best
    return peak, batch


@dataclass(slots=True, frozen=True)
class InstanceState:
    """An instance as `AttainabilityChecker.check` reads it (its residents are summarised afresh by each check)."""
    residents: tuple[ResidentRequest, ...]  # running and queued on the instance
    kv_capacity_tokens: int  # the instance's whole KV pool, in tokens
    iteration_end: float  # when the iteration in flight ends (<= now when idle)
    tpot_ms: float  # the TPOT its tier holds it to

    def __post_init__(self):
        if self.kv_capacity_tokens < 1:
            raise ValueError(f"kv_capacity_tokens must be positive, got {self.kv_capacity_tokens}")
        if not self.tpot_ms > 0:
            raise ValueError(f"tpot_ms must be positive, got {self.tpot_ms}")
