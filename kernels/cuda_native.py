"""The CUDA C++ kernel of csrc/cuda (module kernels._cuda, built by setup.py where CUDA is present and its toolchain
can build it) behind the reference signature: the KV-cache store. A CUDA C++ decode attention was here too; on an
H200 the Triton kernel ran it at twice its speed, so it was dropped (bench/RESULTS.md)."""
from __future__ import annotations

import importlib

import torch

from kernels.kv_store import check_store_inputs


def load():
    """The compiled module; ImportError naming the cause when it was not built."""
    try:
        return importlib.import_module("kernels._cuda")
    except ImportError as error:
        raise ImportError("kernels._cuda is not built: install the project on a machine with CUDA "
                          "(pip install --no-build-isolation -v -e .) so setup.py compiles csrc/cuda; where it "
                          "cannot, the install's output says why") from error


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    check_store_inputs(k, v, k_cache, v_cache, slot_mapping)
    load().store_kvcache(k, v, k_cache, v_cache, slot_mapping)
