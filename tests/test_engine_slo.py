"""The multi-SLO policy embedded in the engine: an emulated engine with a known step-time function, in virtual time."""
from __future__ import annotations

import random

import pytest

from engine import EngineConfig, build_engine
from engine.engine import InvalidRequestError
from engine.sampling_params import SamplingParams
from scheduler import RequestSnapshot, measure_request
from scheduler.slo import SLO


class KnownLatency:
    """10 ms per step + 0.1 ms per prefill token + 0.2 ms per decode + 1 µs per KV token read."""

    def predict(self, prefill: int, decodes: int, kv: int) -> float:
        return 0.010 + 1e-4 * prefill + 2e-4 * decodes + 1e-6 * kv


class VirtualClock:
    def __init__(self):
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


TIGHT, LOOSE = SLO(ttft_ms=300, tpot_ms=30), SLO(ttft_ms=5000, tpot_ms=500)


def workload(seed: int = 0):
    """12 long-prompt batch requests and 8 short voice-like requests, interleaved over 1.2 s."""
    rng = random.Random(seed)
    reqs = [(0.1 * i, "loose", [rng.randrange(307) for _ in range(1000)], 20) for i in range(12)]
    reqs += [(0.03 + 0.15 * i, "tight", [rng.randrange(307) for _ in range(50)], 40) for i in range(8)]
    return sorted(reqs, key=lambda r: r[0])


def run(folder: str, policy: str) -> dict[str, list[bool]]:
    clock = VirtualClock()
    engine = build_engine(EngineConfig(model=folder, executor="emulated", num_kv_blocks=1200, batch_policy=policy,
                                       max_num_batched_tokens=2048), latency_model=KnownLatency())
    engine.executor.sleep, engine.clock = clock.advance, clock.now
    pending = workload()
    done = {}
    slos = {}
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= clock.t:
            arrival, tier, prompt, n = pending.pop(0)
            rid = f"{tier}-{arrival:.2f}"
            slos[rid] = TIGHT if tier == "tight" else LOOSE
            engine.add_request(rid, prompt, SamplingParams(max_tokens=n), slo=slos[rid], arrival=arrival, tier=tier)
        if not engine.has_unfinished():
            clock.t = pending[0][0]
            continue
        done.update({o.request_id: o for o in engine.step() if o.finished})
    attained: dict[str, list[bool]] = {"tight": [], "loose": []}
    for rid, out in done.items():
        attained[rid.split("-")[0]].append(measure_request(slos[rid], out.arrival, out.token_times).attained)
    return attained


def test_polyserve_keeps_tight_slos_that_fcfs_misses(llama_tiny):
    poly = run(llama_tiny[0], "polyserve")
    fcfs = run(llama_tiny[0], "fcfs")
    assert len(poly["tight"]) == len(fcfs["tight"]) == 8
    poly_tight, fcfs_tight = sum(poly["tight"]) / 8, sum(fcfs["tight"]) / 8
    assert poly_tight == 1.0, poly
    assert fcfs_tight <= 0.25, fcfs  # 2048-token steps of long prefills are ~210 ms: every 30 ms budget breaks
    assert sum(poly["loose"]) / 12 >= 0.9  # and the batch requests still make their loose targets


