"""Goodput (DESIGN.md §1): the rules, the bound of each rule, and the search that measures a policy by a rule.

Rules, each a score of one run's measured window and a target the score must reach:
- every-tier (the headline): each tier attains its SLO for >= 90 % of its requests; score = the worst tier's share;
- strict: >= 99 % of all requests attain; score = the pooled share.
Refused and unfinished requests count as misses under both.

Bounds, each an upper bound for its own rule (a figure is compared only with the bound of its rule). One instance
serving tier k alone at batch B runs iterations of T(B): B decodes, the prefill of the requests that replace the
finishing ones folded in (B * P_k / D_k prompt tokens per iteration), the KV at its steady state (every resident
half way through its output). Cumulative deadlines let a request of D output tokens spend (ttft_k + (D - 1) *
tpot_k) / D per token on average, more the shorter its output: so a tier is taken class by class of output length
(LENGTH_CLASSES equal-count classes, each with its mean lengths and the allowance of its shortest output, the most
any of its requests may spend), and a class's B is the batch of the highest capacity B / (D * T(B)) among those
whose T(B) is within its allowance and whose KV fits the pool and the sequence cap. A tier's capacity is the
harmonic mean of its classes' (each weighted by its share of the tier's requests). N instances carrying the mix p_k
then serve at most lambda* = N / sum_k (p_k / capacity_k) requests per second. On the tier's mean lengths alone it
is not a bound: a fleet serves short outputs at the large batches their longer allowance permits. A rule that lets a
share of requests miss is bounded by the same computation on the requests it must serve: those left after dropping
the share whose drop leaves the least instance time, per tier for every-tier, from all tiers together for strict.
The drop is the best of several orders, costliest first: each request's instance time at its tier's batch (its
decode iterations' share plus its prompt's marginal prefill time), and prompt plus a multiple of output length
(DROP_OUTPUT_WEIGHTS; for strict, each also weighed by what its units cost in each tier). By its marginal time alone
a long prompt looks cheap, but dropping the longest prompts lowers every iteration's prefill and KV at the classes'
means and so raises their batches: that drop leaves several per cent less instance time on the conversation trace
than the costliest by marginal time. The best of all subsets is not searched, so the bound is only as high as the
best of these orders (bench/RESULTS.md).

Disaggregated (PD) fleets are bounded the same way with the two stages apart (`fluid_bound`'s `prefill_chunk`): a
request's prompt takes prefill instance time at the best per-token cost of a prompt-only step (a chunk of at most
`prefill_chunk` tokens), its other D - 1 tokens decode iterations of T(B) on a decode instance, B decodes and no
prefill, each within the allowance of those tokens, (ttft_k + (D - 1) * tpot_k) / (D - 1) (the first token's time
not charged: an upper bound); the fleet split between the stages as it serves most (fluidly), so a request costs the
sum of its two stages' instance time.

The same computation with a tier's allowance held to `tpot_k * (1 + premium_k)` for every class (`pace_premium`) is
not a bound but a reference: what a fleet serves when the residents of an instance share one pace that runs `premium`
over the TPOT, whatever their output lengths (bench/shared_pace.py measures the premium such a pace can reach).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

import numpy as np

from cluster.sim.workload import Workload
from scheduler.latency_model import LatencyModel


@dataclass(slots=True, frozen=True)
class GoodputRule:
    """What a run must reach for its rate to count: a `target` share of requests attaining, of every tier
    (`per_tier`) or of all pooled."""
    name: str
    target: float
    per_tier: bool

    def score(self, pooled: float, per_tier: dict[str, float]) -> float:
        """The share the target applies to: the worst tier's, or the pooled one."""
        return min(per_tier.values(), default=math.nan) if self.per_tier else pooled

    def passes(self, score: float) -> bool:
        return score >= self.target  # NaN (a run given up) fails


