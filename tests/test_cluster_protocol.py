"""The wire protocol: round trips, bounds, and fuzzing a live worker (random, truncated, oversized and misdirected
frames each close their own connection; the worker keeps serving the others), and a router fed garbage by an
engine (that engine is dropped, the router keeps serving)."""
from __future__ import annotations

import asyncio
import json
import logging
import random
import threading

import msgspec
import pytest

from cluster import protocol as p
from cluster.router import Router
from cluster.service import RouterService
from cluster.worker import Worker
from engine.config import EngineConfig
from engine.llm import build_engine
from engine.sampling_params import SamplingParams
from engine.serving import NoInstanceError
from scheduler.fcfs import FCFSPolicy
from scheduler.roofline import emulated_latency_model
from scheduler.slo import SLO
from scheduler.tiers import Tier, TierSet
from scheduler.types import StepStats

SAMPLES = [
    p.Hello(p.PROTOCOL_VERSION, "engine-0", 123, 5.5, 1000, 16, 4096, 32000, True, "emulated"),
    p.Submit("r1", [1, 2, 3], p.SamplingSpec(temperature=0.0, max_tokens=7, stop=["\n"], seed=3), "tight", SLO(250, 20),
             0.125),
    p.Submit("r2", list(range(5000)), p.SamplingSpec(), "batch", SLO(5000, 250), 0.0),
    p.Abort("r1"),
    p.Drain(),
    p.Tokens([p.TokenDelta("r1", [5, 6], "ab", [1.0, 1.5], [-0.1, -0.2]), p.TokenDelta("r2", [], "", [])]),
    p.Finish("r1", "stop", 2, 16),
    p.Error("r1", "invalid", "token id 99999 is outside the vocabulary"),
    p.StepReport([p.StepTiming(1.0, 0.004, 512, 3, 2048, 40, 4, 1, 4),
                  p.StepTiming(1.004, 0.003, 0, 4, 2052, 40, 4, 0, 4)], 1000, [p.Resident("r1", 10, 11, 2)]),
    p.Heartbeat(7.25, 4, 1, 30, 64),
    p.Drained(),
    p.Auth(bytes(range(32))),
]
TOKEN = "protocol-test-cluster-token"


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    frame = p.encode_frame(msg)
    (size,) = p.HEADER.unpack(frame[:4])
    assert size == len(frame) - 4
    assert p.decode_payload(frame[4:]) == msg
    assert msgspec.msgpack.decode(frame[4:])[0] == f"{msg.__struct_config__.tag}"
    assert msg.__struct_config__.tag.endswith(f".{p.PROTOCOL_VERSION}")


def test_a_prompts_logprobs_frame_reads_whole_and_decodes_beside_the_loop(monkeypatch):
    """A frame carrying a long prompt's top logprobs reads back equal, its decode run on another thread than the
    event loop's (small frames stay on the loop)."""
    top = [[(t, -0.5), (t + 1, -1.5)] for t in range(20_000)]
    big = p.Tokens([p.TokenDelta("r", [1], "a", [0.0], prompt_logprobs=[None] + [-0.25] * 19_999,
                                 prompt_top_logprobs=[None] + top[1:])])
    small = SAMPLES[3]
    threads = []
    decode = p.decode_payload
    monkeypatch.setattr(p, "decode_payload", lambda payload: threads.append(threading.get_ident()) or decode(payload))

    async def read_both():
        reader = asyncio.StreamReader()
        reader.feed_data(p.encode_frame(big) + p.encode_frame(small))
        reader.feed_eof()
        return [await p.read_message(reader) for _ in range(3)], threading.get_ident()

    (first, second, end), loop_thread = asyncio.run(read_both())
    assert len(p.encode_frame(big)) > p.THREAD_DECODE_BYTES
    assert first == big and second == small and end is None
    assert threads[0] != loop_thread and threads[1] == loop_thread


def test_other_versions_and_garbage_are_protocol_errors():
    body = msgspec.msgpack.decode(p.encode_frame(SAMPLES[3])[4:])
    body[0] = other = f"abort.{p.PROTOCOL_VERSION + 1}"
    with pytest.raises(p.ProtocolError, match=other):
        p.decode_payload(msgspec.msgpack.encode(body))
    with pytest.raises(p.ProtocolError, match="malformed"):
        p.decode_payload(msgspec.msgpack.encode([f"submit.{p.PROTOCOL_VERSION}", "r", "not a list", [], "", {}, 0.0]))
    with pytest.raises(ValueError, match="exceeds the bound"):
        p.encode_frame(p.Submit("big", [7] * 100, p.SamplingSpec(), "", SLO(1000, 100), 0.0), max_bytes=64)


