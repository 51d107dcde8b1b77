"""Prefill/decode disaggregation through the router service: a prefill worker runs each prompt to its first token
and holds its KV, the router places the rest on a decode worker, which pulls the KV over the cluster protocol (an
authenticated peer connection), imports it and streams on. The text is the co-located engine's token for token; a
decode worker lost mid-transfer and a corrupt payload cost only delay; no block leaks on either side."""
from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import pytest

from cluster import protocol as p
from cluster.router import MOVING_MEAN_WEIGHT, Router
from cluster.service import RouterService
from cluster.worker import Worker
from engine import LLM, EngineConfig, SamplingParams
from engine.engine import Engine
from engine.kv_transfer import KvChunk, KvEnd, chunk_trailer, decode_frame, encode_frame
from engine.llm import build_engine
from scheduler.roofline import emulated_latency_model

WAIT_S = 60.0


class PdFleet:
    """Workers of the given roles in this process (instance ids `prefill-0`, `decode-0`, ...), attached to a router
    service on this event loop."""

    def __init__(self, folder: str, roles: list[str], kv_chunk_bytes: int = 64 << 10, **config):
        engines = [build_engine(EngineConfig(model=folder, role=role, **config)) for role in roles]
        self.engines, self.free = {}, {}
        self.service = RouterService(Router(engines[0].tiers, emulated_latency_model(), shed_late=False),
                                     heartbeat_timeout_s=30.0, drain_timeout_s=5.0)
        self.workers: dict[str, Worker] = {}
        for i, (role, engine) in enumerate(zip(roles, engines)):
            instance_id = f"{role}-{roles[:i].count(role)}"
            self.engines[instance_id], self.free[instance_id] = engine, engine.blocks.num_free_blocks()
            self.workers[instance_id] = Worker(engine, instance_id=instance_id, token=self.service.token,
                                               heartbeat_s=0.2, kv_chunk_bytes=kv_chunk_bytes)

    async def __aenter__(self) -> "PdFleet":
        for worker in self.workers.values():
            await self.service.attach("127.0.0.1", await worker.start())
        await self.service.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.service.stop()
        for worker in self.workers.values():
            await worker.stop()

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams) -> list:
        tier, slo = self.service.router.tiers.resolve(None)
        outputs = self.service.generate(request_id, prompt, params, tier.name, slo, time.monotonic())
        return await asyncio.wait_for(_collect(outputs), WAIT_S)

    async def settled(self, *instance_ids: str) -> None:
        """Until the engines hold nothing: every block free again, every hand-off released."""
        deadline = time.monotonic() + WAIT_S
        while not all(self.engines[i].blocks.num_free_blocks() == self.free[i] and not self.engines[i].handoffs
                      and not self.engines[i].imports and not self.workers[i].handoffs for i in instance_ids):
            assert time.monotonic() < deadline, {i: (self.engines[i].blocks.num_free_blocks(), self.free[i])
                                                 for i in instance_ids}
            await asyncio.sleep(0.02)


async def _collect(outputs) -> list:
    return [out async for out in outputs]


def run(coro):
    return asyncio.run(coro)


def joined(outs) -> tuple[list[int], str]:
    return [t for o in outs for t in o.new_token_ids], "".join(o.new_text for o in outs)


def test_prefill_and_decode_workers_give_the_colocated_text(default_model):
    """SmolLM2: a long prompt prefilled over many chunks and a stop string met on the decode side, each handed off
    with its KV in many frames; the decode engine never prefills (its KV all came by transfer)."""
    config = dict(num_kv_blocks=96, max_num_batched_tokens=32, batch_policy="fcfs")
    reference = LLM(default_model, **config)
    story = " ".join(f"Item {i}: the {['red', 'green', 'blue', 'grey'][i % 4]} box is on shelf {i * 7 % 13}."
                     for i in range(16))
    long_prompt = reference.tokenizer.apply_chat_template(
        [{"role": "user", "content": story + " Which shelf holds item 5? Answer briefly."}])
    chat = reference.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours of the sky."}])
    greedy = SamplingParams(temperature=0, max_tokens=8)
    free_text = reference.generate([chat], greedy)[0].text
    stopping = SamplingParams(temperature=0, max_tokens=8, stop=[free_text.split()[2]])
    want = reference.generate([long_prompt, chat], [greedy, stopping])
    assert len(long_prompt) > 6 * config["max_num_batched_tokens"]

    async def scenario():
        async with PdFleet(default_model, ["prefill", "decode"], kv_chunk_bytes=256 << 10, **config) as fleet:
            got = [await fleet.generate("long", long_prompt, greedy), await fleet.generate("stop", chat, stopping)]
            await fleet.settled("prefill-0", "decode-0")
            return got, fleet

    got, fleet = run(scenario())
    for outs, ref in zip(got, want):
        assert outs[-1].finish_reason == ref.finish_reason
        assert outs[-1].token_ids == ref.token_ids and outs[-1].text == ref.text
        assert joined(outs) == (ref.token_ids, ref.text)  # the stream is the whole output, once
    assert want[1].finish_reason == "stop" and len(want[1].token_ids) > 2  # met on the decode side
    assert fleet.service.counts["handed_off"] == 2 and not fleet.service.counts["transfer_failed"]
    prefill, decode = fleet.engines["prefill-0"], fleet.engines["decode-0"]
    assert max(s.num_prefill_tokens for s in prefill.step_stats) <= config["max_num_batched_tokens"]
    assert sum(s.num_prefill_tokens for s in prefill.step_stats) >= len(long_prompt)
    assert not any(s.num_prefill_tokens for s in decode.step_stats)
    assert any(s.num_decode_seqs for s in decode.step_stats)


