"""The one place that chooses, per device, the implementation of every op the model calls."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kernels import reference


@dataclass(slots=True, frozen=True)
class Ops:
    name: str
    store_kvcache: Callable
    paged_attention: Callable
    rms_norm: Callable
    fused_add_rms_norm: Callable
    rotary_embedding: Callable
    silu_and_mul: Callable


REFERENCE = Ops("reference", reference.store_kvcache, reference.paged_attention, reference.rms_norm,
                reference.fused_add_rms_norm, reference.rotary_embedding, reference.silu_and_mul)


def get_ops(device: str, backend: str = "auto") -> Ops:
    """Reference ops on the CPU; the GPU kernels on CUDA (added with the kernels)."""
    if device == "cpu" and backend in ("auto", "reference"):
        return REFERENCE
    raise ValueError(f"no kernels for device {device!r} yet")
