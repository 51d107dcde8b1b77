"""Router <-> engine wire protocol: asyncio TCP streams of length-prefixed, typed, versioned frames (DESIGN.md §5).

A frame is a 4-byte big-endian payload length followed by the payload: one message, msgpack-encoded by msgspec as
a tagged array whose tag carries the protocol version ("submit.1"). A peer speaking another version, a length of 0
or over the bound, a payload that is cut short or does not decode to a known message: each raises `ProtocolError`,
and the side that reads it closes that one connection with the reason logged.

Worker -> router: Hello (first frame), Tokens, Finish, Prefilled, Error, StepReport, Heartbeat, Drained.
Router -> worker: Auth (first frame), Submit, Import, Move, Abort, Drain.
Importing worker -> the worker that holds the KV, on the latter's KV listener (`Hello.kv_port`): after the same
handshake (Hello, Auth), KvPull; answered with KvData frames (the hand-off frames of engine/kv_transfer.py, each its
own frame, written as the reader takes them) or KvRefused; then the puller's KvDone lets the holder free the KV.
Authentication: the Hello carries a fresh random challenge; the router's first frame answers it with an HMAC keyed by
the fleet's shared secret (`auth_proof`), so the secret never crosses the wire and a recorded answer fits no other
connection. A worker sends nothing but the Hello to a connection before that answer, closes one whose answer is
wrong or missing, and serves one authenticated connection at a time: its router's.
Times a worker sends are on its own monotonic clock; Hello carries that clock's reading so the router can map them.
"""
from __future__ import annotations

import array
import asyncio
import bisect
import fcntl
import hashlib
import hmac
import itertools
import os
import select
import socket
import struct
import termios
import threading
from typing import Annotated, Callable, Union

import msgspec

from engine import kv_transfer
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutput
from scheduler.slo import SLO
from scheduler.types import StepStats

PROTOCOL_VERSION = 7
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
    kv_port: int = 0  # the worker's listener for other workers' pulls of the KV it holds for them (0: none)


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
    tpot_reserve: float = 0.0  # the share of its TPOT kept before each token's deadline (Engine.add_request's)


class Import(_Message, tag=_tag("import")):
    """Continue a request that another worker let go of (`Prefilled`: a prefill worker's at its first token, or one
    it was told to `Move`): pull its KV from that worker's KV listener (`kv_host`:`kv_port`), import it and stream
    the rest as for a Submit."""
    request_id: str
    handoff: bytes  # engine.kv_transfer.encode_frame of the other engine's Handoff
    kv_host: str
    kv_port: int
    clock_shift: float  # this worker's clock - the other worker's: the Handoff's times are on the latter
    tpot_reserve: float = 0.0  # as a Submit's: the router's for its new place (replaces the Handoff's)


class Move(_Message, tag=_tag("move")):
    """Let go of a decoding request between steps, its KV held for another worker to pull: answered by Prefilled
    as a prefill worker's hand-off, or by nothing where it is no longer decoding here (it finishes as usual)."""
    request_id: str


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
    """A prefill worker's request has its first token, or a request this worker was told to `Move` left its batch
    (its tokens so far sent before this frame), and its KV is held for another worker to pull (`Import`), until that
    one says KvDone, the router aborts it, or the worker's hold times out."""
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


def step_timing(stats: StepStats) -> StepTiming:
    """`stats` on the wire (the worker's side)."""
    return StepTiming(*[getattr(stats, name) for name in StepTiming.__struct_fields__])


def step_stats(timing: StepTiming) -> StepStats:
    """A step off the wire as the engine measured it (the router's side)."""
    return StepStats(**msgspec.structs.asdict(timing))


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
    # it came in, not a copy (`encode_kv_head` lets a sender write it without one either)
    frame: memoryview


class KvRefused(_Message, tag=_tag("kv_refused")):
    """The pulled request is not held here (released, timed out, aborted): it must be prefilled again."""
    request_id: str
    message: str


class KvDone(_Message, tag=_tag("kv_done")):
    """The puller applied the KV: the prefill side may free it."""
    request_id: str


