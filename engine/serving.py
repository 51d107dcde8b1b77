"""What a serving process shares beside the HTTP app (engine/api_server.py), kept free of aiohttp so the engine
worker and the simulator's calibration can use it: the refusals a `Backend` raises at admission, which the HTTP
layer answers with their status codes, and the start-up heap freeze every serving process does."""
from __future__ import annotations

import gc


class QueueFullError(Exception):
    """Admission refused because the queue is at its bound; answered 429 with Retry-After."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NoInstanceError(Exception):
    """No instance can take the request now (none running, none can be started); answered 503."""


def freeze_startup_heap() -> None:
    """Takes every object alive now (model, tokenizer, modules: what lives as long as the process) out of the
    garbage collector's walks, so that a full collection while serving walks only what serving allocated: its pause
    stays short. vLLM freezes its heap after warm-up (`freeze_gc_heap`), SGLang offers the same (`freeze_gc`)."""
    gc.collect()
    gc.freeze()
