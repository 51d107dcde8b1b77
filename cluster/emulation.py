"""What an emulated engine stands in for: Llama-3.1-8B on one H200, its iteration time from the scheduler's roofline
model and its KV pool sized as the real GPU's would be. `time_scale` shrinks (or stretches) every iteration alike, so
tests run a fleet fast while the router and the engines' policies predict exactly the time the emulation sleeps.
"""
from __future__ import annotations

from scheduler.latency_model import LatencyModel
from scheduler.roofline import H200_SXM, LLAMA_3_1_8B, GpuSpec, ModelShape, RooflineLatencyModel

H200_MEMORY_BYTES = 141e9  # NVIDIA H200 SXM datasheet: 141 GB HBM3e


class ScaledLatencyModel:
    """`base` times a constant factor."""

    def __init__(self, base: LatencyModel, scale: float):
        if not scale > 0:
            raise ValueError(f"time scale must be positive, got {scale}")
        self.base, self.scale = base, scale
        within = getattr(base, "chunk_within", None)
        if scale == 1.0:  # no wrapper call on the router's hot path
            self.predict = base.predict
            if within is not None:
                self.chunk_within = within
        elif within is not None:
            self.chunk_within = lambda budget_s, *batch: within(budget_s / scale, *batch)

    def predict(self, num_prefill_tokens: int, num_decode_seqs: int, num_kv_tokens: int) -> float:
        return self.scale * self.base.predict(num_prefill_tokens, num_decode_seqs, num_kv_tokens)


def emulated_latency_model(time_scale: float = 1.0, gpu: GpuSpec = H200_SXM,
                           model: ModelShape = LLAMA_3_1_8B) -> ScaledLatencyModel:
    return ScaledLatencyModel(RooflineLatencyModel(gpu, model), time_scale)


def parameter_count(model: ModelShape) -> int:
    """Weights of a Llama-layout model: untied embedding and LM head, the layers' projections and two norms each,
    the final norm (8.03e9 for Llama-3.1-8B, its published size)."""
    per_layer = sum(i * o for i, o in model.layer_gemms()) + 2 * model.hidden_size
    return 2 * model.vocab_size * model.hidden_size + model.num_layers * per_layer + model.hidden_size


def kv_blocks_for_gpu(block_size: int = 16, memory_bytes: float = H200_MEMORY_BYTES,
                      memory_utilization: float = 0.9, model: ModelShape = LLAMA_3_1_8B) -> int:
    """KV blocks that fit beside the weights in `memory_utilization` of the GPU (activations not counted: an upper
    bound of a few percent, as vLLM's own profiling run would take that much back)."""
    if not 0 < memory_utilization <= 1:
        raise ValueError(f"memory_utilization must lie in (0, 1], got {memory_utilization}")
    kv_bytes_per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * model.dtype_bytes
    free = memory_bytes * memory_utilization - parameter_count(model) * model.dtype_bytes
    if free <= 0:
        raise ValueError(f"{model.name} does not fit in {memory_bytes / 1e9:.0f} GB at {memory_utilization:.0%}")
    return int(free // (kv_bytes_per_token * block_size))
