"""Random flattened mixed batches over a paged KV cache, for the kernel tests and benchmarks.

Blocks are handed out in a shuffled order (block tables are never the identity), table entries past a sequence's
last block point at spare blocks (block 0 among them), and every cache slot no sequence owns (spare blocks, the
tail of a last block) can be filled with NaN, so an attention kernel that reads a key it should not shows it in
its output. K and V lie as in one layer of the engine's block-major cache: a block's K and V side by side, so
that the blocks of each are strided, as the engine's are.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PagedBatch:
    q: torch.Tensor                # [T, Hq, D]
    k_cache: torch.Tensor          # [num_blocks, block_size, Hkv, D], blocks strided
    v_cache: torch.Tensor
    block_tables: torch.Tensor     # int32 [B, max_blocks]
    seq_lens: torch.Tensor         # int32 [B]
    query_start_loc: torch.Tensor  # int32 [B + 1]
    scale: float
    q_lens: list[int]
    context_lens: list[int]

    def attention_args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.query_start_loc,
                self.scale)

    def keys_seen(self) -> int:
        """Sum over query tokens of the keys each one attends to (causal): the work of the attention."""
        return sum(q_len * context + q_len * (q_len + 1) // 2
                   for q_len, context in zip(self.q_lens, self.context_lens))


def random_paged_batch(q_lens: list[int], context_lens: list[int], num_q_heads: int, num_kv_heads: int,
                       head_dim: int, block_size: int, dtype: torch.dtype, device: str | torch.device,
                       seed: int = 0, spare_blocks: int = 2, poison_unused: bool = True) -> PagedBatch:
    """Sequence i has context_lens[i] cached tokens before this step and q_lens[i] query tokens in it; its cache
    already holds all context_lens[i] + q_lens[i] tokens (as after this step's KV store)."""
    if len(q_lens) != len(context_lens):
        raise ValueError(f"{len(q_lens)} query lengths for {len(context_lens)} context lengths")
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    seq_lens = [context + q_len for context, q_len in zip(context_lens, q_lens)]
    blocks_per_seq = [-(-length // block_size) for length in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=generator, device=device).to(torch.int32)
    if spare_blocks:  # physical block 0 stays a spare: code that pads gathers with slot 0 then reads NaN
        order = torch.cat((order[order != 0], order[order == 0]))
    max_blocks = max(blocks_per_seq, default=0) + 1
    spare = order[sum(blocks_per_seq):]
    block_tables = torch.empty((len(seq_lens), max_blocks), dtype=torch.int32, device=device)
    owned = torch.zeros((num_blocks, block_size), dtype=torch.bool, device=device)
    next_block = 0
    for i, (length, count) in enumerate(zip(seq_lens, blocks_per_seq)):
        mine = order[next_block:next_block + count]
        next_block += count
        block_tables[i, :count] = mine
        block_tables[i, count:] = spare[0] if len(spare) else 0
        slots = torch.arange(count * block_size, device=device) < length
        owned[mine.long()] = slots.view(count, block_size)

    kv = torch.randn((num_blocks, 2, block_size, num_kv_heads, head_dim), generator=generator, device=device,
                     dtype=dtype)
    k_cache, v_cache = kv[:, 0], kv[:, 1]
    if poison_unused:
        k_cache[~owned] = float("nan")
        v_cache[~owned] = float("nan")
    q = torch.randn((sum(q_lens), num_q_heads, head_dim), generator=generator, device=device, dtype=dtype)
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    return PagedBatch(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        scale=head_dim ** -0.5, q_lens=list(q_lens), context_lens=list(context_lens),
    )
