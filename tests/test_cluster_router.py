"""The router and autoscaler as pure policies, on hand-built fleets in virtual time (no processes, no sockets).

Instances have a KV pool of 4000 tokens and requests a 1000-token prompt with 100 output tokens: an instance of
the roofline model (Llama-3.1-8B on H200) holds three such requests, a fourth would overflow its KV at the peak.
"""
from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from cluster.autoscaler import Autoscaler, ScalePlan, ScalingLimits
from cluster.fleet import InstanceStatus, RoutedRequest
from cluster.protocol import Resident
from cluster.router import POOLED_AT_FULL_STEP, How, InstanceReport, Outcome, Router
from scheduler.attainability import AttainabilityChecker, Rejection
from scheduler.chunking import largest_chunk
from scheduler.instance_state import InstanceState, ResidentSummary
from scheduler.roofline import emulated_latency_model
from scheduler.tiers import Tier, TierSet
from scheduler.types import StepStats
from test_scheduler_attainability import reference_check

MODEL = emulated_latency_model()
TIERS = TierSet([Tier("tight", 20, 500), Tier("std", 50, 1000), Tier("batch", 200, 5000)])
TIGHT, STD, BATCH = 0, 1, 2
CAPACITY = 4000


def make_router(policy="polyserve", tiers=TIERS, queue_limit=4, shed_late=True, **limits) -> Router:
    limits = {"min_instances": 0, "max_instances": 16, "idle_pool": 0, **limits}
    return Router(tiers, MODEL, policy=policy, autoscaler=Autoscaler(ScalingLimits(**limits)), queue_limit=queue_limit,
                  shed_late=shed_late)


def request(rid: str, tier: int, arrival: float = 0.0, prompt: int = 1000, max_tokens: int = 100,
            tiers=TIERS) -> RoutedRequest:
    t = tiers[tier]
    return RoutedRequest(rid, tier, t.name, t.slo, arrival, prompt, max_tokens)


def ready(router: Router, *ids: str, capacity: int = CAPACITY, now: float = 0.0) -> None:
    for iid in ids:
        router.add_instance(iid, now)
        router.on_ready(iid, capacity, now)


def fill(router: Router, iid: str, tier: int, n: int, now: float = 0.0) -> list[RoutedRequest]:
    """Submits n requests of `tier`, each of which must land on instance `iid`: the test arranges the fleet so that
    the routing picks it (an idle one joins `tier`, idle ones are taken in the order they came up)."""
    reqs = [request(f"{iid}-{tier}-{i}", tier, now) for i in range(n)]
    for r in reqs:
        d = router.submit(r, now)
        assert d.outcome is Outcome.PLACED and d.instance_id == iid, (r.request_id, d)
    return reqs


def residents(router: Router, iid: str) -> int:
    return len(router.fleet[iid].residents)


def state(router: Router, iid: str, tpot_ms: float) -> InstanceState:
    """The attainability test's view of instance `iid` as it is now, held to `tpot_ms`."""
    view = router.fleet[iid]
    return InstanceState(tuple(view.residents.values()), view.kv_capacity_tokens, view.iteration_end, tpot_ms)


def test_own_tier_packs_the_busiest_instance_that_can_attain():
    router = make_router()
    ready(router, "full", "busy", "light")
    # packing sends a request to the busiest instance with room: each instance is filled up before the next one
    # takes any, then gives back what it should not hold (aborted, so the tier's output-length mean stays put)
    fill(router, "full", STD, 3)  # a fourth request would overflow its KV
    busy = fill(router, "busy", STD, 3)
    light = fill(router, "light", STD, 3)
    for r in busy[:1] + light[:2]:
        router.on_finished(r.request_id, 0, 0.0, completed=False)
    loads = [router.fleet[i].load for i in ("full", "busy", "light")]
    assert loads == sorted(loads, reverse=True) and loads[0] > loads[2]
    full_verdict = router.checker.check(state(router, "full", 50), request("x", STD).snapshot(0.0), 0.0)
    assert full_verdict.reason is Rejection.KV_CAPACITY

    d = router.submit(request("r1", STD), 0.0)
    assert (d.outcome, d.instance_id, d.how) == (Outcome.PLACED, "busy", How.OWN)
    # "busy" is now full too: the next goes to the last instance with room, never promoted or scaled
    d = router.submit(request("r2", STD), 0.0)
    assert (d.instance_id, d.how) == ("light", How.OWN)
    assert [residents(router, i) for i in ("full", "busy", "light")] == [3, 3, 2]


def test_promotion_only_when_the_own_tier_refuses_nearest_tighter_first():
    router = make_router()
    ready(router, "t0", "s0", "b0")
    fill(router, "t0", TIGHT, 1)
    fill(router, "s0", STD, 1)
    fill(router, "b0", BATCH, 2)
    # the batch instance still has room: no promotion even though tighter instances are less loaded
    assert router.submit(request("b-1", BATCH), 0.0).instance_id == "b0"
    # batch is full now: promoted, to std (nearest) before tight
    d = router.submit(request("b-2", BATCH), 0.0)
    assert (d.instance_id, d.how) == ("s0", How.PROMOTED)
    d = router.submit(request("b-3", BATCH), 0.0)
    assert (d.instance_id, d.how) == ("s0", How.PROMOTED)
    d = router.submit(request("b-4", BATCH), 0.0)  # std full: on to tight
    assert (d.instance_id, d.how) == ("t0", How.PROMOTED)
    assert router.fleet["s0"].num_own_tier == 1 and residents(router, "s0") == 3
    assert router.counts["promoted"] == 3


def test_an_idle_instance_joins_before_a_tighter_tier_is_tried():
    """Lazy promotion comes after the idle pool: a full batch tier takes an idle instance first; DESIGN.md's order
    ("before-scale-up") promotes onto the tighter instance with room instead."""
    def placed(**switches):
        router = Router(TIERS, MODEL, autoscaler=Autoscaler(ScalingLimits(min_instances=0, max_instances=16,
                                                                           idle_pool=0)), **switches)
        ready(router, "b0", "s0", "spare")
        # batch fills before std holds anything, or the before-scale-up order would promote it onto s0
        fill(router, "b0", BATCH, 3)  # full
        fill(router, "s0", STD, 1)
        d = router.submit(request("x", BATCH), 0.0)
        return d.instance_id, d.how

    assert placed() == ("spare", How.SCALED_UP)
    assert placed(promotion="before-scale-up") == ("s0", How.PROMOTED)
    assert placed(promotion="none") == ("spare", How.SCALED_UP)


def test_ablation_switches_change_only_their_ingredient():
    def placed(**switches):
        router = Router(TIERS, MODEL, autoscaler=Autoscaler(ScalingLimits(min_instances=0, max_instances=16,
                                                                           idle_pool=0)), **switches)
        ready(router, "b-busy", "b-light", "t0")
        # batch fills before tight holds anything, or eager promotion would send it onto t0; b-busy is full
        # before b-light takes its request, since packing would send that one to b-busy too, then gives one back
        # (aborted, so the tier's output-length mean stays put)
        busy = fill(router, "b-busy", BATCH, 3)
        fill(router, "b-light", BATCH, 1)
        router.on_finished(busy[0].request_id, 0, 0.0, completed=False)
        fill(router, "t0", TIGHT, 1)
        d = router.submit(request("x", BATCH), 0.0)
        return d.instance_id, d.how

    assert placed() == ("b-busy", How.OWN)  # the busiest own-tier instance that can attain
    assert placed(gradient=False) == ("b-light", How.OWN)
    assert placed(promotion="eager") == ("t0", How.PROMOTED)  # tighter tiers first
    assert placed(promotion="none") == ("b-busy", How.OWN)
    with pytest.raises(ValueError, match="promotion"):
        Router(TIERS, MODEL, promotion="sometimes")


def test_promotion_is_judged_at_the_host_tier_tpot():
    # 100-token requests decoding on the host: four predict 3.59 ms, five 3.60 ms, over the host's 3.6 ms TPOT
    tiers = TierSet([Tier("host", 3.6, 500), Tier("std", 50, 1000)])
    router = make_router(tiers=tiers)
    ready(router, "h")
    hosted = [request(f"h{i}", 0, prompt=100, tiers=tiers) for i in range(3)]
    for r in hosted:
        d = router.submit(r, 0.0)
        assert d.outcome is Outcome.PLACED and d.instance_id == "h"
    router.on_report("h", InstanceReport(0.0, 30, [Resident(r.request_id, 100, 100, 1) for r in hosted]), 0.0)
    d = router.submit(request("p1", 1, prompt=100, tiers=tiers), 0.0)  # std has no instance: promoted
    assert (d.instance_id, d.how) == ("h", How.PROMOTED)
    router.on_report("h", InstanceReport(0.01, 40, [Resident(r.request_id, 100, 100, 1)
                                                    for r in router.fleet["h"].residents.values()]), 0.01)
    p2 = request("p2", 1, prompt=100, tiers=tiers)
    at_host = router.checker.check(state(router, "h", 3.6), p2.snapshot(0.0), 0.01)
    at_own = router.checker.check(state(router, "h", 50.0), p2.snapshot(0.0), 0.01)
    assert at_host.reason is Rejection.TPOT and at_own.ok  # passes at its own 50 ms, not at the host's 3.6 ms
    d = router.submit(p2, 0.01)
    assert d.outcome is Outcome.QUEUED and len(router.fleet["h"].residents) == 4


