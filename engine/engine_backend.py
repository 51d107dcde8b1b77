"""`EngineBackend`: one engine in this process behind the HTTP API (the `Backend` of `engine.api_server`)."""
from __future__ import annotations

from typing import AsyncIterator

from engine.async_engine import AsyncEngine, EngineLoad
from engine.engine import Engine, RequestOutput
from engine.metrics import ServerMetrics
from engine.sampling_params import SamplingParams
from engine.serving import NoInstanceError, QueueFullError, admit_slo, refuse_unattainable
from engine.tokenizer import Tokenizer
from scheduler.instance_state import RequestSnapshot
from scheduler.slo import SLO
from scheduler.types import StepStats

INSTANCE = "0"  # this backend's one instance, as /metrics labels it


class EngineBackend:
    """Builds the AsyncEngine around `engine` (whose step loop starts with `start`).

    Admission: the tier and SLO of `slo_for`, through the engine's tiers (with `check_idle`, an SLO that an idle
    instance could not meet by the engine's latency model is refused), then a bound on requests still waiting for
    their first token (`max_pending`, else QueueFullError with `retry_after_s`).
    """

    def __init__(self, engine: Engine, model_name: str, *, check_idle: bool = False, max_pending: int = 256,
                 retry_after_s: float = 1.0):
        if max_pending < 1:
            raise ValueError(f"max_pending must be positive, got {max_pending}")
        self.engine = engine
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.tokenizer: Tokenizer | None = engine.tokenizer
        self.tiers = engine.tiers
        self.checker = engine.attainability if check_idle else None
        self.max_pending, self.retry_after_s = max_pending, retry_after_s
        self._num_kv_blocks = engine.blocks.num_total_blocks
        self.metrics: ServerMetrics | None = None
        self.async_engine = AsyncEngine(engine, on_step=self._on_step, on_load=self._on_load)
        self._pending = 0
        self._running = False

    @property
    def ready(self) -> bool:
        return self._running

    @property
    def num_pending(self) -> int:
        """Admitted requests still waiting for their first token (what `max_pending` bounds)."""
        return self._pending

    async def start(self) -> None:
        await self.async_engine.start()
        self._running = True

    async def stop(self) -> None:
        self._running = False
        await self.async_engine.stop()

    def bind_metrics(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        for tier in self.tiers:  # one engine serves every tier
            metrics.set_instances(tier.name, 1)

    def slo_for(self, spec: str | SLO | None, num_prompt_tokens: int, max_tokens: int) -> tuple[str, SLO]:
        tier, slo = admit_slo(self.tiers, spec)
        if self.checker is not None:
            kv_tokens = self._num_kv_blocks * self.engine.block_size
            refuse_unattainable(self.checker.check_idle(
                RequestSnapshot(0.0, num_prompt_tokens, max_tokens, slo, tier.name), kv_tokens), slo)
        return tier.name, slo

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, tier: str,
                       slo: SLO, arrival: float) -> AsyncIterator[RequestOutput]:
        if not self._running:
            raise NoInstanceError("the engine is not running")
        if self._pending >= self.max_pending:
            raise QueueFullError(f"{self._pending} requests are already waiting for their first token",
                                 self.retry_after_s)
        self._pending += 1
        pending = True
        try:
            async for out in self.async_engine.generate(request_id, prompt_token_ids, params, slo, arrival, tier):
                if pending:
                    pending = False
                    self._pending -= 1
                    if self.metrics is not None and out.first_scheduled_time is not None:
                        self.metrics.observe_queue_time(tier, max(0.0, out.first_scheduled_time - out.arrival))
                yield out
        finally:
            if pending:
                self._pending -= 1

    def _on_step(self, stats: StepStats, _: None) -> None:
        if self.metrics is None:
            return
        self.metrics.observe_batch(INSTANCE, stats.num_seqs)
        self.metrics.observe_step(INSTANCE, stats.duration, stats.num_blocks_used / self._num_kv_blocks,
                                  stats.num_running, stats.num_waiting)

    def _on_load(self, load: EngineLoad) -> None:
        if self.metrics is not None:
            self.metrics.observe_load(INSTANCE, load.num_blocks_used / self._num_kv_blocks, load.num_running,
                                      load.num_waiting)
