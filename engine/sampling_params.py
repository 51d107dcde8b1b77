"""Per-request sampling controls, validated on construction so bad values fail before they reach a batch."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.structured_output import StructuredOutput


MAX_TOP_LOGPROBS = 20  # the alternatives one position may ask for: bounds the sampler's top-k


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: no limit
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False  # return the log-probability of each chosen token
    # with logprobs and prompt_logprobs: this many most likely alternatives of every position too
    top_logprobs: int = 0
    # the log-probability of every prompt token after the first (its prompt is then computed, never served from the
    # prefix cache: cached positions have no logits)
    prompt_logprobs: bool = False
    structured_output: StructuredOutput | None = None  # None: free text

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disable it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if self.top_logprobs and not (self.logprobs or self.prompt_logprobs):
            raise ValueError("top_logprobs needs logprobs or prompt_logprobs")
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutput):
                raise ValueError(f"structured_output must be a StructuredOutput, got {self.structured_output!r}")
            self.structured_output.check()
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
