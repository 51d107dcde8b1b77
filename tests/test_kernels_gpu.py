"""The Triton kernels against the reference at real shapes (Llama-3-8B attention: 32 query / 8 KV heads, head
dim 128, block 16), and inside a CUDA graph. GPU only; bounds as in test_kernels.py.

Triton modules are imported inside the tests, never at collection: on a CPU machine test_kernels.py must be
the first to define them (under the interpreter)."""
from __future__ import annotations

import pytest
import torch

from kernels import get_ops, reference
from kernels.paged_batch import random_paged_batch
from test_kernels import BF16, F16, F32, assert_close, llama3_cos_sin_cache, poisoned_allocations

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="real-shape kernel checks need a CUDA device")]


@pytest.fixture(scope="module")
def ops():
    return get_ops("cuda", backend="triton")


def ragged(count: int, low: int, high: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (count,), generator=generator).tolist()


@pytest.mark.parametrize("dtype, q_heads, kv_heads, head_dim, num_splits", [
    (BF16, 32, 8, 128, None), (BF16, 32, 8, 128, 7), (F16, 32, 4, 64, None), (F32, 8, 8, 128, 3),
    (BF16, 24, 8, 128, 2),  # group 3
])
def test_decode_at_real_shapes(ops, dtype, q_heads, kv_heads, head_dim, num_splits):
    contexts = ragged(32, 1, 6000, seed=head_dim + q_heads)
    batch = random_paged_batch([1] * 32, contexts, q_heads, kv_heads, head_dim, 16, dtype, "cuda", seed=1)
    with poisoned_allocations():
        out = ops.paged_attention(*batch.attention_args(), max_query_len=1, max_seq_len=max(contexts) + 1,
                                  num_splits=num_splits)
    assert_close(out, reference.paged_attention(*batch.attention_args()), dtype)


@pytest.mark.parametrize("dtype, kv_heads", [(BF16, 8), (F16, 4), (BF16, 32)])
def test_mixed_batch_at_real_shapes(ops, dtype, kv_heads):
    """24 decodes, a 512-token chunk over a 1000-token prefix (starts mid-block), a 2048-token first chunk and a
    77-token last chunk."""
    decodes = ragged(24, 1, 4000, seed=kv_heads)
    q_lens = [1] * 24 + [512, 2048, 77]
    contexts = decodes + [1000, 0, 3001]
    batch = random_paged_batch(q_lens, contexts, 32, kv_heads, 128, 16, dtype, "cuda", seed=2)
    with poisoned_allocations():
        out = ops.paged_attention(*batch.attention_args(), max_query_len=2048)
    assert_close(out, reference.paged_attention(*batch.attention_args()), dtype)


def test_decode_step_replays_in_a_cuda_graph(ops):
    """Capture store + attention once, then replay with other lengths, tokens and slots: a host sync or a launch
    shape read from the inputs would fail the capture or give a wrong replay."""
    contexts = [1500, 700, 2047, 64, 1, 900, 1200, 333]
    batch = random_paged_batch([1] * 8, contexts, 32, 8, 128, 16, BF16, "cuda", seed=3, poison_unused=False)
    generator = torch.Generator("cuda").manual_seed(4)
    k_new = torch.empty(8, 8, 128, device="cuda", dtype=BF16)
    v_new = torch.empty_like(k_new)
    slot_mapping = torch.empty(8, dtype=torch.int64, device="cuda")

    def fill(lens: list[int]) -> None:
        """New lengths (each within the sequence's blocks), new query and new K/V for the last position."""
        batch.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        batch.q.copy_(torch.randn(batch.q.shape, generator=generator, device="cuda"))
        k_new.copy_(torch.randn(k_new.shape, generator=generator, device="cuda"))
        v_new.copy_(torch.randn(v_new.shape, generator=generator, device="cuda"))
        last = torch.tensor(lens, device="cuda").long() - 1
        slot_mapping.copy_(batch.block_tables.gather(1, (last // 16)[:, None]).squeeze(1).long() * 16 + last % 16)

    def step() -> torch.Tensor:
        ops.store_kvcache(k_new, v_new, batch.k_cache, batch.v_cache, slot_mapping)
        return ops.paged_attention(*batch.attention_args(), max_query_len=1, num_splits=4)

    fill([c + 1 for c in contexts])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    for lens in ([1000, 2, 2048, 30, 1, 1, 1216, 200], [17, 650, 1999, 65, 2, 901, 3, 334]):  # within their blocks
        fill(lens)
        k_expected, v_expected = batch.k_cache.clone(), batch.v_cache.clone()
        reference.store_kvcache(k_new, v_new, k_expected, v_expected, slot_mapping)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(batch.k_cache, k_expected) and torch.equal(batch.v_cache, v_expected)
        assert_close(out, reference.paged_attention(*batch.attention_args()), BF16)


def test_kv_store_at_real_shapes(ops):
    generator = torch.Generator("cuda").manual_seed(5)
    tokens, num_blocks = 4096, 2048
    kv = torch.randn(tokens, 2, 8, 128, generator=generator, device="cuda").to(BF16)
    slot_mapping = torch.randperm(num_blocks * 16, generator=generator, device="cuda")[:tokens]
    slot_mapping[::7] = -1
    k_cache = torch.randn(num_blocks, 16, 8, 128, generator=generator, device="cuda").to(BF16)
    v_cache = torch.randn_like(k_cache)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    reference.store_kvcache(kv[:, 0], kv[:, 1], k_expected, v_expected, slot_mapping)
    ops.store_kvcache(kv[:, 0], kv[:, 1], k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_small_ops_at_real_shapes(ops, dtype):
    generator = torch.Generator("cuda").manual_seed(6)
    tokens, hidden, intermediate = 2048, 4096, 14336
    x = torch.randn(tokens, hidden, generator=generator, device="cuda").to(dtype)
    residual = torch.randn(tokens, hidden, generator=generator, device="cuda").to(dtype)
    weight = torch.randn(hidden, generator=generator, device="cuda").to(dtype)
    with poisoned_allocations():
        normed, new_residual = ops.fused_add_rms_norm(x, residual, weight, 1e-5)
        alone = ops.rms_norm(x, weight, 1e-5)
    ref_normed, ref_residual = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert_close(new_residual, ref_residual, dtype)
    assert_close(normed, ref_normed, dtype)
    assert_close(alone, reference.rms_norm(x, weight, 1e-5), dtype)

    qkv = torch.randn(tokens, 48 * 128, generator=generator, device="cuda").to(dtype)
    q, k = qkv[:, :4096].view(tokens, 32, 128), qkv[:, 4096:5120].view(tokens, 8, 128)
    cache = llama3_cos_sin_cache(128, 131072).cuda()
    positions = torch.randint(0, 131072, (tokens,), generator=generator, device="cuda")
    with poisoned_allocations():
        q_out, k_out = ops.rotary_embedding(q, k, positions, cache)
    q_ref, k_ref = reference.rotary_embedding(q, k, positions, cache)
    assert_close(q_out, q_ref, dtype)
    assert_close(k_out, k_ref, dtype)

    gate_up = torch.randn(tokens, 2 * intermediate, generator=generator, device="cuda").to(dtype) * 3
    with poisoned_allocations():
        act = ops.silu_and_mul(gate_up)
    assert_close(act, reference.silu_and_mul(gate_up), dtype)