TINY = dict(num_kv_blocks=48, max_num_batched_tokens=8, batch_policy="fcfs", block_size=8)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPT = [(7 * i + 3) % 300 for i in range(45)]


def interpose(worker: Worker, before_send) -> list:
    """Runs `await before_send(writer, pull, n)` before the worker's n-th KV send (n from 0); returns the pulls."""
    send, pulls = worker._send_kv, []

    async def wrapped(writer, pull):
        pulls.append(pull)
        writer = await before_send(writer, pull, len(pulls) - 1) or writer
        await send(writer, pull)

    worker._send_kv = wrapped
    return pulls


def test_a_decode_worker_lost_mid_transfer_costs_only_delay(llama_tiny):
    """The decode worker that pulls dies once its pull began: the request goes to the other decode worker, which
    pulls the KV the prefill side still holds; the text is the co-located one."""
    want = LLM(llama_tiny[0], **TINY).generate([PROMPT], GREEDY)[0].token_ids

    async def scenario():
        async with PdFleet(llama_tiny[0], ["prefill", "decode", "decode"], kv_chunk_bytes=1024, **TINY) as fleet:
            lost = []

            async def kill_the_puller(writer, pull, n):
                if n == 0:
                    lost.append(fleet.service.streams[pull.request_id].routed.instance_id)
                    await fleet.workers[lost[0]].stop()

            pulls = interpose(fleet.workers["prefill-0"], kill_the_puller)
            outs = await fleet.generate("r", PROMPT, GREEDY)
            survivor = ({"decode-0", "decode-1"} - set(lost)).pop()
            await fleet.settled("prefill-0", survivor)
            return outs, fleet, pulls, lost

    outs, fleet, pulls, lost = run(scenario())
    assert outs[-1].finish_reason == "length" and joined(outs)[0] == want
    assert len(pulls) == 2 and lost[0] not in fleet.service.links
    assert fleet.service.counts["handed_off"] == 1 and not fleet.service.counts["migrated"]  # not prefilled again
    assert fleet.service.counts["transfer_failed"] == 1


class CorruptingWriter:
    """A stream writer that flips one byte of the first KV chunk after chunk 0, its checksum left as it was. It
    passes on whole frames, however they were written (a KvData frame's head and data in turn)."""

    def __init__(self, writer):
        self.writer, self.corrupted, self.pending = writer, False, b""

    def write(self, data: bytes | memoryview) -> None:
        self.pending += bytes(data)
        while len(self.pending) >= p.HEADER.size:
            end = p.HEADER.size + p.HEADER.unpack_from(self.pending)[0]
            if len(self.pending) < end:
                return
            data, self.pending = self.pending[:end], self.pending[end:]
            msg = p.decode_payload(data[p.HEADER.size:])
            if not self.corrupted and isinstance(msg, p.KvData):
                frame = decode_frame(msg.frame)
                if isinstance(frame, KvChunk) and frame.index == 1:
                    flipped = bytearray(frame.data)
                    flipped[3] ^= 0x10
                    data = p.encode_frame(p.KvData(encode_frame(msgspec.structs.replace(frame, data=bytes(flipped)))))
                    self.corrupted = True
            self.writer.write(data)

    async def drain(self) -> None:
        await self.writer.drain()


def test_a_corrupt_payload_closes_the_pull_and_is_retried(llama_tiny, caplog):
    want = LLM(llama_tiny[0], **TINY).generate([PROMPT], GREEDY)[0].token_ids

    async def scenario():
        async with PdFleet(llama_tiny[0], ["prefill", "decode"], kv_chunk_bytes=1024, **TINY) as fleet:
            writers = []

            async def corrupt_first(writer, pull, n):
                if n == 0:
                    writers.append(CorruptingWriter(writer))
                    return writers[0]

            pulls = interpose(fleet.workers["prefill-0"], corrupt_first)
            outs = await fleet.generate("r", PROMPT, GREEDY)
            await fleet.settled("prefill-0", "decode-0")
            return outs, fleet, pulls, writers

    with caplog.at_level(logging.WARNING, logger="cluster.worker"):
        outs, fleet, pulls, writers = run(scenario())
    assert writers[0].corrupted and len(pulls) == 2
    assert any("KV pull of r" in r.message and "chunk 1 fails its checksum" in r.message for r in caplog.records)
    assert outs[-1].finish_reason == "length" and joined(outs)[0] == want
    assert fleet.service.counts["transfer_failed"] == 1 and not fleet.service.counts["migrated"]


