"""The CPU fast path (kernels.torch_native) beyond matching the reference (tests/test_kernels.py does that): it takes
torch's fused attention kernel, and its cheaper rewrites of norm and rotary round exactly like the plain formulas."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from kernels import reference, torch_native
from kernels.paged_batch import random_paged_batch

F32, BF16 = torch.float32, torch.bfloat16


def aten_ops_called(fn) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {event.key for event in prof.key_averages()}


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_attention_of_a_mixed_batch_runs_on_the_fused_sdpa_kernel(dtype):
    """Decode rows, a whole-prompt prefill and a chunk over a cached prefix: every SDPA call takes the fused CPU
    kernel. 3-D inputs fall back to the unfused math path (several times slower); this guards against that."""
    batch = random_paged_batch([1, 40, 1, 17], [70, 0, 9, 33], 6, 2, 64, 16, dtype, "cpu", seed=5)
    out = torch_native.paged_attention(*batch.attention_args())
    called = aten_ops_called(lambda: torch_native.paged_attention(*batch.attention_args()))
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in called
    assert "aten::_scaled_dot_product_attention_math" not in called
    tolerance = 1e-5 if dtype == F32 else 1.6e-2
    torch.testing.assert_close(out, reference.paged_attention(*batch.attention_args()), atol=tolerance,
                               rtol=tolerance)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_rms_norm_equals_torch_rms_norm_bit_for_bit(dtype):
    generator = torch.Generator().manual_seed(3)
    x = (torch.randn(37, 576, generator=generator) * 3).to(dtype)
    residual = torch.randn(37, 576, generator=generator).to(dtype)
    weight = torch.randn(576, generator=generator).to(dtype)
    assert torch.equal(torch_native.rms_norm(x, weight, 1e-5), F.rms_norm(x, (576,), weight, 1e-5))
    normed, new_residual = torch_native.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, x + residual)
    assert torch.equal(normed, F.rms_norm(x + residual, (576,), weight, 1e-5))


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_rotary_equals_the_plain_neox_formula_bit_for_bit(dtype):
    """x1 cos - x2 sin, x2 cos + x1 sin in q's dtype (the formula of transformers' apply_rotary_pos_emb)."""
    generator = torch.Generator().manual_seed(4)
    tokens, q_heads, kv_heads, head_dim = 13, 9, 3, 64
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    q = qkv[:, :q_heads * head_dim].view(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim:(q_heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    cos_sin_cache = torch.randn(4096, head_dim, generator=generator)
    positions = torch.randint(0, 4096, (tokens,), generator=generator)
    cos, sin = (half.to(dtype) for half in cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1))

    def plain(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    q_out, k_out = torch_native.rotary_embedding(q, k, positions, cos_sin_cache)
    assert torch.equal(q_out, plain(q)) and torch.equal(k_out, plain(k))


def test_store_notices_a_new_slot_mapping_with_padding_rows():
    """The slots are worked out once per slot_mapping; a later step's mapping with padding rows (-1) must not reuse
    the previous step's."""
    k_cache, v_cache = torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8)
    k, v = torch.ones(3, 2, 8), torch.full((3, 2, 8), 2.0)
    torch_native.store_kvcache(k, v, k_cache, v_cache, torch.tensor([0, 1, 2]))
    torch_native.store_kvcache(k * 5, v * 5, k_cache, v_cache, torch.tensor([-1, 20, -1]))
    flat_k, flat_v = k_cache.view(-1, 2, 8), v_cache.view(-1, 2, 8)
    assert flat_k[:3].eq(1).all() and flat_v[:3].eq(2).all()
    assert flat_k[20].eq(5).all() and flat_v[20].eq(10).all()
    assert flat_k[3:20].eq(0).all() and flat_k[21:].eq(0).all()
