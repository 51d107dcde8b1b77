"""The one place that chooses, per device, the implementation of every op the model calls.

Backends:
  reference  the torch ops of kernels.reference (any device): slow, obviously correct, the oracle of the tests;
  torch      kernels.torch_native: vectorised torch (decode rows in the C++ kernel of kernels.cpu_native, prefill
             chunks in SDPA), the default on the CPU;
  triton     the Triton kernels (the default on CUDA). On CPU tensors they run only under Triton's interpreter,
             which Triton selects when each kernel is defined: TRITON_INTERPRET=1 must be in the environment
             before the first get_ops(..., backend="triton") (that call imports the kernel modules);
  cuda       the Triton kernels with the CUDA C++ KV-cache store of csrc/cuda in place of Triton's (needs the
             kernels._cuda extension and a CUDA device).
The Triton modules are imported here lazily, so importing `kernels` never imports triton; the first Triton or CUDA
bundle checks that the installed Triton is new enough for them.
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from kernels import reference, torch_native

BACKENDS = ("reference", "torch", "triton", "cuda")
TRITON_REQUIRED = (3, 4)  # the kernels read triton.knobs, which Triton 3.4 introduced


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
TORCH = Ops("torch", torch_native.store_kvcache, torch_native.paged_attention, torch_native.rms_norm,
            torch_native.fused_add_rms_norm, torch_native.rotary_embedding, torch_native.silu_and_mul)


def leading_decodes(q_lens: torch.Tensor) -> int:
    """How many sequences at the head of the batch have one query token each: every backend's attention runs them
    as decode rows (split-KV tiles) and the rest as prefill chunks (its `num_decodes`). The PolyServe policy
    schedules decodes first; under the others a prefill chunk scheduled before a decode only moves that decode to
    the prefill path."""
    others = (q_lens != 1).nonzero()
    return int(others[0]) if len(others) else len(q_lens)


def require_triton() -> None:
    """ImportError naming the installed and the required version where Triton is missing or too old for the
    kernels (checked before they are imported, which would fail on an older Triton with a less helpful error)."""
    try:
        import triton
    except ImportError as error:
        raise ImportError(f"the Triton kernels need triton >= {'.'.join(map(str, TRITON_REQUIRED))}, and triton is "
                          f"not installed (pip install the version pyproject.toml pins)") from error
    match = re.match(r"(\d+)\.(\d+)", triton.__version__)
    if match is None or tuple(map(int, match.groups())) < TRITON_REQUIRED:
        raise ImportError(f"the Triton kernels need triton >= {'.'.join(map(str, TRITON_REQUIRED))}; triton "
                          f"{triton.__version__} is installed (pip install the version pyproject.toml pins)")


def _triton_ops(device_type: str) -> Ops:
    require_triton()
    if device_type == "cpu" and "kernels.attention" not in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("Triton kernels on CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 in the "
                         "environment before the first get_ops(..., backend='triton')")
    from kernels import activation, attention, kv_store, norm, rotary

    if device_type == "cpu" and not attention.INTERPRETED:
        raise ValueError("the Triton kernels were already defined for the GPU in this process (kernels.attention "
                         "was imported before TRITON_INTERPRET=1 was set); they cannot run on CPU tensors")
    name = "triton-interpreter" if attention.INTERPRETED else "triton"
    return Ops(name, kv_store.store_kvcache, attention.paged_attention, norm.rms_norm, norm.fused_add_rms_norm,
               rotary.rotary_embedding, activation.silu_and_mul)


def _cuda_ops() -> Ops:
    require_triton()
    from kernels import cuda_native

    cuda_native.load()  # the ImportError names what is missing
    triton_ops = _triton_ops("cuda")
    return Ops("cuda", cuda_native.store_kvcache, triton_ops.paged_attention, triton_ops.rms_norm,
               triton_ops.fused_add_rms_norm, triton_ops.rotary_embedding, triton_ops.silu_and_mul)


def get_ops(device: str | torch.device, backend: str | None = None) -> Ops:
    """The ops for tensors on `device` ("cpu", "cuda", "cuda:1", ...): by default the vectorised torch ops on the
    CPU and the Triton kernels on CUDA; `backend` overrides (see the module docstring)."""
    device_type = torch.device(device).type
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"no ops for device {str(device)!r} (cpu or cuda)")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} asked for, but torch sees no CUDA device")
    if backend is None:
        backend = "torch" if device_type == "cpu" else "triton"
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose one of {BACKENDS}")
    if backend == "reference":
        return REFERENCE
    if backend == "torch":
        return TORCH
    if backend == "triton":
        return _triton_ops(device_type)
    if device_type != "cuda":
        raise ValueError("the 'cuda' backend (CUDA C++ kernels) needs a CUDA device")
    return _cuda_ops()