Message = Union[Hello, Auth, Submit, Import, Move, Abort, Drain, Tokens, Finish, Prefilled, Error, StepReport,
                Heartbeat, Drained, KvPull, KvData, KvRefused, KvDone]

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


def encode_kv_head(frame: kv_transfer.KvFrame, data_bytes: int, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """`encode_frame(KvData(kv_transfer.encode_frame(frame)))` up to a chunk's data, for a chunk whose data,
    `data_bytes` of it, follows from where it lies, and then its `kv_transfer.chunk_trailer` (the chunk's own data
    and checksum are not looked at): no copy of the data into the frame. Another frame whole. ValueError if the
    message exceeds the frame bound."""
    if isinstance(frame, kv_transfer.KvChunk):
        return _kv_data_head(kv_transfer.encode_chunk_head(frame, data_bytes),
                             data_bytes + kv_transfer.CHUNK_TRAILER_BYTES, max_bytes)
    return _kv_data_head(kv_transfer.encode_frame(frame), 0, max_bytes)


def _kv_data_head(inner_head: bytes, after_bytes: int, max_bytes: int) -> bytes:
    inner = len(inner_head) + after_bytes
    size = len(_KV_DATA_HEAD) + len(kv_transfer.bin_header(inner)) + inner
    if size > max_bytes:
        raise ValueError(f"KvData frame of {size} bytes exceeds the bound of {max_bytes} bytes")
    return HEADER.pack(size) + _KV_DATA_HEAD + kv_transfer.bin_header(inner) + inner_head


_IOV_MAX = os.sysconf("SC_IOV_MAX")  # buffers one sendmsg or recvmsg_into takes
_SEND_WAIT_S = 0.25  # a sender waiting for room in the socket looks at its stop flag this often


def send_kv_frames(sock: socket.socket, pieces, timeout: float, stop: threading.Event,
                   max_bytes: int = MAX_FRAME_BYTES) -> None:
    """Writes the hand-off frames of `pieces` (`kv_transfer.KvExport.pieces`) to the connected stream socket `sock`
    as KvData frames, each chunk's data from where it lies with no copy but the kernel's (`sendmsg` of its head and
    first part, of each part as the chunk gives it, then of its checksum); blocking, for a thread of its own,
    through a duplicate of the socket's descriptor, which may be non-blocking (an asyncio transport's, whose own
    writes must have been flushed and wait meanwhile). It asks for the next part once the socket took the last one.
    TimeoutError when the peer takes nothing for `timeout` s, ConnectionError when the connection is lost or `stop`
    is set (looked at between parts and while waiting), ValueError for a frame over `max_bytes`."""
    with socket.socket(fileno=os.dup(sock.fileno())) as own:
        room = select.poll()
        room.register(own.fileno(), select.POLLOUT)
        for frame, data in pieces:
            if stop.is_set():
                raise ConnectionError("the KV pull was given up")
            if data is None:
                _send_all(own, [encode_kv_head(frame, 0, max_bytes)], room, timeout, stop)
                continue
            head = [encode_kv_head(frame, data.nbytes, max_bytes)]
            for part in data.parts():
                _send_all(own, [*head, *part], room, timeout, stop)
                head = []
                if stop.is_set():
                    raise ConnectionError("the KV pull was given up")
            _send_all(own, [*head, kv_transfer.chunk_trailer(data.checksum)], room, timeout, stop)


def _send_all(sock: socket.socket, buffers: list, room: select.poll, timeout: float, stop: threading.Event) -> None:
    ends = list(itertools.accumulate(len(b) for b in buffers))  # each buffer's end in what is sent
    sent = 0
    while True:
        at = bisect.bisect_right(ends, sent)  # the first buffer not sent whole
        if at == len(buffers):
            return
        batch = buffers[at:at + _IOV_MAX]
        batch[0] = memoryview(batch[0])[sent - (ends[at] - len(batch[0])):]
        try:
            sent += sock.sendmsg(batch, (), socket.MSG_NOSIGNAL)
            continue
        except BlockingIOError:
            pass
        waited = 0.0
        while not room.poll(_SEND_WAIT_S * 1000):
            waited += _SEND_WAIT_S
            if stop.is_set():
                raise ConnectionError("the KV pull was given up")
            if waited >= timeout:
                raise TimeoutError(f"the KV peer took nothing for {timeout:g} s")


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


def decode_kv_chunk_head(head: bytes | memoryview, size: int) -> tuple[kv_transfer.KvChunk, int, int] | None:
    """When `head`, the leading bytes of a frame of `size` payload bytes, shows a KvData frame that carries a chunk
    (`encode_kv_head`'s): the chunk with its data empty and its checksum 0, where in the payload its data starts,
    and the data's size (the checksum follows it to the frame's end). None for any other frame, and for one whose
    head does not add up to `size` (the whole frame's decoding says what is wrong)."""
    view = memoryview(head).cast("B")
    if view[:len(_KV_DATA_HEAD)] != _KV_DATA_HEAD:
        return None
    inner = kv_transfer.decode_bin_header(view[len(_KV_DATA_HEAD):])
    if inner is None:
        return None
    start = len(_KV_DATA_HEAD) + inner[1]
    chunk = kv_transfer.decode_chunk_head(view[start:])
    if chunk is None or start + inner[0] != size \
            or not 1 <= size - (start + chunk[1] + chunk[2]) <= kv_transfer.CHUNK_TRAILER_BYTES:
        return None
    return chunk[0], start + chunk[1], chunk[2]


class PullReader:
    """The decode side of a KV pull connection, on a non-blocking socket of its own (`connect`) read through the
    event loop: messages as `read_message` reads them from a StreamReader, but a KvData frame that carries a chunk
    is read head first and its data straight from the socket to where the receiver wants it (`read_message`'s
    `chunk_memory`: on a CPU cache the reserved blocks), with `recvmsg_into` over many blocks at a time:
    each byte is copied once, by the kernel. It reads a few KiB ahead for the frames' headers and heads only; past
    that a peer's bytes wait in the socket, and the peer's writes in turn (backpressure). One read at a time."""

    READ_AHEAD_BYTES = 4096

    def __init__(self, sock: socket.socket, max_bytes: int = MAX_FRAME_BYTES):
        sock.setblocking(False)
        self.sock, self.max_bytes = sock, max_bytes
        self._ahead = memoryview(bytearray(self.READ_AHEAD_BYTES))
        self._start = self._end = 0  # the unread bytes of the read-ahead
        self._closed = False
        self._queued = array.array("i", [0])

    @classmethod
    async def connect(cls, host: str, port: int, timeout: float | None = None,
                      max_bytes: int = MAX_FRAME_BYTES) -> "PullReader":
        sock = await asyncio.to_thread(socket.create_connection, (host, port), timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(sock, max_bytes)

    # ---- the socket ----------------------------------------------------------------------------------------
    async def _readable(self, timeout: float | None) -> None:
        """Returns once the socket has bytes (or its end, or an error) to read; TimeoutError after `timeout`."""
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        fd = self.sock.fileno()
        loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
        timer = None if timeout is None else loop.call_later(
            timeout, lambda: ready.done() or ready.set_exception(TimeoutError("the peer sent nothing in time")))
        try:
            await ready
        finally:
            loop.remove_reader(fd)
            if timer is not None:
                timer.cancel()

    async def _read(self, read: Callable[[], int], timeout: float | None) -> int:
        """`read()` (a non-blocking read from the socket, the bytes it read) once the socket has bytes; ends in
        IncompleteReadError at the peer's end and ConnectionError when the connection was lost or closed here."""
        while True:
            if self._closed:
                raise ConnectionError("the connection is closed")
            try:
                nbytes = read()
            except (BlockingIOError, InterruptedError):
                await self._readable(timeout)
                continue
            except OSError as err:
                raise ConnectionError(f"the connection was lost: {err}") from None
            if not nbytes:
                raise asyncio.IncompleteReadError(b"", None)
            return nbytes

    async def _read_into(self, memory: memoryview, timeout: float | None) -> None:
        """Fills `memory` from the read-ahead and the connection (through the read-ahead while it is small)."""
        have = self._take_ahead(memory)
        try:
            while have < len(memory):
                if len(memory) - have < len(self._ahead):  # reads ahead: the next frame's header and head come along
                    self._end += await self._read(lambda: self.sock.recv_into(self._ahead[self._end:]), timeout)
                    have += self._take_ahead(memory[have:])
                else:
                    view = memory[have:]
                    have += await self._read(lambda: self.sock.recv_into(view), timeout)
        except asyncio.IncompleteReadError:
            raise asyncio.IncompleteReadError(bytes(memory[:have]), len(memory)) from None

    def _take_ahead(self, memory: memoryview) -> int:
        have = min(len(memory), self._end - self._start)
        memory[:have] = self._ahead[self._start:self._start + have]
        self._start += have
        if self._start == self._end:
            self._start = self._end = 0
        return have

    async def _read_landing(self, landing: kv_transfer.ChunkLanding, timeout: float | None) -> None:
        """Fills a receiver's landing, its buffers many at a time (`recvmsg_into`)."""
        ahead = min(landing.nbytes - landing.filled, self._end - self._start)
        landing.write(self._ahead[self._start:self._start + ahead])
        self._start += ahead
        if self._start == self._end:
            self._start = self._end = 0
        while landing.filled < landing.nbytes:
            await self._read(lambda: landing.fill(lambda buffers: self.sock.recvmsg_into(buffers)[0],
                                                  self._queued_bytes(), _IOV_MAX), timeout)

    def _queued_bytes(self) -> int:
        """The bytes waiting in the socket now (at least 1: a read then waits, or finds the end)."""
        fcntl.ioctl(self.sock.fileno(), termios.FIONREAD, self._queued)
        return max(self._queued[0], 1)

    # ---- the reader's side ---------------------------------------------------------------------------------
    async def read_message(self, timeout: float | None = None,
                           chunk_memory: Callable[[int], kv_transfer.ChunkLanding] | None = None) \
            -> Message | kv_transfer.KvFrame | None:
        """The next message; None when the peer ended the connection between frames; TimeoutError when a read of
        it waits longer than `timeout` for bytes. With `chunk_memory` (`KvReceiver.chunk_memory`), a KvData frame
        comes as the hand-off frame it carries, decoded, a chunk's data read into `chunk_memory(its size)` (the
        chunk's data is that landing; what `chunk_memory` raises is raised before the data is read)."""
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
                head, start, nbytes = chunk
                landing = chunk_memory(nbytes)
                landing.write(memoryview(payload)[start:start + nbytes])  # the data's first bytes, read with the head
                trailer = bytearray(size - start - nbytes)
                read = max(len(payload) - start - nbytes, 0)  # the checksum's bytes read with the head, if any
                trailer[:read] = memoryview(payload)[start + nbytes:]
                await self._read_landing(landing, timeout)
                await self._read_into(memoryview(trailer)[read:], timeout)
                checksum = kv_transfer.decode_chunk_trailer(trailer)
                if checksum is None:
                    raise ProtocolError(f"a KV chunk of {nbytes} bytes ends in {bytes(trailer)!r}, not its checksum")
                return msgspec.structs.replace(head, data=landing, checksum=checksum)
            if size > len(payload):  # not a chunk: the rest of the frame after the bytes read
                read, payload = payload, bytearray(size)
                payload[:len(read)] = read
                await self._read_into(memoryview(payload)[len(read):], timeout)
        except asyncio.IncompleteReadError:
            raise ProtocolError(f"stream ended inside a frame of {size} bytes") from None
        msg = decode_payload(payload)
        return kv_transfer.decode_frame(msg.frame) if chunk_memory is not None and isinstance(msg, KvData) else msg

    async def write(self, data: bytes) -> None:
        """ConnectionError when the connection is closed or lost."""
        if self._closed:
            raise ConnectionError("the connection is closed")
        try:
            await asyncio.get_running_loop().sock_sendall(self.sock, data)
        except OSError as err:
            raise ConnectionError(f"the connection was lost: {err}") from None

    def close(self) -> None:
        """Closes the connection (what was written is sent)."""
        if not self._closed:
            self._closed = True
            self.sock.close()