EVERY_TIER = GoodputRule("every-tier", 0.9, per_tier=True)
STRICT = GoodputRule("strict", 0.99, per_tier=False)
# Output-length classes per tier in the bounds: finer classes give a lower (tighter) bound, which has stopped
# moving by this many on the matrix's workloads (bench/RESULTS.md).
LENGTH_CLASSES = 40
# The orders a rule that lets a share of requests miss may drop them in, besides their cost at the tier's batch
# (`_request_costs`): by prompt plus this many times the output, longest first (inf: the output alone). A long prompt
# costs more than its marginal prefill: it raises every iteration's prefill and KV at the class's mean, and so lowers
# the batch the allowance takes.
DROP_OUTPUT_WEIGHTS = (0.0, 1.0, 2.0, 4.0, 8.0, math.inf)


@dataclass(slots=True, frozen=True)
class TierCapacity:
    tier: str
    mean_prompt: float
    mean_output: float
    batch: int  # B at the tier's mean lengths and their allowance
    iteration_s: float  # T(B) then
    requests_per_s: float  # one instance, this tier alone: over its output-length classes (`fluid_bound`)


def tier_capacity(model: LatencyModel, tier: str, tpot_ms: float, ttft_ms: float, mean_prompt: float,
                  mean_output: float, kv_capacity_tokens: int, max_batch: int,
                  allowance_output: float | None = None, decode_only: bool = False,
                  pace_premium: float | None = None) -> TierCapacity:
    """B, T(B) and the per-instance rate of requests of these mean lengths (module docstring), their allowance that
    of an output of `allowance_output` tokens (None: the mean); `decode_only`: a PD decode instance's (no prefill in
    its iterations, one fewer of them, each with that output's allowance per decoded token); `pace_premium`: the
    allowance is instead `tpot_ms * (1 + pace_premium)` whatever the output (one pace shared by every length)."""
    if not (mean_prompt > 0 and mean_output >= 1):
        raise ValueError(f"tier {tier}: mean prompt and output must be positive, got {mean_prompt}, {mean_output}")
    d = mean_output if allowance_output is None else allowance_output
    iterations = mean_output - 1 if decode_only else mean_output
    if iterations <= 0:  # its one token comes with its prompt: nothing to decode
        return TierCapacity(tier, mean_prompt, mean_output, 0, 0.0, math.inf)
    if pace_premium is not None:
        if pace_premium < 0:
            raise ValueError(f"tier {tier}: pace premium must be non-negative, got {pace_premium}")
        allowance_s = tpot_ms * (1.0 + pace_premium) / 1000.0
    elif decode_only:  # the most a decoded token may take: that of the shortest output that decodes at all
        d = max(d, 2.0)
        allowance_s = (ttft_ms + (d - 1) * tpot_ms) / (d - 1) / 1000.0
    else:
        allowance_s = (ttft_ms + (d - 1) * tpot_ms) / d / 1000.0
    kv_per_request = mean_prompt + mean_output / 2

    def iteration(b: int) -> float:
        prefill = 0 if decode_only else round(b * mean_prompt / mean_output)
        return model.predict(prefill, b, round(b * kv_per_request))

    def fits(b: int) -> bool:
        return iteration(b) <= allowance_s and b * kv_per_request <= kv_capacity_tokens

    if not fits(1):
        return TierCapacity(tier, mean_prompt, mean_output, 0, iteration(1), 0.0)
    lo, hi = 1, max_batch  # the largest batch that fits: iteration time grows with the batch
    if fits(hi):
        lo = hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    best = max(range(1, lo + 1), key=lambda b: b / iteration(b))  # not always the largest: the best
    t = iteration(best)
    return TierCapacity(tier, mean_prompt, mean_output, best, t, best / (iterations * t))


@dataclass(slots=True, frozen=True)
class FluidBound:
    tiers: tuple[TierCapacity, ...]
    shares: tuple[float, ...]  # p_k: the requests each tier must serve, as a share of all admitted ones
    # of a PD fleet's instance time at the bound, its prefill instances' (the fluid split); 0 for a co-located one
    prefill_share: float = 0.0

    def rate(self, num_instances: int) -> float:
        """lambda*: the most requests per second `num_instances` can carry for this mix."""
        load = sum(p / c.requests_per_s for p, c in zip(self.shares, self.tiers) if p > 0)
        return num_instances / load if load > 0 else math.inf