def test_the_prefill_side_gone_means_prefilled_again(llama_tiny):
    """Every pull refused (the hold is gone: timed out): the stream migrates, prefilled again from its prompt and
    first token, and still ends as the co-located one."""
    want = LLM(llama_tiny[0], **TINY).generate([PROMPT], GREEDY)[0].token_ids

    async def scenario():
        async with PdFleet(llama_tiny[0], ["prefill", "decode"], kv_chunk_bytes=1024, **TINY) as fleet:
            prefill = fleet.workers["prefill-0"]

            async def time_out_first(writer, pull, n):
                if n == 0:
                    prefill._let_go(pull.request_id, "timed out")
                    await asyncio.sleep(0.2)  # the release reaches the engine

            interpose(prefill, time_out_first)
            outs = await fleet.generate("r", PROMPT, GREEDY)
            await fleet.settled("prefill-0", "decode-0")
            return outs, fleet

    outs, fleet = run(scenario())
    assert joined(outs)[0] == want and outs[-1].finish_reason == "length"
    assert fleet.service.counts["migrated"] == 1 and fleet.service.counts["handed_off"] == 2


def test_a_prefill_worker_lost_after_the_first_token_means_prefilled_again_elsewhere(llama_tiny):
    """The prefill worker dies as its KV is pulled, its first token already streamed: the stream goes on from a
    prefill of its prompt and first token on the other prefill worker, handed off again; the client sees the
    co-located text, once, and no error."""
    want = LLM(llama_tiny[0], **TINY).generate([PROMPT], GREEDY)[0].token_ids

    async def scenario():
        async with PdFleet(llama_tiny[0], ["prefill", "prefill", "decode"], kv_chunk_bytes=1024, **TINY) as fleet:
            lost, stopping = [], []

            def die_when_pulled(instance_id):
                async def before_send(writer, pull, n):
                    if not lost:
                        lost.append(instance_id)
                        stopping.append(asyncio.create_task(fleet.workers[instance_id].stop()))
                        await asyncio.sleep(WAIT_S)  # ended with its worker
                return before_send

            for instance_id in ("prefill-0", "prefill-1"):
                interpose(fleet.workers[instance_id], die_when_pulled(instance_id))
            outs = await fleet.generate("r", PROMPT, GREEDY)
            await asyncio.gather(*stopping)
            survivor = ({"prefill-0", "prefill-1"} - set(lost)).pop()
            await fleet.settled(survivor, "decode-0")
            return outs, fleet, lost

    outs, fleet, lost = run(scenario())
    assert outs[-1].finish_reason == "length" and joined(outs)[0] == want
    assert lost and lost[0] not in fleet.service.links
    assert fleet.service.counts["migrated"] == 1 and fleet.service.counts["handed_off"] == 2


def test_a_full_decode_worker_refuses_and_the_request_waits(llama_tiny):
    """The decode engine's blocks are taken by a reservation the router placed none of: until a report tells the
    router they are taken, it places the hand-off there and the engine refuses the Import before any transfer, the
    router placing it again each tick; once told, the router holds it in its queue (no room now). Either way the
    request waits, and once the blocks are free it goes through."""
    want = LLM(llama_tiny[0], **TINY).generate([PROMPT], GREEDY)[0].token_ids
    small = {**TINY, "num_kv_blocks": 12}
    other = LLM(llama_tiny[0], role="prefill", **small).engine
    other.add_request("blocker", list(range(1, 61)), GREEDY)
    while other.has_unfinished():
        other.step()
    blocker = other.handoff("blocker")  # 61 tokens: 8 of the 12 blocks, where the request needs 7

    async def scenario():
        async with PdFleet(llama_tiny[0], ["prefill", "decode"], kv_chunk_bytes=1024, **small) as fleet:
            decode = fleet.workers["decode-0"].async_engine
            reservation = await decode.call(Engine.reserve_import, blocker)
            request = asyncio.create_task(fleet.generate("r", PROMPT, GREEDY))
            router = fleet.service.router

            def waiting() -> bool:
                queued = any(r.request_id == "r" for queue in router.queues for r in queue)
                return fleet.service.counts["import_refused"] >= 2 or (queued and "r" in router.handoffs)

            deadline = time.monotonic() + WAIT_S
            while not waiting():
                assert time.monotonic() < deadline and not request.done()
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)
            assert not request.done()  # nowhere to go while the blocks are taken
            await decode.call(Engine.cancel_import, reservation)
            outs = await request
            await fleet.settled("prefill-0", "decode-0")
            return outs, fleet

    outs, fleet = run(scenario())
    assert joined(outs)[0] == want and outs[-1].finish_reason == "length"
    assert fleet.service.counts["handed_off"] == 1 and not fleet.service.counts["transfer_failed"]


