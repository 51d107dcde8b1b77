"""Step reports coalesced on the worker (cluster/step_reports.py): the rule, a live worker whose router hears every
step's timing and, at every report, the view it would have had from a report per step, and the simulator under the
same rule."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from bench.router_scale import SameClockLink
from cluster import protocol as p
from cluster.fleet import RoutedRequest
from cluster.router import InstanceReport, Router
from cluster.service import RouterService
from cluster.sim.simulator import SimConfig, Simulator
from cluster.step_reports import StepReportCoalescer
from cluster.worker import Worker, resident_report
from engine.config import EngineConfig
from engine.llm import build_engine
from scheduler.fcfs import FCFSPolicy
from scheduler.prediction_error import prediction_error
from scheduler.roofline import emulated_latency_model
from scheduler.slo import SLO
from scheduler.tiers import Tier, TierSet

TOKEN = "coalescing-test-cluster-token"
TIERS = TierSet([Tier("std", ttft_ms=5000.0, tpot_ms=500.0)])


def timing(i: int) -> p.StepTiming:
    return p.StepTiming(float(i), 0.01, 0, 1, 100 + i, 10, 1, 0, 1)


def resident(rid: str, computed: int, output: int, prompt: int = 10) -> p.Resident:
    return p.Resident(rid, prompt, computed, output)


# ---- the rule ------------------------------------------------------------------------------------------------
def test_decode_progress_is_held_for_every_steps_and_sent_with_every_timing():
    c = StepReportCoalescer(every_steps=4, num_total_blocks=64)
    first = c.add(timing(0), [resident("a", 10, 1)])  # a joined (and its first token came out): at once
    assert first is not None and first.residents == [resident("a", 10, 1)] and first.num_total_blocks == 64
    sent = [c.add(timing(i), [resident("a", 10 + i, 1 + i)]) for i in range(1, 9)]
    assert [r is not None for r in sent] == [False, False, False, True] * 2
    assert [t.start for t in sent[3].steps] == [1.0, 2.0, 3.0, 4.0]  # every held step's timing, oldest first
    assert sent[7].residents == [resident("a", 18, 9)]  # only the newest progress
    assert c.flush() is None  # nothing held


@pytest.mark.parametrize("change", ["joined", "left", "first token", "preempted"])
def test_what_placement_depends_on_is_sent_at_once(change):
    c = StepReportCoalescer(every_steps=100)
    before = [resident("a", 12, 3), resident("b", 4, 0)]  # b prefilling
    assert c.add(timing(0), before) is not None
    assert c.add(timing(1), [resident("a", 13, 4), resident("b", 8, 0)]) is None  # decode and prefill progress
    after = {"joined": [resident("a", 14, 5), resident("b", 9, 0), resident("c", 0, 0)],
             "left": [resident("b", 9, 0)],
             "first token": [resident("a", 14, 5), resident("b", 10, 1)],
             "preempted": [resident("a", 0, 5), resident("b", 9, 0)]}[change]
    report = c.add(timing(2), after)
    assert report is not None and len(report.steps) == 2
    assert report.residents == after  # each changed since the last report


def test_a_report_lists_only_the_residents_that_changed_and_flush_sends_what_is_held():
    c = StepReportCoalescer(every_steps=3)
    c.add(timing(0), [resident("a", 11, 1), resident("q", 0, 0)])  # q waits for KV: it does not move
    assert c.add(timing(1), [resident("a", 12, 2), resident("q", 0, 0)]) is None
    held = c.flush()
    assert held is not None and [t.start for t in held.steps] == [1.0] and held.residents == [resident("a", 12, 2)]
    assert c.flush() is None
    c.reset()  # a new router hears everyone again
    assert c.add(timing(2), [resident("a", 13, 3), resident("q", 0, 0)]).residents == \
        [resident("a", 13, 3), resident("q", 0, 0)]


def test_every_steps_must_be_a_positive_integer():
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match="every_steps"):
            StepReportCoalescer(every_steps=bad)


def test_a_report_needs_a_step():
    frame = p.encode_frame(p.StepReport([], 10, []))
    with pytest.raises(p.ProtocolError):
        p.decode_payload(frame[p.HEADER.size:])


# ---- a live worker ---------------------------------------------------------------------------------------------
def _place(routers, rid: str, prompt: int, max_tokens: int, now: float = 0.0) -> None:
    for router in routers:
        req = RoutedRequest(rid, 0, "std", TIERS[0].slo, now, prompt, max_tokens)
        assert router.submit(req, now).instance_id == "w"


def _view(router: Router) -> dict:
    view = router.fleet["w"]
    return {"residents": {rid: (r.num_computed_tokens, r.num_output_tokens) for rid, r in view.residents.items()},
            "kv_tokens": view.kv_tokens, "iteration_end": view.iteration_end,
            "steps_observed": router.model.num_observations}


def test_a_coalescing_worker_sends_fewer_reports_and_its_router_sees_what_a_report_per_step_shows(tmp_path):
    """Five requests (long prompts prefilled in chunks, two arriving mid-run, different lengths) on a worker that
    holds up to 8 steps per report. Its router, fed the frames as the service handles them, is compared before
    every report with a second router told every step so far (the engine's own record, taken right after each
    step): whenever both hold the residents the engine holds, their progress, the KV, the iteration's end and the
    steps the latency model observed are the same."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 4096, "eos_token_id": 2}))
    engine = build_engine(EngineConfig(model=str(tmp_path), executor="emulated", num_kv_blocks=256),
                          FCFSPolicy(64, 64), step_time=lambda *_: 0.001)
    truth: list[tuple] = []  # every step: its stats and the residents after it
    engine.step_hooks.append(lambda stats: truth.append((stats, resident_report(engine))))
    requests = {"a": (150, 60), "b": (20, 40), "c": (90, 70), "late-d": (130, 30), "late-e": (10, 50)}
    late = ("late-d", "late-e")  # sent once b finished

    async def run() -> list:
        worker = Worker(engine, instance_id="w", token=TOKEN, heartbeat_s=60.0, report_every_steps=8)
        port = await worker.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        hello = await p.read_message(reader)
        writer.write(p.encode_frame(p.Auth(p.auth_proof(TOKEN, hello.challenge))))

        def submit(rid: str) -> None:
            prompt, max_tokens = requests[rid]
            writer.write(p.encode_frame(p.Submit(rid, [3 + i % 900 for i in range(prompt)],
                                                 p.SamplingSpec(temperature=0.0, max_tokens=max_tokens,
                                                                ignore_eos=True), "std", SLO(5000, 500), 0.0)))

        for rid in ("a", "b", "c"):
            submit(rid)
        frames, finished = [], set()
        async with asyncio.timeout(30):
            while len(finished) < len(requests):
                msg = await p.read_message(reader)
                frames.append(msg)
                if isinstance(msg, p.Finish):
                    finished.add(msg.request_id)
                    if msg.request_id == "b":
                        for rid in late:
                            submit(rid)
        writer.close()
        await worker.stop()
        return frames

    frames = asyncio.run(run())
    reports = [m for m in frames if isinstance(m, p.StepReport)]
    assert len(truth) > 80
    assert [t.start for r in reports for t in r.steps] == [s.start for s, _ in truth]  # every step's timing
    assert len(reports) < len(truth) / 3

    coalesced, per_step = Router(TIERS, emulated_latency_model()), Router(TIERS, emulated_latency_model())
    for router in (coalesced, per_step):
        router.add_instance("w", 0.0)
        router.on_ready("w", 256 * 16, 0.0)
    for rid in ("a", "b", "c"):
        _place((coalesced, per_step), rid, *requests[rid])
    service = RouterService(coalesced, token=TOKEN)
    link = SameClockLink("w")
    told = compared = 0  # steps told to per_step; views compared

    def compare() -> int:
        engine_holds = {r.request_id for r in truth[told - 1][1]}
        if set(coalesced.fleet["w"].residents) != engine_holds or set(per_step.fleet["w"].residents) != engine_holds:
            return 0  # a finish or a submit on its way
        heard, every_step = _view(coalesced), _view(per_step)
        # the online fit refits at other moments from the same steps: the load it predicts agrees to rounding
        assert heard.pop("iteration_end") == pytest.approx(every_step.pop("iteration_end"), rel=0, abs=1e-6)
        assert heard == every_step, f"after step {told}"
        return 1

    for msg in frames:
        if isinstance(msg, p.StepReport):
            if told:
                compared += compare()
            service._on_message(link, msg)
            while told < len(truth) and truth[told][0].start <= msg.steps[-1].start:
                stats, residents = truth[told]
                per_step.on_report("w", InstanceReport(stats.start + stats.duration, stats.num_blocks_used,
                                                       residents, (stats,)), 0.0)
                told += 1
        elif isinstance(msg, p.Finish):
            for router in (coalesced, per_step):
                router.on_finished(msg.request_id, msg.num_output_tokens, 0.0)
            if msg.request_id == "b":
                stats = truth[told - 1][0]
                for rid in late:
                    _place((coalesced, per_step), rid, *requests[rid], now=stats.start + stats.duration)
    assert told == len(truth) and coalesced.model.num_observations == len(truth)
    assert not coalesced.fleet["w"].residents and compare() == 1
    assert compared > len(reports) // 2


