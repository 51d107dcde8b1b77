"""An engine process serving the cluster protocol (DESIGN.md §5).

    python -m cluster.worker --port 0 --executor emulated [--time-scale 0.5] [--num-kv-blocks N] ...

Its engine flags are `EngineConfig`'s (engine/config.py), as `cluster.serve` forwards them.

Prints `READY <port>` on stdout once it listens; SIGTERM or SIGINT drains it. It listens on `--host` only. Every
connection gets Hello (with a challenge) first; the router's, which answers it with proof of the cluster token
($POLYSERVE_CLUSTER_TOKEN or `--cluster-token-file`), is then served, and any other closed (cluster/protocol.py). The
router's connection gets, for its own requests, Tokens / Finish / Error frames, and the timing of every engine step
(batch shape, iteration time, KV use) with the residents' progress in StepReports, several steps to a report when
nothing placement depends on changed (`--report-every-steps`, cluster/step_reports.py); a Heartbeat (running,
waiting, KV use) every `--heartbeat-s`, after the steps held back, and at once when the engine's load changed with
no step to report it. Drain: new submits are
answered with a `draining` error, residents finish, every connection gets Drained, and the process exits.

Prefill/decode roles (`--role`, engine/kv_transfer.py): a prefill worker ends a request at its first token with a
Prefilled frame (the engine's Handoff) instead of a Finish, and holds its KV for `--handoff-timeout-s` on a second
listener (`Hello.kv_port`) where other workers pull it after the same handshake as the router's; a decode or
co-located worker told to Move a decoding request lets go of it between steps and holds it the same way. A worker
told to Import a request (role decode or both) connects there, pulls the blocks (streamed in bounded frames, each
written once the socket has taken the previous one), imports them, says KvDone (the holder frees them) and streams
the rest to its router as for a Submit. A pull that fails closes that peer connection, logs why and answers the
router with an Error (kinds refused, transfer, gone: cluster/protocol.py); nothing of it is applied.

Prompts arrive as token ids (the router tokenizes); the engine detokenizes with the model folder's tokenizer, so
stop strings cut exactly where they would in one process, and text deltas travel with the tokens.
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import os
import secrets
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Awaitable

import msgspec

from cluster import protocol as p
from cluster.step_reports import DEFAULT_REPORT_EVERY_STEPS, StepReportCoalescer
from engine import kv_transfer
from engine.async_engine import AsyncEngine, EngineLoad
from engine.config import EngineConfig, add_engine_args
from engine.engine import Engine, InvalidRequestError, RequestOutput
from engine.kv_transfer import KvBegin, KvChunk, KvEnd, KvImportRefused, KvTransferError
from engine.llm import build_engine
from engine.serving import freeze_startup_heap
from scheduler.types import StepStats

log = logging.getLogger(__name__)

MAX_WRITE_BUFFER_BYTES = 64 << 20  # a peer that reads nothing for this long is gone; its connection is closed
AUTH_TIMEOUT_S = 10.0  # a connection that has not authenticated by then is closed
KV_PULL_TIMEOUT_S = 10.0  # a KV peer that sends nothing for this long is given up


class AuthError(p.ProtocolError):
    """A connection's first frame did not prove the shared secret, or another router holds this worker."""


class HandoffGone(KvTransferError):
    """The prefill worker holds the pulled request no more: it must be prefilled again."""