LONG = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)  # still streaming when the test acts
# No model: engines of one process that step at once share no model state, and each step sleeps an H200's time
EMULATED = {**TINY, "executor": "emulated"}


def streaming(fleet: PdFleet, request_id: str, params: SamplingParams):
    tier, slo = fleet.service.router.tiers.resolve(None)
    return fleet.service.generate(request_id, PROMPT, params, tier.name, slo, time.monotonic())


def test_a_hand_off_streaming_from_its_decode_worker_is_forgotten(llama_tiny):
    """Its decode worker streams only once the KV is imported, which freed it on the prefill side: the router
    holds the hand-off no more, so the autoscaler may stop that prefill worker, and the client leaving aborts the
    request on the decode worker alone."""
    async def scenario():
        async with PdFleet(llama_tiny[0], ["prefill", "decode"], kv_chunk_bytes=1024, **EMULATED) as fleet:
            service, prefill = fleet.service, fleet.workers["prefill-0"]
            told = []  # what the router sent the prefill worker
            dispatch = prefill._dispatch
            prefill._dispatch = lambda conn, msg: (told.append(msg), dispatch(conn, msg))
            outputs = streaming(fleet, "r", LONG)
            held = []  # per output: (from decode-0, hand-off held, prefill instances holding a hand-off's KV)
            async for out in outputs:
                s = service.streams["r"]
                held.append((s.routed.instance_id == "decode-0", s.handoff is not None, service._holding_kv()))
                if len(out.token_ids) >= 3:
                    break
            await outputs.aclose()
            # any Abort of "r" reaches the prefill worker before the next request's Submit does
            after = await fleet.generate("after", PROMPT, GREEDY)
            await fleet.settled("prefill-0", "decode-0")
            return held, told, after

    held, told, after = run(scenario())
    assert held[-1] == (True, False, set())
    assert after[-1].finish_reason == "length"
    assert [type(m).__name__ for m in told if getattr(m, "request_id", None) == "r"] == ["Submit"]


def test_a_decode_worker_lost_after_it_streamed_means_the_stream_migrates(llama_tiny):
    """Not an import retry: the prefill side holds the KV no more, and the stream is output already. It is
    prefilled again with what it streamed, handed off to the other decode worker, and ends as the co-located one."""
    want = LLM(llama_tiny[0], **EMULATED).generate([PROMPT], LONG)[0].token_ids

    async def scenario():
        async with PdFleet(llama_tiny[0], ["prefill", "decode", "decode"], kv_chunk_bytes=1024, **EMULATED) as fleet:
            outs, lost = [], []
            async for out in streaming(fleet, "r", LONG):
                outs.append(out)
                if not lost and len(out.token_ids) >= 3:  # a busy machine may stream tokens several at a time
                    lost.append(fleet.service.streams["r"].routed.instance_id)
                    await fleet.workers[lost[0]].stop()
            survivor = ({"decode-0", "decode-1"} - set(lost)).pop()
            await fleet.settled("prefill-0", survivor)
            return outs, fleet, lost

    outs, fleet, lost = run(scenario())
    assert lost[0].startswith("decode") and lost[0] not in fleet.service.links
    assert outs[-1].finish_reason == "length" and joined(outs)[0] == want
    counts = fleet.service.counts
    assert counts["migrated"] == 1 and counts["handed_off"] == 2 and not counts["transfer_failed"]


def test_a_resident_the_router_moves_streams_on_from_the_other_worker_token_for_token(llama_tiny):
    """Two co-located workers: a request streaming from one is moved mid-stream. The router's choice is staged as
    its drain makes it (`Router._drain_into`: the move listed, the instance it leaves out of the request's tier,
    here by draining it); the worker lets go of the request between steps and holds its KV, the other pulls that KV
    with the output so far and streams on, and the client reads the co-located text once; nothing is left held."""
    want = LLM(llama_tiny[0], **TINY).generate([PROMPT], LONG)[0]

    async def scenario():
        async with PdFleet(llama_tiny[0], ["both", "both"], kv_chunk_bytes=1024, **TINY) as fleet:
            service, router = fleet.service, fleet.service.router
            outs, source = [], []
            async for out in streaming(fleet, "r", LONG):
                outs.append(out)
                if not source and len(out.token_ids) >= 3:
                    source.append(router.requests["r"].instance_id)
                    router.leaving["r"] = source[0]
                    router.migrations.append(("r", source[0]))
                    router.start_draining(source[0], time.monotonic())
                    service._dispatch([], time.monotonic())
            await fleet.settled("both-0", "both-1")
            return outs, fleet, source[0]

    outs, fleet, source = run(scenario())
    target = ({"both-0", "both-1"} - {source}).pop()
    assert outs[-1].finish_reason == "length" and outs[-1].token_ids == want.token_ids
    assert joined(outs) == (want.token_ids, want.text)
    assert fleet.service.counts["moved"] == 1 and not fleet.service.counts["transfer_failed"]
    assert not fleet.service.router.leaving and not fleet.service.router.moving
    # the other engine computed no prompt: the KV of the prompt and the output so far came by transfer
    assert not any(s.num_prefill_tokens for s in fleet.engines[target].step_stats)
    assert any(s.num_decode_seqs for s in fleet.engines[target].step_stats)