def fluid_bound(model: LatencyModel, workload: Workload, kv_capacity_tokens: int, max_batch: int,
                rule: GoodputRule | None = None, prefill_chunk: int | None = None,
                pace_premium: Mapping[str, float] | None = None) -> FluidBound:
    """The bound of `rule` (None: every request attaining) for the tier mix and per-tier lengths of `workload`
    (requests refused at admission left out), `model` giving the step time the fleet really has; with
    `prefill_chunk`, that of a PD fleet whose prefill instances run chunks of at most that many tokens; with
    `pace_premium` (by tier name, every tier), the shared-pace reference instead (module docstring)."""
    served = workload.tier_index >= 0
    total = int(served.sum())
    if total == 0:
        raise ValueError("the workload has no admissible request")
    tiers = workload.tiers
    prefill_s = None if prefill_chunk is None else prefill_seconds_per_token(model, prefill_chunk)
    missing = set() if pace_premium is None else {t.name for t in tiers} - pace_premium.keys()
    if missing:
        raise ValueError(f"pace_premium names no premium for tiers {sorted(missing)}")
    premiums = [None if pace_premium is None else pace_premium[t.name] for t in tiers]
    masks = [workload.tier_index == k for k in range(len(tiers))]

    def capacities(kept: list[np.ndarray]) -> list[TierCapacity]:
        return [_capacity(model, tier, workload, mask, kv_capacity_tokens, max_batch, prefill_s, premium)
                for tier, mask, premium in zip(tiers, kept, premiums)]

    full = capacities(masks)
    if rule is not None and rule.target < 1.0:
        masks, full = _least_time_kept(workload, masks, full, capacities,
                                       _request_costs(model, workload, masks, full, prefill_s),
                                       1.0 - rule.target, rule.per_tier, total)
    shares = tuple(int(m.sum()) / total for m in masks)
    for p, c in zip(shares, full):
        if p > 0 and c.requests_per_s == 0:
            raise ValueError(f"tier {c.tier}: no batch meets its deadlines, the bound is zero")
    bound = FluidBound(tuple(full), shares)
    if prefill_s is None:
        return bound
    # a request's instance time (1 / rate(1)) holds its tier's mean prompt's prefill (`_capacity`)
    prompt_s = prefill_s * sum(p * c.mean_prompt for p, c in zip(shares, full))
    return replace(bound, prefill_share=prompt_s * bound.rate(1))


def prefill_seconds_per_token(model: LatencyModel, max_chunk: int) -> float:
    """The least instance time per prompt token of a prompt-only step: the best chunk of at most `max_chunk`
    tokens with no cached prefix (a longer context only costs more)."""
    return min(model.predict(c, 0, c) / c for c in range(1, max_chunk + 1))


def _capacity(model: LatencyModel, tier, workload: Workload, mask: np.ndarray, kv_capacity_tokens: int,
              max_batch: int, prefill_s: float | None = None, pace_premium: float | None = None) -> TierCapacity:
    """The tier's figures at its mean lengths, its rate over its output-length classes; with `prefill_s` (seconds
    per prompt token on a prefill instance), a PD fleet's: the decode stage's, plus each prompt's prefill time; with
    `pace_premium`, every class at that shared pace (`tier_capacity`)."""
    if not mask.any():
        return TierCapacity(tier.name, 1.0, 1.0, 0, 0.0, 0.0)
    decode_only = prefill_s is not None
    prompts, outputs = workload.prompt_lens[mask], workload.output_lens[mask]
    at_means = tier_capacity(model, tier.name, tier.tpot_ms, tier.ttft_ms, float(prompts.mean()),
                             float(outputs.mean()), kv_capacity_tokens, max_batch, decode_only=decode_only,
                             pace_premium=pace_premium)
    order = np.argsort(outputs, kind="stable")
    seconds_per_request = float(prompts.mean()) * prefill_s if decode_only else 0.0  # of one instance
    for members in np.array_split(order, min(LENGTH_CLASSES, len(order))):
        c = tier_capacity(model, tier.name, tier.tpot_ms, tier.ttft_ms, float(prompts[members].mean()),
                          float(outputs[members].mean()), kv_capacity_tokens, max_batch,
                          allowance_output=float(outputs[members].min()), decode_only=decode_only,
                          pace_premium=pace_premium)
        if c.requests_per_s == 0:
            return replace(at_means, requests_per_s=0.0)
        seconds_per_request += len(members) / len(order) / c.requests_per_s
    return replace(at_means, requests_per_s=1.0 / seconds_per_request)


