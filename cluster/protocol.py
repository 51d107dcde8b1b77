"""Router <-> engine wire protocol: asyncio TCP streams of length-prefixed, typed, versioned frames (DESIGN.md §5).

A frame is a 4-byte big-endian payload length followed by the payload: one message, msgpack-encoded by msgspec as
a tagged array whose tag carries the protocol version ("submit.1"). A peer speaking another version, a length of 0
or over the bound, a payload that is cut short or does not decode to a known message: each raises `ProtocolError`,
and the side that reads it closes that one connection with the reason logged.

Worker -> router: Hello (first frame), Tokens, Finish, Prefilled, Error, StepReport, Heartbeat, Drained.
Router -> worker: Auth (first frame), Submit, Import, Abort, Drain.
Decode worker -> prefill worker, on the prefill worker's KV listener (`Hello.kv_port`): after the same handshake
(Hello, Auth), KvPull; answered with KvData frames (the hand-off frames of engine/kv_transfer.py, each its own
frame, written as the reader takes them) or KvRefused; then the puller's KvDone lets the prefill side free the KV.
Authentication: the Hello carries a fresh random challenge; the router's first frame answers it with an HMAC keyed by
the fleet's shared secret (`auth_proof`), so the secret never crosses the wire and a recorded answer fits no other
connection. A worker sends nothing but the Hello to a connection before that answer, closes one whose answer is
wrong or missing, and serves one authenticated connection at a time: its router's.
Times a worker sends are on its own monotonic clock; Hello carries that clock's reading so the router can map them.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import struct
from typing import Annotated, Callable, Union

import msgspec

from engine import kv_transfer
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutput
from scheduler.slo import SLO

PROTOCOL_VERSION = 6
MAX_FRAME_BYTES = 8 << 20  # a 128k-token prompt is ~0.5 MB of msgpack; 8 MiB leaves room and bounds a bad peer
THREAD_DECODE_BYTES = 1 << 18  # above this a frame takes milliseconds to decode: off the event loop
HEADER = struct.Struct("!I")


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame; the connection it came on must be closed."""


def _tag(name: str) -> str:
    return f"{name}.{PROTOCOL_VERSION}"


class _Message(msgspec.Struct, array_like=True, tag_field="type", forbid_unknown_fields=True):
    pass


class SamplingSpec(msgspec.Struct, array_like=True):
    """engine.SamplingParams on the wire, field for field by name. Unchecked here: the worker checks it by building
    the SamplingParams, so a bad value fails that one request, not the connection it came on."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: bool = False
    structured_output: StructuredOutput | None = None
    top_logprobs: int = 0
    prompt_logprobs: bool = False

    @classmethod
    def of(cls, params: SamplingParams) -> "SamplingSpec":
        return cls(**{name: getattr(params, name) for name in cls.__struct_fields__})

    def params(self) -> SamplingParams:
        """The engine's SamplingParams; ValueError names a bad field."""
        return SamplingParams(**msgspec.structs.asdict(self))


class Hello(_Message, tag=_tag("hello")):
    version: int
    instance_id: str
    pid: int
    clock: float  # the worker's monotonic clock when it sent this frame
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    has_tokenizer: bool
    executor: str
    challenge: bytes = b""  # random, fresh per connection: the router's Auth answers it
    role: str = "both"  # engine.config's role: both | prefill | decode
    kv_port: int = 0  # a prefill worker's listener for decode workers' KV pulls (0: none)


class Auth(_Message, tag=_tag("auth")):
    """The router's first frame: proof that it holds the fleet's secret (`auth_proof` of the Hello's challenge)."""
    proof: bytes


class Submit(_Message, tag=_tag("submit")):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    tier: str  # the tier the router admitted it under: the engine keeps that tier's output-length mean
    slo: SLO  # made concrete at the router's admission
    queued_s: float  # time since the request's arrival at the router; the worker dates its arrival back by it
    # the prompt's last tokens are output already streamed from a failed instance: the engine continues after them
    # (Engine.add_request's resumed_tokens)
    resumed_tokens: int = 0


