"""What the attainability test knows of an instance: its residents, and a summary of them kept for speed.

The engine builds a state from its own requests (`RequestSnapshot.of`); the router keeps one per instance from the
engines' step reports plus the placements it made since the last report, and keeps that instance's
`ResidentSummary` current as requests come and go, so a test reads aggregates instead of every resident.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field
from itertools import islice
from typing import Collection, Protocol, Sequence

from scheduler.chunking import largest_chunk
from scheduler.latency_model import LatencyModel
from scheduler.output_length import OutputLengthTracker
from scheduler.slo import SLO
from scheduler.types import SchedulableRequest


class ResidentRequest(Protocol):
    """A request as the test reads it: `RequestSnapshot`, and the router's own `RoutedRequest` as it is."""
    arrival: float  # seconds, the clock `now` is on
    num_prompt_tokens: int
    max_tokens: int  # output cap
    slo: SLO
    tier: str  # key of the output-length mean it is charged
    num_computed_tokens: int  # tokens whose KV is cached
    num_output_tokens: int


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

    def __post_init__(self):
        if self.num_prompt_tokens < 1 or self.max_tokens < 1:
            raise ValueError(f"a request needs a prompt and an output cap, got num_prompt_tokens "
                             f"{self.num_prompt_tokens}, max_tokens {self.max_tokens}")
        if not 0 <= self.num_computed_tokens <= self.num_prompt_tokens + self.num_output_tokens:
            raise ValueError(f"num_computed_tokens {self.num_computed_tokens} outside [0, prompt + output]")
        if self.num_output_tokens < 0:
            raise ValueError(f"num_output_tokens must be non-negative, got {self.num_output_tokens}")

    @classmethod
    def of(cls, req: SchedulableRequest, default_slo: SLO, tier: str = "") -> "RequestSnapshot":
        return cls(arrival=req.arrival, num_prompt_tokens=req.num_prompt_tokens, max_tokens=req.max_tokens,
                   slo=req.slo or default_slo, tier=tier, num_computed_tokens=req.num_computed_tokens,
                   num_output_tokens=req.num_output_tokens)