def _request_costs(model: LatencyModel, workload: Workload, masks: list[np.ndarray],
                   capacities: list[TierCapacity], prefill_s: float | None = None) -> np.ndarray:
    """Each request's instance time at its tier's batch: D * T(B) / B for its decode iterations, plus its prompt's
    prefill at the marginal prefill time per token beside that batch; with `prefill_s`, a PD fleet's: D - 1
    iterations, and the prompt at `prefill_s` per token on a prefill instance (-inf outside the tiers)."""
    cost = np.full(len(workload), -np.inf)
    for mask, c in zip(masks, capacities):
        if prefill_s is not None:
            per_iteration = c.iteration_s / c.batch if c.batch else 0.0
            cost[mask] = (workload.output_lens[mask] - 1) * per_iteration + workload.prompt_lens[mask] * prefill_s
            continue
        if c.batch == 0:
            continue
        kv = round(c.batch * (c.mean_prompt + c.mean_output / 2))
        base = round(c.batch * c.mean_prompt / c.mean_output)
        per_prompt_token = (model.predict(base + 1024, c.batch, kv + 1024) - model.predict(base, c.batch, kv)) / 1024
        cost[mask] = workload.output_lens[mask] * (c.iteration_s / c.batch) + workload.prompt_lens[mask] * per_prompt_token
    return cost


def _least_time_kept(workload: Workload, masks: list[np.ndarray], full: list[TierCapacity],
                     capacities: Callable[[list[np.ndarray]], list[TierCapacity]], costs: np.ndarray, share: float,
                     per_tier: bool, total: int) -> tuple[list[np.ndarray], list[TierCapacity]]:
    """Each tier's requests left once `share` are dropped, of each tier or of all together, and the tiers'
    capacities on them (`full`: on all of them): the drop, costliest first by `costs` or by an order of
    DROP_OUTPUT_WEIGHTS, that leaves the least instance time per admitted request (each tier's own for every-tier,
    the fleet's for strict). Across tiers an order of lengths is tried as it is and weighed by what its units cost in
    each tier (scaled so that a tier's keys add up to the tier's instance time): a tight tier's token costs more."""
    prompts, outputs = workload.prompt_lens.astype(float), workload.output_lens.astype(float)
    keys = [outputs if math.isinf(w) else prompts + w * outputs for w in DROP_OUTPUT_WEIGHTS]
    if not per_tier:
        weighed = []
        for key in keys:
            key = key.copy()
            for m, c in zip(masks, full):
                if m.any() and c.requests_per_s > 0:
                    key[m] *= int(m.sum()) / c.requests_per_s / key[m].sum()
            weighed.append(key)
        keys += weighed
    keys.append(costs)
    admitted = workload.tier_index >= 0
    tried = []
    for key in keys:
        keep = admitted.copy()
        for group in masks if per_tier else [admitted]:
            idx = np.flatnonzero(group)
            n_drop = math.floor(share * len(idx) + 1e-9)
            if n_drop:
                keep[idx[np.argsort(key[idx], kind="stable")[len(idx) - n_drop:]]] = False
        kept = [m & keep for m in masks]
        caps = capacities(kept)
        load = [int(m.sum()) / total / c.requests_per_s if c.requests_per_s > 0 else
                (0.0 if not m.any() else math.inf) for m, c in zip(kept, caps)]
        tried.append((kept, caps, load))
    if not per_tier:
        kept, caps, _ = min(tried, key=lambda t: sum(t[2]))
        return kept, caps
    best = [min(tried, key=lambda t: t[2][k]) for k in range(len(masks))]
    return [b[0][k] for k, b in enumerate(best)], [b[1][k] for k, b in enumerate(best)]


