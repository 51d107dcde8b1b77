"""What a serving process shares beside the HTTP app (engine/api_server.py), kept free of aiohttp so the engine
worker and the simulator's calibration can use it: admission (a request's SLO made concrete once; refusals that the
HTTP layer answers with their status codes) and the start-up heap freeze every serving process does."""
from __future__ import annotations

import gc

from engine.engine import InvalidRequestError
from scheduler.attainability import Attainability
from scheduler.slo import SLO
from scheduler.tiers import Tier, TierSet


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


def admit_slo(tiers: TierSet, spec: SLO | str | None) -> tuple[Tier, SLO]:
    """`TierSet.resolve`, its refusals as InvalidRequestError (HTTP 400)."""
    try:
        return tiers.resolve(spec)
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None


def refuse_unattainable(verdict: Attainability, slo: SLO) -> None:
    """Raises InvalidRequestError, naming why, when an idle instance's verdict is no."""
    if not verdict.ok:
        raise InvalidRequestError(
            f"SLO ttft {slo.ttft_ms:g} ms, tpot {slo.tpot_ms:g} ms cannot be met even on an idle instance "
            f"({verdict.reason.value}: predicted first token {1000 * verdict.first_token_time:.1f} ms, "
            f"steady iteration {1000 * verdict.steady_iteration_s:.1f} ms, peak KV {verdict.peak_kv_tokens} "
            "tokens)")
