"""The router's end of one worker connection: handshake (the worker's Hello, the router's Auth), a read loop that
hands every frame to the service, and the worker's clock mapped onto the router's."""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

from cluster import protocol as p

log = logging.getLogger(__name__)

ROUTER_BOUND = (p.Tokens, p.Finish, p.Prefilled, p.Error, p.StepReport, p.Heartbeat, p.Drained)


class EngineLink:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hello: p.Hello,
                 clock_offset: float, now: float):
        self.reader, self.writer, self.hello = reader, writer, hello
        self.instance_id = hello.instance_id
        self.clock_offset = clock_offset  # router clock - worker clock (plus the Hello's transit, microseconds)
        self.last_heard = now
        self.drained = False
        self.closed = False
        self.close_reason = ""

    @classmethod
    async def connect(cls, host: str, port: int, clock: Callable[[], float], timeout_s: float = 10.0, *,
                      token: str) -> "EngineLink":
        """Connects, reads the worker's Hello and answers its challenge with proof of `token` (the fleet's shared
        secret); ProtocolError if it speaks another version or something else."""
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
        try:
            hello = await asyncio.wait_for(p.read_message(reader), timeout_s)
            if not isinstance(hello, p.Hello):
                raise p.ProtocolError(f"expected Hello first, got {type(hello).__name__ if hello else 'end of stream'}")
            if hello.version != p.PROTOCOL_VERSION:
                raise p.ProtocolError(f"worker speaks protocol {hello.version}, router {p.PROTOCOL_VERSION}")
            writer.write(p.encode_frame(p.Auth(p.auth_proof(token, hello.challenge))))
        except BaseException:
            writer.close()
            raise
        now = clock()
        return cls(reader, writer, hello, now - hello.clock, now)

    def to_router_clock(self, t: float) -> float:
        return t + self.clock_offset

    def send(self, msg) -> None:
        if not self.closed:
            self.writer.write(p.encode_frame(msg))

    def close(self, reason: str) -> None:
        if not self.closed:
            self.closed, self.close_reason = True, reason
            self.writer.close()

    async def run(self, on_message: Callable[["EngineLink", object], None], clock: Callable[[], float]) -> str:
        """Reads until the stream ends or breaks; returns why. A malformed frame closes this connection only."""
        reason = "connection closed by the worker"
        try:
            while not self.closed:
                msg = await p.read_message(self.reader)
                if msg is None:
                    break
                if not isinstance(msg, ROUTER_BOUND):
                    raise p.ProtocolError(f"a router does not accept {type(msg).__name__} frames")
                self.last_heard = clock()
                on_message(self, msg)
        except p.ProtocolError as e:
            reason = f"protocol error: {e}"
            log.warning("closing connection to instance %s: %s", self.instance_id, e)
        except (ConnectionError, OSError) as e:
            reason = f"connection lost: {e}"
        self.close(self.close_reason or reason)
        return self.close_reason
