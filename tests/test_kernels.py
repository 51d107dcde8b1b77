"""Every Triton kernel against its torch reference at small shapes, on fresh random inputs.

Without a GPU the kernels run in Triton's interpreter. Triton picks interpreter or compiler when a kernel is
defined, i.e. when kernels.attention & co. are first imported, so TRITON_INTERPRET is set here, at collection,
before any test imports them (kernels/__init__ imports no Triton module). With a GPU the same tests run the
compiled kernels on CUDA tensors.

Error bounds, per element: |out - ref| <= tol * (|ref| + max|ref|), with tol by dtype:
  float32  1e-5    (same fp32 math, other summation order)
  float16  2e-3    (2 ulp at 2^-10: the output rounding, plus P rounded to fp16 before P·V on the GPU)
  bfloat16 1.6e-2  (2 ulp at 2^-7: the interpreter truncates fp32 -> bf16 instead of rounding, 1 ulp)
Every buffer a kernel allocates is poisoned with NaN first (see `poisoned_allocations`), and cache slots no
sequence owns hold NaN, so an element left unwritten or a key read by mistake fails the comparison.
"""
from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from kernels import get_ops, reference  # noqa: E402
from kernels.paged_batch import random_paged_batch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter converts a one-element array to an int when a loop bound is a tensor (its own code).
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.fixture(scope="module")
def ops():
    return get_ops(DEVICE, backend="triton")


@contextlib.contextmanager
def poisoned_allocations():
    """torch.empty / torch.empty_like hand out NaN-filled floating tensors while active; yields the list of them."""
    empty, empty_like = torch.empty, torch.empty_like
    allocated = []

    def poison(t):
        if t.is_floating_point():
            allocated.append(t.fill_(float("nan")))
        return t

    torch.empty = lambda *a, **k: poison(empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison(empty_like(*a, **k))
    try:
        yield allocated
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any(), f"{int(out.isnan().sum())} output elements unwritten or poisoned"
    out, ref = out.float(), ref.float()
    tol = TOLERANCE[dtype]
    bound = tol * (ref.abs() + ref.abs().max())
    excess = (out - ref).abs() - bound
    worst = int(excess.argmax())
    assert excess.max() <= 0, (f"{int((excess > 0).sum())} elements beyond tolerance {tol}; worst "
                               f"out={out.flatten()[worst].item()} ref={ref.flatten()[worst].item()}")


# (name, q_lens, context_lens, q_heads, kv_heads, head_dim, block_size, dtype, num_splits)
ATTENTION_CASES = [
    ("decode-mha-fp32", [1] * 5, [0, 15, 33, 50, 95], 4, 4, 64, 16, F32, 1),
    ("decode-gqa3-bf16-split3", [1] * 4, [6, 40, 63, 130], 6, 2, 128, 16, BF16, 3),
    ("decode-mqa8-fp16-split4", [1] * 3, [89, 4, 47], 8, 1, 64, 32, F16, 4),
    ("prefill-gqa3-fp16", [7, 23, 40], [0, 5, 19], 6, 2, 64, 16, F16, 1),
    ("prefill-mqa8-bf16", [33, 16], [3, 45], 8, 1, 128, 32, BF16, 1),
    ("prefill-mha-fp32-split2", [20, 9], [29, 0], 4, 4, 128, 16, F32, 2),
    ("mixed-gqa3-bf16", [1, 1, 37, 0, 1, 12], [40, 2, 11, 9, 70, 0], 6, 2, 128, 16, BF16, 1),
    ("mixed-mqa8-fp32-split3", [1, 25, 1], [100, 6, 2], 8, 1, 64, 16, F32, 3),
    ("mixed-mha-fp16-block48", [5, 1, 1, 18], [27, 60, 1, 13], 4, 4, 64, 48, F16, 1),
    # Head dims other than 64/128 run padded to a power of two (the engine's tiny test models use 8 to 32).
    ("mixed-gqa2-fp32-dim48-split2", [1, 14, 1], [33, 4, 0], 4, 2, 48, 16, F32, 2),
    ("decode-gqa3-bf16-dim8", [1] * 3, [17, 2, 40], 3, 1, 8, 16, BF16, 1),
    # Launches of LONG_DECODE_MIN_SEQS decode rows or more take the long decode tile.
    ("decode-gqa2-bf16-long-tile-split2", [1] * 9, [0, 37, 74, 111, 148, 185, 222, 259, 296], 4, 2, 64, 16, BF16, 2),
    ("decode-mha-fp16-long-tile", [1] * 8, [53, 106, 159, 212, 265, 28, 81, 134], 2, 2, 32, 16, F16, 1),
]


@pytest.fixture
def attention_module(ops):
    from kernels import attention

    return attention


@pytest.fixture
def short_splits(attention_module, monkeypatch):
    """Splits of 16 keys or more, so the short contexts the interpreter can afford use several of them."""
    monkeypatch.setattr(attention_module, "MIN_KEYS_PER_SPLIT", 16)


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=[c[0] for c in ATTENTION_CASES])
def test_paged_attention_matches_reference(ops, short_splits, case):
    _, q_lens, context_lens, q_heads, kv_heads, head_dim, block_size, dtype, num_splits = case
    batch = random_paged_batch(q_lens, context_lens, q_heads, kv_heads, head_dim, block_size, dtype, DEVICE,
                               seed=len(q_lens) * 1000 + sum(context_lens))
    with poisoned_allocations():
        out = ops.paged_attention(*batch.attention_args(), num_splits=num_splits)
    assert_close(out, reference.paged_attention(*batch.attention_args()), dtype)


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=[c[0] for c in ATTENTION_CASES])
def test_torch_bundle_attention_matches_reference(case):
    """The vectorised torch attention (the CPU default) on the same batches, NaN-poisoned unowned slots included."""
    _, q_lens, context_lens, q_heads, kv_heads, head_dim, block_size, dtype, _ = case
    batch = random_paged_batch(q_lens, context_lens, q_heads, kv_heads, head_dim, block_size, dtype, DEVICE, seed=9)
    out = get_ops(DEVICE, backend="torch").paged_attention(*batch.attention_args())
    assert_close(out, reference.paged_attention(*batch.attention_args()), dtype)


