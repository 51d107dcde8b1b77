"""Roofline latency model: an iteration's time from a GPU's bandwidth and matrix rate and a model's shapes, for when
nothing has been measured.

Each matrix product costs its FLOPs at the achievable matrix rate PLUS its bytes (weights, activations in and out)
at the achievable bandwidth. The sum, not the classic max: it over-predicts slightly where compute and memory
overlap and is affine in the token count, so `predict` is a handful of multiply-adds. With the default
efficiencies (0.8 of the matrix rate, 0.9 of the bandwidth), vidur's measured per-layer timings of the four
projection GEMMs of a Llama layer come out at 0.78-1.16x the prediction on H100 (Llama-2-7B, 1 to 4096 tokens) and
A100 (Llama-3-8B, 1 to 32768 tokens); tests/test_scheduler_latency.py checks this against ../shared/profiles/.
The classic max() form, with the best single pair of efficiencies, misses the knee (100-500 tokens) by up to 1.4x.

Attention: every decode query reads its sequence's whole KV (bytes at bandwidth) and does 4 * head_dim FLOPs per
(query, key) pair per head. The three inputs do not say which part of `num_kv_tokens` belongs to prefill chunks, so
a prefill chunk of c tokens is charged c^2 / 2 causal pairs within itself and its cached prefix only as KV read: it
under-charges a chunk with a long prefix (the prefix * c pairs); the online fit learns what this model misses.
"""
from __future__ import annotations

from dataclasses import dataclass

from scheduler.latency_model import LatencyModel, quadratic_root, scaled


@dataclass(slots=True, frozen=True)
class GpuSpec:
    name: str
    memory_bandwidth: float  # bytes/s, datasheet
    matmul_flops: float  # dense 16-bit tensor FLOP/s, datasheet
    compute_efficiency: float = 0.8  # achievable fraction of matmul_flops (fitted: module docstring)
    bandwidth_efficiency: float = 0.9  # achievable fraction of memory_bandwidth

    def __post_init__(self):
        if not (self.memory_bandwidth > 0 and self.matmul_flops > 0):
            raise ValueError(f"GPU {self.name}: bandwidth and matmul rate must be positive")
        if not (0 < self.compute_efficiency <= 1 and 0 < self.bandwidth_efficiency <= 1):
            raise ValueError(f"GPU {self.name}: efficiencies must lie in (0, 1]")


# NVIDIA datasheets, SXM parts, BF16 dense (half the "with sparsity" figure).
H100_SXM = GpuSpec("NVIDIA H100 SXM5 80GB", memory_bandwidth=3.35e12, matmul_flops=989.4e12)
H200_SXM = GpuSpec("NVIDIA H200 SXM 141GB", memory_bandwidth=4.8e12, matmul_flops=989.4e12)
A100_SXM = GpuSpec("NVIDIA A100 SXM4 80GB", memory_bandwidth=2.039e12, matmul_flops=312e12)


@dataclass(slots=True, frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2

    def __post_init__(self):
        for field_name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                           "intermediate_size", "vocab_size", "dtype_bytes"):
            if getattr(self, field_name) < 1:
                raise ValueError(f"model {self.name}: {field_name} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model {self.name}: num_heads {self.num_heads} is not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")

    @classmethod
    def from_hf_config(cls, config: dict, name: str = "", dtype_bytes: int = 2) -> "ModelShape":
        """Shapes from a Hugging Face Llama-family config.json (already parsed)."""
        heads = config["num_attention_heads"]
        return cls(name=name or config.get("_name_or_path", ""), num_layers=config["num_hidden_layers"],
                   hidden_size=config["hidden_size"], num_heads=heads,
                   num_kv_heads=config.get("num_key_value_heads", heads),
                   head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                   intermediate_size=config["intermediate_size"], vocab_size=config["vocab_size"],
                   dtype_bytes=dtype_bytes)

    def layer_gemms(self) -> tuple[tuple[int, int], ...]:
        """(in, out) features of one layer's projections: fused QKV, O, fused gate+up, down."""
        h, hd = self.hidden_size, self.head_dim
        return ((h, (self.num_heads + 2 * self.num_kv_heads) * hd), (self.num_heads * hd, h),
                (h, 2 * self.intermediate_size), (self.intermediate_size, h))


