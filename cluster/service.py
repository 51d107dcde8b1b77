"""The router as an asyncio service: engine connections, request streams, heartbeats, failures and autoscaling
around the pure `Router` and `Autoscaler` (DESIGN.md §5). This file owns every clock reading and every socket.

- A request is submitted to the router; placed, it is sent to its instance, queued, it waits (a finish anywhere, a
  new instance or the periodic tick retries the queues). Its tokens come back as RequestOutputs.
- Every frame from an engine counts as a sign of life; an engine silent for `heartbeat_timeout_s` is closed and
  treated as dead, as is one whose connection breaks or sends a malformed frame. A dead engine's requests are
  placed again. Those that produced no token start over; those that did migrate: the next instance prefills their
  prompt and the tokens already streamed, and continues the same output (same text, stop strings across the seam,
  a seeded generator past its draws: `Engine.add_request`'s resumed_tokens) for what remains of max_tokens. The
  client sees a pause. A stream whose instance fails again after `max_migrations` migrations ends with an
  explicit error output. The dead engine's process is killed, and the autoscaler's next plan replaces it.
- Processes to start come first from the launcher's warm spares (engines already built, not yet attached: joining
  takes a connection), then from a cold launch; the spares are started again as they are used, ahead of need.
- Each tick: heartbeat check, queue retry, the autoscaler's plan (start processes, drain and stop idle ones),
  spares topped up.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable

import msgspec

from cluster import protocol as p
from cluster.engine_link import EngineLink
from cluster.fleet import InstanceStatus, InstanceView, RoutedRequest
from cluster.launcher import LocalLauncher
from cluster.router import Decision, InstanceReport, Outcome, Placement, Router
from engine.engine import InvalidRequestError, RequestOutput
from engine.sampling_params import SamplingParams
from engine.serving import NoInstanceError, QueueFullError
from scheduler.slo import SLO
from scheduler.types import StepStats

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Stream:
    """One request's state at the router: what to send an instance, and what came back so far."""
    routed: RoutedRequest
    submit: p.Submit  # queued_s is filled in at each send; a migration replaces it
    logprobs_wanted: bool
    prompt_token_ids: list[int]  # as the client sent it
    max_tokens: int  # as the client asked
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)  # RequestOutput, or an exception to raise
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None  # from the first instance that sent them
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    text: str = ""
    sent: bool = False  # sent to an instance at least once (its queue time is recorded)
    done: bool = False  # the last output (or an exception) is queued
    migrations: int = 0  # times it continued on another instance after its own failed mid-stream
    lost_at: float | None = None  # when its instance was found dead, until its first token after that

    @property
    def started(self) -> bool:
        return bool(self.token_ids)

    def output(self, new_ids: list[int], new_text: str, finish_reason: str | None = None, cached: int = 0,
               error: str | None = None) -> RequestOutput:
        r = self.routed
        return RequestOutput(
            request_id=r.request_id, prompt_token_ids=self.prompt_token_ids, token_ids=self.token_ids,
            text=self.text, new_token_ids=new_ids, new_text=new_text, finished=finish_reason is not None,
            finish_reason=finish_reason, arrival=r.arrival,
            first_token_time=self.token_times[0] if self.token_times else None, token_times=self.token_times,
            logprobs=self.logprobs if self.logprobs_wanted else None, num_cached_tokens=cached, error=error,
            top_logprobs=self.top_logprobs if self.logprobs_wanted and self.submit.sampling.top_logprobs else None,
            prompt_logprobs=self.prompt_logprobs, prompt_top_logprobs=self.prompt_top_logprobs)

    def end(self, item: RequestOutput | BaseException) -> None:
        if not self.done:
            self.done = True
            self.outputs.put_nowait(item)


