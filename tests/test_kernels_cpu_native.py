"""The CPU C++ decode attention (kernels.cpu_native, csrc/cpu) against kernels.reference, and its use by the CPU
fast path (kernels.torch_native). The install builds the extension wherever torch imports (./run installs torch
first), so a missing one fails here unless the build was turned off with POLYSERVE_SKIP_CPU_KERNELS=1.

Same error bounds and poisoning as tests/test_kernels.py: the output buffer starts as NaN, and cache slots no
sequence owns hold NaN, so an unwritten element or a key read past a sequence's end fails the comparison.
"""
from __future__ import annotations

import os

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from kernels import cpu_native, reference, torch_native
from kernels.paged_batch import random_paged_batch
from test_kernels import BF16, F16, F32, assert_close, poisoned_allocations

if not cpu_native.available():
    if os.environ.get("POLYSERVE_SKIP_CPU_KERNELS") == "1":
        pytest.skip("kernels._cpu not built (POLYSERVE_SKIP_CPU_KERNELS=1)", allow_module_level=True)
    raise ImportError("kernels._cpu is not built: install the project with torch already installed "
                      "(pip install --no-build-isolation -e .)")

LAYOUTS = {"mha": (4, 4), "gqa3": (6, 2), "mqa": (8, 1)}  # (query heads, KV heads)


def decode_batch(block_size: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    """Decode rows over contexts of 0 (a padding row), 1, exactly one block, one block + 1, a few hundred tokens
    and a length that ends mid-block; returns the batch and the kernel's arguments."""
    context_lens = [0, 0, block_size - 1, block_size, 299, 2 * block_size + 4]
    batch = random_paged_batch([1] * len(context_lens), context_lens, q_heads, kv_heads, head_dim, block_size, dtype,
                               "cpu", seed=seed)
    batch.seq_lens[0] = 0
    return batch, (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.scale)


@pytest.mark.parametrize("block_size", [16, 32, 48])
@pytest.mark.parametrize("head_dim", [8, 48, 64, 128])
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_decode_attention_matches_reference(layout, dtype, head_dim, block_size):
    batch, args = decode_batch(block_size, *LAYOUTS[layout], head_dim, dtype, seed=head_dim + block_size)
    with poisoned_allocations():
        out = cpu_native.decode_attention(*args)
    assert_close(out, reference.paged_attention(*batch.attention_args()), dtype)
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # the length-0 row


def test_int64_tables_and_a_strided_query():
    """int64 block tables and lengths; q as the model hands it over: a head-range view of a wider tensor."""
    batch, _ = decode_batch(16, 6, 2, 64, BF16, seed=3)
    wide = torch.cat((batch.q, torch.full_like(batch.q[:, :2], float("nan"))), dim=1)  # [B, Hq + 2, D]
    q = wide[:, :6]
    assert not q.is_contiguous()
    out = cpu_native.decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables.long(),
                                      batch.seq_lens.long(), batch.scale)
    assert_close(out, reference.paged_attention(*batch.attention_args()), BF16)


@pytest.mark.parametrize("bad, message", [
    ("block", "outside the cache's"),
    ("length", "outside \\[0, "),
    ("dtype", "share one dtype"),
    ("heads", "not a multiple"),
])
def test_decode_attention_rejects_bad_input(bad, message):
    batch, (q, k_cache, v_cache, block_tables, seq_lens, scale) = decode_batch(16, 6, 2, 64, F32)
    if bad == "block":
        block_tables = block_tables.clone()
        block_tables[4, 0] = k_cache.shape[0]
    elif bad == "length":
        seq_lens = seq_lens.clone()
        seq_lens[4] = block_tables.shape[1] * 16 + 1
    elif bad == "dtype":
        v_cache = v_cache.to(BF16)
    else:
        q = q[:, :5]
    with pytest.raises(RuntimeError, match=message):
        cpu_native.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)


@pytest.fixture
def fresh_plan(monkeypatch):
    """torch_native caches its per-step plan by the identity of the metadata tensors; start each test without one."""
    monkeypatch.setattr(torch_native, "_last_plan", None)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_mixed_batch_decodes_with_the_cpp_kernel(fresh_plan, dtype):
    """Decode rows between prefills and a row with no query token: the decode rows go to the C++ kernel (the
    prefills still to SDPA) and the whole batch matches the reference."""
    batch = random_paged_batch([1, 40, 1, 0, 17, 1], [70, 0, 9, 5, 33, 300], 6, 2, 64, 16, dtype, "cpu", seed=5)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = torch_native.paged_attention(*batch.attention_args())
    called = {event.key for event in prof.key_averages()}
    assert "polyserve::cpu_decode_attention" in called
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in called
    assert_close(out, reference.paged_attention(*batch.attention_args()), dtype)


def test_sdpa_fallback_without_the_extension(fresh_plan, monkeypatch):
    monkeypatch.setattr(cpu_native, "available", lambda: False)
    batch = random_paged_batch([1, 23, 1], [50, 4, 0], 6, 2, 64, 16, BF16, "cpu", seed=6)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = torch_native.paged_attention(*batch.attention_args())
    assert "polyserve::cpu_decode_attention" not in {event.key for event in prof.key_averages()}
    assert_close(out, reference.paged_attention(*batch.attention_args()), BF16)