def test_demotion_is_tried_last_and_holds_the_looser_instance_to_the_tighter_tpot():
    """A request that fits nowhere in its own tier, the idle pool or a tighter tier goes on a looser tier's
    instance that attains it at the request's TPOT, and that instance is then held to it: its own tier's next
    request is judged at the tighter TPOT there."""
    # 100-token requests decoding: four predict 3.59 ms, five 3.60 ms, over the host tier's 3.6 ms TPOT
    tiers = TierSet([Tier("host", 3.6, 500), Tier("std", 50, 1000)])

    def fleet(num_std: int, **switches) -> Router:
        router = Router(tiers, MODEL, autoscaler=Autoscaler(ScalingLimits(min_instances=0, max_instances=16,
                                                                           idle_pool=0)), **switches)
        ready(router, "t", "s")
        for rid, tier, iid in [(f"h{i}", 0, "t") for i in range(4)] + [(f"s{i}", 1, "s") for i in range(num_std)]:
            assert router.submit(request(rid, tier, prompt=100, tiers=tiers), 0.0).instance_id == iid
            decoding(router, 0.0)  # each placed into a fleet whose residents decode
        return router

    def decoding(router: Router, now: float) -> None:
        for iid in ("t", "s"):
            router.on_report(iid, InstanceReport(now, 30, [Resident(rid, 100, 100, 1)
                                                           for rid in router.fleet[iid].residents]), now)

    # the host tier's instance is full at its TPOT; the std one holds three, so a fourth sequence fits 3.6 ms
    router = fleet(3)
    d = router.submit(request("x", 0, prompt=100, tiers=tiers), 0.01)
    assert (d.outcome, d.instance_id, d.how) == (Outcome.PLACED, "s", How.DEMOTED)
    assert router.fleet["s"].tier == 1 and router.counts["demoted"] == 1
    decoding(router, 0.01)
    y = request("y", 1, prompt=100, tiers=tiers)
    assert router.checker.check(state(router, "s", 50.0), y.snapshot(0.01), 0.01).ok  # it would fit at std's TPOT
    assert router.submit(y, 0.01).outcome is Outcome.QUEUED  # but "s" is held to the host's now
    router.on_finished("x", 5, 0.02)
    assert [(p.request.request_id, p.instance_id) for p in router.retry_queued(0.02)] == [("y", "s")]

    # four std sequences and the request would be five at 3.6 ms: not demoted there
    assert fleet(4).submit(request("x", 0, prompt=100, tiers=tiers), 0.01).outcome is Outcome.QUEUED
    # without demotion the request waits even where it would fit
    assert fleet(3, demotion=False).submit(request("x", 0, prompt=100, tiers=tiers), 0.01).outcome is Outcome.QUEUED


def test_a_waiting_tier_that_holds_no_instance_takes_the_loosest_tiers_when_none_is_idle():
    """Two instances went to std and batch before any tight request came: a tight request that fits on neither
    waits, and when it is retried the least-loaded instance of the loosest tier joins tight; its batch residents
    stay, the tight request goes on once they leave room, and batch requests are promoted from then on. Not while
    an instance is idle, nor below the looser tier's floor."""
    def fleet(**limits) -> Router:
        router = make_router(**limits)
        ready(router, "s0", "b0")
        fill(router, "s0", STD, 3)  # both full: a fourth 1000-token request overflows either's KV
        fill(router, "b0", BATCH, 3)
        return router

    router = fleet()
    t = request("t", TIGHT)
    assert router.submit(t, 0.0).outcome is Outcome.QUEUED
    assert router.retry_queued(0.01) == []  # b0 joined tight, but its three batch requests leave no room yet
    assert router.fleet["b0"].tier == TIGHT and router.fleet["s0"].tier == STD
    assert router.fleet.members[BATCH] == [] and router.counts["retiered"] == 1
    router.on_finished("b0-2-0", 100, 0.02)  # b0, holding no tight request, goes idle; tight is retried first
    assert [(p.request.request_id, p.instance_id) for p in router.retry_queued(0.02)] == [("t", "b0")]
    assert router.fleet["b0"].tier == TIGHT
    router.on_finished("s0-1-0", 100, 0.03)
    d = router.submit(request("b-new", BATCH, arrival=0.03), 0.03)  # batch holds no instance now: promoted
    assert (d.outcome, d.how) == (Outcome.PLACED, How.PROMOTED)
    assert router.counts["retiered"] == 1

    router = fleet()
    ready(router, "spare")  # an idle instance: the tight request scales it up and nothing is taken
    assert router.submit(request("t", TIGHT), 0.0).instance_id == "spare"
    assert router.fleet["b0"].tier == BATCH and router.counts["retiered"] == 0

    router = make_router(min_per_tier=1)  # one instance a tier, tight's lost: the floor keeps the others where they are
    ready(router, "t0", "s0", "b0")
    fill(router, "s0", STD, 3)
    fill(router, "b0", BATCH, 3)
    assert router.on_lost("t0", 0.0) == []
    assert router.submit(request("t", TIGHT), 0.0).outcome is Outcome.QUEUED
    assert router.retry_queued(0.01) == [] and router.counts["retiered"] == 0


def test_scale_up_takes_an_idle_instance_into_the_tier_and_respects_its_cap():
    router = make_router(max_per_tier=2)
    ready(router, "s0", "idle0", "idle1")
    fill(router, "s0", STD, 3)
    d = router.submit(request("r", STD), 0.0)
    assert (d.instance_id, d.how) == ("idle0", How.SCALED_UP)
    assert router.fleet["idle0"].tier == STD and [v.instance_id for v in router.fleet.idle] == ["idle1"]
    fill(router, "idle0", STD, 2)  # tier std now at its cap of two instances, both full
    d = router.submit(request("r2", STD), 0.0)
    assert d.outcome is Outcome.QUEUED and router.fleet["idle1"].tier is None
    # another tier may still take the idle instance
    assert router.submit(request("t", TIGHT), 0.0).how is How.SCALED_UP


def test_queue_is_bounded_retried_fifo_and_readmits_go_first():
    router = make_router(queue_limit=2)
    ready(router, "s0")
    placed = fill(router, "s0", STD, 3)
    assert router.submit(request("q1", STD, 0.0), 0.0).outcome is Outcome.QUEUED
    assert router.submit(request("q2", STD, 0.0), 0.0).outcome is Outcome.QUEUED
    full = router.submit(request("q3", STD, 0.0), 0.0)
    assert full.outcome is Outcome.QUEUE_FULL and full.retry_after_s >= 1
    assert "q3" not in router.requests
    # an accepted request placed again ignores the bound and goes to the front
    assert router.submit(request("back", STD, 0.0), 0.1, readmit=True).outcome is Outcome.QUEUED
    assert [r.request_id for r in router.queues[STD]] == ["back", "q1", "q2"]
    assert router.retry_queued(0.2) == []  # nothing freed yet
    router.on_finished(placed[0].request_id, 100, 0.3)
    out = router.retry_queued(0.3)
    assert [(p.request.request_id, p.instance_id) for p in out] == [("back", "s0")]
    assert router.withdraw("q2") and [r.request_id for r in router.queues[STD]] == ["q1"]


def test_a_request_that_can_no_longer_be_on_time_is_given_up_or_served_late():
    for shed_late in (True, False):
        router = make_router(shed_late=shed_late)
        ready(router, "s0")
        placed = fill(router, "s0", STD, 3)
        assert router.submit(request("late", STD, arrival=0.0), 0.0).outcome is Outcome.QUEUED
        assert router.submit(request("next", STD, arrival=4.5), 4.5).outcome is Outcome.QUEUED
        router.on_finished(placed[0].request_id, 100, 5.0)  # 5 s later: its 1 s TTFT is long gone
        out = router.retry_queued(5.0)
        if shed_late:  # given up, for the caller to answer; the room goes to the next one, still on time
            assert [p.request.request_id for p in out] == ["next"] and not out[0].request.late
            assert [r.request_id for r in router.take_shed()] == ["late"] and router.take_shed() == []
            assert "late" not in router.requests and router.counts["shed"] == 1
        else:
            assert [p.request.request_id for p in out] == ["late"] and out[0].request.late
            assert router.take_shed() == []


def test_a_request_queued_again_after_its_instance_was_lost_is_never_given_up():
    router = make_router()
    ready(router, "s0")
    placed = fill(router, "s0", STD, 3)
    lost = router.on_lost("s0", 0.5)
    assert {r.request_id for r in lost} == {r.request_id for r in placed}
    for r in lost:
        assert router.submit(r, 0.5, readmit=True).outcome is Outcome.QUEUED  # nothing serves
    router.add_instance("s1", 5.0)
    out = router.on_ready("s1", CAPACITY, 5.0)  # 5 s on: every first token is past due
    assert sorted(p.request.request_id for p in out) == sorted(r.request_id for r in placed)
    assert router.take_shed() == []


