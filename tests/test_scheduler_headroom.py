"""The feedback headroom: it settles where the share of requests missing equals its target."""
import random

import pytest

from scheduler.headroom import HANDED_OFF, LATE_START, MISSED, ON_TIME, Headroom, handed_off


def test_misses_raise_and_attainments_lower_the_margin_within_bounds():
    h = Headroom(target=0.01, step=0.02, max_margin=0.1)
    for _ in range(10):
        h.missed()
    assert h.margin == pytest.approx(0.1)  # capped
    h.attained()
    assert h.margin == pytest.approx(0.1 - 0.02 * 0.01 / 0.99)
    for _ in range(10_000):
        h.attained()
    assert h.margin == 0.0 and h.budget_ms(50.0) == 50.0
    assert (h.num_missed, h.num_attained) == (10, 10_001)


def test_settles_at_the_margin_whose_miss_rate_is_the_target():
    """Requests miss when a random slowdown (here uniform up to 20 %) exceeds the margin planned for: the miss rate
    at margin m is 0.2 - m over 0.2, so a 1 % target needs m = 0.198."""
    rng = random.Random(3)
    h = Headroom(target=0.01, step=0.002)
    misses = []
    for i in range(200_000):
        missed = rng.uniform(0.0, 0.2) > h.margin
        (h.missed if missed else h.attained)()
        if i >= 100_000:
            misses.append(missed)
    assert sum(misses) / len(misses) == pytest.approx(0.01, abs=0.002)
    assert h.margin == pytest.approx(0.198, abs=0.004)


def test_a_late_first_token_is_a_late_start_and_so_is_a_handed_off_requests_first_token_where_it_goes():
    h = Headroom()
    assert h.note_token(ON_TIME, True, True) == LATE_START and h.num_missed == 0
    assert h.note_token(ON_TIME, False, True) == MISSED and h.num_missed == 1
    assert handed_off(ON_TIME) == HANDED_OFF and handed_off(LATE_START) == LATE_START
    assert h.note_token(HANDED_OFF, False, True) == LATE_START and h.num_missed == 1
    on_time = h.note_token(HANDED_OFF, False, False)
    assert on_time == ON_TIME and h.note_token(on_time, False, True) == MISSED and h.num_missed == 2


@pytest.mark.parametrize("kwargs", [dict(target=0.0), dict(target=1.0), dict(step=0.0), dict(step=0.6),
                                    dict(max_margin=1.0), dict(margin=0.9)])
def test_bad_settings_named(kwargs):
    with pytest.raises(ValueError, match="target|step|margin"):
        Headroom(**kwargs)


def test_every_margin_of_a_deployment_follows_its_headroom_target(llama_tiny):
    """The router's two margins per tier, the engine's, and the simulated engines' let the configured share miss."""
    import numpy as np

    from cluster.router import Router
    from cluster.sim.simulator import SimConfig, Simulator
    from cluster.sim.workload import Workload
    from engine.config import EngineConfig
    from engine.llm import build_engine
    from scheduler.roofline import emulated_latency_model
    from scheduler.tiers import parse_tiers

    tiers, model = parse_tiers("a:20:500,b:100:2000"), emulated_latency_model()
    router = Router(tiers, model, headroom_target=0.02)
    assert [h.target for h in router.headroom + router.first_token_headroom] == [0.02] * 4
    engine = build_engine(EngineConfig(model=llama_tiny[0], executor="emulated", num_kv_blocks=64,
                                       headroom_target=0.02))
    assert engine.headroom.target == 0.02 and engine.policy.headroom is engine.headroom
    sim = Simulator(SimConfig(num_instances=2, headroom_target=0.02), tiers, model)
    one = Workload(np.array([0.0]), np.array([100], np.int64), np.array([5], np.int64), np.zeros(1, np.int8), tiers)
    assert sim.run(one).served.all()
    assert [h.target for h in sim.router.headroom] + [i.headroom.target for i in sim.instances.values()] == [0.02] * 4
    for bad in (0.0, 1.0):
        with pytest.raises(ValueError, match="headroom target"):
            Router(tiers, model, headroom_target=bad)
        with pytest.raises(ValueError, match="headroom target"):
            Simulator(SimConfig(num_instances=1, headroom_target=bad), tiers, model)
        with pytest.raises(ValueError, match="headroom target"):
            build_engine(EngineConfig(model=llama_tiny[0], executor="emulated", num_kv_blocks=64,
                                      headroom_target=bad))
