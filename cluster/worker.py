"""An engine process serving the cluster protocol (DESIGN.md §5).

    python -m cluster.worker --port 0 --executor emulated [--time-scale 0.5] [--num-kv-blocks N] ...

Its engine flags are `EngineConfig`'s (engine/config.py), as `cluster.serve` forwards them.

Prints `READY <port>` on stdout once it listens; SIGTERM or SIGINT drains it. Every connection (normally one: the router's) gets Hello first,
then for its own requests Tokens / Finish / Error frames, and for every engine step a StepReport (batch shape,
iteration time, KV use, all residents); a Heartbeat every `--heartbeat-s`. Drain: new submits are answered with a
`draining` error, residents finish, every connection gets Drained, and the process exits.

Prompts arrive as token ids (the router tokenizes); the engine detokenizes with the model folder's tokenizer, so
stop strings cut exactly where they would in one process, and text deltas travel with the tokens.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field

from cluster import protocol as p
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig, add_engine_args
from engine.engine import Engine, InvalidRequestError, RequestOutput
from engine.llm import build_engine
from engine.serving import freeze_startup_heap
from scheduler.types import StepStats

log = logging.getLogger(__name__)

MAX_WRITE_BUFFER_BYTES = 64 << 20  # a peer that reads nothing for this long is gone; its connection is closed


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
    def __init__(self, engine: Engine, *, instance_id: str, heartbeat_s: float = 0.5, parent_pid: int | None = None,
                 clock=time.monotonic):
        """`parent_pid`: exit when that process is gone (a launcher's workers must not outlive it)."""
        if not heartbeat_s > 0:
            raise ValueError(f"heartbeat_s must be positive, got {heartbeat_s}")
        self.engine = engine
        self.async_engine = AsyncEngine(engine, on_step=self._on_step, snapshot=resident_report)
        self.instance_id, self.heartbeat_s, self.clock = instance_id, heartbeat_s, clock
        self.parent_pid = parent_pid
        self.connections: set[_Connection] = set()
        self.draining = False
        self._drained = False
        self.done = asyncio.Event()
        self._server: asyncio.AbstractServer | None = None
        self._flush_scheduled = False
        self._heartbeat_task: asyncio.Task | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Starts the engine and listens; returns the bound port."""
        await self.async_engine.start()
        self._server = await asyncio.start_server(self._serve_connection, host, port)
        self._heartbeat_task = asyncio.create_task(self._heartbeats())
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            self._close(conn)
        await self.async_engine.stop()
        self.done.set()

    # ---- connections ----------------------------------------------------------------------------------------
    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = "%s:%s" % writer.get_extra_info("peername")[:2]
        conn = _Connection(writer, peer)
        self.connections.add(conn)
        e = self.engine
        writer.write(p.encode_frame(p.Hello(
            p.PROTOCOL_VERSION, self.instance_id, os.getpid(), self.clock(), e.executor.num_kv_blocks, e.block_size,
            e.max_model_len, e.executor.vocab_size, e.tokenizer is not None, e.config.executor)))
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

    def _dispatch(self, conn: _Connection, msg) -> None:
        if isinstance(msg, p.Submit):
            if self.draining:
                conn.add(p.Error(msg.request_id, "draining", f"instance {self.instance_id} is draining"))
                self._schedule_flush()
            elif msg.request_id in conn.requests:
                conn.add(p.Error(msg.request_id, "invalid", f"request id {msg.request_id!r} is already in use"))
                self._schedule_flush()
            else:
                conn.requests[msg.request_id] = asyncio.create_task(self._serve_request(conn, msg))
        elif isinstance(msg, p.Abort):
            if msg.request_id in conn.requests:  # only a connection's own requests
                self.async_engine.abort(msg.request_id)
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
        seen = 0  # tokens already sent: the engine's token_times list keeps growing on its thread, so slice by count
        try:
            params = msg.sampling.params()
            arrival = self.clock() - max(0.0, msg.queued_s)
            async for out in self.async_engine.generate(rid, msg.prompt_token_ids, params, msg.slo, arrival, msg.tier,
                                                        msg.resumed_tokens):
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
                if out.finished:
                    conn.add(self._final(out))
                self._schedule_flush()
        except (InvalidRequestError, ValueError) as err:
            conn.add(p.Error(rid, "invalid", str(err)))
            self._schedule_flush()
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the request ends with an answer, whatever went wrong
            log.exception("request %s failed", rid)
            conn.add(p.Error(rid, "engine", f"{type(err).__name__}: {err}"))
            self._schedule_flush()
        finally:
            conn.requests.pop(rid, None)
            if self.draining:
                self._maybe_drained()

    @staticmethod
    def _final(out: RequestOutput):
        if out.finish_reason == "error":
            return p.Error(out.request_id, "engine", out.error or "engine error")
        return p.Finish(out.request_id, out.finish_reason, len(out.token_ids), out.num_cached_tokens)

    def _maybe_drained(self) -> None:
        if self._drained or any(conn.requests for conn in self.connections):
            return
        self._drained = True
        for conn in self.connections:
            conn.add(p.Drained())
        self._flush()
        asyncio.get_running_loop().create_task(self.stop())

    # ---- reports --------------------------------------------------------------------------------------------
    def _on_step(self, stats: StepStats, residents: list[p.Resident]) -> None:
        frame = p.encode_frame(p.StepReport(
            stats.start, stats.duration, stats.num_prefill_tokens, stats.num_decode_seqs, stats.num_kv_tokens,
            stats.num_blocks_used, self.engine.executor.num_kv_blocks, stats.num_running, stats.num_waiting,
            stats.num_seqs, residents))
        for conn in self.connections:
            conn.frames.append(frame)
        # the step's outputs reach their request tasks in this loop turn; flushing on the next keeps them together
        self._schedule_flush()

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                log.warning("parent process %d is gone; exiting", self.parent_pid)
                asyncio.get_running_loop().create_task(self.stop())
                return
            beat = p.encode_frame(p.Heartbeat(self.clock(), len(self.engine.running), len(self.engine.waiting)))
            for conn in self.connections:
                conn.frames.append(beat)
            self._flush()

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
    add_engine_args(ap)
    return ap.parse_args(argv)


async def _main(args: argparse.Namespace) -> None:
    engine = build_engine(EngineConfig.from_args(args), instance_id=args.instance_id)
    worker = Worker(engine, instance_id=args.instance_id, heartbeat_s=args.heartbeat_s, parent_pid=args.parent_pid)
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
