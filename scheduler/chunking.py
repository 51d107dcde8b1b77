"""Dynamic chunking: the largest prefill chunk that keeps an iteration within a time budget (DESIGN.md §2)."""
from __future__ import annotations

from scheduler.latency_model import ChunkSolvingModel, LatencyModel


ROOT_MARGIN = 1e-6  # tokens: a root's rounding error is ~1e-16 relative, chunks are below 1e6 tokens


def largest_chunk(model: LatencyModel, budget_s: float, num_decode_seqs: int, num_kv_tokens: int, cap: int,
                  num_prefill_tokens: int = 0) -> int:
    """Largest c in [0, cap] with predict(num_prefill_tokens + c, num_decode_seqs, num_kv_tokens + c) <= budget_s;
    0 when not even one token fits.

    A chunk of c prompt tokens adds c to the context the batch attends over; `num_kv_tokens` holds the rest (the
    decodes' contexts, the chunk's cached prefix) and `num_prefill_tokens` what the batch already holds of other
    prefills. Binary search: exact for models that grow with every input (the three shipped ones do); for any
    other model the answer still fits the budget. A `ChunkSolvingModel` (the root of its prediction in c,
    scheduler/roofline.py) is searched from that root instead, a step or two in place of a dozen predictions;
    the root is only where the search starts (or, clear of every integer, the answer itself), so the answer is the
    same.
    """
    if cap <= 0:
        return 0
    predict = model.predict
    if _solves_chunk(model):  # a step or two from its root to the exact answer
        root = model.chunk_within(budget_s, num_prefill_tokens, num_decode_seqs, num_kv_tokens)
        # a root clear of every integer by far more than its rounding error is the answer as it stands
        if root >= cap + ROOT_MARGIN:
            return cap
        c = int(root)
        if root - c > ROOT_MARGIN and c + 1 - root > ROOT_MARGIN:
            return c
        while c > 0 and predict(num_prefill_tokens + c, num_decode_seqs, num_kv_tokens + c) > budget_s:
            c -= 1
        while c < cap and predict(num_prefill_tokens + c + 1, num_decode_seqs, num_kv_tokens + c + 1) <= budget_s:
            c += 1
        return c
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


_SOLVES_CHUNK: dict[type, bool] = {}


def _solves_chunk(model: LatencyModel) -> bool:
    """isinstance(model, ChunkSolvingModel), once per class: a runtime protocol check costs microseconds, and this
    is on the path of every chunk search."""
    cls = type(model)
    solves = _SOLVES_CHUNK.get(cls)
    if solves is None:
        solves = _SOLVES_CHUNK[cls] = isinstance(model, ChunkSolvingModel)
    return solves
