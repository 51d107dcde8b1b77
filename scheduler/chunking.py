"""Dynamic chunking: the largest prefill chunk that keeps an iteration within a time budget (DESIGN.md §2)."""
from __future__ import annotations

from scheduler.latency_model import LatencyModel


def largest_chunk(model: LatencyModel, budget_s: float, num_decode_seqs: int, num_kv_tokens: int, cap: int,
                  num_prefill_tokens: int = 0) -> int:
    """Largest c in [0, cap] with predict(num_prefill_tokens + c, num_decode_seqs, num_kv_tokens + c) <= budget_s;
    0 when not even one token fits.

    A chunk of c prompt tokens adds c to the context the batch attends over; `num_kv_tokens` holds the rest (the
    decodes' contexts, the chunk's cached prefix) and `num_prefill_tokens` what the batch already holds of other
    prefills. Binary search: exact for models that grow with every input (the three shipped ones do); for any
    other model the answer still fits the budget.
    """
    if cap <= 0:
        return 0
    predict = model.predict
    if predict(num_prefill_tokens + cap, num_decode_seqs, num_kv_tokens + cap) <= budget_s:
        return cap
    lo, hi = 0, cap  # predict at lo fits (or lo == 0), at hi does not
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if predict(num_prefill_tokens + mid, num_decode_seqs, num_kv_tokens + mid) <= budget_s:
            lo = mid
        else:
            hi = mid
    return lo
