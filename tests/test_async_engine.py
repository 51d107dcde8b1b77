"""The streaming interface and the emulated executor."""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

import pytest

from engine import EngineConfig, InvalidRequestError, LLM, SamplingParams, build_engine
from engine.async_engine import AsyncEngine
from engine.engine import Engine
from engine.structured_output import JSON_OBJECT, Grammars, StructuredOutput


def step_time(prefill: int, decodes: int, kv: int, seqs: int) -> float:
    return 0.002 + 1e-5 * prefill + 1e-4 * decodes


@pytest.fixture
def emulated(llama_tiny):
    return build_engine(EngineConfig(model=llama_tiny[0], executor="emulated", num_kv_blocks=64), step_time=step_time)


def test_emulated_executor_sleeps_the_given_step_time_and_is_deterministic(llama_tiny):
    llm = LLM(llama_tiny[0], executor="emulated", num_kv_blocks=64, step_time=step_time)
    params = SamplingParams(max_tokens=20)
    t0 = time.monotonic()
    a = llm.generate([[1, 2, 3], [7] * 40], params)
    elapsed = time.monotonic() - t0
    b = llm.generate([[1, 2, 3], [7] * 40], params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == 20 for o in a)  # emulated tokens never end a sequence early
    stats = list(llm.engine.step_stats)[:20]
    expected = sum(step_time(s.num_prefill_tokens, s.num_decode_seqs, s.num_kv_tokens, s.num_seqs) for s in stats)
    assert expected <= elapsed < expected + 0.5
    assert all(s.duration >= step_time(s.num_prefill_tokens, s.num_decode_seqs, s.num_kv_tokens, s.num_seqs)
               for s in stats)


def test_stream_tokens_as_they_are_produced(emulated):
    async def main():
        aengine = AsyncEngine(emulated)
        await aengine.start()
        try:
            async def consume(rid, n):
                outs = [o async for o in aengine.generate(rid, [3, 4, 5], SamplingParams(max_tokens=n))]
                return outs
            a, b = await asyncio.gather(consume("a", 8), consume("b", 3))
        finally:
            await aengine.stop()
        return a, b

    a, b = asyncio.run(main())
    assert [len(o.new_token_ids) for o in a] == [1] * 8 and a[-1].finished and not a[0].finished
    assert [t for o in a for t in o.new_token_ids] == a[-1].token_ids
    assert len(b) == 3 and b[-1].finish_reason == "length"


def test_abort_by_leaving_the_stream_frees_kv(emulated):
    async def main():
        aengine = AsyncEngine(emulated)
        await aengine.start()
        try:
            gen = aengine.generate("x", list(range(50)), SamplingParams(max_tokens=1000))
            async for out in gen:
                if len(out.token_ids) >= 3:
                    break
            await gen.aclose()
            with pytest.raises(InvalidRequestError, match="empty"):
                async for _ in aengine.generate("bad", [], SamplingParams()):
                    pass
            for _ in range(100):
                if await aengine.call(lambda e: not e.has_unfinished()):
                    break
                await asyncio.sleep(0.01)
            ok = [o async for o in aengine.generate("after", [1, 2], SamplingParams(max_tokens=2))]
            return await aengine.call(lambda e: (e.blocks.num_free_blocks(), e.blocks.num_total_blocks)), ok
        finally:
            await aengine.stop()

    (free, total), ok = asyncio.run(main())
    assert free == total and ok[-1].finished


def test_every_step_reaches_the_latency_model_once_and_the_stream_beyond_the_history(emulated):
    """The engine alone feeds its online latency model, once per step; AsyncEngine's per-step callback (what
    /metrics and the worker's step reports hang on) fires for every step, also past the bounded step history."""
    emulated.step_stats = deque(maxlen=4)
    seen, snapshots = [], []

    async def main():
        aengine = AsyncEngine(emulated, on_step=lambda stats, snap: (seen.append(stats), snapshots.append(snap)),
                              snapshot=lambda engine: len(engine.running))
        await aengine.start()
        try:
            outs = await asyncio.gather(*[_collect(aengine, f"r{i}", 12) for i in range(3)])
            for _ in range(100):  # the last step's callback is delivered after the last output
                if len(seen) == emulated.num_steps:
                    break
                await asyncio.sleep(0.01)
        finally:
            await aengine.stop()
        return outs

    outs = asyncio.run(main())
    assert all(o[-1].finished for o in outs)
    assert emulated.num_steps >= 12 > len(emulated.step_stats)
    assert len(seen) == emulated.num_steps == emulated.latency_model.num_observations
    assert len({id(s) for s in seen}) == len(seen)
    assert max(snapshots) == 3 and snapshots[-1] == 0  # taken on the engine thread right after each step


