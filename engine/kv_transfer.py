"""Hand-off of one request from a prefill engine to a decode engine: its state and its prompt's KV blocks.

A prefill engine (`EngineConfig.role`) stops a request once it has sampled the first token and holds its blocks;
`Engine.handoff` describes it (`Handoff`: the request's state, the KV layout and how many blocks hold the prompt),
`Engine.export_kv` streams the blocks as frames, and `Engine.release_handoff` frees them once the decode side has
them. A decode engine reserves blocks for the request first (`Engine.reserve_import`, refused when they are not
free) and feeds the frames to the `KvReceiver` it got, which verifies each chunk and puts it in the reserved blocks
(a CPU cache) or stages it in host memory (a device's); the request is applied, its blocks marked computed, only
when the whole transfer is in and every checksum holds (`Engine.finish_import`). Anything else leaves the rest of
its KV cache untouched and `Engine.cancel_import` gives the reservation back, its blocks unmarked: no request, and
no prefix-cache entry, reads what part of a transfer reached them.

The decode side pulls: it names the first block it needs (the leading blocks its own prefix cache already holds
are not sent again). The stream is `KvBegin`, then `KvChunk`s of at most `max_chunk_bytes` in order, then `KvEnd`.
The payload is the blocks one after another, each block all layers' K then V (`[layers, 2, block_size, kv heads,
head dim]` in the cache's dtype), so a sender can start on the first blocks while later ones are still being read.
Each chunk carries its checksum (`chunk_checksum`) and the end a CRC-32 over those, in order.

The frames are msgspec structs, tagged with `KV_WIRE_VERSION` as the cluster protocol's frames are with theirs, so
a transport can carry them as they are (`encode_frame` / `decode_frame`). They live here, below the cluster,
because the engine produces and checks them itself: an in-process transport needs no cluster code.

The bytes are copied as little as the frames allow: a chunk's data is a view of the blocks read for it (no copy of
its own), and `encode_frame_parts` encodes a chunk without copying its data in, so that a transport writes the data
from where it lies. On the receiving side a transport that reads a frame's head first (`decode_chunk_head`) reads
the chunk's data straight into the memory the receiver gives for it (`KvReceiver.chunk_memory`), where the receiver
checks it; a chunk decoded whole (`decode_frame`: its data a view of the decoded buffer) is checked where it lies.
Into a CPU cache that memory is one chunk's buffer, kept from chunk to chunk, and a checked chunk goes into its
blocks at once, while its bytes are still in the processor's cache (`write_payload_part`): the transfer ends with
its last chunk, with no copy of the whole payload after it. Into a device's cache it is the chunk's place in a
staging payload, which goes into the blocks in one indexed copy at the end (`write_blocks`), from pinned memory (one
DMA to the device).
"""
from __future__ import annotations

import threading
import weakref
import zlib
from typing import Iterator, Union

import msgspec
import numpy as np
import torch

from engine.model_config import DTYPES
from engine.sampler import TopLogprobs
from engine.sampling_params import SamplingParams
from scheduler.slo import SLO

KV_WIRE_VERSION = 2
MAX_CHUNK_BYTES = 1 << 20
# A chunk's checksum folds its 64-bit words into columns this wide (`chunk_checksum`); little-endian on every host.
_FOLD_BYTES = 4096
_WORD = np.dtype("<u8")
_STAGING_KEPT_BYTES = 2 << 30  # staging buffers kept for later transfers, at most
_READS_KEPT_BYTES = 64 << 20  # buffers of a sender's block reads kept for later reads, at most


class KvTransferError(Exception):
    """A hand-off that cannot be applied: a frame out of order, a checksum that does not hold, a cut-short stream,
    a layout this engine cannot take. Nothing of it was applied."""


class KvImportRefused(KvTransferError):
    """The decode engine has not the free blocks for the request now: nothing was transferred; try another engine
    or later."""


def _tag(name: str) -> str:
    return f"{name}.{KV_WIRE_VERSION}"


class _Frame(msgspec.Struct, array_like=True, tag_field="type", forbid_unknown_fields=True):
    pass


