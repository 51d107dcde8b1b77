"""`RouterBackend`: the fleet behind the HTTP API (the `Backend` of engine/api_server.py)."""
from __future__ import annotations

from typing import AsyncIterator

from cluster.service import RouterService
from engine.engine import InvalidRequestError, RequestOutput
from engine.metrics import ServerMetrics
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from scheduler.instance_state import RequestSnapshot
from scheduler.slo import SLO


class RouterBackend:
    """Admission: the tier and SLO of `slo_for` (an SLO that an idle instance could not meet is refused, once an
    instance has said how large its KV pool is); then the router places, queues (bounded: 429) or, with no
    instance at all, answers 503."""

    def __init__(self, service: RouterService, model_name: str, max_model_len: int, tokenizer: Tokenizer | None,
                 default_tier: str | None = None):
        tiers = service.router.tiers
        self.service = service
        self.model_name, self.max_model_len, self.tokenizer = model_name, max_model_len, tokenizer
        self.default_tier = tiers.by_name(default_tier) if default_tier is not None else tiers[len(tiers) - 1]

    @property
    def ready(self) -> bool:
        return self.service.ready

    async def start(self) -> None:
        await self.service.start()

    async def stop(self) -> None:
        await self.service.stop()

    def bind_metrics(self, metrics: ServerMetrics) -> None:
        self.service.metrics = metrics

    def slo_for(self, spec: str | SLO | None, num_prompt_tokens: int, max_tokens: int) -> tuple[str, SLO]:
        router = self.service.router
        try:
            tier, slo = (self.default_tier, self.default_tier.slo) if spec is None else router.tiers.resolve(spec)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        verdict = router.admissible(RequestSnapshot(0.0, num_prompt_tokens, max_tokens, slo, tier.name))
        if verdict is not None and not verdict.ok:
            raise InvalidRequestError(
                f"SLO ttft {slo.ttft_ms:g} ms, tpot {slo.tpot_ms:g} ms cannot be met even on an idle instance "
                f"({verdict.reason.value}: predicted first token {1000 * verdict.first_token_time:.1f} ms, "
                f"steady iteration {1000 * verdict.steady_iteration_s:.1f} ms, peak KV {verdict.peak_kv_tokens})")
        return tier.name, slo

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, slo: SLO,
                 arrival: float) -> AsyncIterator[RequestOutput]:
        return self.service.generate(request_id, prompt_token_ids, params, slo, arrival)
