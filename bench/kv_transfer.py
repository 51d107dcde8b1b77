"""KV hand-off throughput over a loopback TCP socket between two processes, against a plain copy of the same bytes.

    python -m bench.kv_transfer [--models smollm2-135m,llama-3.1-8b] [--dtypes bfloat16,float32]
                                [--tokens 512,2048,8192] [--chunk-bytes 4194304] [--receiver buffered|streams]
                                [--repeats 3] [--max-bytes 1073741824] [--device cpu|cuda]

One request's prompt KV, in a cache of the model's shape whose blocks lie scattered (a shuffled block table), goes
from a sender process to this one over 127.0.0.1. The KV path is the cluster's pull (cluster/worker.py): the sender
frames the blocks (`stream_blocks(...).pieces()`: each chunk the cache's blocks, summed as they are sent) and writes
them as cluster protocol `KvData` frames from its asyncio connection's socket on a thread
(`protocol.send_kv_frames`: `sendmsg` of each head, its blocks and its checksum); this side reads them as the decode
worker does (`protocol.PullReader.read_message`: a chunk's head, then its data straight into the `KvReceiver`'s
blocks, summed as they land, then its checksum) into a receiver on a cache tensor of its own, as a decode engine's,
and applies the complete transfer (`KvReceiver.apply`, as `Engine.finish_import` does). The plain copy sends the
same bytes from one contiguous buffer in chunks of the same size, unframed and unchecked, into one preallocated
buffer here: what the socket and the event loop allow these two processes (the KV frames come over a connection of
their own). Each repeat runs the plain copy and then the KV transfer; both are timed on this side, from the request
to the sender until the last byte is in place; the median of the repeats is reported, with the CPU time each process
took for the transfer (all its threads, user and system: on loopback the kernel's copies are most of it), and as "of
plain" the median of the repeats' own ratios (each repeat's two transfers run back to back).

--receiver picks how this side reads the plain copy: `buffered` (an `asyncio.BufferedProtocol`: it lands straight in
its destination, the most a reader of this event loop gets) or `streams` (`StreamReader.readexactly`, each piece
then copied into the destination: what a reader through asyncio streams gets, as the decode worker's pull was before
it read chunks into their place). The KV frames are read by the pull's reader in both. The sender writes the plain
copy with `StreamWriter` in both. The first repeat checks that the blocks that landed hold the bytes sent. Payloads
above --max-bytes are skipped (this side holds each one three times over while checking it). Figures depend on the
load of the machine: give the load average.

--device cuda puts both caches on the GPU: the pull then goes device -> pinned host -> socket -> pinned host ->
device (the sender's checksums taken on the device, the receiver's too), timed until the last copy onto the device is
done; the plain copy is the same host-to-host socket copy, the reference the issue sets.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import socket
import statistics
import threading
import time
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from cluster import protocol as p
from engine.kv_transfer import KvLayout, KvReceiver, MAX_CHUNK_BYTES, Handoff, read_blocks, stream_blocks
from engine.model_config import DTYPES
from engine.sampling_params import SamplingParams
from scheduler.slo import SLO

HEADER = p.HEADER  # the commands' length prefix: the cluster protocol's frame header
BLOCK_SIZE = 16
SPARE_BLOCKS = 8  # the cache holds more blocks than the request's, so that its block table is a real scatter
# (layers, kv heads, head dim) of the models' caches
SHAPES = {"smollm2-135m": (30, 3, 64), "llama-3.1-8b": (32, 8, 128)}


@dataclass(slots=True, frozen=True)
class Case:
    model: str
    dtype: str
    tokens: int

    @property
    def layout(self) -> KvLayout:
        layers, heads, dim = SHAPES[self.model]
        return KvLayout(layers, heads, dim, BLOCK_SIZE, self.dtype)

    @property
    def num_blocks(self) -> int:
        return -(-self.tokens // BLOCK_SIZE)

    @property
    def payload_bytes(self) -> int:
        return self.num_blocks * self.layout.block_bytes

    def cache(self, device: str) -> torch.Tensor:
        layout = self.layout
        return torch.empty(self.num_blocks + SPARE_BLOCKS, layout.num_layers, 2, BLOCK_SIZE, layout.num_kv_heads,
                           layout.head_dim, dtype=DTYPES[self.dtype], device=device)

    def block_ids(self) -> list[int]:
        """The request's block table: the same on both sides, so that the receiver can check what landed."""
        order = torch.randperm(self.num_blocks + SPARE_BLOCKS, generator=torch.Generator().manual_seed(self.tokens))
        return order[:self.num_blocks].tolist()

    def handoff(self) -> Handoff:
        return Handoff(self.label, [0] * self.tokens, 0, SamplingParams(), SLO(1.0, 0.1), "bench", 0.0, 0.0, None,
                       0, 0, self.layout, self.num_blocks)

    @property
    def label(self) -> str:
        return f"{self.model} {self.dtype} {self.tokens}"


class Command(msgspec.Struct, array_like=True):
    op: str  # "prepare" (answered with one byte once done), "plain", "kv" or "quit"
    case: int


