"""Triton attention over the paged KV cache for the flattened mixed batch (decode rows and chunked-prefill rows).

One launch serves every sequence of the batch, whatever its number of query tokens; no padding to the longest one.
The grid is (query blocks, KV heads, KV splits):
  * a query block is up to BLOCK_Q consecutive query tokens of one sequence times the GROUP query heads that share
    a KV head, so the BLOCK_M = BLOCK_Q * GROUP rows of the tile read each K/V tile once (GQA/MQA/MHA alike);
  * sequence i owns the query blocks starting at query_start_loc[i] // BLOCK_Q + i, so num_tokens // BLOCK_Q +
    num_seqs programs cover any split of the tokens among sequences; each program finds its sequence by binary
    search and the surplus ones exit at once (the layout of vLLM's unified Triton attention);
  * the decode rows of a batch (one query token each, first in the batch) get a launch of their own: decode tiles,
    program i on sequence i without a search, split-KV; the prefill rows after them take the layout above;
  * split-KV (flash-decoding): with num_splits > 1 each program covers one slice of its keys and writes a partial
    output and log-sum-exp; a merge kernel combines the slices. Each sequence uses only as many of the launch's
    splits as its keys fill (see MIN_KEYS_PER_SPLIT), so the split count a CUDA graph fixes is an upper bound.
Every launch size derives from tensor shapes and Python ints, never from tensor contents, so the kernels may be
captured in CUDA graphs (see `paged_attention` for what the caller passes).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.dispatch import require_triton

require_triton()  # a clear error on a Triton without `triton.knobs`, not an AttributeError

INTERPRETED = triton.knobs.runtime.interpret  # read at the same moment @triton.jit below reads it
MAX_HEAD_DIM = 256  # tuned for 64 and 128; other sizes run padded to a power of two (at least 16)
LOG2E = 1.4426950408889634
MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed cost (its Q load, its partial write, the merge) dominates
MAX_SPLITS = 32
# Decode launches of at least this many rows take the long decode tile (see _tile_config); the model runner's
# warm-up launches one of this size so that both tile lengths compile before serving.
LONG_DECODE_MIN_SEQS = 8
# The tile shapes of the attention launches (see _tile_config): "pipelined", the default, or "legacy", the one
# before it, kept selectable so that a GPU run measures both.
TILE_CONFIGS = ("pipelined", "legacy")
TILE_CONFIG = os.environ.get("POLYSERVE_ATTN_CONFIG", "pipelined")
if TILE_CONFIG not in TILE_CONFIGS:
    raise ValueError(f"POLYSERVE_ATTN_CONFIG must be one of {', '.join(TILE_CONFIGS)}, got {TILE_CONFIG!r}")


@triton.jit
def _find_sequence(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence whose first query block is at or before `q_block`."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(q, acc, m_i, l_i, tile_start, kv_hi, query_pos, block_table_row, k_cache_ptr, v_cache_ptr, kv_head,
                 dims, dim_valid, scale_log2, stride_k_block, stride_k_slot, stride_k_head, stride_v_block,
                 stride_v_slot, stride_v_head, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr):
    """One K/V tile folded into the online softmax (acc, m_i, l_i). Unmasked: every key of the tile exists and is
    visible to every row, so the loads and scores go without masks and no row's maximum can stay -inf."""
    keys = tile_start + tl.arange(0, BLOCK_N)
    if MASKED:
        key_valid = keys < kv_hi
        physical_block = tl.load(block_table_row + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
    else:
        physical_block = tl.load(block_table_row + keys // BLOCK_SIZE).to(tl.int64)
    slot = keys % BLOCK_SIZE
    k_offsets = physical_block * stride_k_block + slot * stride_k_slot + kv_head * stride_k_head
    v_offsets = physical_block * stride_v_block + slot * stride_v_slot + kv_head * stride_v_head
    if MASKED:
        k = tl.load(k_cache_ptr + k_offsets[None, :] + dims[:, None], mask=key_valid[None, :] & dim_valid[:, None],
                    other=0.0)
    else:
        k = tl.load(k_cache_ptr + k_offsets[None, :] + dims[:, None], mask=dim_valid[:, None], other=0.0)
    if UPCAST_DOT:
        k = k.to(tl.float32)
    scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
    if MASKED:
        visible = key_valid[None, :] & (keys[None, :] <= query_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # A row that has seen no visible key yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_shift = m_new
    alpha = tl.exp2(m_i - m_shift)
    p = tl.exp2(scores - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_cache_ptr + v_offsets[:, None] + dims[None, :], mask=key_valid[:, None] & dim_valid[None, :],
                    other=0.0)
    else:
        v = tl.load(v_cache_ptr + v_offsets[:, None] + dims[None, :], mask=dim_valid[None, :], other=0.0)
    if UPCAST_DOT:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# Batch sizes and the block-table width change every step, and the prefill launch of a mixed batch starts its
# metadata pointers after however many decode rows precede it: specialising on these (Triton does for ints equal to
# 1 or divisible by 16, and for pointers aligned to 16 bytes) would compile new variants while serving. The
# metadata are read a scalar or a gather at a time, so their alignment buys nothing. The other strides are fixed
# per model and stay specialised: their divisibility is what lets the K/V loads vectorise.
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "num_splits", "stride_block_table"],
            do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    out_ptr, partial_out_ptr, partial_lse_ptr,
    scale_log2, num_seqs, num_tokens, num_splits,
    stride_q_token, stride_q_head,
    stride_k_block, stride_k_slot, stride_k_head,
    stride_v_block, stride_v_slot, stride_v_head,
    stride_block_table,
    stride_out_token, stride_out_head,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_KV: tl.constexpr, MIN_SPLIT_KEYS: tl.constexpr, SINGLE_QUERY: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # A launch may cover a later range of the batch's sequences (the prefill rows after the decode rows): its
    # query blocks and its partial outputs are numbered from its first token.
    first_token = tl.load(query_start_loc_ptr)
    if SINGLE_QUERY:
        # Every sequence has at most one query token: program i is sequence i, nothing to search.
        seq = tl.program_id(0)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        first_query = 0
    else:
        # Later query blocks of a sequence see more keys: numbered last-first, the longest programs start first and
        # the short ones fill the gaps at the end instead of leaving a tail of long ones.
        q_block = tl.num_programs(0) - 1 - tl.program_id(0) + first_token // BLOCK_Q
        seq = _find_sequence(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        first_query = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if first_query >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    query = first_query + rows // GROUP  # offset of the row's token among its sequence's query tokens
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (query < q_len)
    query_pos = context_len + query
    token = (q_start + query).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    if BLOCK_D == HEAD_DIM:
        dim_valid = tl.full([BLOCK_D], 1, tl.int1)  # a constant mask keeps the loads vectorised
    else:
        dim_valid = dims < HEAD_DIM

    q = tl.load(q_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    # Causality caps the keys this block needs at its last query's position.
    kv_end = tl.minimum(seq_len, context_len + first_query + BLOCK_Q)
    if not SPLIT_KV:
        kv_lo = 0
        kv_hi = kv_end
    else:
        # The launch's split count is an upper bound (a CUDA graph fixes it for the longest context it may meet);
        # how many of them this sequence uses is decided here from its own keys, one split per MIN_SPLIT_KEYS of
        # them, so a short context leaves its other splits an early exit and the merge fewer partials to read.
        # The same rule as choose_num_splits, per sequence.
        seq_splits = tl.maximum(tl.minimum(kv_end // MIN_SPLIT_KEYS, num_splits), 1)
        per_split = tl.cdiv(tl.cdiv(kv_end, seq_splits), BLOCK_N) * BLOCK_N
        kv_lo = split * per_split
        kv_hi = tl.minimum(kv_lo + per_split, kv_end)
        partial_row = (split * num_tokens + token - first_token) * NUM_Q_HEADS + head
        if kv_lo >= kv_hi:
            # Nothing to attend to: only tell the merge so (its partial output stays unwritten and unread).
            tl.store(partial_lse_ptr + partial_row, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_valid)
            return

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    # Every row of the block sees the keys up to its first query's position: whole tiles of those need neither the
    # causal nor the bounds mask, so they run in a loop of their own, and only the tiles on the diagonal and the
    # last partial one pay for the masks.
    seen_by_all = tl.minimum(kv_hi, context_len + first_query + 1)
    unmasked_end = kv_lo + tl.maximum(seen_by_all - kv_lo, 0) // BLOCK_N * BLOCK_N
    for tile_start in range(kv_lo, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, tile_start, kv_hi, query_pos, block_table_row, k_cache_ptr, v_cache_ptr, kv_head,
            dims, dim_valid, scale_log2, stride_k_block, stride_k_slot, stride_k_head, stride_v_block, stride_v_slot,
            stride_v_head, BLOCK_SIZE, BLOCK_N, UPCAST_DOT, DOT_PRECISION, MASKED=False)
    for tile_start in range(unmasked_end, kv_hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, tile_start, kv_hi, query_pos, block_table_row, k_cache_ptr, v_cache_ptr, kv_head,
            dims, dim_valid, scale_log2, stride_k_block, stride_k_slot, stride_k_head, stride_v_block, stride_v_slot,
            stride_v_head, BLOCK_SIZE, BLOCK_N, UPCAST_DOT, DOT_PRECISION, MASKED=True)

    # A row with no visible key (a padding sequence of length 0) gets zeros, as the reference does.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if not SPLIT_KV:
        tl.store(out_ptr + token[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])
    else:
        tl.store(partial_out_ptr + partial_row[:, None] * HEAD_DIM + dims[None, :], out,
                 mask=row_valid[:, None] & dim_valid[None, :])
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(partial_lse_ptr + partial_row, lse, mask=row_valid)


@triton.jit(do_not_specialize=["num_tokens", "num_splits"])
def _merge_splits_kernel(
    partial_out_ptr, partial_lse_ptr, out_ptr, num_tokens, num_splits, stride_out_token, stride_out_head,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One program per (token, query head): every split's log-sum-exp in one vector load, the weights once, the
    partial outputs in one pass. A split with log-sum-exp -inf saw no key and its partial output is never read
    (the attention kernel skips writing it). BLOCK_S covers the most splits any launch has, so the split count
    is a runtime value and compiles nothing new."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    rows = (splits * num_tokens + token) * NUM_Q_HEADS + head
    lse = tl.load(partial_lse_ptr + rows, mask=splits < num_splits, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    weights = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))
    filled = lse > float("-inf")
    parts = tl.load(partial_out_ptr + rows[:, None] * HEAD_DIM + dims[None, :],
                    mask=filled[:, None] & dim_valid[None, :], other=0.0)
    weight_sum = tl.sum(weights, 0)
    out = tl.sum(weights[:, None] * parts, 0) / tl.where(weight_sum > 0, weight_sum, 1.0)
    tl.store(out_ptr + token * stride_out_token + head * stride_out_head + dims, out.to(out_ptr.dtype.element_ty),
             mask=dim_valid)


_SM_COUNTS: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached: the query is slow); 1 for the CPU interpreter."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int | None, sm_count: int) -> int:
    """KV splits of a decode launch: enough programs for about two per multiprocessor, each split keeping at least
    MIN_KEYS_PER_SPLIT keys. A host-side choice from Python ints, so a CUDA-graph runner can fix it per batch size
    (max_seq_len None: the graph's bound); the kernel applies the length rule again per sequence, so this is only
    the most splits a sequence of the launch may use."""
    programs = max(1, num_seqs * num_kv_heads)
    by_occupancy = -(-2 * sm_count // programs)
    by_length = MAX_SPLITS if max_seq_len is None else max_seq_len // MIN_KEYS_PER_SPLIT
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [blocks, block_size, kv_heads, head_dim], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    head_dim = q.shape[2]
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} unsupported by the Triton attention (1 to {MAX_HEAD_DIM})")
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"cache head_dim {k_cache.shape[3]} != query head_dim {head_dim}")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} KV heads")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q dtype {q.dtype} unsupported (float16, bfloat16, float32)")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"cache dtypes {k_cache.dtype}/{v_cache.dtype} differ from q's {q.dtype}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last (head_dim) dimension")
    if block_tables.dim() != 2 or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_tables must be an int32/int64 [seqs, max_blocks] tensor, got {block_tables.dtype} "
                         f"{tuple(block_tables.shape)}")
    num_seqs = block_tables.shape[0]
    if seq_lens.shape != (num_seqs,) or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"for {num_seqs} sequences seq_lens must be [{num_seqs}] and query_start_loc "
                         f"[{num_seqs + 1}], got {tuple(seq_lens.shape)} and {tuple(query_start_loc.shape)}")
    if seq_lens.stride(0) != 1 or query_start_loc.stride(0) != 1 or block_tables.stride(1) != 1:
        raise ValueError("seq_lens, query_start_loc and block_tables rows must be contiguous")
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)}
    if len(devices) != 1:
        raise ValueError(f"all attention inputs must be on one device, got {sorted(map(str, devices))}")


