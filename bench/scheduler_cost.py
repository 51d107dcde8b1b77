"""CPU cost of the scheduler's hot calls: `python -m bench.scheduler_cost`.

- one PolyServePolicy.schedule with 256 running (decodes of 4 tiers, some chunked prefills) and 256 waiting requests
  (target <= 200 us);
- one attainability test against an instance with 256 residents (target <= 100 us);
- one latency-model predict, per source.
Each figure is the median of many timed calls, in microseconds, on this machine's CPU.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

from scheduler import (H100_SXM, LLAMA_3_1_8B, SLO, AttainabilityChecker, InstanceState, KvState,
                       OnlineLatencyModel, OutputLengthTracker, PolyServePolicy, ProfileTable, RequestSnapshot,
                       RooflineLatencyModel)
from scheduler.build_profiles import PROFILE_DIR
from scheduler.instance_state import ResidentSummary
from scheduler.slo import deadline_terms

TIERS = [SLO(ttft_ms=300, tpot_ms=25), SLO(ttft_ms=600, tpot_ms=50), SLO(ttft_ms=1500, tpot_ms=100),
         SLO(ttft_ms=3000, tpot_ms=200)]
BLOCK = 16
NOW = 1000.0


@dataclass(eq=False)
class BenchRequest:
    request_id: str
    arrival: float
    slo: SLO
    num_prompt_tokens: int
    num_tokens: int
    num_computed_tokens: int
    num_output_tokens: int
    num_blocks: int
    max_tokens: int
    tier: str = field(init=False)
    tpot_reserve: float = 0.0
    first_token_due: float = field(init=False)
    tpot_s: float = field(init=False)

    def __post_init__(self):
        self.tier = str(self.slo.tpot_ms)
        self.first_token_due, self.tpot_s = deadline_terms(self.arrival, self.slo)


def make_requests(rng: random.Random, n_running: int, n_waiting: int):
    running, waiting = [], []
    for i in range(n_running):
        prompt, slo = rng.randint(100, 3000), rng.choice(TIERS)
        if i % 16 == 0:  # a chunked prefill under way
            computed = rng.randint(0, prompt - 1)
            running.append(BenchRequest(f"r{i}", NOW - rng.uniform(0, 0.2), slo, prompt, prompt, computed, 0,
                                        -(-computed // BLOCK), 1000))
        else:
            out = rng.randint(1, 500)
            computed = prompt + out - 1
            arrival = NOW - (slo.ttft_ms + out * slo.tpot_ms) / 1000 + rng.uniform(0.04, 0.3)  # some slack
            running.append(BenchRequest(f"r{i}", arrival, slo, prompt, prompt + out, computed, out,
                                        -(-computed // BLOCK), 1000))
    for i in range(n_waiting):
        prompt = rng.randint(100, 3000)
        waiting.append(BenchRequest(f"w{i}", NOW - rng.uniform(0, 0.5), rng.choice(TIERS), prompt, prompt, 0, 0, 0,
                                    1000))
    return running, waiting


def median_us(fn, repeat: int) -> float:
    for _ in range(min(20, repeat)):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    rng = random.Random(0)
    roofline = RooflineLatencyModel(H100_SXM, LLAMA_3_1_8B)
    models = {"roofline": roofline, "profile table": ProfileTable.load(PROFILE_DIR / "llama-3.1-8b_h100.json"),
              "online fit": OnlineLatencyModel(roofline)}
    print("predict, median us per call:")
    for name, model in models.items():
        print(f"  {name:14s} {median_us(lambda: model.predict(512, 200, 400_000), 20000):7.2f}")

    running, waiting = make_requests(rng, 256, 256)
    kv = KvState(block_size=BLOCK, num_free_blocks=20_000, num_total_blocks=60_000)
    print("PolyServePolicy.schedule, 256 running + 256 waiting (target <= 200 us):")
    for name, model in models.items():
        policy = PolyServePolicy(model, max_num_seqs=512, max_num_batched_tokens=8192, max_prefill_chunk=2048)
        plan = policy.schedule(NOW, running, waiting, kv)
        prefill = sum(n for r, n in plan.scheduled if r.num_output_tokens == 0)
        us = median_us(lambda: policy.schedule(NOW, running, waiting, kv), 2000)
        print(f"  {name:14s} {us:7.1f} us  ({len(plan.scheduled)} scheduled, {prefill} prefill tokens)")

    tracker = OutputLengthTracker(default_mean=300)
    residents = tuple(RequestSnapshot(arrival=r.arrival, num_prompt_tokens=r.num_prompt_tokens,
                                      max_tokens=r.max_tokens, slo=r.slo, tier=str(r.slo.tpot_ms),
                                      num_computed_tokens=r.num_computed_tokens,
                                      num_output_tokens=r.num_output_tokens) for r in running)
    state = InstanceState(residents=residents, kv_capacity_tokens=2_000_000, iteration_end=NOW + 0.01, tpot_ms=100)
    candidate = RequestSnapshot(arrival=NOW, num_prompt_tokens=1500, max_tokens=1000, slo=TIERS[2], tier="100")
    print("AttainabilityChecker.check (counts the residents each call), and .fits on the summary an owner keeps "
          "(the router's scan), 256 residents (target <= 100 us):")
    summary = ResidentSummary(residents, tracker)
    for name, model in models.items():
        checker = AttainabilityChecker(model, tracker, max_prefill_chunk=2048)
        result = checker.check(state, candidate, NOW)
        us = median_us(lambda: checker.check(state, candidate, NOW), 2000)
        fits_us = median_us(lambda: checker.fits(summary, 2_000_000, NOW + 0.01, 100, candidate, NOW), 2000)
        print(f"  {name:14s} check {us:7.1f} us, fits {fits_us:5.1f} us  (ok={result.ok}, "
              f"reason={result.reason and result.reason.value}, peak KV {result.peak_kv_tokens})")


if __name__ == "__main__":
    main()