def test_decode_hint_and_default_splits_match_reference(ops):
    """max_query_len=1 and max_seq_len steer the launch (decode tiles, split count); the result must not move."""
    batch = random_paged_batch([1] * 3, [300, 17, 129], 6, 2, 64, 16, F16, DEVICE, seed=7)
    ref = reference.paged_attention(*batch.attention_args())
    with poisoned_allocations():
        hinted = ops.paged_attention(*batch.attention_args(), max_query_len=1, max_seq_len=301)
        default = ops.paged_attention(*batch.attention_args())
    assert_close(hinted, ref, F16)
    assert_close(default, ref, F16)


# (name, q_lens, context_lens, q_heads, kv_heads, head_dim, block_size, dtype, num_splits, num_decodes)
MIXED_CASES = [
    ("gqa4-bf16-split4", [1, 1, 1, 37, 12], [40, 150, 0, 11, 70], 8, 2, 64, 16, BF16, 4, 3),
    # The decode after the first prefill chunk is left to the prefill launch.
    ("mha-fp16-auto-splits", [1, 1, 19, 1, 5], [27, 60, 13, 2, 0], 4, 4, 64, 16, F16, None, 2),
    ("gqa4-fp32-dim48-split3", [1, 33, 7], [95, 0, 130], 8, 2, 48, 16, F32, 3, 1),
    ("mha-bf16-block48-split2", [1, 1, 1, 1, 9], [51, 7, 100, 33, 20], 4, 4, 128, 48, BF16, 2, 4),
]


@pytest.mark.parametrize("case", MIXED_CASES, ids=[c[0] for c in MIXED_CASES])
def test_mixed_batch_runs_decode_rows_on_decode_tiles(ops, attention_module, short_splits, monkeypatch, case):
    """With the decode rows first, they get a launch of their own (decode tiles, no search, split-KV) and the
    prefill chunks after them another, over the rest of the tokens; together they match the reference."""
    _, q_lens, context_lens, q_heads, kv_heads, head_dim, block_size, dtype, num_splits, num_decodes = case
    batch = random_paged_batch(q_lens, context_lens, q_heads, kv_heads, head_dim, block_size, dtype, DEVICE,
                               seed=sum(q_lens) + sum(context_lens))
    launches = []
    launch = attention_module._launch
    monkeypatch.setattr(attention_module, "_launch", lambda *a, **k: launches.append(k) or launch(*a, **k))
    with poisoned_allocations():
        out = ops.paged_attention(*batch.attention_args(), max_query_len=max(q_lens),
                                  max_seq_len=int(batch.seq_lens.max()), num_splits=num_splits,
                                  num_decodes=num_decodes)
    assert_close(out, reference.paged_attention(*batch.attention_args()), dtype)
    layout = [(k["first_token"], k["num_tokens"], k["decode"], k["single_query"]) for k in launches]
    assert layout == [(0, num_decodes, True, True), (num_decodes, sum(q_lens) - num_decodes, False, False)]
    if num_splits is not None:
        assert [k["num_splits"] for k in launches] == [num_splits, num_splits]