def test_scale_down_releases_the_least_loaded_instance_once_it_holds_no_request_of_its_tier():
    router = make_router()
    ready(router, "a", "b")
    a = fill(router, "a", STD, 3)
    b = fill(router, "b", STD, 1)
    d = router.submit(request("promo", BATCH), 0.0)  # no batch instance, none idle: promoted onto b, a is full
    assert (d.instance_id, d.how) == ("b", How.PROMOTED)
    router.on_finished(a[0].request_id, 100, 1.0)
    assert router.fleet["a"].tier == STD and router.fleet["b"].tier == STD
    router.on_finished(b[0].request_id, 100, 2.0)  # b is the least loaded, with only the promoted request left
    assert router.fleet["b"].tier is None and router.fleet["b"] in router.fleet.idle
    assert router.counts["released"] == 1 and "promo" in router.fleet["b"].residents
    # its resident (200 ms) allows any tier at least as tight: std may take it back
    fill(router, "a", STD, 1)  # a is full again
    d = router.submit(request("s-new", STD, arrival=3.0), 3.0)
    assert (d.instance_id, d.how) == ("b", How.SCALED_UP)


def test_min_per_tier_keeps_instances_and_fills_tiers_first():
    router = make_router(min_per_tier=1)
    ready(router, "x", "y", "z", "w")
    assert [router.fleet[i].tier for i in "xyzw"] == [TIGHT, STD, BATCH, None]
    r = fill(router, "y", STD, 1)
    router.on_finished(r[0].request_id, 100, 1.0)
    assert router.fleet["y"].tier == STD  # the tier's only instance stays


def test_no_instance_only_when_nothing_runs_and_nothing_can_start():
    router = Router(TIERS, MODEL)  # no autoscaler: a fixed fleet
    assert router.submit(request("a", STD), 0.0).outcome is Outcome.NO_INSTANCE
    router.add_instance("s", 0.0)  # starting: requests wait for it
    assert router.submit(request("b", STD), 0.0).outcome is Outcome.QUEUED
    out = router.on_ready("s", CAPACITY, 0.5)
    assert [(p.request.request_id, p.instance_id, p.how) for p in out] == [("b", "s", How.SCALED_UP)]
    scalable = make_router(max_instances=2)
    assert scalable.submit(request("c", STD), 0.0).outcome is Outcome.QUEUED  # the autoscaler will start one


def test_lost_instance_hands_back_its_residents_for_placement_elsewhere():
    router = make_router()
    ready(router, "a", "b")
    lost = fill(router, "a", STD, 2)
    lost[1].num_output_tokens = 7
    back = router.on_lost("a", 1.0)
    assert {r.request_id for r in back} == {r.request_id for r in lost}
    assert router.fleet["a"].status is InstanceStatus.DEAD and not router.fleet["a"].residents
    assert all(r.instance_id is None and r.request_id not in router.requests for r in back)
    d = router.submit(back[0], 1.0, readmit=True)
    assert (d.instance_id, d.how) == ("b", How.SCALED_UP)
    router.remove_instance("a", 1.0)
    assert "a" not in router.fleet.instances


def test_an_instance_whose_kv_blocks_are_full_now_takes_no_prompt_though_its_steady_state_fits():
    """The steady-state test counts KV in tokens at the residents' expected lengths; what an instance holds now, in
    whole blocks, can be more (outputs past their mean, each resident's partial last block, a handed-off prompt's KV
    held until pulled): a prompt that does not find its blocks free now beside a block of growth per resident goes
    to an instance where it does."""
    router = make_router()
    for iid in ("busy", "light"):
        router.add_instance(iid, 0.0)
        router.on_ready(iid, CAPACITY, 0.0, block_size=16)  # 250 blocks
    busy, light = fill(router, "busy", STD, 3), fill(router, "light", STD, 3)
    for r in busy[2:] + light[1:]:  # aborted: the tier's output-length mean stays put
        router.on_finished(r.request_id, 0, 0.0, completed=False)
    busy = busy[:2]
    router.on_report("busy", InstanceReport(0.1, 0, [Resident(r.request_id, 1000, 1000, 0) for r in busy]), 0.1)
    assert router.submit(request("fits", STD), 0.1).instance_id == "busy"  # the busiest that attains: packing
    router.on_finished("fits", 0, 0.1, completed=False)
    # the same residents, but the engine says 189 blocks are taken: 189 + 2 growth + 63 for the prompt > 250
    router.on_report("busy", InstanceReport(0.2, 189, [Resident(r.request_id, 1000, 1000, 0) for r in busy]), 0.2)
    assert router.checker.check(state(router, "busy", 50), request("x", STD).snapshot(0.2), 0.2).ok
    d = router.submit(request("moves", STD), 0.2)
    assert (d.outcome, d.instance_id) == (Outcome.PLACED, "light")
    # 186 leave just the room: 186 + 2 + 63 = 251 is one over, 185 fits
    for used, where in ((186, "light"), (185, "busy")):
        router.on_finished("moves", 0, 0.3, completed=False)
        router.on_report("busy", InstanceReport(0.3, used, [Resident(r.request_id, 1000, 1000, 0) for r in busy]), 0.3)
        d = router.submit(request("moves", STD), 0.3)
        assert d.instance_id == where, used
    with pytest.raises(ValueError, match="block_size"):
        router.add_instance("bad", 0.4)
        router.on_ready("bad", CAPACITY, 0.4, block_size=0)


def test_reports_update_progress_load_and_iteration_end():
    router = make_router()
    ready(router, "a")
    reqs = fill(router, "a", STD, 2)
    before = router.fleet["a"].load
    report = InstanceReport(2.0, 150, [Resident(reqs[0].request_id, 1000, 1050, 50),
                                       Resident(reqs[1].request_id, 1000, 1000, 0), Resident("gone", 5, 5, 0)])
    router.on_report("a", report, 2.001)
    view = router.fleet["a"]
    assert reqs[0].num_output_tokens == 50 and reqs[0].num_computed_tokens == 1050
    assert view.kv_tokens == 2050 and view.load > before
    assert view.iteration_end == pytest.approx(2.0 + view.load)
    assert state(router, "a", 50).residents[0].num_output_tokens == 50


def test_a_report_prepares_the_next_scan_and_joins_and_leaves_still_show(monkeypatch):
    router = make_router()
    ready(router, "a")
    reqs = fill(router, "a", STD, 2)
    view = router.fleet["a"]
    router.on_report("a", InstanceReport(1.0, 0, [Resident(r.request_id, 1000, 1001, 1) for r in reqs]), 1.0)
    # the decodes' chunk already found at the report
    summary = view.summary
    budget = TIERS[STD].tpot_ms / 1000.0  # no miss yet: no headroom taken
    calls = []
    model = router.model
    original = model.predict
    monkeypatch.setattr(model, "predict", lambda *a: calls.append(a) or original(*a))
    cap = router.max_prefill_chunk
    chunk, _ = summary.decode_chunk(model, budget, cap)
    assert not calls and summary.num_decoding == 2
    assert 0 < chunk == largest_chunk(model, budget, 2, summary.kv_decoding, cap)
    r = request("x", STD, 1.0)
    assert router.checker.check(state(router, "a", 50), r.snapshot(1.0), 1.0) == \
        reference_check(router.checker, state(router, "a", 50), r.snapshot(1.0), 1.0)
    # a join or a leave: the summary follows it without a count of its own
    router.on_finished(reqs[0].request_id, 1, 1.1)
    assert (summary.num_residents, summary.num_decoding) == (1, 1)
    d = router.submit(r, 1.2)
    assert (d.instance_id, d.how) == ("a", How.OWN)
    assert (summary.num_residents, summary.num_decoding, summary.ahead(2.2)) == (2, 1, (1, 1000))


def test_the_router_learns_step_times_from_reports():
    """Steps that take 25 % longer than the model says, plus 1 ms of host time: after some reports the router
    predicts them, in its load and in its attainability test alike."""
    router = make_router()
    ready(router, "a")
    reqs = fill(router, "a", STD, 2)
    rng = random.Random(5)
    for i in range(300):
        p, d = rng.choice([0, 0, 256, 1024]), rng.randint(1, 200)
        k = d * rng.randint(200, 2000) + p
        truth = 1.25 * MODEL.predict(p, d, k) + 0.001
        router.on_report("a", InstanceReport(i * 0.1, 0, [], [StepStats(i * 0.1, truth, p, d, k, 0, 0, 0, d)]),
                         i * 0.1)
    for p, d, k in [(0, 64, 64 * 1500), (512, 32, 32 * 800 + 512), (0, 150, 150 * 1800)]:
        assert router.model.predict(p, d, k) == pytest.approx(1.25 * MODEL.predict(p, d, k) + 0.001, rel=0.02)
    router.on_report("a", InstanceReport(31.0, 0, [Resident(r.request_id, 1000, 1000, 0) for r in reqs]), 31.0)
    view = router.fleet["a"]
    assert view.load == pytest.approx(1.25 * MODEL.predict(0, 2, view.kv_tokens) + 0.001, rel=0.02)
    assert router.checker.model is router.model


