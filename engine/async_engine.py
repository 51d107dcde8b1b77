"""The streaming interface: the engine steps on a thread of its own; asyncio callers add requests, read each one's
outputs as they are produced, and abort them. Used by the HTTP server and the cluster worker."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Protocol

from engine.engine import Engine, InvalidRequestError, RequestOutput
from engine.kv_transfer import ChunkLanding, Handoff, KvBegin, KvChunk, KvEnd
from engine.sampling_params import SamplingParams
from scheduler.slo import SLO
from scheduler.types import StepStats

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class EngineLoad:
    """What the engine holds between steps (a step's StepStats says the same as of its end)."""
    num_running: int
    num_waiting: int
    num_blocks_used: int


class KvSource(Protocol):
    """Where an imported request's KV comes from (a prefill engine, over some transport)."""

    def frames(self, first_block: int,
               chunk_memory: Callable[[int], ChunkLanding]) -> AsyncGenerator[KvBegin | KvChunk | KvEnd, None]:
        """The transfer's frames from the prompt's block `first_block` on, in order. A transport that reads a
        chunk's head before its data may read the data into `chunk_memory(its size)` (`KvReceiver.chunk_memory`: on
        a CPU cache the reserved blocks' rows) and yield the chunk with that landing as its data: it is then not
        copied again."""

    async def applied(self) -> None:
        """The KV is in this engine: the sender may let go of it."""

    def close(self) -> None:
        """The transfer is given up (nothing of it applied): the sender keeps its KV."""


class AsyncEngine:
    def __init__(self, engine: Engine, on_step: Callable[[StepStats, Any], None] | None = None,
                 snapshot: Callable[[Engine], Any] | None = None,
                 on_load: Callable[[EngineLoad], None] | None = None):
        """`on_step(stats, snapshot(engine))` runs on the event loop after every step; `snapshot` (None: no
        snapshot) on the engine thread right after the step, where the engine's lists are consistent.
        `on_load(load)` runs on the event loop when the engine's load changed with no step to say so (an abort,
        a request added or ended while no step follows), so what the last step reported does not outlive it."""
        self.engine = engine
        self.on_step, self.snapshot, self.on_load = on_step, snapshot, on_load
        self._stepped: tuple[StepStats, Any] | None = None  # the step just taken, set by the engine's step hook
        self._load: EngineLoad | None = None  # as last told (by a step or by on_load)
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
        """Runs fn(engine, *args) on the engine thread between steps and returns its result (or raises). A caller
        that stops waiting before it ran (its task cancelled) cancels it; once it ran, it stays done."""
        return await self._call(fn, args)

    async def _call(self, fn: Callable, args: tuple, undo: Callable[[Any], Any] | None = None):
        """`call`, and `undo(result)` on the engine thread if the caller stops waiting after fn completed: fn's
        work would otherwise stay in the engine with nobody to read or end it."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._post(lambda: fn(self.engine, *args), fut)
        try:
            return await asyncio.wrap_future(fut)
        except BaseException:
            if undo is not None:
                self._undo(fut, undo)
            raise

    def _undo(self, fut: concurrent.futures.Future, undo: Callable[[Any], Any]) -> None:
        """Queues undo(fut's result), run iff fut's command completed without an error: commands run in order, so
        by then the command has run (or was cancelled before it ran, leaving nothing to undo). A command that
        failed did nothing of its own to undo (an id refused as in use belongs to another request)."""
        def run() -> None:
            if not fut.cancelled() and fut.exception() is None:
                undo(fut.result())  # its outputs go nowhere: nobody reads this request any more
        self._post(run)

    def _post(self, fn: Callable[[], Any], fut: concurrent.futures.Future | None = None) -> None:
        self._commands.append((fn, fut))
        self._wake.set()

    def _open_stream(self, request_id: str) -> asyncio.Queue:
        """The queue a new request's outputs go to; InvalidRequestError while another stream has its id (taking
        the id over would leave that stream without its outputs)."""
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        return queue

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       slo: SLO | str | None = None, arrival: float | None = None,
                       tier: str | None = None, resumed_tokens: int = 0,
                       tpot_reserve: float = 0.0) -> AsyncIterator[RequestOutput]:
        """Adds the request (`Engine.add_request`: raising InvalidRequestError at once if it can't run) and yields
        its outputs; leaving the iteration early aborts the request and frees its KV."""
        queue = self._open_stream(request_id)
        try:
            if params.structured_output is not None:  # compiling a grammar can take a while: not on the step loop
                await asyncio.to_thread(self.engine.compile_grammar, params)
            await self._call(Engine.add_request,
                             (request_id, prompt, params, slo, arrival, tier, resumed_tokens, tpot_reserve),
                             undo=lambda _: self.engine.abort(request_id))
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        async for out in self._outputs(request_id, queue):
            yield out

    async def generate_imported(self, handoff: Handoff, source: KvSource) -> AsyncIterator[RequestOutput]:
        """A request a prefill engine ran to its first token, continued here (a decode engine): its blocks are
        reserved (KvImportRefused, nothing pulled, when they are not free), its KV pulled from `source` and checked
        off the engine thread, applied (`Engine.finish_import`), `source` told so, and its outputs after the first
        token yielded as `generate`'s. A transfer that fails raises its error from the first iteration, with the
        reservation given back and `source` closed."""
        request_id = handoff.request_id
        queue = self._open_stream(request_id)  # before the import: its first step's outputs may come right after
        try:
            if handoff.params.structured_output is not None:  # as `generate`: finish_import finds it compiled
                await asyncio.to_thread(self.engine.compile_grammar, handoff.params)
            # Engine.abort gives back a reservation and ends an applied import alike.
            receiver = await self._call(Engine.reserve_import, (handoff,),
                                        undo=lambda _: self.engine.abort(request_id))
            try:
                frames = source.frames(receiver.first_block, receiver.chunk_memory)
                try:
                    async for frame in frames:
                        receiver.receive(frame)
                finally:
                    await frames.aclose()
                await self.call(Engine.finish_import, receiver)
            except BaseException:  # the reservation, or the request a finish_import queued before applied
                self._drop(request_id)
                raise
        except BaseException:
            self._streams.pop(request_id, None)
            source.close()
            raise
        async for out in self._outputs(request_id, queue, source.applied()):
            yield out

    async def _outputs(self, request_id: str, queue: asyncio.Queue,
                       first: Awaitable[None] | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs until its last (after awaiting `first`); leaving early aborts it."""
        finished = False
        try:
            if first is not None:
                await first
            while not finished:
                out: RequestOutput = await queue.get()
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._drop(request_id)

    def abort(self, request_id: str) -> None:
        """Ends the request; its stream reads the final output ("abort")."""
        self._post(lambda: self.engine.abort(request_id))

    def hand_over(self, request_id: str) -> None:
        """Lets go of a decoding request between steps (`Engine.hand_over`); its stream reads the final output
        ("prefilled", with its hand-off), or goes on as before where it is not decoding."""
        self._post(lambda: self.engine.hand_over(request_id))

    def _drop(self, request_id: str) -> None:
        """Ends a request whose stream is closed. Its final output goes nowhere: a new stream may have its id by
        the time it would arrive."""
        def drop() -> None:
            self.engine.abort(request_id)
        self._post(drop)

    # ---- engine thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            outputs: list[RequestOutput] = []
            while self._commands:
                fn, fut = self._commands.popleft()
                if fut is not None and not fut.set_running_or_notify_cancel():
                    continue  # its caller stopped waiting before it ran: it never runs
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
            idle = not self.engine.has_unfinished()
            if not idle:
                try:
                    outputs.extend(self.engine.step())
                except Exception:  # the engine's own invariants broke: end everything loudly rather than hang
                    log.exception("engine step crashed; ending all requests")
                    outputs.extend(self._fail_all("engine step crashed"))
                stepped = self._stepped
            load = self._changed_load() if stepped is None and self.on_load is not None else None
            if outputs or stepped is not None or load is not None:
                self._loop.call_soon_threadsafe(self._deliver, outputs, stepped, load)
            if idle and not self._commands:
                self._wake.wait(timeout=0.5)
                self._wake.clear()

    def _changed_load(self) -> EngineLoad | None:
        blocks = self.engine.blocks
        load = EngineLoad(len(self.engine.running), len(self.engine.waiting),
                          blocks.num_total_blocks - blocks.num_free_blocks())
        if load == self._load:
            return None
        self._load = load
        return load

    def _after_step(self, stats: StepStats) -> None:
        self._stepped = (stats, self.snapshot(self.engine) if self.snapshot is not None else None)
        self._load = EngineLoad(stats.num_running, stats.num_waiting, stats.num_blocks_used)

    def _fail_all(self, reason: str) -> list[RequestOutput]:
        outs = []
        for req in list(self.engine.running) + list(self.engine.waiting):
            out = self.engine.abort(req.request_id)
            out.finish_reason, out.error = "error", reason
            outs.append(out)
        return outs

    def _deliver(self, outputs: list[RequestOutput], stepped: tuple[StepStats, Any] | None,
                 load: EngineLoad | None) -> None:
        for out in outputs:
            queue = self._streams.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        if self.on_step is not None and stepped is not None:
            self.on_step(*stepped)
        if load is not None:
            self.on_load(load)
