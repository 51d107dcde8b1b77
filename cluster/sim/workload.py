"""Workloads for the simulator and the live benchmarks (DESIGN.md §6): trace replay, Poisson arrivals with trace
lengths, a seeded tier mix, and a phase change that inverts the mix mid-run.

A workload is columns (numpy arrays, sorted by arrival) rather than objects: an hour at hundreds of instances is
millions of requests, and the simulator makes an object only for the request it is placing.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from scheduler.attainability import AttainabilityChecker
from scheduler.instance_state import RequestSnapshot
from scheduler.latency_model import LatencyModel
from scheduler.output_length import OutputLengthTracker
from scheduler.tiers import Tier, TierSet

TRACE_COLUMNS = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")
REFUSED = -1  # tier index of a request no tier can serve even on an idle instance


def traces_dir() -> Path:
    """../shared/traces beside the repository (CI clones the repo next to shared/)."""
    return Path(__file__).resolve().parents[3] / "shared" / "traces"


@dataclass(slots=True, frozen=True)
class Trace:
    """Arrival times (seconds from the trace's start) and lengths of a request trace, sorted by arrival."""
    name: str
    arrivals: np.ndarray  # float64
    prompt_lens: np.ndarray  # int64
    output_lens: np.ndarray  # int64

    def __post_init__(self):
        n = len(self.arrivals)
        if n == 0:
            raise ValueError(f"trace {self.name} is empty")
        if len(self.prompt_lens) != n or len(self.output_lens) != n:
            raise ValueError(f"trace {self.name}: columns have different lengths")
        if np.any(np.diff(self.arrivals) < 0):
            raise ValueError(f"trace {self.name}: arrivals must not decrease")
        if self.prompt_lens.min() < 1 or self.output_lens.min() < 1:
            raise ValueError(f"trace {self.name}: every request needs at least one prompt and one output token")

    @property
    def duration(self) -> float:
        return float(self.arrivals[-1] - self.arrivals[0])


def load_trace(name: str = "azure2023_conv", folder: Path | None = None) -> Trace:
    """A trace of ../shared/traces by file name (with or without .csv): columns arrived_at, num_prefill_tokens,
    num_decode_tokens."""
    path = (folder or traces_dir()) / (name if name.endswith(".csv") else name + ".csv")
    if not path.is_file():
        raise FileNotFoundError(f"trace {path} not found (expected ../shared/traces beside the repository)")
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or tuple(header) != TRACE_COLUMNS:
            raise ValueError(f"trace {path}: header must be {','.join(TRACE_COLUMNS)}, got {header}")
        rows = list(reader)
    try:
        arrivals = np.array([float(r[0]) for r in rows])
        prompts = np.array([int(r[1]) for r in rows], dtype=np.int64)
        outputs = np.array([int(r[2]) for r in rows], dtype=np.int64)
    except (ValueError, IndexError) as e:
        raise ValueError(f"trace {path}: malformed row ({e})") from None
    order = np.argsort(arrivals, kind="stable")
    return Trace(path.stem, arrivals[order] - arrivals[order[0]], prompts[order], outputs[order])


# ---- tiers ----------------------------------------------------------------------------------------------------
TIER_NAMES = ("tight", "snug", "relaxed", "loose")
TPOT_MULTIPLES = (2.5, 5.0, 10.0, 20.0)  # of an idle instance's one-sequence decode step
TTFT_MULTIPLES = (10.0, 20.0, 40.0, 80.0)  # of one full prefill chunk on an idle instance
DEFAULT_MIX = (0.1, 0.2, 0.3, 0.4)  # tightest first; the phase change reverses it


def default_tiers(model: LatencyModel, max_prefill_chunk: int = 2048, context_tokens: int = 2048) -> TierSet:
    """Four tiers from tight to loose, derived from the latency model: the tightest TPOT is 2.5x an idle decode step
    (one sequence of `context_tokens`), so an idle instance meets it with room for a batch; each looser tier doubles
    TPOT and TTFT. TTFT is counted in full prefill chunks: the tightest allows ten."""
    decode_s = model.predict(0, 1, context_tokens)
    chunk_s = model.predict(max_prefill_chunk, 0, max_prefill_chunk)
    return TierSet([Tier(name, tpot_ms=round(decode_s * tm * 1000.0, 2), ttft_ms=round(chunk_s * fm * 1000.0, 1))
                    for name, tm, fm in zip(TIER_NAMES, TPOT_MULTIPLES, TTFT_MULTIPLES)])


def max_idle_prompts(tiers: TierSet, model: LatencyModel, kv_capacity_tokens: int, max_prefill_chunk: int,
                     expected_output: float, longest: int = 1 << 20) -> list[int]:
    """Per tier, the longest prompt whose SLO an idle instance can meet (0: none), by the attainability test the
    router uses. The test is monotone in the prompt length (more chunks, more KV), so a bisection finds it."""
    checker = AttainabilityChecker(model, OutputLengthTracker(max(expected_output, 1.0)), max_prefill_chunk)

    def ok(tier: Tier, prompt: int) -> bool:
        snap = RequestSnapshot(arrival=0.0, num_prompt_tokens=prompt, max_tokens=1 << 30, slo=tier.slo,
                               tier=tier.name)
        return checker.check_idle(snap, kv_capacity_tokens).ok

    limits = []
    for tier in tiers:
        if not ok(tier, 1):
            limits.append(0)
            continue
        lo, hi = 1, longest  # ok(lo); hi: not known ok
        if ok(tier, hi):
            limits.append(hi)
            continue
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if ok(tier, mid) else (lo, mid)
        limits.append(lo)
    return limits


@dataclass(slots=True, frozen=True)
class TierMix:
    """Probability of each tier, tightest first."""
    weights: tuple[float, ...]

    def __post_init__(self):
        if not self.weights or any(not (w >= 0 and math.isfinite(w)) for w in self.weights) or sum(self.weights) <= 0:
            raise ValueError(f"tier mix weights must be non-negative, finite and not all zero, got {self.weights}")

    @property
    def probabilities(self) -> np.ndarray:
        w = np.asarray(self.weights, dtype=float)
        return w / w.sum()

    def inverted(self) -> "TierMix":
        """The mix with the tiers' shares reversed: the tightest tier takes the loosest one's share."""
        return TierMix(tuple(reversed(self.weights)))


# ---- the goodput matrix's workloads ---------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class WorkloadSpec:
    """A named workload of the goodput matrix (DESIGN.md §6): a trace's lengths, shares of the default tiers
    (tightest first), and whether the shares invert half way through the measured window."""
    name: str
    trace: str
    mix: tuple[float, ...]
    phase_change: bool = False

    def phase_change_at(self, window: tuple[float, float]) -> float | None:
        """When the mix inverts: in the middle of the measured `window`, so that the window holds as much of each
        phase and its tier shares are the average of the two mixes (the shares its fluid bound is computed on)."""
        return (window[0] + window[1]) / 2 if self.phase_change else None


# Equal shares wherever the mix is not what the workload is about: the headline rule needs every tier at 90 %, so
# equal shares weigh each tier's difficulty alike. The 3-tier mix drops snug, keeping the tightest and the loosest
# tier (the widest spread of deadlines on one instance) and a missing tier between tight and relaxed, so a
# promoted relaxed request lands on a much tighter instance; the 2-tier mix is interactive against batch, nothing
# between. The phase change starts light on
# the tightest tier and ends heavy on it, so the fleet must move instances between tiers within the window.
MATRIX_WORKLOADS = (
    WorkloadSpec("conv-4tier", "azure2023_conv", (1.0, 1.0, 1.0, 1.0)),
    WorkloadSpec("code-4tier", "azure2023_code", (1.0, 1.0, 1.0, 1.0)),
    WorkloadSpec("conv-3tier", "azure2023_conv", (1.0, 0.0, 1.0, 1.0)),
    WorkloadSpec("conv-2tier", "azure2023_conv", (1.0, 0.0, 0.0, 1.0)),
    WorkloadSpec("conv-phase", "azure2023_conv", DEFAULT_MIX, phase_change=True),
)


def workload_spec(name: str) -> WorkloadSpec:
    """The workload of MATRIX_WORKLOADS called `name`."""
    for spec in MATRIX_WORKLOADS:
        if spec.name == name:
            return spec
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(s.name for s in MATRIX_WORKLOADS)}")