def test_headroom_counts_late_tokens_after_an_on_time_first_one():
    router = make_router()
    ready(router, "a")
    on_time_start, late_start = fill(router, "a", STD, 2)  # std: first token within 1 s, then one per 50 ms
    headroom = router.headroom[STD]

    def report(t, outputs):
        router.on_report("a", InstanceReport(t, 0, [Resident(r.request_id, 1000, 1000 + n - 1, n)
                                                    for r, n in outputs]), t)

    report(0.5, [(on_time_start, 1), (late_start, 0)])
    assert headroom.margin == 0.0
    report(1.2, [(on_time_start, 2), (late_start, 1)])  # token 2 was due at 1.05 s; the other's first at 1.0 s
    assert headroom.margin == pytest.approx(headroom.step) and headroom.num_missed == 1
    report(1.3, [(on_time_start, 3), (late_start, 2)])  # each request counts once; a late start never
    assert headroom.num_missed == 1
    router.on_finished(late_start.request_id, 2, 1.3)
    assert headroom.num_attained == 0
    third = request("third", STD, 1.3)
    assert router.submit(third, 1.3).instance_id == "a"
    report(1.5, [(on_time_start, 4), (third, 1)])
    router.on_finished(third.request_id, 1, 1.5)
    assert headroom.num_attained == 1 and headroom.margin < headroom.step


def test_a_hand_off_landing_after_its_first_tokens_deadline_starts_there_late_not_missed_by_packing():
    """The test promises a hand-off's next token one TPOT after its first token's deadline to one whose KV lands
    by then: late, that one is a miss of packing. One placed later waited on the prefill or a queue: its next
    token is a start, and late, the request is a late start, never counted."""
    router = make_router()
    for iid, role in (("p", "prefill"), ("d", "decode")):
        router.add_instance(iid, 0.0)
        router.set_role(iid, role)
        router.on_ready(iid, CAPACITY, 0.0)
    headroom = router.headroom[STD]
    landed, late = request("landed", STD), request("late", STD)  # std: first token within 1 s, then one per 50 ms
    assert router.hand_off(landed, 0.9).instance_id == "d"
    assert router.hand_off(late, 1.02).instance_id == "d"

    def report(t, outputs):
        router.on_report("d", InstanceReport(t, 0, [Resident(r.request_id, 1000, 1000 + n - 1, n)
                                                    for r, n in outputs]), t)

    report(1.2, [(landed, 2), (late, 2)])  # token 2 was due at 1.05 s
    assert headroom.num_missed == 1 and headroom.margin == pytest.approx(headroom.step)
    report(1.4, [(landed, 3), (late, 3)])
    assert headroom.num_missed == 1


def test_a_tier_whose_prompts_wait_lends_its_decode_instance_to_other_tiers_hand_offs_but_not_past_its_own():
    """A tier whose requests wait lends its instances to no other tier's request; but a hand-off (its prompt
    computed, its next token due a TPOT after its first) goes before the prompts a tier's queue holds, so only the
    tier's own waiting hand-offs keep it out."""
    router = make_router()
    for iid, role, capacity in (("p", "prefill", 2000), ("d", "decode", CAPACITY)):
        router.add_instance(iid, 0.0)
        router.set_role(iid, role)
        router.on_ready(iid, capacity, 0.0)
    assert router.hand_off(request("tight-0", TIGHT), 0.0).how is How.SCALED_UP  # d joins the tight tier
    # a tight prompt the prefill instance cannot hold, nor the decode instance beside its resident: it waits
    assert router.submit(request("tight-prompt", TIGHT, prompt=3000), 0.0).outcome is Outcome.QUEUED
    placed = router.hand_off(request("std-0", STD), 0.0)
    assert (placed.instance_id, placed.how) == ("d", How.PROMOTED)
    # a tight hand-off that finds no room waits at the front of its tier's queue: now the tier lends d to no other
    assert router.hand_off(request("tight-1", TIGHT, prompt=3000), 0.0).outcome is Outcome.QUEUED
    assert router.queues[TIGHT][0].request_id == "tight-1"
    assert router.hand_off(request("std-1", STD), 0.0).outcome is Outcome.QUEUED
    assert residents(router, "d") == 2


def test_first_tokens_of_requests_placed_on_time_feed_their_tier_first_token_margin():
    router = make_router()
    ready(router, "a")
    on_time, late_first = fill(router, "a", STD, 2)  # std: first token due at 1.0 s
    late_queued = request("late-queued", STD, 0.0)
    late_queued.late = True  # judged from its placement on: its first token is not the packing's to answer for
    assert router.submit(late_queued, 0.0).instance_id == "a"
    margin = router.first_token_headroom[STD]

    def report(t, outputs):
        router.on_report("a", InstanceReport(t, 0, [Resident(r.request_id, 1000, 1000 + n - 1, n)
                                                    for r, n in outputs]), t)

    report(0.5, [(on_time, 1), (late_first, 0), (late_queued, 0)])
    assert (margin.num_attained, margin.num_missed, margin.margin) == (1, 0, 0.0)
    report(1.2, [(on_time, 2), (late_first, 1), (late_queued, 1)])
    assert (margin.num_attained, margin.num_missed) == (1, 1) and margin.margin == pytest.approx(margin.step)
    report(1.3, [(on_time, 3), (late_first, 2), (late_queued, 2)])  # only a first token counts
    assert (margin.num_attained, margin.num_missed) == (1, 1)
    assert router.first_token_headroom[TIGHT].num_missed == router.first_token_headroom[BATCH].num_missed == 0


def test_a_tier_margin_pooling_more_instances_than_its_full_step_allows_weighs_each_outcome_down():
    """Both margins of a tier pool the outcomes of every instance held to it; past POOLED_AT_FULL_STEP instances
    each outcome moves them by a step scaled down so that they move per second no faster than over that many
    (scheduler/headroom.py), and below it by a whole step."""
    n = POOLED_AT_FULL_STEP + 8
    router = make_router(max_instances=2 * n)
    ids = [f"i{k}" for k in range(n)]
    ready(router, *ids, capacity=1200)
    reqs = [fill(router, iid, STD, 1)[0] for iid in ids]  # no room for a second prompt: each takes the next idle one
    assert len(router.fleet.members[STD]) == n
    packing, first_token = router.headroom[STD], router.first_token_headroom[STD]
    weight = POOLED_AT_FULL_STEP / n

    def report(iid, t, req, tokens):
        router.on_report(iid, InstanceReport(t, 0, [Resident(req.request_id, 1000, 1000 + tokens - 1, tokens)]), t)

    report("i0", 0.5, reqs[0], 1)  # first token due at 1.0 s: on time
    report("i0", 1.2, reqs[0], 2)  # the second was due at 1.05 s
    assert packing.num_missed == 1 and packing.margin == pytest.approx(weight * packing.step)
    report("i1", 1.2, reqs[1], 1)  # late first token
    assert first_token.num_missed == 1 and first_token.margin == pytest.approx(weight * first_token.step)
    ready(router, "t0")
    (on_tight,) = fill(router, "t0", TIGHT, 1)
    report("t0", 0.7, on_tight, 1)  # first token due at 0.5 s: a whole step in a tier of one
    assert router.first_token_headroom[TIGHT].margin == pytest.approx(first_token.step)


@pytest.mark.parametrize("policy", ["polyserve", "least-loaded-admission"])
def test_a_first_token_margin_asks_for_the_first_token_that_much_early_behind_the_same_queue(policy):
    """The margin moves the first token's due time, not the request's place in the instance's prefill queue: the
    residents due before it still go first, so the first token the test predicts is the one without a margin."""
    def placed_on(margin_s: float) -> str:
        router = make_router(policy)
        ready(router, "a")
        fill(router, "a", STD, 2)
        ready(router, "b")
        cand = request("x", STD, 0.0)
        router.first_token_headroom[STD].margin = margin_s / (TIERS[STD].ttft_ms / 1000.0)
        return router.submit(cand, 0.0).instance_id

    router = make_router(policy)
    ready(router, "a")
    fill(router, "a", STD, 2)
    cand = request("x", STD, 0.0)
    verdict = router.checker.check(state(router, "a", TIERS[STD].tpot_ms), cand.snapshot(0.0), 0.0)
    due = cand.first_token_due  # the figures as the queue ahead of it by its own deadline gives them
    slack = min(due - verdict.first_token_time, due - verdict.worst_prefill_end,
                due + cand.tpot_s - verdict.second_token_time)
    assert verdict.ok and slack > 0.01
    view = router.fleet["a"]
    fits = lambda early: router.checker.fits(view.summary, view.kv_capacity_tokens, view.iteration_end,
                                              TIERS[STD].tpot_ms, cand.snapshot(0.0), 0.0, early)
    assert fits(0.0) and fits(slack - 1e-6) and not fits(slack + 1e-6)
    busiest = "a" if policy == "polyserve" else "b"  # the baseline takes the least-loaded that attains
    assert placed_on(0.0) == busiest and placed_on(slack + 1e-3) == "b"


