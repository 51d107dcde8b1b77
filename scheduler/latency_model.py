"""The latency model interface: predicted time of one engine iteration from the shape of its batch (DESIGN.md §2).

Three sources implement it: `ProfileTable` (measured grid, interpolated), `OnlineLatencyModel` (least squares on
the engine's own step timings) and `RooflineLatencyModel` (GPU and model figures, nothing measured).
"""
from __future__ import annotations

from typing import Protocol


class LatencyModel(Protocol):
    def predict(self, num_prefill_tokens: int, num_decode_seqs: int, num_kv_tokens: int) -> float:
        """Seconds for one iteration computing `num_prefill_tokens` prompt tokens and one token for each of
        `num_decode_seqs` sequences, attending over `num_kv_tokens` context tokens summed across the batch."""
        ...
