"""Engine configuration: one slotted dataclass, checked once."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # a Hugging Face folder; None: the default model (SmolLM2-135M-Instruct)
    device: str = "cpu"
    dtype: str | None = None  # float32 | bfloat16 | float16; None: the checkpoint's own on CUDA, float32 on the CPU
    executor: str = "model"  # model | emulated
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory
    kv_cache_memory: int = 1 << 30  # bytes for the KV pool when num_kv_blocks is None (CPU); GPU: gpu_memory_utilization
    gpu_memory_utilization: float = 0.85
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's context length
    enable_prefix_caching: bool = True
    kernels: str = "auto"  # auto (vectorised torch on the CPU, Triton on CUDA) | reference | torch | triton | cuda
    enforce_eager: bool = False  # no CUDA graphs
    policy: str = "fcfs"  # fcfs (static budget, Sarathi-style) | edf | polyserve (multi-SLO, DESIGN.md §2)
    max_prefill_chunk: int | None = None  # polyserve's cap on one step's prefill tokens (default: the token budget)
    default_ttft_ms: float = 10_000.0  # the SLO of a request that names none
    default_tpot_ms: float = 1_000.0

    def __post_init__(self):
        if self.executor not in ("model", "emulated"):
            raise ValueError(f"executor must be 'model' or 'emulated', got {self.executor!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.policy not in ("fcfs", "edf", "polyserve"):
            raise ValueError(f"policy must be fcfs, edf or polyserve, got {self.policy!r}")
        if self.kernels not in ("auto", "reference", "torch", "triton", "cuda"):
            raise ValueError(f"kernels must be auto, reference, torch, triton or cuda, got {self.kernels!r}")
