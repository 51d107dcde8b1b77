"""The one place batch policies are built: the engine, the cluster worker and the simulator all call
`make_batch_policy`, so a policy name means the same object everywhere."""
from __future__ import annotations

from scheduler.edf import EDFPolicy
from scheduler.fcfs import FCFSPolicy
from scheduler.headroom import Headroom
from scheduler.latency_model import LatencyModel
from scheduler.polyserve import PolyServePolicy
from scheduler.types import BatchPolicy

BATCH_POLICIES = ("polyserve", "edf", "fcfs")


def make_batch_policy(name: str, latency_model: LatencyModel, max_num_seqs: int, max_num_batched_tokens: int,
                      max_prefill_chunk: int, headroom: Headroom | None = None) -> BatchPolicy:
    """`name`'s policy. PolyServe chunks prefills dynamically up to `max_prefill_chunk` tokens a step within the
    engine's `max_num_batched_tokens`, its budget less `headroom`'s margin; the static-budget baselines (FCFS, EDF)
    spend `max_prefill_chunk` tokens a step, decodes included: the same per-step prefill allowance, so a comparison
    differs in policy alone."""
    if name == "polyserve":
        return PolyServePolicy(latency_model, max_num_seqs, max_num_batched_tokens, max_prefill_chunk, headroom)
    if name == "edf":
        return EDFPolicy(max_num_seqs, max_prefill_chunk)
    if name == "fcfs":
        return FCFSPolicy(max_prefill_chunk, max_num_seqs)
    raise ValueError(f"batch policy must be one of {', '.join(BATCH_POLICIES)}, got {name!r}")
