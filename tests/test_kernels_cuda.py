"""The CUDA C++ KV-cache store of csrc/cuda (module kernels._cuda) against the reference; GPU only, and only where
setup.py built the extension."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from kernels import reference
from test_kernels import BF16, F16, F32

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA C++ store needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("kernels._cuda") is None,
                       reason="kernels._cuda not built (pip install --no-build-isolation -e . on a CUDA machine)"),
]


@pytest.fixture(scope="module")
def cuda_native():
    from kernels import cuda_native

    return cuda_native


@pytest.mark.parametrize("dtype, slot_dtype", [(BF16, torch.int64), (F16, torch.int32), (F32, torch.int64)])
def test_store_kvcache_matches_reference(cuda_native, dtype, slot_dtype):
    generator = torch.Generator("cuda").manual_seed(1)
    tokens, kv_heads, head_dim, num_blocks, block_size = 1000, 8, 128, 300, 16
    qkv = torch.randn(tokens, (32 + 2 * kv_heads) * head_dim, generator=generator, device="cuda").to(dtype)
    k = qkv[:, 32 * head_dim:(32 + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (32 + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=generator, device="cuda")[:tokens]
    slot_mapping[::5] = -1
    slot_mapping = slot_mapping.to(slot_dtype)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator, device="cuda").to(dtype)
    v_cache = torch.randn_like(k_cache)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    reference.store_kvcache(k, v, k_expected, v_expected, slot_mapping)
    cuda_native.store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