def test_the_hand_off_frames_round_trip():
    frames = [p.Hello(p.PROTOCOL_VERSION, "prefill-0", 1, 2.0, 64, 16, 4096, 307, False, "model", b"c", "prefill",
                      4242),
              p.Prefilled("r", b"\x01\x02", 16), p.Import("r", b"\x01\x02", "10.0.0.2", 4242, -0.5),
              p.KvPull("r", 3), p.KvData(b"\x00" * 100), p.KvRefused("r", "not held"), p.KvDone("r")]
    for frame in frames:
        data = p.encode_frame(frame)
        assert p.decode_payload(data[p.HEADER.size:]) == frame


def test_a_kv_data_frame_written_from_where_the_chunk_lies_is_the_one_frame():
    """`encode_kv_head` of a chunk, its data as it lies and its checksum (`chunk_trailer`), joined, are one KvData
    frame of the length its header says, which decodes back to the chunk; another frame is whole in its head; over
    the frame bound it is refused."""
    data = bytes(range(256)) * 300
    chunk = KvChunk("r", 1, memoryview(data), 5)
    frame = p.encode_kv_head(chunk, len(data)) + data + chunk_trailer(5)
    assert p.HEADER.unpack_from(frame)[0] == len(frame) - p.HEADER.size
    assert decode_frame(p.decode_payload(frame[p.HEADER.size:]).frame) == chunk
    end = KvEnd("r", 2, 9)
    assert p.encode_kv_head(end, 0) == p.encode_frame(p.KvData(encode_frame(end)))
    with pytest.raises(ValueError, match="exceeds the bound"):
        p.encode_kv_head(chunk, len(data), max_bytes=len(data))


@pytest.mark.parametrize("policy", ["polyserve", "least-loaded"])
def test_the_router_places_prompts_on_prefill_and_hand_offs_on_decode_instances(policy):
    """The pure policy: a new request never goes to a decode instance, a hand-off only to one, and with no decode
    instance serving the hand-off waits at the head of its queue."""
    from cluster.fleet import RoutedRequest
    from cluster.router import Outcome

    tiers = EngineConfig(executor="emulated").tier_set
    router = Router(tiers, emulated_latency_model(), policy=policy)
    for instance_id, role in [("p", "prefill"), ("d", "decode")]:
        router.add_instance(instance_id, 0.0)
        router.set_role(instance_id, role)
    with pytest.raises(ValueError, match="role must be one of"):
        router.set_role("p", "router")
    router.on_ready("p", 4096, 0.0)
    slo = tiers.default.slo
    reqs = [RoutedRequest(f"r{i}", tiers.index(tiers.default.name), tiers.default.name, slo, 0.0, 100, 20)
            for i in range(3)]
    assert [router.submit(r, 0.0).instance_id for r in reqs] == ["p"] * 3  # the decode one is not even ready
    router.on_finished("r0", 1, 0.01, completed=False)
    assert router.hand_off(reqs[0], 0.01).outcome is Outcome.QUEUED
    router.on_ready("d", 4096, 0.02)  # the queued hand-off goes to the decode instance as it joins
    assert reqs[0].instance_id == "d" and reqs[0].num_computed_tokens == 100
    router.on_finished("r1", 1, 0.03, completed=False)
    assert router.hand_off(reqs[1], 0.03).instance_id == "d"
    router.set_role("p", "both")  # a whole-request instance takes new requests, never a hand-off
    router.on_finished("r2", 1, 0.04, completed=False)
    assert router.hand_off(reqs[2], 0.04).instance_id == "d"
    late = RoutedRequest("r3", reqs[0].tier_index, reqs[0].tier, slo, 0.05, 100, 20)
    # PolyServe's tier rules take the busiest attaining, the decode instance, which runs it whole; a baseline never
    # gives a decode instance a new request
    assert router.submit(late, 0.05).instance_id == ("d" if policy == "polyserve" else "p")


def slow_link_router(roles: list[tuple[str, str]], kv_tokens: dict[str, int] | None = None) -> Router:
    """A router over ready instances of these (id, role)s, each with `kv_tokens` of KV (1M where not given), the
    emulated tiers, and KV moving at 1 ms a token."""
    from scheduler.transfer import TransferLink, TransferModel

    link = TransferModel(TransferLink("slow", bandwidth=1e6, latency_s=0.0), bytes_per_token=1000)
    router = Router(EngineConfig(executor="emulated").tier_set, emulated_latency_model(), transfer=link)
    for instance_id, role in roles:
        router.add_instance(instance_id, 0.0)
        router.set_role(instance_id, role)
        router.on_ready(instance_id, (kv_tokens or {}).get(instance_id, 1 << 20), 0.0)
    return router


