"""The streaming interface and the emulated executor."""
from __future__ import annotations

import asyncio
import time
from collections import deque

import pytest

from engine import EngineConfig, InvalidRequestError, LLM, SamplingParams, build_engine
from engine.async_engine import AsyncEngine


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
