"""The latency model interface: predicted time of one engine iteration from the shape of its batch (DESIGN.md §2).

Three sources implement it: `ProfileTable` (measured grid, interpolated), `OnlineLatencyModel` (least squares on
the engine's own step timings) and `RooflineLatencyModel` (GPU and model figures, nothing measured).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from scheduler.types import StepStats


class LatencyModel(Protocol):
    def predict(self, num_prefill_tokens: int, num_decode_seqs: int, num_kv_tokens: int) -> float:
        """Seconds for one iteration computing `num_prefill_tokens` prompt tokens and one token for each of
        `num_decode_seqs` sequences, attending over `num_kv_tokens` context tokens summed across the batch."""
        ...


@runtime_checkable
class ChunkSolvingModel(LatencyModel, Protocol):
    """A model that solves its own prediction for the prefill chunk (the roofline's quadratic in c)."""

    def chunk_within(self, budget_s: float, num_prefill_tokens: int, num_decode_seqs: int,
                     num_kv_tokens: int) -> float:
        """The real c >= 0 at which predict(num_prefill_tokens + c, num_decode_seqs, num_kv_tokens + c) reaches
        `budget_s` (0 when even c = 0 is over it)."""
        ...


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


def scaled(base: LatencyModel, scale: float) -> LatencyModel:
    """`base` with every prediction times `scale`; `base` itself at scale 1 (no wrapper call on hot paths)."""
    if scale == 1.0:
        return base
    if isinstance(base, ChunkSolvingModel):
        return ScaledChunkSolvingModel(base, scale)
    return ScaledLatencyModel(base, scale)