def test_the_router_fills_the_least_queued_prefill_instance_and_waits_for_the_transfer():
    """PolyServe's PD placement: a new prompt goes to the prefill instance with the least queued work of those that
    run it and its transfer by its first-token deadline, else whole to a decode instance; a hand-off is tested from
    when its KV arrives."""
    from cluster.fleet import RoutedRequest
    from cluster.router import How, Outcome

    router = slow_link_router([("p0", "prefill"), ("p1", "prefill"), ("d", "decode")])
    tiers = router.tiers
    tier = tiers[tiers.index("standard")]  # TTFT 500 ms, TPOT 50 ms
    assert [v.instance_id for v in router.fleet.prefill] == ["p0", "p1"] and router.fleet.idle == [router.fleet["d"]]
    reqs = {rid: RoutedRequest(rid, tiers.index(tier.name), tier.name, tier.slo, 0.0, prompt, 20)
            for rid, prompt in [("a", 300), ("b", 100), ("c", 100), ("x", 600)]}

    placed = {rid: router.submit(reqs[rid], 0.0) for rid in "abc"}
    assert all(d.how is How.PREFILL for d in placed.values())
    # each prompt goes where the least work waits: "b" beside "a"'s 300 tokens, "c" behind "b"'s 100
    assert [placed[rid].instance_id for rid in "abc"] == ["p0", "p1", "p1"]
    assert router.fleet["p0"].load > router.fleet["p1"].load > 0
    # each holds a place for its hand-off on the decode instance, which joined their tier for the first
    decode = router.fleet["d"]
    assert all(router.reserved[rid] is decode for rid in "abc") and decode.tier == reqs["a"].tier_index
    assert sorted(decode.residents) == ["a", "b", "c"]
    # "x"'s KV takes 600 ms to move, past its whole TTFT: no prefill instance attains it, so the decode instance
    # runs it whole, prefill and all
    x = router.submit(reqs["x"], 0.0)
    assert x.instance_id == "d" and x.how is How.OWN and "x" not in router.handoffs and "x" not in router.reserved
    # "b"'s KV arrives at 0.11 s, its next token due at 0.55 s: on time
    router.on_finished("b", 1, 0.01, completed=False)
    assert router.hand_off(reqs["b"], 0.01).instance_id == "d" and not reqs["b"].late
    # "a" first token at 0.3 s: its KV arrives at 0.6 s, past its next token's deadline; served late all the same
    router.on_finished("a", 1, 0.3, completed=False)
    assert router.hand_off(reqs["a"], 0.3).instance_id == "d" and reqs["a"].late


def test_a_prompt_the_prefill_pool_cannot_take_runs_whole_only_on_a_decode_instance_already_in_a_tier():
    """PolyServe's convertible decode instances: a new request that no prefill instance attains runs whole on a decode
    instance serving a tier, never on one scaled up from the idle pool for it; with none, it waits in its queue."""
    from cluster.fleet import RoutedRequest
    from cluster.router import How, Outcome

    router = slow_link_router([("p", "prefill"), ("d0", "decode"), ("d1", "decode")])
    tiers = router.tiers
    tier = tiers[tiers.index("standard")]  # TTFT 500 ms
    reqs = {rid: RoutedRequest(rid, tiers.index(tier.name), tier.name, tier.slo, 0.0, prompt, 20)
            for rid, prompt in [("x", 600), ("a", 100)]}
    # "x"'s KV takes 600 ms to move, past its TTFT: no prefill instance attains it, and both decode instances idle
    assert router.submit(reqs["x"], 0.0).outcome is Outcome.QUEUED
    assert len(router.fleet.idle) == 2 and not any(router.fleet[d].residents for d in ("d0", "d1"))
    # "a" goes to prefill, its hand-off's place held on a decode instance that joins the tier for it
    assert router.submit(reqs["a"], 0.0).how is How.PREFILL
    member = router.reserved["a"]
    assert member.tier == reqs["a"].tier_index
    # now "x" runs whole there, prefill and all; the other decode instance stays idle and empty
    [placement] = router.retry_queued(0.01)
    assert placement.request.request_id == "x" and placement.instance_id == member.instance_id
    assert placement.how is How.OWN and "x" not in router.handoffs
    [idle] = router.fleet.idle
    assert idle is not member and not idle.residents
    # a tight request's KV (TTFT 250 ms) moves too slowly as well: it runs whole on "standard"'s instance, demoted
    # (the tier's only one), not on the idle one
    tight = tiers[tiers.index("tight")]
    y = RoutedRequest("y", tiers.index(tight.name), tight.name, tight.slo, 0.01, 600, 20)
    y_placed = router.submit(y, 0.01)
    assert y_placed.instance_id == member.instance_id and y_placed.how is How.DEMOTED and not idle.residents