class Import(_Message, tag=_tag("import")):
    """Continue a request that a prefill worker ran to its first token: pull its KV from that worker's KV listener
    (`kv_host`:`kv_port`), import it and stream the rest as for a Submit."""
    request_id: str
    handoff: bytes  # engine.kv_transfer.encode_frame of the prefill engine's Handoff
    kv_host: str
    kv_port: int
    clock_shift: float  # this worker's clock - the prefill worker's: the Handoff's times are on the latter


class Abort(_Message, tag=_tag("abort")):
    request_id: str


class Drain(_Message, tag=_tag("drain")):
    """Finish what is resident, accept nothing new, then say Drained and exit."""


class TokenDelta(msgspec.Struct, array_like=True):
    request_id: str
    token_ids: list[int]
    text: str  # text that became safe to stream with these tokens (may be empty)
    emit_times: list[float]  # one per token, worker clock
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token: (token id, logprob), most likely first
    # the whole prompt's, in the request's first delta only (engine.RequestOutput's fields of the same names)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None


class Tokens(_Message, tag=_tag("tokens")):
    """New tokens of one engine step, every request that produced any."""
    deltas: list[TokenDelta]


class Finish(_Message, tag=_tag("finish")):
    request_id: str
    finish_reason: str  # stop | length | abort
    num_output_tokens: int
    num_cached_tokens: int


class Prefilled(_Message, tag=_tag("prefilled")):
    """A prefill worker's request has its first token (sent before this frame) and its KV is held for a decode
    worker to pull (`Import`), until that one says KvDone, the router aborts it, or the worker's hold times out."""
    request_id: str
    handoff: bytes  # engine.kv_transfer.encode_frame of the engine's Handoff
    num_cached_tokens: int


class Error(_Message, tag=_tag("error")):
    """A request ends without a normal finish, or (request_id "") the connection is being closed for a reason."""
    request_id: str
    # invalid (bad request: nothing ran) | draining (not accepted: place elsewhere) | engine | protocol; for an
    # Import: refused (no free KV blocks, nothing pulled: place elsewhere or later) | transfer (the pull failed,
    # nothing applied: the prefill side still holds the KV) | gone (the prefill side holds it no more)
    kind: str
    message: str


class Resident(msgspec.Struct, array_like=True):
    request_id: str
    num_prompt_tokens: int
    num_computed_tokens: int
    num_output_tokens: int


class StepTiming(msgspec.Struct, array_like=True):
    """One engine step as measured: scheduler.types.StepStats on the wire, field for field."""
    start: float  # worker clock
    duration: float
    num_prefill_tokens: int
    num_decode_seqs: int
    num_kv_tokens: int
    num_blocks_used: int
    num_running: int
    num_waiting: int
    num_seqs: int  # sequences in the batch


class StepReport(_Message, tag=_tag("step")):
    """The engine steps measured since the worker's previous report, oldest first, and the residents whose progress
    changed since then, as they are after the newest step (cluster/step_reports.py: when a worker sends one)."""
    steps: Annotated[list[StepTiming], msgspec.Meta(min_length=1)]
    num_total_blocks: int
    residents: list[Resident]


class Heartbeat(_Message, tag=_tag("heartbeat")):
    """What the engine holds now: sent every heartbeat period, and at once when its load changed with no step to
    report it (an abort, the last finish), so that an idle engine's figures do not stay those of its last step."""
    clock: float
    num_running: int
    num_waiting: int
    num_blocks_used: int
    num_total_blocks: int


class Drained(_Message, tag=_tag("drained")):
    """Sent once, after the last resident of a draining worker finished; the worker exits next."""


class KvPull(_Message, tag=_tag("kv_pull")):
    """Send the held request's KV blocks from `first_block` on (the puller's prefix cache holds those before)."""
    request_id: str
    first_block: int


class KvData(_Message, tag=_tag("kv_data")):
    # one engine.kv_transfer frame, encoded by that module (KvBegin, KvChunk or KvEnd); decoded, a view of the payload
    # it came in, not a copy (`encode_kv_data` writes it without one either)
    frame: memoryview