class KvLayout(msgspec.Struct, array_like=True, frozen=True):
    """The shape of one KV block. An engine that runs no model (the emulated executor) has no KV: zero layers."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    @classmethod
    def of_cache(cls, kv_cache: torch.Tensor | None, block_size: int) -> "KvLayout":
        """The layout of an executor's cache `[layers, 2, blocks, block_size, kv heads, head dim]`, or None's."""
        if kv_cache is None:
            return cls(0, 0, 0, block_size, "none")
        layers, _, _, size, heads, dim = kv_cache.shape
        name = next(n for n, d in DTYPES.items() if d == kv_cache.dtype)
        return cls(layers, heads, dim, size, name)

    @property
    def block_bytes(self) -> int:
        if self.num_layers == 0:
            return 0
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * DTYPES[self.dtype].itemsize


class Handoff(_Frame, tag=_tag("kv_handoff")):
    """Everything a decode engine needs to continue a request but its KV. Times are on the prefill engine's clock."""
    request_id: str
    prompt_token_ids: list[int]
    first_token: int
    params: SamplingParams
    slo: SLO
    tier: str
    arrival: float
    first_token_time: float
    first_scheduled_time: float | None
    num_cached_tokens: int
    standing: int  # the headroom's reading of the request so far (`scheduler.headroom`)
    layout: KvLayout
    num_blocks: int  # blocks holding the prompt's KV: ceil(prompt tokens / block size)
    first_logprob: float | None = None
    first_top_logprobs: TopLogprobs | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[TopLogprobs | None] | None = None


class KvBegin(_Frame, tag=_tag("kv_begin")):
    request_id: str
    layout: KvLayout
    first_block: int  # the prompt's blocks first_block .. num_blocks - 1 follow
    num_blocks: int
    total_bytes: int
    num_chunks: int


class KvChunk(_Frame, tag=_tag("kv_chunk")):
    request_id: str
    index: int
    checksum: int  # `chunk_checksum(data)`
    data: memoryview  # any bytes-like object when built; decoded, a view of the decoded buffer, not a copy


class KvEnd(_Frame, tag=_tag("kv_end")):
    request_id: str
    num_chunks: int
    checksum: int  # CRC-32 of the chunks' checksums in order (`_chain`): with each chunk's own, it covers the payload


KvFrame = Union[Handoff, KvBegin, KvChunk, KvEnd]
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KvFrame)


def encode_frame(frame: KvFrame) -> bytes:
    return _encoder.encode(frame)


def bin_header(size: int) -> bytes:
    """The msgpack header of a bin (bytes) value of `size` bytes, in the narrowest form, as msgspec writes it."""
    if size < 1 << 8:
        return b"\xc4" + size.to_bytes(1, "big")
    if size < 1 << 16:
        return b"\xc5" + size.to_bytes(2, "big")
    return b"\xc6" + size.to_bytes(4, "big")


_EMPTY_BIN = bin_header(0)
_NO_DATA = memoryview(b"")


def encode_frame_parts(frame: KvFrame) -> tuple[bytes, memoryview]:
    """`encode_frame(frame)` as (head, data), the same bytes once joined, without copying a chunk's data into the
    encoding: the data is the chunk's last field, so the head ends with its bin header and the data follows as it
    lies (empty for the other frames). A transport writes both in turn."""
    if not isinstance(frame, KvChunk):
        return encode_frame(frame), _NO_DATA
    data = memoryview(frame.data).cast("B")
    head = _encoder.encode(KvChunk(frame.request_id, frame.index, frame.checksum, b""))
    return head[:-len(_EMPTY_BIN)] + bin_header(data.nbytes), data


# what msgpack puts after a str's or bin's marker byte: the length's bytes (a fixstr's length is in its marker)
_STR_LENGTH_BYTES = {0xd9: 1, 0xda: 2, 0xdb: 4}
_BIN_LENGTH_BYTES = {0xc4: 1, 0xc5: 2, 0xc6: 4}
_UINT_BYTES = {0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8}  # a positive fixint's value is in its marker
_CHUNK_PREFIX = b"\x95" + _encoder.encode(_tag("kv_chunk"))  # a KvChunk: an array of its tag and four fields