def test_decoder_fuzz_raises_only_protocol_errors():
    rng = random.Random(0)
    frames = [p.encode_frame(m)[4:] for m in SAMPLES]
    decoded = errors = 0
    for i in range(3000):
        if i % 2:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        else:  # a valid frame with a few bytes flipped, cut or extended
            data = bytearray(rng.choice(frames))
            for _ in range(rng.randrange(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            data = bytes(data[:rng.randrange(1, len(data) + 1)]) if rng.random() < 0.5 else bytes(data)
        try:
            p.decode_payload(data)
            decoded += 1
        except p.ProtocolError:
            errors += 1
    assert errors > 2000 and decoded + errors == 3000


def _tiny_model(folder) -> str:
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 4096, "eos_token_id": 2}))
    return str(folder)


async def _read_all(reader: asyncio.StreamReader, until_finish: str | None = None, timeout: float = 10.0):
    msgs = []
    async with asyncio.timeout(timeout):
        while (msg := await p.read_message(reader)) is not None:
            msgs.append(msg)
            if until_finish is not None and isinstance(msg, p.Finish) and msg.request_id == until_finish:
                break
    return msgs


def _auth(hello: p.Hello) -> bytes:
    """The router's first frame: proof of the cluster token for this connection's challenge."""
    return p.encode_frame(p.Auth(p.auth_proof(TOKEN, hello.challenge)))


def _submit(rid: str, max_tokens: int = 20) -> bytes:
    return p.encode_frame(p.Submit(rid, [5, 6, 7, 8], p.SamplingSpec(temperature=0.0, max_tokens=max_tokens),
                                   "std", SLO(1000, 100), 0.0))


def test_worker_survives_fuzzed_connections(tmp_path, caplog):
    engine = build_engine(EngineConfig(model=_tiny_model(tmp_path), executor="emulated", num_kv_blocks=256),
                          FCFSPolicy(2048, 64), step_time=lambda *_: 0.002)

    async def scenario():
        worker = Worker(engine, instance_id="w", token=TOKEN, heartbeat_s=0.2)
        port = await worker.start()
        good_r, good_w = await asyncio.open_connection("127.0.0.1", port)
        hello = await p.read_message(good_r)
        assert isinstance(hello, p.Hello) and hello.instance_id == "w" and hello.num_kv_blocks == 256
        good_w.write(_auth(hello) + _submit("long", max_tokens=200))  # runs through the whole fuzzing

        rng = random.Random(1)
        valid = p.encode_frame(SAMPLES[1])
        kinds = ["random", "bad_payload", "truncated", "oversized", "zero", "misdirected"]
        closed_by_worker = 0
        for i in range(60):
            kind = kinds[i % len(kinds)]
            r, w = await asyncio.open_connection("127.0.0.1", port)
            assert isinstance(await p.read_message(r), p.Hello)
            if kind == "random":  # then EOF: a random header may announce more bytes than follow
                w.write(bytes(rng.randrange(256) for _ in range(rng.randrange(5, 200))))
                w.write_eof()
            elif kind == "bad_payload":
                junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 100)))
                w.write(p.HEADER.pack(len(junk)) + junk)
            elif kind == "truncated":
                w.write(valid[:rng.randrange(1, len(valid))])
                w.write_eof()
            elif kind == "oversized":
                w.write(p.HEADER.pack(p.MAX_FRAME_BYTES + 1) + b"x" * 16)
            elif kind == "zero":
                w.write(p.HEADER.pack(0))
            else:
                w.write(p.encode_frame(p.Tokens([])))
            rest = await _read_all(r, timeout=5.0)  # the worker closes the connection (EOF), saying why
            errors = [m for m in rest if isinstance(m, p.Error) and m.kind == "protocol"]
            closed_by_worker += bool(errors)
            w.close()
        # the good connection's request was never disturbed, and new connections are served
        got = await _read_all(good_r, until_finish="long", timeout=20.0)
        tokens = [t for m in got if isinstance(m, p.Tokens) for d in m.deltas for t in d.token_ids]
        assert len(tokens) == 200
        good_w.close()  # a worker serves one router at a time
        while worker.connections:
            await asyncio.sleep(0.01)
        r2, w2 = await asyncio.open_connection("127.0.0.1", port)
        w2.write(_auth(await p.read_message(r2)) + _submit("after"))
        got = await _read_all(r2, until_finish="after")
        finish = [m for m in got if isinstance(m, p.Finish)]
        assert finish and finish[0].num_output_tokens == 20
        assert any(isinstance(m, p.StepReport) for m in got)
        good_w.close()
        w2.close()
        await worker.stop()
        return closed_by_worker

    with caplog.at_level(logging.WARNING, logger="cluster.worker"):
        closed = asyncio.run(scenario())
    assert closed >= 50  # all but the truncated ones (those end by EOF before a full frame) get a reason
    assert sum("closing connection" in r.message for r in caplog.records) >= 50
    assert not engine.has_unfinished()


