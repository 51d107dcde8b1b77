"""The router as an asyncio service: engine connections, request streams, heartbeats, failures and autoscaling
around the pure `Router` and `Autoscaler` (DESIGN.md §5). This file owns every clock reading and every socket.

- A request is submitted to the router; placed, it is sent to its instance, queued, it waits (a finish anywhere, a
  new instance or the periodic tick retries the queues). Its tokens come back as RequestOutputs.
- The parallel samples of one request (n > 1: the HTTP layer asks for `<id>-0`, `<id>-1`, ... all at once, then
  reads the first sample's first output before it reads the others') are admitted together when the first is:
  placed on one instance, the test counting each of them, so that the others share the first's prompt blocks in
  its prefix cache. Each is sent to it when its own first output is asked for.
- Every frame from an engine counts as a sign of life; an engine silent for `heartbeat_timeout_s` is closed and
  treated as dead, as is one whose connection breaks or sends a malformed frame. A dead engine's requests are
  placed again. Those that produced no token start over; those that did migrate: the next instance prefills their
  prompt and the tokens already streamed, and continues the same output (same text, stop strings across the seam,
  a seeded generator past its draws: `Engine.add_request`'s resumed_tokens) for what remains of max_tokens. The
  client sees a pause. A stream whose instance fails again after `max_migrations` migrations ends with an
  explicit error output. The dead engine's process is killed, and the autoscaler's next plan replaces it. A
  worker the launcher finds gone first (a Ray actor or its machine dead) has its connection closed: the same path.
- Processes to start come first from the launcher's warm spares (engines already built, not yet attached: joining
  takes a connection), then from a cold launch; the spares are started again as they are used, ahead of need. A
  launch that finds no room (no free GPU on any machine) is logged once and not retried for `placement_retry_s`,
  or until an instance leaves; a launch that fails otherwise is retried after a growing backoff.
- Each tick: heartbeat check, queue retry, the autoscaler's plan (start processes, drain and stop idle ones),
  spares topped up.
- Prefill/decode disaggregation (instances whose Hello says role prefill or decode): a new request goes to a
  prefill instance (the router's placement among those), which streams its first token and says Prefilled (it holds
  the KV); the router then places it on a decode instance (`Router.hand_off`) and sends that one an Import: the
  hand-off and where to pull the KV. A decode instance that has no free blocks for it refuses before any transfer:
  it is placed again a tick later. A pull that fails is placed again, the prefill side still holding the KV, up to
  `max_transfer_attempts`; then, or when the prefill side holds it no more, or when the decode instance is lost
  after it streamed, the stream migrates (prefilled again, as any stream whose instance failed). A client that
  leaves mid-way has the prefill side's hold aborted too. Every prompt sent to a prefill instance feeds the
  autoscaler's prefill token rate (and, through the router, every hand-off its KV byte rate and every decode
  instance's step report its decode token rate); the plan's prefill starts raise the launcher's prefill target, and its
  stops drain idle prefill instances as decode ones, never one still holding a hand-off's KV.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
import weakref
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable

import msgspec

from cluster import protocol as p
from cluster.engine_link import EngineLink
from cluster.fleet import InstanceStatus, InstanceView, RoutedRequest
from cluster.launcher import Launcher, PlacementError
from cluster.router import Decision, InstanceReport, Outcome, Placement, Router
from engine.engine import InvalidRequestError, RequestOutput
from engine.sampling_params import SamplingParams
from engine.serving import NoInstanceError, QueueFullError
from scheduler.slo import SLO

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False, weakref_slot=True)
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
    opened: bool = False  # its first output was asked for: it may be sent to an instance
    sent: bool = False  # sent to an instance at least once (its queue time is recorded)
    done: bool = False  # the last output (or an exception) is queued
    migrations: int = 0  # times it continued on another instance after its own failed mid-stream
    lost_at: float | None = None  # when its instance was found dead, until its first token after that
    companions: list["_Stream"] = field(default_factory=list)  # samples admitted with it, until it is placed
    handoff: "_HandOff | None" = None  # its prompt ran on a prefill instance, which holds its KV
    transfer_attempts: int = 0  # imports of the current hand-off that failed

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


@dataclass(slots=True, frozen=True)
class _HandOff:
    """What an instance said of a request whose KV it holds for a pull: sent on, in an Import, to where it goes."""
    handoff: bytes
    held_by: str  # the instance that holds its KV: a prefill instance, or the one a moved request left
    kv_host: str
    kv_port: int
    clock_offset: float  # the router's clock - the holder's


class _Outputs:
    """Backend.generate's iterator over one request's outputs. A class rather than the async generator itself, so
    that closing one never read still reaches the service: a sample admitted with its request's first holds a
    place on an instance before its own first output is asked for."""
    __slots__ = ("_service", "_stream", "_outputs")

    def __init__(self, service: "RouterService", stream: _Stream):
        self._service, self._stream = service, stream
        self._outputs = service._outputs(stream)

    def __aiter__(self) -> "_Outputs":
        return self

    def __anext__(self) -> Awaitable[RequestOutput]:
        return self._outputs.__anext__()

    async def aclose(self) -> None:
        await self._outputs.aclose()
        self._service._leave(self._stream)


def _sample_index(request_id: str) -> tuple[str, int] | None:
    """(`<id>`, i) of a request id `<id>-i`, as the HTTP layer names the parallel samples of one request."""
    base, dash, index = request_id.rpartition("-")
    return (base, int(index)) if dash and index.isascii() and index.isdigit() else None


class RouterService:
    def __init__(self, router: Router, *, launcher: Launcher | None = None, heartbeat_timeout_s: float = 3.0,
                 tick_s: float = 0.05, drain_timeout_s: float = 60.0, connect_timeout_s: float = 10.0,
                 max_migrations: int = 2, token: str | None = None, placement_retry_s: float = 60.0,
                 max_transfer_attempts: int = 3, clock=time.monotonic):
        """`max_migrations`: how many times one stream may continue elsewhere after its instance failed; a failure
        beyond that ends it with an error output. `token`: the shared secret proved to every worker (None: the
        launcher's; with neither, a random one that only fits workers given it). `placement_retry_s`: after the
        launcher found no room for a worker (PlacementError), how long before it is asked again, unless an
        instance leaves first. `max_transfer_attempts`: KV pulls of one hand-off that may fail before the request
        is prefilled again."""
        if max_transfer_attempts < 1:
            raise ValueError(f"max_transfer_attempts must be positive, got {max_transfer_attempts}")
        self.max_transfer_attempts = max_transfer_attempts
        if launcher is not None and token is not None and token != launcher.token:
            raise ValueError("the service's cluster token differs from its launcher's")
        if not placement_retry_s > 0:
            raise ValueError(f"placement_retry_s must be positive, got {placement_retry_s}")
        self.token = launcher.token if launcher is not None else token or secrets.token_hex(32)
        self.placement_retry_s = placement_retry_s
        if launcher is not None:
            launcher.on_exit = self._worker_gone
        if not (heartbeat_timeout_s > 0 and tick_s > 0):
            raise ValueError("heartbeat_timeout_s and tick_s must be positive")
        if max_migrations < 0:
            raise ValueError(f"max_migrations must be non-negative, got {max_migrations}")
        self.max_migrations = max_migrations
        self.router, self.launcher, self.clock = router, launcher, clock
        self.heartbeat_timeout_s, self.tick_s = heartbeat_timeout_s, tick_s
        self.drain_timeout_s, self.connect_timeout_s = drain_timeout_s, connect_timeout_s
        self.links: dict[str, EngineLink] = {}
        self.streams: dict[str, _Stream] = {}  # admitted, until their client leaves
        # samples `<id>-i` (i > 0) asked for and not admitted: the first sample's admission takes them along; a
        # client that drops one unread drops it here too
        self._samples: weakref.WeakValueDictionary[str, _Stream] = weakref.WeakValueDictionary()
        self.metrics = None  # engine.metrics.ServerMetrics, bound by the HTTP app
        self.cold_starts: list[float] = []  # seconds from spawn to the worker's Hello, every cold launch
        self.warm_starts: list[float] = []  # seconds from taking a warm spare to its Hello, every one taken
        # seconds from finding a stream's instance dead to its next token, the latest migrations
        self.migration_delays: deque[float] = deque(maxlen=4096)
        # "migrated", "migrations_exhausted", "unplaceable", "handed_off", "import_refused", "transfer_failed"
        self.counts: Counter[str] = Counter()
        self._link_tasks: dict[str, asyncio.Task] = {}
        self._tasks: set[asyncio.Task] = set()
        self._tick_task: asyncio.Task | None = None
        self._spare_tasks: set[asyncio.Task] = set()  # spares starting: stopping does not wait for them
        self._next_instance = 0
        self._launch_failures = 0
        self._launch_blocked_until = 0.0
        self._unplaceable = False  # the last launch found no room: launches wait for placement_retry_s or a leaver
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
        link = await EngineLink.connect(host, port, self.clock, self.connect_timeout_s, token=self.token)
        self.router.add_instance(link.instance_id, self.clock())
        self._ready(link)
        return link.instance_id

    def _ready(self, link: EngineLink) -> None:
        now = self.clock()
        self.links[link.instance_id] = link
        self._link_tasks[link.instance_id] = self._spawn(self._run_link(link))
        h = link.hello
        self.router.set_role(link.instance_id, h.role)
        self._dispatch(self.router.on_ready(link.instance_id, h.num_kv_blocks * h.block_size, now, h.block_size), now)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- requests --------------------------------------------------------------------------------------------
    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, tier: str, slo: SLO,
                 arrival: float) -> AsyncIterator[RequestOutput]:
        """Backend.generate (engine/api_server.py): admission on the first __anext__, then the outputs. A sample
        `<id>-i` (i > 0) asked for before `<id>-0` is admitted is admitted with it (the module's docstring)."""
        routed = RoutedRequest(request_id, self.router.tiers.index(tier), tier, slo, arrival, len(prompt_token_ids),
                               params.max_tokens)
        submit = p.Submit(request_id, list(prompt_token_ids), p.SamplingSpec.of(params), tier, slo, 0.0)
        stream = _Stream(routed, submit, params.logprobs, submit.prompt_token_ids, params.max_tokens)
        sample = _sample_index(request_id)
        if sample is not None and sample[1] > 0:
            self._samples[request_id] = stream
        return _Outputs(self, stream)

    async def _outputs(self, stream: _Stream) -> AsyncIterator[RequestOutput]:
        try:
            self._open(stream)
            while True:
                item = await stream.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    break
        finally:
            self._leave(stream)

    def _open(self, stream: _Stream) -> None:
        """Its first output is asked for: admission (with the samples that come with it), or, admitted already
        with its request's first sample, its send where it was placed."""
        stream.opened = True
        routed = stream.routed
        request_id = routed.request_id
        now = self.clock()
        if self.streams.get(request_id) is stream:
            if routed.instance_id is not None:
                self._send(stream, routed.instance_id, now)
            return
        if self._samples.get(request_id) is stream:
            del self._samples[request_id]
        if request_id in self.streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        companions = self._companions_of(stream)
        routed.companions = tuple(c.routed for c in companions)
        self.streams[request_id] = stream
        decision = self.router.submit(routed, now)
        if decision.outcome is Outcome.QUEUE_FULL:
            raise QueueFullError(f"tier {routed.tier} has {self.router.queue_length(routed.tier_index)} requests "
                                 f"waiting, its bound", decision.retry_after_s)
        if decision.outcome is Outcome.COSTLY:
            raise QueueFullError(f"tier {routed.tier} has no place for a request now, and its "
                                 f"{routed.num_prompt_tokens}-token prompt is among the tier's costliest: refused to "
                                 f"keep the fleet's other requests on time", decision.retry_after_s)
        if decision.outcome is Outcome.NO_INSTANCE:
            raise NoInstanceError("no engine instance is serving or starting, and none can be started")
        for c in companions:
            del self._samples[c.routed.request_id]
            self.streams[c.routed.request_id] = c
        stream.companions = companions
        if decision.outcome is Outcome.PLACED:
            self._send_placed(stream, decision.instance_id, now)

    def _companions_of(self, stream: _Stream) -> list[_Stream]:
        """The samples `<id>-1`, `<id>-2`, ... of a stream `<id>-0`, asked for with it and not admitted."""
        sample = _sample_index(stream.routed.request_id)
        if sample is None or sample[1] != 0:
            return []
        out = []
        first = stream.routed
        while True:
            request_id = f"{sample[0]}-{len(out) + 1}"
            c = self._samples.get(request_id)
            if c is None or request_id in self.streams or c.prompt_token_ids != stream.prompt_token_ids \
                    or (c.routed.arrival, c.routed.tier, c.routed.slo) != (first.arrival, first.tier, first.slo):
                return out
            out.append(c)

    def _leave(self, stream: _Stream) -> None:
        """Its client is done with it, read to the end or not (then it is aborted, or taken out of the queue)."""
        request_id = stream.routed.request_id
        if self._samples.get(request_id) is stream:
            del self._samples[request_id]
        if self.streams.get(request_id) is stream:
            del self.streams[request_id]
            if not stream.done:
                self._abandon(stream)

    def _send(self, stream: _Stream, instance_id: str, now: float) -> None:
        """Sends it to where it was placed; one not asked for yet waits for that (`_open` sends it)."""
        if not stream.opened:
            return
        submit = stream.submit
        submit.queued_s = now - stream.routed.arrival
        submit.tpot_reserve = stream.routed.tpot_reserve
        link = self.links[instance_id]
        h = stream.handoff
        if h is None:
            link.send(submit)
            autoscaler = self.router.autoscaler
            if autoscaler is not None and self.router.roles.get(instance_id) == "prefill":
                r = stream.routed  # its prompt work there: a companion's shares the first sample's cached blocks
                autoscaler.prefill_tokens.add(self.clock(), r.num_prompt_tokens - r.num_computed_tokens)
        else:  # decode clock = router clock - its offset = prefill clock + the prefill's offset - its offset
            link.send(p.Import(submit.request_id, h.handoff, h.kv_host, h.kv_port,
                               h.clock_offset - link.clock_offset, stream.routed.tpot_reserve))
        if not stream.sent:
            stream.sent = True
            if self.metrics is not None:
                self.metrics.observe_queue_time(stream.routed.tier, max(0.0, submit.queued_s))

    def _dispatch(self, placements: list[Placement], now: float) -> None:
        """Sends what the router placed, answers what it gave up, and tells the instances whose residents it chose
        to move to let go of them (each then says Prefilled, and `_on_prefilled` places it)."""
        for placement in placements:
            stream = self.streams.get(placement.request.request_id)
            if stream is not None:
                self._send_placed(stream, placement.instance_id, now)
        for routed in self.router.take_shed():
            stream = self.streams.get(routed.request_id)
            if stream is not None:
                message = (f"tier {routed.tier}: waited {1000 * (now - routed.arrival):.0f} ms for room, and its "
                           f"first token can no longer come within its {routed.slo.ttft_ms:g} ms")
                for s in (stream, *stream.companions):
                    s.end(QueueFullError(message, self.router.retry_after(routed.tier_index)))
        for request_id, instance_id in self.router.take_migrations():
            link = self.links.get(instance_id)
            if link is not None:
                link.send(p.Move(request_id))

    def _send_placed(self, stream: _Stream, instance_id: str, now: float) -> None:
        """A request the router placed, with the samples admitted with it (placed there too): those whose client
        left while they waited leave the router now."""
        self._send(stream, instance_id, now)
        for c in stream.companions:
            if self.streams.get(c.routed.request_id) is c:
                self._send(c, instance_id, now)
            else:
                self.router.on_finished(c.routed.request_id, 0, now, completed=False)
        stream.companions = []

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
        if stream.handoff is not None:
            self._give_up_handoff(stream)
        if req.instance_id is None:
            self.router.withdraw(req.request_id)
            return
        link = self.links.get(req.instance_id)
        if link is not None and stream.sent:
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
                if s.handoff is not None and d.token_ids and instance_id != s.handoff.held_by:
                    # the importing worker streams only once the import is applied, and the holder freed the KV
                    # when told so: nothing is held for this stream any more
                    s.handoff = None
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
            steps = [p.step_stats(t) for t in msg.steps]
            last = steps[-1]
            self.router.on_report(instance_id, InstanceReport(link.to_router_clock(last.start + last.duration),
                                                              last.num_blocks_used, msg.residents, steps), now)
            if self.metrics is not None:
                total = max(1, msg.num_total_blocks)
                for t in steps:
                    self.metrics.observe_step(instance_id, t.duration, t.num_blocks_used / total, t.num_running,
                                              t.num_waiting)
                    self.metrics.observe_batch(instance_id, t.num_seqs)
        elif isinstance(msg, p.Heartbeat):
            self.router.on_load(instance_id, msg.num_blocks_used)
            if self.metrics is not None:
                self.metrics.observe_load(instance_id, msg.num_blocks_used / max(1, msg.num_total_blocks),
                                          msg.num_running, msg.num_waiting)
        elif isinstance(msg, p.Finish):
            s = streams.get(msg.request_id)
            if s is None or s.routed.instance_id != instance_id:
                return
            self.router.on_finished(msg.request_id, len(s.token_ids), now,  # a migrated one's count starts over there
                                    completed=msg.finish_reason in ("stop", "length"))
            s.end(s.output([], "", msg.finish_reason, msg.num_cached_tokens))
            self._dispatch(self.router.retry_queued(now), now)
        elif isinstance(msg, p.Prefilled):
            self._on_prefilled(link, msg, now)
        elif isinstance(msg, p.Error):
            self._on_error(link, msg, now)
        elif isinstance(msg, p.Drained):
            link.drained = True

    # ---- prefill/decode hand-offs --------------------------------------------------------------------------------
    def _on_prefilled(self, link: EngineLink, msg: p.Prefilled, now: float) -> None:
        s = self.streams.get(msg.request_id)
        if s is None or s.routed.instance_id != link.instance_id or s.done:
            link.send(p.Abort(msg.request_id))  # nobody waits for it: its KV is freed there
            return
        if not link.hello.kv_port:
            self.router.on_finished(msg.request_id, len(s.token_ids), now, completed=False)
            s.end(s.output([], "", "error", error=f"instance {link.instance_id} handed off a request but has no "
                                                  f"KV listener"))
            return
        host = link.writer.get_extra_info("peername")[0]
        s.handoff = _HandOff(msg.handoff, link.instance_id, host, link.hello.kv_port, link.clock_offset)
        s.transfer_attempts = 0
        if msg.request_id in self.router.leaving:  # a resident the router chose to move, not a prefill's hand-off
            self.counts["moved"] += 1
            self._handed(s, self.router.moved(msg.request_id, len(s.token_ids), now), now)
        else:
            self.counts["handed_off"] += 1
            self.router.on_finished(msg.request_id, len(s.token_ids), now, completed=False)
            self._hand_off(s, now)
        self._dispatch(self.router.retry_queued(now), now)

    def _hand_off(self, s: _Stream, now: float, *, retry: bool = False) -> None:
        self._handed(s, self.router.hand_off(s.routed, now, retry=retry, num_output_tokens=max(1, len(s.token_ids))),
                     now)

    def _handed(self, s: _Stream, decision, now: float) -> None:
        if decision.outcome is Outcome.PLACED:
            self._send(s, decision.instance_id, now)
        elif decision.outcome is Outcome.NO_INSTANCE:
            self._give_up_handoff(s)
            s.end(s.output([], "", "error", error="no decode instance is serving or can be started"))

    def _hand_off_later(self, s: _Stream) -> None:
        """Placed again a tick from now: a decode instance refused it for want of free blocks, which its report
        had not shown yet."""
        def retry():
            if self.streams.get(s.routed.request_id) is s and not s.done and s.handoff is not None \
                    and s.routed.request_id not in self.router.requests and not self._stopping:
                self._hand_off(s, self.clock(), retry=True)
        asyncio.get_running_loop().call_later(self.tick_s, retry)

    def _give_up_handoff(self, s: _Stream) -> None:
        """The instance that holds its KV (a prefill instance, or the one a moved request left) need hold it no
        more."""
        h, s.handoff = s.handoff, None
        link = self.links.get(h.held_by)
        if link is not None:
            link.send(p.Abort(s.routed.request_id))

    def _import_failed(self, s: _Stream, instance_id: str, kind: str, reason: str, now: float) -> None:
        """The decode instance did not apply the hand-off: another attempt, or (the prefill side holds it no more,
        or the attempts ran out) prefilled again."""
        if kind == "refused":
            self.counts["import_refused"] += 1
            self._hand_off_later(s)
            return
        if kind == "draining":  # it raced the drain: nothing was pulled, and the draining instance takes no more
            self._hand_off(s, now, retry=True)
            return
        self.counts["transfer_failed"] += 1
        s.transfer_attempts += 1
        if kind == "transfer" and s.transfer_attempts < self.max_transfer_attempts:
            self._hand_off(s, now, retry=True)
            return
        self._give_up_handoff(s)
        self._migrate(s, instance_id, reason, now)

    def _on_error(self, link: EngineLink, msg: p.Error, now: float) -> None:
        if not msg.request_id:
            log.warning("instance %s reports: %s (%s)", link.instance_id, msg.message, msg.kind)
            return
        s = self.streams.get(msg.request_id)
        if s is None or s.routed.instance_id != link.instance_id:
            return
        self.router.on_finished(msg.request_id, len(s.token_ids), now, completed=False)
        if s.handoff is not None and msg.kind in ("refused", "transfer", "gone", "draining"):
            self._import_failed(s, link.instance_id, msg.kind, msg.message, now)
        elif msg.kind == "draining":  # it raced the drain (nothing ran there): place it elsewhere
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
        if self.launcher is not None and self.launcher.holds(instance_id):
            self.launcher.kill(instance_id)
            self._spawn(self.launcher.stop(instance_id, 5.0))
        self._room_freed()
        for req in lost:
            s = self.streams.get(req.request_id)
            if s is None or s.done:
                continue
            if s.handoff is not None and s.handoff.held_by != instance_id:
                # lost before it streamed from its decode instance: the prefill side may hold the KV still
                self._import_failed(s, instance_id, "transfer", reason, now)
            elif s.started:
                if s.handoff is not None:
                    self._give_up_handoff(s)
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
        req.num_prompt_tokens, req.max_tokens, req.resumed_tokens = len(prompt), remaining, done
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
        router, launcher = self.router, self.launcher
        if autoscaler.limits.min_prefill_instances:  # what only a disaggregated fleet's plan reads
            roles = router.roles if launcher is None else {**launcher.roles, **router.roles}
            plan = autoscaler.plan(router.fleet, router.waiting_tiers(), now, keep=self._holding_kv(), roles=roles,
                                   prefill_seconds_per_token=router.prefill_seconds_per_token,
                                   decode_seconds_per_token=router.decode_seconds_per_token, transfer=router.transfer)
        else:
            plan = autoscaler.plan(router.fleet, router.waiting_tiers(), now)
        if launcher is not None and (plan.num_to_start or plan.num_prefill_to_start):
            self._start_instances(launcher, plan.num_prefill_to_start, plan.num_to_start, now)
        for instance_id in plan.to_stop:
            self._stop_instance(instance_id, now)
        if launcher is not None and now >= self._launch_blocked_until:
            for _ in range(launcher.num_spares_short()):
                instance_id = self._new_instance_id()
                task = self._spawn(self._spare_started(instance_id, launcher.start_spare(instance_id)))
                self._spare_tasks.add(task)
                task.add_done_callback(self._spare_tasks.discard)

    def _holding_kv(self) -> set[str]:
        """The instances that hold a hand-off's KV for a stream (a prefill instance's, or a moved request's), not yet
        imported where it was sent."""
        return {s.handoff.held_by for s in self.streams.values() if s.handoff is not None}

    def _start_instances(self, launcher: Launcher, num_prefill: int, num_others: int, now: float) -> None:
        """Decode (or co-located) workers from the warm spares first, then cold starts: the prefill workers first,
        as the launcher gives a starting worker role prefill while it holds fewer than its prefill target."""
        sizes_prefill = self.router.autoscaler.limits.min_prefill_instances > 0
        if sizes_prefill:
            launcher.prefill_instances = launcher.num_prefill_held()  # no prefill worker missing: spares may go
        started: list[tuple[str, tuple[str, int] | None]] = []
        while len(started) < num_others and (spare := launcher.take_spare()) is not None:
            started.append(spare)
        if now >= self._launch_blocked_until:
            cold = num_prefill + num_others - len(started)
            if sizes_prefill:
                launcher.prefill_instances += num_prefill
            started += [(self._new_instance_id(), None) for _ in range(cold)]
        for instance_id, address in started:
            self.router.add_instance(instance_id, now)
            self._spawn(self._launch(instance_id, now, address))

    def _new_instance_id(self) -> str:
        self._next_instance += 1
        return f"engine-{self._next_instance - 1}"

    async def _spare_started(self, instance_id: str, starting: Awaitable[None]) -> None:
        try:
            await starting
        except Exception as e:
            self._launch_failed(instance_id, e)
        else:
            self._launched()

    def _launch_failed(self, instance_id: str, error: Exception) -> None:
        if isinstance(error, PlacementError):
            # no room anywhere: further asks would fail alike until a worker leaves or a machine joins
            self.counts["unplaceable"] += 1
            self._launch_blocked_until = self.clock() + self.placement_retry_s
            if not self._unplaceable:
                self._unplaceable = True
                log.warning("no room for worker %s (%s); the fleet stays at %d instances, and the next launch waits "
                            "%g s or until an instance leaves", instance_id, error, self.router.fleet.num_live(),
                            self.placement_retry_s)
            return
        self._launch_failures += 1
        backoff = min(30.0, 0.5 * 2 ** self._launch_failures)
        self._launch_blocked_until = self.clock() + backoff
        log.error("launching %s failed (%s); next launch in %.1f s", instance_id, error, backoff)

    def _launched(self) -> None:
        self._launch_failures = 0
        self._unplaceable = False

    def _room_freed(self) -> None:
        """An instance left: its place may take a worker that found no room."""
        if self._unplaceable:
            self._launch_blocked_until = 0.0

    def _worker_gone(self, instance_id: str, reason: str) -> None:
        """The launcher found a worker gone, perhaps before its connection shows it: that connection is closed,
        and the instance handled as dead."""
        link = self.links.get(instance_id)
        if link is not None:
            link.close(reason)

    async def _launch(self, instance_id: str, now: float, address: tuple[str, int] | None = None) -> None:
        """Starts (`address` None) or takes over (a warm spare's address) a worker and joins it to the router."""
        try:
            host, port = address or await self.launcher.start(instance_id)
            link = await EngineLink.connect(host, port, self.clock, self.connect_timeout_s, token=self.token)
            if link.instance_id != instance_id:
                link.close("wrong instance")
                raise p.ProtocolError(f"worker at {host}:{port} says it is {link.instance_id!r}, not {instance_id!r}")
        except Exception as e:
            self._launch_failed(instance_id, e)
            self.router.on_lost(instance_id, self.clock())
            self.router.remove_instance(instance_id, self.clock())
            if self.launcher.holds(instance_id):
                self.launcher.kill(instance_id)
                await self.launcher.stop(instance_id, 5.0)
            return
        self._launched()
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
            self._room_freed()
        if self.router.fleet.instances.get(instance_id) is view and view.status is InstanceStatus.DRAINING:
            self.router.remove_instance(instance_id, self.clock())
            if self.metrics is not None:
                self.metrics.forget_instance(instance_id)
