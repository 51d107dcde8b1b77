"""The streaming interface: the engine steps on a thread of its own; asyncio callers add requests, read each one's
outputs as they are produced, and abort them. Used by the HTTP server and the cluster worker."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import deque
from typing import Any, AsyncIterator, Callable

from engine.engine import Engine, RequestOutput
from engine.sampling_params import SamplingParams
from scheduler.slo import SLO
from scheduler.types import StepStats

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: Engine, on_step: Callable[[StepStats, Any], None] | None = None,
                 snapshot: Callable[[Engine], Any] | None = None):
        """`on_step(stats, snapshot(engine))` runs on the event loop after every step; `snapshot` (None: no
        snapshot) on the engine thread right after the step, where the engine's lists are consistent."""
        self.engine = engine
        self.on_step, self.snapshot = on_step, snapshot
        self._stepped: tuple[StepStats, Any] | None = None  # the step just taken, set by the engine's step hook
        engine.step_hooks.append(self._after_step)
        self._commands: deque[tuple[Callable, concurrent.futures.Future | None]] = deque()
        self._wake = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    async def call(self, fn: Callable, *args):
        """Runs fn(engine, *args) on the engine thread between steps and returns its result (or raises)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.append((lambda: fn(self.engine, *args), fut))
        self._wake.set()
        return await asyncio.wrap_future(fut)

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       slo: SLO | str | None = None, arrival: float | None = None,
                       tier: str | None = None) -> AsyncIterator[RequestOutput]:
        """Adds the request (`Engine.add_request`: raising InvalidRequestError at once if it can't run) and yields
        its outputs; leaving the iteration early aborts the request and frees its KV."""
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        try:
            await self.call(Engine.add_request, request_id, prompt, params, slo, arrival, tier)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        finished = False
        try:
            while not finished:
                out: RequestOutput = await queue.get()
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.append((lambda: self.engine.abort(request_id), None))
        self._wake.set()

    # ---- engine thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            outputs: list[RequestOutput] = []
            while self._commands:
                fn, fut = self._commands.popleft()
                try:
                    result = fn()
                except Exception as e:
                    if fut is not None:
                        fut.set_exception(e)
                    continue
                if fut is not None:
                    fut.set_result(result)
                elif isinstance(result, RequestOutput):
                    outputs.append(result)  # an abort's final output
            stepped = self._stepped = None
            if self.engine.has_unfinished():
                try:
                    outputs.extend(self.engine.step())
                except Exception:  # the engine's own invariants broke: end everything loudly rather than hang
                    log.exception("engine step crashed; ending all requests")
                    outputs.extend(self._fail_all("engine step crashed"))
                stepped = self._stepped
            elif not self._commands:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
            if outputs or stepped is not None:
                self._loop.call_soon_threadsafe(self._deliver, outputs, stepped)

    def _after_step(self, stats: StepStats) -> None:
        self._stepped = (stats, self.snapshot(self.engine) if self.snapshot is not None else None)

    def _fail_all(self, reason: str) -> list[RequestOutput]:
        outs = []
        for req in list(self.engine.running) + list(self.engine.waiting):
            out = self.engine.abort(req.request_id)
            out.finish_reason, out.error = "error", reason
            outs.append(out)
        return outs

    def _deliver(self, outputs: list[RequestOutput], stepped: tuple[StepStats, Any] | None) -> None:
        for out in outputs:
            queue = self._streams.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        if self.on_step is not None and stepped is not None:
            self.on_step(*stepped)
