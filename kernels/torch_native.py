"""Vectorised torch versions of the attention-side ops: the fast path on the CPU (and any device without Triton).

Same signatures as `kernels.reference`. Decode rows of the batch go to the C++ kernel of kernels.cpu_native, which
reads K and V in place from the paged cache; without that extension (or off the CPU) they share one
`scaled_dot_product_attention` call over their gathered, padded contexts. Each prefill chunk gets its own SDPA call
with a causal mask offset by its cached prefix. The plan (decode rows and their tables, gathers, masks) depends only
on the step's metadata, so it is built once per step and reused by every layer.

A layer's cache may have its blocks strided (one layer of a block-major cache): it is read and written as a flat
view of token rows over the whole storage, `_token_rows`, where block b's slot o is row b * rows_per_block + o.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import cpu_native


@dataclass(slots=True)
class _Plan:
    key: tuple  # the metadata tensors the plan was built from (compared by identity), then the cache's shape
    decode_rows: torch.Tensor  # query rows of decode sequences
    # for the C++ kernel (None without it): the decode sequences' block tables [Bd, max_blocks] and lengths [Bd]
    decode_tables: torch.Tensor | None
    decode_lens: torch.Tensor | None
    # for SDPA (None with the C++ kernel): flat cache slots [Bd, Lmax] (padded) and the mask [Bd, 1, 1, Lmax],
    # 0 where a key exists, -inf elsewhere
    decode_slots: torch.Tensor | None
    decode_mask: torch.Tensor | None
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]  # (q start, q end, slots [S], mask [L, S])


_last_plan: _Plan | None = None


def _slots(block_table: torch.Tensor, seq_len: int, block_size: int, rows_per_block: int) -> torch.Tensor:
    pos = torch.arange(seq_len, device=block_table.device)
    return block_table.long()[pos // block_size] * rows_per_block + pos % block_size


def _token_rows(cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`cache` [blocks, block_size, Hkv, D] as a view [rows, Hkv, D] of its storage whose rows are its tokens' (a
    block's slots one after another, `rows_per_block` rows from one block's first to the next's), and that count.
    A contiguous cache's rows are its slots; a strided one's span the other layers' rows between its blocks too."""
    num_blocks, block_size, heads, dim = cache.shape
    row = cache.stride(1)
    if cache.stride(3) != 1 or cache.stride(2) != dim or row != heads * dim or cache.stride(0) % row:
        raise ValueError(f"a cache's blocks must be whole token rows of contiguous heads, got strides {cache.stride()}")
    rows_per_block = cache.stride(0) // row
    rows = (num_blocks - 1) * rows_per_block + block_size if num_blocks else 0
    return cache.as_strided((rows, heads, dim), (row, dim, 1)), rows_per_block


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as SDPA would convert it on every call (0 where True, -inf where False), converted once."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _plan(block_tables, seq_lens, query_start_loc, block_size: int, rows_per_block: int,
          dtype: torch.dtype) -> _Plan:
    global _last_plan
    key = (block_tables, seq_lens, query_start_loc, (block_size, rows_per_block, dtype))
    if _last_plan is not None and all(a is b for a, b in zip(_last_plan.key[:3], key)) \
            and _last_plan.key[3] == key[3]:
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
            mask = None if q_len == seq_len else _additive(torch.arange(seq_len, device=dev)[None, :] <= q_pos, dtype)
            prefills.append((starts[i], starts[i + 1], _slots(block_tables[i], seq_len, block_size, rows_per_block),
                             mask))
    rows = torch.tensor([starts[i] for i in decode], dtype=torch.long, device=dev)
    if dev.type == "cpu" and cpu_native.available():
        if len(decode) == len(lens):  # every sequence decodes: its tables as they are, no copy
            tables, decode_lens = block_tables, seq_lens
        else:
            seqs = torch.tensor(decode, dtype=torch.long)
            tables, decode_lens = block_tables[seqs], seq_lens[seqs]
        _last_plan = _Plan(key, rows, tables, decode_lens, None, None, prefills)
        return _last_plan
    width = max((lens[i] for i in decode), default=0)
    slots = torch.zeros(len(decode), width, dtype=torch.long, device=dev)
    mask = torch.zeros(len(decode), 1, 1, width, dtype=torch.bool, device=dev)
    for row, i in enumerate(decode):
        own = _slots(block_tables[i], lens[i], block_size, rows_per_block)
        # Pad with the sequence's own first slot, never another block's: unowned slots may hold NaN (the pool is
        # torch.empty), and a masked NaN key still turns P·V into NaN.
        slots[row] = own[0] if lens[i] else 0
        slots[row, :lens[i]] = own
        mask[row, ..., :lens[i]] = True
    _last_plan = _Plan(key, rows, None, None, slots, _additive(mask, dtype), prefills)
    return _last_plan


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *,
                    max_query_len: int | None = None, max_seq_len: int | None = None,
                    num_splits: int | None = None, num_decodes: int | None = None) -> torch.Tensor:
    """kernels.reference.paged_attention, vectorised; the keyword hints (for the GPU kernels) are ignored."""
    (k_flat, rows_per_block), (v_flat, _) = _token_rows(k_cache), _token_rows(v_cache)
    plan = _plan(block_tables, seq_lens, query_start_loc, k_cache.shape[1], rows_per_block, q.dtype)
    gqa = q.shape[1] != k_cache.shape[2]
    decode_only = not plan.prefills and len(plan.decode_rows) == q.shape[0]  # q is all decode rows, in order
    out = None if decode_only and q.shape[0] else torch.empty_like(q)
    if len(plan.decode_rows):
        qd = q if decode_only else q[plan.decode_rows]  # [Bd, Hq, D]
        if plan.decode_tables is not None:
            o = cpu_native.decode_attention(qd, k_cache, v_cache, plan.decode_tables, plan.decode_lens, scale)
        else:
            k = _gather(k_flat, plan.decode_slots).transpose(1, 2)  # [Bd, Hkv, L, D]
            v = _gather(v_flat, plan.decode_slots).transpose(1, 2)
            o = F.scaled_dot_product_attention(qd.unsqueeze(2), k, v, attn_mask=plan.decode_mask, scale=scale,
                                               enable_gqa=gqa).squeeze(2)
        if decode_only:
            return o
        out[plan.decode_rows] = o
    for start, end, slots, mask in plan.prefills:
        # 4-D, batch of one: torch's CPU SDPA takes its flash kernel only for 4-D inputs; 3-D ones fall to the
        # unfused math path (several times slower, most of a prefill step's time)
        qp = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
        k = _gather(k_flat, slots).transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
        v = _gather(v_flat, slots).transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                           enable_gqa=gqa)
        out[start:end] = o[0].transpose(0, 1)
    return out