def test_an_instance_is_packed_to_its_tier_tpot_less_the_headroom():
    def placed_on_one_instance(router, tiers) -> int:
        ready(router, "a", capacity=10**6)
        n = 0
        while router.submit(request(f"r{n}", 0, prompt=100, tiers=tiers), 0.0).outcome is Outcome.PLACED:
            n += 1
        return n

    tiers = TierSet([Tier("tight", 10.0, 2000), Tier("std", 50, 1000)])
    full = placed_on_one_instance(make_router(tiers=tiers, queue_limit=1), tiers)
    router = make_router(tiers=tiers, queue_limit=1)
    for _ in range(30):
        router.headroom[0].missed()
    assert router.headroom[0].margin == pytest.approx(0.3)
    packed = placed_on_one_instance(router, tiers)
    # exactly what a tier of 7 ms with no headroom takes
    seven = TierSet([Tier("tight", 7.0, 2000), Tier("std", 50, 1000)])
    assert 0 < packed == placed_on_one_instance(make_router(tiers=seven, queue_limit=1), seven) < full


def test_token_reserve_hands_each_placement_the_margin_of_the_tier_its_instance_is_held_to():
    def placed(token_reserve: bool) -> list[RoutedRequest]:
        router = Router(TIERS, MODEL, autoscaler=Autoscaler(ScalingLimits(min_instances=0, max_instances=2,
                                                                          idle_pool=0)), token_reserve=token_reserve)
        ready(router, "a", "b")
        for tier, misses in ((TIGHT, 20), (STD, 10)):
            for _ in range(misses):
                router.headroom[tier].missed()
        reqs = [request("std", STD), request("tight", TIGHT), request("batch", BATCH)]
        for r in reqs:
            assert router.submit(r, 0.0).outcome is Outcome.PLACED
        for _ in range(10):  # a margin that moves later leaves what a placement was told as it was
            router.headroom[STD].missed()
        assert [r.instance_id for r in reqs] == ["a", "b", "a"]  # batch has no instance of its own: onto std's
        return reqs

    # std's instance is held to std's TPOT and tight's to tight's; batch, promoted, is held to std's there
    assert [r.tpot_reserve for r in placed(True)] == pytest.approx([0.1, 0.2, 0.1])
    assert [r.tpot_reserve for r in placed(False)] == [0.0, 0.0, 0.0]


def test_baselines_ignore_tiers():
    rr = make_router("round-robin")
    ready(rr, "a", "b", "c")
    chosen = [rr.submit(request(f"r{i}", i % 3), 0.0).instance_id for i in range(6)]
    assert sorted(chosen[:3]) == ["a", "b", "c"] and chosen[:3] == chosen[3:]
    ll = make_router("least-loaded")
    ready(ll, "a", "b")
    fill(ll, "a", STD, 1)
    assert ll.submit(request("x", TIGHT), 0.0).instance_id == "b"
    assert ll.submit(request("y", STD), 0.0).instance_id in ("a", "b")
    rnd = make_router("random")
    ready(rnd, "a", "b", "c")
    picks = {rnd.submit(request(f"r{i}", 0), 0.0).instance_id for i in range(30)}  # placed past any KV: no test
    assert picks == {"a", "b", "c"}
    assert all(v.tier is None for v in rnd.fleet.instances.values())


def test_least_loaded_admission_takes_the_least_loaded_instance_that_attains():
    router = make_router("least-loaded-admission")
    ready(router, "a")
    ready(router, "roomy", capacity=12_000)
    # the least loaded first, instance order on a tie; "a", of 4000 tokens, holds three requests
    placed = [router.submit(request(f"r{i}", i % 3), 0.0) for i in range(7)]
    assert [d.instance_id for d in placed] == ["a", "roomy", "a", "roomy", "a", "roomy", "roomy"]
    assert all(d.how is How.BASELINE for d in placed)
    a, roomy = router.fleet["a"], router.fleet["roomy"]
    assert a.load < roomy.load  # three residents against four
    verdict = router.checker.check(state(router, "a", TIERS[TIGHT].tpot_ms), request("x", BATCH).snapshot(0.0), 0.0)
    assert verdict.reason is Rejection.KV_CAPACITY
    d = router.submit(request("x", BATCH), 0.0)  # "a" is tried first and cannot hold it
    assert (d.outcome, d.instance_id, d.how) == (Outcome.PLACED, "roomy", How.BASELINE)
    # tiers are ignored: no labels, no scale-up or promotion
    assert a.tier is None and roomy.tier is None and not router.fleet.members[STD]
    assert not router.counts["scaled_up"] and not router.counts["promoted"]


def test_least_loaded_admission_holds_an_instance_to_its_tightest_resident_tpot():
    # 100-token requests decoding: four predict 3.59 ms, five 3.60 ms, over the host tier's 3.6 ms TPOT
    tiers = TierSet([Tier("host", 3.6, 500), Tier("std", 50, 1000)])
    router = make_router("least-loaded-admission", tiers=tiers)
    ready(router, "s")
    for i in range(5):
        assert router.submit(request(f"s{i}", 1, prompt=100, tiers=tiers), 0.0).instance_id == "s"
    ready(router, "h")
    for i, tier in enumerate((0, 1, 1, 1)):  # one host request among std ones
        assert router.submit(request(f"h{i}", tier, prompt=100, tiers=tiers), 0.0).instance_id == "h"
    for iid in ("s", "h"):
        residents_now = router.fleet[iid].residents.values()
        router.on_report(iid, InstanceReport(0.0, 0, [Resident(r.request_id, 100, 100, 1) for r in residents_now]),
                         0.0)
    assert router.fleet["h"].load < router.fleet["s"].load  # four residents against five
    x = request("x", 1, prompt=100, tiers=tiers)
    at_host = router.checker.check(state(router, "h", 3.6), x.snapshot(0.0), 0.0)
    at_own = router.checker.check(state(router, "h", 50.0), x.snapshot(0.0), 0.0)
    assert at_host.reason is Rejection.TPOT and at_own.ok  # "h" could take it but for its host resident
    d = router.submit(x, 0.0)
    assert (d.instance_id, d.how) == ("s", How.BASELINE)


def test_least_loaded_admission_queues_per_tier_and_places_when_capacity_frees():
    router = make_router("least-loaded-admission", queue_limit=2, shed_late=False)
    ready(router, "a", "b")
    placed = [router.submit(request(f"r{i}", STD), 0.0).instance_id for i in range(6)]
    assert placed == ["a", "b"] * 3  # both full
    assert router.submit(request("q1", STD), 0.0).outcome is Outcome.QUEUED
    assert router.submit(request("q2", STD), 0.0).outcome is Outcome.QUEUED
    full = router.submit(request("q3", STD), 0.0)
    assert full.outcome is Outcome.QUEUE_FULL and full.retry_after_s >= 1 and "q3" not in router.requests
    # the bound is per tier, as PolyServe's
    assert router.submit(request("t1", TIGHT), 0.0).outcome is Outcome.QUEUED
    assert router.waiting_tiers() == [TIGHT, STD]
    assert router.retry_queued(0.5) == []  # nothing freed: every head stays
    router.on_finished("r1", 100, 1.0)  # leaves "b"
    out = router.retry_queued(1.0)
    # both late by now, the one due sooner first: t1 takes the room b had; q1 then fits nowhere
    assert [(p.request.request_id, p.instance_id, p.how) for p in out] == [("t1", "b", How.BASELINE)]
    router.on_finished("r0", 100, 2.0)  # leaves "a"
    out = router.retry_queued(2.0)
    assert [(p.request.request_id, p.instance_id) for p in out] == [("q1", "a")]
    assert router.queue_length(STD) == 1 and out[0].request.late  # its 1 s TTFT passed while it waited


def test_the_queued_head_due_soonest_takes_freed_room_whatever_its_tier():
    router = make_router("least-loaded-admission", shed_late=False)
    ready(router, "a")
    assert [router.submit(request(f"r{i}", STD), 0.0).instance_id for i in range(3)] == ["a"] * 3  # full
    assert router.submit(request("q", STD), 0.0).outcome is Outcome.QUEUED  # first token due at 1.0 s
    assert router.submit(request("t", TIGHT, arrival=0.8), 0.8).outcome is Outcome.QUEUED  # due at 1.3 s
    router.on_finished("r0", 100, 0.9)
    out = router.retry_queued(0.9)
    # the looser tier's head is due sooner: it takes the room, and the tight one waits, still on time
    assert [(p.request.request_id, p.instance_id) for p in out] == [("q", "a")]
    assert router.queue_length(TIGHT) == 1 and not router.requests["t"].late


