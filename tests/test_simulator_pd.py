"""The simulator's prefill/decode mode (cluster/sim/simulator.py `prefill_instances`) and the KV transfer-time model
(scheduler/transfer.py): where each token comes from, the transfer in the first token gap, blocks given back on
both sides, and the co-located mode unchanged by the PD knobs."""
from __future__ import annotations

import numpy as np
import pytest

from cluster.sim.simulator import SimConfig, Simulator
from scheduler.transfer import LINKS, TransferLink, TransferModel, kv_bytes_per_token, transfer_model
from cluster.sim.workload import Workload
from scheduler.prediction_error import prediction_error
from scheduler.roofline import LLAMA_2_7B, LLAMA_3_1_8B, emulated_latency_model
from scheduler.tiers import Tier, TierSet

TIERS = TierSet([Tier("tight", tpot_ms=30.0, ttft_ms=2000.0), Tier("loose", tpot_ms=100.0, ttft_ms=5000.0)])
MODEL = emulated_latency_model()


def poisson_workload(rate: float, n: int, seed: int, max_prompt: int = 2000, max_output: int = 200) -> Workload:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    prompts = rng.integers(50, max_prompt, n)
    outputs = rng.integers(1, max_output, n)
    outputs[:5] = 1  # a few answered by their first token alone
    return Workload(arrivals, prompts, outputs, rng.integers(0, 2, n).astype(np.int8), TIERS)


def run(workload: Workload, **kw):
    cfg = SimConfig(record_token_times=True, reveal_output_len=True, **kw)
    sim = Simulator(cfg, TIERS, MODEL)
    return sim, sim.run(workload)


# ---- the transfer-time model ------------------------------------------------------------------------------------
def test_kv_bytes_per_token_from_the_model_shape():
    assert kv_bytes_per_token(LLAMA_3_1_8B) == 32 * 2 * 8 * 128 * 2 == 131072
    assert kv_bytes_per_token(LLAMA_2_7B) == 4 * 131072  # all 32 heads are KV heads


def test_transfer_time_is_bytes_over_bandwidth_plus_latency():
    model = transfer_model("net-400g")
    link = LINKS["net-400g"]
    assert model.seconds(0) == link.latency_s
    assert model.seconds(1000) == pytest.approx(1000 * 131072 / link.bandwidth + link.latency_s)
    # the faster the link, the shorter the same prompt's transfer
    times = [transfer_model(name).seconds(4096) for name in ("same-host", "net-400g", "nvlink")]
    assert times == sorted(times, reverse=True)


@pytest.mark.parametrize("bad", [lambda: transfer_model("carrier-pigeon"),
                                 lambda: TransferLink("x", bandwidth=0.0, latency_s=0.0),
                                 lambda: TransferLink("x", bandwidth=1e9, latency_s=-1.0),
                                 lambda: TransferModel(LINKS["nvlink"], 0),
                                 lambda: transfer_model("nvlink").seconds(-1)])
def test_transfer_model_rejects_bad_input(bad):
    with pytest.raises(ValueError):
        bad()


@pytest.mark.parametrize("kw, match", [
    (dict(num_instances=3, prefill_instances=3), "no decode instance"),
    (dict(num_instances=3, prefill_instances=-1), "non-negative"),
    (dict(num_instances=3, transfer="carrier-pigeon"), "transfer must be one of"),
])
def test_pd_config_rejects_bad_input(kw, match):
    with pytest.raises(ValueError, match=match):
        SimConfig(**kw)


@pytest.mark.parametrize("prefill_instances, limits", [
    (1, dict(min_instances=2)),  # an autoscaled PD fleet needs the autoscaler's prefill limits
    (0, dict(min_instances=2, min_prefill_instances=1)),  # and those need a starting prefill pool
    (3, dict(min_instances=2, max_instances=4, min_prefill_instances=1, max_prefill_instances=2)),  # beyond them
])
def test_autoscaled_pd_config_needs_matching_prefill_limits(prefill_instances, limits):
    from cluster.autoscaler import ScalingLimits
    with pytest.raises(ValueError, match="prefill limits"):
        SimConfig(num_instances=4, prefill_instances=prefill_instances, autoscale=ScalingLimits(**limits))


# ---- PD mode -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("link", ["nvlink", "net-400g"])
def test_first_token_from_prefill_the_rest_from_decode_after_the_transfer(link):
    wl = poisson_workload(rate=6.0, n=150, seed=1)
    sim, res = run(wl, num_instances=3, prefill_instances=1, transfer=link)
    assert sim.router.roles == {"i0": "prefill", "i1": "decode", "i2": "decode"}
    assert res.served.all() and res.attained.all()
    transfer = transfer_model(link)
    for i in range(len(wl)):
        times, sources = res.token_times[i], res.token_instances[i]
        assert len(times) == len(sources) == wl.output_lens[i]
        if res.handed_off[i]:
            assert sources[0] == "i0" and all(s in ("i1", "i2") for s in sources[1:])
            assert times[1] - times[0] >= transfer.seconds(int(wl.prompt_lens[i]))
        elif sources[0] == "i0":
            assert sources == ["i0"]  # answered by its first token alone
        else:
            # run whole where its tier's decode instance has compute to spare: only a loose request (a KV full of
            # these contexts steps over the tight tier's 30 ms on this model, within the loose tier's 100 ms)
            assert wl.tier_index[i] == 1 and len(set(sources)) == 1 and sources[0] in ("i1", "i2")
    tight = (wl.tier_index == 0) & (wl.output_lens > 1)
    assert res.handed_off[tight].all() and res.handed_off.sum() > len(wl) // 2
    assert {s for sources in res.token_instances for s in sources[1:]} == {"i1", "i2"}  # both decode instances
    for inst in sim.instances.values():  # every block back, on both sides
        assert inst.free_blocks == inst.num_total_blocks and inst.num_residents == 0


