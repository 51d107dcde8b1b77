"""Goodput (DESIGN.md §1): the fluid optimal bound, and the searches that measure a policy against it.

- Fixed fleet: the highest Poisson arrival rate at which >= 90 % of requests (all tiers together) attain their SLO,
  found by bisection on the rate, each probe pooled over several seeds.
- Autoscaled fleet: SLO-attaining requests per instance-second held.
- Fluid bound: for tier k (mean prompt P_k, mean output D_k), B_k is the largest batch whose predicted iteration,
  with the prefill of the requests that replace the finishing ones folded in (B_k * P_k / D_k prompt tokens per
  iteration) and the KV at its steady state (every resident half way through its output), stays within tpot_k,
  fits the KV pool and the engine's sequence cap. One instance then completes at most B_k / (D_k * T(B_k)) tier-k
  requests per second; N instances carrying the mix p_k at best lambda* = N / sum_k (p_k / capacity_k).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from cluster.sim.workload import Workload
from scheduler.latency_model import LatencyModel

ATTAINMENT_TARGET = 0.9


@dataclass(slots=True, frozen=True)
class TierCapacity:
    tier: str
    mean_prompt: float
    mean_output: float
    batch: int  # B_k
    iteration_s: float  # T(B_k)
    requests_per_s: float  # one instance, this tier alone


def tier_capacity(model: LatencyModel, tier: str, tpot_ms: float, mean_prompt: float, mean_output: float,
                  kv_capacity_tokens: int, max_batch: int) -> TierCapacity:
    """B_k, T(B_k) and the per-instance rate of one tier (module docstring)."""
    if not (mean_prompt > 0 and mean_output >= 1):
        raise ValueError(f"tier {tier}: mean prompt and output must be positive, got {mean_prompt}, {mean_output}")
    tpot_s = tpot_ms / 1000.0

    def iteration(b: int) -> float:
        return model.predict(round(b * mean_prompt / mean_output), b,
                             round(b * (mean_prompt + mean_output / 2)))

    def fits(b: int) -> bool:
        return iteration(b) <= tpot_s and b * (mean_prompt + mean_output / 2) <= kv_capacity_tokens

    if not fits(1):
        return TierCapacity(tier, mean_prompt, mean_output, 0, iteration(1), 0.0)
    lo, hi = 1, max_batch  # fits(lo)
    if fits(hi):
        lo = hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    t = iteration(lo)
    return TierCapacity(tier, mean_prompt, mean_output, lo, t, lo / (mean_output * t))


@dataclass(slots=True, frozen=True)
class FluidBound:
    tiers: tuple[TierCapacity, ...]
    shares: tuple[float, ...]  # p_k

    def rate(self, num_instances: int) -> float:
        """lambda*: the most requests per second `num_instances` can carry for this mix."""
        load = sum(p / c.requests_per_s for p, c in zip(self.shares, self.tiers) if p > 0)
        return num_instances / load if load > 0 else math.inf


def fluid_bound(model: LatencyModel, workload: Workload, kv_capacity_tokens: int, max_batch: int) -> FluidBound:
    """The bound for the tier mix and per-tier lengths of `workload` (requests refused at admission left out)."""
    caps, shares = [], []
    served = workload.tier_index >= 0
    total = int(served.sum())
    if total == 0:
        raise ValueError("the workload has no admissible request")
    for k, tier in enumerate(workload.tiers):
        mask = workload.tier_index == k
        count = int(mask.sum())
        shares.append(count / total)
        if count == 0:
            caps.append(TierCapacity(tier.name, 1.0, 1.0, 0, 0.0, 0.0))
            continue
        caps.append(tier_capacity(model, tier.name, tier.tpot_ms, float(workload.prompt_lens[mask].mean()),
                                  float(workload.output_lens[mask].mean()), kv_capacity_tokens, max_batch))
    for p, c in zip(shares, caps):
        if p > 0 and c.requests_per_s == 0:
            raise ValueError(f"tier {c.tier}: no batch meets its TPOT, the bound is zero")
    return FluidBound(tuple(caps), tuple(shares))


# ---- searches -------------------------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Probe:
    rate: float
    attainment: float  # pooled over the seeds
    per_seed: tuple[float, ...]


@dataclass(slots=True, frozen=True)
class GoodputSearch:
    goodput: float  # the highest probed rate that met the target (0 if none)
    probes: tuple[Probe, ...]  # in probing order


def search_goodput(attainment_at: Callable[[float, int], float], seeds: Sequence[int], low: float, high: float,
                   rel_tol: float = 0.03, target: float = ATTAINMENT_TARGET, max_probes: int = 16,
                   width: int = 1, map_fn: Callable = map) -> GoodputSearch:
    """Search for the highest rate whose attainment, averaged over `seeds`, is >= `target`.

    `attainment_at(rate, seed)` runs one simulation; it may answer NaN for a run it gave up on (certain to fail):
    the probe then fails. [low, high] is widened (halving low, doubling high) until low passes and high fails;
    then narrowed until high / low - 1 <= rel_tol. Attainment is treated as falling with the rate (it is, up to
    noise: several seeds per probe keep the noise down).

    `width` rates are probed per round, all their runs through `map_fn` (a process pool's `map` runs them at
    once): the first round probes low and high together, each later one splits the bracket into width + 1 equal
    parts on a log scale. width 1 is bisection (low first, then high)."""
    if not (0 < low < high) or not seeds:
        raise ValueError("need 0 < low < high and at least one seed")
    if width < 1:
        raise ValueError(f"width must be at least 1, got {width}")
    probes: list[Probe] = []
    passed: dict[float, bool] = {}

    def probe(rates: list[float]) -> None:
        rates = rates[:max_probes - len(probes)]
        runs = list(map_fn(_run_one, [(attainment_at, rate, seed) for rate in rates for seed in seeds]))
        for i, rate in enumerate(rates):
            per_seed = tuple(runs[i * len(seeds):(i + 1) * len(seeds)])
            p = Probe(rate, float(np.mean(per_seed)), per_seed)
            probes.append(p)
            passed[rate] = p.attainment >= target

    probe([low, high] if width > 1 else [low])
    while len(probes) < max_probes:
        ok = [r for r, good in passed.items() if good]
        if not ok:  # even the lowest rate fails
            lowest = min(passed)
            if lowest / 2 < 1e-6:
                break
            probe([lowest / 2 ** (i + 1) for i in range(width)])
            continue
        lo = max(ok)
        above = [r for r, good in passed.items() if not good and r > lo]
        if not above:  # nothing above the best passing rate failed yet
            probe([high] if high not in passed else [lo * 2 ** (i + 1) for i in range(width)])
            continue
        hi = min(above)
        if hi / lo - 1 <= rel_tol:
            break
        probe([lo * (hi / lo) ** ((i + 1) / (width + 1)) for i in range(width)])
    return GoodputSearch(max((r for r, good in passed.items() if good), default=0.0), tuple(probes))


def _run_one(job: tuple[Callable[[float, int], float], float, int]) -> float:
    attainment_at, rate, seed = job
    return attainment_at(rate, seed)


def autoscaled_goodput(num_attained: int, instance_seconds: float) -> float:
    """SLO-attaining requests per instance-second held (DESIGN.md §1)."""
    if not instance_seconds > 0:
        raise ValueError(f"instance_seconds must be positive, got {instance_seconds}")
    return num_attained / instance_seconds
