"""CUDA graphs of the model's forward for decode-only steps at fixed batch sizes.

A small decode step is a few hundred kernel launches of a few microseconds each: launch overhead, not the GPU,
sets its time. Each captured size replays the whole forward with one launch; a batch is padded up to the next
captured size with sequences of no context (seq_len 0, slot -1), which the kernels leave as zero rows.
"""
from __future__ import annotations

import torch

from engine.context import AttentionContext, set_context

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device):
        from kernels.attention import choose_num_splits, num_sms  # Triton: only where CUDA graphs are made

        self.sizes = [s for s in CAPTURE_SIZES if s <= max_num_seqs] or [1]
        n = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        cfg = model.cfg
        pool = None
        for bs in reversed(self.sizes):  # the largest first: the smaller graphs reuse its memory pool
            # The split count is the most a sequence may need (at max_model_len); the attention kernel gives each
            # sequence only the splits its own keys fill and the others exit at once. One graph per batch size
            # then serves every context, and a batch mixing long and short sequences splits each as it needs,
            # which graphs per split bucket (more captures, a choice from the longest sequence only) would not.
            set_context(AttentionContext(
                self.slot_mapping[:bs], self.block_tables[:bs], self.seq_lens[:bs], self.query_start_loc[:bs + 1],
                max_seq_len=max_model_len, max_query_len=1,
                num_splits=choose_num_splits(bs, cfg.num_kv_heads, max_model_len, num_sms(device))))
            try:
                model(self.input_ids[:bs], self.positions[:bs])  # compiles and loads every kernel before capture
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bs] = model(self.input_ids[:bs], self.positions[:bs])
            finally:
                set_context(None)
            pool = graph.pool()
            self.graphs[bs] = graph

    def fits(self, num_seqs: int, num_tokens: int) -> bool:
        return num_tokens == num_seqs <= self.sizes[-1]

    def run(self, meta) -> torch.Tensor:
        """Hidden states [B, hidden] of a decode-only batch (meta: engine._C.BatchMetadata)."""
        b = len(meta.seq_lens)
        bs = next(s for s in self.sizes if s >= b)
        width = meta.block_tables.shape[1]
        self.input_ids[:b].copy_(torch.from_numpy(meta.input_ids), non_blocking=True)
        self.positions[:b].copy_(torch.from_numpy(meta.positions), non_blocking=True)
        self.slot_mapping[:b].copy_(torch.from_numpy(meta.slot_mapping), non_blocking=True)
        self.slot_mapping[b:bs].fill_(-1)
        self.seq_lens[:b].copy_(torch.from_numpy(meta.seq_lens), non_blocking=True)
        self.seq_lens[b:bs].zero_()
        self.block_tables[:b, :width].copy_(torch.from_numpy(meta.block_tables), non_blocking=True)
        self.graphs[bs].replay()
        return self.outputs[bs][:b]
