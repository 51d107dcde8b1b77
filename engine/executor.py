"""Executors run one step's batch and return the sampled tokens. Two behind one interface: the real model, and an
emulated one that runs no model and sleeps for a given step time, so fleets of engine processes run without a GPU."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from engine._C import BatchMetadata
from engine.sampler import IMPOSSIBLE_LOGPROB, PromptSpan, SamplerOutput, SpanLogprobs
from engine.sampling_params import SamplingParams
from engine.structured_output import GrammarMask


@dataclass(slots=True)
class StepBatch:
    meta: BatchMetadata
    params: list[SamplingParams]  # one per sampled row
    generators: list[torch.Generator | None]
    num_prefill_tokens: int
    num_decode_seqs: int
    num_kv_tokens: int
    num_seqs: int  # sequences in the batch, prefills included
    grammar: GrammarMask | None = None  # the sampled rows held to a structured output
    prompt_spans: list[PromptSpan] = field(default_factory=list)  # prompt positions whose logprobs are asked


class Executor(Protocol):
    num_kv_blocks: int
    vocab_size: int
    device: torch.device  # where per-request sampling generators live
    kv_cache: torch.Tensor | None  # [blocks, layers, 2, block_size, kv heads, head dim]; None: it keeps no KV

    def execute(self, batch: StepBatch) -> SamplerOutput: ...


StepTimeFn = Callable[[int, int, int, int], float]  # (prefill tokens, decode seqs, kv tokens, sequences) -> seconds


class EmulatedExecutor:
    """Deterministic tokens (a function of the last token and its position, never an end-of-sequence id; under a
    structured output, the nearest token its grammar allows: end-of-sequence once the document is complete) after
    sleeping `step_time(prefill tokens, decode seqs, kv tokens, sequences)` seconds."""

    def __init__(self, step_time: StepTimeFn, num_kv_blocks: int, vocab_size: int, eos_token_ids: tuple[int, ...],
                 sleep: Callable[[float], None] = time.sleep):
        self.step_time, self.num_kv_blocks, self.vocab_size = step_time, num_kv_blocks, vocab_size
        self.eos = set(eos_token_ids)
        self.device = torch.device("cpu")
        self.kv_cache = None
        self.sleep = sleep  # a virtual clock's advance in tests

    def execute(self, batch: StepBatch) -> SamplerOutput:
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
        if batch.grammar is not None:
            tokens = batch.grammar.nearest_allowed(tokens)
        if delay > 0:
            self.sleep(delay)
        # every emitted token is certain: log-probability 0, and its alternatives impossible (vLLM's floor)
        logprobs = [0.0] * len(tokens) if any(p.logprobs for p in batch.params) else None
        top = None
        if any(p.logprobs and p.top_logprobs for p in batch.params):
            top = [self._certain(tok, p.top_logprobs) if p.logprobs and p.top_logprobs else None
                   for tok, p in zip(tokens, batch.params)]
        spans = [SpanLogprobs([0.0] * len(s.next_token_ids),
                              [self._certain(t, s.top_logprobs) for t in s.next_token_ids] if s.top_logprobs else None)
                 for s in batch.prompt_spans]
        return SamplerOutput(tokens, logprobs, top, spans or None)

    def _certain(self, token: int, k: int) -> list[tuple[int, float]]:
        return [(token, 0.0)] + [((token + j) % self.vocab_size, IMPOSSIBLE_LOGPROB) for j in range(1, k)]
