"""PolyServe batch policy and the EDF baseline, on hand-computed batches."""
from dataclasses import dataclass, field

import pytest

from scheduler.headroom import Headroom
from scheduler.slo import deadline_terms
from scheduler import SLO, EDFPolicy, FCFSPolicy, KvState, PolyServePolicy, StepPlan

BLOCK = 16


@dataclass(eq=False)
class Req:
    """Satisfies scheduler.types.SchedulableRequest."""
    request_id: str
    arrival: float
    slo: SLO
    num_prompt_tokens: int
    num_tokens: int
    num_computed_tokens: int
    num_output_tokens: int
    num_blocks: int
    max_tokens: int = 1000
    tier: str = ""
    tpot_reserve: float = 0.0
    first_token_due: float = field(init=False)
    tpot_s: float = field(init=False)

    def __post_init__(self):
        self.first_token_due, self.tpot_s = deadline_terms(self.arrival, self.slo)


def decoding(name, arrival, slo, prompt=1000, out=10, blocks=None):
    tokens = prompt + out
    computed = tokens - 1
    return Req(name, arrival, slo, prompt, tokens, computed, out,
               -(-computed // BLOCK) if blocks is None else blocks)


def queued(name, arrival, slo, prompt):
    return Req(name, arrival, slo, prompt, prompt, 0, 0, 0)


class Linear:
    def __init__(self, base, per_prefill, per_decode, per_kv):
        self.c = (base, per_prefill, per_decode, per_kv)

    def predict(self, p, d, k):
        return self.c[0] + self.c[1] * p + self.c[2] * d + self.c[3] * k


# 10 ms per step, 10 us per prefill token, 0.1 ms per decode, 0.1 us per KV token: with 4 decodes of 1010 tokens
# the decodes alone take 10 + 0.4 + 0.404 = 10.804 ms and each prefill token adds 10.1 us
MODEL = Linear(0.010, 1e-5, 1e-4, 1e-7)
TPOT20 = SLO(ttft_ms=1000, tpot_ms=20)
ROOMY = KvState(block_size=BLOCK, num_free_blocks=10_000, num_total_blocks=20_000)
NOW = 100.0


def policy(**kw):
    args = dict(max_num_seqs=64, max_num_batched_tokens=4096, max_prefill_chunk=4096)
    args.update(kw)
    return PolyServePolicy(MODEL, **args)


def decodes_with_slack(slacks_ms, slo=TPOT20, out=10):
    """Decodes whose next token is due slacks_ms[i] after NOW."""
    reqs = []
    for i, slack in enumerate(slacks_ms):
        arrival = NOW + slack / 1000 - (slo.ttft_ms + out * slo.tpot_ms) / 1000
        reqs.append(decoding(f"d{i}", arrival, slo, out=out))
    return reqs


def chunks(plan: StepPlan):
    return [(r.request_id, n) for r, n in plan.scheduled]


def test_every_decode_runs_and_chunk_fits_the_tightest_budget():
    running = decodes_with_slack([40, 25.3, 60, 100])  # tightest: 25.3 ms
    plan = policy().schedule(NOW, running, [queued("w", NOW, TPOT20, 3000)], ROOMY)
    # 25.3 - 10.804 = 14.496 ms of prefill at 10.1 us per token: 1435.2 -> 1435
    assert chunks(plan) == [("d0", 1), ("d1", 1), ("d2", 1), ("d3", 1), ("w", 1435)]
    assert plan.preempted == []


def test_late_decode_budget_is_floored_at_its_tpot():
    running = decodes_with_slack([-5, 40, 60, 100])  # d0 is late: its budget is its tpot, 20 ms
    plan = policy().schedule(NOW, running, [queued("w", NOW, TPOT20, 3000)], ROOMY)
    assert chunks(plan)[-1] == ("w", 910)  # (20 - 10.804) / 0.0101 = 910.5


def test_the_headroom_margin_shrinks_the_budget():
    running = decodes_with_slack([-5, 40, 60, 100])  # budget 20 ms, less a quarter: 15 ms
    headroom = Headroom(margin=0.25)
    plan = policy(headroom=headroom).schedule(NOW, running, [queued("w", NOW, TPOT20, 3000)], ROOMY)
    assert chunks(plan)[-1] == ("w", 415)  # (15 - 10.804) / 0.0101 = 415.4
    headroom.margin = 0.0
    assert chunks(policy(headroom=headroom).schedule(NOW, running, [queued("w", NOW, TPOT20, 3000)], ROOMY))[-1] \
        == ("w", 910)


def test_a_placed_reserve_keeps_a_share_of_a_tpot_before_that_requests_deadline():
    running = decodes_with_slack([40, 35, 60, 100])
    running[1].tpot_reserve = 0.5  # 10 ms of its 35 kept: 25 ms left
    plan = policy().schedule(NOW, running, [queued("w", NOW, TPOT20, 3000)], ROOMY)
    assert chunks(plan)[-1] == ("w", 1405)  # (25 - 10.804) / 0.0101 = 1405.5
    running[1].tpot_reserve, running[2].tpot_reserve = 0.0, 0.5  # 60 - 10 ms: d1's 35 binds again
    assert chunks(policy().schedule(NOW, running, [queued("w", NOW, TPOT20, 3000)], ROOMY))[-1] == ("w", 2395)
    running[1].tpot_reserve = 0.9  # never below the TPOT's floor, as a late request's
    assert chunks(policy().schedule(NOW, running, [queued("w", NOW, TPOT20, 3000)], ROOMY))[-1] == ("w", 910)
    # the headroom's grown reserve, 0.01 of the 1.2 s to d1's deadline (12 ms), is the larger: it is kept alone
    running[1].tpot_reserve = 0.5
    plan = policy(headroom=Headroom(margin=0.01)).schedule(NOW, running, [queued("w", NOW, TPOT20, 3000)], ROOMY)
    assert chunks(plan)[-1] == ("w", 1207)  # (35 - 12 - 10.804) / 0.0101 = 1207.5


def test_no_decodes_means_full_chunks_in_deadline_order():
    waiting = [queued("late", NOW - 0.5, TPOT20, 1500),  # first-token deadline NOW + 0.5
               queued("early", NOW - 0.9, TPOT20, 1000)]  # NOW + 0.1
    plan = policy(max_prefill_chunk=2048).schedule(NOW, [], waiting, ROOMY)
    assert chunks(plan) == [("early", 1000), ("late", 1048)]


def test_prefills_by_first_token_deadline_not_arrival_or_tier():
    tight, loose = SLO(ttft_ms=200, tpot_ms=20), SLO(ttft_ms=1000, tpot_ms=100)
    waiting = [queued("old_loose", NOW - 0.85, loose, 100),  # deadline NOW + 0.15
               queued("new_tight", NOW - 0.02, tight, 100),  # NOW + 0.18
               queued("mid_tight", NOW - 0.1, tight, 100),  # NOW + 0.10
               queued("newest_loose", NOW, loose, 100)]  # NOW + 1.0
    plan = policy().schedule(NOW, [], waiting, ROOMY)
    # the loose request that has waited 850 ms goes before the tight one that arrived 20 ms ago
    assert [name for name, _ in chunks(plan)] == ["mid_tight", "old_loose", "new_tight", "newest_loose"]


def test_budget_is_shared_by_successive_prefills():
    running = decodes_with_slack([40, 60, 100, -1])  # budget 20 ms: 910 prefill tokens in all
    waiting = [queued("a", NOW - 0.9, TPOT20, 300), queued("b", NOW - 0.8, TPOT20, 3000)]
    plan = policy().schedule(NOW, running, waiting, ROOMY)
    # a takes its 300; b gets (20 - 10.804 - 3.03) / 0.0101 = 610.5
    assert chunks(plan)[4:] == [("a", 300), ("b", 610)]


def test_running_prefill_counts_its_cached_prefix():
    running = decodes_with_slack([40, 60, 100, -1])
    partial = Req("p", NOW - 0.5, TPOT20, 2000, 2000, 500, 0, 32)  # 500 of 2000 prompt tokens cached
    plan = policy().schedule(NOW, running + [partial], [], ROOMY)
    # the chunk attends over its 500 cached tokens too: (20 - 10.804 - 0.05) / 0.0101 = 905.5
    assert chunks(plan)[-1] == ("p", 905)


def test_token_and_sequence_caps():
    running = decodes_with_slack([40, 60, 100, 200])
    waiting = [queued("a", NOW - 0.9, TPOT20, 2000), queued("b", NOW - 0.8, TPOT20, 2000)]
    plan = policy(max_num_batched_tokens=100, max_num_seqs=5).schedule(NOW, running, waiting, ROOMY)
    assert chunks(plan)[4:] == [("a", 96)]  # 100 tokens minus 4 decodes
    slack_budget = decodes_with_slack([1000] * 4)
    plan = policy(max_num_seqs=5).schedule(NOW, slack_budget, [queued("a", NOW, TPOT20, 10),
                                                               queued("b", NOW, TPOT20, 10)], ROOMY)
    assert [name for name, _ in chunks(plan)] == ["d0", "d1", "d2", "d3", "a"]  # the 5th sequence slot


def test_kv_shortage_preempts_the_request_with_the_most_slack():
    # three decodes at a block boundary (1024 computed tokens in 64 full blocks): each needs a new block
    slacks = [10, 100, 50]
    running = decodes_with_slack(slacks, out=25)
    assert all(r.num_computed_tokens == 1024 and r.num_blocks == 64 for r in running)
    kv = KvState(block_size=BLOCK, num_free_blocks=1, num_total_blocks=200)
    plan = policy().schedule(NOW, running, [queued("w", NOW, TPOT20, 10)], kv)
    assert [r.request_id for r in plan.preempted] == ["d1"]  # 100 ms of slack
    assert chunks(plan) == [("d0", 1), ("d2", 1)]  # and nobody new under KV pressure


def test_admission_leaves_each_decode_a_block_to_grow():
    running = decodes_with_slack([1000] * 4)  # 1009 computed: room left in their last block
    kv = KvState(block_size=BLOCK, num_free_blocks=6, num_total_blocks=300)
    plan = policy().schedule(NOW, running, [queued("w", NOW - 0.9, TPOT20, 500), queued("x", NOW, TPOT20, 10)], kv)
    # 6 free - 4 reserved = 2 blocks = 32 tokens for w; then the pool is spent and x waits
    assert chunks(plan)[4:] == [("w", 32)]


def test_policy_rejects_bad_configuration():
    with pytest.raises(ValueError, match="exceeds max_num_batched_tokens"):
        PolyServePolicy(MODEL, max_num_seqs=512, max_num_batched_tokens=256)
    with pytest.raises(ValueError, match="max_prefill_chunk"):
        PolyServePolicy(MODEL, max_num_seqs=8, max_num_batched_tokens=256, max_prefill_chunk=0)


# ---- baselines --------------------------------------------------------------------------------------------------

def test_edf_static_budget_lets_a_far_decode_stall():
    slo = SLO(ttft_ms=500, tpot_ms=100)
    d_soon = decoding("d_soon", NOW - 0.5 - 1.0 + 0.04, slo)  # next token due NOW + 0.04
    d_far = decoding("d_far", NOW - 0.5 - 1.0 + 0.3, slo)  # due NOW + 0.3
    waiting = [queued("w1", NOW - 0.45, slo, 80),  # first token due NOW + 0.05
               queued("w2", NOW - 0.40, slo, 50)]  # NOW + 0.10
    plan = EDFPolicy(max_num_seqs=8, max_num_batched_tokens=100).schedule(NOW, [d_soon, d_far], waiting, ROOMY)
    assert chunks(plan) == [("d_soon", 1), ("w1", 80), ("w2", 19)]  # d_far gets nothing this step


def test_edf_preempts_latest_deadline_first():
    slo = SLO(ttft_ms=500, tpot_ms=100)
    soon = decoding("soon", NOW - 1.5 + 0.01, slo, out=25)
    later = decoding("later", NOW - 1.5 + 0.2, slo, out=25)
    latest = decoding("latest", NOW - 1.5 + 0.9, slo, out=25)
    kv = KvState(block_size=BLOCK, num_free_blocks=1, num_total_blocks=200)  # each needs one new block
    plan = EDFPolicy(max_num_seqs=8, max_num_batched_tokens=100).schedule(NOW, [latest, soon, later], [], kv)
    assert [r.request_id for r in plan.preempted] == ["latest"]
    assert chunks(plan) == [("soon", 1), ("later", 1)]


def test_all_policies_share_the_interface():
    slo = SLO(ttft_ms=500, tpot_ms=100)
    running = decodes_with_slack([40, 60], slo=slo)
    waiting = [queued("w", NOW, slo, 50)]
    for p in (FCFSPolicy(64, 8), EDFPolicy(8, 64), PolyServePolicy(MODEL, 8, 64)):
        plan = p.schedule(NOW, running, waiting, ROOMY)
        assert sorted(chunks(plan)) == [("d0", 1), ("d1", 1), ("w", 50)], type(p).__name__


def test_plan_invariants_on_random_states():
    import random
    rng = random.Random(11)
    tiers = [SLO(300, 25), SLO(600, 50), SLO(1500, 100)]
    for trial in range(300):
        running, waiting = [], []
        for i in range(rng.randint(0, 40)):
            slo = rng.choice(tiers)
            if rng.random() < 0.8:
                running.append(decoding(f"d{i}", NOW - rng.uniform(0, 3), slo, prompt=rng.randint(1, 900),
                                        out=rng.randint(1, 300)))
            else:
                prompt = rng.randint(2, 900)
                computed = rng.randint(0, prompt - 1)
                running.append(Req(f"p{i}", NOW - rng.uniform(0, 1), slo, prompt, prompt, computed, 0,
                                   -(-computed // BLOCK)))
        for i in range(rng.randint(0, 40)):
            waiting.append(queued(f"w{i}", NOW - rng.uniform(0, 1), rng.choice(tiers), rng.randint(1, 900)))
        kv = KvState(block_size=BLOCK, num_free_blocks=rng.choice([0, 3, 20, 200]), num_total_blocks=5000)
        max_tokens, max_seqs = rng.choice([64, 512, 2048]), 48
        polyserve = PolyServePolicy(MODEL, max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens,
                                    max_prefill_chunk=rng.choice([32, 256, 2048]))
        edf = EDFPolicy(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens)
        for p in (polyserve, edf):
            plan = p.schedule(NOW, running, waiting, kv)
            ids = [r.request_id for r, _ in plan.scheduled] + [r.request_id for r in plan.preempted]
            assert len(ids) == len(set(ids)), "a request is scheduled or preempted twice"
            assert all(r in running for r in plan.preempted)
            assert all(1 <= n <= r.num_tokens - r.num_computed_tokens for r, n in plan.scheduled)
            assert sum(n for _, n in plan.scheduled) <= max_tokens
            new = [r for r, _ in plan.scheduled if r not in running]
            assert len(running) - len(plan.preempted) + len(new) <= max(max_seqs, len(running))
            freed = sum(r.num_blocks for r in plan.preempted)
            needed = sum(max(0, -(-(r.num_computed_tokens + n) // BLOCK) - r.num_blocks) for r, n in plan.scheduled)
            assert needed <= kv.num_free_blocks + freed, "plan needs more KV blocks than there are"
            if p is polyserve:
                decodes = [r for r in running if r.num_output_tokens and r not in plan.preempted]
                assert all((r, 1) in plan.scheduled for r in decodes), "a running decode was stalled"
                assert plan.preempted == [] or kv.num_free_blocks < sum(
                    max(0, r.num_computed_tokens // BLOCK + 1 - r.num_blocks) for r in running if r.num_output_tokens)
                prefill = [(r, n) for r, n in plan.scheduled if (r, n) not in [(d, 1) for d in decodes]]
                if decodes and prefill:
                    def budget(r):
                        slo = r.slo
                        return max(slo.token_deadline(r.arrival, r.num_output_tokens + 1) - NOW, slo.tpot_ms / 1000)
                    predicted = MODEL.predict(sum(n for _, n in prefill), len(decodes),
                                              sum(r.num_tokens for r in decodes)
                                              + sum(r.num_computed_tokens + n for r, n in prefill))
                    assert predicted <= min(map(budget, decodes)) + 1e-12