# ---- the simulator ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def h200(h200_fleet):
    return h200_fleet


def test_the_simulator_coalesces_as_the_worker_and_fast_forward_still_changes_nothing(h200):
    """Under the worker's rule the router hears every step's timing, fast-forward changes nothing, and the router's
    later view does not cost attainment (one seed, a fleet loaded to a few percent of misses)."""
    model, tiers, factory = h200
    workload = factory.poisson(150.0, 4.0, 1)
    error = prediction_error("gpu-typical")
    runs = {}
    for every, fast in ((1, True), (8, True), (8, False)):
        sim = Simulator(SimConfig(num_instances=4, report_every_steps=every, fast_forward=fast,
                                  prediction_error=error), tiers, model)
        runs[every, fast] = (sim, sim.run(workload))
        assert sim.router.model.num_observations == runs[every, fast][1].num_steps  # every step reached the router
    (_, fast), (_, slow) = runs[8, True], runs[8, False]
    assert np.array_equal(fast.attained, slow.attained) and fast.counts == slow.counts
    np.testing.assert_allclose(fast.ttft, slow.ttft, rtol=0, atol=1e-9)
    np.testing.assert_allclose(fast.worst_lateness, slow.worst_lateness, rtol=0, atol=1e-9)
    every_step = runs[1, True][1].attainment()
    assert every_step < 1.0 and abs(fast.attainment() - every_step) < 0.03
    with pytest.raises(ValueError, match="report_every_steps"):
        SimConfig(report_every_steps=0)