@pytest.mark.parametrize("link", list(LINKS))
def test_one_request_by_hand_prefill_step_transfer_then_decode_steps(link):
    prompt = 1500  # one prefill chunk
    wl = Workload(np.array([0.0]), np.array([prompt]), np.array([3]), np.zeros(1, np.int8), TIERS)
    _, res = run(wl, num_instances=2, prefill_instances=1, transfer=link)
    first = MODEL.predict(prompt, 0, prompt)
    imported = first + transfer_model(link).seconds(prompt)
    second = imported + MODEL.predict(0, 1, prompt + 1)  # the idle decode instance steps as the KV arrives
    third = second + MODEL.predict(0, 1, prompt + 2)
    assert res.token_times[0] == pytest.approx([first, second, third], rel=1e-12)
    assert res.token_instances[0] == ["i0", "i1", "i1"]


@pytest.mark.parametrize("router_policy", ["polyserve", "round-robin"])
def test_decode_instance_short_of_blocks_delays_hand_offs_without_losing_or_leaking(router_policy):
    # the decode instance holds a few prompts' KV at once: imports wait for earlier requests to finish there, in the
    # router's queue (PolyServe counts the KV it places) or refused by the instance and tried again (round-robin
    # does not look)
    wl = poisson_workload(rate=20.0, n=60, seed=3, max_prompt=600, max_output=60)
    sim, res = run(wl, num_instances=2, prefill_instances=1, num_kv_blocks=120, router_policy=router_policy)
    assert res.served.all()
    assert res.counts["handed_off"] == int(res.handed_off.sum())
    # a request not handed off was answered by its first token alone, or (PolyServe) run whole on the decode
    # instance, whose few blocks bound its batch long before either tier's TPOT does
    whole = ~res.handed_off & (wl.output_lens > 1)
    assert res.handed_off.sum() >= len(wl) // 3
    if router_policy == "polyserve":
        assert res.counts["import_refused"] == 0 and res.counts["queued"] > 0
    else:
        assert res.counts["import_refused"] > 0 and not whole.any()
    assert all(set(s) == {"i1"} if whole[i] else s[0] == "i0" and set(s[1:]) <= {"i1"}
               for i, s in enumerate(res.token_instances))
    for inst in sim.instances.values():
        assert inst.free_blocks == inst.num_total_blocks and inst.num_residents == 0


def test_pd_runs_are_deterministic_under_prediction_error():
    wl = poisson_workload(rate=6.0, n=120, seed=4)
    kw = dict(num_instances=3, prefill_instances=1, prediction_error=prediction_error("gpu-typical"), seed=7)
    _, a = run(wl, **kw)
    _, b = run(wl, **kw)
    assert a.token_times == b.token_times and a.token_instances == b.token_instances


# ---- co-located mode ---------------------------------------------------------------------------------------------
def test_co_located_mode_ignores_the_transfer_link():
    wl = poisson_workload(rate=20.0, n=300, seed=5)
    results = [run(wl, num_instances=3, transfer=link, prediction_error=prediction_error("gpu-typical"))[1]
               for link in LINKS]
    first = results[0]
    assert first.handed_off is None
    assert len({s for sources in first.token_instances for s in sources}) == 3  # every instance serves
    for other in results[1:]:
        assert other.attainment() == first.attainment()
        assert other.tier_attainment() == first.tier_attainment()
        assert other.token_times == first.token_times
        assert other.token_instances == first.token_instances


def test_a_draining_tiers_residents_move_mid_stream_without_losing_a_token_or_a_block():
    """The mix turns from loose to tight half way: the router moves residents of the draining loose tier between
    instances (co-located, their KV over the link). Each moved stream goes on from the token it stopped at, after
    its KV's transfer, and ends with its whole output; every block comes back on both sides."""
    rng = np.random.default_rng(1)
    arrivals = np.cumsum(rng.exponential(1.0 / 100.0, 1440))
    arrivals = arrivals[arrivals < 12.0]
    n = len(arrivals)
    prompts, outputs = rng.integers(200, 1500, n), rng.integers(50, 400, n)
    loose = rng.random(n) >= np.where(arrivals < 6.0, 0.1, 0.9)
    wl = Workload(arrivals, prompts, np.where(loose, 2 * outputs, outputs), loose.astype(np.int8), TIERS)
    sim, res = run(wl, num_instances=4, num_kv_blocks=6000)
    moved = [i for i, sources in enumerate(res.token_instances) if len(set(sources)) > 1]
    assert res.counts["moving"] >= len(moved) >= 1
    link = transfer_model(SimConfig().transfer)
    for i in moved:
        times, sources = res.token_times[i], res.token_instances[i]
        assert wl.tier_index[i] == 1 and len(times) == wl.output_lens[i] and res.attained[i]
        k = next(j for j in range(1, len(sources)) if sources[j] != sources[j - 1])
        assert sources[k:] == [sources[k]] * (len(sources) - k)  # moved once, then stays
        assert times[k] - times[k - 1] >= link.seconds(int(wl.prompt_lens[i]) + k - 1)
    for inst in sim.instances.values():
        assert inst.free_blocks == inst.num_total_blocks and inst.num_residents == 0