def _tile_config(block_d: int, group: int, decode: bool, fp32: bool, num_seqs: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the configuration TILE_CONFIG names.

    Pipelined (the default): the K/V loads of later tiles are in flight while a tile is computed, so no iteration
    waits for all copies. num_stages counts pipeline stages, not buffers: the block-table load that a K/V load
    depends on takes stages of its own, so 7 stages give decode tiles three K/V buffers and 5 give prefill tiles
    three (kernels.compile_check reads the buffers and partial waits back from the compiled IR and asserts them).
    Decode tiles are short (one token times the GROUP heads) and bandwidth-bound: BLOCK_N shrinks as heads widen
    so every stage moves the same bytes and registers stay clear of spills. A launch of LONG_DECODE_MIN_SEQS rows
    or more takes the long tile: four times the keys per stage, single-buffered, at least two blocks per
    multiprocessor. Measured on an H200 (bench/RESULTS.md), it streams faster from eight rows up at all but one
    shape, and the short, deeply pipelined tile is faster for a single row, whose keys are split into many short
    runs. 16-bit prefill tiles are 128 rows (64 for wider heads) so the Q·Kᵀ and P·V products run as Hopper wgmma,
    with 8 warps to hold the accumulator.
    fp32 (exact products run on the FMA units, not the tensor cores) takes short tiles with 8 warps."""
    if TILE_CONFIG == "legacy":
        return _legacy_tile_config(block_d, group, decode, fp32)
    rows_for_group = max(16, triton.next_power_of_2(group))
    if fp32:
        return rows_for_group, 32, 8, 5
    if decode and num_seqs >= LONG_DECODE_MIN_SEQS:
        return rows_for_group, min(128, 16384 // block_d), 4, 4
    if decode:
        return rows_for_group, min(128, 4096 // block_d), 4, 7
    if block_d <= 128:
        return max(128, rows_for_group), 64, 8, 5
    return max(64, rows_for_group), 32, 8, 5


def _legacy_tile_config(block_d: int, group: int, decode: bool, fp32: bool) -> tuple[int, int, int, int]:
    """The configuration before the pipelined one, kept so a GPU run can measure both: single-buffered decode
    tiles, double-buffered prefill tiles, and every iteration waits for all its copies."""
    rows_for_group = triton.next_power_of_2(group)
    if fp32:
        return max(16, rows_for_group), 32, 8, 3
    if decode:
        return max(16, rows_for_group), 64 if block_d <= 128 else 32, 4, 3
    if block_d <= 128:
        return max(128, rows_for_group), 64, 8 if block_d == 128 else 4, 3
    return max(64, rows_for_group), 32, 8, 2


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *,
                    max_query_len: int | None = None, max_seq_len: int | None = None,
                    num_splits: int | None = None, num_decodes: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's query tokens over its paged context (shapes: kernels.reference).

    Hints, all Python ints the host already knows; none is read back from the device:
      max_query_len  upper bound on any sequence's query tokens; 1 makes every sequence a decode row. Without
                     this hint a batch with as many tokens as sequences runs on decode tiles too.
      max_seq_len    upper bound on any sequence's context; caps the KV splits chosen when num_splits is None.
      num_splits     the most KV splits a sequence may use (each takes at least MIN_KEYS_PER_SPLIT of its keys);
                     None chooses from the shapes for the decode rows and 1 for the others. A CUDA-graph runner
                     passes it, fixed per captured batch size.
      num_decodes    the first num_decodes sequences have exactly one query token each (a scheduler that puts the
                     decode rows first); they run on decode tiles with split-KV, the other sequences in a second
                     launch on prefill tiles. None: every sequence when max_query_len is 1, else none.
    Query tokens past query_start_loc[-1] (graph padding) get unspecified values; a sequence with no context
    (seq_len 0, a padding slot) gets zeros.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    num_tokens = q.shape[0]
    num_seqs = block_tables.shape[0]
    if num_decodes is None:
        num_decodes = num_seqs if max_query_len == 1 else 0
    if not 0 <= num_decodes <= min(num_seqs, num_tokens):
        raise ValueError(f"num_decodes must be in [0, {min(num_seqs, num_tokens)}] for {num_seqs} sequences and "
                         f"{num_tokens} tokens, got {num_decodes}")
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")

    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    num_kv_heads = k_cache.shape[2]
    if num_decodes:
        splits = num_splits or choose_num_splits(num_decodes, num_kv_heads, max_seq_len, num_sms(q.device))
        _launch(q, k_cache, v_cache, block_tables[:num_decodes], seq_lens[:num_decodes],
                query_start_loc[:num_decodes + 1], out, scale, first_token=0, num_tokens=num_decodes, decode=True,
                single_query=True, num_splits=splits)
    if num_decodes < num_seqs:
        decode = num_decodes == 0 and max_query_len is None and num_tokens == num_seqs
        if num_splits is not None:
            splits = num_splits
        else:
            splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms(q.device)) if decode else 1
        # The decode rows hold one token each, so the remaining sequences' tokens start at num_decodes.
        _launch(q, k_cache, v_cache, block_tables[num_decodes:], seq_lens[num_decodes:],
                query_start_loc[num_decodes:], out, scale, first_token=num_decodes,
                num_tokens=num_tokens - num_decodes, decode=decode, single_query=False, num_splits=splits)
    return out


def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, query_start_loc: torch.Tensor, out: torch.Tensor, scale: float, *,
            first_token: int, num_tokens: int, decode: bool, single_query: bool, num_splits: int) -> None:
    """The attention (and the merge of its splits) of a contiguous range of the batch's sequences, whose query
    tokens are q[first_token:first_token + num_tokens] (graph padding included)."""
    if num_tokens == 0:
        return
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_seqs = block_tables.shape[0]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    block_m, block_n, num_warps, num_stages = _tile_config(block_d, group, decode, q.dtype == torch.float32,
                                                           num_seqs)
    block_q = block_m // group
    if num_splits > 1:
        partial_out = torch.empty((num_splits, num_tokens, num_q_heads, head_dim), dtype=torch.float32,
                                  device=q.device)
        partial_lse = torch.empty((num_splits, num_tokens, num_q_heads), dtype=torch.float32, device=q.device)
    else:
        partial_out = partial_lse = out  # unused: the kernel writes `out` directly
    # The interpreter's tl.dot multiplies bf16 as raw integers; give it fp32 there (on the GPU bf16 goes to the
    # tensor cores as is).
    upcast = INTERPRETED and q.dtype == torch.bfloat16
    if single_query:
        programs = num_seqs
    else:  # query blocks numbered from the range's first token's (see _find_sequence's layout)
        programs = (first_token + num_tokens) // block_q - first_token // block_q + num_seqs
    _paged_attention_kernel[(programs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        out, partial_out, partial_lse,
        scale * LOG2E, num_seqs, num_tokens, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        NUM_Q_HEADS=num_q_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        SPLIT_KV=num_splits > 1, MIN_SPLIT_KEYS=MIN_KEYS_PER_SPLIT, SINGLE_QUERY=single_query,
        UPCAST_DOT=upcast, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        merge_splits(partial_out, partial_lse, out[first_token:first_token + num_tokens])


def merge_splits(partial_out: torch.Tensor, partial_lse: torch.Tensor, out: torch.Tensor) -> None:
    """Writes into out [T, H, D] the attention that split-KV partials make together (shapes and meaning:
    kernels.reference.merge_splits); a split with log-sum-exp -inf is skipped, its partial output never read."""
    num_splits, num_tokens, num_q_heads, head_dim = partial_out.shape
    if partial_lse.shape != (num_splits, num_tokens, num_q_heads) or out.shape != (num_tokens, num_q_heads, head_dim):
        raise ValueError(f"partials {tuple(partial_out.shape)} / {tuple(partial_lse.shape)} do not match out "
                         f"{tuple(out.shape)}")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"{num_splits} splits to merge; at most {MAX_SPLITS}")
    if partial_out.dtype != torch.float32 or partial_lse.dtype != torch.float32:
        raise ValueError(f"partials must be float32, got {partial_out.dtype} and {partial_lse.dtype}")
    if not (partial_out.is_contiguous() and partial_lse.is_contiguous() and out.stride(2) == 1):
        raise ValueError("partials must be contiguous and out's last dimension too")
    if num_tokens == 0:
        return
    _merge_splits_kernel[(num_tokens, num_q_heads)](
        partial_out, partial_lse, out, num_tokens, num_splits, out.stride(0), out.stride(1),
        NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_S=MAX_SPLITS, num_warps=4,
    )
