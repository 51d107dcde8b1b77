"""Vectorised torch versions of the attention-side ops: the fast path on the CPU (and any device without Triton).

Same signatures as `kernels.reference`. Decode rows of the batch share one `scaled_dot_product_attention` call over
their gathered, padded contexts; each prefill chunk gets its own call with a causal mask offset by its cached prefix.
The gather plan depends only on the step's metadata, so it is built once per step and reused by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class _Plan:
    key: tuple  # the metadata tensors the plan was built from (compared by identity)
    decode_rows: torch.Tensor  # query rows of decode sequences
    decode_slots: torch.Tensor  # [Bd, Lmax] flat cache slots (padded with 0)
    decode_mask: torch.Tensor  # [Bd, 1, 1, Lmax] True where a key exists
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]  # (q start, q end, slots [S], mask [L, S])


_last_plan: _Plan | None = None


def _slots(block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(seq_len, device=block_table.device)
    return block_table.long()[pos // block_size] * block_size + pos % block_size


def _plan(block_tables, seq_lens, query_start_loc, block_size: int) -> _Plan:
    global _last_plan
    key = (block_tables, seq_lens, query_start_loc, block_size)
    if _last_plan is not None and all(a is b for a, b in zip(_last_plan.key, key)):
        return _last_plan
    lens, starts = seq_lens.tolist(), query_start_loc.tolist()
    dev = block_tables.device
    decode, prefills = [], []
    for i, seq_len in enumerate(lens):
        q_len = starts[i + 1] - starts[i]
        if q_len == 1:
            decode.append(i)
        elif q_len > 1:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=dev)[:, None]
            # no cached prefix: plain causal, which lets SDPA take its fused kernel instead of a materialised mask
            mask = None if q_len == seq_len else torch.arange(seq_len, device=dev)[None, :] <= q_pos
            prefills.append((starts[i], starts[i + 1], _slots(block_tables[i], seq_len, block_size), mask))
    width = max((lens[i] for i in decode), default=0)
    slots = torch.zeros(len(decode), width, dtype=torch.long, device=dev)
    mask = torch.zeros(len(decode), 1, 1, width, dtype=torch.bool, device=dev)
    for row, i in enumerate(decode):
        own = _slots(block_tables[i], lens[i], block_size)
        # Pad with the sequence's own first slot, never another block's: unowned slots may hold NaN (the pool is
        # torch.empty), and a masked NaN key still turns P·V into NaN.
        slots[row] = own[0] if lens[i] else 0
        slots[row, :lens[i]] = own
        mask[row, ..., :lens[i]] = True
    rows = torch.tensor([starts[i] for i in decode], dtype=torch.long, device=dev)
    _last_plan = _Plan(key, rows, slots, mask, prefills)
    return _last_plan


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *,
                    max_query_len: int | None = None, max_seq_len: int | None = None,
                    num_splits: int | None = None) -> torch.Tensor:
    """kernels.reference.paged_attention, vectorised; the keyword hints (for the GPU kernels) are ignored."""
    plan = _plan(block_tables, seq_lens, query_start_loc, k_cache.shape[1])
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    out = torch.empty_like(q)
    gqa = q.shape[1] != k_cache.shape[2]
    if len(plan.decode_rows):
        decode_only = not plan.prefills and len(plan.decode_rows) == q.shape[0]  # q is all decode rows, in order
        qd = (q if decode_only else q[plan.decode_rows]).unsqueeze(2)  # [Bd, Hq, 1, D]
        k = _gather(k_flat, plan.decode_slots).transpose(1, 2)  # [Bd, Hkv, L, D]
        v = _gather(v_flat, plan.decode_slots).transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=plan.decode_mask, scale=scale, enable_gqa=gqa)
        if decode_only:
            return o.squeeze(2)
        out[plan.decode_rows] = o.squeeze(2)
    for start, end, slots, mask in plan.prefills:
        qp = q[start:end].transpose(0, 1)  # [Hq, L, D]
        k = _gather(k_flat, slots).transpose(0, 1)  # [Hkv, S, D]
        v = _gather(v_flat, slots).transpose(0, 1)
        o = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                           enable_gqa=gqa)
        out[start:end] = o.transpose(0, 1)
    return out


def _gather(flat: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """flat[slots] for an index of any shape: index_select copies whole rows, where advanced indexing goes
    element by element (several times slower on the CPU)."""
    return flat.index_select(0, slots.reshape(-1)).view(*slots.shape, *flat.shape[1:])


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    slot_mapping = slot_mapping.long()  # index_copy_ takes int64 only; the reference accepts int32 too
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


_last_rotary: tuple | None = None


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    global _last_rotary
    if _last_rotary is not None and _last_rotary[0] is positions and _last_rotary[1] is cos_sin_cache:
        cos, sin = _last_rotary[2]
    else:
        cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        _last_rotary = (positions, cos_sin_cache, (cos.to(q.dtype), sin.to(q.dtype)))
        cos, sin = _last_rotary[2]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)  # torch's fused kernel accumulates in fp32


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
