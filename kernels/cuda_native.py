"""The CUDA C++ kernels of csrc/cuda (module kernels._cuda, built by setup.py where CUDA is present and its
toolchain can build them) behind the reference signatures: the KV-cache store, and decode attention used for
batches the caller marks as decode-only (max_query_len=1); every other batch goes to the Triton attention."""
from __future__ import annotations

import importlib

import torch

from kernels import attention
from kernels.kv_store import check_store_inputs

CUDA_HEAD_DIMS = (64, 128)  # the decode kernel's compiled instantiations


def load():
    """The compiled module; ImportError naming the cause when it was not built."""
    try:
        return importlib.import_module("kernels._cuda")
    except ImportError as error:
        raise ImportError("kernels._cuda is not built: install the project on a machine with CUDA "
                          "(pip install --no-build-isolation -v -e .) so setup.py compiles csrc/cuda; where it "
                          "cannot, the install's output says why") from error


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    check_store_inputs(k, v, k_cache, v_cache, slot_mapping)
    load().store_kvcache(k, v, k_cache, v_cache, slot_mapping)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, num_splits: int) -> torch.Tensor:
    """One query token per sequence: q [B, Hq, D] with token i belonging to sequence i."""
    return load().decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *,
                    max_query_len: int | None = None, max_seq_len: int | None = None,
                    num_splits: int | None = None, num_decodes: int | None = None) -> torch.Tensor:
    """kernels.attention.paged_attention, with decode-only batches (max_query_len == 1, one token per sequence)
    of head_dim 64 or 128 sent to the CUDA C++ kernel; the hints mean the same as there."""
    num_seqs = block_tables.shape[0]
    if max_query_len != 1 or q.shape[0] != num_seqs or q.shape[2] not in CUDA_HEAD_DIMS:
        return attention.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                         max_query_len=max_query_len, max_seq_len=max_seq_len,
                                         num_splits=num_splits, num_decodes=num_decodes)
    if num_splits is None:
        num_splits = attention.choose_num_splits(num_seqs, k_cache.shape[2], max_seq_len,
                                                 attention.num_sms(q.device))
    return decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits)