def test_lmetric_takes_the_smallest_product_of_new_prefill_and_batch_size():
    router = make_router("lmetric")
    ready(router, "few", "many")
    # empty instances score 0: the lower load, then instance order
    assert router.submit(request("long", STD, prompt=3000), 0.0).instance_id == "few"
    assert router.submit(request("s1", STD, prompt=100), 0.0).instance_id == "many"  # 100 * 1 against 100 * 0
    assert router.submit(request("s2", STD, prompt=100), 0.0).instance_id == "many"  # 100 * 1 each: the lower load
    few, many = router.fleet["few"], router.fleet["many"]
    # "few" holds one resident whose 3000-token prompt is still queued, "many" two of 100 tokens: least-loaded
    # would take "many", the product (1000 * 1 against 1000 * 2) takes "few"
    assert few.load > many.load
    d = router.submit(request("x", BATCH), 0.0)
    assert (d.outcome, d.instance_id, d.how) == (Outcome.PLACED, "few", How.BASELINE)
    # two residents each: a tie on the product, and "many" is the less loaded
    assert router.submit(request("y", TIGHT), 0.0).instance_id == "many"
    # placed at once, with no attainability test: two residents against three take "few", its KV pool full
    assert few.kv_tokens == CAPACITY
    assert router.submit(request("z", STD), 0.0).instance_id == "few"
    assert all(v.tier is None for v in router.fleet.instances.values())


def test_autoscaler_plan():
    router = make_router(min_instances=1, max_instances=3, idle_pool=1, stop_after_idle_s=10.0)
    auto = router.autoscaler
    assert auto.plan(router.fleet, [], 0.0) == ScalePlan(num_to_start=1)  # min 1, pool 1: one covers both
    router.add_instance("a", 0.0)
    assert auto.plan(router.fleet, [], 0.0) == ScalePlan()  # starting counts
    router.on_ready("a", CAPACITY, 1.0)
    fill(router, "a", STD, 3, now=1.0)  # a leaves the pool for tier std
    assert auto.plan(router.fleet, [], 1.0) == ScalePlan(num_to_start=1)  # the pool is short
    router.add_instance("b", 1.0)
    router.on_ready("b", CAPACITY, 2.0)
    assert auto.plan(router.fleet, [STD], 2.0) == ScalePlan(num_to_start=1)  # a waiting tier wants one more
    router.add_instance("c", 2.0)
    assert auto.plan(router.fleet, [STD, TIGHT], 2.0) == ScalePlan()  # max_instances reached
    router.on_ready("c", CAPACITY, 3.0)
    assert auto.plan(router.fleet, [], 5.0) == ScalePlan()  # b and c idle: one too many, but not idle long enough
    assert auto.plan(router.fleet, [], 12.5) == ScalePlan(to_stop=("b",))  # the longest idle goes
    assert auto.plan(router.fleet, [], 13.5, keep={"b"}) == ScalePlan(to_stop=("c",))  # b kept (a prefill engine)
    assert auto.plan(router.fleet, [], 13.5, keep={"b", "c"}) == ScalePlan()
    router.start_draining("b", 12.5)
    router.remove_instance("b", 13.0)
    router.on_lost("a", 14.0)  # a dies: only c is left, in the pool
    assert auto.plan(router.fleet, [], 14.0) == ScalePlan()  # min 1 and pool 1 are met by c
    router.remove_instance("a", 14.0)
    fill(router, "c", TIGHT, 1, now=14.0)
    assert auto.plan(router.fleet, [], 15.0) == ScalePlan(num_to_start=1)  # replace into the pool


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="policy"):
        Router(TIERS, MODEL, policy="fastest")
    with pytest.raises(ValueError, match="max_instances"):
        ScalingLimits(min_instances=3, max_instances=2)
    router = make_router()
    ready(router, "a")
    with pytest.raises(ValueError, match="already"):
        router.add_instance("a", 0.0)
    with pytest.raises(KeyError, match="unknown instance"):
        router.on_ready("zz", CAPACITY, 0.0)
    router.submit(request("dup", STD), 0.0)
    with pytest.raises(ValueError, match="already placed"):
        router.submit(request("dup", STD), 0.0)


# ---- parallel samples, resumed streams, and what an idle instance says -------------------------------------------
def samples(rid: str, n: int, tier: int = STD, arrival: float = 0.0) -> RoutedRequest:
    """Sample 0 of a request of n parallel samples, the other n - 1 its companions."""
    first = request(f"{rid}-0", tier, arrival)
    first.companions = tuple(request(f"{rid}-{i}", tier, arrival) for i in range(1, n))
    return first


def test_the_samples_of_one_request_go_onto_one_instance_each_counted():
    router = make_router(max_instances=2)
    ready(router, "a", "b")
    on_a = fill(router, "a", STD, 2)
    probe = request("probe", STD).snapshot(0.0)
    assert router.checker.check(state(router, "a", 50), probe, 0.0).ok  # one more request fits on "a"
    # three samples would overflow "a"'s KV at the peak, so all three go to "b" (from the idle pool), together
    d = router.submit(samples("n", 3), 0.0)
    assert (d.outcome, d.instance_id, d.how) == (Outcome.PLACED, "b", How.SCALED_UP)
    b = router.fleet["b"]
    assert list(b.residents) == ["n-0", "n-1", "n-2"] and b.residents_per_tier[STD] == 3
    assert all(router.requests[f"n-{i}"].instance_id == "b" for i in range(3))
    assert router.requests["n-0"].companions == ()  # placed: each a request of its own from here on
    # the others prefill what the first's cached prompt does not give them; every sample is a sequence of its own
    assert [r.num_computed_tokens for r in b.residents.values()] == [0, 999, 999]
    assert (b.summary.num_residents, b.kv_tokens) == (3, 3000)
    assert b.load == pytest.approx(MODEL.predict(0, 3, 3000))
    assert not router.checker.check(state(router, "b", 50), probe, 0.0).ok  # "b" is full with them
    assert router.counts["scaled_up"] == 1 + 3  # "a" for the first of `fill`, and each sample
    # two samples fit nowhere now: they wait as one, and are placed as one when "a" has room for both
    assert router.submit(samples("m", 2, arrival=0.1), 0.1).outcome is Outcome.QUEUED
    assert "m-0" in router.requests and "m-1" not in router.requests
    assert router.retry_queued(0.15) == []
    router.on_finished(on_a[0].request_id, 100, 0.2)
    out = router.retry_queued(0.2)
    assert [(p.request.request_id, p.instance_id) for p in out] == [("m-0", "a")]
    assert {"m-0", "m-1"} <= set(router.fleet["a"].residents) and router.requests["m-1"].instance_id == "a"
    # a companion's id is taken like any other
    taken = request("x-0", STD, 0.3)
    taken.companions = (request("n-1", STD, 0.3),)
    with pytest.raises(ValueError, match="'n-1' is already placed"):
        router.submit(taken, 0.3)
    assert "x-0" not in router.requests


def test_least_loaded_admission_tests_the_samples_of_one_request_together():
    router = make_router("least-loaded-admission")
    ready(router, "a", "b")
    assert [router.submit(request(f"r{i}", STD), 0.0).instance_id for i in range(2)] == ["a", "b"]
    probe = request("probe", STD).snapshot(0.0)
    assert all(router.checker.check(state(router, i, 50), probe, 0.0).ok for i in ("a", "b"))
    # one request more fits on either, three samples on neither (a fourth request overflows the KV)
    assert router.submit(samples("n", 3), 0.0).outcome is Outcome.QUEUED
    d = router.submit(samples("m", 2), 0.0)
    assert (d.outcome, d.instance_id) == (Outcome.PLACED, "a")
    assert {"m-0", "m-1"} <= set(router.fleet["a"].residents)


def migrated(router: Router, lost: list[RoutedRequest], now: float, resumed: bool) -> list[tuple[str, float, float]]:
    """Each lost stream placed again as the service places it (its streamed tokens now its prompt's end), in
    turn: where it went, its predicted next token there and the soonest any instance of its tier predicted."""
    out = []
    for r in lost:
        r.num_prompt_tokens, r.max_tokens = r.num_prompt_tokens + 20, r.max_tokens - 20
        r.resumed_tokens = 20 if resumed else 0
        predicted = {iid: router.checker.check(state(router, iid, TIERS[STD].tpot_ms), r.snapshot(now), now)
                     .first_token_time - now for iid, view in router.fleet.instances.items()
                     if view.status is InstanceStatus.READY}
        d = router.submit(r, now, readmit=True)
        assert d.outcome is Outcome.PLACED, r.request_id
        out.append((d.instance_id, predicted[d.instance_id], min(predicted.values())))
    return out


