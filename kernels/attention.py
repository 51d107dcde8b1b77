"""Triton attention over the paged KV cache for the flattened mixed batch (decode rows and chunked-prefill rows).

One launch serves every sequence of the batch, whatever its number of query tokens; no padding to the longest one.
The grid is (query blocks, KV heads, KV splits):
  * a query block is up to BLOCK_Q consecutive query tokens of one sequence times the GROUP query heads that share
    a KV head, so the BLOCK_M = BLOCK_Q * GROUP rows of the tile read each K/V tile once (GQA/MQA/MHA alike);
  * sequence i owns the query blocks starting at query_start_loc[i] // BLOCK_Q + i, so num_tokens // BLOCK_Q +
    num_seqs programs cover any split of the tokens among sequences; each program finds its sequence by binary
    search and the surplus ones exit at once (the layout of vLLM's unified Triton attention);
  * split-KV (flash-decoding): with num_splits > 1 each program covers one slice of its keys and writes a partial
    output and log-sum-exp; a merge kernel combines the slices.
Every launch size derives from tensor shapes and Python ints, never from tensor contents, so the kernels may be
captured in CUDA graphs (see `paged_attention` for what the caller passes).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

INTERPRETED = triton.knobs.runtime.interpret  # read at the same moment @triton.jit below reads it
MAX_HEAD_DIM = 256  # tuned for 64 and 128; other sizes run padded to a power of two (at least 16)
LOG2E = 1.4426950408889634
MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed cost (its Q load, its partial write, the merge) dominates
MAX_SPLITS = 32


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


# Batch sizes change every step: specialising on them (Triton does for 1 and multiples of 16) would only add compiles.
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "num_splits"])
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
    SPLIT_KV: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

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
        # Per-sequence slices, computed here from the sequence's own length, so a graph replay with other lengths
        # still spreads every sequence over all splits.
        per_split = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
        kv_lo = split * per_split
        kv_hi = tl.minimum(kv_lo + per_split, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    for tile_start in range(kv_lo, kv_hi, BLOCK_N):
        keys = tile_start + tl.arange(0, BLOCK_N)
        key_valid = keys < kv_hi
        physical_block = tl.load(block_table_row + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        slot = keys % BLOCK_SIZE
        k_offsets = physical_block * stride_k_block + slot * stride_k_slot + kv_head * stride_k_head
        v_offsets = physical_block * stride_v_block + slot * stride_v_slot + kv_head * stride_v_head
        k = tl.load(k_cache_ptr + k_offsets[None, :] + dims[:, None], mask=key_valid[None, :] & dim_valid[:, None],
                    other=0.0)
        if UPCAST_DOT:
            k = k.to(tl.float32)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        visible = key_valid[None, :] & (keys[None, :] <= query_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # A row that has seen no visible key yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(scores - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v = tl.load(v_cache_ptr + v_offsets[:, None] + dims[None, :], mask=key_valid[:, None] & dim_valid[None, :],
                    other=0.0)
        if UPCAST_DOT:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # A row with no visible key (a padding sequence of length 0) gets zeros, as the reference does.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if not SPLIT_KV:
        tl.store(out_ptr + token[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])
    else:
        row = (split * num_tokens + token) * NUM_Q_HEADS + head
        tl.store(partial_out_ptr + row[:, None] * HEAD_DIM + dims[None, :], out,
                 mask=row_valid[:, None] & dim_valid[None, :])
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(partial_lse_ptr + row, lse, mask=row_valid)


@triton.jit(do_not_specialize=["num_tokens", "num_splits"])
def _merge_splits_kernel(
    partial_out_ptr, partial_lse_ptr, out_ptr, num_tokens, num_splits, stride_out_token, stride_out_head,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_valid = heads < NUM_Q_HEADS
    mask = head_valid[:, None] & (dims[None, :] < HEAD_DIM)

    lse_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for split in range(num_splits):
        lse = tl.load(partial_lse_ptr + (split * num_tokens + token) * NUM_Q_HEADS + heads, mask=head_valid,
                      other=float("-inf"))
        lse_max = tl.maximum(lse_max, lse)
    lse_shift = tl.where(lse_max == float("-inf"), 0.0, lse_max)

    weight_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for split in range(num_splits):
        row = (split * num_tokens + token) * NUM_Q_HEADS + heads
        weight = tl.exp2(tl.load(partial_lse_ptr + row, mask=head_valid, other=float("-inf")) - lse_shift)
        part = tl.load(partial_out_ptr + row[:, None] * HEAD_DIM + dims[None, :], mask=mask, other=0.0)
        weight_sum += weight
        acc += weight[:, None] * part
    out = acc / tl.where(weight_sum > 0, weight_sum, 1.0)[:, None]
    tl.store(out_ptr + token * stride_out_token + heads[:, None] * stride_out_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


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
    """KV splits for a decode batch: enough programs for about two per multiprocessor, each split keeping at least
    MIN_KEYS_PER_SPLIT keys. A host-side choice from Python ints, so a CUDA-graph runner can fix it per batch size."""
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


def _tile_config(block_d: int, group: int, decode: bool, fp32: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Decode tiles are short (one token times the GROUP heads) and
    bandwidth-bound; 16-bit prefill tiles are 128 rows so the Q·Kᵀ and P·V products run as Hopper wgmma with
    the loads pipelined (the shape of Triton's fused-attention tutorial for head_dim 64/128). Wider heads take
    smaller tiles, and fp32 (exact products run on the FMA units, not the tensor cores) short ones with 8 warps:
    compiled for sm_90 here, ptxas reports no register spills for these (fp32 MQA with split-KV aside: 364 B)."""
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
                    num_splits: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's query tokens over its paged context (shapes: kernels.reference).

    Hints, all Python ints the host already knows; none is read back from the device:
      max_query_len  upper bound on any sequence's query tokens; 1 (or any batch with tokens == sequences)
                     selects the decode tiles.
      max_seq_len    upper bound on any sequence's context; caps the KV splits chosen when num_splits is None.
      num_splits     KV splits; None chooses from the shapes (decode batches only; 1 for prefill). A CUDA-graph
                     runner should pass it, fixed per captured batch size.
    Query tokens past query_start_loc[-1] (graph padding) get unspecified values; a sequence with no context
    (seq_len 0, a padding slot) gets zeros.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = block_tables.shape[0]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    decode = num_tokens == num_seqs or max_query_len == 1
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms(q.device)) if decode else 1
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")

    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    block_m, block_n, num_warps, num_stages = _tile_config(block_d, group, decode, q.dtype == torch.float32)
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
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        out, partial_out, partial_lse,
        scale * LOG2E, num_seqs, num_tokens, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        NUM_Q_HEADS=num_q_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n, SPLIT_KV=num_splits > 1,
        UPCAST_DOT=upcast, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens,)](
            partial_out, partial_lse, out, num_tokens, num_splits, out.stride(0), out.stride(1),
            NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=triton.next_power_of_2(num_q_heads),
            num_warps=4,
        )
    return out