def decode_bin_header(buffer: bytes | memoryview) -> tuple[int, int] | None:
    """The inverse of `bin_header` at the start of `buffer`: (the bin's size, the header's length), or None when
    `buffer` does not begin with a whole bin header."""
    width = _BIN_LENGTH_BYTES.get(buffer[0]) if len(buffer) else None
    if width is None or len(buffer) < 1 + width:
        return None
    return int.from_bytes(buffer[1:1 + width], "big"), 1 + width


def decode_chunk_head(buffer: bytes | memoryview) -> tuple[KvChunk, int, int] | None:
    """The inverse of `encode_frame_parts`'s head, for a transport that reads a chunk's data where it wants it:
    when `buffer` begins with an encoded KvChunk whose head (all but the data) it holds whole, (the chunk with empty
    data, where its data starts, the data's size); else None (another frame, a head cut short, bytes that are no
    frame: `decode_frame` of the whole frame says which)."""
    view = memoryview(buffer).cast("B")
    if view[:len(_CHUNK_PREFIX)] != _CHUNK_PREFIX:
        return None
    pos = len(_CHUNK_PREFIX)
    try:
        marker = view[pos]  # the request id, a str
        if 0xa0 <= marker <= 0xbf:
            pos += 1 + (marker & 0x1f)
        else:
            width = _STR_LENGTH_BYTES[marker]
            pos += 1 + width + int.from_bytes(view[pos + 1:pos + 1 + width], "big")
        for _ in ("index", "checksum"):
            marker = view[pos]
            pos += 1 if marker < 0x80 else 1 + _UINT_BYTES[marker]
    except (IndexError, KeyError):
        return None
    data = decode_bin_header(view[pos:])
    if data is None:
        return None
    try:  # the head with its data emptied is a whole frame: the decoder checks every field as for any other
        chunk = _decoder.decode(bytes(view[:pos]) + _EMPTY_BIN)
    except msgspec.DecodeError:
        return None
    return chunk, pos + data[1], data[0]


def decode_frame(payload: bytes | memoryview) -> KvFrame:
    """The frame `payload` encodes; KvTransferError when it is none of this version's. A chunk's data is a view of
    `payload`: a transport that reuses its read buffer hands the chunk to `KvReceiver.receive` before it does."""
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise KvTransferError(f"not a KV hand-off frame of version {KV_WIRE_VERSION}: {e}") from None


