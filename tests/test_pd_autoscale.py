"""Per-stage autoscaling of a disaggregated fleet (cluster/autoscaler.py): the prefill token rate over its window,
the prefill pool sized from it (ceil, limits, hysteresis, only idle empty engines stopped), the decode pool sized
from its decode token rate at the batch its TPOT allows, both pools raised by the KV byte rate their links carry;
the simulator's PD fleet following a burst of long prompts and a step in the decode rate, and a live `cluster.serve`
PD fleet of emulated engine processes, growing the prefill pool under a burst of long prompts and shrinking it
after."""
from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest

from cluster.autoscaler import Autoscaler, ScalePlan, ScalingLimits, TokenRate, decode_seconds_per_token
from cluster.fleet import RoutedRequest
from cluster.router import Outcome, Router
from cluster.sim.simulator import SimConfig, Simulator
from cluster.sim.workload import Workload
from scheduler.latency_model import scaled
from scheduler.roofline import emulated_latency_model
from scheduler.tiers import Tier, TierSet
from scheduler.transfer import TransferLink, TransferModel

MODEL = emulated_latency_model()
TIERS = TierSet([Tier("tight", tpot_ms=30.0, ttft_ms=2000.0), Tier("loose", tpot_ms=100.0, ttft_ms=5000.0)])
CAPACITY = 100_000
SECONDS_PER_TOKEN = 0.001  # a prefill engine runs 1000 prompt tokens a second


# ---- the token rate ----------------------------------------------------------------------------------------------
def test_token_rate_counts_the_tokens_of_its_window():
    rate = TokenRate(window_s=10.0)
    assert rate.rate(0.0) == 0.0
    rate.add(0.0, 1000)
    rate.add(5.0, 2000)
    assert rate.rate(5.0) == 300.0
    assert rate.rate(9.5) == 300.0
    assert rate.rate(10.0) == 200.0  # the window is (now - 10, now]: the first left it
    assert rate.rate(15.0) == 0.0
    rate.add(15.0, 500)
    assert rate.rate(15.0) == 50.0


@pytest.mark.parametrize("call, message", [
    (lambda: TokenRate(window_s=0.0), "window_s"),
    (lambda: TokenRate(window_s=1.0).add(0.0, -1), "non-negative"),
])
def test_token_rate_rejects_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_token_rate_refuses_time_going_back():
    rate = TokenRate(window_s=1.0)
    rate.add(2.0, 10)
    with pytest.raises(ValueError, match="time went back"):
        rate.add(1.0, 10)


# ---- the limits --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, message", [
    (dict(min_instances=2, max_instances=4, min_prefill_instances=2), "leave a decode engine"),
    (dict(min_instances=2, max_instances=4, min_prefill_instances=1, max_prefill_instances=4), "leave a decode"),
    (dict(min_instances=3, max_instances=4, min_prefill_instances=2, max_prefill_instances=1), "<= max_prefill"),
    (dict(min_instances=2, max_instances=4, min_prefill_instances=-1), "0 <= min_prefill"),
    (dict(max_prefill_instances=2), "needs min_prefill_instances"),
    (dict(min_instances=2, min_prefill_instances=1, prefill_utilisation=0.0), "prefill_utilisation"),
    (dict(min_instances=2, min_prefill_instances=1, prefill_utilisation=1.5), "prefill_utilisation"),
    (dict(min_instances=2, min_prefill_instances=1, prefill_rate_window_s=0.0), "prefill_rate_window_s"),
])
def test_scaling_limits_reject_bad_prefill_limits(kw, message):
    with pytest.raises(ValueError, match=message):
        ScalingLimits(**kw)


def test_a_fixed_prefill_pool_by_default():
    limits = ScalingLimits(min_instances=3, max_instances=6, min_prefill_instances=2)
    assert limits.prefill_cap == 2
    assert Autoscaler(limits).prefill_wanted(rate=1e9, seconds_per_token=SECONDS_PER_TOKEN) == 2


# ---- the sizing rule ---------------------------------------------------------------------------------------------
def pd_limits(**kw) -> ScalingLimits:
    return ScalingLimits(**{"min_instances": 2, "max_instances": 6, "idle_pool": 0, "min_prefill_instances": 1,
                            "max_prefill_instances": 3, "prefill_utilisation": 0.5, "stop_after_idle_s": 5.0,
                            "prefill_rate_window_s": 10.0, **kw})


