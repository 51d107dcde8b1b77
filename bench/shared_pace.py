"""The TTFT credit a batch can spend when its residents share one pace, and what a fleet of such instances serves.

The cumulative deadline lets a request of D output tokens spend (ttft + (D - 1) * tpot) / D per token, and the
goodput bounds (cluster/sim/goodput.py) credit each output-length class with its own allowance, as though each were
served at its own pace. An instance runs one pace for all its residents. A fluid model of one instance: a closed
batch of B residents, each leaving at its output length (drawn from its tier's outputs in the bounds' sample) and
replaced at once by a fresh one whose first token came `first_token_ms` after its arrival, so that it starts with a
bank of ttft - first_token_ms; each step lasts the TPOT plus a premium that every resident pays out of its bank. No
prefill and no prediction error: an ideal instance. Pace rules:
- least-bank: the least bank over the tier's mean output (a memoryless expected remaining output): no resident's
  bank ever goes below zero;
- known-length: the least of bank / remaining output, every length known: a clairvoyant pace, none missing;
- tenth-bank: the tenth-percentile bank over the mean output: the residents below it may miss.
A tier's batch is the one its capacity takes at that pace (`tier_capacity`'s pace_premium), found by taking premium
and batch in turn, from the every-tier bound's batches, until the batches stop moving or come back to an earlier
round's (a tier with no request in the mix takes none). The every-tier bound recomputed with each tier's
allowance at TPOT x (1 + premium) (`fluid_bound`'s pace_premium) is then a reference for a policy that shares one
pace per instance. Not a bound: a policy could sort requests by predicted length, or move them between instances.

    python -m bench.shared_pace [--workload conv-4tier] [--first-token-ms 60] [--instances 8,16,64,256]
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from bench.goodput import Setup
from cluster.sim.goodput import EVERY_TIER
from cluster.sim.workload import workload_spec

PACE_RULES = ("least-bank", "known-length", "tenth-bank")
MAX_ROUNDS = 8  # premium and batch taken in turn settle within a few rounds (a premium falls as the batch grows)


@dataclass(slots=True, frozen=True)
class PaceOutcome:
    premium: float  # the mean step over the TPOT, less one
    missed: float  # share of the residents that left with their bank below zero


def shared_pace(outputs: np.ndarray, tpot_ms: float, ttft_ms: float, first_token_ms: float, batch: int, rule: str,
                steps: int = 20_000, seed: int = 0) -> PaceOutcome:
    """The fluid instance of the module's doc: `batch` residents whose outputs are drawn from `outputs` (those of
    one token decode nothing and are left out), run `steps` steps under pace `rule`; the first tenth of the steps
    (the batch starting all fresh) is not counted."""
    if rule not in PACE_RULES:
        raise ValueError(f"rule must be one of {', '.join(PACE_RULES)}, got {rule!r}")
    if batch < 1 or steps < 10:
        raise ValueError(f"need a batch of at least 1 and at least 10 steps, got {batch}, {steps}")
    if not 0 <= first_token_ms <= ttft_ms:
        raise ValueError(f"first_token_ms must lie in [0, ttft_ms {ttft_ms}], got {first_token_ms}")
    outputs = np.asarray(outputs)
    outputs = outputs[outputs >= 2]
    if not len(outputs):
        raise ValueError("no output of two tokens or more to draw from")
    rng = np.random.default_rng(seed)
    fresh_bank = ttft_ms - first_token_ms
    mean_output = float(outputs.mean())
    remaining = rng.choice(outputs, batch) - 1.0
    bank = np.full(batch, fresh_bank)
    warmup = steps // 10
    spent = 0.0
    left = missed = 0
    for step in range(steps):
        if rule == "least-bank":
            premium = bank.min() / mean_output
        elif rule == "tenth-bank":
            premium = np.quantile(bank, 0.1) / mean_output
        else:
            premium = (bank / remaining).min()
        premium = max(float(premium), 0.0)
        bank -= premium
        remaining -= 1.0
        counted = step >= warmup
        if counted:
            spent += premium
        done = remaining <= 0
        n = int(done.sum())
        if n:
            if counted:
                left += n
                missed += int((bank[done] < -1e-9 * max(fresh_bank, 1.0)).sum())
            remaining[done] = rng.choice(outputs, n) - 1.0
            bank[done] = fresh_bank
    return PaceOutcome(spent / (steps - warmup) / tpot_ms, missed / left if left else 0.0)


@dataclass(slots=True, frozen=True)
class SharedPaceReference:
    rule: str
    batches: dict[str, int]  # per tier with requests: the batch its capacity takes at its premium
    outcomes: dict[str, PaceOutcome]  # per tier with requests, at that batch
    rate_per_instance: float  # requests per second one instance carries for the mix (the reference's slope)


def shared_pace_reference(setup: Setup, rule: str, first_token_ms: float, steps: int = 20_000,
                          seed: int = 0) -> SharedPaceReference:
    """Each tier's premium under `rule` at the batch that premium lets it take, and the every-tier bound's
    computation with those premiums (module doc). A ValueError names a tier that no batch serves at its premium."""
    sample = setup.bound_sample()
    outputs = {t.name: sample.output_lens[sample.tier_index == k] for k, t in enumerate(sample.tiers)}
    tiers = [t for t in sample.tiers if len(outputs[t.name])]
    served = {t.name for t in tiers}
    premiums = dict.fromkeys(outputs, 0.0)  # a tier with no request costs nothing at any premium
    bound = setup.bound(EVERY_TIER)
    batches: dict[str, int] = {}
    seen: list[dict[str, int]] = []
    outcomes: dict[str, PaceOutcome] = {}
    for _ in range(MAX_ROUNDS):
        now = {c.tier: c.batch for c in bound.tiers if c.tier in served}
        if now in seen:  # settled, or swinging between batches one apart, where the premiums barely differ
            break
        seen.append(now)
        batches = now
        outcomes = {t.name: shared_pace(outputs[t.name], t.tpot_ms, t.ttft_ms, first_token_ms,
                                        max(batches[t.name], 1), rule, steps, seed) for t in tiers}
        premiums.update((name, o.premium) for name, o in outcomes.items())
        try:
            bound = setup.bound(EVERY_TIER, pace_premium=premiums)
        except ValueError as e:
            raise ValueError(f"{rule}: at premiums {_percents(premiums)}: {e}") from None
    else:
        raise RuntimeError(f"batches still moving after {MAX_ROUNDS} rounds: {batches}")
    return SharedPaceReference(rule, batches, outcomes, bound.rate(1))


def _percents(premiums: dict[str, float]) -> str:
    return ", ".join(f"{name} +{x:.1%}" for name, x in premiums.items())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="conv-4tier")
    parser.add_argument("--prediction-error", default="gpu-typical",
                        help="the step time the bounds are computed on (its expected value)")
    parser.add_argument("--first-token-ms", type=float, default=60.0,
                        help="a fresh resident's first token after its arrival (its bank is the TTFT less this)")
    parser.add_argument("--instances", default="8,16,64,256")
    parser.add_argument("--steps", type=int, default=20_000)
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.instances.split(",")]
    setup = Setup(workload_spec(args.workload), None, 8.0, 12.0, args.prediction_error)
    bound = setup.bound(EVERY_TIER).rate(1)
    print(f"{args.workload}, {args.prediction_error} step time, first token {args.first_token_ms:g} ms after arrival")
    print("every-tier bound: " + ", ".join(f"{n}: {bound * n:.1f}" for n in sizes) + " req/s")
    report = {"workload": args.workload, "first_token_ms": args.first_token_ms, "bound_per_instance": bound,
              "tpot_pace_per_instance": None, "rules": {}}
    try:
        tpot_pace = setup.bound(EVERY_TIER, pace_premium={t.name: 0.0 for t in setup.bound_sample().tiers}).rate(1)
    except ValueError as e:
        print(f"at the TPOT's pace: none ({e})")
    else:
        report["tpot_pace_per_instance"] = tpot_pace
        print("at the TPOT's pace: " + ", ".join(f"{n}: {tpot_pace * n:.1f} ({tpot_pace / bound:.1%})"
                                                  for n in sizes))
    for rule in PACE_RULES:
        try:
            ref = shared_pace_reference(setup, rule, args.first_token_ms, args.steps)
        except ValueError as e:
            print(f"{rule}: none ({e})")
            continue
        tiers = ", ".join(f"{name} B {ref.batches[name]} +{o.premium:.1%} (missed {o.missed:.1%})"
                          for name, o in ref.outcomes.items())
        print(f"{rule}: {tiers}")
        print("    " + ", ".join(f"{n}: {ref.rate_per_instance * n:.1f} ({ref.rate_per_instance / bound:.1%})"
                                 for n in sizes) + " req/s")
        report["rules"][rule] = {"batches": ref.batches, "rate_per_instance": ref.rate_per_instance,
                                 "premium": {k: o.premium for k, o in ref.outcomes.items()},
                                 "missed": {k: o.missed for k, o in ref.outcomes.items()}}
    return report


if __name__ == "__main__":
    main()
