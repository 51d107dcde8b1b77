"""Executors run one step's batch and return the sampled tokens. Two behind one interface: the real model, and an
emulated one that runs no model and sleeps for a given step time, so fleets of engine processes run without a GPU."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from engine._C import BatchMetadata
from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class StepBatch:
    meta: BatchMetadata
    params: list[SamplingParams]  # one per sampled row
    generators: list[torch.Generator | None]
    num_prefill_tokens: int
    num_decode_seqs: int
    num_kv_tokens: int
    num_seqs: int  # sequences in the batch, prefills included


class Executor(Protocol):
    num_kv_blocks: int
    vocab_size: int
    device: torch.device  # where per-request sampling generators live

    def execute(self, batch: StepBatch) -> tuple[list[int], list[float] | None]: ...


StepTimeFn = Callable[[int, int, int, int], float]  # (prefill tokens, decode seqs, kv tokens, sequences) -> seconds


class EmulatedExecutor:
    """Deterministic tokens (a function of the last token and its position, never an end-of-sequence id) after
    sleeping `step_time(prefill tokens, decode seqs, kv tokens, sequences)` seconds."""

    def __init__(self, step_time: StepTimeFn, num_kv_blocks: int, vocab_size: int, eos_token_ids: tuple[int, ...],
                 sleep: Callable[[float], None] = time.sleep):
        self.step_time, self.num_kv_blocks, self.vocab_size = step_time, num_kv_blocks, vocab_size
        self.eos = set(eos_token_ids)
        self.device = torch.device("cpu")
        self.sleep = sleep  # a virtual clock's advance in tests

    def execute(self, batch: StepBatch) -> tuple[list[int], list[float] | None]:
        meta = batch.meta
        delay = self.step_time(batch.num_prefill_tokens, batch.num_decode_seqs, batch.num_kv_tokens, batch.num_seqs)
        last = meta.input_ids[meta.logits_indices]
        pos = meta.positions[meta.logits_indices]
        tokens = []
        for t, p in zip(last.tolist(), pos.tolist()):
            tok = (t * 1103515245 + p * 12345 + 7) % self.vocab_size
            while tok in self.eos:
                tok = (tok + 1) % self.vocab_size
            tokens.append(tok)
        if delay > 0:
            self.sleep(delay)
        logprobs = [0.0] * len(tokens) if any(p.logprobs for p in batch.params) else None
        return tokens, logprobs