@pytest.mark.parametrize("rate, wanted", [
    (0.0, 1),  # the minimum
    (250.0, 1),  # a quarter of an engine's rate: half its planned share
    (500.0, 1),  # exactly its planned share
    (510.0, 2),  # a little more takes a second engine (ceil)
    (1000.0, 2),
    (1400.0, 3),
    (1e6, 3),  # the maximum
])
def test_prefill_engines_wanted_from_the_token_rate(rate, wanted):
    auto = Autoscaler(pd_limits())
    assert auto.prefill_wanted(rate, SECONDS_PER_TOKEN) == wanted
    assert wanted == max(1, min(3, math.ceil(rate * SECONDS_PER_TOKEN / 0.5)))


# ---- the plan ----------------------------------------------------------------------------------------------------
def pd_router(limits: ScalingLimits, prefill=("p0",), decode=("d0",), transfer: TransferModel | None = None) -> Router:
    router = Router(TIERS, MODEL, autoscaler=Autoscaler(limits), transfer=transfer)
    for instance_id, role in [*((i, "prefill") for i in prefill), *((i, "decode") for i in decode)]:
        router.add_instance(instance_id, 0.0)
        router.set_role(instance_id, role)
        router.on_ready(instance_id, CAPACITY, 0.0)
    return router


def plan(router: Router, now: float, keep=()) -> ScalePlan:
    return router.autoscaler.plan(router.fleet, router.waiting_tiers(), now, keep=keep, roles=router.roles,
                                  prefill_seconds_per_token=SECONDS_PER_TOKEN)


def start_prefill(router: Router, now: float, *ids: str) -> None:
    for instance_id in ids:
        router.add_instance(instance_id, now)
        router.set_role(instance_id, "prefill")


def prompt(request_id: str, tokens: int, now: float) -> RoutedRequest:
    tier = TIERS[1]
    return RoutedRequest(request_id, 1, tier.name, tier.slo, now, tokens, 16)


def test_a_burst_starts_prefill_engines_and_they_stop_once_idle_past_the_hold():
    router = pd_router(pd_limits())
    auto = router.autoscaler
    assert plan(router, 0.0) == ScalePlan()  # one prefill and one decode engine: the minimum
    auto.prefill_tokens.add(1.0, 15_000)  # 1500 tokens a second over the window: three engines at half load
    assert plan(router, 1.0) == ScalePlan(num_prefill_to_start=2)
    start_prefill(router, 1.0, "p1", "p2")
    assert plan(router, 1.5) == ScalePlan()  # starting ones count
    for instance_id in ("p1", "p2"):
        router.on_ready(instance_id, CAPACITY, 2.0)
    assert plan(router, 9.0) == ScalePlan()  # the rate still wants three
    # the burst left the window at 11: one is wanted, but three were wanted 5 s ago (the hold)
    assert plan(router, 11.5) == ScalePlan()
    assert plan(router, 13.9) == ScalePlan()
    # past the hold, the surplus idle ones go: the longest idle first, never below the minimum
    assert plan(router, 14.5) == ScalePlan(to_stop=("p0", "p1"))
    assert plan(router, 14.5, keep={"p0"}) == ScalePlan(to_stop=("p1", "p2"))  # one still holding a hand-off's KV


def test_a_dip_in_the_rate_shorter_than_the_hold_stops_nothing():
    router = pd_router(pd_limits(prefill_rate_window_s=2.0), prefill=("p0", "p1"))
    auto = router.autoscaler
    feeds = {float(t) for t in range(26) if t != 15}  # 600 tokens each: 600 a second over the window, 300 in a dip
    first_stop = None
    for tick in range(100):  # every half second, as the service's ticks
        now = tick * 0.5
        if now in feeds:
            auto.prefill_tokens.add(now, 600)
        wanted = auto.prefill_wanted(auto.prefill_tokens.rate(now), SECONDS_PER_TOKEN)
        assert wanted == (2 if 1 <= now < 15 or 17 <= now < 26 else 1)
        p = plan(router, now)
        assert p.num_prefill_to_start == 0 and p.num_to_start == 0
        if p.to_stop:
            first_stop = (now, p.to_stop)
            break
    # the dip from 15 to 17 stops nothing; the one from 26 stops an engine once two were last wanted over 5 s ago
    assert first_stop == (31.0, ("p0",))


