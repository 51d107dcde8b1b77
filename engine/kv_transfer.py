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
head dim]` in the cache's dtype, `KvLayout.block_bytes`): in the engine's block-major cache (`[blocks, layers, 2,
...]`) each block is one run of bytes, and blocks with consecutive ids one longer run, so that a chunk is a few large
pieces of memory however small one layer's share of a block is. A chunk is as many whole blocks as fit, or a part of
one block where a block does not fit. Each chunk carries its checksum after its data (`chunk_checksum`, folded so
that its blocks start folds: `KvLayout.fold_bytes`, and summed piece by piece: `FoldSums`) and the end a CRC-32 over
those, in order.

The frames are msgspec structs, tagged with `KV_WIRE_VERSION` as the cluster protocol's frames are with theirs, so
a transport can carry them as they are (`encode_frame` / `decode_frame`). They live here, below the cluster,
because the engine produces and checks them itself: an in-process transport needs no cluster code.

Between two CPU caches nothing but the kernel copies the bytes. A sender takes each chunk as the cache's blocks
(`KvExport.pieces`: `ChunkData`, views, each part summed just before it is sent) and a socket transport writes them
as they are (`encode_chunk_head`, then the blocks: `sendmsg`, then `chunk_trailer`); from a device's cache a chunk
crosses into pinned host memory first, its checksum summed on the device as it does, on a stream of the transfer's
own, the next chunk while this one is sent. On the receiving side a transport that reads a frame's head first
(`decode_chunk_head`) reads the chunk's data straight into the memory the receiver gives for it
(`KvReceiver.chunk_memory`, a `ChunkLanding`), then its checksum (`decode_chunk_trailer`): into a CPU cache, the
reserved blocks the bytes belong in, summed as they land; into a device's cache, the chunk's place in pinned
staging, from which it crosses into its blocks on a stream of the receiver's own as soon as it is in, and is summed
there: the decode side's CPU does not read the payload, and its engine's thread and stream do not copy it. A chunk
decoded whole (`decode_frame`, or iterated in process) is checked as it is (a device's: where it lands, at `apply`),
then written into its blocks (`write_payload_part`) or its staging.
"""
from __future__ import annotations

import bisect
import collections
import itertools
import threading
import weakref
import zlib
from typing import Callable, Iterator, Union

import msgspec
import numpy as np
import torch

from engine._C import add_fold_sums
from engine.model_config import DTYPES
from engine.sampler import TopLogprobs
from engine.sampling_params import SamplingParams
from scheduler.slo import SLO

KV_WIRE_VERSION = 6
# Each chunk costs a frame head, a checksum pass set-up (a launch and a read-back from a device) and a syscall or two
# on either side: large chunks pay it rarely, one still crosses the wire in milliseconds, and the frame limit holds
# twice this.
MAX_CHUNK_BYTES = 4 << 20
# A chunk's checksum folds its 64-bit words into columns this wide (`chunk_checksum`); little-endian on every host.
_FOLD_BYTES = 4096
# A sender folds a chunk's data into its checksum about this much at a time, just before the socket copies it: the
# copy then finds it in the CPU's cache, and each part is one syscall. A multiple of every fold width.
SEND_PART_BYTES = 1 << 20
_WORD = np.dtype("<u8")
_STAGING_KEPT_BYTES = 2 << 30  # staging buffers kept for later transfers, at most


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
        """The layout of an executor's cache `[blocks, layers, 2, block_size, kv heads, head dim]`, or None's."""
        if kv_cache is None:
            return cls(0, 0, 0, block_size, "none")
        _, layers, _, size, heads, dim = kv_cache.shape
        name = next(n for n, d in DTYPES.items() if d == kv_cache.dtype)
        return cls(layers, heads, dim, size, name)

    @property
    def block_bytes(self) -> int:
        """One block's K and V of every layer: the payload's unit, one run of bytes in a block-major cache."""
        if self.num_layers == 0:
            return 0
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * DTYPES[self.dtype].itemsize

    @property
    def fold_bytes(self) -> int:
        """The width of the folds `chunk_checksum` sums a chunk's words over: 4 KiB, or the largest power of two
        that divides a block when that is less, so that every block of a chunk of whole blocks starts a fold and the
        sums can be taken over the blocks where they lie. A block that is no whole number of words folds by 4 KiB."""
        block = self.block_bytes
        fold = min(_FOLD_BYTES, block & -block) if block else _FOLD_BYTES
        return fold if fold >= _WORD.itemsize else _FOLD_BYTES


class Handoff(_Frame, tag=_tag("kv_handoff")):
    """Everything an engine needs to continue a request but its KV: one a prefill engine ran to its first token, or
    one a decode or co-located engine let go of mid-stream to be moved (its output after the first token in the
    `later_` fields). Times are on the sending engine's clock."""
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
    num_blocks: int  # blocks holding its computed KV: the prompt's and every output token's but the newest
    first_logprob: float | None = None
    first_top_logprobs: TopLogprobs | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[TopLogprobs | None] | None = None
    later_tokens: list[int] = msgspec.field(default_factory=list)
    later_times: list[float] = msgspec.field(default_factory=list)
    later_logprobs: list[float] | None = None
    later_top_logprobs: list[TopLogprobs] | None = None
    tpot_reserve: float = 0.0  # as its request's (`engine.request.Request`); the importer's router may set another

    @property
    def output_token_ids(self) -> list[int]:
        return [self.first_token, *self.later_tokens]


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
    data: memoryview  # any bytes-like object when built; decoded, a view of the decoded buffer, not a copy
    checksum: int  # `chunk_checksum(data)`: after the data, so that a sender sums each part as it sends it


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
CHUNK_TRAILER_BYTES = 9  # `chunk_trailer`: a msgpack uint 64


def encode_chunk_head(chunk: KvChunk, nbytes: int) -> bytes:
    """The encoding of `chunk` up to its data, for data of `nbytes` bytes that follow it as they lie, and then its
    `chunk_trailer` (the chunk's own data and checksum are not looked at): for a sender that writes a chunk's data
    from where it lies and sums it as it goes (`KvExport.pieces`). Head, data and trailer joined decode as the
    chunk (`decode_frame`)."""
    head = _encoder.encode(KvChunk(chunk.request_id, chunk.index, b"", 0))
    return head[:-len(_EMPTY_BIN) - 1] + bin_header(nbytes)  # less the empty data and the checksum 0 (one byte)


def chunk_trailer(checksum: int) -> bytes:
    """What follows a chunk's data after `encode_chunk_head`: its checksum, as a msgpack uint 64 of fixed width,
    so that the frame's length is known before the checksum is."""
    return b"\xcf" + checksum.to_bytes(8, "big")


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
    """The inverse of `encode_chunk_head`, for a transport that reads a chunk's data where it wants it: when
    `buffer` begins with an encoded KvChunk whose head (up to its data) it holds whole, (the chunk with its data
    empty and its checksum 0, where its data starts, the data's size: its checksum follows, `decode_chunk_trailer`);
    else None (another frame, a head cut short, bytes that are no frame: `decode_frame` of the whole frame says
    which)."""
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
        marker = view[pos]  # the index
        pos += 1 if marker < 0x80 else 1 + _UINT_BYTES[marker]
    except (IndexError, KeyError):
        return None
    data = decode_bin_header(view[pos:])
    if data is None:
        return None
    try:  # the head with empty data and a checksum is a whole frame: the decoder checks every field as for any other
        chunk = _decoder.decode(bytes(view[:pos]) + _EMPTY_BIN + b"\x00")
    except msgspec.DecodeError:
        return None
    return chunk, pos + data[1], data[0]


def decode_chunk_trailer(buffer: bytes | memoryview) -> int | None:
    """The checksum that follows a chunk's data (`chunk_trailer`, or msgpack's narrowest uint where the whole frame
    was encoded at once), when `buffer` is exactly one uint; else None."""
    view = memoryview(buffer).cast("B")
    if len(view) == 1 and view[0] < 0x80:
        return view[0]
    if not view or _UINT_BYTES.get(view[0]) != len(view) - 1:
        return None
    return int.from_bytes(view[1:], "big")


def decode_frame(payload: bytes | memoryview) -> KvFrame:
    """The frame `payload` encodes; KvTransferError when it is none of this version's. A chunk's data is a view of
    `payload`: a transport that reuses its read buffer hands the chunk to `KvReceiver.receive` before it does."""
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise KvTransferError(f"not a KV hand-off frame of version {KV_WIRE_VERSION}: {e}") from None


def chunk_checksum(data: bytes | bytearray | memoryview | np.ndarray, fold_bytes: int) -> int:
    """The checksum of a chunk's bytes, folded by `fold_bytes` (the layout's `KvLayout.fold_bytes`, a multiple of
    8): the CRC-32 of its 64-bit words summed (mod 2**64) column by column over folds of that many bytes, then of
    the bytes after the last whole fold, then of the length. A byte that changes changes its column's sum, which the
    CRC-32 over the sums then catches (but for a chance of about one in 2**32, as any CRC-32 of a long message); a
    truncated or lengthened chunk changes the length. What it gives up against a CRC-32 of every byte is the order
    of the folds: two whole folds swapped inside one chunk go unseen, a fault that a transport of in-order writes
    does not make. The sums run at the speed of the CPU's cache (`engine._C.add_fold_sums`: a few rows to one pass
    over the sums, not numpy's row by row), several times as fast as zlib's CRC-32 of every byte, and over a chunk
    of whole rows they are taken where the rows lie (`rows_checksum`)."""
    if fold_bytes < _WORD.itemsize or fold_bytes % _WORD.itemsize:
        raise ValueError(f"fold_bytes must be a positive multiple of {_WORD.itemsize}, got {fold_bytes}")
    raw = np.frombuffer(data, dtype=np.uint8)
    body = len(raw) - len(raw) % fold_bytes
    sums = FoldSums(fold_bytes)
    if body:
        sums.add(raw[:body])
    return sums.checksum(raw[body:])


def _checksum_of(sums, tail, size: int) -> int:
    """`chunk_checksum` of `size` bytes from their folds' column sums (host words; None: no whole fold) and the
    bytes after the last whole fold: the CRC-32 of the sums, then of the tail, then of the length."""
    crc = zlib.crc32(sums) if sums is not None else 0
    return zlib.crc32(size.to_bytes(8, "big"), zlib.crc32(tail, crc))


class FoldSums:
    """`chunk_checksum` taken piece by piece: the folds' column sums of buffers that follow one another in the
    chunk, each a whole number of folds, added as they come (a sender's parts before it sends them, a receiver's
    bytes as they land), each while the CPU's cache holds it for the copy just before or after."""

    def __init__(self, fold_bytes: int):
        self.sums = np.zeros(fold_bytes // _WORD.itemsize, dtype=_WORD)
        self.size = 0

    def add(self, buffer: memoryview | np.ndarray) -> None:
        """ValueError for a buffer that is no whole number of folds."""
        add_fold_sums(buffer, self.sums)
        self.size += buffer.nbytes

    def checksum(self, tail: np.ndarray | bytes = b"") -> int:
        """`chunk_checksum` of the bytes added so far, then of `tail` (fewer bytes than a fold)."""
        return _checksum_of(self.sums if self.size else None, tail, self.size + len(tail))


def rows_checksum(rows: list[np.ndarray] | list[torch.Tensor], fold_bytes: int) -> int:
    """`chunk_checksum` of the bytes of `rows` one after another, each a 2-D byte array whose rows are each one run
    of bytes (equally spaced blocks of a cache, a view of them): when every row is whole folds, the folds' sums are
    taken where the rows lie, a row at a time (`FoldSums`), not a copy; else over a joined copy. Tensors (a
    device's cache) are summed where they lie, on their device (`_tensor_rows_checksum`)."""
    if rows and isinstance(rows[0], torch.Tensor):
        return _tensor_rows_checksum(rows, fold_bytes)
    if len(rows) == 1 and rows[0].flags.c_contiguous:
        return chunk_checksum(rows[0], fold_bytes)
    if any(part.shape[1] % fold_bytes for part in rows):
        return chunk_checksum(np.concatenate([part.reshape(-1) for part in rows]), fold_bytes)
    sums = FoldSums(fold_bytes)
    for part in rows:
        for row in part:
            sums.add(row)
    return sums.checksum()


def _tensor_rows_checksum(rows: list[torch.Tensor], fold_bytes: int) -> int:
    """`rows_checksum` of byte tensors, the folds' sums taken on their device: only the sums, and the bytes after
    the last whole fold, cross to the host. A device's KV then never passes through the sender's CPU but for the
    kernel's copy into the socket. The words are summed as int64, whose two's-complement sums wrap as uint64's do."""
    words, word = fold_bytes // _WORD.itemsize, _WORD.itemsize
    size = sum(part.numel() for part in rows)
    if any(part.shape[1] % fold_bytes or part.storage_offset() % word or part.stride(0) % word for part in rows):
        data = torch.cat([part.reshape(-1) for part in rows]) if len(rows) > 1 else rows[0].reshape(-1)
        if data.storage_offset() % word or not data.is_contiguous():
            data = data.clone()  # words start where the bytes do
        body = size - size % fold_bytes
        sums = data[:body].view(torch.int64).view(-1, words).sum(dim=0) if body else None
        tail = data[body:].cpu().numpy()
    else:
        sums = sum(part.view(torch.int64).reshape(len(part), -1, words).sum(dim=(0, 1)) for part in rows)
        tail = b""
    return _checksum_of(sums.cpu().numpy().view(_WORD) if sums is not None else None, tail, size)


def _chain(crc: int, checksum: int) -> int:
    """The end checksum so far, `crc`, followed by one more chunk's. A CRC of the chunks' checksums rather than of
    the payload again: each byte is checksummed once on either side."""
    return zlib.crc32(checksum.to_bytes(4, "big"), crc)


def read_blocks(kv_cache: torch.Tensor, block_ids: list[int], out: np.ndarray | None = None) -> np.ndarray:
    """The blocks' KV as one host byte array, block after block (the payload's order): the leading bytes of `out`
    (a byte array of at least their size) when given, else a new array. On the CPU through numpy, whose indexed
    copies of byte rows are many times faster than torch's."""
    raw = kv_cache.view(torch.uint8)
    shape = (len(block_ids), *raw.shape[1:])
    size = int(np.prod(shape))
    if out is None:
        out = np.empty(size, dtype=np.uint8)
    elif out.dtype != np.uint8 or out.ndim != 1 or len(out) < size:
        raise ValueError(f"out must be a flat byte array of at least {size} bytes, got {out.dtype} {out.shape}")
    blocks = out[:size].reshape(shape)
    if raw.device.type == "cpu":
        np.take(raw.numpy(), block_ids, axis=0, out=blocks)
    else:
        torch.from_numpy(blocks).copy_(raw[torch.tensor(block_ids, device=raw.device)])
    return out[:size]


def write_blocks(kv_cache: torch.Tensor, block_ids: list[int], payload: torch.Tensor) -> None:
    """The inverse of `read_blocks`: host bytes into the cache's blocks, in one indexed copy. On a device the
    payload crosses whole first (one DMA when it is pinned), a blocking copy: the payload may be reused once this
    returns. On the CPU through numpy: torch's indexed copy of byte rows is many times slower."""
    raw = kv_cache.view(torch.uint8)
    blocks = payload.reshape(len(block_ids), *raw.shape[1:])
    if raw.device.type == "cpu":
        raw.numpy()[block_ids] = blocks.numpy()
        return
    raw.index_copy_(0, torch.tensor(block_ids, device=raw.device), blocks.to(raw.device))


def _block_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """A contiguous cache's bytes as `[blocks, block bytes]`: a view whose rows are the payload's units."""
    return kv_cache.view(torch.uint8).view(kv_cache.shape[0], -1)


def write_payload_part(kv_cache: torch.Tensor, block_ids: list[int], offset: int, data: np.ndarray) -> None:
    """Bytes `offset ..` of the payload of `block_ids` (`read_blocks`' order) into their places in a contiguous CPU
    cache, the rest of the blocks untouched: a chunk written as it comes, one indexed copy of its whole blocks and a
    copy each of the parts of blocks at its ends."""
    if not kv_cache.is_contiguous():
        raise ValueError("write_payload_part writes into a contiguous cache only")
    blocks = _block_rows(kv_cache).numpy()
    unit, ids = blocks.shape[1], np.asarray(block_ids)
    start, end = offset, offset + len(data)
    first, last = -(-start // unit), end // unit  # the whole blocks: first .. last - 1
    if first > last:  # inside one block
        blocks[ids[last], start - last * unit:end - last * unit] = data
        return
    if start < first * unit:
        blocks[ids[first - 1], start - (first - 1) * unit:] = data[:first * unit - start]
    if first < last:
        blocks[ids[first:last]] = data[first * unit - start:last * unit - start].reshape(-1, unit)
    if last * unit < end:
        blocks[ids[last], :end - last * unit] = data[last * unit - start:]


def stream_blocks(request_id: str, kv_cache: torch.Tensor | None, layout: KvLayout, block_ids: list[int],
                  first_block: int, max_chunk_bytes: int = MAX_CHUNK_BYTES) -> "KvExport":
    """The frames of blocks `block_ids[first_block:]` (`KvExport`), read from the cache as they are consumed (a
    consumer that stops early leaves the rest unread). A chunk holds as many whole blocks (`KvLayout.block_bytes`)
    as fit in `max_chunk_bytes`, or a part of one block where a block does not fit. ValueError for a bad chunk size
    or first block, or a cache that is not contiguous (every executor's is)."""
    if max_chunk_bytes < 1:
        raise ValueError(f"max_chunk_bytes must be positive, got {max_chunk_bytes}")
    if not 0 <= first_block <= len(block_ids):
        raise ValueError(f"first_block must lie in [0, {len(block_ids)}], got {first_block}")
    if layout.block_bytes and not kv_cache.is_contiguous():
        raise ValueError("stream_blocks reads a contiguous cache only")
    return KvExport(_pieces(request_id, kv_cache, layout, block_ids, first_block, max_chunk_bytes))


class KvExport:
    """One transfer's frames, produced as they are consumed, in either of two forms (one per transfer). Iterated:
    the frames, each chunk's data bytes of its own (an in-process transport). `pieces()`: each frame with its
    chunk's data as `ChunkData`, for a transport that writes it from where it lies with no copy but the kernel's
    (`cluster.protocol.send_kv_frames`)."""

    def __init__(self, pieces: Iterator[tuple[KvBegin | KvChunk | KvEnd, "ChunkData | None"]]):
        self._pieces = pieces

    def __iter__(self) -> "KvExport":
        return self

    def __next__(self) -> KvBegin | KvChunk | KvEnd:
        frame, data = next(self._pieces)
        if data is None:
            return frame
        joined = memoryview(b"".join(buffer for part in data.parts() for buffer in part))
        return KvChunk(frame.request_id, frame.index, joined, data.checksum)

    def pieces(self) -> Iterator[tuple[KvBegin | KvChunk | KvEnd, "ChunkData | None"]]:
        """(frame, data): a chunk with its data and checksum empty, and its `data` the `ChunkData` that gives both
        (its parts must all be taken before the next piece is asked for: the end's checksum chains theirs); the
        other frames with None. A transport writes a chunk's head (`encode_chunk_head`), its parts as they come,
        then its checksum (`chunk_trailer`)."""
        return self._pieces


class ChunkData:
    """A chunk's data as a sender writes it: its buffers, in parts (`parts()`), and once they were all taken its
    checksum. On the CPU the buffers are the cache's blocks (a view per run of consecutive blocks), and each part is
    folded into the checksum just before it is handed over: the copy into the socket then finds it in the CPU's
    cache, and the first bytes go out before the last are read. From a device's cache one pinned buffer, summed on
    the device before its copy out (`checksum` given)."""

    __slots__ = ("buffers", "nbytes", "_fold_bytes", "_checksum")

    def __init__(self, buffers: list[memoryview], fold_bytes: int, checksum: int | None = None):
        self.buffers = buffers
        self.nbytes = sum(buffer.nbytes for buffer in buffers)
        self._fold_bytes, self._checksum = fold_bytes, checksum

    def parts(self) -> Iterator[list[memoryview]]:
        """The data in order, as lists of buffers of about `SEND_PART_BYTES` in all (a buffer longer than that is
        cut), each for one write."""
        sums = FoldSums(self._fold_bytes) if self._checksum is None else None
        part, size = [], 0
        for buffer in self.buffers:
            for at in range(0, buffer.nbytes, SEND_PART_BYTES):
                piece = buffer[at:at + SEND_PART_BYTES]
                if sums is not None:
                    sums.add(piece)
                part.append(piece)
                size += piece.nbytes
                if size >= SEND_PART_BYTES:
                    yield part
                    part, size = [], 0
        if part:
            yield part
        if sums is not None:
            self._checksum = sums.checksum()

    @property
    def checksum(self) -> int:
        """RuntimeError before every part was taken."""
        if self._checksum is None:
            raise RuntimeError("a chunk's checksum is known once all its parts were taken")
        return self._checksum


def _chunk_spans(total: int, unit: int, max_chunk_bytes: int) -> tuple[int, Iterator[tuple[int, int]]]:
    """How many chunks a payload of `total` bytes in blocks of `unit` bytes makes, and each chunk's (start, end)."""
    if not total:
        return 0, iter(())
    if unit <= max_chunk_bytes:
        step = max_chunk_bytes // unit * unit
        return -(-total // step), ((start, min(start + step, total)) for start in range(0, total, step))
    parts = -(-unit // max_chunk_bytes)
    return total // unit * parts, ((start + at, min(start + at + max_chunk_bytes, start + unit))
                                   for start in range(0, total, unit) for at in range(0, unit, max_chunk_bytes))


def _block_spans(unit: int, block_ids: list[int], start: int, end: int) -> list[tuple[int, int]]:
    """Where payload bytes `start .. end` lie in a block-major cache of blocks of `unit` bytes, as (offset, size)
    in its bytes: the part of a block the span starts in, then its whole blocks, one span per run of consecutive
    ids, then the part of a block it ends in."""
    first, last = -(-start // unit), end // unit  # the whole blocks: first .. last - 1
    if first > last:  # inside one block
        return [(block_ids[last] * unit + start - last * unit, end - start)]
    spans = [(block_ids[first - 1] * unit + start - (first - 1) * unit, first * unit - start)] \
        if start < first * unit else []
    while first < last:
        run = 1
        while first + run < last and block_ids[first + run] == block_ids[first] + run:
            run += 1
        spans.append((block_ids[first] * unit, run * unit))
        first += run
    if last * unit < end:
        spans.append((block_ids[last] * unit, end - last * unit))
    return spans


def _cache_bytes(kv_cache: torch.Tensor) -> torch.Tensor:
    """A contiguous cache's bytes, flat."""
    return kv_cache.view(torch.uint8).reshape(-1)


def _pieces(request_id: str, kv_cache: torch.Tensor | None, layout: KvLayout, block_ids: list[int],
            first_block: int, max_chunk_bytes: int) -> Iterator[tuple[KvBegin | KvChunk | KvEnd, ChunkData | None]]:
    wanted = block_ids[first_block:] if layout.block_bytes else []
    unit, fold = layout.block_bytes, layout.fold_bytes
    total = len(wanted) * unit
    num_chunks, spans = _chunk_spans(total, unit, max_chunk_bytes)
    yield KvBegin(request_id, layout, first_block, len(block_ids), total, num_chunks), None
    if not num_chunks:
        yield KvEnd(request_id, 0, 0), None
        return
    flat = _cache_bytes(kv_cache)
    if flat.device.type != "cpu":
        yield from _device_pieces(request_id, flat, unit, fold, wanted, list(spans), total, max_chunk_bytes)
        return
    host, crc = memoryview(flat.numpy()), 0
    for index, (start, end) in enumerate(spans):
        buffers = [host[offset:offset + size] for offset, size in _block_spans(unit, wanted, start, end)]
        # a layout whose blocks are no whole folds (none of a real model's) is summed at once, copied
        checksum = rows_checksum([np.frombuffer(b, dtype=np.uint8)[None] for b in buffers], fold) \
            if any(buffer.nbytes % fold for buffer in buffers) else None
        data = ChunkData(buffers, fold, checksum)
        yield KvChunk(request_id, index, b"", 0), data
        crc = _chain(crc, data.checksum)
    yield KvEnd(request_id, num_chunks, crc), None


def _device_pieces(request_id: str, flat: torch.Tensor, unit: int, fold: int, wanted: list[int],
                   spans: list[tuple[int, int]], total: int, max_chunk_bytes: int) \
        -> Iterator[tuple[KvChunk | KvEnd, ChunkData | None]]:
    """`_pieces`' chunks from a device's cache (`flat`, its bytes): each is summed on the device and copied into
    pinned host memory (one DMA per run of blocks) on a stream of the transfer's own, so that neither holds up the
    engine's work on its stream, and the next chunk crosses while this one is sent (two buffers in turn)."""
    copier = torch.cuda.Stream(flat.device)
    copier.wait_stream(torch.cuda.current_stream(flat.device))  # the blocks as the engine's queued work leaves them
    staging = [_staging.take(min(total, max_chunk_bytes)) for _ in range(min(2, len(spans)))]

    def stage(index: int) -> _StagedChunk:
        start, end = spans[index]
        parts = [flat[offset:offset + size] for offset, size in _block_spans(unit, wanted, start, end)]
        return _StagedChunk(parts, staging[index % 2], fold, copier)

    crc = 0
    try:
        ahead = stage(0)
        for index in range(len(spans)):
            staged, ahead = ahead, stage(index + 1) if index + 1 < len(spans) else None
            data = staged.data()
            yield KvChunk(request_id, index, b"", 0), data
            crc = _chain(crc, data.checksum)
    finally:
        copier.synchronize()  # no copy still writes into a buffer given back
        _staging.give_all(staging)
    yield KvEnd(request_id, len(spans), crc), None


def _device_fold_sums(parts: list[torch.Tensor], fold_bytes: int) -> torch.Tensor | None:
    """The folds' column sums of 1-D byte tensors on a device, one after another (as int64, whose two's-complement
    sums wrap as uint64's do), read back into pinned host memory without waiting: valid once the current stream's
    work up to here is done. None where a part is no whole number of folds or does not start on a word."""
    words, word = fold_bytes // _WORD.itemsize, _WORD.itemsize
    if not all(part.numel() % fold_bytes == 0 and part.storage_offset() % word == 0 for part in parts):
        return None
    sums = sum(part.view(torch.int64).view(-1, words).sum(dim=0) for part in parts)
    host = torch.empty(words, dtype=torch.int64, pin_memory=True)
    host.copy_(sums, non_blocking=True)
    return host


class _StagedChunk:
    """A chunk on its way from a device's cache into a pinned host buffer, queued on `copier`: its folds' sums
    taken on the device and read back with it (where its parts are whole folds; else summed before, waiting)."""

    def __init__(self, parts: list[torch.Tensor], buffer: torch.Tensor, fold_bytes: int, copier):
        self.size = sum(part.numel() for part in parts)
        self.host, self.fold_bytes = buffer[:self.size], fold_bytes
        with torch.cuda.stream(copier):
            self.sums = _device_fold_sums(parts, fold_bytes)
            self.checksum = rows_checksum([part[None] for part in parts], fold_bytes) if self.sums is None else None
            at = 0
            for part in parts:
                self.host[at:at + part.numel()].copy_(part, non_blocking=True)
                at += part.numel()
            self.copied = torch.cuda.Event()
            self.copied.record(copier)

    def data(self) -> ChunkData:
        """The chunk in host memory, with its checksum, once its copy is done (waits for it)."""
        self.copied.synchronize()
        checksum = self.checksum
        if checksum is None:
            checksum = _checksum_of(self.sums.numpy().view(_WORD), b"", self.size)
        return ChunkData([memoryview(self.host.numpy())], self.fold_bytes, checksum)


class _Crossing:
    """A chunk on its way from host staging (`host`, pinned) into its reserved blocks on a device (`parts`, views
    of the cache's bytes), queued on `copier`, its folds' sums then taken there from the blocks and read back with
    it (where its runs are whole folds; else summed on the host, from staging): what landed is what is checked."""

    def __init__(self, index: int, host: torch.Tensor, parts: list[torch.Tensor], fold_bytes: int, checksum: int,
                 copier):
        self.index, self.expected, self.size = index, checksum, host.numel()
        with torch.cuda.stream(copier):
            at = 0
            for part in parts:
                part.copy_(host[at:at + part.numel()], non_blocking=True)
                at += part.numel()
            self.sums = _device_fold_sums(parts, fold_bytes)
            self.done = torch.cuda.Event()
            self.done.record(copier)
        self.got = chunk_checksum(host.numpy(), fold_bytes) if self.sums is None else None

    def checksum(self) -> int:
        """The checksum of what landed in the blocks, once it has (waits for it)."""
        self.done.synchronize()
        return self.got if self.got is not None else _checksum_of(self.sums.numpy().view(_WORD), b"", self.size)


def _give_back(copier, buffers: list[torch.Tensor]) -> None:
    """A receiver's host buffers back to the pool, once no copy queued on its stream reads them any more."""
    if copier is not None:
        copier.synchronize()
    _staging.give_all(buffers)


class _BufferPool:
    """Host buffers kept for the next transfers once done with: the first write to fresh memory pays its page
    faults, which made staging several times slower than the copy itself, and every request's KV (from or to a
    device) goes through them. The smallest kept buffer that fits is taken; past `max_bytes` kept, the
    smallest go."""

    def __init__(self, max_bytes: int, pin: bool = False):
        self.max_bytes = max_bytes
        self.pin = pin  # page-locked buffers where CUDA is, for copies to the device in one DMA
        self._free: list[torch.Tensor] = []
        # given back and not yet sorted in: a receiver's finalizer gives its buffers back wherever the collector
        # runs, on a thread that may be inside `take` already, so `give` never waits for the lock
        self._returned: collections.deque[torch.Tensor] = collections.deque()
        self._lock = threading.Lock()  # receivers are made and dropped on engine and transport threads alike

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least `nbytes`, kept or new."""
        with self._lock:
            self._sort_in()
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin and torch.cuda.is_available())

    def give_all(self, buffers: list[torch.Tensor]) -> None:
        for buffer in buffers:
            self.give(buffer)
        buffers.clear()

    def give(self, buffer: torch.Tensor) -> None:
        """Kept for the next `take`; sorted in now unless the lock is held (then by the next `take` or `give`)."""
        self._returned.append(buffer)
        if self._lock.acquire(blocking=False):
            try:
                self._sort_in()
            finally:
                self._lock.release()

    def _sort_in(self) -> None:
        if not self._returned:
            return  # `_free` is sorted and within `max_bytes` already
        while self._returned:
            self._free.append(self._returned.popleft())
        self._free.sort(key=torch.Tensor.numel, reverse=True)
        kept = sum(b.numel() for b in self._free)
        while kept > self.max_bytes:
            kept -= self._free.pop().numel()


_staging = _BufferPool(_STAGING_KEPT_BYTES, pin=True)


class ChunkLanding:
    """The memory a chunk's bytes go to, as a receiver gives it out (`KvReceiver.chunk_memory`): `buffers` in order,
    which a transport fills (`fill`, `write`) and then `receive`s as the chunk's data. Into a CPU cache they are the
    reserved blocks the bytes belong in, so that nothing copies them again; else one buffer of staging.
    Each fill goes in under the receiver's lock and none after `KvReceiver.cancel`: the blocks may be given back as
    soon as it returns. With `fold_bytes` (a receiver that checks the chunk on the host) the bytes are summed for
    its checksum as they land (`checksum`), while the CPU's cache still holds them."""

    def __init__(self, buffers: list[memoryview], receiver: "KvReceiver", fold_bytes: int | None = None):
        self.buffers, self.receiver = buffers, receiver
        self._ends = list(itertools.accumulate(b.nbytes for b in buffers))  # each buffer's end in the chunk
        self.nbytes = self._ends[-1] if buffers else 0
        self.filled = 0
        self._fold_bytes = fold_bytes
        # summed as they land where every buffer is whole folds (a real model's blocks are); else at `checksum`
        self._sums = FoldSums(fold_bytes) if fold_bytes and all(b.nbytes % fold_bytes == 0 for b in buffers) \
            else None

    def __len__(self) -> int:
        return self.nbytes

    def fill(self, read: Callable[[list[memoryview]], int], max_bytes: int | None = None,
             max_buffers: int | None = None) -> int:
        """Calls `read(buffers)` with the unfilled part, in order (a transport's read into them, `recvmsg_into`),
        which returns how many bytes it put there; returns that. With `max_bytes` and `max_buffers`, only the
        buffers that the first `max_bytes` unfilled bytes fall in, at most `max_buffers` of them (at least one): a
        read of what the socket holds does not pay for hundreds of buffers it leaves empty. KvTransferError once the
        receiver was cancelled."""
        with self.receiver._writing:
            if self.receiver._cancelled:
                raise KvTransferError(f"request {self.receiver.request_id!r}: the import was cancelled")
            at = bisect.bisect_right(self._ends, self.filled)  # the first buffer not full
            stop = len(self.buffers)
            if max_bytes is not None:
                stop = bisect.bisect_left(self._ends, self.filled + max_bytes, at, stop) + 1
            if max_buffers is not None:
                stop = min(stop, at + max(max_buffers, 1))
            rest = self.buffers[at:stop]
            if rest:
                rest[0] = rest[0][self.filled - (self._ends[at] - rest[0].nbytes):]
            nbytes = read(rest)
            self.filled += nbytes
            if self._sums is not None:
                self._sum_landed()
        return nbytes

    def _sum_landed(self) -> None:
        """Folds the whole folds landed since the last call into the sums."""
        fold, summed = self._fold_bytes, self._sums.size
        end = self.filled - self.filled % fold
        while summed < end:
            at = bisect.bisect_right(self._ends, summed)
            begins = self._ends[at] - self.buffers[at].nbytes
            part = self.buffers[at][summed - begins:min(self._ends[at], end) - begins]
            self._sums.add(part)
            summed += part.nbytes

    def checksum(self) -> int:
        """`chunk_checksum` of the bytes of a filled landing (given `fold_bytes`)."""
        if self._sums is None:
            return chunk_checksum(b"".join(self.buffers), self._fold_bytes)
        return self._sums.checksum()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Copies `data` into the unfilled part, from its start; ValueError when it does not fit."""
        data = memoryview(data).cast("B")
        if data.nbytes > self.nbytes - self.filled:
            raise ValueError(f"{data.nbytes} bytes do not fit in the {self.nbytes - self.filled} unfilled")

        def copy(buffers: list[memoryview]) -> int:
            at = 0
            for buffer in buffers:
                if at == data.nbytes:
                    break
                count = min(buffer.nbytes, data.nbytes - at)
                buffer[:count] = data[at:at + count]
                at += count
            return at

        self.fill(copy)


class KvReceiver:
    """One incoming transfer into a decode engine's reserved blocks. `receive` takes the frames in order and checks
    them as they come. Into a cache on the CPU (`kv_cache`, `in_place`) each chunk lands in its reserved
    blocks, is checked there and counts once its checksum holds: until `Engine.finish_import` marks them computed
    nothing reads those blocks, and a transfer that fails gives them back as they are (a failed chunk's bytes in
    them too), with no prefix-cache entry naming them. Into a device's cache (`checked_on_device`) each chunk lands in
    pinned host staging (`payload`) and, once in, crosses into its reserved blocks on a stream of the receiver's own
    (a DMA per run of blocks), where it is summed: `apply` waits for the last and compares, so the engine's thread
    and stream do no copy of it, and a chunk that fails leaves the blocks as the failed CPU transfer does. With no
    cache (or one not contiguous) the payload waits in staging until `apply` puts it there in one copy, each chunk
    checked as it comes. It touches no engine
    state, so a transport may feed it off the engine's thread; `cancel`, from any thread, ends its writes into the
    cache before the blocks are given back. Its host buffers go back to a pool for later transfers when the receiver
    is dropped: `payload` is valid as long as the receiver is referenced. A transport that reads a chunk's head
    before its data reads the data into `chunk_memory(size)` and then `receive`s the chunk with that landing as its
    data: the bytes are then copied once, from the socket to where they belong, and checked where they lie."""

    def __init__(self, handoff: Handoff, seq_id: int, block_ids: list[int], first_block: int,
                 kv_cache: torch.Tensor | None = None):
        self.handoff, self.seq_id = handoff, seq_id
        self.block_ids = block_ids  # the reserved blocks of the prompt, the cached leading ones included
        self.first_block = first_block  # the first block to pull: those before it are prefix-cache hits here
        self._pulled = block_ids[first_block:handoff.num_blocks]  # the blocks the payload goes to, in its order
        self.kv_cache = kv_cache
        layout = handoff.layout
        self.total_bytes = (handoff.num_blocks - first_block) * layout.block_bytes
        self.in_place = bool(self.total_bytes) and kv_cache is not None and kv_cache.device.type == "cpu" \
            and kv_cache.is_contiguous()  # as every executor's is
        self.payload: torch.Tensor | None = None  # staged (not in place): the bytes received, in payload order
        # a device's cache: each chunk crosses into its blocks as it comes and is checked there (`_Crossing`)
        self.checked_on_device = bool(self.total_bytes) and kv_cache is not None and kv_cache.device.type != "cpu" \
            and kv_cache.is_contiguous()
        self._crossings: list[_Crossing] = []
        self._copier = None
        if self.checked_on_device:
            self._device_bytes = _cache_bytes(kv_cache)
            self._copier = torch.cuda.Stream(kv_cache.device)
            # after what the engine's stream queued with those blocks (it reads no reserved block meanwhile)
            self._copier.wait_stream(torch.cuda.current_stream(kv_cache.device))
        self._buffers: list[torch.Tensor] = []  # host buffers taken from `_staging`, given back when it goes
        weakref.finalize(self, _give_back, self._copier, self._buffers).atexit = False
        if self.in_place:  # the cache's bytes, flat: a view
            self._cache_bytes = memoryview(_cache_bytes(kv_cache).numpy())
        elif self.total_bytes:
            self._buffers.append(_staging.take(self.total_bytes))
            self.payload = self._buffers[-1][:self.total_bytes]
        else:
            self.payload = torch.empty(0, dtype=torch.uint8)
        self._begun = self.complete = self._cancelled = False
        self._writing = threading.Lock()  # a write into the cache against `cancel`
        self._received = self._num_chunks = self._next_index = self._crc = 0
        self._landing: ChunkLanding | None = None  # the last `chunk_memory`, until the next chunk is received

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

    def chunk_memory(self, nbytes: int) -> ChunkLanding:
        """Where the next chunk's `nbytes` bytes go, for a transport to read them into; it then `receive`s the chunk
        with this landing (the object returned) as its data, which is checked where it lies, not copied. Bytes that
        fail the chunk's checks, or are never received, count for nothing. KvTransferError when no chunk is due or
        they would run past the payload KvBegin announced."""
        if self.complete or not self._begun:
            raise KvTransferError(f"request {self.request_id!r}: no chunk is due "
                                  f"({'the transfer ended' if self.complete else 'before KvBegin'})")
        end = self._received + nbytes
        if nbytes < 0 or end > self.total_bytes:
            raise KvTransferError(f"request {self.request_id!r}: a chunk of {nbytes} bytes runs past the announced "
                                  f"{self.total_bytes} bytes ({self._received} received)")
        if self.in_place:
            buffers = [self._cache_bytes[offset:offset + size] for offset, size in
                       _block_spans(self.handoff.layout.block_bytes, self._pulled, self._received, end)]
        else:
            buffers = [memoryview(self.payload.numpy()[self._received:end])]
        self._landing = ChunkLanding(buffers, self, None if self.checked_on_device else self.handoff.layout.fold_bytes)
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
        fold = self.handoff.layout.fold_bytes
        if landed:  # read where it belongs by the transport (`chunk_memory`): checked there
            if data.filled != data.nbytes:
                raise KvTransferError(f"request {self.request_id!r}: chunk {index} landed {data.filled} of its "
                                      f"{data.nbytes} bytes")
            if self.checked_on_device:
                self._cross(index, end, chunk.checksum)
            else:
                self._check(index, data.checksum(), chunk.checksum)
        elif self.in_place:  # checked as it came, then written into its blocks while it is still cached
            received = np.frombuffer(data, dtype=np.uint8)
            self._check(index, chunk_checksum(received, fold), chunk.checksum)
            with self._writing:
                if self._cancelled:
                    raise KvTransferError(f"request {self.request_id!r}: the import was cancelled")
                write_payload_part(self.kv_cache, self._pulled, self._received, received)
        else:  # copied into staging and checked there (a device's: at `apply`), counting only once it holds
            staged = self.payload.numpy()[self._received:end]
            staged[:] = np.frombuffer(data, dtype=np.uint8)
            self._staged(index, end, staged, chunk.checksum)
        self._received, self._crc = end, _chain(self._crc, chunk.checksum)
        self._next_index += 1

    def _staged(self, index: int, end: int, staged, checksum: int) -> None:
        """A chunk's bytes in staging, `self._received .. end`: checked now on the host, or for a device's cache
        sent on into its blocks, checked there."""
        if self.checked_on_device:
            self._cross(index, end, checksum)
        else:
            self._check(index, chunk_checksum(staged, self.handoff.layout.fold_bytes), checksum)

    def _cross(self, index: int, end: int, checksum: int) -> None:
        """Queues the staged bytes `self._received .. end` into their blocks on the device, and their sums there."""
        layout = self.handoff.layout
        with self._writing:
            if self._cancelled:
                raise KvTransferError(f"request {self.request_id!r}: the import was cancelled")
            parts = [self._device_bytes[offset:offset + size]
                     for offset, size in _block_spans(layout.block_bytes, self._pulled, self._received, end)]
            self._crossings.append(_Crossing(index, self.payload[self._received:end], parts, layout.fold_bytes,
                                             checksum, self._copier))

    def _check(self, index: int, got: int, checksum: int) -> None:
        if got != checksum:
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
        """Puts a complete transfer's bytes into the reserved blocks of `kv_cache`: in place, or on a device, they
        are there already (on a device once their copies are done: it waits for them and checks what landed);
        staged for a host's cache, they go in one indexed copy (`write_blocks`). KvTransferError, nothing marked,
        when the transfer is not complete or a chunk fails its checksum on the device."""
        if not self.complete:
            raise KvTransferError(f"request {self.request_id!r}: the KV transfer is not complete")
        if self.checked_on_device:
            for crossing in self._crossings:
                self._check(crossing.index, crossing.checksum(), crossing.expected)
        elif self.total_bytes and not self.in_place:
            if self.kv_cache is None:
                raise KvTransferError(f"request {self.request_id!r}: no KV cache to put its payload in")
            write_blocks(self.kv_cache, self._pulled, self.payload)

    def cancel(self) -> None:
        """Ends the transfer here, from any thread: once this returns no chunk is written into the cache any more,
        and any frame received after it is refused, so its blocks may be given back."""
        with self._writing:
            self._cancelled = True
        if self._copier is not None:  # what was queued lands before the blocks go back
            self._copier.synchronize()