# ---- workloads ------------------------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Workload:
    """Requests sorted by arrival. `tier_index` points into `tiers`; REFUSED marks a request whose SLO no tier can
    meet even on an idle instance (it is counted as refused at admission, never served)."""
    arrivals: np.ndarray
    prompt_lens: np.ndarray
    output_lens: np.ndarray
    tier_index: np.ndarray  # int8
    tiers: TierSet
    description: str = ""

    def __post_init__(self):
        n = len(self.arrivals)
        if not (len(self.prompt_lens) == len(self.output_lens) == len(self.tier_index) == n):
            raise ValueError("workload columns have different lengths")
        if n and np.any(np.diff(self.arrivals) < 0):
            raise ValueError("workload arrivals must not decrease")
        if n and (self.tier_index.max() >= len(self.tiers) or self.tier_index.min() < REFUSED):
            raise ValueError("workload tier index out of range")

    def __len__(self) -> int:
        return len(self.arrivals)

    @property
    def duration(self) -> float:
        return float(self.arrivals[-1] - self.arrivals[0]) if len(self) > 1 else 0.0

    @property
    def num_refused(self) -> int:
        return int(np.count_nonzero(self.tier_index == REFUSED))


def assign_tiers(arrivals: np.ndarray, prompt_lens: np.ndarray, mix: TierMix, max_prompts: Sequence[int],
                 rng: np.random.Generator, phase_change_at: float | None = None) -> np.ndarray:
    """A tier per request drawn from `mix` (from its inverse at and after `phase_change_at`); a request whose drawn
    tier an idle instance cannot meet moves to the nearest looser tier that it can, or is REFUSED if none."""
    num_tiers = len(mix.weights)
    if len(max_prompts) != num_tiers:
        raise ValueError(f"mix has {num_tiers} tiers but max_prompts has {len(max_prompts)}")
    u = rng.random(len(arrivals))
    cdf = np.cumsum(mix.probabilities)
    drawn = np.minimum(np.searchsorted(cdf, u, side="right"), num_tiers - 1)
    if phase_change_at is not None:
        late = arrivals >= phase_change_at
        cdf_late = np.cumsum(mix.inverted().probabilities)
        drawn[late] = np.minimum(np.searchsorted(cdf_late, u[late], side="right"), num_tiers - 1)
    tier = np.full(len(arrivals), REFUSED, dtype=np.int8)
    # loosest first, so each request ends on the tightest attainable tier at or looser than the drawn one
    for k in range(num_tiers - 1, -1, -1):
        fits = prompt_lens <= max_prompts[k]
        tier[(drawn <= k) & fits] = k
    return tier