def test_only_empty_prefill_engines_idle_for_the_stop_delay_are_stopped():
    router = pd_router(pd_limits(), prefill=("p0", "p1", "p2"))
    busy = prompt("r", 1000, 1.0)
    placed = router.submit(busy, 1.0)
    assert placed.instance_id == "p0"  # all equally empty: the first of the pool
    # nothing wanted beyond the minimum: two surplus, the busy one kept
    assert plan(router, 6.0) == ScalePlan(to_stop=("p1", "p2"))
    router.on_finished("r", 1, 7.0, completed=False)  # handed off at its first token: p0 is empty again
    assert plan(router, 7.0) == ScalePlan(to_stop=("p1", "p2"))  # p0 was seen busy at 6: idle since then
    assert plan(router, 10.5, keep={"p1"}) == ScalePlan(to_stop=("p2",))
    assert plan(router, 11.0, keep={"p1"}) == ScalePlan(to_stop=("p2", "p0"))  # idle 5 s since last seen busy


def test_prefill_growth_stays_within_max_instances():
    limits = pd_limits(min_instances=2, max_instances=4)
    router = pd_router(limits, prefill=("p0",), decode=("d0", "d1"))
    router.autoscaler.prefill_tokens.add(0.0, 100_000)
    assert plan(router, 0.0) == ScalePlan(num_prefill_to_start=1)  # three wanted, one place left


def test_the_decode_minimum_is_what_the_prefill_minimum_leaves():
    router = pd_router(pd_limits(min_instances=3), prefill=("p0", "p1", "p2"), decode=("d0", "d1"))
    router.autoscaler.prefill_tokens.add(0.0, 15_000)  # three prefill engines wanted
    assert plan(router, 0.0) == ScalePlan()
    router.on_lost("d1", 1.0)
    router.remove_instance("d1", 1.0)
    # five engines still serve, above min_instances 3, but only one decode engine of the two the minimum leaves
    assert plan(router, 1.0) == ScalePlan(num_to_start=1)


def test_without_disaggregation_the_plan_ignores_roles_and_the_rate():
    limits = ScalingLimits(min_instances=2, max_instances=6, idle_pool=0, stop_after_idle_s=5.0)
    router = pd_router(limits, prefill=(), decode=("a", "b"))
    router.autoscaler.prefill_tokens.add(0.0, 1_000_000)
    assert plan(router, 0.0) == ScalePlan()


# ---- the decode stage ---------------------------------------------------------------------------------------------
DECODE_SECONDS_PER_TOKEN = 0.001  # a decode engine's TPOT-bound batch decodes 1000 tokens a second


def decode_plan(router: Router, now: float, transfer: TransferModel | None = None) -> ScalePlan:
    return router.autoscaler.plan(router.fleet, router.waiting_tiers(), now, roles=router.roles,
                                  prefill_seconds_per_token=SECONDS_PER_TOKEN,
                                  decode_seconds_per_token=DECODE_SECONDS_PER_TOKEN, transfer=transfer)


@pytest.mark.parametrize("kw, message", [
    (dict(decode_utilisation=0.0), "decode_utilisation"),
    (dict(decode_utilisation=1.5), "decode_utilisation"),
    (dict(decode_utilisation=float("nan")), "decode_utilisation"),
    (dict(transfer_utilisation=0.0), "transfer_utilisation"),
    (dict(transfer_utilisation=-0.5), "transfer_utilisation"),
])
def test_scaling_limits_reject_bad_decode_and_transfer_utilisation(kw, message):
    with pytest.raises(ValueError, match=message):
        ScalingLimits(**kw)


@pytest.mark.parametrize("rate, wanted", [
    (0.0, 1),  # what min_instances leaves beside the prefill minimum
    (500.0, 1),  # exactly one engine's planned share of its batch
    (510.0, 2),  # a little more takes a second engine (ceil)
    (1500.0, 3),
    (1e6, 5),  # what max_instances leaves beside the prefill minimum
])
def test_decode_engines_wanted_from_the_decode_token_rate(rate, wanted):
    auto = Autoscaler(pd_limits(decode_utilisation=0.5))
    assert auto.decode_wanted(rate, DECODE_SECONDS_PER_TOKEN) == wanted
    assert wanted == max(1, min(5, math.ceil(rate * DECODE_SECONDS_PER_TOKEN / 0.5)))


@pytest.mark.parametrize("budget_s, context, max_batch", [
    (0.030, 1000, 4096),  # the TPOT bounds the batch
    (0.030, 1000, 64),  # the KV bounds it
    (0.100, 200, 4096),
    (0.001, 100, 1000),  # not even one sequence within the budget: one sequence's step
])
def test_decode_seconds_per_token_at_the_largest_batch_within_the_budget(budget_s, context, max_batch):
    batch = max((b for b in range(1, max_batch + 1) if MODEL.predict(0, b, b * context) <= budget_s), default=1)
    assert decode_seconds_per_token(MODEL, budget_s, context, max_batch) == \
        MODEL.predict(0, batch, batch * context) / batch


