"""Attention metadata of the current step. The model sees only (input_ids, positions); attention reads the rest here.
One per thread: each engine steps on a thread of its own, and two engines in one process (a prefill and a decode
engine in a test, or beside a server) must not read each other's."""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionContext:
    slot_mapping: torch.Tensor  # int64 [T]
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    seq_lens: torch.Tensor  # int32 [B]
    query_start_loc: torch.Tensor  # int32 [B+1]
    max_seq_len: int
    max_query_len: int
    num_splits: int | None = None  # KV splits of decode attention; fixed per captured CUDA graph, else chosen
    num_decodes: int | None = None  # leading sequences with one query token each (attention's decode launch)


_local = threading.local()


def set_context(ctx: AttentionContext | None) -> None:
    _local.context = ctx


def get_context() -> AttentionContext:
    ctx = getattr(_local, "context", None)
    if ctx is None:
        raise RuntimeError("attention called outside a step: no AttentionContext is set")
    return ctx
