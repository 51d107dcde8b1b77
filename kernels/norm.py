"""Triton RMSNorm, alone or fused with the residual add that precedes it in every Llama layer.

The fused form reads x and the residual once and writes the new residual and the normalised row once, instead of
a separate add kernel writing the sum and the norm kernel reading it back. One program per row; the whole row sits
in registers, so the sum of squares and the scaling need no second pass over memory.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROW = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_residual, stride_out, stride_residual_out,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
        new_residual = (x + residual).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, new_residual, mask=mask)
        # Normalise the rounded sum, as the next layer will see it (and as the reference does).
        x = new_residual.to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    tl.store(out_ptr + row * stride_out + cols, (x * inv_rms * weight).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D [rows, n] view of t when its strides allow one, else a contiguous copy."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() == 0 or weight.shape != (x.shape[-1],):
        raise ValueError(f"weight {tuple(weight.shape)} must be [{x.shape[-1] if x.dim() else '?'}] for x "
                         f"{tuple(x.shape)}")
    if x.shape[-1] > MAX_ROW:
        raise ValueError(f"rows of {x.shape[-1]} elements exceed the one-program-per-row limit {MAX_ROW}")
    if weight.stride(0) != 1:
        raise ValueError("weight must be contiguous")


def _launch(x, residual, weight, eps):
    n = x.shape[-1]
    x_rows = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out_rows = out.view(-1, n)
    if residual is None:
        residual_rows = residual_out_rows = x_rows  # unused
        residual_out = None
    else:
        residual_rows = _rows(residual)
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        residual_out_rows = residual_out.view(-1, n)
    if x_rows.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(x_rows.shape[0],)](
            x_rows, residual_rows, weight, out_rows, residual_out_rows,
            x_rows.stride(0), residual_rows.stride(0), out_rows.stride(0), residual_out_rows.stride(0),
            n, eps, HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 512)),
        )
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., n] normalised over its last dimension, times weight [n]; fp32 math, output in x's dtype."""
    _check(x, weight)
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual + x (rounded to x's dtype), then normalised: returns (normed, new residual); inputs untouched."""
    _check(x, weight)
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    return _launch(x, residual, weight, eps)