def test_decode_seconds_per_token_rejects_bad_input():
    with pytest.raises(ValueError, match="context and max_batch"):
        decode_seconds_per_token(MODEL, 0.03, 0, 10)


def hand_off(router: Router, request_id: str, tier: int, tokens: int, now: float) -> str:
    t = TIERS[tier]
    decision = router.hand_off(RoutedRequest(request_id, tier, t.name, t.slo, now, tokens, 16), now)
    return decision.instance_id


def test_the_routers_decode_seconds_per_token_from_its_decode_residents():
    router = pd_router(pd_limits(), decode=("d0", "d1"))
    assert router.decode_seconds_per_token == 0.0  # nothing decoding: nothing to size from
    assert router.submit(prompt("new", 1000, 0.0), 0.0).instance_id == "p0"
    # the decode engine that holds the prompt's place counts it as it will be there, decoding
    held = router.reserved["new"]
    assert held.instance_id in ("d0", "d1") and list(held.residents) == ["new"]
    assert router.decode_seconds_per_token == decode_seconds_per_token(
        router.model, router.headroom[1].budget_ms(TIERS[1].tpot_ms) / 1000.0, 1001, CAPACITY // 1001)
    router.on_finished("new", 0, 0.0, completed=False)  # it left the prefill engine: its place is given back
    assert router.decode_seconds_per_token == 0.0 and not held.residents
    # short contexts, so that the KV does not bound the batch before the tight tier's TPOT does
    loose = hand_off(router, "a", 1, 40, 0.0)
    view = router.fleet.instances[loose]
    budget_s = router.headroom[1].budget_ms(TIERS[1].tpot_ms) / 1000.0
    only_loose = router.decode_seconds_per_token
    assert only_loose == decode_seconds_per_token(router.model, budget_s, view.kv_tokens,
                                                  CAPACITY // view.kv_tokens)
    # a tight tier's resident, as long, on the other engine: its TPOT allows a smaller batch, each token a larger share
    assert hand_off(router, "b", 0, 40, 0.0) != loose
    assert router.decode_seconds_per_token > only_loose


def test_a_rising_decode_rate_starts_decode_engines_before_any_request_waits():
    router = pd_router(pd_limits(decode_utilisation=0.5))
    auto = router.autoscaler
    auto.decode_tokens.add(0.0, 4000)  # 400 a second over the window: one engine at 0.4 of its batch
    assert decode_plan(router, 0.0) == ScalePlan()
    auto.decode_tokens.add(1.0, 2000)  # 600 a second: past one engine's planned share
    assert router.waiting_tiers() == []  # nothing waits: the queue-driven rule would start nothing
    assert plan(router, 1.0) == ScalePlan()
    assert decode_plan(router, 1.0) == ScalePlan(num_to_start=1)
    router.add_instance("d1", 1.0)
    router.set_role("d1", "decode")
    assert decode_plan(router, 1.5) == ScalePlan()  # a starting one counts
    auto.decode_tokens.add(2.0, 10_000)  # 1600 a second: four
    assert decode_plan(router, 2.0) == ScalePlan(num_to_start=2)
    auto.decode_tokens.add(3.0, 100_000)  # far more: within max_instances beside the prefill engine
    router.add_instance("d2", 3.0)
    router.set_role("d2", "decode")
    assert decode_plan(router, 3.0) == ScalePlan(num_to_start=2)


def test_decode_engines_stay_while_the_rate_wants_them_and_idle_ones_stop_after_it_falls():
    limits = pd_limits(decode_utilisation=0.5, prefill_rate_window_s=4.0)
    # the co-located rule alone stops two of three idle decode engines once idle past the hold: the minimum is one
    assert plan(pd_router(limits, decode=("d0", "d1", "d2")), 5.0) == ScalePlan(to_stop=("d0", "d1"))
    router = pd_router(limits, decode=("d0", "d1", "d2"))
    auto = router.autoscaler
    stops = []
    for now in (0.0, 1.0, 2.0):
        auto.decode_tokens.add(now, 1000)  # 1000 a second until 12: two engines at half their batch
    for tick in range(6, 60):  # every half second, as the service's ticks, from when the window is full
        now = tick * 0.5
        if now <= 12.0 and now == int(now):
            auto.decode_tokens.add(now, 1000)
        wanted = auto.decode_wanted(auto.decode_tokens.rate(now), DECODE_SECONDS_PER_TOKEN)
        assert wanted == (2 if now < 14.0 else 1)
        p = decode_plan(router, now)
        assert p.num_to_start == 0 and p.num_prefill_to_start == 0
        for instance_id in p.to_stop:
            stops.append((now, instance_id))
            router.start_draining(instance_id, now)
            router.remove_instance(instance_id, now)
    # one goes once idle past the hold, two stay while the rate wants them; the second goes once two were last
    # wanted (at 13.5) longer than stop_after_idle_s ago
    assert stops == [(5.0, "d0"), (19.0, "d1")]
    assert [i for i, r in router.roles.items() if r == "decode"] == ["d2"]


# ---- the transfer stage -------------------------------------------------------------------------------------------
SLOW_LINK = TransferModel(TransferLink("slow", bandwidth=1e9, latency_s=0.0), bytes_per_token=1000)


@pytest.mark.parametrize("bytes_rate, links", [(0.0, 0), (5e8, 1), (6e8, 2), (1.5e9, 3)])
def test_links_wanted_so_that_none_runs_past_its_share(bytes_rate, links):
    auto = Autoscaler(pd_limits(transfer_utilisation=0.5))
    assert auto.links_wanted(bytes_rate, SLOW_LINK) == links
    assert auto.links_wanted(bytes_rate, None) == 0  # no link model: the transfer is not sized


def test_the_kv_byte_rate_raises_both_pools_past_what_their_links_carry():
    router = pd_router(pd_limits(transfer_utilisation=0.5))
    auto = router.autoscaler
    auto.transfer_bytes.add(0.0, 15 * 10 ** 9)  # 1.5 GB a second over the 10 s window: three links at half load
    assert decode_plan(router, 0.0) == ScalePlan()  # no prompt or decode token: without the link's model, nothing
    assert decode_plan(router, 0.0, transfer=SLOW_LINK) == ScalePlan(num_to_start=2, num_prefill_to_start=2)
    router = pd_router(pd_limits(transfer_utilisation=0.5))
    router.autoscaler.transfer_bytes.add(0.0, 50 * 10 ** 9)  # ten links' worth: each pool within its limits
    assert decode_plan(router, 0.0, transfer=SLOW_LINK) == ScalePlan(num_to_start=2, num_prefill_to_start=2)
    start_prefill(router, 0.0, "p1", "p2")  # three prefill engines, the cap: the rest of max_instances decodes
    assert decode_plan(router, 0.0, transfer=SLOW_LINK) == ScalePlan(num_to_start=2)


def test_a_hand_off_feeds_its_prompts_kv_bytes_once_whatever_its_retries():
    router = pd_router(pd_limits(), decode=("d0", "d1"), transfer=SLOW_LINK)
    window, auto = router.autoscaler.limits.prefill_rate_window_s, router.autoscaler
    req = prompt("a", 40, 0.0)
    assert router.hand_off(req, 0.0).outcome is Outcome.PLACED
    assert auto.transfer_bytes.rate(0.0) * window == 40 * SLOW_LINK.bytes_per_token
    # the decode instance refused the import: the router hears it left, and the same hand-off is placed anew
    router.on_finished("a", 1, 0.1, completed=False)
    assert router.hand_off(req, 0.1, retry=True).outcome is Outcome.PLACED
    assert auto.transfer_bytes.rate(0.1) * window == 40 * SLOW_LINK.bytes_per_token
    hand_off(router, "b", 0, 60, 0.2)
    assert auto.transfer_bytes.rate(0.2) * window == 100 * SLOW_LINK.bytes_per_token
    plain = pd_router(pd_limits(), decode=("d0", "d1"))  # no link model: nothing to count the bytes by
    hand_off(plain, "a", 1, 40, 0.0)
    assert plain.autoscaler.transfer_bytes.rate(0.0) == 0.0


def test_without_disaggregation_the_decode_and_transfer_rates_change_nothing():
    limits = ScalingLimits(min_instances=2, max_instances=6, idle_pool=0, stop_after_idle_s=5.0)
    router = pd_router(limits, prefill=(), decode=("a", "b"))
    router.autoscaler.decode_tokens.add(0.0, 10 ** 9)
    router.autoscaler.transfer_bytes.add(0.0, 10 ** 15)
    assert decode_plan(router, 0.0, transfer=SLOW_LINK) == ScalePlan()


# ---- the simulator -----------------------------------------------------------------------------------------------
def burst_workload(seed: int = 0) -> Workload:
    """Short prompts at 4 a second for 60 s, and long ones (3000 tokens) at 25 a second from 10 s to 25 s: about
    twice what one prefill engine of the model runs."""
    rng = np.random.default_rng(seed)
    base = np.cumsum(rng.exponential(1 / 4.0, 240))
    burst = 10.0 + np.cumsum(rng.exponential(1 / 25.0, 375))
    arrivals = np.concatenate([base, burst[burst < 25.0]])
    prompts = np.concatenate([rng.integers(100, 300, len(base)), np.full(int((burst < 25.0).sum()), 3000)])
    order = np.argsort(arrivals, kind="stable")
    n = len(arrivals)
    return Workload(arrivals[order], prompts[order], rng.integers(4, 24, n), rng.integers(0, 2, n).astype(np.int8),
                    TIERS)


def test_simulated_pd_fleet_grows_its_prefill_pool_under_a_burst_and_shrinks_it_after():
    limits = ScalingLimits(min_instances=2, max_instances=8, idle_pool=0, min_prefill_instances=1,
                           max_prefill_instances=4, stop_after_idle_s=3.0, prefill_rate_window_s=5.0)
    cfg = SimConfig(num_instances=2, prefill_instances=1, autoscale=limits, cold_start_s=2.0, reveal_output_len=True)
    wl = burst_workload()
    res = Simulator(cfg, TIERS, MODEL).run(wl)
    prefill = {round(s[0]): s[4] for s in res.samples}
    assert all(n == 1 for t, n in prefill.items() if t <= 10)  # the short prompts alone need one
    assert max(prefill[t] for t in range(12, 27)) >= 3  # the burst
    assert all(n <= 4 for n in prefill.values())
    assert prefill[max(prefill)] == 1  # back to the minimum after
    assert all(n == 1 for t, n in prefill.items() if t >= 45)
    assert all(live - p >= 1 for _, _, _, live, p in res.samples)  # a decode instance throughout
    assert res.counts["handed_off"] == int(res.handed_off.sum())
    # in the burst, a request that no prefill engine could take in time ran whole on a decode engine (the router's
    # "convertible" decode instances); outside it, only where a decode engine of its tier had compute to spare: never
    # a tight one (its KV full of these contexts steps over its 30 ms TPOT on this model), and few loose ones
    whole = res.served & ~res.handed_off
    calm = (res.arrival < 10.0) | (res.arrival > 30.0)
    assert whole[(res.arrival >= 10.0) & (res.arrival <= 30.0)].sum() > 10
    assert not whole[calm & (res.tier == 0)].any() and whole[calm].sum() < 0.05 * calm.sum()
    assert res.served.mean() > 0.9


def test_simulated_pd_autoscaling_is_deterministic():
    limits = ScalingLimits(min_instances=2, max_instances=8, idle_pool=0, min_prefill_instances=1,
                           max_prefill_instances=4, stop_after_idle_s=3.0, prefill_rate_window_s=5.0)
    cfg = SimConfig(num_instances=2, prefill_instances=1, autoscale=limits, cold_start_s=2.0, reveal_output_len=True)
    a, b = (Simulator(cfg, TIERS, MODEL).run(burst_workload()) for _ in range(2))
    assert a.samples == b.samples
    np.testing.assert_array_equal(a.attained, b.attained)


CHAT = TierSet([Tier("chat", tpot_ms=100.0, ttft_ms=2000.0)])


def decode_step_workload(seed: int = 0) -> Workload:
    """Short prompts and 30-token answers at 4 a second, 40 a second from 5 s to 12 s: a step in the decode token
    rate that a model twenty times slower than the emulated one decodes on a few engines."""
    rng = np.random.default_rng(seed)

    def poisson(rate: float, start: float, end: float) -> np.ndarray:
        times = start + np.cumsum(rng.exponential(1 / rate, int(2 * rate * (end - start))))
        return times[times < end]

    arrivals = np.concatenate([poisson(4.0, 0.0, 5.0), poisson(40.0, 5.0, 12.0), poisson(4.0, 12.0, 25.0)])
    n = len(arrivals)
    return Workload(arrivals, rng.integers(20, 80, n), np.full(n, 30), np.zeros(n, np.int8), CHAT)


def test_simulated_pd_fleet_sizes_its_decode_pool_from_a_decode_rate_step():
    model = scaled(MODEL, 20.0)
    wl = decode_step_workload()
    decode = {}  # decode_utilisation -> decode engines starting or serving, by sample time
    for utilisation in (1.0, 0.5):
        limits = ScalingLimits(min_instances=2, max_instances=10, idle_pool=0, min_prefill_instances=1,
                               max_prefill_instances=4, stop_after_idle_s=2.0, prefill_rate_window_s=2.0,
                               decode_utilisation=utilisation)
        cfg = SimConfig(num_instances=2, prefill_instances=1, autoscale=limits, cold_start_s=0.5,
                        reveal_output_len=True)
        res = Simulator(cfg, CHAT, model, sample_s=0.5).run(wl)
        assert res.served.all()
        assert res.counts["handed_off"] == len(wl)
        decode[utilisation] = {t: live - prefill for t, _, _, live, prefill in res.samples}
    for pool in decode.values():
        assert all(n == 1 for t, n in pool.items() if t < 6.0)  # before the step: the minimum
        assert all(n == 1 for t, n in pool.items() if t >= 20.0)  # back to it once the rate fell, past the hold
    # only the rate rule reads decode_utilisation: planned at half their batch, the engines are more at the step
    peak = {u: max(pool.values()) for u, pool in decode.items()}
    assert peak[0.5] >= max(3, peak[1.0] + 1)
    assert all(5.0 <= t < 20.0 for t, n in decode[0.5].items() if n > 1)


def test_simulated_pd_fleet_feeds_decoded_tokens_and_handed_off_bytes():
    """Over a window longer than the run, the rates hold every token the decode instances decoded (every output
    token after the first: a hand-off's, and a request a decode instance ran whole) and every hand-off's prompt
    KV."""
    window = 1000.0
    limits = ScalingLimits(min_instances=3, max_instances=3, idle_pool=0, min_prefill_instances=1,
                           prefill_rate_window_s=window)
    cfg = SimConfig(num_instances=3, prefill_instances=1, autoscale=limits, reveal_output_len=True)
    wl = burst_workload()
    sim = Simulator(cfg, TIERS, MODEL)
    res = sim.run(wl)
    assert res.served.all()
    auto, end = sim.router.autoscaler, float(res.arrival.max())
    handed = res.handed_off
    assert (~handed).any()  # the burst ran some whole on decode instances
    assert auto.decode_tokens.rate(end) * window == pytest.approx(int((wl.output_lens - 1).sum()))
    assert auto.transfer_bytes.rate(end) * window == pytest.approx(
        int(wl.prompt_lens[handed].sum()) * sim.router.transfer.bytes_per_token)


# ---- live: the router service and cluster.serve ------------------------------------------------------------------
def test_live_service_feeds_decoded_tokens_and_handed_off_bytes(llama_tiny):
    """The router service feeds what the simulator does: every decode worker's step report its decoded tokens, every
    hand-off its prompt's KV bytes (the router's transfer model's)."""
    import asyncio

    from cluster.service import RouterService
    from cluster.worker import Worker
    from engine import EngineConfig, SamplingParams
    from engine.llm import build_engine

    window = 1e6  # longer than the test: the rates hold every amount fed
    config = dict(num_kv_blocks=48, max_num_batched_tokens=8, batch_policy="fcfs", block_size=8)
    engines = {role: build_engine(EngineConfig(model=llama_tiny[0], role=role, **config))
               for role in ("prefill", "decode")}
    limits = ScalingLimits(min_instances=2, max_instances=2, idle_pool=0, min_prefill_instances=1,
                           prefill_rate_window_s=window)
    router = Router(engines["prefill"].tiers, MODEL, autoscaler=Autoscaler(limits), shed_late=False,
                    transfer=TransferModel(TransferLink("test", bandwidth=1e9, latency_s=0.0), bytes_per_token=1000))
    service = RouterService(router, heartbeat_timeout_s=30.0, drain_timeout_s=5.0)
    prompts = {f"r{k}": [(7 * i + 3 * k) % 300 for i in range(20 + 5 * k)] for k in range(3)}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    auto = router.autoscaler

    def decoded() -> int:
        return sum(s.num_decode_seqs for s in engines["decode"].step_stats)

    async def scenario():
        workers = [Worker(engine, instance_id=role, token=service.token, heartbeat_s=0.2)
                   for role, engine in engines.items()]
        for worker in workers:
            await service.attach("127.0.0.1", await worker.start())
        await service.start()
        try:
            tier, slo = router.tiers.resolve(None)
            for request_id, prompt in prompts.items():
                outs = [o async for o in service.generate(request_id, prompt, params, tier.name, slo,
                                                         time.monotonic())]
                assert outs[-1].finish_reason == "length"
            deadline = time.monotonic() + 30.0  # the decode worker's last step report may follow its finish
            while auto.decode_tokens.rate(time.monotonic()) * window < decoded() - 0.5:
                assert time.monotonic() < deadline, "the decode worker's steps were not all fed"
                await asyncio.sleep(0.02)
        finally:
            await service.stop()
            for worker in workers:
                await worker.stop()

    asyncio.run(scenario())
    assert service.counts["handed_off"] == len(prompts)
    assert decoded() == len(prompts) * (params.max_tokens - 1)  # the first token of each came from the prefill side
    now = time.monotonic()
    assert auto.decode_tokens.rate(now) * window == pytest.approx(decoded())
    assert auto.transfer_bytes.rate(now) * window == pytest.approx(sum(map(len, prompts.values())) * 1000)


def test_live_prefill_pool_grows_under_a_burst_of_long_prompts_and_shrinks_after(default_model):
    """Emulated engines fifty times slower than the model: a 1500-token prompt is over a second of prefill, so a
    burst of ten in the 4 s rate window wants more than one prefill engine, of which --max-prefill-instances allows
    two; once idle past --stop-after-idle-s, the second is stopped. The decode engine's KV, full of such prompts,
    holds a batch predicted over the TPOT: it has no compute to spare for prompts of its own, so all go to prefill."""
    from concurrent.futures import ThreadPoolExecutor

    from conftest import openai_client, serving_fleet

    from cluster.fleet import InstanceStatus

    argv = ["--model", default_model, "--executor", "emulated", "--time-scale", "50", "--num-kv-blocks", "16384",
            "--tiers", "batch:500:120000", "--serve-late", "--prefill-instances", "1", "--max-prefill-instances",
            "2", "--min-instances", "2", "--max-instances", "3", "--idle-pool", "0", "--warm-spares", "0",
            "--stop-after-idle-s", "1", "--prefill-rate-window-s", "4"]
    with serving_fleet(argv) as (server, backend):
        router = backend.service.router

        def serving_prefill() -> int:
            return sum(1 for i, v in list(router.fleet.instances.items())
                       if v.status is InstanceStatus.READY and router.roles.get(i) == "prefill")

        def wait_for(condition, what: str) -> None:
            deadline = time.monotonic() + 120.0
            while not condition():
                assert time.monotonic() < deadline, what
                time.sleep(0.05)

        wait_for(lambda: serving_prefill() == 1 and len(router.fleet.instances) == 2, "the PD fleet did not come up")
        client = openai_client(server)
        most = [1]  # the most prefill engines seen serving, sampled every 50 ms from the burst on
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.wait(0.05):
                most[0] = max(most[0], serving_prefill())

        def ask(k: int):
            prompt = [(k * 7 + j) % 1000 + 10 for j in range(1500)]
            return client.completions.create(model=backend.model_name, prompt=prompt, max_tokens=2, temperature=0)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            with ThreadPoolExecutor(10) as pool:
                outs = list(pool.map(ask, range(10)))
            assert all(o.usage.completion_tokens == 2 and o.choices[0].finish_reason == "length" for o in outs)
            assert backend.service.counts["handed_off"] == 10
            wait_for(lambda: most[0] == 2, "the prefill pool did not grow")
            wait_for(lambda: serving_prefill() == 1 and sum(1 for r in router.roles.values() if r == "prefill") == 1,
                     "the prefill pool did not shrink back")
        finally:
            sampling.set()
            sampler.join()
        assert most[0] == 2  # never beyond --max-prefill-instances
        assert sorted(router.roles.values()) == ["decode", "prefill"]


# ---- cluster.serve's flags ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["--max-prefill-instances", "2"],  # no disaggregation
    ["--prefill-instances", "2", "--min-instances", "3", "--max-prefill-instances", "1"],  # below the minimum
    ["--prefill-instances", "1", "--min-instances", "2", "--max-instances", "3", "--max-prefill-instances", "3"],
])
def test_bad_max_prefill_instances_are_refused(default_model, argv):
    from cluster.serve import build_backend, parse_args
    with pytest.raises(ValueError, match="--max-prefill-instances"):
        build_backend(parse_args(["--model", default_model, "--executor", "emulated", *argv]))


@pytest.mark.parametrize("argv, low, high", [
    (["--prefill-instances", "1", "--min-instances", "2"], 1, 1),  # a fixed pool by default
    (["--prefill-instances", "1", "--min-instances", "2", "--max-instances", "6", "--max-prefill-instances", "3"],
     1, 3),
    (["--prefill-instances", "1", "--min-instances", "2", "--max-instances", "6", "--max-prefill-instances", "3",
      "--router-policy", "least-loaded"], 1, 1),  # a baseline serves a fixed fleet
])
def test_prefill_limits_from_the_flags(default_model, argv, low, high):
    from cluster.serve import build_backend, parse_args
    limits = build_backend(parse_args(["--model", default_model, "--executor", "emulated", "--prefill-utilisation",
                                       "0.5", *argv])).service.router.autoscaler.limits
    assert (limits.min_prefill_instances, limits.prefill_cap, limits.prefill_utilisation) == (low, high, 0.5)