class _PeerKv:
    """A decode worker's pull of one request's KV from a prefill worker's KV listener (AsyncEngine's KvSource): each
    chunk's bytes go from the socket straight to where the receiver wants them (`protocol.PullReader`)."""

    def __init__(self, host: str, port: int, token: str, request_id: str):
        self.address, self.token, self.request_id = (host, port), token, request_id
        self.link: p.PullReader | None = None

    async def frames(self, first_block: int, chunk_memory):
        self.link = await p.PullReader.connect(*self.address, KV_PULL_TIMEOUT_S)
        hello = await self.link.read_message(KV_PULL_TIMEOUT_S)
        if not isinstance(hello, p.Hello):
            raise p.ProtocolError(f"expected Hello first, got {type(hello).__name__}")
        if hello.version != p.PROTOCOL_VERSION:
            raise p.ProtocolError(f"KV peer speaks protocol {hello.version}, this worker {p.PROTOCOL_VERSION}")
        await self.link.write(p.encode_frame(p.Auth(p.auth_proof(self.token, hello.challenge)))
                              + p.encode_frame(p.KvPull(self.request_id, first_block)))
        while True:
            frame = await self.link.read_message(KV_PULL_TIMEOUT_S, chunk_memory)
            if frame is None:
                raise ConnectionError("the KV peer closed the connection mid-transfer")
            if isinstance(frame, p.KvRefused):
                raise HandoffGone(frame.message)
            if isinstance(frame, p.Error):
                raise p.ProtocolError(f"the KV peer closed the connection: {frame.message} ({frame.kind})")
            if not isinstance(frame, (KvBegin, KvChunk, KvEnd)):
                raise p.ProtocolError(f"expected KvData, got {type(frame).__name__}")
            yield frame
            if isinstance(frame, KvEnd):
                return

    async def applied(self) -> None:
        """Says KvDone; a peer gone by now frees the KV when its hold times out."""
        try:
            await self.link.write(p.encode_frame(p.KvDone(self.request_id)))
        except ConnectionError as err:
            log.info("KV peer %s:%d gone before KvDone of %s: %s", *self.address, self.request_id, err)
        self.close()

    def close(self) -> None:
        """Closes the connection (what was written is sent)."""
        if self.link is not None:
            self.link.close()


def resident_report(engine: Engine) -> list[p.Resident]:
    """Who is resident, and how far along: taken on the engine thread right after a step (AsyncEngine's
    snapshot), where the engine's lists are a consistent picture; read from the event loop they would race the
    next step."""
    return [p.Resident(r.request_id, r.num_prompt_tokens, r.num_computed_tokens, r.num_output_tokens)
            for group in (engine.running, engine.waiting) for r in group]


@dataclass(slots=True, eq=False)
class _Connection:
    writer: asyncio.StreamWriter
    peer: str
    requests: dict[str, asyncio.Task] = field(default_factory=dict)
    deltas: list[p.TokenDelta] = field(default_factory=list)
    frames: list[bytes] = field(default_factory=list)  # encoded, written after this flush's Tokens frame

    def add(self, msg) -> None:
        self.frames.append(p.encode_frame(msg))


