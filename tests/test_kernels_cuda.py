"""The CUDA C++ kernels of csrc/cuda (module kernels._cuda) against the same reference; GPU only, and only where
setup.py built the extension. Bounds as in test_kernels.py."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from kernels import get_ops, reference
from kernels.paged_batch import random_paged_batch
from test_kernels import BF16, F16, F32, assert_close, poisoned_allocations

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA C++ kernels need a CUDA device"),
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


@pytest.mark.parametrize("dtype, q_heads, kv_heads, head_dim, block_size, num_splits", [
    (BF16, 32, 8, 128, 16, 1), (BF16, 32, 8, 128, 16, 6), (F16, 32, 4, 64, 32, 3),
    (F32, 8, 8, 128, 16, 2), (BF16, 24, 8, 64, 16, 1),  # group 3: one padded head in a block of 4
    (F16, 32, 1, 128, 16, 4),  # MQA: four blocks of 8 heads per KV head
])
def test_decode_attention_matches_reference(cuda_native, dtype, q_heads, kv_heads, head_dim, block_size,
                                            num_splits):
    generator = torch.Generator().manual_seed(q_heads + head_dim)
    contexts = torch.randint(0, 5000, (40,), generator=generator).tolist()
    batch = random_paged_batch([1] * 40, contexts, q_heads, kv_heads, head_dim, block_size, dtype, "cuda", seed=2)
    batch.seq_lens[7] = 0  # a graph-padding sequence: zeros
    with poisoned_allocations():
        out = cuda_native.decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                           batch.seq_lens, batch.scale, num_splits)
    assert torch.equal(out[7], torch.zeros_like(out[7]))
    assert_close(out, reference.paged_attention(*batch.attention_args()), dtype)


def test_cuda_bundle_sends_decodes_to_cuda_and_the_rest_to_triton():
    ops = get_ops("cuda", backend="cuda")
    decode = random_paged_batch([1] * 16, list(range(100, 1700, 100)), 32, 8, 128, 16, BF16, "cuda", seed=3)
    mixed = random_paged_batch([1, 300, 1], [900, 20, 5], 32, 8, 128, 16, BF16, "cuda", seed=4)
    for batch, max_query_len in ((decode, 1), (mixed, 300)):
        out = ops.paged_attention(*batch.attention_args(), max_query_len=max_query_len)
        assert_close(out, reference.paged_attention(*batch.attention_args()), BF16)


def test_cuda_decode_replays_in_a_cuda_graph(cuda_native):
    batch = random_paged_batch([1] * 8, [3000, 10, 700, 4095, 64, 1, 2000, 128], 32, 8, 128, 16, BF16, "cuda",
                               seed=5, poison_unused=False)

    def step() -> torch.Tensor:
        return cuda_native.decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                            batch.seq_lens, batch.scale, 4)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    batch.seq_lens.copy_(torch.tensor([5, 11, 1, 4096, 60, 2, 1999, 129], dtype=torch.int32))
    batch.q.copy_(torch.randn_like(batch.q))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, reference.paged_attention(*batch.attention_args()), BF16)