class KvRefused(_Message, tag=_tag("kv_refused")):
    """The pulled request is not held here (released, timed out, aborted): it must be prefilled again."""
    request_id: str
    message: str


class KvDone(_Message, tag=_tag("kv_done")):
    """The puller applied the KV: the prefill side may free it."""
    request_id: str


Message = Union[Hello, Auth, Submit, Import, Abort, Drain, Tokens, Finish, Prefilled, Error, StepReport, Heartbeat,
                Drained, KvPull, KvData, KvRefused, KvDone]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def auth_proof(token: str, challenge: bytes) -> bytes:
    """The answer to a worker's challenge: HMAC-SHA256 keyed by the shared secret, over a label (so the same
    secret keyed elsewhere never yields it) and the challenge."""
    return hmac.new(token.encode(), b"polyserve-router-auth\0" + challenge, hashlib.sha256).digest()


TOKEN_ENV = "POLYSERVE_CLUSTER_TOKEN"
MIN_TOKEN_CHARS = 16


def load_cluster_token(path: str | None = None) -> str | None:
    """The fleet's shared secret: the file's content (stripped) when a path is given, else $POLYSERVE_CLUSTER_TOKEN,
    else None. ValueError for one too short to guess-proof."""
    token = (open(path).read() if path else os.environ.get(TOKEN_ENV, "")).strip()
    if path and not token:
        raise ValueError(f"the cluster token file {path} is empty")
    if token and len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"the cluster token must be at least {MIN_TOKEN_CHARS} characters, got {len(token)}")
    return token or None


