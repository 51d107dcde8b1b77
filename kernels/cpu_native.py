"""The CPU C++ kernel of csrc/cpu (module kernels._cpu, built by setup.py wherever torch imports): paged decode
attention that reads K and V in place from the cache. Optional: without the extension, available() is False and
kernels.torch_native keeps its gather + SDPA path."""
from __future__ import annotations

import importlib
from functools import cache

import torch


@cache
def _module():
    try:
        return importlib.import_module("kernels._cpu")
    except ImportError:
        return None


def available() -> bool:
    return _module() is not None


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence: q [B, Hq, D] with row i belonging to sequence i (block_tables[i],
    seq_lens[i], each int32 or int64); the caches in q's dtype (float32, bfloat16 or float16), any tensor's last
    dimension contiguous. The output has q's shape and dtype, zeros for a sequence of length 0."""
    module = _module()
    if module is None:
        raise ImportError("kernels._cpu is not built: install the project (pip install --no-build-isolation -e .) "
                          "with torch importable and POLYSERVE_SKIP_CPU_KERNELS unset")
    out = torch.empty(q.shape, dtype=q.dtype)
    module.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, out)
    return out