def _gather(flat: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """flat[slots] for an index of any shape: index_select copies whole rows, where advanced indexing goes
    element by element (several times slower on the CPU)."""
    return flat.index_select(0, slots.reshape(-1)).view(*slots.shape, *flat.shape[1:])


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    (k_rows, rows_per_block), (v_rows, _) = _token_rows(k_cache), _token_rows(v_cache)
    slots, keep = _store_slots(slot_mapping, k_cache.shape[1], rows_per_block)
    if keep is not None:
        k, v = k[keep], v[keep]
    k_rows.index_copy_(0, slots, k if k.dtype == k_cache.dtype else k.to(k_cache.dtype))
    v_rows.index_copy_(0, slots, v if v.dtype == v_cache.dtype else v.to(v_cache.dtype))


_last_store: tuple | None = None


def _store_slots(slot_mapping: torch.Tensor, block_size: int,
                 rows_per_block: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The int64 token rows to write (`_token_rows`; index_copy_ takes no other index) and the rows of k and v to
    keep (None: all); every layer stores with the same slot_mapping, so this is worked out (with its host sync) once
    per step."""
    global _last_store
    key = (slot_mapping, block_size, rows_per_block)
    if _last_store is None or _last_store[0][0] is not slot_mapping or _last_store[0][1:] != key[1:]:
        keep = slot_mapping >= 0  # negative: a padding row (CUDA-graph batches), written nowhere
        slots, keep = (slot_mapping.long(), None) if bool(keep.all()) else (slot_mapping[keep].long(), keep)
        if rows_per_block != block_size:
            slots = slots // block_size * rows_per_block + slots % block_size
        _last_store = (key, slots, keep)
    return _last_store[1], _last_store[2]


_last_rotary: tuple | None = None


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotation of q and k together: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin], written as
    x * [cos, cos] + [x2, x1] * [-sin, sin] (the same roundings: negating a product is exact), five ops for both."""
    global _last_rotary
    if (_last_rotary is None or _last_rotary[0] is not positions or _last_rotary[1] is not cos_sin_cache
            or _last_rotary[2].dtype != q.dtype):
        cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # the same for every layer of a step
        cos2, sin2 = torch.cat((cos, cos), dim=-1).to(q.dtype), torch.cat((-sin, sin), dim=-1).to(q.dtype)
        _last_rotary = (positions, cos_sin_cache, cos2, sin2)
    cos2, sin2 = _last_rotary[2], _last_rotary[3]
    x = torch.cat((q, k), dim=1)  # [T, Hq + Hkv, D]
    half = x.shape[-1] // 2
    swapped = x.unflatten(-1, (2, half)).flip(-2).flatten(-2)  # [x2, x1]
    x.mul_(cos2).add_(swapped.mul_(sin2))
    return x.split((q.shape[1], k.shape[1]), dim=1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """torch's own F.rms_norm step for step (fp32 math, the weight applied in fp32, one rounding at the end), in
    half its ops: on the CPU it is a composite of ~15 small ops, 5 of them dtype copies."""
    xf = x.float()
    scale = xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return (xf * scale).mul_(weight).to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