def test_streams_resumed_from_a_lost_instance_spread_where_their_next_token_comes_soonest():
    """An instance dies with 24 streams under way. Placed again busiest first, as new requests are, they pile up on
    one instance and re-prefill one behind the other; resumed streams go each where its next token is predicted
    soonest, the ones placed before it counted in: they spread over both survivors, and the last one's next
    token comes much sooner."""
    placed = {}
    for resumed in (False, True):
        router = make_router(queue_limit=64)
        ready(router, "a", "b", "c", capacity=100_000)
        now = 0.0
        for i in range(24):  # all onto "a" (the busiest that attains), each decoding its 20th token
            d = router.submit(request(f"r{i}", STD, now, prompt=1500, max_tokens=400), now)
            assert d.instance_id == "a"
            router.on_report("a", InstanceReport(now, 0, [Resident(r.request_id, 1500, 1519, 20)
                                                          for r in router.fleet["a"].residents.values()]), now)
            now += 0.05
        placed[resumed] = migrated(router, router.on_lost("a", now), now, resumed)
    piled, spread = placed[False], placed[True]
    assert max(Counter(i for i, *_ in piled).values()) >= 18
    counts = Counter(i for i, *_ in spread)
    assert set(counts) == {"b", "c"} and abs(counts["b"] - counts["c"]) <= 2
    assert all(mine == pytest.approx(soonest) for _, mine, soonest in spread)
    assert max(t for _, t, _ in spread) < 0.7 * max(t for _, t, _ in piled)


def test_a_resumed_stream_is_never_held_to_its_first_token_deadline():
    """Its first token from here is not its first: it is placed where its old first-token deadline, still ahead,
    cannot be met (a request that never streamed waits for an instance that could meet it), and its next token
    does not feed the first-token margin."""
    router = make_router(max_instances=1)
    ready(router, "a", now=-0.96)
    fill(router, "a", STD, 2, now=-0.96)  # two prefills, their first tokens due by 0.04: ahead of anything now
    due_soon = dict(arrival=-0.95, prompt=1000, max_tokens=100)  # first token due by 0.05: idle "a" could
    plain = request("plain", STD, **due_soon)
    assert router.submit(plain, 0.01, readmit=True).outcome is Outcome.QUEUED and not plain.late
    resumed = request("resumed", STD, **due_soon)
    resumed.resumed_tokens = 5
    d = router.submit(resumed, 0.01, readmit=True)
    assert (d.outcome, d.instance_id) == (Outcome.PLACED, "a") and resumed.late
    margin = router.first_token_headroom[STD]
    router.on_report("a", InstanceReport(0.5, 0, [Resident("resumed", 1000, 1000, 1)]), 0.5)  # past 0.05
    assert (margin.num_missed, margin.num_attained) == (0, 0)


def test_an_idle_instance_word_replaces_its_last_steps_kv_figure():
    router = make_router()
    ready(router, "a")
    reqs = fill(router, "a", STD, 2)
    router.on_report("a", InstanceReport(1.0, 130, [Resident(r.request_id, 1000, 1001, 1) for r in reqs]), 1.0)
    assert router.fleet["a"].num_blocks_used == 130
    for r in reqs:
        router.on_finished(r.request_id, 1, 1.1, completed=False)
    router.on_load("a", 0)
    view = router.fleet["a"]
    assert (view.num_blocks_used, len(view.residents), view.kv_tokens, view.load) == (0, 0, 0, 0.0)
    router.on_lost("a", 1.2)
    router.on_load("a", 99)  # a dead instance's last word changes nothing
    assert view.num_blocks_used == 0


# ---- the summary-based test places exactly as the one-pass test it replaced -----------------------------------------
def assert_counts_as_afresh(summary: ResidentSummary) -> None:
    """Read without touching what the summary keeps: its peak figures stay as the router left them."""
    fresh = ResidentSummary(list(summary.residents), summary.output_lengths)
    for name in ("num_residents", "kv_residents", "num_decoding", "kv_decoding"):
        assert getattr(summary, name) == getattr(fresh, name)
    assert summary.ahead(math.inf) == fresh.ahead(math.inf)


class ReferenceChecker(AttainabilityChecker):
    """The attainability test as one pass over each instance's residents (tests/test_scheduler_attainability.py)."""

    def check(self, instance, request, now):
        return reference_check(self, instance, request, now)

    def fits(self, summary, kv_capacity_tokens, iteration_end, tpot_ms, request, now, early_s=0.0):
        state = InstanceState(tuple(summary.residents), kv_capacity_tokens, iteration_end, tpot_ms)
        verdict = reference_check(self, state, request, now)
        due = request.first_token_due - early_s
        return verdict.ok and verdict.first_token_time <= due and verdict.worst_prefill_end <= due \
            and verdict.second_token_time <= due + request.tpot_s


def test_placements_equal_those_of_the_reference_test_through_random_events():
    """Two routers, one on the summary-kept test and one on the reference, driven by the same random placements,
    step reports, finishes (moving the output-length means), losses and retries: every decision is the same, and
    each instance's summary describes its residents as a count of them afresh would."""
    rng = random.Random(3)
    fast = make_router(queue_limit=8, max_instances=8)
    ref = make_router(queue_limit=8, max_instances=8)
    ref.checker = ReferenceChecker(MODEL, ref.output_lengths, 2048)
    routers = (fast, ref)
    now, serial = 0.0, 0
    ids = [f"i{k}" for k in range(5)]
    for r in routers:
        ready(r, *ids, capacity=12_000)
    outcomes: dict[str, int] = {}

    def both(method, *args):
        a, b = (getattr(r, method)(*args) for r in routers)
        if method in ("retry_queued", "on_ready"):
            a = [(p.request.request_id, p.instance_id, p.how) for p in a]
            b = [(p.request.request_id, p.instance_id, p.how) for p in b]
        assert a == b, (method, args)
        return a

    for _ in range(3000):
        now += rng.uniform(0, 0.03)
        op = rng.random()
        if op < 0.35:
            tier = rng.randrange(len(TIERS))
            prompt, max_tokens = rng.randint(20, 2500), rng.randint(5, 400)
            arrival = now - rng.choice((0.0, 0.0, rng.uniform(0, 2)))
            d = [r.submit(RoutedRequest(f"q{serial}", tier, TIERS[tier].name, TIERS[tier].slo, arrival, prompt,
                                        max_tokens), now) for r in routers]
            assert d[0] == d[1]
            outcomes[d[0].how.value if d[0].how else d[0].outcome.value] = \
                outcomes.get(d[0].how.value if d[0].how else d[0].outcome.value, 0) + 1
            serial += 1
        elif op < 0.6:  # a step report from one instance: prefills advance by a chunk, decodes by a token or two
            iid = rng.choice(ids)
            view = fast.fleet.instances.get(iid)
            if view is None or view.status is not InstanceStatus.READY:
                continue
            progress = []
            for req in view.residents.values():
                out, computed = req.num_output_tokens, req.num_computed_tokens
                if computed < req.num_prompt_tokens + out - 1 or not out:
                    computed = min(req.num_prompt_tokens, computed + rng.randint(0, 1500))
                    out = 1 if computed == req.num_prompt_tokens and rng.random() < 0.7 else out
                    computed = min(computed, req.num_prompt_tokens + out - 1) if out else computed
                else:
                    steps = rng.randint(1, 3)
                    out, computed = out + steps, computed + steps
                progress.append(Resident(req.request_id, req.num_prompt_tokens, computed, out))
            both("on_report", iid, InstanceReport(now, 0, progress), now)
        elif op < 0.93:
            placed = [rid for rid, req in fast.requests.items() if req.instance_id is not None]
            if placed:
                rid = rng.choice(placed)
                both("on_finished", rid, rng.randint(0, 500), now, rng.random() < 0.8)
                both("retry_queued", now)
        elif op < 0.96:
            iid = rng.choice(ids)
            if fast.fleet.instances[iid].status is InstanceStatus.READY and len(fast.fleet.instances) > 2:
                lost = [router.on_lost(iid, now) for router in routers]
                assert [r.request_id for r in lost[0]] == [r.request_id for r in lost[1]]
                for a, b in zip(*lost):  # back in, as the service readmits them
                    assert fast.submit(a, now, readmit=True) == ref.submit(b, now, readmit=True)
                for r in routers:
                    r.remove_instance(iid, now)
                    r.add_instance(iid, now)
                both("on_ready", iid, 12_000, now)
        else:
            both("retry_queued", now)
        for view in fast.fleet.instances.values():
            assert_counts_as_afresh(view.summary)
    assert [(i, sorted(v.residents)) for i, v in sorted(fast.fleet.instances.items())] == \
        [(i, sorted(v.residents)) for i, v in sorted(ref.fleet.instances.items())]
    assert all(outcomes.get(k) for k in ("own", "promoted", "scaled_up", "queued")), outcomes
    assert any(h.num_missed for h in fast.first_token_headroom)  # placements were planned with first-token margins