def chunk_checksum(data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """The checksum of a chunk's bytes: the CRC-32 of its 64-bit words summed (mod 2**64) column by column over rows
    of 4 KiB, then of the bytes after the last whole row, then of the length. A byte that changes changes its
    column's sum, which the CRC-32 over the 4 KiB of sums then catches (but for a chance of about one in 2**32, as
    any CRC-32 of a long message); a truncated or lengthened chunk changes the length. What it gives up against a
    CRC-32 of every byte is the order of the rows: two whole rows swapped inside one chunk go unseen, a fault that
    a transport of contiguous writes does not make. The sums run at memory speed through numpy, several times as
    fast as zlib's CRC-32 of every byte, which was the transfer's main cost on a CPU."""
    raw = np.frombuffer(data, dtype=np.uint8)
    body = len(raw) - len(raw) % _FOLD_BYTES
    crc = 0
    if body:
        sums = raw[:body].view(_WORD).reshape(-1, _FOLD_BYTES // _WORD.itemsize).sum(axis=0, dtype=_WORD)
        crc = zlib.crc32(sums)
    crc = zlib.crc32(raw[body:], crc)
    return zlib.crc32(len(raw).to_bytes(8, "big"), crc)


def _chain(crc: int, checksum: int) -> int:
    """The end checksum so far, `crc`, followed by one more chunk's. A CRC of the chunks' checksums rather than of
    the payload again: each byte is checksummed once on either side."""
    return zlib.crc32(checksum.to_bytes(4, "big"), crc)


def read_blocks(kv_cache: torch.Tensor, block_ids: list[int], out: np.ndarray | None = None) -> np.ndarray:
    """The blocks' KV as one host byte array, block after block (the payload's order): the leading bytes of `out`
    (a byte array of at least their size) when given, else a new array. On the CPU through numpy, whose strided
    copies of these slices are many times faster than torch's."""
    raw = kv_cache.view(torch.uint8)
    shape = (len(block_ids), *raw[:, :, 0].shape)
    size = int(np.prod(shape))
    if out is None:
        out = np.empty(size, dtype=np.uint8)
    elif out.dtype != np.uint8 or out.ndim != 1 or len(out) < size:
        raise ValueError(f"out must be a flat byte array of at least {size} bytes, got {out.dtype} {out.shape}")
    blocks = out[:size].reshape(shape)
    if raw.device.type == "cpu":
        cache = raw.numpy()
        np.stack([cache[:, :, b] for b in block_ids], out=blocks)
    else:
        torch.from_numpy(blocks).copy_(torch.stack([raw[:, :, b] for b in block_ids]))
    return out[:size]


def write_blocks(kv_cache: torch.Tensor, block_ids: list[int], payload: torch.Tensor) -> None:
    """The inverse of `read_blocks`: host bytes into the cache's blocks, in one indexed copy. On a device the
    payload crosses whole first (one DMA when it is pinned), a blocking copy: the payload may be reused once this
    returns. On the CPU through numpy: torch's indexed copy of these byte slices is several times slower."""
    raw = kv_cache.view(torch.uint8)
    blocks = payload.reshape(len(block_ids), *raw[:, :, 0].shape)
    if raw.device.type == "cpu":
        raw.numpy()[:, :, block_ids] = blocks.numpy().transpose(1, 2, 0, *range(3, blocks.dim()))
        return
    index = torch.tensor(block_ids, device=raw.device)
    raw.index_copy_(2, index, blocks.to(raw.device).movedim(0, 2))


def write_payload_part(kv_cache: torch.Tensor, block_ids: list[int], offset: int, data: np.ndarray) -> None:
    """Bytes `offset ..` of the payload of `block_ids` (`read_blocks`' order) into their places in a contiguous CPU
    cache, the rest of the blocks untouched: a chunk written as it comes. A block's payload is its rows, one per
    (layer, K or V), each one run of bytes in the cache: a part is one indexed copy of its whole rows and a copy
    each of the parts of rows at its ends."""
    if not kv_cache.is_contiguous():
        raise ValueError("write_payload_part writes into a contiguous cache only")
    layers, _, num_blocks = kv_cache.shape[:3]
    planes = kv_cache.view(torch.uint8).numpy().reshape(layers * 2, num_blocks, -1)  # a view: contiguous
    rows_per_block, row = layers * 2, planes.shape[2]
    ids = np.asarray(block_ids)

    def row_of(index: int) -> np.ndarray:  # a payload row's bytes in the cache
        block, plane = divmod(index, rows_per_block)
        return planes[plane, ids[block]]

    start, end = offset, offset + len(data)
    first, last = -(-start // row), end // row  # the whole rows: first .. last - 1
    if first > last:  # inside one row
        row_of(last)[start - last * row:end - last * row] = data
        return
    if start < first * row:
        row_of(first - 1)[start - (first - 1) * row:] = data[:first * row - start]
    if first < last:
        blocks, plane_of = np.divmod(np.arange(first, last), rows_per_block)
        planes[plane_of, ids[blocks]] = data[first * row - start:last * row - start].reshape(-1, row)
    if last * row < end:
        row_of(last)[:end - last * row] = data[last * row - start:]


def stream_blocks(request_id: str, kv_cache: torch.Tensor | None, layout: KvLayout, block_ids: list[int],
                  first_block: int, max_chunk_bytes: int = MAX_CHUNK_BYTES) -> Iterator[KvBegin | KvChunk | KvEnd]:
    """The frames of blocks `block_ids[first_block:]`, read from the cache as the chunks need them (a consumer that
    stops early leaves the rest unread). A chunk holds whole blocks when a block fits in one, else a block's part;
    no chunk spans two reads, and a chunk's data is a view of its read: the bytes are copied once, from the cache's
    blocks into the read."""
    if max_chunk_bytes < 1:
        raise ValueError(f"max_chunk_bytes must be positive, got {max_chunk_bytes}")
    if not 0 <= first_block <= len(block_ids):
        raise ValueError(f"first_block must lie in [0, {len(block_ids)}], got {first_block}")
    return _frames(request_id, kv_cache, layout, block_ids, first_block, max_chunk_bytes)


def _frames(request_id: str, kv_cache: torch.Tensor | None, layout: KvLayout, block_ids: list[int],
            first_block: int, max_chunk_bytes: int) -> Iterator[KvBegin | KvChunk | KvEnd]:
    wanted = block_ids[first_block:] if layout.block_bytes else []
    per_read = max(1, max_chunk_bytes // max(1, layout.block_bytes))  # blocks read at once
    reads = [wanted[i:i + per_read] for i in range(0, len(wanted), per_read)]
    num_chunks = sum(-(-len(r) * layout.block_bytes // max_chunk_bytes) for r in reads)
    yield KvBegin(request_id, layout, first_block, len(block_ids), len(wanted) * layout.block_bytes, num_chunks)
    crc = index = 0
    for read in reads:
        # into a kept buffer, which goes back once the chunks' views of it are gone (sent, or copied by the
        # transport): fresh memory would pay its page faults on every read, and the read is the sender's main cost
        buffer = _read_buffers.take(len(read) * layout.block_bytes)
        blocks = read_blocks(kv_cache, read, buffer.numpy())
        weakref.finalize(blocks, _read_buffers.give, buffer).atexit = False
        view = memoryview(blocks)
        for start in range(0, len(blocks), max_chunk_bytes):
            checksum = chunk_checksum(blocks[start:start + max_chunk_bytes])
            crc = _chain(crc, checksum)
            yield KvChunk(request_id, index, checksum, view[start:start + max_chunk_bytes])
            index += 1
    yield KvEnd(request_id, index, crc)


class _BufferPool:
    """Host buffers kept for the next transfers once done with: the first write to fresh memory pays its page
    faults, which made staging (and a sender's block reads) several times slower than the copy itself, and every
    request's KV goes through them. The smallest kept buffer that fits is taken; past `max_bytes` kept, the
    smallest go."""

    def __init__(self, max_bytes: int, pin: bool = False):
        self.max_bytes = max_bytes
        self.pin = pin  # page-locked buffers where CUDA is, for copies to the device in one DMA
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()  # receivers are made and dropped on engine and transport threads alike

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least `nbytes`, kept or new."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin and torch.cuda.is_available())

    def give_all(self, buffers: list[torch.Tensor]) -> None:
        for buffer in buffers:
            self.give(buffer)
        buffers.clear()

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buffer)
            self._free.sort(key=torch.Tensor.numel, reverse=True)
            while sum(b.numel() for b in self._free) > self.max_bytes:
                self._free.pop()


_staging = _BufferPool(_STAGING_KEPT_BYTES, pin=True)
_read_buffers = _BufferPool(_READS_KEPT_BYTES)
_chunk_buffers = _BufferPool(_READS_KEPT_BYTES)  # a receiver's landing buffer, when it writes chunks in place


class KvReceiver:
    """One incoming transfer into a decode engine's reserved blocks. `receive` takes the frames in order and checks
    them as they come. Into a cache on the CPU (`kv_cache`) each chunk is written into its blocks as soon as its
    checksum holds (`in_place`): until `Engine.finish_import` marks them computed nothing reads those blocks, and a
    transfer that fails gives them back as they are, with no prefix-cache entry naming them. Into a device's cache
    (or with none) the payload waits in host staging (`payload`, pinned where CUDA is) until `apply` puts it there
    in one copy. It touches no engine state, so a transport may feed it off the engine's thread; `cancel`, from any
    thread, ends its writes into the cache before the blocks are given back. Its host buffers go back to pools for
    later transfers when the receiver is dropped: `payload` is valid as long as the receiver is referenced. A
    transport that reads a chunk's head before its data reads the data into `chunk_memory(size)` and then
    `receive`s the chunk with that memory as its data: the bytes are then copied once from the socket, and checked
    where they lie (and, in place, copied once more while they are still in the processor's cache)."""

    def __init__(self, handoff: Handoff, seq_id: int, block_ids: list[int], first_block: int,
                 kv_cache: torch.Tensor | None = None):
        self.handoff, self.seq_id = handoff, seq_id
        self.block_ids = block_ids  # the reserved blocks of the prompt, the cached leading ones included
        self.first_block = first_block  # the first block to pull: those before it are prefix-cache hits here
        self.kv_cache = kv_cache
        self.total_bytes = (handoff.num_blocks - first_block) * handoff.layout.block_bytes
        self.in_place = bool(self.total_bytes) and kv_cache is not None and kv_cache.device.type == "cpu" \
            and kv_cache.is_contiguous()  # as every executor's is
        self.payload: torch.Tensor | None = None  # staged (not in place): the bytes received, in payload order
        self._buffers: list[torch.Tensor] = []  # host buffers taken from `_pool`, given back when the receiver goes
        self._pool = _chunk_buffers if self.in_place else _staging
        weakref.finalize(self, self._pool.give_all, self._buffers).atexit = False
        if not self.in_place:
            self.payload = self._take(self.total_bytes)[:self.total_bytes]
        self._begun = self.complete = self._cancelled = False
        self._writing = threading.Lock()  # a chunk's write into the cache against `cancel`
        self._received = self._num_chunks = self._next_index = self._crc = 0
        self._landing: memoryview | None = None  # the last `chunk_memory`, until the next chunk is received

    def _take(self, nbytes: int) -> torch.Tensor:
        if not nbytes:
            return torch.empty(0, dtype=torch.uint8)
        self._buffers.append(self._pool.take(nbytes))
        return self._buffers[-1]

    @property
    def request_id(self) -> str:
        return self.handoff.request_id

    def receive(self, frame: KvBegin | KvChunk | KvEnd) -> None:
        """KvTransferError when the frame does not continue this transfer as it must."""
        if self.complete or self._cancelled:
            raise KvTransferError(f"request {self.request_id!r}: a frame after the transfer "
                                  f"{'was cancelled' if self._cancelled else 'ended'}")
        if getattr(frame, "request_id", None) != self.request_id:
            raise KvTransferError(f"request {self.request_id!r}: a frame of another request "
                                  f"({getattr(frame, 'request_id', None)!r})")
        if isinstance(frame, KvBegin):
            self._begin(frame)
        elif not self._begun:
            raise KvTransferError(f"request {self.request_id!r}: {type(frame).__name__} before KvBegin")
        elif isinstance(frame, KvChunk):
            self._chunk(frame)
        elif isinstance(frame, KvEnd):
            self._end(frame)
        else:
            raise KvTransferError(f"request {self.request_id!r}: unexpected frame {type(frame).__name__}")

    def chunk_memory(self, nbytes: int) -> memoryview:
        """The host memory the next chunk's `nbytes` bytes go to, for a transport to read them into; it then
        `receive`s the chunk with this memory (the object returned) as its data, which is checked in place, not
        copied. Bytes that fail the chunk's checks, or are never received, count for nothing. KvTransferError when
        no chunk is due or they would run past the payload KvBegin announced."""
        if self.complete or not self._begun:
            raise KvTransferError(f"request {self.request_id!r}: no chunk is due "
                                  f"({'the transfer ended' if self.complete else 'before KvBegin'})")
        end = self._received + nbytes
        if nbytes < 0 or end > self.total_bytes:
            raise KvTransferError(f"request {self.request_id!r}: a chunk of {nbytes} bytes runs past the announced "
                                  f"{self.total_bytes} bytes ({self._received} received)")
        if self.in_place:  # a buffer of one chunk, kept from chunk to chunk: the bytes stay in the processor's cache
            if not self._buffers or self._buffers[-1].numel() < nbytes:
                if self._buffers:
                    self._pool.give(self._buffers.pop())
                self._take(max(1, nbytes))
            self._landing = memoryview(self._buffers[-1].numpy()[:nbytes])
        else:
            self._landing = memoryview(self.payload.numpy()[self._received:end])
        return self._landing

    def _begin(self, begin: KvBegin) -> None:
        if self._begun:
            raise KvTransferError(f"request {self.request_id!r}: a second KvBegin")
        expected = (self.handoff.layout, self.first_block, self.handoff.num_blocks, self.total_bytes)
        got = (begin.layout, begin.first_block, begin.num_blocks, begin.total_bytes)
        if got != expected:
            raise KvTransferError(f"request {self.request_id!r}: KvBegin announces (layout, first block, blocks, "
                                  f"bytes) {got}, the reservation expects {expected}")
        self._num_chunks, self._begun = begin.num_chunks, True

    def _chunk(self, chunk: KvChunk) -> None:
        index, data = chunk.index, chunk.data
        if index != self._next_index:
            raise KvTransferError(f"request {self.request_id!r}: chunk {index} where chunk {self._next_index} "
                                  f"was due")
        end = self._received + len(data)
        if end > self.total_bytes or index >= self._num_chunks:
            raise KvTransferError(f"request {self.request_id!r}: chunk {index} runs past the announced "
                                  f"{self.total_bytes} bytes in {self._num_chunks} chunks")
        landed, self._landing = data is self._landing, None
        if self.in_place:  # checked where it lies, then written into its blocks while it is still cached
            received = np.frombuffer(data, dtype=np.uint8)
            self._check(index, received, chunk.checksum)
            with self._writing:
                if self._cancelled:
                    raise KvTransferError(f"request {self.request_id!r}: the import was cancelled")
                write_payload_part(self.kv_cache, self.block_ids[self.first_block:self.handoff.num_blocks],
                                   self._received, received)
        else:  # checked where it lands: the staging bytes count only once the checksum holds, and are still cached
            staged = self.payload.numpy()[self._received:end]
            if not landed:  # else read there by the transport: `chunk_memory`
                staged[:] = np.frombuffer(data, dtype=np.uint8)
            self._check(index, staged, chunk.checksum)
        self._received, self._crc = end, _chain(self._crc, chunk.checksum)
        self._next_index += 1

    def _check(self, index: int, data: np.ndarray, checksum: int) -> None:
        if chunk_checksum(data) != checksum:
            raise KvTransferError(f"request {self.request_id!r}: chunk {index} fails its checksum")

    def _end(self, end: KvEnd) -> None:
        if self._next_index != self._num_chunks or end.num_chunks != self._num_chunks \
                or self._received != self.total_bytes:
            raise KvTransferError(f"request {self.request_id!r}: transfer cut short: {self._next_index} of "
                                  f"{self._num_chunks} chunks, {self._received} of {self.total_bytes} bytes")
        if end.checksum != self._crc:
            raise KvTransferError(f"request {self.request_id!r}: the payload fails its checksum")
        self.complete = True

    def apply(self) -> None:
        """Puts a complete transfer's bytes into the reserved blocks of `kv_cache`: in place they are there already;
        staged, they go in one indexed copy (`write_blocks`: on a device one DMA of the pinned payload, then a
        copy on the device). KvTransferError when the transfer is not complete."""
        if not self.complete:
            raise KvTransferError(f"request {self.request_id!r}: the KV transfer is not complete")
        if self.total_bytes and not self.in_place:
            if self.kv_cache is None:
                raise KvTransferError(f"request {self.request_id!r}: no KV cache to put its payload in")
            write_blocks(self.kv_cache, self.block_ids[self.first_block:self.handoff.num_blocks], self.payload)

    def cancel(self) -> None:
        """Ends the transfer here, from any thread: once this returns no chunk is written into the cache any more,
        and any frame received after it is refused, so its blocks may be given back."""
        with self._writing:
            self._cancelled = True
