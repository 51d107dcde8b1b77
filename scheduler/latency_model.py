"""The latency model interface: predicted time of one engine iteration from the shape of its batch (DESIGN.md §2).

Three sources implement it: `ProfileTable` (measured grid, interpolated), `OnlineLatencyModel` (least squares on
the engine's own step timings) and `RooflineLatencyModel` (GPU and model figures, nothing measured).
"""
from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

from scheduler.types import StepStats


class LatencyModel(Protocol):
    def predict(self, num_prefill_tokens: int, num_decode_seqs: int, num_kv_tokens: int) -> float:
        """Seconds for one iteration computing `num_prefill_tokens` prompt tokens and one token for each of
        `num_decode_seqs` sequences, attending over `num_kv_tokens` context tokens summed across the batch."""
        ...


@runtime_checkable
class ChunkSolvingModel(LatencyModel, Protocol):
    """A model whose prediction is a quadratic in the prefill chunk (the roofline's: the chunk's causal pairs), and
    that solves it for the chunk."""

    def chunk_within(self, budget_s: float, num_prefill_tokens: int, num_decode_seqs: int,
                     num_kv_tokens: int) -> float:
        """The real c >= 0 at which predict(num_prefill_tokens + c, num_decode_seqs, num_kv_tokens + c) reaches
        `budget_s` (0 when even c = 0 is over it)."""
        ...

    def chunk_polynomial(self, num_prefill_tokens: int, num_decode_seqs: int,
                         num_kv_tokens: int) -> tuple[float, float, float]:
        """(q, l, k) with predict(num_prefill_tokens + c, num_decode_seqs, num_kv_tokens + c) = q c^2 + l c + k
        for every c >= 1 (the batch holds prefill tokens), up to rounding."""
        ...


def quadratic_root(quadratic: float, linear: float, constant: float) -> float:
    """The real c >= 0 at which quadratic c^2 + linear c + constant reaches 0, for quadratic, linear >= 0 (a
    prediction less its budget, growing with c): 0 when it is not below 0 at c = 0, inf when it never reaches 0."""
    if constant >= 0:
        return 0.0
    denominator = linear + math.sqrt(linear * linear - 4.0 * quadratic * constant)
    # the positive root, in the form without cancellation
    return -2.0 * constant / denominator if denominator > 0 else math.inf


@runtime_checkable
class LearningLatencyModel(LatencyModel, Protocol):
    """A model that learns from the steps the engine measured (its one owner feeds it once per step)."""

    def observe(self, stats: StepStats) -> None: ...


class ScaledLatencyModel:
    """`base` times a constant factor: an emulated fleet that runs faster (or slower) than the hardware it stands
    for, with every predictor seeing exactly the time the emulation sleeps."""

    def __init__(self, base: LatencyModel, scale: float):
        if not scale > 0:
            raise ValueError(f"time scale must be positive, got {scale}")
        self.base, self.scale = base, scale

    def predict(self, num_prefill_tokens: int, num_decode_seqs: int, num_kv_tokens: int) -> float:
        return self.scale * self.base.predict(num_prefill_tokens, num_decode_seqs, num_kv_tokens)


class ScaledChunkSolvingModel(ScaledLatencyModel):
    """`ScaledLatencyModel` of a model that solves for its chunk: the root at budget b of the scaled model is the
    base model's root at b / scale."""

    def chunk_within(self, budget_s: float, num_prefill_tokens: int, num_decode_seqs: int,
                     num_kv_tokens: int) -> float:
        return self.base.chunk_within(budget_s / self.scale, num_prefill_tokens, num_decode_seqs, num_kv_tokens)

    def chunk_polynomial(self, num_prefill_tokens: int, num_decode_seqs: int,
                         num_kv_tokens: int) -> tuple[float, float, float]:
        q, l, k = self.base.chunk_polynomial(num_prefill_tokens, num_decode_seqs, num_kv_tokens)
        return self.scale * q, self.scale * l, self.scale * k


def scaled(base: LatencyModel, scale: float) -> LatencyModel:
    """`base` with every prediction times `scale`; `base` itself at scale 1 (no wrapper call on hot paths)."""
    if scale == 1.0:
        return base
    if isinstance(base, ChunkSolvingModel):
        return ScaledChunkSolvingModel(base, scale)
    return ScaledLatencyModel(base, scale)