def test_costly_share_refuses_a_long_prompt_only_under_pressure():
    """A long prompt is placed while nothing has waited lately; refused rather than queued; refused though its tier
    has room within a stay of the latest wait (the longest a request is expected to hold its place); placed again
    once that has passed; and a request placed again after its instance was lost is never refused for its cost."""
    router = Router(TIERS, MODEL, autoscaler=Autoscaler(ScalingLimits(min_instances=0, max_instances=1, idle_pool=0)),
                    queue_limit=8, costly_share=0.1)
    ready(router, "a")

    def served(rid: str, prompt: int, now: float = 0.0) -> None:
        assert router.submit(request(rid, STD, arrival=now, prompt=prompt), now).outcome is Outcome.PLACED
        router.on_finished(rid, 100, now)

    for i in range(300):  # the tier's recent prompts: 100 to 1000 tokens, each served and gone
        served(f"h{i}", 100 + 3 * i)
    assert not router.under_pressure(0.0)
    served("long-with-room", 1000)
    placed = 0  # "a" fills up with prompts not among the costliest, until one would queue: it does
    while (decision := router.submit(request(f"mid{placed}", STD, prompt=800), 0.0)).outcome is Outcome.PLACED:
        placed += 1
    assert decision.outcome is Outcome.QUEUED and placed >= 2 and router.under_pressure(0.0)
    refused = router.submit(request("long", STD, prompt=1000), 0.0)
    assert refused.outcome is Outcome.COSTLY and refused.retry_after_s >= 1 and "long" not in router.requests
    assert router.counts["costly"] == 1 and router.queue_length(STD) == 1
    # a request placed again after its instance was lost is never refused for its cost
    again = request("lost", STD, prompt=1000)
    assert router.submit(again, 0.0, readmit=True).outcome is Outcome.QUEUED
    for i in range(placed):  # "a" empties and takes the queue, which empties too
        router.on_finished(f"mid{i}", 100, 0.0)
    assert {p.request.request_id for p in router.retry_queued(0.0)} == {"lost", f"mid{placed}"}
    for rid in ("lost", f"mid{placed}"):
        router.on_finished(rid, 100, 0.0)
    assert not any(router.queues) and not router.fleet["a"].residents and router.under_pressure(0.0)
    assert router.submit(request("long-after-wait", STD, prompt=1000), 0.0).outcome is Outcome.COSTLY
    served("mid-after-wait", 800)
    stay = max(router.retry_after(tier) for tier in range(len(TIERS)))  # the longest expected stay, rounded up
    assert router.under_pressure(stay / 2) and not router.under_pressure(stay)
    assert router.submit(request("long-later", STD, stay / 2, prompt=1000), stay / 2).outcome is Outcome.COSTLY
    costly = router.counts["costly"]
    served("long-much-later", 1000, now=stay)
    assert router.counts["costly"] == costly


def test_a_looser_tier_spends_its_spare_while_a_tighter_tier_sheds_and_its_late_tokens_count_against_it():
    """Two routers alike but for one thing: on one, a tight request queued until its first token could not be on
    time and was shed. Then long std prompts arrive under pressure on both: the one whose tighter tier shed refuses
    std's whole allowance (costly share and margins' share) less one standard error, the other only the share; once
    a std stay has passed since the shed, the share alone again. A std request whose later token came late is a loss
    that takes from what std has to spare, counted once."""
    def served_history(arrivals: int) -> Router:
        """One instance, the every-tier rule's shares, and std's recent prompts, each served and gone while
        nothing waited."""
        router = Router(TIERS, MODEL, autoscaler=Autoscaler(ScalingLimits(min_instances=0, max_instances=1,
                                                                          idle_pool=0)),
                        queue_limit=10_000, costly_share=0.08, headroom_target=0.02)
        ready(router, "a")
        for i in range(arrivals):
            assert router.submit(request(f"h{i}", STD, prompt=100 + i), 0.0).outcome is Outcome.PLACED
            router.on_finished(f"h{i}", 100, 0.0)
        return router

    def loaded(shed: bool) -> Router:
        router = served_history(1000)
        n = 0
        while router.submit(request(f"t{n}", TIGHT, prompt=100), 0.0).outcome is Outcome.PLACED:
            n += 1
        assert router.queue_length(TIGHT) == 1 and router.under_pressure(0.0)
        if shed:
            router.retry_queued(1.0)  # past its 500 ms first-token deadline: shed
            assert [r.request_id for r in router.take_shed()] == [f"t{n}"]
        else:
            assert router.withdraw(f"t{n}")
        return router

    def refusals(router: Router, now: float, tag: str) -> int:
        before = router.counts["costly"]
        for i in range(100):
            router.submit(request(f"{tag}{i}", STD, now, prompt=5000), now)
        return router.counts["costly"] - before

    shedding, calm = loaded(True), loaded(False)
    seen = 1100  # std's arrivals once the long ones are in
    spare = 0.1 - math.sqrt(0.1 * 0.9 / seen)
    assert refusals(shedding, 1.0, "long") == math.floor(spare * seen)
    assert refusals(calm, 1.0, "long") == math.floor(0.08 * seen)
    stay = shedding.retry_after(STD)  # at least one expected std stay after the shed
    assert refusals(shedding, 1.0 + stay, "later") == 0  # past its share of the 1200 arrivals already
    assert shedding.costly[STD].spare_share() == pytest.approx(0.1 - math.sqrt(0.1 * 0.9 / 1200))

    fresh = served_history(300)
    before = fresh.costly[STD].spare_share()
    assert fresh.submit(request("slow", STD, prompt=100), 0.0).outcome is Outcome.PLACED
    fresh.on_report("a", InstanceReport(0.4, 0, [Resident("slow", 100, 100, 1)]), 0.4)  # on time: no loss
    fresh.on_report("a", InstanceReport(5.0, 0, [Resident("slow", 100, 100, 2)]), 5.0)  # far past its second token
    fresh.on_report("a", InstanceReport(9.0, 0, [Resident("slow", 100, 100, 3)]), 9.0)  # one loss, counted once
    seen = 301
    assert fresh.costly[STD].spare_share() == pytest.approx(
        0.1 - math.sqrt(0.1 * 0.9 / seen) - 1 / seen) and before == pytest.approx(0.1 - math.sqrt(0.1 * 0.9 / 300))


def test_a_draining_tier_gives_a_waiting_tier_an_instance_and_moves_its_residents_to_its_others():
    """The mix turned: tight's one instance is full, batch holds two, and batch's completions outrun its arrivals.
    A tight request that fits nowhere takes batch's least-loaded instance; that one's batch resident is moved (its
    place held on batch's other instance, the caller told to let it go) and lands there as a hand-off with its output
    so far; the tight request goes on the instance it leaves. Not while batch takes in as many as it completes."""
    def fleet() -> Router:
        router = Router(TIERS, MODEL, autoscaler=Autoscaler(ScalingLimits(min_instances=0, max_instances=16,
                                                                          idle_pool=0)), demotion=False)
        ready(router, "t0", "b0", "b1")
        fill(router, "t0", TIGHT, 3)  # full: a fourth overflows its KV
        left = fill(router, "b0", BATCH, 3)[0]
        moving = fill(router, "b1", BATCH, 1)[0]
        router.on_finished(left.request_id, 0, 0.0, completed=False)  # b0 holds two, b1 one
        router.on_report("b1", InstanceReport(0.5, 70, [Resident(moving.request_id, 1000, 1049, 50)]), 0.5)
        return router

    router = fleet()  # batch's arrivals and completions alike (none): nothing moves
    assert router.submit(request("t", TIGHT, arrival=3.0), 3.0).outcome is Outcome.QUEUED
    assert router.retry_queued(3.01) == [] and router.take_migrations() == []
    assert router.fleet["b1"].tier == BATCH and router.counts["retiered"] == 0

    router = fleet()
    for t in (2.0 + i / 20 for i in range(20)):  # twenty completions of batch in the last second, no arrival
        router.flows[BATCH].completed(t)
    assert router.submit(request("t", TIGHT, arrival=3.0), 3.0).outcome is Outcome.QUEUED
    assert router.retry_queued(3.01) == []
    assert router.fleet["b1"].tier == TIGHT and router.counts["retiered"] == 1
    assert router.take_migrations() == [("b1-2-0", "b1")] and router.take_migrations() == []
    stand_in = router.fleet["b0"].residents["b1-2-0"]  # its place on b0 held, as it will arrive
    assert (stand_in.num_computed_tokens, stand_in.num_output_tokens) == (1049, 50)
    # b1 is tight's now, and has room for the tight request beside the batch resident on its way out
    assert [(p.request.request_id, p.instance_id) for p in router.retry_queued(3.02)] == [("t", "b1")]
    assert router.take_migrations() == []  # chosen once
    with pytest.raises(KeyError, match="not chosen"):
        router.moved("b0-2-0", 10, 3.03)
    d = router.moved("b1-2-0", 52, 3.03)  # its instance let go of it with 52 tokens out
    assert (d.outcome, d.instance_id, d.how) == (Outcome.PLACED, "b0", How.OWN)
    moved = router.fleet["b0"].residents["b1-2-0"]
    assert (moved.num_computed_tokens, moved.num_output_tokens) == (1051, 52) and "b1-2-0" in router.handoffs
    assert "b1-2-0" not in router.fleet["b1"].residents and not router.moving and not router.leaving