class RouterService:
    def __init__(self, router: Router, *, launcher: LocalLauncher | None = None, heartbeat_timeout_s: float = 3.0,
                 tick_s: float = 0.05, drain_timeout_s: float = 60.0, connect_timeout_s: float = 10.0,
                 max_migrations: int = 2, clock=time.monotonic):
        """`max_migrations`: how many times one stream may continue elsewhere after its instance failed; a failure
        beyond that ends it with an error output."""
        if not (heartbeat_timeout_s > 0 and tick_s > 0):
            raise ValueError("heartbeat_timeout_s and tick_s must be positive")
        if max_migrations < 0:
            raise ValueError(f"max_migrations must be non-negative, got {max_migrations}")
        self.max_migrations = max_migrations
        self.router, self.launcher, self.clock = router, launcher, clock
        self.heartbeat_timeout_s, self.tick_s = heartbeat_timeout_s, tick_s
        self.drain_timeout_s, self.connect_timeout_s = drain_timeout_s, connect_timeout_s
        self.links: dict[str, EngineLink] = {}
        self.streams: dict[str, _Stream] = {}
        self.metrics = None  # engine.metrics.ServerMetrics, bound by the HTTP app
        self.cold_starts: list[float] = []  # seconds from spawn to the worker's Hello, every cold launch
        self.warm_starts: list[float] = []  # seconds from taking a warm spare to its Hello, every one taken
        # seconds from finding a stream's instance dead to its next token, the latest migrations
        self.migration_delays: deque[float] = deque(maxlen=4096)
        self.counts: Counter[str] = Counter()  # "migrated", "migrations_exhausted"
        self._link_tasks: dict[str, asyncio.Task] = {}
        self._tasks: set[asyncio.Task] = set()
        self._tick_task: asyncio.Task | None = None
        self._spare_tasks: set[asyncio.Task] = set()  # spares starting: stopping does not wait for them
        self._next_instance = 0
        self._launch_failures = 0
        self._launch_blocked_until = 0.0
        self._stopping = False

    @property
    def ready(self) -> bool:
        return any(v.status is InstanceStatus.READY for v in self.router.fleet.instances.values())

    # ---- lifecycle -------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._tick_task = asyncio.create_task(self._ticks())
        self._autoscale(self.clock())

    async def stop(self) -> None:
        """Drains every engine (residents finish, within drain_timeout_s), stops their processes, and ends any
        request still open with an error."""
        self._stopping = True
        if self._tick_task is not None:
            self._tick_task.cancel()
        for task in self._spare_tasks:
            task.cancel()
        now = self.clock()
        for instance_id in list(self.links):
            self._stop_instance(instance_id, now)
        pending = [t for t in self._tasks if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=self.drain_timeout_s + 10)
        for link in list(self.links.values()):
            link.close("router stopping")
        if self.launcher is not None:
            await self.launcher.close()
        for stream in list(self.streams.values()):
            stream.end(stream.output([], "", "error", error="the router is shutting down"))

    async def attach(self, host: str, port: int) -> str:
        """Adds a worker that already runs (a fixed fleet); returns its instance id."""
        link = await EngineLink.connect(host, port, self.clock, self.connect_timeout_s)
        self.router.add_instance(link.instance_id, self.clock())
        self._ready(link)
        return link.instance_id

    def _ready(self, link: EngineLink) -> None:
        now = self.clock()
        self.links[link.instance_id] = link
        self._link_tasks[link.instance_id] = self._spawn(self._run_link(link))
        h = link.hello
        self._dispatch(self.router.on_ready(link.instance_id, h.num_kv_blocks * h.block_size, now), now)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- requests --------------------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, tier: str,
                       slo: SLO, arrival: float) -> AsyncIterator[RequestOutput]:
        """Backend.generate (engine/api_server.py): admission on the first __anext__, then the outputs."""
        if request_id in self.streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        routed = RoutedRequest(request_id, self.router.tiers.index(tier), tier, slo, arrival, len(prompt_token_ids),
                               params.max_tokens)
        submit = p.Submit(request_id, list(prompt_token_ids), p.SamplingSpec.of(params), tier, slo, 0.0)
        stream = _Stream(routed, submit, params.logprobs, submit.prompt_token_ids, params.max_tokens)
        self.streams[request_id] = stream
        try:
            now = self.clock()
            decision = self.router.submit(routed, now)
            if decision.outcome is Outcome.QUEUE_FULL:
                raise QueueFullError(f"tier {tier} has {self.router.queue_length(routed.tier_index)} requests "
                                     f"waiting, its bound", decision.retry_after_s)
            if decision.outcome is Outcome.NO_INSTANCE:
                raise NoInstanceError("no engine instance is serving or starting, and none can be started")
            if decision.outcome is Outcome.PLACED:
                self._send(stream, decision.instance_id, now)
            while True:
                item = await stream.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    break
        finally:
            self.streams.pop(request_id, None)
            if not stream.done:
                self._abandon(stream)

    def _send(self, stream: _Stream, instance_id: str, now: float) -> None:
        submit = stream.submit
        submit.queued_s = now - stream.routed.arrival
        self.links[instance_id].send(submit)
        if not stream.sent:
            stream.sent = True
            if self.metrics is not None:
                self.metrics.observe_queue_time(stream.routed.tier, max(0.0, submit.queued_s))

    def _dispatch(self, placements: list[Placement], now: float) -> None:
        """Sends what the router placed, and answers what it gave up."""
        for placement in placements:
            stream = self.streams.get(placement.request.request_id)
            if stream is not None:
                self._send(stream, placement.instance_id, now)
        for routed in self.router.take_shed():
            stream = self.streams.get(routed.request_id)
            if stream is not None:
                message = (f"tier {routed.tier}: waited {1000 * (now - routed.arrival):.0f} ms for room, and its "
                           f"first token can no longer come within its {routed.slo.ttft_ms:g} ms")
                stream.end(QueueFullError(message, self.router.retry_after(routed.tier_index)))

    def _decided(self, stream: _Stream, decision: Decision, now: float) -> None:
        """A re-placed request: sent, queued, or (nowhere to go) answered."""
        if decision.outcome is Outcome.PLACED:
            self._send(stream, decision.instance_id, now)
        elif decision.outcome is Outcome.NO_INSTANCE:
            message = "its instance failed and no other instance is serving or can be started"
            stream.end(stream.output([], "", "error", error=message) if stream.started else NoInstanceError(message))

    def _abandon(self, stream: _Stream) -> None:
        """The client left before the end: abort it where it runs, or take it out of the queue."""
        req = stream.routed
        if req.instance_id is None:
            self.router.withdraw(req.request_id)
            return
        link = self.links.get(req.instance_id)
        if link is not None:
            link.send(p.Abort(req.request_id))
        now = self.clock()
        self.router.on_finished(req.request_id, len(stream.token_ids), now, completed=False)
        self._dispatch(self.router.retry_queued(now), now)

    # ---- frames from engines ---------------------------------------------------------------------------------
    async def _run_link(self, link: EngineLink) -> None:
        reason = await link.run(self._on_message, self.clock)
        if self.links.get(link.instance_id) is not link:
            return
        del self.links[link.instance_id]
        self._link_tasks.pop(link.instance_id, None)
        view = self.router.fleet.instances.get(link.instance_id)
        if view is None or view.status is InstanceStatus.DEAD:
            return
        if link.drained and not view.residents:  # a clean drain
            if view.status is not InstanceStatus.DRAINING:  # not asked for here (else _stop_instance removes it)
                self.router.remove_instance(link.instance_id, self.clock())
            return
        self._instance_failed(link.instance_id, reason)

    def _on_message(self, link: EngineLink, msg) -> None:
        now = self.clock()
        streams, instance_id = self.streams, link.instance_id
        if isinstance(msg, p.Tokens):
            offset = link.clock_offset
            for d in msg.deltas:
                s = streams.get(d.request_id)
                if s is None or s.routed.instance_id != instance_id or s.done:
                    continue
                if s.lost_at is not None and d.token_ids:
                    self.migration_delays.append(now - s.lost_at)
                    s.lost_at = None
                s.token_ids.extend(d.token_ids)
                s.token_times.extend([t + offset for t in d.emit_times])
                if d.logprobs is not None:
                    s.logprobs.extend(d.logprobs)
                if d.top_logprobs is not None:
                    s.top_logprobs.extend(d.top_logprobs)
                if d.prompt_logprobs is not None and s.prompt_logprobs is None:
                    s.prompt_logprobs, s.prompt_top_logprobs = d.prompt_logprobs, d.prompt_top_logprobs
                s.text += d.text
                s.outputs.put_nowait(s.output(d.token_ids, d.text))
        elif isinstance(msg, p.StepReport):
            step = StepStats(msg.start, msg.duration, msg.num_prefill_tokens, msg.num_decode_seqs, msg.num_kv_tokens,
                             msg.num_blocks_used, msg.num_running, msg.num_waiting, msg.num_seqs)
            self.router.on_report(instance_id, InstanceReport(link.to_router_clock(msg.start + msg.duration),
                                                              msg.num_blocks_used, msg.residents, (step,)), now)
            if self.metrics is not None:
                self.metrics.observe_step(instance_id, msg.duration, msg.num_blocks_used / max(1, msg.num_total_blocks),
                                          msg.num_running, msg.num_waiting)
                self.metrics.observe_batch(instance_id, msg.num_seqs)
        elif isinstance(msg, p.Finish):
            s = streams.get(msg.request_id)
            if s is None or s.routed.instance_id != instance_id:
                return
            self.router.on_finished(msg.request_id, len(s.token_ids), now,  # a migrated one's count starts over there
                                    completed=msg.finish_reason in ("stop", "length"))
            s.end(s.output([], "", msg.finish_reason, msg.num_cached_tokens))
            self._dispatch(self.router.retry_queued(now), now)
        elif isinstance(msg, p.Error):
            self._on_error(link, msg, now)
        elif isinstance(msg, p.Drained):
            link.drained = True

    def _on_error(self, link: EngineLink, msg: p.Error, now: float) -> None:
        if not msg.request_id:
            log.warning("instance %s reports: %s (%s)", link.instance_id, msg.message, msg.kind)
            return
        s = self.streams.get(msg.request_id)
        if s is None or s.routed.instance_id != link.instance_id:
            return
        self.router.on_finished(msg.request_id, len(s.token_ids), now, completed=False)
        if msg.kind == "draining":  # it raced the drain (nothing ran there): place it elsewhere
            self._decided(s, self.router.submit(s.routed, now, readmit=True), now)
        elif msg.kind == "invalid" and not s.started:
            s.end(InvalidRequestError(msg.message))
        else:
            s.end(s.output([], "", "error", error=f"instance {link.instance_id}: {msg.message}"))
        self._dispatch(self.router.retry_queued(now), now)

    # ---- failures --------------------------------------------------------------------------------------------
    def _instance_failed(self, instance_id: str, reason: str) -> None:
        now = self.clock()
        log.warning("instance %s is dead: %s", instance_id, reason)
        lost = self.router.on_lost(instance_id, now)
        if self.launcher is not None and self.launcher.pid(instance_id) is not None:
            self.launcher.kill(instance_id)
            self._spawn(self.launcher.stop(instance_id, 5.0))
        for req in lost:
            s = self.streams.get(req.request_id)
            if s is None or s.done:
                continue
            if s.started:
                self._migrate(s, instance_id, reason, now)
            else:
                self._decided(s, self.router.submit(req, now, readmit=True), now)
        self.router.remove_instance(instance_id, now)
        if self.metrics is not None:
            self.metrics.forget_instance(instance_id)
        if not self._stopping:
            self._autoscale(now)

    def _migrate(self, s: _Stream, instance_id: str, reason: str, now: float) -> None:
        """A stream that its instance left mid-way continues on another: the prompt plus every token it streamed
        is the new prompt, of which those tokens are output already (`p.Submit.resumed_tokens`), for the tokens
        that remain. The router sees a longer prompt and a shorter output; readmitted, it waits at the head of
        its queue and is never shed."""
        done = len(s.token_ids)
        remaining = s.max_tokens - done
        if remaining <= 0:  # its last token came, its finish did not
            s.end(s.output([], "", "length"))
            return
        if s.migrations >= self.max_migrations:
            self.counts["migrations_exhausted"] += 1
            s.end(s.output([], "", "error", error=f"instance {instance_id} failed mid-stream ({reason}), and this "
                                                  f"stream had already moved {s.migrations} times"))
            return
        s.migrations += 1
        s.lost_at = now
        self.counts["migrated"] += 1
        prompt = s.prompt_token_ids + s.token_ids
        s.submit = msgspec.structs.replace(s.submit, prompt_token_ids=prompt, resumed_tokens=done,
                                           sampling=msgspec.structs.replace(s.submit.sampling, max_tokens=remaining))
        req = s.routed
        req.num_prompt_tokens, req.max_tokens = len(prompt), remaining
        self._decided(s, self.router.submit(req, now, readmit=True), now)

    # ---- the periodic tick -----------------------------------------------------------------------------------
    async def _ticks(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                self._tick(self.clock())
            except Exception:  # a bug here must not stop heartbeats and scaling for good
                log.exception("router tick failed")

    def _tick(self, now: float) -> None:
        for link in list(self.links.values()):
            silent = now - link.last_heard
            if silent > self.heartbeat_timeout_s:
                link.close(f"no frame for {silent:.1f} s (heartbeat timeout {self.heartbeat_timeout_s:g} s)")
        if self.router.waiting_tiers():
            self._dispatch(self.router.retry_queued(now), now)
        self._autoscale(now)
        if self.metrics is not None:
            fleet = self.router.fleet
            for tier, members in zip(self.router.tiers, fleet.members):
                self.metrics.set_instances(tier.name, len(members))
            self.metrics.set_instances("idle", len(fleet.idle))

    def _autoscale(self, now: float) -> None:
        autoscaler = self.router.autoscaler
        if autoscaler is None or self._stopping:
            return
        plan = autoscaler.plan(self.router.fleet, self.router.waiting_tiers(), now)
        launcher = self.launcher
        if plan.num_to_start and launcher is not None:
            for _ in range(plan.num_to_start):
                spare = launcher.take_spare()
                if spare is not None:
                    instance_id, address = spare
                elif now >= self._launch_blocked_until:
                    instance_id, address = self._new_instance_id(), None
                else:
                    break
                self.router.add_instance(instance_id, now)
                self._spawn(self._launch(instance_id, now, address))
        for instance_id in plan.to_stop:
            self._stop_instance(instance_id, now)
        if launcher is not None and now >= self._launch_blocked_until:
            for _ in range(launcher.num_spares_short()):
                instance_id = self._new_instance_id()
                task = self._spawn(self._spare_started(instance_id, launcher.start_spare(instance_id)))
                self._spare_tasks.add(task)
                task.add_done_callback(self._spare_tasks.discard)

    def _new_instance_id(self) -> str:
        self._next_instance += 1
        return f"engine-{self._next_instance - 1}"

    async def _spare_started(self, instance_id: str, starting: Awaitable[None]) -> None:
        try:
            await starting
        except Exception as e:
            self._launch_failed(instance_id, e)
        else:
            self._launch_failures = 0

    def _launch_failed(self, instance_id: str, error: Exception) -> None:
        self._launch_failures += 1
        backoff = min(30.0, 0.5 * 2 ** self._launch_failures)
        self._launch_blocked_until = self.clock() + backoff
        log.error("launching %s failed (%s); next launch in %.1f s", instance_id, error, backoff)

    async def _launch(self, instance_id: str, now: float, address: tuple[str, int] | None = None) -> None:
        """Starts (`address` None) or takes over (a warm spare's address) a worker and joins it to the router."""
        try:
            host, port = address or await self.launcher.start(instance_id)
            link = await EngineLink.connect(host, port, self.clock, self.connect_timeout_s)
            if link.instance_id != instance_id:
                link.close("wrong instance")
                raise p.ProtocolError(f"worker at {host}:{port} says it is {link.instance_id!r}, not {instance_id!r}")
        except Exception as e:
            self._launch_failed(instance_id, e)
            self.router.on_lost(instance_id, self.clock())
            self.router.remove_instance(instance_id, self.clock())
            if self.launcher.pid(instance_id) is not None:
                self.launcher.kill(instance_id)
                await self.launcher.stop(instance_id, 5.0)
            return
        self._launch_failures = 0
        (self.cold_starts if address is None else self.warm_starts).append(self.clock() - now)
        if self._stopping:
            link.send(p.Drain())
            self.router.on_lost(instance_id, self.clock())
            self.router.remove_instance(instance_id, self.clock())
            return
        self._ready(link)

    def _stop_instance(self, instance_id: str, now: float) -> None:
        """Drain (residents finish, nothing new), then stop the process."""
        view = self.router.fleet.instances.get(instance_id)
        if view is None or view.status is not InstanceStatus.READY:
            return  # gone, or already on its way out
        self.router.start_draining(instance_id, now)
        link = self.links.get(instance_id)
        if link is not None:
            link.send(p.Drain())
        self._spawn(self._finish_stop(instance_id, view))

    async def _finish_stop(self, instance_id: str, view: InstanceView) -> None:
        link = self.links.get(instance_id)
        if link is not None:
            task = self._link_tasks.get(instance_id)
            if task is not None:
                done, _ = await asyncio.wait({task}, timeout=self.drain_timeout_s)
                if not done:
                    link.close(f"did not drain within {self.drain_timeout_s:g} s")
                    await task
        if self.launcher is not None:
            await self.launcher.stop(instance_id, 10.0)
        if self.router.fleet.instances.get(instance_id) is view and view.status is InstanceStatus.DRAINING:
            self.router.remove_instance(instance_id, self.clock())
            if self.metrics is not None:
                self.metrics.forget_instance(instance_id)