def encode_frame(msg: _Message, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """Header plus payload, ready to write; ValueError if the message exceeds the frame bound."""
    buf = bytearray(HEADER.size)
    _encoder.encode_into(msg, buf, HEADER.size)
    size = len(buf) - HEADER.size
    if size > max_bytes:
        raise ValueError(f"{type(msg).__name__} frame of {size} bytes exceeds the bound of {max_bytes} bytes")
    HEADER.pack_into(buf, 0, size)
    return bytes(buf)


_KV_DATA_HEAD = _encoder.encode(KvData(memoryview(b"")))[:-len(kv_transfer.bin_header(0))]


def encode_kv_data(frame: kv_transfer.KvFrame, max_bytes: int = MAX_FRAME_BYTES) -> tuple[bytes, memoryview]:
    """`encode_frame(KvData(kv_transfer.encode_frame(frame)))` as (head, data), the same bytes once joined: a
    chunk's data is not copied into the frame but written after the head from where it lies (`writer.write` each in
    turn; `writelines` would join them, a copy). ValueError if the message exceeds the frame bound."""
    head, data = kv_transfer.encode_frame_parts(frame)
    inner = len(head) + data.nbytes
    size = len(_KV_DATA_HEAD) + len(kv_transfer.bin_header(inner)) + inner
    if size > max_bytes:
        raise ValueError(f"KvData frame of {size} bytes exceeds the bound of {max_bytes} bytes")
    return HEADER.pack(size) + _KV_DATA_HEAD + kv_transfer.bin_header(inner) + head, data


def decode_payload(payload: bytes | memoryview) -> Message:
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError: wrong types, unknown tag or version
        raise ProtocolError(f"malformed frame: {e}") from None


def _frame_size(header: bytes | bytearray, max_bytes: int) -> int:
    """The payload length a frame header announces; ProtocolError when it lies outside [1, max_bytes]."""
    (size,) = HEADER.unpack(header)
    if size == 0 or size > max_bytes:
        raise ProtocolError(f"frame length {size} is outside [1, {max_bytes}]")
    return size


def _header_cut(partial: bytes) -> ProtocolError:
    return ProtocolError(f"stream ended inside a frame header ({len(partial)} of {HEADER.size} bytes)")


async def read_message(reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES) -> Message | None:
    """The next message, or None when the peer closed the stream cleanly between frames. Frames over
    THREAD_DECODE_BYTES are decoded off the event loop."""
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise _header_cut(e.partial) from None
    size = _frame_size(header, max_bytes)
    try:
        payload = await reader.readexactly(size)
    except asyncio.IncompleteReadError as e:
        raise ProtocolError(f"stream ended inside a frame ({len(e.partial)} of {size} bytes)") from None
    if size > THREAD_DECODE_BYTES:  # a prompt's top logprobs: decoded beside the loop, which keeps its other streams
        return await asyncio.to_thread(decode_payload, payload)
    return decode_payload(payload)


# the first read of a frame that may carry a chunk: its head whole unless the request id is hundreds of characters
# long (such a frame is then read whole, and its chunk copied into place)
_KV_HEAD_READ_BYTES = 512


def decode_kv_chunk_head(head: bytes | memoryview, size: int) -> tuple[kv_transfer.KvChunk, int] | None:
    """When `head`, the leading bytes of a frame of `size` payload bytes, shows a KvData frame that carries a chunk
    (`encode_kv_data`'s head): the chunk with its data empty, and where in the payload its data starts. None for any
    other frame, and for one whose head does not add up to `size` (the whole frame's decoding says what is wrong)."""
    view = memoryview(head).cast("B")
    if view[:len(_KV_DATA_HEAD)] != _KV_DATA_HEAD:
        return None
    inner = kv_transfer.decode_bin_header(view[len(_KV_DATA_HEAD):])
    if inner is None:
        return None
    start = len(_KV_DATA_HEAD) + inner[1]
    chunk = kv_transfer.decode_chunk_head(view[start:])
    if chunk is None or start + inner[0] != size or start + chunk[1] + chunk[2] != size:
        return None
    return chunk[0], start + chunk[1]


class PullReader(asyncio.BufferedProtocol):
    """The decode side of a KV pull connection (its protocol, for `loop.create_connection`): messages as
    `read_message` reads them from a StreamReader, but a KvData frame that carries a chunk is read head first and
    its data straight from the socket into the receiver's staging (`read_message`'s `chunk_memory`): each byte is
    copied once, where a StreamReader copies it into its buffer and out again. It reads while a read waits, and a
    few KiB ahead (the next frame's header and head) while none does; past that a peer's bytes wait in the socket,
    and the peer's writes in turn (backpressure). One read at a time."""

    READ_AHEAD_BYTES = 4096

    def __init__(self, max_bytes: int = MAX_FRAME_BYTES):
        self.max_bytes = max_bytes
        self.transport: asyncio.Transport | None = None
        self._ahead = memoryview(bytearray(self.READ_AHEAD_BYTES))
        self._start = self._end = 0  # the unread bytes of the read-ahead
        self._into: memoryview | None = None  # a waiting read's destination, filled up to _filled
        self._filled = 0
        self._waiter: asyncio.Future | None = None
        self._eof, self._lost = False, None  # the peer's end; an error that ended the connection
        self._paused = False

    # ---- asyncio's side ------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._into is not None:
            return self._into[self._filled:]
        if self._start:  # the unread bytes to the front: a few, and only once a read took some
            rest = self._end - self._start
            self._ahead[:rest] = self._ahead[self._start:self._end]
            self._start, self._end = 0, rest
        return self._ahead[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._into is not None:
            self._filled += nbytes
            if self._filled == len(self._into):
                self._wake(None)
            return
        self._end += nbytes
        self._update_reading()

    def eof_received(self) -> bool:
        self._end_reads(None)
        return False  # the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        self._end_reads(exc)

    def _end_reads(self, exc: Exception | None) -> None:
        self._eof, self._lost = True, self._lost or exc
        if self._into is not None:
            self._wake(self._ended(self._into[:self._filled], len(self._into)))

    def _ended(self, partial: memoryview, expected: int) -> Exception:
        if self._lost is not None:
            return ConnectionError(f"the connection was lost: {self._lost}")
        return asyncio.IncompleteReadError(bytes(partial), expected)

    def _wake(self, error: Exception | None) -> None:
        """Ends the waiting read: done, or `error`. Its task may have been cancelled meanwhile."""
        self._into = None
        if self._waiter.done():
            return
        if error is None:
            self._waiter.set_result(None)
        else:
            self._waiter.set_exception(error)

    def _update_reading(self) -> None:
        """Reads while a read waits or the read-ahead has room."""
        wanted = self._into is not None or self._end < len(self._ahead)
        if self.transport is None or self.transport.is_closing() or wanted != self._paused:
            return
        if wanted:
            self.transport.resume_reading()
        else:
            self.transport.pause_reading()
        self._paused = not wanted

    async def _read_into(self, memory: memoryview, timeout: float | None) -> None:
        """Fills `memory` from the connection: TimeoutError when it waits longer than `timeout` for bytes,
        IncompleteReadError at the peer's end, ConnectionError when the connection was lost."""
        have = min(len(memory), self._end - self._start)
        memory[:have] = self._ahead[self._start:self._start + have]
        self._start += have
        if self._start == self._end:
            self._start = self._end = 0
        if have < len(memory):
            if self._eof:
                raise self._ended(memory[:have], len(memory))
            loop = asyncio.get_running_loop()
            self._into, self._filled, self._waiter = memory, have, loop.create_future()
            timer = None if timeout is None else loop.call_later(timeout, self._time_out)
            self._update_reading()
            try:
                await self._waiter
            finally:
                self._into = self._waiter = None
                if timer is not None:
                    timer.cancel()
        self._update_reading()

    def _time_out(self) -> None:
        if self._into is not None:
            self._wake(TimeoutError("the peer sent nothing in time"))

    # ---- the reader's side ---------------------------------------------------------------------------------
    async def read_message(self, timeout: float | None = None,
                           chunk_memory: Callable[[int], memoryview] | None = None) \
            -> Message | kv_transfer.KvFrame | None:
        """The next message; None when the peer ended the connection between frames; TimeoutError when a read of
        it waits longer than `timeout` for bytes. With `chunk_memory` (`KvReceiver.chunk_memory`), a KvData frame
        comes as the hand-off frame it carries, decoded, a chunk's data read into `chunk_memory(its size)` (the
        chunk's data is that memory; what `chunk_memory` raises is raised before the data is read)."""
        header = bytearray(HEADER.size)
        try:
            await self._read_into(memoryview(header), timeout)
        except asyncio.IncompleteReadError as e:
            if not e.partial:
                return None
            raise _header_cut(e.partial) from None
        size = _frame_size(header, self.max_bytes)
        payload = bytearray(size if chunk_memory is None else min(size, _KV_HEAD_READ_BYTES))
        try:
            await self._read_into(memoryview(payload), timeout)
            chunk = None if chunk_memory is None else decode_kv_chunk_head(payload, size)
            if chunk is not None:
                head, start = chunk
                data = chunk_memory(size - start)
                read = len(payload) - start  # the data's first bytes, read with the head
                data[:read] = memoryview(payload)[start:]
                await self._read_into(data[read:], timeout)
                return msgspec.structs.replace(head, data=data)
            if size > len(payload):  # not a chunk: the rest of the frame after the bytes read
                read, payload = payload, bytearray(size)
                payload[:len(read)] = read
                await self._read_into(memoryview(payload)[len(read):], timeout)
        except asyncio.IncompleteReadError:
            raise ProtocolError(f"stream ended inside a frame of {size} bytes") from None
        msg = decode_payload(payload)
        return kv_transfer.decode_frame(msg.frame) if chunk_memory is not None and isinstance(msg, KvData) else msg

    def write(self, data: bytes) -> None:
        """ConnectionError when the connection is closed or closing."""
        if self.transport is None or self.transport.is_closing():
            raise ConnectionError("the connection is closed")
        self.transport.write(data)

    def close(self) -> None:
        """Closes the connection once what was written is sent."""
        if self.transport is not None:
            self.transport.close()
