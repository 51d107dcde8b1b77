"""Per-stage autoscaling of a disaggregated fleet (cluster/autoscaler.py): the prefill token rate over its window,
the prefill pool sized from it (ceil, limits, hysteresis, only idle empty engines stopped), the decode pool planned
beside it; the simulator's PD fleet, and a live `cluster.serve` PD fleet of emulated engine processes, growing
the prefill pool under a burst of long prompts and shrinking it after."""
from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest

from cluster.autoscaler import Autoscaler, ScalePlan, ScalingLimits, TokenRate
from cluster.fleet import RoutedRequest
from cluster.router import Router
from cluster.sim.simulator import SimConfig, Simulator
from cluster.sim.workload import Workload
from scheduler.roofline import emulated_latency_model
from scheduler.tiers import Tier, TierSet

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
def pd_router(limits: ScalingLimits, prefill=("p0",), decode=("d0",)) -> Router:
    router = Router(TIERS, MODEL, autoscaler=Autoscaler(limits))
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
    # outside the burst every served request was handed off; in it, one that no prefill engine could take in time
    # ran whole on a decode engine (the router's "convertible" decode instances)
    whole = res.served & ~res.handed_off
    assert not whole[(res.arrival < 10.0) | (res.arrival > 30.0)].any()
    assert res.served.mean() > 0.9


def test_simulated_pd_autoscaling_is_deterministic():
    limits = ScalingLimits(min_instances=2, max_instances=8, idle_pool=0, min_prefill_instances=1,
                           max_prefill_instances=4, stop_after_idle_s=3.0, prefill_rate_window_s=5.0)
    cfg = SimConfig(num_instances=2, prefill_instances=1, autoscale=limits, cold_start_s=2.0, reveal_output_len=True)
    a, b = (Simulator(cfg, TIERS, MODEL).run(burst_workload()) for _ in range(2))
    assert a.samples == b.samples
    np.testing.assert_array_equal(a.attained, b.attained)


# ---- live: cluster.serve with emulated engine processes ----------------------------------------------------------
def test_live_prefill_pool_grows_under_a_burst_of_long_prompts_and_shrinks_after(default_model):
    """Emulated engines fifty times slower than the model: a 1500-token prompt is over a second of prefill, so a
    burst of ten in the 4 s rate window wants more than one prefill engine, of which --max-prefill-instances allows
    two; once idle past --stop-after-idle-s, the second is stopped."""
    from concurrent.futures import ThreadPoolExecutor

    from conftest import openai_client, serving_fleet

    from cluster.fleet import InstanceStatus

    argv = ["--model", default_model, "--executor", "emulated", "--time-scale", "50", "--num-kv-blocks", "1024",
            "--tiers", "batch:5000:120000", "--serve-late", "--prefill-instances", "1", "--max-prefill-instances",
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