def test_worker_rejects_bad_requests_and_drains(tmp_path):
    engine = build_engine(EngineConfig(model=_tiny_model(tmp_path), executor="emulated", num_kv_blocks=64),
                          FCFSPolicy(2048, 64), step_time=lambda *_: 0.001)

    async def scenario():
        worker = Worker(engine, instance_id="w", token=TOKEN)
        port = await worker.start()
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(_auth(await p.read_message(r)))
        w.write(p.encode_frame(p.Submit("oov", [5, 5000], p.SamplingSpec(), "std", SLO(1000, 100), 0.0)))
        w.write(p.encode_frame(p.Submit("neg", [5], p.SamplingSpec(temperature=-1.0), "std", SLO(1000, 100), 0.0)))
        w.write(_submit("ok", max_tokens=30))
        w.write(p.encode_frame(p.Drain()))
        w.write(_submit("late"))
        got = await _read_all(r)  # until the worker closes after Drained
        errors = {m.request_id: (m.kind, m.message) for m in got if isinstance(m, p.Error)}
        assert errors["oov"][0] == "invalid" and "vocabulary" in errors["oov"][1]
        assert errors["neg"][0] == "invalid" and "temperature" in errors["neg"][1]
        assert errors["late"][0] == "draining"
        kinds = [type(m).__name__ for m in got]
        assert kinds.index("Finish") < kinds.index("Drained") == len(kinds) - 1  # residents finish first
        await asyncio.wait_for(worker.done.wait(), 5)

    asyncio.run(scenario())


def test_router_drops_an_engine_that_sends_garbage_and_keeps_serving():
    tiers = TierSet([Tier("std", 50, 1000)])

    async def scenario():
        async def fake_engine(reader, writer):
            writer.write(p.encode_frame(p.Hello(p.PROTOCOL_VERSION, "bad", 1, 0.0, 100, 16, 4096, 1000, False,
                                                "emulated")))
            await reader.read(1)  # the router's Submit: answer it with garbage
            writer.write(p.HEADER.pack(5) + b"\xc1\xc1\xc1\xc1\xc1")
            await writer.drain()

        server = await asyncio.start_server(fake_engine, "127.0.0.1", 0)
        service = RouterService(Router(tiers, emulated_latency_model()), heartbeat_timeout_s=5.0)
        await service.start()
        await service.attach("127.0.0.1", server.sockets[0].getsockname()[1])
        gen = service.generate("x", [1, 2, 3], SamplingParams(max_tokens=4), "std", SLO(1000, 50), service.clock())
        with pytest.raises(NoInstanceError):  # its only instance died before a token: nowhere to place it again
            await asyncio.wait_for(anext(gen), 10)
        assert "bad" not in service.router.fleet.instances and not service.links
        assert service.router.counts["lost"] == 1
        await service.stop()
        server.close()

    asyncio.run(scenario())


def test_sampling_spec_carries_every_sampling_param_by_name():
    params = SamplingParams(temperature=0.3, top_k=5, top_p=0.9, seed=7, max_tokens=9, stop=["x"], stop_token_ids=[3],
                            ignore_eos=True, logprobs=True)
    assert set(p.SamplingSpec.__struct_fields__) == set(SamplingParams.__dataclass_fields__)
    wire = p.decode_payload(p.encode_frame(p.Submit("r", [1], p.SamplingSpec.of(params), "t", SLO(100, 10), 0.0))[4:])
    assert wire.sampling.params() == params and wire.slo == SLO(100, 10)


def test_a_step_crosses_the_wire_field_for_field():
    stats = StepStats(1.5, 0.004, 512, 3, 2048, 40, 6, 1, 5)  # no two counts alike: a swapped pair shows
    assert p.StepTiming.__struct_fields__ == tuple(StepStats.__dataclass_fields__)
    wire = p.decode_payload(p.encode_frame(p.StepReport([p.step_timing(stats)], 1000, []))[4:])
    assert wire.steps == [p.StepTiming(1.5, 0.004, 512, 3, 2048, 40, 6, 1, 5)]
    assert p.step_stats(wire.steps[0]) == stats