class Worker:
    def __init__(self, engine: Engine, *, instance_id: str, token: str, heartbeat_s: float = 0.5,
                 parent_pid: int | None = None, report_every_steps: int = DEFAULT_REPORT_EVERY_STEPS,
                 handoff_timeout_s: float = 30.0, kv_chunk_bytes: int = kv_transfer.MAX_CHUNK_BYTES,
                 clock=time.monotonic):
        """`token`: the fleet's shared secret, which the router's first frame must prove (protocol.auth_proof).
        `parent_pid`: exit when that process is gone (a launcher's workers must not outlive it).
        `report_every_steps`: the most steps whose report is held back while nothing placement depends on changed
        (StepReportCoalescer; 1: a report every step).
        `handoff_timeout_s`: how long the KV of a request let go of (a prefill engine's at its first token, or one
        told to Move) is held for another worker's pull before it is freed; `kv_chunk_bytes`: the most payload
        bytes in one KV frame sent."""
        if not heartbeat_s > 0:
            raise ValueError(f"heartbeat_s must be positive, got {heartbeat_s}")
        if not handoff_timeout_s > 0:
            raise ValueError(f"handoff_timeout_s must be positive, got {handoff_timeout_s}")
        if not 0 < kv_chunk_bytes <= p.MAX_FRAME_BYTES // 2:
            raise ValueError(f"kv_chunk_bytes must lie in [1, {p.MAX_FRAME_BYTES // 2}], got {kv_chunk_bytes}")
        self.handoff_timeout_s, self.kv_chunk_bytes = handoff_timeout_s, kv_chunk_bytes
        if not token:
            raise ValueError("a worker needs the cluster token (the shared secret its router proves)")
        self._token = token
        self.engine = engine
        self.async_engine = AsyncEngine(engine, on_step=self._on_step, snapshot=resident_report,
                                        on_load=self._on_load)
        blocks = engine.blocks  # read before the engine thread starts; then only what the engine tells
        self.load = EngineLoad(0, 0, blocks.num_total_blocks - blocks.num_free_blocks())
        self.reports = StepReportCoalescer(report_every_steps, engine.executor.num_kv_blocks)
        self.instance_id, self.heartbeat_s, self.clock = instance_id, heartbeat_s, clock
        self.parent_pid = parent_pid
        self.connections: set[_Connection] = set()  # authenticated: its router's, at most one
        self.draining = False
        self._drained = False
        self.done = asyncio.Event()
        self._server: asyncio.AbstractServer | None = None
        self._kv_server: asyncio.AbstractServer | None = None
        self.kv_port = 0
        self.handoffs: dict[str, asyncio.TimerHandle] = {}  # held for a pull: each with its timeout
        self._pulling: Counter[str] = Counter()  # held ones being sent now: freed only once no send is under way
        self._let_go_after_pull: set[str] = set()
        self._flush_scheduled = False
        self._heartbeat_task: asyncio.Task | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Starts the engine and listens; returns the bound port."""
        await self.async_engine.start()
        self._server = await asyncio.start_server(self._serve_connection, host, port)
        self._kv_server = await asyncio.start_server(self._serve_kv_peer, host, 0)
        self.kv_port = self._kv_server.sockets[0].getsockname()[1]
        self._heartbeat_task = asyncio.create_task(self._heartbeats())
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        for server in (self._server, self._kv_server):
            if server is not None:
                server.close()
        for timer in self.handoffs.values():
            timer.cancel()
        for conn in list(self.connections):
            self._close(conn)
        await self.async_engine.stop()
        self.done.set()

    # ---- connections ----------------------------------------------------------------------------------------
    def _hello(self, challenge: bytes) -> bytes:
        e = self.engine
        return p.encode_frame(p.Hello(
            p.PROTOCOL_VERSION, self.instance_id, os.getpid(), self.clock(), e.executor.num_kv_blocks, e.block_size,
            e.max_model_len, e.executor.vocab_size, e.tokenizer is not None, e.config.executor, challenge, e.role,
            self.kv_port))

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = "%s:%s" % writer.get_extra_info("peername")[:2]
        challenge = secrets.token_bytes(32)
        writer.write(self._hello(challenge))
        try:
            await self._authenticate(reader, challenge)
        except (p.ProtocolError, asyncio.TimeoutError) as err:
            reason = str(err) or f"no Auth frame within {AUTH_TIMEOUT_S:g} s"
            log.warning("closing connection from %s before it authenticated: %s", peer, reason)
            writer.write(p.encode_frame(p.Error("", "auth" if isinstance(err, AuthError) else "protocol", reason)))
            writer.close()
            return
        except ConnectionError as err:
            log.info("connection from %s lost before it authenticated: %s", peer, err)
            writer.close()
            return
        conn = _Connection(writer, peer)
        self.connections.add(conn)
        self.reports.reset()  # its router has heard of no resident yet
        try:
            while True:
                msg = await p.read_message(reader)
                if msg is None:
                    break
                self._dispatch(conn, msg)
        except p.ProtocolError as err:
            log.warning("closing connection from %s: %s", peer, err)
            conn.add(p.Error("", "protocol", str(err)))
            self._flush()
        except ConnectionError as err:
            log.info("connection from %s lost: %s", peer, err)
        finally:
            self._close(conn)

    async def _authenticate(self, reader: asyncio.StreamReader, challenge: bytes, router: bool = True) -> None:
        """Returns once the peer's first frame proved the secret and (a `router`) no other router holds this
        worker; raises AuthError, ProtocolError (not an Auth frame) or TimeoutError."""
        msg = await asyncio.wait_for(p.read_message(reader), AUTH_TIMEOUT_S)
        if not isinstance(msg, p.Auth):
            raise p.ProtocolError(f"expected Auth first, got {type(msg).__name__ if msg else 'end of stream'}")
        if not hmac.compare_digest(msg.proof, p.auth_proof(self._token, challenge)):
            raise AuthError("its Auth frame does not prove the cluster token")
        if router and self.connections:
            raise AuthError(f"worker {self.instance_id} already serves a router")

    def _dispatch(self, conn: _Connection, msg) -> None:
        if isinstance(msg, (p.Submit, p.Import)):
            if self.draining:
                conn.add(p.Error(msg.request_id, "draining", f"instance {self.instance_id} is draining"))
                self._schedule_flush()
            elif msg.request_id in conn.requests:
                conn.add(p.Error(msg.request_id, "invalid", f"request id {msg.request_id!r} is already in use"))
                self._schedule_flush()
            else:
                serve = self._serve_request if isinstance(msg, p.Submit) else self._serve_import
                conn.requests[msg.request_id] = asyncio.create_task(serve(conn, msg))
        elif isinstance(msg, p.Move):
            if msg.request_id in conn.requests:  # one that finished meanwhile: nothing to move
                self.async_engine.hand_over(msg.request_id)
        elif isinstance(msg, p.Abort):
            if msg.request_id in conn.requests:  # only a connection's own requests
                self.async_engine.abort(msg.request_id)
            elif msg.request_id in self.handoffs:  # no decode worker will take it
                self._let_go(msg.request_id, "aborted")
        elif isinstance(msg, p.Drain):
            self.drain()
        else:
            raise p.ProtocolError(f"a worker does not accept {type(msg).__name__} frames")

    def drain(self) -> None:
        """Accept nothing new, finish the residents, say Drained on every connection, stop."""
        self.draining = True
        self._maybe_drained()

    def _close(self, conn: _Connection) -> None:
        if conn not in self.connections:
            return
        self.connections.discard(conn)
        for task in conn.requests.values():
            task.cancel()  # leaving the engine's stream aborts the request and frees its KV
        conn.writer.close()

    # ---- requests -------------------------------------------------------------------------------------------
    async def _serve_request(self, conn: _Connection, msg: p.Submit) -> None:
        rid = msg.request_id

        async def run() -> None:
            params = msg.sampling.params()
            arrival = self.clock() - max(0.0, msg.queued_s)
            await self._stream(conn, rid, self.async_engine.generate(
                rid, msg.prompt_token_ids, params, msg.slo, arrival, msg.tier, msg.resumed_tokens, msg.tpot_reserve), 0)
        await self._serve(conn, rid, run(), "request")

    async def _serve_import(self, conn: _Connection, msg: p.Import) -> None:
        """A request another worker let go of: its KV pulled from there, then its outputs after those streamed."""
        rid = msg.request_id

        async def run() -> None:
            try:
                handoff = kv_transfer.decode_frame(msg.handoff)
            except KvTransferError as err:
                raise InvalidRequestError(str(err)) from None
            if not isinstance(handoff, kv_transfer.Handoff) or handoff.request_id != rid:
                raise InvalidRequestError(f"the Import of {rid!r} carries no hand-off of that request")
            shift = msg.clock_shift
            handoff = msgspec.structs.replace(
                handoff, arrival=handoff.arrival + shift, first_token_time=handoff.first_token_time + shift,
                first_scheduled_time=None if handoff.first_scheduled_time is None
                else handoff.first_scheduled_time + shift, later_times=[t + shift for t in handoff.later_times],
                tpot_reserve=msg.tpot_reserve)
            source = _PeerKv(msg.kv_host, msg.kv_port, self._token, rid)
            try:
                await self._stream(conn, rid, self.async_engine.generate_imported(handoff, source),
                                   len(handoff.output_token_ids))
            except KvImportRefused as err:
                conn.add(p.Error(rid, "refused", str(err)))
            except (KvTransferError, p.ProtocolError, ConnectionError, OSError, asyncio.TimeoutError) as err:
                reason = str(err) or type(err).__name__
                log.warning("KV pull of %s from %s:%d failed, connection closed: %s", rid, msg.kv_host,
                            msg.kv_port, reason)
                conn.add(p.Error(rid, "gone" if isinstance(err, HandoffGone) else "transfer", reason))
        await self._serve(conn, rid, run(), "import")

    async def _serve(self, conn: _Connection, rid: str, work: Awaitable[None], what: str) -> None:
        """Runs a request's `work`; whatever goes wrong, the request ends with an answer and leaves the connection."""
        try:
            await work
        except (InvalidRequestError, ValueError) as err:
            conn.add(p.Error(rid, "invalid", str(err)))
        except asyncio.CancelledError:
            raise
        except Exception as err:
            log.exception("%s %s failed", what, rid)
            conn.add(p.Error(rid, "engine", f"{type(err).__name__}: {err}"))
        finally:
            conn.requests.pop(rid, None)
            self._schedule_flush()
            if self.draining:
                self._maybe_drained()

    async def _stream(self, conn: _Connection, rid: str, outputs, seen: int) -> None:
        """Sends a request's outputs as Tokens deltas and its end; `seen`: its tokens sent already (elsewhere)."""
        async for out in outputs:
            n = len(out.new_token_ids)
            if n or out.new_text:
                logprobs = out.logprobs[seen:seen + n] if out.logprobs is not None else None
                top = out.top_logprobs[seen:seen + n] if out.top_logprobs is not None else None
                first = seen == 0  # the prompt's logprobs are complete from the first output on
                conn.deltas.append(p.TokenDelta(rid, out.new_token_ids, out.new_text,
                                                out.token_times[seen:seen + n], logprobs, top,
                                                out.prompt_logprobs if first else None,
                                                out.prompt_top_logprobs if first else None))
                seen += n
            if out.finish_reason == "prefilled":
                self._hold(rid)
                conn.add(p.Prefilled(rid, kv_transfer.encode_frame(out.handoff), out.num_cached_tokens))
            elif out.finished:
                conn.add(self._final(out))
            self._schedule_flush()

    # ---- held hand-offs (a prefill engine) ------------------------------------------------------------------
    def _hold(self, rid: str) -> None:
        timer = asyncio.get_running_loop().call_later(self.handoff_timeout_s, self._let_go, rid,
                                                      f"no decode worker pulled it within {self.handoff_timeout_s:g} s")
        self.handoffs[rid] = timer

    def _let_go(self, rid: str, why: str) -> None:
        """Frees a held request's KV (once no pull of it is being sent)."""
        if rid in self._pulling:
            self._let_go_after_pull.add(rid)
            return
        timer = self.handoffs.pop(rid, None)
        if timer is None:
            return
        timer.cancel()
        log.debug("hand-off of %s released: %s", rid, why)
        asyncio.get_running_loop().create_task(self._release(rid))

    async def _release(self, rid: str) -> None:
        try:
            await self.async_engine.call(Engine.release_handoff, rid)
        except KeyError:  # aborted on the engine meanwhile
            pass
        if self.draining:
            self._maybe_drained()

    async def _serve_kv_peer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A decode worker's KV pulls: the handshake, then KvPull -> KvData frames, KvDone -> the KV freed."""
        peer = "%s:%s" % writer.get_extra_info("peername")[:2]
        challenge = secrets.token_bytes(32)
        writer.transport.set_write_buffer_limits(0)  # `drain` then waits until the transport holds nothing
        writer.write(self._hello(challenge))
        try:
            await self._authenticate(reader, challenge, router=False)
            while (msg := await p.read_message(reader)) is not None:
                if isinstance(msg, p.KvPull):
                    await self._send_kv(writer, msg)
                elif isinstance(msg, p.KvDone):
                    self._let_go(msg.request_id, "pulled")
                else:
                    raise p.ProtocolError(f"a KV listener does not accept {type(msg).__name__} frames")
        except (p.ProtocolError, asyncio.TimeoutError) as err:
            log.warning("closing KV connection from %s: %s", peer, str(err) or "no Auth frame in time")
        except (ConnectionError, OSError) as err:
            log.info("KV connection from %s lost: %s", peer, err)
        except Exception:
            log.exception("KV connection from %s failed", peer)
        finally:
            writer.close()

    async def _send_kv(self, writer: asyncio.StreamWriter, pull: p.KvPull) -> None:
        rid = pull.request_id
        if rid not in self.handoffs:
            writer.write(p.encode_frame(p.KvRefused(rid, f"request {rid!r} is not held by {self.instance_id}")))
            return
        self._pulling[rid] += 1
        try:
            frames = await self.async_engine.call(Engine.export_kv, rid, pull.first_block, self.kv_chunk_bytes)
            await writer.drain()  # the frames go after what the transport holds, on the socket itself
        except ValueError as err:  # a first block outside the prompt's
            self._end_pull(rid)
            writer.write(p.encode_frame(p.Error(rid, "invalid", str(err))))
            return
        except BaseException:
            self._end_pull(rid)
            raise
        sock = writer.get_extra_info("socket") if isinstance(writer, asyncio.StreamWriter) else None
        if sock is None or writer.get_extra_info("sslcontext") is not None:  # bytes must go through its writer
            try:
                await self._write_kv(writer, frames.pieces())
            finally:
                self._end_pull(rid)
            return
        # On a thread, blocking: the chunks go from the cache's blocks with no copy but the kernel's. The blocks stay
        # held until the thread is done with them, even when this task is cancelled first.
        stop = threading.Event()
        sending = asyncio.ensure_future(asyncio.to_thread(p.send_kv_frames, sock, frames.pieces(), KV_PULL_TIMEOUT_S,
                                                          stop))
        sending.add_done_callback(lambda done: (done.cancelled() or done.exception(), self._end_pull(rid)))
        try:
            await asyncio.shield(sending)
        except asyncio.CancelledError:
            stop.set()
            raise

    @staticmethod
    async def _write_kv(writer, pieces) -> None:
        """The frames through a writer that owns no plain socket: each chunk read and summed on a thread (it reads
        the cache), then written part by part (the writer copies what the socket does not take at once)."""
        while (piece := await asyncio.to_thread(next, pieces, None)) is not None:
            frame, data = piece
            if data is None:
                writer.write(p.encode_kv_head(frame, 0))
                continue
            parts = await asyncio.to_thread(list, data.parts())
            writer.write(p.encode_kv_head(frame, data.nbytes))
            for buffer in (buffer for part in parts for buffer in part):
                writer.write(buffer)
            writer.write(kv_transfer.chunk_trailer(data.checksum))
            await writer.drain()  # the next chunk is read once the socket took this one

    def _end_pull(self, rid: str) -> None:
        self._pulling[rid] -= 1
        if not self._pulling[rid]:
            del self._pulling[rid]
        if rid not in self._pulling and rid in self._let_go_after_pull:
            self._let_go_after_pull.discard(rid)
            self._let_go(rid, "given up during its pull")

    @staticmethod
    def _final(out: RequestOutput):
        if out.finish_reason == "error":
            return p.Error(out.request_id, "engine", out.error or "engine error")
        return p.Finish(out.request_id, out.finish_reason, len(out.token_ids), out.num_cached_tokens)

    def _maybe_drained(self) -> None:
        if self._drained or self.handoffs or any(conn.requests for conn in self.connections):
            return
        self._drained = True
        self._send_held_reports()
        for conn in self.connections:
            conn.add(p.Drained())
        self._flush()
        asyncio.get_running_loop().create_task(self.stop())

    # ---- reports --------------------------------------------------------------------------------------------
    def _on_step(self, stats: StepStats, residents: list[p.Resident]) -> None:
        self.load = EngineLoad(stats.num_running, stats.num_waiting, stats.num_blocks_used)
        if self.connections:  # steps before the router came are not its to hear
            report = self.reports.add(p.step_timing(stats), residents)
            if report is not None:
                self._send_report(report)
        # the step's outputs reach their request tasks in this loop turn; flushing on the next keeps them together
        self._schedule_flush()

    def _send_report(self, report: p.StepReport) -> None:
        frame = p.encode_frame(report)
        for conn in self.connections:
            conn.frames.append(frame)

    def _send_held_reports(self) -> None:
        report = self.reports.flush()
        if report is not None:
            self._send_report(report)

    def _on_load(self, load: EngineLoad) -> None:
        self.load = load
        self._beat()
        self._schedule_flush()

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                log.warning("parent process %d is gone; exiting", self.parent_pid)
                asyncio.get_running_loop().create_task(self.stop())
                return
            self._beat()
            self._flush()

    def _beat(self) -> None:
        self._send_held_reports()  # a heartbeat never describes the engine as newer than the steps told before it
        load = self.load
        beat = p.encode_frame(p.Heartbeat(self.clock(), load.num_running, load.num_waiting, load.num_blocks_used,
                                          self.engine.executor.num_kv_blocks))
        for conn in self.connections:
            conn.frames.append(beat)

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        for conn in list(self.connections):
            if not (conn.deltas or conn.frames):
                continue
            chunks = []
            if conn.deltas:
                chunks.append(p.encode_frame(p.Tokens(conn.deltas)))
                conn.deltas = []
            chunks.extend(conn.frames)
            conn.frames = []
            conn.writer.write(b"".join(chunks))
            if conn.writer.transport.get_write_buffer_size() > MAX_WRITE_BUFFER_BYTES:
                log.warning("closing connection from %s: it has not read %d bytes", conn.peer,
                            conn.writer.transport.get_write_buffer_size())
                self._close(conn)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0: any free port (printed as READY <port>)")
    ap.add_argument("--instance-id", default=f"worker-{os.getpid()}")
    ap.add_argument("--heartbeat-s", type=float, default=0.5)
    ap.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    ap.add_argument("--report-every-steps", type=int, default=DEFAULT_REPORT_EVERY_STEPS,
                    help="the most engine steps told in one step report while nothing placement depends on changed "
                         "(a resident joining, leaving, emitting its first token, preempted: reported at once); "
                         "1: a report every step")
    ap.add_argument("--handoff-timeout-s", type=float, default=30.0,
                    help="how long the KV of a request let go of (prefilled, or moved) is held for another "
                         "worker's pull")
    ap.add_argument("--cluster-token-file", default=None,
                    help=f"file holding the shared secret the router proves (default: ${p.TOKEN_ENV}; one is needed)")
    add_engine_args(ap)
    return ap.parse_args(argv)


async def _main(args: argparse.Namespace) -> None:
    token = p.load_cluster_token(args.cluster_token_file)
    if token is None:
        raise SystemExit(f"no cluster token: set ${p.TOKEN_ENV} or pass --cluster-token-file")
    engine = build_engine(EngineConfig.from_args(args), instance_id=args.instance_id)
    worker = Worker(engine, instance_id=args.instance_id, token=token, heartbeat_s=args.heartbeat_s,
                    parent_pid=args.parent_pid, report_every_steps=args.report_every_steps,
                    handoff_timeout_s=args.handoff_timeout_s)
    port = await worker.start(args.host, args.port)
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, worker.drain)
    freeze_startup_heap()
    print(f"READY {port}", flush=True)
    await worker.done.wait()


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    asyncio.run(_main(parse_args(argv)))


if __name__ == "__main__":
    main()