@pytest.mark.parametrize("kv_tokens, whole", [(4000, True), (1 << 20, False)])
def test_a_prompt_runs_whole_on_its_tiers_instance_only_where_kv_bounds_the_batch(kv_tokens, whole):
    """PolyServe's PD placement tries a new request whole on its own tier's decode instances whose KV, full at their
    residents' context, holds a batch that still steps within the TPOT (their steps have time to spare), before the
    prefill pool; an instance whose TPOT bounds its batch first is left to decode, the prompt going to prefill."""
    from cluster.fleet import RoutedRequest
    from cluster.router import How

    tiers = EngineConfig(executor="emulated").tier_set
    tier = tiers[tiers.index("standard")]
    router = Router(tiers, emulated_latency_model())
    for instance_id, role, kv in [("p", "prefill", 1 << 20), ("d", "decode", kv_tokens)]:
        router.add_instance(instance_id, 0.0)
        router.set_role(instance_id, role)
        router.on_ready(instance_id, kv, 0.0)
    a, b = (RoutedRequest(rid, tiers.index(tier.name), tier.name, tier.slo, 0.0, 100, 20) for rid in "ab")
    # nothing on the decode instance yet: how its batch is bounded is unknown, and "a" goes to prefill
    assert router.submit(a, 0.0).how is How.PREFILL and router.reserved["a"] is router.fleet["d"]
    placed = router.submit(b, 0.0)
    if whole:  # 4000 tokens of KV hold 39 of "a"'s context: far within the 50 ms TPOT
        assert (placed.instance_id, placed.how) == ("d", How.OWN)
        assert "b" not in router.handoffs and "b" not in router.reserved
    else:  # a million tokens hold ten thousand such: far over it
        assert placed.how is How.PREFILL and router.reserved["b"] is router.fleet["d"]


def test_a_prompt_run_whole_spares_the_least_loaded_of_a_looser_tiers_instances():
    """Demoted, a prompt run whole holds its instance to its tighter TPOT for its stay: of a looser tier's several
    instances it never takes the least-loaded, where that tier's own requests go once the busier ones are packed."""
    from cluster.fleet import RoutedRequest
    from cluster.router import How

    router = slow_link_router([("p", "prefill"), ("d0", "decode"), ("d1", "decode")], kv_tokens={"d0": 360})
    tiers = router.tiers
    standard, tight = (tiers[tiers.index(name)] for name in ("standard", "tight"))
    a, b = (RoutedRequest(rid, tiers.index(standard.name), standard.name, standard.slo, 0.0, prompt, 20)
            for rid, prompt in [("a", 50), ("b", 400)])
    # "a"'s hand-off place on d0; "b"'s does not fit d0's KV beside it, so d1 joins the tier for it
    assert router.submit(a, 0.0).how is How.PREFILL and router.reserved["a"].instance_id == "d0"
    assert router.submit(b, 0.0).how is How.PREFILL and router.reserved["b"].instance_id == "d1"
    d0, d1 = router.fleet["d0"], router.fleet["d1"]
    assert d0.tier == d1.tier == a.tier_index and d0.load < d1.load
    # a tight prompt no prefill instance takes in time (its KV 260 ms to move) fits either: it goes on the busier
    y = RoutedRequest("y", tiers.index(tight.name), tight.name, tight.slo, 0.0, 260, 20)
    placed = router.submit(y, 0.0)
    assert placed.instance_id == "d1" and placed.how is How.DEMOTED and "y" not in d0.residents


@pytest.mark.parametrize("a_leaves_at, left_out", [(0.04, 1), (5.0, 0)])
def test_stand_ins_count_only_beyond_the_places_expected_to_free_before_they_land(a_leaves_at, left_out):
    """A decode instance's test leaves out its latest stand-ins, as many as the instants it is expected to let a
    request go while one holds its place (the fleet's mean hold over the instance's mean gap between such instants):
    where requests leave it quickly a prompt finds room a stand-in would deny it; where they leave slowly it waits as
    before."""
    from cluster.fleet import RoutedRequest
    from cluster.router import How, Outcome

    tiers = EngineConfig(executor="emulated").tier_set
    tier = tiers[tiers.index("standard")]
    router = Router(tiers, emulated_latency_model())
    for instance_id, role, kv in [("p", "prefill", 1 << 20), ("d", "decode", 1000)]:
        router.add_instance(instance_id, 0.0)
        router.set_role(instance_id, role)
        router.on_ready(instance_id, kv, 0.0)
    decode = router.fleet["d"]

    def request(rid: str, at: float) -> RoutedRequest:
        return RoutedRequest(rid, tiers.index(tier.name), tier.name, tier.slo, at, 300, 20)

    # "a" goes to prefill (nothing on the decode instance yet) and holds its place 20 ms; "b" runs whole beside its
    # stand-in (the instance's KV bounds its batch: its steps have time to spare); the decode instance lets a request
    # go at 0.02 (the stand-in giving way), 0.03 ("b") and then ("a")
    a, b = request("a", 0.0), request("b", 0.0)
    assert router.submit(a, 0.0).how is How.PREFILL and router.submit(b, 0.0).how is How.OWN
    assert list(decode.stand_ins) == ["a"]
    router.on_finished("a", 1, 0.02, completed=False)
    assert router.hand_off(a, 0.02).instance_id == "d" and not decode.stand_ins
    router.on_finished("b", 20, 0.03)
    router.on_finished("a", 20, a_leaves_at)
    assert not decode.residents and router.hold_s == pytest.approx(0.02)
    assert decode.unseat_gap_s == pytest.approx(0.01 + MOVING_MEAN_WEIGHT * (a_leaves_at - 0.03 - 0.01))
    # again a stand-in ("c") and two prompts run whole beside it: the 1000-token KV has no room for a fourth prompt
    # of 300 unless the stand-in is left out
    now = a_leaves_at
    assert [router.submit(request(rid, now), now).how for rid in "cde"] == [How.PREFILL, How.OWN, How.OWN]
    fourth = request("f", now)
    assert [stand_in.request_id for stand_in in router._landing_after_departures(decode, fourth)] == ["c"][:left_out]
    kv_before = decode.kv_tokens
    placed = router.submit(fourth, now)
    assert (placed.outcome, placed.instance_id) == ((Outcome.PLACED, "d") if left_out else (Outcome.QUEUED, None))
    # left out only for the test's while: the stand-in is still a resident, its KV counted
    assert decode.residents["c"] is not None and decode.kv_tokens == kv_before + 300 * left_out
    assert list(decode.stand_ins) == ["c"]


