"""What a near-limit request body does to everyone else: the longest inter-token gap of a running stream, and the
latency of /health, while one client sends a body just under the server's limit.

    python -m bench.stream_gap [--servers engine,router] [--body-mb 3.8] [--time-scale 1.0]

Per server (`engine`: `python -m engine.serve`, `router`: `python -m cluster.serve` with one engine process; both
emulated executors on the default model's tokenizer, started as processes of their own so that this client does not
share their interpreter): one streaming completion runs throughout; after a warm-up, its gaps are measured over a
quiet second (the baseline), then while each kind of near-limit body is sent and answered (`completion`: a prompt
string of --body-mb MB; `chat`: one user message of that size), with /health polled back to back meanwhile. Both
bodies are longer than the model's context, so each is answered 400; what matters is what their parsing, templating
and tokenizing cost the other requests until then. Times are measured on this client's receive clock.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import aiohttp

FILLER = "The quick brown fox jumps over the lazy dog. "
WARMUP_TOKENS = 50
QUIET_S = 1.0
SETTLE_S = 0.3  # streaming measured on after the big body's answer, so a stall that ends with it is seen whole


@dataclass(slots=True)
class Window:
    kind: str
    status: int
    answer_s: float
    max_gap_ms: float
    tokens: int
    health_polls: int
    max_health_ms: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(kind: str, port: int, time_scale: float) -> list[str]:
    common = ["--host", "127.0.0.1", "--port", str(port), "--executor", "emulated", "--time-scale", str(time_scale)]
    if kind == "engine":
        return [sys.executable, "-m", "engine.serve", *common]
    return [sys.executable, "-m", "cluster.serve", *common, "--min-instances", "1", "--max-instances", "1",
            "--idle-pool", "0"]


async def wait_healthy(session: aiohttp.ClientSession, url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            async with session.get(f"{url}/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"the server did not become healthy within {timeout_s:g} s")


class Stream:
    """One long streaming completion; keeps the receive time of every token chunk."""

    def __init__(self, session: aiohttp.ClientSession, url: str, model: str):
        self.times: list[float] = []
        self.task = asyncio.create_task(self._run(session, url, model))

    async def _run(self, session: aiohttp.ClientSession, url: str, model: str) -> None:
        body = {"model": model, "prompt": "Count:", "max_tokens": 6000, "stream": True,
                "temperature": 0}
        async with session.post(f"{url}/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.content:
                if line.startswith(b"data: {"):
                    self.times.append(time.monotonic())

    async def tokens(self, n: int) -> None:
        while len(self.times) < n:
            if self.task.done():
                self.task.result()
                raise RuntimeError("the stream ended early")
            await asyncio.sleep(0.005)

    def max_gap_ms(self, start: float, end: float) -> tuple[float, int]:
        """The longest gap between chunks that touches [start, end], counting the open one up to `end`."""
        inside = [t for t in self.times if start <= t <= end]
        before = [t for t in self.times if t < start][-1:]
        points = before + inside + [end]
        return 1000 * max(b - a for a, b in zip(points, points[1:])), len(inside)


async def poll_health(session: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> list[float]:
    latencies = []
    while not stop.is_set():
        t0 = time.monotonic()
        async with session.get(f"{url}/health") as r:
            await r.read()
        latencies.append(time.monotonic() - t0)
    return latencies


def post(url: str, data: bytes) -> int:
    """Sends a body and reads the answer: on a thread of its own, so that sending megabytes does not hold up this
    client's loop, which reads the stream."""
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code


async def measure(url: str, body_bytes: int) -> list[Window]:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(f"{url}/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        stream = Stream(session, url, model)
        await stream.tokens(WARMUP_TOKENS)
        t0 = time.monotonic()
        await asyncio.sleep(QUIET_S)
        gap, n = stream.max_gap_ms(t0, time.monotonic())
        windows = [Window("quiet", 0, 0.0, gap, n, 0, 0.0)]
        text = FILLER * (body_bytes // len(FILLER))
        bodies = {"completion": {"model": model, "prompt": text, "max_tokens": 16},
                  "chat": {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 16}}
        for kind, body in bodies.items():
            data = json.dumps(body).encode()
            stop = asyncio.Event()
            poller = asyncio.create_task(poll_health(session, url, stop))
            await asyncio.sleep(0.05)
            path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
            start = time.monotonic()
            status = await asyncio.to_thread(post, url + path, data)
            answered = time.monotonic()
            await asyncio.sleep(SETTLE_S)
            stop.set()
            health = await poller
            gap, n = stream.max_gap_ms(start, time.monotonic())
            windows.append(Window(kind, status, answered - start, gap, n, len(health), 1000 * max(health)))
        stream.task.cancel()
        try:
            await stream.task
        except asyncio.CancelledError:
            pass
        return windows


def run_server(kind: str, body_bytes: int, time_scale: float) -> list[Window]:
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(server_command(kind, port, time_scale), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    async def main():
        async with aiohttp.ClientSession() as session:
            await wait_healthy(session, url, proc, 180)
        return await measure(url, body_bytes)

    try:
        return asyncio.run(main())
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="engine,router")
    ap.add_argument("--body-mb", type=float, default=3.8, help="size of the big prompt, in MB (1e6 bytes)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="the emulated step time times this")
    args = ap.parse_args(argv)
    body_bytes = int(args.body_mb * 1e6)
    print(f"{'server':8} {'window':10} {'status':>6} {'answer s':>9} {'max gap ms':>11} {'tokens':>7} "
          f"{'health polls':>12} {'max health ms':>13}")
    for kind in args.servers.split(","):
        for w in run_server(kind, body_bytes, args.time_scale):
            print(f"{kind:8} {w.kind:10} {w.status or '':>6} {w.answer_s:9.2f} {w.max_gap_ms:11.1f} {w.tokens:7d} "
                  f"{w.health_polls:12d} {w.max_health_ms:13.1f}", flush=True)


if __name__ == "__main__":
    main()