# ---- the sender process ------------------------------------------------------------------------------------------
def sender_main(port: int, kv_port: int, cases: list[Case], chunk_bytes: int, device: str) -> None:
    asyncio.run(_sender(port, kv_port, cases, chunk_bytes, device))


async def _sender(port: int, kv_port: int, cases: list[Case], chunk_bytes: int, device: str) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    _, kv_writer = await asyncio.open_connection("127.0.0.1", kv_port)
    kv_socket = kv_writer.get_extra_info("socket")
    current, cache, block_ids, source = -1, None, None, None
    while True:
        (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
        command = msgspec.msgpack.decode(await reader.readexactly(size), type=Command)
        if command.op == "quit":
            break
        case = cases[command.case]
        if command.case != current:
            cache = source = None  # the last case's memory goes before the next one's is taken
            cache, block_ids = case.cache(device), case.block_ids()
            cache.view(torch.uint8).random_(0, 256, generator=torch.Generator(device).manual_seed(command.case))
            source = memoryview(read_blocks(cache.cpu(), block_ids))
            current = command.case
        if command.op == "prepare":
            writer.write(b"\x01")
        elif command.op == "plain":
            for start in range(0, len(source), chunk_bytes):
                writer.write(source[start:start + chunk_bytes])
                await writer.drain()
        elif command.op == "kv":  # as the prefill worker's KV listener sends (`Worker._send_kv`)
            pieces = stream_blocks(case.label, cache, case.layout, block_ids, 0, chunk_bytes).pieces()
            await asyncio.to_thread(p.send_kv_frames, kv_socket, pieces, 10.0, threading.Event())
    for w in (writer, kv_writer):
        w.close()
        await w.wait_closed()


# ---- this side ---------------------------------------------------------------------------------------------------
class BufferedLink(asyncio.BufferedProtocol):
    """Reads raw bytes straight into a destination buffer."""

    def __init__(self):
        self.raw: memoryview | None = None  # the destination of a raw copy
        self.filled = 0
        self.done: asyncio.Future | None = None
        self.transport = None
        self.connected = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.connected.set_result(None)

    def expect_raw(self, destination: memoryview) -> asyncio.Future:
        self.raw, self.filled = destination, 0
        self.done = asyncio.get_running_loop().create_future()
        return self.done

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.done is None or self.done.done():  # asked for the connection's end too: a byte would be an error
            return memoryview(bytearray(1))
        return self.raw[self.filled:]

    def buffer_updated(self, nbytes: int) -> None:
        if self.done is None or self.done.done():
            raise RuntimeError("bytes came that no copy expects")
        self.filled += nbytes
        if self.filled == len(self.raw):
            self.done.set_result(None)

    def connection_lost(self, exc) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("the sender left mid-transfer"))


class StreamLink:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer


def cpu_seconds(pid: int) -> float:
    """The CPU time process `pid` has taken so far, all its threads' (Linux: /proc/<pid>/task/*/schedstat)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as stat:
                total += int(stat.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            pass
    return total / 1e9


@dataclass(slots=True)
class Timing:
    """One transfer: its wall time, and the CPU time the sender and this side took for it."""
    wall_s: float
    sender_cpu_s: float
    receiver_cpu_s: float


class Stopwatch:
    def __init__(self, sender_pid: int):
        self.sender_pid = sender_pid
        self.start = time.perf_counter(), cpu_seconds(sender_pid), time.process_time()

    def stop(self) -> Timing:
        wall, sender, receiver = self.start
        return Timing(time.perf_counter() - wall, cpu_seconds(self.sender_pid) - sender,
                      time.process_time() - receiver)


@dataclass(slots=True)
class Row:
    case: Case
    plain: list[Timing]
    kv: list[Timing]

    def line(self) -> str:
        plain, kv = (statistics.median(t.wall_s for t in timings) for timings in (self.plain, self.kv))
        # each repeat's plain copy and KV transfer run back to back: the median of their ratios is steadier on a
        # machine whose speed drifts between repeats than the ratio of the medians
        ratio = statistics.median(p.wall_s / k.wall_s for p, k in zip(self.plain, self.kv))
        size = self.case.payload_bytes

        def cpu(timings: list[Timing]) -> str:
            return " + ".join(f"{statistics.median(getattr(t, side) for t in timings) * 1e3:.0f}"
                              for side in ("sender_cpu_s", "receiver_cpu_s"))

        return (f"| {self.case.model} | {self.case.dtype} | {self.case.tokens} | {size / 2**20:.1f} | "
                f"{size / plain / 1e9:.2f} | {size / kv / 1e9:.2f} | {ratio * 100:.0f} % | "
                f"{kv / self.case.tokens * 1e6:.2f} | {cpu(self.plain)} | {cpu(self.kv)} |")


async def measure(cases: list[Case], chunk_bytes: int, receiver_kind: str, repeats: int, device: str) -> None:
    """Prints a row per case as it is done."""
    loop = asyncio.get_running_loop()
    accepted = loop.create_future()
    if receiver_kind == "buffered":
        link = BufferedLink()
        server = await loop.create_server(lambda: link, "127.0.0.1", 0)
    else:
        server = await asyncio.start_server(lambda r, w: accepted.set_result(StreamLink(r, w)), "127.0.0.1", 0)

    kv_server = socket.create_server(("127.0.0.1", 0))
    kv_server.setblocking(False)
    port, kv_port = server.sockets[0].getsockname()[1], kv_server.getsockname()[1]
    process = multiprocessing.get_context("spawn").Process(target=sender_main,
                                                           args=(port, kv_port, cases, chunk_bytes, device))
    process.start()
    if receiver_kind == "buffered":
        await link.connected
        send = link.transport.write
    else:
        link = await accepted
        send = link.writer.write
    kv_link = p.PullReader((await loop.sock_accept(kv_server))[0])

    def command(op: str, index: int) -> None:
        payload = msgspec.msgpack.encode(Command(op, index))
        send(HEADER.pack(len(payload)) + payload)

    try:
        for index, case in enumerate(cases):
            cache, block_ids = case.cache(device), case.block_ids()
            cache.zero_()
            plain = torch.empty(case.payload_bytes, dtype=torch.uint8)
            row = Row(case, [], [])
            command("prepare", index)  # the sender's cache is made outside the timings
            if receiver_kind == "streams":
                await link.reader.readexactly(1)
            else:
                await link.expect_raw(memoryview(bytearray(1)))
            for repeat in range(repeats):
                if receiver_kind == "streams":
                    row.plain.append(await _plain_streams(link, command, index, plain, chunk_bytes, process.pid))
                else:
                    watch = Stopwatch(process.pid)
                    done = link.expect_raw(memoryview(plain.numpy()))
                    command("plain", index)
                    await done
                    row.plain.append(watch.stop())
                receiver = KvReceiver(case.handoff(), 0, block_ids, 0, cache)
                watch = Stopwatch(process.pid)
                command("kv", index)
                while not receiver.complete:  # as the decode worker's pull (`_PeerKv.frames`) feeds its receiver
                    receiver.receive(await kv_link.read_message(chunk_memory=receiver.chunk_memory))
                receiver.apply()
                if cache.is_cuda:
                    torch.cuda.synchronize()
                row.kv.append(watch.stop())
                if repeat == 0:  # what landed is what was sent, in its blocks
                    assert receiver.complete and np.array_equal(read_blocks(cache.cpu(), block_ids), plain.numpy())
                    cache.zero_()
                del receiver
            print(row.line(), flush=True)
            del cache, plain
        command("quit", 0)
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
        server.close()
        kv_server.close()


async def _plain_streams(link: StreamLink, command, index: int, plain: torch.Tensor, chunk_bytes: int,
                         sender_pid: int) -> Timing:
    """The plain copy read with `readexactly`, each piece copied into the destination."""
    destination = plain.numpy()
    watch = Stopwatch(sender_pid)
    command("plain", index)
    for offset in range(0, len(destination), chunk_bytes):
        data = await link.reader.readexactly(min(chunk_bytes, len(destination) - offset))
        destination[offset:offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
    return watch.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(SHAPES))
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--tokens", default="512,2048,8192")
    parser.add_argument("--chunk-bytes", type=int, default=MAX_CHUNK_BYTES)
    parser.add_argument("--receiver", choices=("buffered", "streams"), default="buffered")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-bytes", type=int, default=1 << 30)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    for model in args.models.split(","):
        if model not in SHAPES:
            parser.error(f"unknown model {model!r}: one of {', '.join(SHAPES)}")
    for dtype in args.dtypes.split(","):
        if dtype not in DTYPES:
            parser.error(f"unknown dtype {dtype!r}: one of {', '.join(DTYPES)}")
    if not 0 < args.chunk_bytes <= p.MAX_FRAME_BYTES // 2 or args.repeats < 1:
        parser.error(f"--chunk-bytes must lie in [1, {p.MAX_FRAME_BYTES // 2}] (as a worker's) and --repeats be "
                     f"positive")
    tokens = [int(t) for t in args.tokens.split(",") if t.isdigit() and int(t) > 0]
    if len(tokens) != len(args.tokens.split(",")):
        parser.error(f"--tokens must be positive integers, got {args.tokens!r}")
    cases = [Case(m, d, t) for m in args.models.split(",") for d in args.dtypes.split(",") for t in tokens]
    skipped = [c for c in cases if c.payload_bytes > args.max_bytes]
    cases = [c for c in cases if c.payload_bytes <= args.max_bytes]
    for case in skipped:
        print(f"skipped {case.label}: {case.payload_bytes / 2**20:.0f} MiB is over --max-bytes")
    print(f"chunks of {args.chunk_bytes} bytes, receiver {args.receiver}, caches on {args.device}, "
          f"median of {args.repeats}")
    print("| model | dtype | prompt tokens | MiB | plain copy GB/s | KV transfer GB/s | of plain | "
          "added TTFT ms / 1k tokens | plain copy CPU ms, sender + receiver | KV transfer CPU ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    asyncio.run(measure(cases, args.chunk_bytes, args.receiver, args.repeats, args.device))


if __name__ == "__main__":
    main()