def test_engine_admission_test_and_predicted_iteration(llama_tiny):
    """The engine's admission test (what engine.serve refuses by) reads its latency model and KV pool; a step
    predicts its own end by the same model."""
    clock = VirtualClock()
    engine = build_engine(EngineConfig(model=llama_tiny[0], executor="emulated", num_kv_blocks=64),
                          latency_model=KnownLatency())
    engine.executor.sleep, engine.clock = clock.advance, clock.now
    kv_tokens = engine.blocks.num_total_blocks * engine.block_size
    assert kv_tokens == 64 * 16
    check = engine.attainability.check_idle
    short = RequestSnapshot(arrival=0.0, num_prompt_tokens=100, max_tokens=20, slo=TIGHT)
    assert check(short, kv_tokens).ok
    too_fast = RequestSnapshot(arrival=0.0, num_prompt_tokens=100, max_tokens=20, slo=SLO(ttft_ms=300, tpot_ms=5))
    verdict = check(too_fast, kv_tokens)
    assert not verdict.ok and verdict.reason.value in ("tpot", "second_token")
    too_long = RequestSnapshot(arrival=0.0, num_prompt_tokens=900, max_tokens=200, slo=LOOSE)
    verdict = check(too_long, kv_tokens)  # 1100 tokens of KV in a 1024-token pool
    assert not verdict.ok and verdict.reason.value == "kv_capacity"
    for i in range(3):
        engine.add_request(f"r{i}", list(range(1, 60)), SamplingParams(max_tokens=50), slo=TIGHT)
    engine.step()
    assert engine.iteration_end == pytest.approx(KnownLatency().predict(3 * 59, 0, 3 * 59))
    assert {r.tier for r in engine.running} == {engine.tiers.for_tpot(TIGHT.tpot_ms).name}


def test_engine_makes_the_slo_concrete_once_at_admission(llama_tiny):
    """A request naming no SLO gets the default tier's; a tier name gets that tier's; an SLO of its own is kept and
    joins its tier; an SLO no tier hosts, or an unknown tier, is refused before anything runs."""
    config = EngineConfig(model=llama_tiny[0], executor="emulated", num_kv_blocks=64,
                          tiers="fast:30:300,slow:500:5000", default_tier="fast")
    engine = build_engine(config, latency_model=KnownLatency())
    params = SamplingParams(max_tokens=2)
    assert (engine.add_request("none", [1, 2], params).tier, engine.requests["none"].slo) == \
        ("fast", SLO(300, 30))
    assert engine.add_request("named", [1, 2], params, slo="slow").slo == SLO(5000, 500)
    own = engine.add_request("own", [1, 2], params, slo=SLO(1000, 100))
    assert (own.tier, own.slo) == ("fast", SLO(1000, 100))  # between the tiers: the tighter one hosts it
    with pytest.raises(InvalidRequestError, match="tighter than the tightest tier"):
        engine.add_request("too-tight", [1, 2], params, slo=SLO(1000, 5))
    with pytest.raises(InvalidRequestError, match="unknown tier"):
        engine.add_request("unknown", [1, 2], params, slo="gold")
    assert set(engine.requests) == {"none", "named", "own"}


def test_engine_feeds_its_headroom_the_outcomes_its_policy_plans_with(llama_tiny):
    """Steps four times slower than the engine's model: the tight request's first token is on time (60 ms of its
    300), then every token falls 11 ms further behind its 30 ms budget and token 23 is late: a miss of packing.
    The loose request keeps every deadline."""
    clock = VirtualClock()
    known = KnownLatency()
    engine = build_engine(EngineConfig(model=llama_tiny[0], executor="emulated", num_kv_blocks=64),
                          latency_model=known, step_time=lambda p, d, k, n: 4 * known.predict(p, d, k))
    engine.executor.sleep, engine.clock = clock.advance, clock.now
    assert engine.policy.headroom is engine.headroom and engine.headroom.margin == 0.0
    engine.add_request("tight", list(range(1, 51)), SamplingParams(max_tokens=40, ignore_eos=True), slo=TIGHT,
                       arrival=0.0)
    while engine.has_unfinished():
        engine.step()
    assert (engine.headroom.num_missed, engine.headroom.num_attained) == (1, 0)
    assert engine.headroom.margin == pytest.approx(engine.headroom.step)
    engine.add_request("loose", list(range(1, 51)), SamplingParams(max_tokens=5, ignore_eos=True), slo=LOOSE,
                       arrival=clock.t)
    while engine.has_unfinished():
        engine.step()
    assert (engine.headroom.num_missed, engine.headroom.num_attained) == (1, 1)
