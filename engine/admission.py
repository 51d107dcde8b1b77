"""What a front end (one engine's, or the router's) does to admit a request: make its SLO concrete, once, and
refuse one that no instance could meet even when idle (DESIGN.md §1)."""
from __future__ import annotations

from engine.engine import InvalidRequestError
from scheduler.attainability import Attainability
from scheduler.slo import SLO
from scheduler.tiers import Tier, TierSet


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