def test_paged_attention_rejects_num_decodes_past_the_single_token_rows(ops):
    batch = random_paged_batch([1, 4], [5, 9], 4, 2, 64, 16, F32, DEVICE)
    with pytest.raises(ValueError, match="num_decodes must be in"):
        ops.paged_attention(*batch.attention_args(), num_decodes=3)


def test_split_count_follows_each_sequence_not_the_launch(ops, attention_module):
    """A CUDA graph launches the split count of the longest context it may meet (32 at batch 1 on an H100-class
    device). Each sequence must use only the splits its keys fill, one per MIN_KEYS_PER_SPLIT: the others write
    log-sum-exp -inf and no partial output (left NaN here), and the result still matches the reference."""
    graph_splits = attention_module.choose_num_splits(1, 2, None, 132)
    assert graph_splits == attention_module.MAX_SPLITS
    min_keys = attention_module.MIN_KEYS_PER_SPLIT
    context_lens = [0, 40, 2 * min_keys + 50, min_keys - 1]
    batch = random_paged_batch([1] * 4, context_lens, 8, 2, 64, 16, F16, DEVICE, seed=41)
    batch.seq_lens[0] = 0  # a graph's padding slot
    with poisoned_allocations() as allocated:
        out = ops.paged_attention(*batch.attention_args(), max_query_len=1, num_splits=graph_splits)
    assert_close(out, reference.paged_attention(*batch.attention_args()), F16)
    partial_out = next(t for t in allocated if t.dim() == 4 and t.shape[0] == graph_splits)
    partial_lse = next(t for t in allocated if t.dim() == 3 and t.shape[0] == graph_splits)
    for seq, seq_len in enumerate(batch.seq_lens.tolist()):
        written = (~partial_out[:, seq].isnan()).flatten(1).any(1)
        used = int(written.sum())
        assert written[:used].all(), f"sequence {seq}: the splits it uses are not the first ones"
        most = max(1, seq_len // min_keys) if seq_len else 0
        assert (used >= 1 or seq_len == 0) and used <= most, (seq, seq_len, used)
        assert (partial_lse[used:, seq] == float("-inf")).all()
    assert int((~partial_out[:, 2].isnan()).flatten(1).any(1).sum()) == 2  # 2 * MIN_KEYS_PER_SPLIT + 50 keys


def test_choose_num_splits_from_the_real_context():
    from kernels.attention import MAX_SPLITS, MIN_KEYS_PER_SPLIT, choose_num_splits

    assert choose_num_splits(1, 8, 100, 132) == 1  # short: one split, whatever the device's size
    assert choose_num_splits(1, 8, 16 * MIN_KEYS_PER_SPLIT, 132) == 16  # capped by the keys
    assert choose_num_splits(1, 8, None, 132) == MAX_SPLITS  # a graph's bound
    assert choose_num_splits(8, 8, 32 * MIN_KEYS_PER_SPLIT, 132) == 5  # about two programs per multiprocessor
    assert choose_num_splits(64, 8, 32 * MIN_KEYS_PER_SPLIT, 132) == 1  # the batch fills the device


@pytest.mark.parametrize("num_splits, tokens, heads, head_dim, dtype", [
    (3, 5, 4, 64, F32), (32, 2, 3, 48, BF16), (1, 3, 2, 128, F16)])
def test_merge_splits_matches_reference(attention_module, num_splits, tokens, heads, head_dim, dtype):
    """Partials as the attention kernel leaves them: splits past a sequence's keys have log-sum-exp -inf and a
    partial output never written (NaN here), and one (token, head) saw no key at all (zeros)."""
    generator = torch.Generator(DEVICE).manual_seed(num_splits)
    partial_out = torch.randn(num_splits, tokens, heads, head_dim, generator=generator, device=DEVICE)
    partial_lse = torch.randn(num_splits, tokens, heads, generator=generator, device=DEVICE) * 8
    empty = torch.rand(num_splits, tokens, heads, generator=generator, device=DEVICE) < 0.4
    empty[:, 0, 0] = True
    empty[0, 1:] = False
    partial_lse[empty] = float("-inf")
    partial_out[empty] = float("nan")
    out = torch.full((tokens, heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    attention_module.merge_splits(partial_out, partial_lse, out)
    expected = reference.merge_splits(partial_out, partial_lse)
    assert torch.equal(expected[0, 0], torch.zeros(head_dim, device=DEVICE))
    assert_close(out, expected.to(dtype), dtype)


def test_padding_sequence_gets_zeros(ops):
    """A CUDA-graph runner pads decode batches with sequences of length 0: their rows must be zeros, not NaN."""
    batch = random_paged_batch([1, 1], [20, 0], 4, 2, 64, 16, F32, DEVICE, seed=3)
    batch.seq_lens[1] = 0
    for num_splits in (1, 2):
        with poisoned_allocations():
            out = ops.paged_attention(*batch.attention_args(), num_splits=num_splits)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert_close(out, reference.paged_attention(*batch.attention_args()), F32)


@pytest.mark.parametrize("bad, message", [
    (dict(head_dim=320), "head_dim 320 unsupported"),
    (dict(kv_heads=3), "not a multiple"),
    (dict(cache_dtype=F16), "differ from q's"),
    (dict(num_splits=0), "num_splits must be in"),
])
def test_paged_attention_rejects_bad_input(ops, bad, message):
    head_dim, kv_heads = bad.get("head_dim", 64), bad.get("kv_heads", 2)
    batch = random_paged_batch([1, 3], [5, 9], 4, kv_heads, head_dim, 16, F32, DEVICE)
    k_cache = batch.k_cache.to(bad.get("cache_dtype", F32))
    with pytest.raises(ValueError, match=message):
        ops.paged_attention(batch.q, k_cache, batch.v_cache, *batch.attention_args()[3:],
                            num_splits=bad.get("num_splits"))


@pytest.mark.parametrize("block_major", [True, False], ids=["block-major", "contiguous"])
@pytest.mark.parametrize("dtype, slot_dtype, block_size", [(F32, torch.int64, 16), (BF16, torch.int32, 32),
                                                           (F16, torch.int64, 16)])
def test_store_kvcache_writes_exactly_the_mapped_slots(ops, dtype, slot_dtype, block_size, block_major):
    """Into a layer of a block-major cache (the engine's: blocks strided, the other layers' between them) or a
    contiguous one: the mapped slots and nothing else, the other layers untouched."""
    generator = torch.Generator(DEVICE).manual_seed(11)
    tokens, kv_heads, head_dim, num_blocks = 37, 3, 64, 9
    # k and v as the model produces them: column slices of one fused projection, not contiguous.
    qkv = torch.randn(tokens, (4 + 2 * kv_heads) * head_dim, generator=generator, device=DEVICE).to(dtype)
    k = qkv[:, 4 * head_dim:(4 + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (4 + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=generator, device=DEVICE)[:tokens]
    slots[torch.randperm(tokens, generator=generator, device=DEVICE)[:5]] = -1
    slot_mapping = slots.to(slot_dtype)
    shape = (num_blocks, 3, 2, block_size, kv_heads, head_dim) if block_major else (2, num_blocks, block_size,
                                                                                     kv_heads, head_dim)
    cache = torch.randn(shape, generator=generator, device=DEVICE).to(dtype)

    def layer(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (kv[:, 1, 0], kv[:, 1, 1]) if block_major else (kv[0], kv[1])

    expected = cache.clone()
    reference.store_kvcache(k, v, *layer(expected), slot_mapping)
    assert not torch.equal(expected, cache)
    for bundle in (ops, get_ops(DEVICE, backend="torch")):
        out = cache.clone()
        bundle.store_kvcache(k, v, *layer(out), slot_mapping)
        assert torch.equal(out, expected), bundle.name


def test_store_then_attend_over_chunked_prefill_and_decodes(ops):
    """The engine's use: each step stores its new K/V into one layer of a block-major cache, then attends. Two
    sequences prefill in chunks that end mid-block, then decode; the Triton, torch and reference bundles must agree
    at every step, and no bundle writes into the other layers."""
    generator = torch.Generator(DEVICE).manual_seed(5)
    q_heads, kv_heads, head_dim, block_size, dtype = 6, 2, 64, 16, F16
    block_tables = torch.tensor([[5, 2, 7, 0], [3, 6, 1, 4]], dtype=torch.int32, device=DEVICE)
    block_major = {name: torch.zeros(8, 3, 2, block_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)
                   for name in ("triton", "torch", "reference")}
    caches = {name: (kv[:, 1, 0], kv[:, 1, 1]) for name, kv in block_major.items()}
    seq_lens = [0, 0]
    for step_q_lens in ([11, 0], [20, 13], [1, 9], [1, 1], [1, 1]):
        positions = [torch.arange(seq_lens[i], seq_lens[i] + n) for i, n in enumerate(step_q_lens)]
        seq_lens = [seq_lens[i] + n for i, n in enumerate(step_q_lens)]
        slot_mapping = torch.cat([block_tables[i].cpu()[p // block_size].long() * block_size + p % block_size
                                  for i, p in enumerate(positions)]).to(DEVICE)
        tokens = sum(step_q_lens)
        q, k, v = (torch.randn(tokens, h, head_dim, generator=generator, device=DEVICE).to(dtype)
                   for h in (q_heads, kv_heads, kv_heads))
        query_start_loc = torch.tensor([0, step_q_lens[0], tokens], dtype=torch.int32, device=DEVICE)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
        outs = {}
        for name, bundle in (("triton", ops), ("torch", get_ops(DEVICE, backend="torch")),
                             ("reference", get_ops(DEVICE, backend="reference"))):
            k_cache, v_cache = caches[name]
            bundle.store_kvcache(k, v, k_cache, v_cache, slot_mapping)
            outs[name] = bundle.paged_attention(q, k_cache, v_cache, block_tables, lens, query_start_loc,
                                                head_dim ** -0.5)
        assert torch.equal(block_major["triton"], block_major["reference"])
        assert torch.equal(block_major["torch"], block_major["reference"])
        assert not block_major["reference"][:, [0, 2]].any()
        assert_close(outs["triton"], outs["reference"], dtype)
        assert_close(outs["torch"], outs["reference"], dtype)


@pytest.mark.parametrize("dtype, shape", [(F32, (5, 200)), (BF16, (7, 3, 64)), (F16, (4, 1000))])
def test_rms_norm_matches_reference(ops, dtype, shape):
    generator = torch.Generator(DEVICE).manual_seed(13)
    x = (torch.randn(shape, generator=generator, device=DEVICE) * 3 + 1).to(dtype)
    weight = torch.randn(shape[-1], generator=generator, device=DEVICE).to(dtype)
    for bundle in (ops, get_ops(DEVICE, backend="torch")):
        with poisoned_allocations():
            out = bundle.rms_norm(x, weight, 1e-6)
        assert_close(out, reference.rms_norm(x, weight, 1e-6), dtype)


def test_rms_norm_of_a_strided_head_view(ops):
    """Per-head q-norm (Qwen3) normalises a [T, H, D] view cut from the fused projection."""
    generator = torch.Generator(DEVICE).manual_seed(17)
    qkv = torch.randn(6, 10 * 64, generator=generator, device=DEVICE).to(BF16)
    q = qkv[:, :4 * 64].view(6, 4, 64)
    weight = torch.randn(64, generator=generator, device=DEVICE).float()
    for bundle in (ops, get_ops(DEVICE, backend="torch")):
        with poisoned_allocations():
            out = bundle.rms_norm(q, weight, 1e-5)
        assert_close(out, reference.rms_norm(q, weight, 1e-5), BF16)


@pytest.mark.parametrize("dtype, shape", [(F32, (5, 200)), (BF16, (9, 256)), (F16, (3, 2, 48))])
def test_fused_add_rms_norm_matches_reference(ops, dtype, shape):
    generator = torch.Generator(DEVICE).manual_seed(19)
    x = torch.randn(shape, generator=generator, device=DEVICE).to(dtype)
    residual = (torch.randn(shape, generator=generator, device=DEVICE) * 4).to(dtype)
    weight = torch.randn(shape[-1], generator=generator, device=DEVICE).to(dtype)
    x_before, residual_before = x.clone(), residual.clone()
    ref_normed, ref_residual = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    for bundle in (ops, get_ops(DEVICE, backend="torch")):
        with poisoned_allocations():
            normed, new_residual = bundle.fused_add_rms_norm(x, residual, weight, 1e-6)
        assert_close(new_residual, ref_residual, dtype)
        assert_close(normed, ref_normed, dtype)
        assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def llama3_cos_sin_cache(head_dim: int, max_pos: int, theta: float = 500000.0) -> torch.Tensor:
    """The cache as a model would build it, with Llama-3.1's frequency scaling (factor 8, low/high frequency
    factors 1 and 4, original context 8192; the formula of transformers' _compute_llama3_parameters)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    factor, low, high, original = 8.0, 1.0, 4.0, 8192
    smooth = (original / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    medium = (wavelen <= original / low) & (wavelen >= original / high)
    scaled = torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float64), scaled)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()


@pytest.mark.parametrize("dtype, head_dim, position_dtype", [(F32, 64, torch.int64), (BF16, 128, torch.int32),
                                                             (F16, 96, torch.int64)])
def test_rotary_embedding_matches_reference(ops, dtype, head_dim, position_dtype):
    generator = torch.Generator(DEVICE).manual_seed(23)
    tokens, q_heads, kv_heads = 9, 6, 2
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=generator, device=DEVICE).to(dtype)
    q = qkv[:, :q_heads * head_dim].view(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim:(q_heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    cache = llama3_cos_sin_cache(head_dim, 10000).to(DEVICE)
    positions = torch.randint(0, 10000, (tokens,), generator=generator, device=DEVICE).to(position_dtype)
    q_ref, k_ref = reference.rotary_embedding(q, k, positions, cache)
    for bundle in (ops, get_ops(DEVICE, backend="torch")):
        with poisoned_allocations():
            q_out, k_out = bundle.rotary_embedding(q, k, positions, cache)
        assert_close(q_out, q_ref, dtype)
        assert_close(k_out, k_ref, dtype)


@pytest.mark.parametrize("dtype, shape", [(F32, (4, 600)), (BF16, (3, 2, 2 * 1100)), (F16, (1, 64))])
def test_silu_and_mul_matches_reference(ops, dtype, shape):
    generator = torch.Generator(DEVICE).manual_seed(29)
    x = (torch.randn(shape, generator=generator, device=DEVICE) * 4).to(dtype)
    for bundle in (ops, get_ops(DEVICE, backend="torch")):
        with poisoned_allocations():
            out = bundle.silu_and_mul(x)
        assert_close(out, reference.silu_and_mul(x), dtype)


def test_small_ops_reject_bad_input(ops):
    x = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        ops.rms_norm(x, torch.ones(7, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="even last dimension"):
        ops.silu_and_mul(torch.randn(3, 7, device=DEVICE))
    with pytest.raises(ValueError, match="positions"):
        ops.rotary_embedding(x.view(3, 1, 8), x.view(3, 1, 8), torch.zeros(2, dtype=torch.int64, device=DEVICE),
                             torch.ones(4, 8, device=DEVICE))
    with pytest.raises(ValueError, match="slot_mapping"):
        ops.store_kvcache(x.view(3, 1, 8), x.view(3, 1, 8), torch.zeros(2, 4, 1, 8, device=DEVICE),
                          torch.zeros(2, 4, 1, 8, device=DEVICE), torch.zeros(3, device=DEVICE))


def test_get_ops_chooses_one_implementation_per_device():
    assert get_ops("cpu").name == "torch"
    assert get_ops("cpu", backend="reference").name == "reference"
    assert get_ops(DEVICE, backend="triton").name in ("triton", "triton-interpreter")
    with pytest.raises(ValueError, match="unknown kernel backend"):
        get_ops("cpu", backend="tpu")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_ops("cpu", backend="cuda")
    with pytest.raises(ValueError, match="no ops for device"):
        get_ops("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            get_ops("cuda")


def test_leading_decodes_counts_the_single_token_sequences_at_the_head():
    from kernels import leading_decodes

    assert leading_decodes(torch.tensor([1, 1, 7, 1], dtype=torch.int32)) == 2
    assert leading_decodes(torch.tensor([1, 1, 1], dtype=torch.int32)) == 3
    assert leading_decodes(torch.tensor([5, 1], dtype=torch.int32)) == 0
    assert leading_decodes(torch.tensor([], dtype=torch.int32)) == 0


def test_engine_generates_the_same_tokens_with_the_triton_kernels(llama_tiny):
    """The whole model on the Triton bundle (interpreter on the CPU): chunked prefill across steps, mixed
    prefill/decode steps and decodes give the greedy tokens of the reference bundle."""
    from engine import LLM, SamplingParams

    folder, _ = llama_tiny
    generator = torch.Generator().manual_seed(31)
    prompts = [torch.randint(0, 300, (n,), generator=generator).tolist() for n in (21, 5, 38)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for kernels in ("reference", "triton"):
        llm = LLM(folder, device=DEVICE, kernels=kernels, max_num_batched_tokens=16, num_kv_blocks=32,
                  max_num_seqs=4, batch_policy="fcfs")
        tokens[kernels] = [out.token_ids for out in llm.generate(prompts, greedy)]
    assert tokens["triton"] == tokens["reference"]
