"""Triton rotary embedding (neox layout, the Hugging Face Llama one) for q and k in one launch.

The kernel only consumes `cos_sin_cache` [max_pos, D] (cos in the first D/2 columns, sin in the rest). Every
scaling variant (Llama-3.1's frequency-dependent scaling, linear, dynamic NTK, YaRN) changes only the inverse
frequencies, so the model applies it when it builds that cache and nothing here depends on it.
One program per token loads that token's cos/sin row once and rotates all of its query and key heads with it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(src, dst, stride_src_head, stride_dst_head, cos, sin, NUM_HEADS: tl.constexpr,
                  BLOCK_H: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    half = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < NUM_HEADS) & (half[None, :] < HALF)
    first = heads[:, None] * stride_src_head + half[None, :]
    x1 = tl.load(src + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + first + HALF, mask=mask, other=0.0).to(tl.float32)
    out = heads[:, None] * stride_dst_head + half[None, :]
    tl.store(dst + out, (x1 * cos - x2 * sin).to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + out + HALF, (x2 * cos + x1 * sin).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cos_sin_ptr, q_out_ptr, k_out_ptr,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head,
    stride_qo_token, stride_qo_head, stride_ko_token, stride_ko_head, stride_cos_sin,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    half = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_sin_ptr + position * stride_cos_sin + half, mask=half < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + position * stride_cos_sin + HALF + half, mask=half < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + token * stride_q_token, q_out_ptr + token * stride_qo_token, stride_q_head, stride_qo_head,
                  cos[None, :], sin[None, :], NUM_Q_HEADS, BLOCK_QH, HALF, BLOCK_HALF)
    _rotate_heads(k_ptr + token * stride_k_token, k_out_ptr + token * stride_ko_token, stride_k_head, stride_ko_head,
                  cos[None, :], sin[None, :], NUM_K_HEADS, BLOCK_KH, HALF, BLOCK_HALF)


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] rotated by the cache rows at `positions` [T]; returns new tensors in the inputs'
    dtypes. Positions are not bounds-checked on the device (that would need a host sync): the caller owns them."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q [T, Hq, D] and k [T, Hkv, D] must agree on T and D, got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    num_tokens, num_q_heads, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"rotary needs an even head_dim, got {head_dim}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim or cos_sin_cache.stride(1) != 1:
        raise ValueError(f"cos_sin_cache must be a [max_pos, {head_dim}] tensor with contiguous rows, got "
                         f"{tuple(cos_sin_cache.shape)}")
    if (positions.shape != (num_tokens,) or positions.dtype not in (torch.int32, torch.int64)
            or (num_tokens > 1 and positions.stride(0) != 1)):
        raise ValueError(f"positions must be a contiguous int32/int64 [{num_tokens}] tensor, got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("q and k need a contiguous last (head_dim) dimension")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=k.shape[1], BLOCK_QH=triton.next_power_of_2(num_q_heads),
        BLOCK_KH=triton.next_power_of_2(k.shape[1]), HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4,
    )
    return q_out, k_out