def test_a_prompt_goes_to_prefill_only_with_a_decode_place_held_for_it():
    """PolyServe's PD admission: a prompt goes to the prefill pool only while a decode instance would take its
    hand-off, and holds that place (a stand-in resident) until it leaves the prefill instance; one with no place
    waits in its queue, and goes once a place frees. A lost instance gives its places and stand-ins back."""
    from cluster.fleet import RoutedRequest
    from cluster.router import How, Outcome

    tiers = EngineConfig(executor="emulated").tier_set
    tier = tiers[tiers.index("standard")]
    router = Router(tiers, emulated_latency_model())
    for instance_id, role, kv in [("p0", "prefill", 1 << 20), ("p1", "prefill", 1 << 20), ("d", "decode", 1000)]:
        router.add_instance(instance_id, 0.0)
        router.set_role(instance_id, role)
        router.on_ready(instance_id, kv, 0.0)
    reqs = {rid: RoutedRequest(rid, tiers.index(tier.name), tier.name, tier.slo, 0.0, 600, 20) for rid in "ab"}
    decode = router.fleet["d"]

    assert router.submit(reqs["a"], 0.0).how is How.PREFILL
    assert router.reserved["a"] is decode and decode.kv_tokens == 601  # its prompt and first token
    # "b" would fit the decode instance's KV alone, not beside "a": it waits, neither on prefill nor run whole
    assert router.submit(reqs["b"], 0.0).outcome is Outcome.QUEUED and "b" not in router.reserved
    assert [r.request_id for r in router.queues[reqs["b"].tier_index]] == ["b"]
    # "a" hands off: its stand-in gives way to it, and "b" still finds no room
    router.on_finished("a", 1, 0.05, completed=False)
    assert "a" not in router.reserved and "a" not in decode.residents
    assert router.hand_off(reqs["a"], 0.05).instance_id == "d" and decode.residents["a"] is reqs["a"]
    assert router.retry_queued(0.06) == []
    # "a" done: "b" goes to prefill from the queue, holding the freed place
    router.on_finished("a", 20, 0.2)
    [placement] = router.retry_queued(0.2)
    assert placement.request.request_id == "b" and placement.how is How.PREFILL
    assert router.reserved["b"] is decode and decode.residents["b"] is not reqs["b"]  # a stand-in
    # the decode instance lost: the stand-in is no lost request ("b" still runs on prefill), its place is gone
    assert router.on_lost("d", 0.6) == [] and not router.reserved
    assert router.requests["b"].instance_id == placement.instance_id
    # with no decode instance serving, a prompt still goes to prefill (its hand-off waits for one to join)
    later = RoutedRequest("c", reqs["a"].tier_index, tier.name, tier.slo, 0.7, 600, 20)
    assert router.submit(later, 0.7).how is How.PREFILL and "c" not in router.reserved
    # a prefill instance lost gives back the decode places its prompts held
    router.add_instance("d2", 0.8)
    router.set_role("d2", "decode")
    router.on_ready("d2", 1 << 20, 0.8)
    late = RoutedRequest("e", reqs["a"].tier_index, tier.name, tier.slo, 0.8, 100, 20)
    placed = router.submit(late, 0.8)
    assert placed.how is How.PREFILL and router.reserved["e"] is router.fleet["d2"]
    lost = router.on_lost(placed.instance_id, 0.9)
    assert "e" in [r.request_id for r in lost] and "e" not in router.reserved
    assert "e" not in router.fleet["d2"].residents
