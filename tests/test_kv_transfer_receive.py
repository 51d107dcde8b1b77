"""The KV pull over a real socket (cluster/protocol.py): the sender writes each chunk from the cache's blocks
(`send_kv_frames`); the decode side (`PullReader`) reads a KvData frame's head first and its chunk's data straight to
where the receiver wants it (the reserved blocks, or staging), where it is checked; the bytes that land are the bytes
sent, however the stream is cut into reads; a corrupted chunk is refused; a stream that ends
mid-frame fails with a clear error, and a decode engine's pull that fails so gives its reservation back."""
from __future__ import annotations

import asyncio
import random
import socket
import threading
import time

import msgspec
import pytest
import torch

from cluster import protocol as p
from cluster.worker import _PeerKv
from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from engine.kv_transfer import CHUNK_TRAILER_BYTES, ChunkLanding, Handoff, KvChunk, KvLayout, KvReceiver, \
    KvTransferError, chunk_trailer, decode_frame, read_blocks, stream_blocks
from scheduler.slo import SLO

BLOCK_SIZE = 4
CACHE = torch.randn(24, 2, 2, BLOCK_SIZE, 2, 32, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
BLOCKS = [5, 0, 19, 20, 3, 11, 12, 13, 1, 9]  # 2 KiB blocks, scattered, some in runs of consecutive ids
WAIT_S = 30.0


class Spy(KvReceiver):
    """A receiver that notes, of each chunk it receives, whether its data is memory it gave out (`chunk_memory`).
    Into `kv_cache` (the chunks written into its blocks as they come) or staged (none)."""

    def __init__(self, request_id: str, kv_cache: torch.Tensor | None = None):
        layout = KvLayout.of_cache(CACHE, BLOCK_SIZE)
        handoff = Handoff(request_id, [0] * (len(BLOCKS) * BLOCK_SIZE), 0, SamplingParams(), SLO(1.0, 0.1), "t",
                          0.0, 0.0, None, 0, 0, layout, len(BLOCKS))
        super().__init__(handoff, 0, BLOCKS, 0, kv_cache)
        self.given: list[ChunkLanding] = []
        self.landed: list[bool] = []

    def chunk_memory(self, nbytes: int) -> ChunkLanding:
        self.given.append(super().chunk_memory(nbytes))
        return self.given[-1]

    def receive(self, frame) -> None:
        if isinstance(frame, KvChunk):
            self.landed.append(any(frame.data is memory for memory in self.given))
        super().receive(frame)


def written(frame) -> bytes:
    """A hand-off frame as a KvData frame, written as the sender writes it: a chunk's head, data and checksum."""
    if not isinstance(frame, KvChunk):
        return p.encode_kv_head(frame, 0)
    return p.encode_kv_head(frame, len(frame.data)) + bytes(frame.data) + chunk_trailer(frame.checksum)


def wire(request_id: str, chunk_bytes: int, flip_chunk: int | None = None) -> tuple[bytes, list[int], list[int]]:
    """The KvData frames of the blocks' transfer as one byte string, where each chunk's data starts in it and where
    each frame ends; the data of chunk `flip_chunk` with a byte flipped (its checksum left as it was)."""
    out, starts, ends = bytearray(), [], []
    layout = KvLayout.of_cache(CACHE, BLOCK_SIZE)
    for frame in stream_blocks(request_id, CACHE, layout, BLOCKS, 0, chunk_bytes):
        out += written(frame)
        if isinstance(frame, KvChunk):
            starts.append(len(out) - CHUNK_TRAILER_BYTES - len(frame.data))
        ends.append(len(out))
    if flip_chunk is not None:
        out[starts[flip_chunk] + 3] ^= 0x10
    return bytes(out), starts, ends


async def serve(data: bytes, pieces_seed: int = 0):
    """A listener that writes `data` to whoever connects, in pieces of random sizes (frames cut anywhere), then
    closes; its port."""
    async def send(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        rng, at = random.Random(pieces_seed), 0
        while at < len(data):
            size = rng.choice((1, 3, 40, 700, 5000, 20_000))
            writer.write(data[at:at + size])
            at += size
            await writer.drain()
            if rng.random() < 0.3:
                await asyncio.sleep(0)  # the reader takes what came so far
        writer.close()

    server = await asyncio.start_server(send, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def pull(receiver: KvReceiver, data: bytes, pieces_seed: int = 0) -> None:
    """`data` read by a PullReader, its frames fed to `receiver` until the transfer is complete."""
    server, port = await serve(data, pieces_seed)
    try:
        reader = await p.PullReader.connect("127.0.0.1", port)
        try:
            while not receiver.complete:
                frame = await reader.read_message(WAIT_S, receiver.chunk_memory)
                if frame is None:
                    raise ConnectionError("the peer closed the connection mid-transfer")
                receiver.receive(frame)
        finally:
            reader.close()
    finally:
        server.close()


def empty_cache() -> torch.Tensor:
    return torch.zeros_like(CACHE)


@pytest.mark.parametrize("chunk_bytes", [100, 1000, 4096])
@pytest.mark.parametrize("pieces_seed", [0, 1])
def test_each_chunk_is_read_into_its_place_in_staging(chunk_bytes, pieces_seed):
    """Chunks smaller than a head's read, not aligned to blocks, and of whole blocks: every chunk's data is read
    into the memory the receiver gave out for it, and the payload is the blocks sent."""
    receiver = Spy("r")
    data, starts, _ = wire("r", chunk_bytes)
    asyncio.run(pull(receiver, data, pieces_seed))
    assert receiver.complete and len(receiver.landed) == len(starts) > 3 and all(receiver.landed)
    assert receiver.payload.numpy().tobytes() == read_blocks(CACHE, BLOCKS).tobytes()


@pytest.mark.parametrize("chunk_bytes", [100, 1000, 4096])
def test_each_chunk_read_for_a_cpu_cache_lands_in_its_blocks_and_no_other(chunk_bytes):
    """Into a CPU cache every chunk is read into the receiver's memory, checked there and written into its blocks
    (scattered, the chunks cut across blocks): the blocks hold what was sent, the others are untouched."""
    cache = empty_cache()
    receiver = Spy("r", cache)
    data, starts, _ = wire("r", chunk_bytes)
    asyncio.run(pull(receiver, data, pieces_seed=1))
    assert receiver.in_place and receiver.payload is None
    assert receiver.complete and len(receiver.landed) == len(starts) > 3 and all(receiver.landed)
    receiver.apply()
    assert torch.equal(cache[BLOCKS], CACHE[BLOCKS])
    assert not cache[[b for b in range(cache.shape[0]) if b not in BLOCKS]].view(torch.uint8).any()


def test_a_landing_filled_in_budgeted_reads_gets_every_byte_in_order_and_each_read_only_the_buffers_it_reaches():
    """A transport reads what its socket holds (`max_bytes`), at most so many buffers at a time (`max_buffers`),
    into blocks of a cache (`chunk_memory`): each read is given the buffers from the first unfilled byte on, the
    first cut where the last read ended, up to the one that the budget's last byte falls in, and the blocks end up
    holding the chunk's bytes in order."""
    cache = empty_cache()
    receiver = Spy("r", cache)
    data, starts, ends = wire("r", 8192)
    receiver.receive(decode_frame(p.decode_payload(data[p.HEADER.size:ends[0]]).frame))
    chunk = decode_frame(p.decode_payload(data[ends[0] + p.HEADER.size:ends[1]]).frame)
    landing = receiver.chunk_memory(len(chunk.data))
    assert [b.nbytes for b in landing.buffers] == [2048, 2048, 4096]  # blocks 5, 0, then the run 19, 20
    sent, rng = bytes(chunk.data), random.Random(3)
    while landing.filled < landing.nbytes:
        max_bytes, max_buffers = rng.choice((1, 7, 100, 600, 5000)), rng.choice((1, 2, 1024))
        size = min(rng.choice((1, 50, 300, 3000)), max_bytes)  # what the socket gives may fall short of the budget

        def read(buffers: list[memoryview]) -> int:
            assert 1 <= len(buffers) <= max_buffers
            room = [b.nbytes for b in buffers]
            assert sum(room[:-1]) < max_bytes and (sum(room) >= max_bytes or len(buffers) == max_buffers
                                                     or landing.filled + sum(room) == landing.nbytes)
            at, piece = 0, sent[landing.filled:landing.filled + size]
            for buffer in buffers:
                take = min(buffer.nbytes, len(piece) - at)
                buffer[:take] = piece[at:at + take]
                at += take
            return at

        landing.fill(read, max_bytes, max_buffers)
    receiver.receive(msgspec.structs.replace(chunk, data=landing))
    assert b"".join(bytes(b) for b in landing.buffers) == sent


def test_a_chunk_whose_head_is_longer_than_the_first_read_is_decoded_whole():
    """A request id longer than a head's read: the frame is read whole and its chunk copied into staging."""
    request_id = "long-" + "x" * 600
    receiver = Spy(request_id)
    data, starts, _ = wire(request_id, 1000)
    asyncio.run(pull(receiver, data))
    assert receiver.complete and len(receiver.landed) == len(starts) and not any(receiver.landed)
    assert receiver.payload.numpy().tobytes() == read_blocks(CACHE, BLOCKS).tobytes()


def test_a_corrupted_chunk_read_into_staging_is_refused():
    receiver = Spy("r")
    data, _, _ = wire("r", 1000, flip_chunk=2)
    with pytest.raises(KvTransferError, match="chunk 2 fails its checksum"):
        asyncio.run(pull(receiver, data))
    assert not receiver.complete and receiver.landed == [True] * 3


def test_a_corrupted_chunk_for_a_cpu_cache_is_refused_and_nothing_after_it_is_written():
    """Chunks of 1000 bytes, parts of 2 KiB blocks: the chunks before it are in their block, and it (the block's
    last 48 bytes) too, where its check fails; the transfer never completes, so nothing marks those blocks
    computed; no byte after it is written."""
    cache = empty_cache()
    receiver = Spy("r", cache)
    data, _, _ = wire("r", 1000, flip_chunk=2)
    with pytest.raises(KvTransferError, match="chunk 2 fails its checksum"):
        asyncio.run(pull(receiver, data))
    assert not receiver.complete and receiver.landed == [True] * 3
    with pytest.raises(KvTransferError, match="not complete"):
        receiver.apply()
    landed, sent = read_blocks(cache, BLOCKS), read_blocks(CACHE, BLOCKS)
    assert landed[:2000].tobytes() == sent[:2000].tobytes()
    assert landed[2000:2048].tobytes() != sent[2000:2048].tobytes() and not landed[2048:].any()


@pytest.mark.parametrize("cut, error, message", [
    (lambda starts, ends: starts[2] + 500, p.ProtocolError, "stream ended inside a frame of"),  # in a chunk's data
    (lambda starts, ends: starts[2] - 10, p.ProtocolError, "stream ended inside a frame of"),  # in a chunk's head
    (lambda starts, ends: ends[1] - 3, p.ProtocolError, "stream ended inside a frame of"),  # in its checksum
    (lambda starts, ends: 2, p.ProtocolError, "inside a frame header .2 of 4 bytes"),
])
def test_a_stream_that_ends_early_fails_with_what_went_wrong(cut, error, message):
    receiver = Spy("r")
    data, starts, ends = wire("r", 1000)
    with pytest.raises(error, match=message):
        asyncio.run(pull(receiver, data[:cut(starts, ends)]))
    assert not receiver.complete


def test_a_chunk_that_ends_in_no_checksum_is_refused():
    """The bytes after a chunk's data that are not one msgpack uint: a ProtocolError that names them, the chunk
    not received."""
    receiver = Spy("r")
    data, _, ends = wire("r", 1000)
    broken = bytearray(data)
    broken[ends[1] - CHUNK_TRAILER_BYTES] = 0xC0  # the checksum's marker: nil
    with pytest.raises(p.ProtocolError, match="a KV chunk of 1000 bytes ends in b'.xc0.*', not its checksum"):
        asyncio.run(pull(receiver, bytes(broken)))
    assert receiver.landed == [] and not receiver.complete


def test_a_pull_cut_mid_chunk_gives_the_reservation_back(llama_tiny):
    """A decode engine pulls through `_PeerKv` from a KV listener that stops mid-chunk: the import fails with the
    protocol's error, nothing is applied, the reserved blocks are free again (what part of the chunk reached them
    is in no prefix-cache entry: the same prompt is computed afresh), and no other block changed."""
    config = dict(num_kv_blocks=48, max_num_batched_tokens=64, batch_policy="fcfs", block_size=8)
    prefill = LLM(llama_tiny[0], role="prefill", **config).engine
    decode = LLM(llama_tiny[0], role="decode", **config).engine
    prefill.add_request("cut", list(range(3, 43)), SamplingParams(temperature=0, max_tokens=4))
    while prefill.has_unfinished():
        prefill.step()
    handoff = prefill.handoff("cut")
    free, cache = decode.blocks.num_free_blocks(), decode.executor.kv_cache.clone()
    reserved = []

    class Noted(_PeerKv):  # notes the receiver it pulls for
        def frames(self, first_block, chunk_memory):
            reserved.append(chunk_memory.__self__)
            return super().frames(first_block, chunk_memory)

    async def listener(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(p.encode_frame(p.Hello(p.PROTOCOL_VERSION, "prefill-0", 1, 0.0, 48, 8, 4096, 256, False,
                                            "model", b"challenge", "prefill", 0)))
        assert isinstance(await p.read_message(reader), p.Auth)
        pulled = await p.read_message(reader)
        sent, cut = bytearray(), None
        for frame in prefill.export_kv("cut", pulled.first_block, 1000):
            sent += written(frame)
            if cut is None and isinstance(frame, KvChunk):
                cut = len(sent) - CHUNK_TRAILER_BYTES - len(frame.data) // 2  # inside the first chunk's data
        writer.write(bytes(sent[:cut]))
        await writer.drain()
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_server(listener, "127.0.0.1", 0)
        engine = AsyncEngine(decode)
        await engine.start()
        try:
            source = Noted("127.0.0.1", server.sockets[0].getsockname()[1], "token", "cut")
            with pytest.raises(p.ProtocolError, match="stream ended inside a frame"):
                async for _ in engine.generate_imported(handoff, source):
                    pass
            deadline = time.monotonic() + WAIT_S
            while decode.imports or decode.blocks.num_free_blocks() != free:  # given back on the engine thread
                assert time.monotonic() < deadline, (decode.imports, decode.blocks.num_free_blocks(), free)
                await asyncio.sleep(0.01)
        finally:
            await engine.stop()
            server.close()

    asyncio.run(scenario())
    assert "cut" not in decode.requests and len(reserved) == 1
    blocks = reserved[0].block_ids
    others = [b for b in range(cache.shape[0]) if b not in blocks]
    assert torch.equal(decode.executor.kv_cache[others].view(torch.uint8), cache[others].view(torch.uint8))
    assert not torch.equal(decode.executor.kv_cache[blocks].view(torch.uint8),
                           cache[blocks].view(torch.uint8))  # half a chunk reached them
    prefill.release_handoff("cut")
    decode.add_request("again", list(range(3, 43)), SamplingParams(temperature=0, max_tokens=4))
    while decode.has_unfinished():
        outs = decode.step()
    assert outs[-1].num_cached_tokens == 0


def test_a_message_read_after_a_transfer_is_decoded_whole_and_a_clean_end_is_none():
    """Other messages than KvData come as they are, with or without `chunk_memory`; the peer's end between frames
    is None."""
    receiver = Spy("r")
    data, _, _ = wire("r", 1000)
    refused = p.KvRefused("r", "x" * 2000)  # longer than a head's read

    async def scenario():
        server, port = await serve(data + p.encode_frame(refused) + p.encode_frame(p.KvDone("r")))
        reader = await p.PullReader.connect("127.0.0.1", port)
        while not receiver.complete:
            receiver.receive(await reader.read_message(WAIT_S, receiver.chunk_memory))
        got = [await reader.read_message(WAIT_S, receiver.chunk_memory), await reader.read_message(WAIT_S),
               await reader.read_message(WAIT_S)]
        reader.close()
        server.close()
        return got

    assert asyncio.run(scenario()) == [refused, p.KvDone("r"), None]


def test_a_kv_data_chunk_head_is_found_only_when_it_adds_up_to_the_frame():
    """`decode_kv_chunk_head` of a KvData frame's first bytes: the chunk, where its data starts in the payload and
    its size (its checksum follows); None for other frames and for a frame length that does not match the head's."""
    data, _, _ = wire("r", 1000)
    size = p.HEADER.unpack_from(data, 0)[0]
    begin = data[p.HEADER.size:p.HEADER.size + size]
    assert p.decode_kv_chunk_head(begin, size) is None  # KvBegin
    chunk_frame = data[p.HEADER.size + size:]
    size = p.HEADER.unpack_from(chunk_frame, 0)[0]
    payload = chunk_frame[p.HEADER.size:p.HEADER.size + size]
    chunk, start, nbytes = p.decode_kv_chunk_head(payload[:200], size)
    assert (chunk.request_id, chunk.index, nbytes) == ("r", 0, 1000)  # a part of a block: one does not fit
    assert size - start - nbytes == CHUNK_TRAILER_BYTES
    assert bytes(decode_frame(p.decode_payload(payload).frame).data) == payload[start:start + nbytes]
    assert p.decode_kv_chunk_head(payload[:200], size + 1) is None
    assert p.decode_kv_chunk_head(p.encode_frame(p.KvDone("r"))[p.HEADER.size:], 10) is None


@pytest.mark.parametrize("chunk_bytes", [1000, 1 << 20])
def test_a_pull_sent_from_the_caches_blocks_lands_in_the_reserved_blocks(chunk_bytes):
    """The worker's path end to end: the sender writes each chunk from the cache's blocks (`send_kv_frames`, from an
    asyncio connection's socket, on a thread), the reader reads it straight into the reserved blocks, scattered (in
    runs here and there) and other than the sender's, from a resumed first block. The pulled blocks hold what was sent; the
    leading (prefix-cached) blocks and every other block are untouched."""
    cache, first_block = empty_cache(), 3
    receiver_blocks = [21, 2, 17, 5, 6, 7, 23, 8, 9, 15]
    layout = KvLayout.of_cache(CACHE, BLOCK_SIZE)
    handoff = Handoff("blocks", [0] * (len(BLOCKS) * BLOCK_SIZE), 0, SamplingParams(), SLO(1.0, 0.1), "t", 0.0, 0.0,
                      None, 0, 0, layout, len(BLOCKS))
    receiver = KvReceiver(handoff, 0, receiver_blocks, first_block, cache)

    async def scenario() -> None:
        async def send(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            pieces = stream_blocks("blocks", CACHE, layout, BLOCKS, first_block, chunk_bytes).pieces()
            await asyncio.to_thread(p.send_kv_frames, writer.get_extra_info("socket"), pieces, WAIT_S,
                                    threading.Event())
            writer.close()

        server = await asyncio.start_server(send, "127.0.0.1", 0)
        reader = await p.PullReader.connect("127.0.0.1", server.sockets[0].getsockname()[1])
        try:
            while not receiver.complete:
                receiver.receive(await reader.read_message(WAIT_S, receiver.chunk_memory))
            assert await reader.read_message(WAIT_S) is None
        finally:
            reader.close()
            server.close()

    asyncio.run(scenario())
    receiver.apply()
    pulled = receiver_blocks[first_block:]
    assert torch.equal(cache[pulled], CACHE[BLOCKS[first_block:]])
    assert not cache[[b for b in range(cache.shape[0]) if b not in pulled]].view(torch.uint8).any()


def test_a_sender_whose_peer_reads_nothing_times_out_and_one_told_to_stop_stops():
    """`send_kv_frames` to a peer that takes nothing: TimeoutError after the timeout; ConnectionError once its stop
    flag is set; the peer's end: ConnectionError."""
    layout = KvLayout.of_cache(CACHE, BLOCK_SIZE)
    big = torch.zeros(600, 2, 2, BLOCK_SIZE, 2, 32, dtype=torch.bfloat16)  # 1.2 MiB: more than the socket holds
    for outcome in ("timeout", "stop", "closed"):
        left, right = socket.socketpair()
        left.setblocking(False)
        stop = threading.Event()
        pieces = stream_blocks("big", big, layout, list(range(600)), 0, 4096).pieces()
        if outcome == "stop":
            threading.Timer(0.3, stop.set).start()
        elif outcome == "closed":
            threading.Timer(0.3, right.close).start()
        error, message = {"timeout": (TimeoutError, "took nothing for 0.5 s"), "stop": (ConnectionError, "given up"),
                          "closed": (ConnectionError, "Broken pipe|reset by peer")}[outcome]
        with pytest.raises(error, match=message):
            p.send_kv_frames(left, pieces, 0.5 if outcome == "timeout" else WAIT_S, stop)
        left.close()
        right.close()
