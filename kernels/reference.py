"""Slow, obviously-correct torch versions of every kernel. The CPU path of the engine and the oracle of the tests.

Shapes shared by all attention ops (a flattened mixed batch of B sequences and T query tokens):
    q                [T, Hq, D]
    k_cache, v_cache [num_blocks, block_size, Hkv, D]  (the blocks may be strided: one layer of a block-major cache)
    block_tables     int32 [B, max_blocks_per_seq]  (entries past a sequence's blocks are ignored)
    seq_lens         int32 [B]   context length of each sequence after this step's tokens are stored
    query_start_loc  int32 [B+1] the query tokens of sequence i are q[query_start_loc[i]:query_start_loc[i+1]]
Query token j of sequence i sits at position seq_lens[i] - q_len_i + j and attends to every key at or before it.
"""
from __future__ import annotations

import torch


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write k, v [T, Hkv, D] into the caches at flat slots `slot_mapping` [T] (block * block_size + offset); -1 skips."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    k_cache[slots // block_size, slots % block_size] = k[keep].to(k_cache.dtype)
    v_cache[slots // block_size, slots % block_size] = v[keep].to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` tokens of one sequence's cache, contiguous: [seq_len, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    return cache[block_table[:num_blocks].long()].reshape(-1, *cache.shape[2:])[:seq_len]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *,
                    max_query_len: int | None = None, max_seq_len: int | None = None,
                    num_splits: int | None = None, num_decodes: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's query tokens over its paged context; fp32 math, output in q's dtype.
    The keyword hints steer the GPU kernels' launch shapes (kernels.attention) and do not change the result."""
    out = torch.empty_like(q)
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        qs = q[starts[i]:starts[i + 1]].float()  # [L, Hq, D]
        q_len = qs.shape[0]
        if q_len == 0:
            continue
        k = gather_kv(k_cache, block_tables[i], seq_len).float().repeat_interleave(group, dim=1)
        v = gather_kv(v_cache, block_tables[i], seq_len).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
        scores.masked_fill_(k_pos > q_pos, float("-inf"))
        out[starts[i]:starts[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


def merge_splits(partial_out: torch.Tensor, partial_lse: torch.Tensor) -> torch.Tensor:
    """Split-KV attention put back together. partial_out [S, T, Hq, D]: each split's attention over its slice of
    the keys; partial_lse [S, T, Hq]: the base-2 log of that slice's softmax mass (-inf: the slice had no key, its
    partial output is ignored). Returns [T, Hq, D] float32; zeros where no slice had a key."""
    out = torch.zeros(partial_out.shape[1:], dtype=torch.float32, device=partial_out.device)
    for token in range(partial_out.shape[1]):
        for head in range(partial_out.shape[2]):
            lse = partial_lse[:, token, head].float()
            seen = lse > float("-inf")
            if seen.any():
                mass = torch.exp2(lse[seen] - lse[seen].max())
                out[token, head] = (mass[:, None] * partial_out[seen, token, head].float()).sum(0) / mass.sum()
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x, then normalise it: returns (normed, new residual)."""
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return rms_norm(new_residual, weight, eps), new_residual


def rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary (the Hugging Face Llama layout). q [T, Hq, D], k [T, Hkv, D];
    cos_sin_cache [max_pos, D] holds cos in its first D/2 columns and sin in the rest."""
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return rotate_neox(q, cos, sin), rotate_neox(k, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