class ResidentSummary:
    """The residents of one instance as the attainability test uses them, each figure exact:
    - counts and KV tokens (prompt + output so far) of all residents and of the decoding ones (output started,
      whole context cached but the newest token);
    - the others, a prefill queued or under way: the deadline of their next token, sorted, with the prompt work
      each has left (who goes before a candidate is a binary search);
    - residents by remaining expected output (tier mean rounded up, capped by max_tokens, less the output so
      far, at least 1): per remaining length, the count and the KV, from which the steady-state KV peak with one
      more request follows (`peak`: O(1) or O(log n), after one pass over the lengths present once they changed);
    - the prefill chunk the decodes leave, per time budget, and the time of an iteration with it (the latency
      model is taken to be fixed while the summary lives: the router's is; the engine takes a new state for every
      test).

    Whoever changes the residents keeps it current: `add` after one joined, `remove` after one left (its fields as
    they were when it joined or at the last rebuild), `rebuild` after residents' progress changed (a step report).
    One never built is counted from `residents` (a live collection) when first read (`refresh`), and counted again
    when read with another tracker of output lengths, or once a tier mean its remaining lengths used has moved to
    another integer. `version` counts the owner's changes, so that a state taken earlier can tell that the summary
    no longer describes its residents.
    """
    __slots__ = ("residents", "version", "num_residents", "kv_residents", "num_decoding", "kv_decoding",
                 "built_with", "_expected", "_wait_keys", "_wait_work", "_counts", "_kvs", "_top", "_bound", "_index",
                 "_chunk_key", "_chunks", "_generation")

    def __init__(self, residents: Collection[ResidentRequest]):
        self.residents = residents
        self.version = 0
        self.num_residents = self.kv_residents = self.num_decoding = self.kv_decoding = 0
        # the tracker of output lengths the counts follow (None: not built yet); `refresh` counts for another one
        self.built_with: OutputLengthTracker | None = None
        self._chunk_key: tuple | None = None
        self._chunks: dict[float, tuple[int, float]] = {}

    # ---- the owner's side --------------------------------------------------------------------------------------
    def add(self, r: ResidentRequest) -> None:
        self.version += 1
        if self.built_with is not None:
            self._count(r, 1)

    def remove(self, r: ResidentRequest) -> None:
        self.version += 1
        if self.built_with is not None:
            self._count(r, -1)

    def rebuild(self, lengths: OutputLengthTracker) -> None:
        """Counts everything again from `residents`, remaining lengths from `lengths`' current means, and the
        figures `peak` needs for a newcomer that outlasts every resident (the owner's pass, not the next test's)."""
        self.version += 1
        self._recount(lengths)
        self._set_top()

    # ---- the test's side ---------------------------------------------------------------------------------------
    def refresh(self, lengths: OutputLengthTracker) -> None:
        """Built, if it is not yet or was built with another tracker's means."""
        if self.built_with is not lengths:
            self._recount(lengths)

    def ahead(self, first_deadline: float) -> tuple[int, int]:
        """Residents not decoding whose next token is due by `first_deadline`, and their prompt work left."""
        keys = self._wait_keys
        if not keys:
            return 0, 0
        n = bisect_right(keys, first_deadline)
        return n, sum(islice(self._wait_work, n))

    def decode_chunk(self, model: LatencyModel, budget_s: float, cap: int) -> int:
        """Largest prefill chunk beside the decodes within `budget_s` (`largest_chunk`; cap with no decode)."""
        return self.decode_chunk_step(model, budget_s, cap)[0]

    def decode_chunk_step(self, model: LatencyModel, budget_s: float, cap: int) -> tuple[int, float]:
        """`decode_chunk` and the predicted time of an iteration of the decodes with a whole such chunk (cached
        with it: a test whose prefill spans several chunks needs no prediction of its own for them)."""
        if self._chunk_key != (model, cap):
            self._chunk_key, self._chunks = (model, cap), {}
        step = self._chunks.get(budget_s)
        if step is None:
            num_decoding, kv_decoding = self.num_decoding, self.kv_decoding
            chunk = cap if num_decoding == 0 else largest_chunk(model, budget_s, num_decoding, kv_decoding, cap)
            step = self._chunks[budget_s] = (chunk, model.predict(chunk, num_decoding, kv_decoding + chunk))
        return step

    def peak(self, remaining: int, kv: int) -> tuple[int, int]:
        """Largest KV the batch reaches with one more request that holds kv + t tokens at iteration t < remaining,
        each resident holding its KV + t while t < its remaining length; and the batch size then (the latest such
        iteration on a tie; (0, 0) when it never exceeds 0). Same figures as the iteration-by-departure scan it
        replaces (tests/test_scheduler_attainability.py keeps it); `refresh` must come first.

        With S(v) = KV_{>=v} + (v - 1) * N_{>=v} over residents of remaining length >= v, the KV just before a
        departure at v is S(v) for v > remaining, S(remaining) + kv + (remaining - 1) with the request in, and
        S(v) + kv + (v - 1) for v < remaining: a prefix maximum of S and a suffix maximum of S(v) + v - 1, both
        over the lengths present, plus one term."""
        self._follow_means()
        top = self._top
        if top is None:
            top = self._set_top()
        longest, best, best_n = top
        if remaining > longest:  # no resident outlasts the request (the usual newcomer): one pass's figures do
            peak, batch = (kv + remaining - 1, 1) if kv + remaining > 1 else (0, 0)
            if best + kv > peak:
                peak, batch = best + kv, best_n + 1
            return peak, batch
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
        lengths (its figures went stale when a resident joined or left: the instance that took the last placement);
        None when `peak` itself costs no pass, or when no bound is known. A request that fits within the bounds
        fits (the latency model grows with KV and batch); only one that does not needs `peak`.

        The bounds follow each change: a resident of remaining length L and KV x raises S(v) + v - 1 by
        x + v - 1 <= x + L - 1 where v <= L, and puts a new length L whose figure is at most the max of the old
        ones plus that (some length >= L was present) or x + 2 (L - 1) (none was); one leaving lowers them."""
        self._follow_means()
        if self._top is not None or self._bound is None:
            return None
        longest, best = self._bound
        if remaining <= longest:
            return None
        peak = kv + remaining - 1
        if best + kv > peak:
            peak = best + kv
        return (peak, self.num_residents + 1) if peak > 0 else (0, 0)

    # ---- internals ---------------------------------------------------------------------------------------------
    def _follow_means(self) -> None:
        """Counted again once a tier mean the remaining lengths used has moved to another integer."""
        lengths = self.built_with
        if lengths.generation == self._generation:
            return
        means = lengths.mean
        for tier, e in self._expected.items():
            if math.ceil(means(tier)) != e:
                self._recount(lengths)
                return
        self._generation = lengths.generation

    def _set_top(self) -> tuple[int, int, int]:
        top = self._top = self._longest_and_best()
        self._bound = top[:2]
        return top

    def _recount(self, lengths: OutputLengthTracker) -> None:
        means = lengths.mean
        expected: dict[str, int] = {}
        counts: dict[int, int] = {}
        kvs: dict[int, int] = {}
        waiting: list[tuple[float, int]] = []
        kv_all = num_decoding = kv_decoding = 0
        expected_get, counts_get, kvs_get = expected.get, counts.get, kvs.get
        for s in self.residents:
            out = s.num_output_tokens
            tokens = s.num_prompt_tokens + out
            kv_all += tokens
            if out and s.num_computed_tokens >= tokens - 1:
                num_decoding += 1
                kv_decoding += tokens
            else:
                s_slo = s.slo
                waiting.append((s.arrival + (s_slo.ttft_ms + out * s_slo.tpot_ms) / 1000.0,
                                tokens - s.num_computed_tokens))
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
        self._expected, self._counts, self._kvs, self.built_with = expected, counts, kvs, lengths
        self._generation = lengths.generation
        self._top = self._bound = self._index = None

    def _count(self, r: ResidentRequest, sign: int) -> None:
        """Adds (sign 1) or takes out (sign -1) one resident's share; one the summary does not hold leaves it to be
        rebuilt when next read."""
        out = r.num_output_tokens
        tokens = r.num_prompt_tokens + out
        e = self._expected.get(r.tier)
        if e is None:
            if sign < 0:
                self.built_with = None
                return
            e = self._expected[r.tier] = math.ceil(self.built_with.mean(r.tier))
        left = (e if e < r.max_tokens else r.max_tokens) - out
        if left < 1:
            left = 1
        count = self._counts.get(left, 0) + sign
        if count < 0:
            self.built_with = None
            return
        if out and r.num_computed_tokens >= tokens - 1:
            self.num_decoding += sign
            self.kv_decoding += sign * tokens
            self._chunks = {}
        else:
            r_slo = r.slo
            key = r.arrival + (r_slo.ttft_ms + out * r_slo.tpot_ms) / 1000.0
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
                    self.built_with = None
                    return
                del keys[i - 1], works[i - 1]
        self.num_residents += sign
        self.kv_residents += sign * tokens
        if count:
            self._counts[left] = count
            self._kvs[left] = self._kvs.get(left, 0) + sign * tokens
        else:
            del self._counts[left], self._kvs[left]
        if sign > 0 and self._bound is not None:
            longest, best = self._bound
            self._bound = (longest if longest > left else left,
                           max(best + tokens + left - 1, tokens + 2 * (left - 1)))
        self._top = self._index = None

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


@dataclass(slots=True, frozen=True)
class InstanceState:
    """An instance as one or more tests read it. A snapshot: its residents do not change while it is read (their
    summary is counted once)."""
    residents: Sequence[ResidentRequest]  # running and queued on the instance
    kv_capacity_tokens: int  # the instance's whole KV pool, in tokens
    iteration_end: float  # when the iteration in flight ends (<= now when idle)
    tpot_ms: float  # the TPOT its tier holds it to
    # the residents' summary: one kept by whoever owns them, or (None) one of the state's own, built when first read
    summary: ResidentSummary | None = field(default=None, compare=False, repr=False)
    summary_version: int = field(default=0, init=False, compare=False, repr=False)

    def __post_init__(self):
        if self.kv_capacity_tokens < 1:
            raise ValueError(f"kv_capacity_tokens must be positive, got {self.kv_capacity_tokens}")
        if not self.tpot_ms > 0:
            raise ValueError(f"tpot_ms must be positive, got {self.tpot_ms}")
        if self.summary is None:
            object.__setattr__(self, "summary", ResidentSummary(self.residents))
        object.__setattr__(self, "summary_version", self.summary.version)

    def resident_summary(self) -> ResidentSummary:
        """The summary of exactly these residents: the one given, unless its owner has changed it since this state
        was taken (then one of the state's own)."""
        summary = self.summary
        if summary.version != self.summary_version:
            summary = ResidentSummary(self.residents)
            object.__setattr__(self, "summary", summary)
            object.__setattr__(self, "summary_version", summary.version)
        return summary