# Hugging Face config.json of meta-llama/Llama-3.1-8B and meta-llama/Llama-2-7b-hf.
LLAMA_3_1_8B = ModelShape("meta-llama/Llama-3.1-8B", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                          head_dim=128, intermediate_size=14336, vocab_size=128256)
LLAMA_2_7B = ModelShape("meta-llama/Llama-2-7b-hf", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=32,
                        head_dim=128, intermediate_size=11008, vocab_size=32000)


class RooflineLatencyModel:
    def __init__(self, gpu: GpuSpec, model: ModelShape):
        self.gpu, self.model = gpu, model
        byte_s = 1.0 / (gpu.memory_bandwidth * gpu.bandwidth_efficiency)
        flop_s = 1.0 / (gpu.matmul_flops * gpu.compute_efficiency)
        db, layers = model.dtype_bytes, model.num_layers
        gemms = model.layer_gemms()
        self._layer_weights_s = sum(i * o for i, o in gemms) * db * byte_s
        self._layer_per_token_s = sum(2 * i * o * flop_s + (i + o) * db * byte_s for i, o in gemms)
        h, v = model.hidden_size, model.vocab_size
        # constant: every layer's weights and the LM head's are read once per iteration
        self._fixed_s = layers * self._layer_weights_s + h * v * db * byte_s
        self._per_token_s = layers * self._layer_per_token_s
        self._per_logit_s = 2 * h * v * flop_s + (h + v) * db * byte_s
        self._per_kv_token_s = layers * 2 * model.num_kv_heads * model.head_dim * db * byte_s
        self._per_pair_s = layers * 4 * model.num_heads * model.head_dim * flop_s

    def layer_gemm_time(self, num_tokens: int) -> float:
        """Seconds for one layer's four projection GEMMs over `num_tokens` tokens."""
        return self._layer_weights_s + num_tokens * self._layer_per_token_s

    def predict(self, num_prefill_tokens: int, num_decode_seqs: int, num_kv_tokens: int) -> float:
        # logits for every decode and (at most, since the count of finishing prefills is unknown) one prefill
        num_logits = num_decode_seqs + (num_prefill_tokens > 0)
        pairs = num_kv_tokens + 0.5 * num_prefill_tokens * num_prefill_tokens
        return (self._fixed_s + (num_prefill_tokens + num_decode_seqs) * self._per_token_s
                + num_logits * self._per_logit_s + num_kv_tokens * self._per_kv_token_s + pairs * self._per_pair_s)

    def chunk_within(self, budget_s: float, num_prefill_tokens: int, num_decode_seqs: int,
                     num_kv_tokens: int) -> float:
        """The real c >= 0 at which predict(num_prefill_tokens + c, num_decode_seqs, num_kv_tokens + c) reaches
        `budget_s` (0 when even c = 0 is over it): `predict` is a quadratic in c there (the causal pairs of the
        prefill), so `scheduler.chunking.largest_chunk` starts its search from this root."""
        quadratic, linear, constant = self.chunk_polynomial(num_prefill_tokens, num_decode_seqs, num_kv_tokens)
        return quadratic_root(quadratic, linear, constant - budget_s)

    def chunk_polynomial(self, num_prefill_tokens: int, num_decode_seqs: int,
                         num_kv_tokens: int) -> tuple[float, float, float]:
        p, d, kv = num_prefill_tokens, num_decode_seqs, num_kv_tokens
        pair_s = self._per_pair_s
        return (0.5 * pair_s, self._per_token_s + self._per_kv_token_s + pair_s + p * pair_s,
                self._fixed_s + (p + d) * self._per_token_s + (d + 1) * self._per_logit_s
                + kv * (self._per_kv_token_s + pair_s) + 0.5 * p * p * pair_s)


# NVIDIA H200 SXM datasheet: 141 GB HBM3e.
H200_MEMORY_BYTES = 141e9


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


def emulated_latency_model(time_scale: float = 1.0, gpu: GpuSpec = H200_SXM,
                           model: ModelShape = LLAMA_3_1_8B) -> LatencyModel:
    """What an emulated engine stands in for by default: Llama-3.1-8B on one H200, by the roofline, every iteration
    times `time_scale` (tests run a fleet fast while every predictor sees exactly the time the emulation sleeps)."""
    return scaled(RooflineLatencyModel(gpu, model), time_scale)
