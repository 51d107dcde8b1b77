"""Turns the last-position logits of a batch into next tokens: greedy, temperature, top-k, top-p, seeded."""
from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> tuple[list[int], list[float] | None]:
    """logits fp32 [B, V]. Returns the chosen token of every row and, if any row asked, their log-probabilities
    under the model's unscaled distribution."""
    tokens = logits.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=logits.device)
        tokens[rows] = _sample_rows(logits[rows], [params[i] for i in sampled_rows],
                                    [generators[i] for i in sampled_rows])
    logprobs = None
    if any(p.logprobs for p in params):
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1).tolist()
    return tokens.tolist(), logprobs


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
