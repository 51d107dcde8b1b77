"""Turns the last-position logits of a batch into next tokens: greedy, temperature, top-k, top-p, seeded; and, for
the rows that ask, the chosen token's log-probability and the most likely alternatives."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams
from engine.structured_output import GrammarMask

TopLogprobs = list[tuple[int, float]]  # (token id, log-probability), most likely first


@dataclass(slots=True)
class PromptSpan:
    """Consecutive prompt positions of one batch item whose following prompt token's log-probability is asked."""
    first_row: int  # row of the first position in the flattened batch
    next_token_ids: list[int]  # the prompt token that follows each position
    top_logprobs: int


@dataclass(slots=True)
class SpanLogprobs:
    logprobs: list[float]  # of each position's next prompt token
    top_logprobs: list[TopLogprobs] | None


@dataclass(slots=True)
class SamplerOutput:
    """What an executor returns for a step."""
    token_ids: list[int]  # one per sampled row
    logprobs: list[float] | None  # the chosen token's, every row, when any row asked
    top_logprobs: list[TopLogprobs | None] | None  # per row: its `top_logprobs` alternatives when it asked for any
    prompt_logprobs: list[SpanLogprobs] | None = None  # one per PromptSpan of the batch


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           grammar: GrammarMask | None = None) -> SamplerOutput:
    """logits fp32 [B, V]. Log-probabilities are those of the model's unscaled distribution (temperature, top-k and
    top-p do not change them), as vLLM returns by default and as OpenAI's are for temperature 1."""
    if grammar is not None:  # tokens a row's grammar forbids get -inf: no row draws them, and their logprob is -inf
        grammar.apply(logits)
    tokens = logits.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=logits.device)
        tokens[rows] = _sample_rows(logits[rows], [params[i] for i in sampled_rows],
                                    [generators[i] for i in sampled_rows])
    logprobs = top = None
    if any(p.logprobs for p in params):
        all_logprobs = torch.log_softmax(logits, dim=-1)
        logprobs = all_logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
        top = top_logprobs(all_logprobs, [p.top_logprobs if p.logprobs else 0 for p in params])
    return SamplerOutput(tokens.tolist(), logprobs, top)


IMPOSSIBLE_LOGPROB = -9999.0


def top_logprobs(logprobs: torch.Tensor, counts: list[int]) -> list[TopLogprobs | None] | None:
    """The `counts[i]` most likely tokens of row i of log-probabilities [B, V]; None for rows that ask none, and
    None when no row asks (one top-k over the rows that ask, at the largest count)."""
    rows = [i for i, k in enumerate(counts) if k > 0]
    if not rows:
        return None
    k = max(counts[i] for i in rows)
    values, ids = logprobs[torch.tensor(rows, device=logprobs.device)].topk(k, dim=-1)
    out: list[TopLogprobs | None] = [None] * len(counts)
    # a token a grammar forbids has logprob -inf, which JSON cannot carry: vLLM's floor for "impossible" instead
    values = values.clamp(min=IMPOSSIBLE_LOGPROB)
    for row, row_ids, row_values in zip(rows, ids.tolist(), values.tolist()):
        out[row] = list(zip(row_ids[:counts[row]], row_values[:counts[row]]))
    return out


def skip_samples(generator: torch.Generator, vocab_size: int, num_samples: int) -> None:
    """Advances a request's generator past `num_samples` draws of `sample`, as if it had drawn them here: a stream
    that continues on another instance then draws what it would have drawn where it started. The generator's
    state cannot jump ahead, so the draws are made (one noise row each, as `_sample_rows` makes them)."""
    row = torch.empty(vocab_size, dtype=torch.float32, device=generator.device)
    for _ in range(num_samples):
        row.exponential_(generator=generator)


def span_logprobs(logits: torch.Tensor, spans: list[PromptSpan]) -> list[SpanLogprobs]:
    """logits fp32 [sum of span lengths, V], the spans' rows in order."""
    logprobs = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor([t for s in spans for t in s.next_token_ids], device=logits.device)
    chosen = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
    out, start = [], 0
    for s in spans:
        end = start + len(s.next_token_ids)
        top = top_logprobs(logprobs[start:end], [s.top_logprobs] * (end - start)) if s.top_logprobs else None
        out.append(SpanLogprobs(chosen[start:end], top))
        start = end
    return out


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> torch.Tensor:
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
    sorted_logits, order = (logits / temperature[:, None]).sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k or vocab for p in params], device=device)
    ranks = torch.arange(vocab, device=device)
    sorted_logits.masked_fill_(ranks[None, :] >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=probs.dtype)
    mass_before = probs.cumsum(dim=-1) - probs
    probs.masked_fill_(mass_before >= top_p[:, None], 0.0)  # the most likely token always survives
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p; one noise row per request keeps seeds
    # reproducible whatever else shares the batch.
    noise = torch.empty_like(probs)
    for i, g in enumerate(generators):
        noise[i].exponential_(generator=g)
    choice = (probs / noise).argmax(dim=-1)
    return order.gather(1, choice[:, None]).squeeze(1)
