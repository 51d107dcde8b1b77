"""`RouterBackend`: the fleet behind the HTTP API (the `Backend` of engine/api_server.py)."""
from __future__ import annotations

from typing import AsyncIterator

from cluster.service import RouterService
from engine.engine import RequestOutput
from engine.metrics import ServerMetrics
from engine.sampling_params import SamplingParams
from engine.serving import admit_slo, refuse_unattainable
from engine.tokenizer import Tokenizer
from scheduler.instance_state import RequestSnapshot
from scheduler.slo import SLO


class RouterBackend:
    """Admission: the tier and SLO of `slo_for`, through the router's tiers (an SLO that an idle instance could not
    meet is refused, once an instance has said how large its KV pool is); then the router places, queues (bounded:
    429) or, with no instance at all, answers 503."""

    def __init__(self, service: RouterService, model_name: str, max_model_len: int, tokenizer: Tokenizer | None):
        self.service = service
        self.model_name, self.max_model_len, self.tokenizer = model_name, max_model_len, tokenizer

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
        tier, slo = admit_slo(router.tiers, spec)
        verdict = router.admissible(RequestSnapshot(0.0, num_prompt_tokens, max_tokens, slo, tier.name))
        if verdict is not None:
            refuse_unattainable(verdict, slo)
        return tier.name, slo

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, tier: str, slo: SLO,
                 arrival: float) -> AsyncIterator[RequestOutput]:
        return self.service.generate(request_id, prompt_token_ids, params, tier, slo, arrival)
