"""Multi-SLO batch policy, latency model and attainability test (DESIGN.md §1-2). Pure Python: no torch, no clock."""
from scheduler.attainability import Attainability, AttainabilityChecker, Rejection
from scheduler.attainment import AttainmentTally, RequestLatency, measure_request
from scheduler.chunking import largest_chunk
from scheduler.edf import EDFPolicy
from scheduler.instance_state import InstanceState, RequestSnapshot
from scheduler.latency_model import LatencyModel
from scheduler.online_fit import OnlineLatencyModel
from scheduler.output_length import OutputLengthTracker
from scheduler.fcfs import FCFSPolicy
from scheduler.policy import BATCH_POLICIES, make_batch_policy
from scheduler.polyserve import PolyServePolicy
from scheduler.profile_table import ProfileTable
from scheduler.roofline import (A100_SXM, H100_SXM, H200_SXM, LLAMA_2_7B, LLAMA_3_1_8B, GpuSpec, ModelShape,
                                RooflineLatencyModel)
from scheduler.slo import SLO, next_token_deadline
from scheduler.tiers import DEFAULT_TIERS, Tier, TierSet, parse_tiers
from scheduler.types import BatchPolicy, KvState, SchedulableRequest, StepPlan, StepStats

__all__ = [
    "BATCH_POLICIES", "DEFAULT_TIERS", "make_batch_policy", "parse_tiers", "A100_SXM", "H100_SXM", "H200_SXM", "LLAMA_2_7B", "LLAMA_3_1_8B", "SLO", "Attainability",
    "AttainabilityChecker", "AttainmentTally", "BatchPolicy", "EDFPolicy", "FCFSPolicy", "GpuSpec", "InstanceState",
    "KvState", "LatencyModel", "ModelShape", "OnlineLatencyModel", "OutputLengthTracker", "PolyServePolicy",
    "ProfileTable", "Rejection", "RequestLatency", "RequestSnapshot", "RooflineLatencyModel", "SchedulableRequest",
    "StepPlan", "StepStats", "Tier", "TierSet", "largest_chunk", "measure_request", "next_token_deadline",
]