async def _collect(aengine: AsyncEngine, rid: str, n: int):
    return [o async for o in aengine.generate(rid, [3, 4, 5], SamplingParams(max_tokens=n))]


# ---- a caller that stops waiting ------------------------------------------------------------------------------
# A cancelled task cancels the command it awaits if the engine thread has not started it; one that already ran stays
# done, and what it left in the engine is undone (a request added or a reservation made for a stream nobody reads).
HANG_GUARD_S = 30  # a dead engine thread would hang these tests: they fail instead


class Gate:
    """Holds the engine thread in a command until opened: commands queued meanwhile wait behind it."""

    def __init__(self, aengine: AsyncEngine):
        self.event = threading.Event()
        self.task = asyncio.create_task(aengine.call(lambda engine: self.event.wait()))

    async def open(self) -> None:
        self.event.set()
        await asyncio.wait_for(self.task, HANG_GUARD_S)


def hold_loop_until(condition) -> None:
    """Blocks the event loop (so no awaiting task resumes) until the engine thread made `condition` true."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, "the engine thread never got there"
        time.sleep(0.001)


async def cancelled(task: asyncio.Task) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def engine_state(aengine: AsyncEngine, request_id: str):
    """(request held, reservation held, free blocks) once every command queued so far has run."""
    return await asyncio.wait_for(aengine.call(lambda e: (request_id in e.requests, request_id in e.imports,
                                                          e.blocks.num_free_blocks())), HANG_GUARD_S)


async def _drain(outputs):
    return [o async for o in outputs]


def test_a_request_cancelled_before_its_add_ran_is_never_added_and_the_engine_serves_on(emulated):
    async def main():
        aengine = AsyncEngine(emulated)
        await aengine.start()
        try:
            free = emulated.blocks.num_free_blocks()
            gate = Gate(aengine)
            task = asyncio.create_task(_drain(aengine.generate("x", [1, 2, 3], SamplingParams(max_tokens=1000))))
            await asyncio.sleep(0)  # its add is queued behind the gate
            await cancelled(task)
            await gate.open()
            state = await engine_state(aengine, "x")
            after = await asyncio.wait_for(_collect(aengine, "after", 3), HANG_GUARD_S)
            return free, state, after
        finally:
            await aengine.stop()

    free, state, after = asyncio.run(main())
    assert state == (False, False, free)
    assert after[-1].finished and len(after[-1].token_ids) == 3


def test_a_request_cancelled_after_its_add_ran_is_aborted_and_its_blocks_freed(emulated):
    async def main():
        aengine = AsyncEngine(emulated)
        await aengine.start()
        try:
            free = emulated.blocks.num_free_blocks()
            task = asyncio.create_task(_drain(aengine.generate("x", list(range(40)), SamplingParams(max_tokens=1000))))
            await asyncio.sleep(0)  # its add is queued
            hold_loop_until(lambda: "x" in emulated.requests)
            await cancelled(task)
            return free, await engine_state(aengine, "x")
        finally:
            await aengine.stop()

    free, state = asyncio.run(main())
    assert state == (False, False, free)


def test_an_add_refused_for_an_id_in_use_leaves_that_request_running(emulated):
    async def main():
        aengine = AsyncEngine(emulated)
        await aengine.start()
        try:
            first = aengine.generate("x", [1, 2, 3], SamplingParams(max_tokens=6))
            outs = [await anext(first)]
            with pytest.raises(InvalidRequestError, match="already in use"):  # while its stream is open
                await anext(aengine.generate("x", [4, 5], SamplingParams(max_tokens=6)))
            outs += await asyncio.wait_for(_drain(first), HANG_GUARD_S)
            # held by the engine with no stream here: the engine refuses it, and nothing undoes the refusal
            await aengine.call(Engine.add_request, "y", [1, 2, 3], SamplingParams(max_tokens=1000))
            with pytest.raises(InvalidRequestError, match="already in use"):
                await anext(aengine.generate("y", [4, 5], SamplingParams(max_tokens=6)))
            held = await engine_state(aengine, "y")
            aengine.abort("y")
            return outs, held
        finally:
            await aengine.stop()

    outs, (held, _, _) = asyncio.run(main())
    assert outs[-1].finished and outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 6
    assert held


MAX_IMPORTED = 200  # steps enough that an import cancelled right after it was applied is still running


class HeldKv:
    """A KvSource reading a request held by a prefill engine of this process."""

    def __init__(self, prefill: Engine, request_id: str):
        self.prefill, self.request_id = prefill, request_id
        self.sent = self.applied_done = self.closed = False

    async def frames(self, first_block: int, chunk_memory):  # the frames as read, not into the receiver's memory
        for frame in self.prefill.export_kv(self.request_id, first_block):
            yield frame
        self.sent = True

    async def applied(self) -> None:
        self.prefill.release_handoff(self.request_id)
        self.applied_done = True

    def close(self) -> None:
        self.closed = True


def prefilled(model: str, request_id: str, params: SamplingParams, prompt=tuple(range(30))):
    """(prefill engine, hand-off) of a request run to its first token on an emulated prefill engine."""
    prefill = build_engine(EngineConfig(model=model, executor="emulated", role="prefill", num_kv_blocks=64),
                           step_time=lambda *_: 0.0)
    prefill.add_request(request_id, list(prompt), params)
    while prefill.has_unfinished():
        prefill.step()
    return prefill, prefill.handoff(request_id)


@pytest.fixture
def decode(llama_tiny):
    return build_engine(EngineConfig(model=llama_tiny[0], executor="emulated", role="decode", num_kv_blocks=64),
                        step_time=step_time)


@pytest.mark.parametrize("when", ["before the reservation", "after the reservation", "after the import applied"])
def test_an_import_cancelled_gives_its_blocks_back(llama_tiny, decode, when):
    prefill, handoff = prefilled(llama_tiny[0], "x", SamplingParams(max_tokens=MAX_IMPORTED))

    async def main():
        aengine = AsyncEngine(decode)
        await aengine.start()
        try:
            free = decode.blocks.num_free_blocks()
            source = HeldKv(prefill, "x")
            gate = Gate(aengine) if when == "before the reservation" else None
            task = asyncio.create_task(_drain(aengine.generate_imported(handoff, source)))
            await asyncio.sleep(0)  # its reservation is queued
            if gate is not None:
                await cancelled(task)
                await gate.open()
            elif when == "after the reservation":
                hold_loop_until(lambda: "x" in decode.imports)
                await cancelled(task)
            else:
                while not source.sent:  # the task queues finish_import as it reads past the last frame
                    await asyncio.sleep(0)
                hold_loop_until(lambda: "x" in decode.requests)
                await cancelled(task)
            state = await engine_state(aengine, "x")
            kept = "x" in prefill.handoffs  # nothing told the sender it may let go of the KV
            again = HeldKv(prefill, "x")
            outs = await asyncio.wait_for(_drain(aengine.generate_imported(handoff, again)), HANG_GUARD_S)
            return free, state, source, kept, again, outs, await engine_state(aengine, "x")
        finally:
            await aengine.stop()

    free, state, source, kept, again, outs, after = asyncio.run(main())
    assert state == (False, False, free)
    assert source.closed and not source.applied_done and kept
    assert again.applied_done and "x" not in prefill.handoffs  # another import of it runs whole
    assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == MAX_IMPORTED
    assert after == (False, False, free)


def test_an_imported_request_finds_its_grammar_compiled_off_the_engine_thread(default_model, monkeypatch):
    """As for a request added here, the structured output's grammar is compiled before the import, not on the step
    loop: applying the import (on the engine thread) takes the grammar compiled already."""
    params = SamplingParams(temperature=0, max_tokens=6, structured_output=StructuredOutput(JSON_OBJECT))
    prefill, handoff = prefilled(default_model, "x", params)
    decode = build_engine(EngineConfig(model=default_model, executor="emulated", role="decode", num_kv_blocks=64),
                          step_time=lambda *_: 0.0)
    compiles = []  # (thread, grammar) of every compile asked of the decode engine's grammars
    compile = Grammars.compile

    def recording(grammars: Grammars, spec: StructuredOutput):
        grammar = compile(grammars, spec)
        if grammars is decode.grammars:
            compiles.append((threading.current_thread().name, grammar))
        return grammar

    monkeypatch.setattr(Grammars, "compile", recording)

    async def main():
        aengine = AsyncEngine(decode)
        await aengine.start()
        try:
            return await asyncio.wait_for(_drain(aengine.generate_imported(handoff, HeldKv(prefill, "x"))),
                                          HANG_GUARD_S)
        finally:
            await aengine.stop()

    outs = asyncio.run(main())
    assert outs[-1].finished
    (first_thread, compiled), *on_engine_thread = compiles
    assert first_thread != "engine-step-loop"
    assert [thread for thread, _ in on_engine_thread] == ["engine-step-loop"]
    assert on_engine_thread[0][1] is compiled  # the matcher's grammar: the one compiled before