# ---- searches -------------------------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Probe:
    rate: float
    scores: tuple[float, ...]  # the rule's score of each seed's run (NaN: given up)
    passed: bool  # every seed reached the target


@dataclass(slots=True, frozen=True)
class GoodputSearch:
    goodput: float  # the highest rate that passed below every rate that failed (0 if none)
    probes: tuple[Probe, ...]  # in probing order
    confirmed: bool  # the goodput passed on two or more seeds and a rate at most rel_tol above it failed

    @property
    def next_failing(self) -> float:
        """The lowest probed rate that failed (inf if none)."""
        return min((p.rate for p in self.probes if not p.passed), default=math.inf)


def search_goodput(score_at: Callable[[float, int], float], seeds: Sequence[int], low: float, high: float,
                   rule: GoodputRule, rel_tol: float = 0.03, max_probes: int = 16, width: int = 1,
                   map_fn: Callable = map, widen: float = 2.0) -> GoodputSearch:
    """Search for the highest rate at which `rule` passes on every seed.

    `score_at(rate, seed)` runs one simulation and answers the rule's score of its window; it may answer NaN for a
    run it gave up on (certain to fail). A rate passes when every seed's run passes. Attainment falls with the rate
    only up to noise (refused requests cost no capacity, so a heavier load can score higher), so a passing rate
    above one that failed does not count: the answer is the highest passing rate below the lowest failing one, and
    the search narrows that bracket until failing / passing - 1 <= rel_tol. [low, high] is widened (low divided by
    `widen`, high multiplied by it, a step a round) until it holds a pass and a failure: a bracket that is a good
    guess widens best by a small factor, one that may be far off by a large one.

    `width` rates are probed per round, all their runs through `map_fn` (a process pool's `map` runs them at
    once): the first round probes low and high together, each later one splits the bracket into width + 1 equal
    parts on a log scale. width 1 is bisection (low first, then high)."""
    if not (0 < low < high) or not seeds:
        raise ValueError("need 0 < low < high and at least one seed")
    if width < 1:
        raise ValueError(f"width must be at least 1, got {width}")
    if not widen > 1:
        raise ValueError(f"widen must exceed 1, got {widen}")
    probes: list[Probe] = []

    def probe(rates: list[float]) -> None:
        rates = rates[:max_probes - len(probes)]
        runs = list(map_fn(_run_one, [(score_at, rate, seed) for rate in rates for seed in seeds]))
        for i, rate in enumerate(rates):
            scores = tuple(runs[i * len(seeds):(i + 1) * len(seeds)])
            probes.append(Probe(rate, scores, all(rule.passes(x) for x in scores)))

    def bracket() -> tuple[float | None, float]:
        failing = min((p.rate for p in probes if not p.passed), default=math.inf)
        return max((p.rate for p in probes if p.passed and p.rate < failing), default=None), failing

    probe([low, high] if width > 1 else [low])
    while len(probes) < max_probes:
        lo, hi = bracket()
        if lo is None:  # even the lowest rate fails
            lowest = min(p.rate for p in probes)
            if lowest / widen < 1e-6:
                break
            probe([lowest / widen ** (i + 1) for i in range(width)])
        elif math.isinf(hi):  # nothing above the best passing rate failed yet
            probe([high] if all(p.rate != high for p in probes) else [lo * widen ** (i + 1) for i in range(width)])
        elif hi / lo - 1 <= rel_tol:
            break
        else:
            probe([lo * (hi / lo) ** ((i + 1) / (width + 1)) for i in range(width)])
    lo, hi = bracket()
    confirmed = lo is not None and len(seeds) >= 2 and hi / lo - 1 <= rel_tol
    return GoodputSearch(lo or 0.0, tuple(probes), confirmed)


def _run_one(job: tuple[Callable[[float, int], float], float, int]) -> float:
    score_at, rate, seed = job
    return score_at(rate, seed)


def autoscaled_goodput(num_attained: int, instance_seconds: float) -> float:
    """SLO-attaining requests per instance-second held (DESIGN.md §1)."""
    if not instance_seconds > 0:
        raise ValueError(f"instance_seconds must be positive, got {instance_seconds}")
    return num_attained / instance_seconds