class WorkloadFactory:
    """Builds seeded workloads over one trace's lengths for one tier set and serving setup.

    Each workload draws from its own seed: arrivals, lengths and tiers from independent streams of it, so the tier
    of request i does not change when, say, the rate changes the arrivals."""

    def __init__(self, trace: Trace, tiers: TierSet, model: LatencyModel, kv_capacity_tokens: int,
                 max_prefill_chunk: int, mix: TierMix | None = None):
        self.trace, self.tiers = trace, tiers
        self.mix = mix or TierMix(DEFAULT_MIX)
        if len(self.mix.weights) != len(tiers):
            raise ValueError(f"tier mix has {len(self.mix.weights)} weights for {len(tiers)} tiers")
        self.max_prompts = max_idle_prompts(tiers, model, kv_capacity_tokens, max_prefill_chunk,
                                            float(trace.output_lens.mean()))

    def _streams(self, seed: int) -> tuple[np.random.Generator, ...]:
        return tuple(np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))

    def poisson(self, rate: float, duration: float, seed: int, phase_change_at: float | None = None) -> Workload:
        """Poisson arrivals at `rate` per second over `duration` seconds; (prompt, output) pairs drawn from the
        trace with replacement."""
        if not (rate > 0 and duration > 0):
            raise ValueError(f"rate and duration must be positive, got {rate}, {duration}")
        arrival_rng, length_rng, tier_rng = self._streams(seed)
        # enough exponential gaps to pass `duration` with overwhelming probability, then cut
        n = int(rate * duration + 10 * math.sqrt(rate * duration) + 10)
        arrivals = np.cumsum(arrival_rng.exponential(1.0 / rate, n))
        arrivals = arrivals[arrivals < duration]
        rows = length_rng.integers(0, len(self.trace.arrivals), len(arrivals))
        prompts, outputs = self.trace.prompt_lens[rows], self.trace.output_lens[rows]
        tiers = assign_tiers(arrivals, prompts, self.mix, self.max_prompts, tier_rng, phase_change_at)
        return Workload(arrivals, prompts, outputs, tiers, self.tiers,
                        f"poisson rate={rate:g}/s duration={duration:g}s seed={seed} trace={self.trace.name}")

    def replay(self, seed: int, rate_scale: float = 1.0, duration: float | None = None,
               phase_change_at: float | None = None) -> Workload:
        """The trace itself, arrivals compressed `rate_scale` times (2: twice the rate), cut at `duration` seconds
        of the rescaled time when given."""
        if not rate_scale > 0:
            raise ValueError(f"rate_scale must be positive, got {rate_scale}")
        _, _, tier_rng = self._streams(seed)
        arrivals = self.trace.arrivals / rate_scale
        keep = slice(None) if duration is None else slice(0, int(np.searchsorted(arrivals, duration)))
        arrivals, prompts, outputs = arrivals[keep], self.trace.prompt_lens[keep], self.trace.output_lens[keep]
        tiers = assign_tiers(arrivals, prompts, self.mix, self.max_prompts, tier_rng, phase_change_at)
        return Workload(arrivals, prompts, outputs, tiers, self.tiers,
                        f"replay {self.trace.name} x{rate_scale:g} seed={seed}")
