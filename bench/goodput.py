"""Goodput of PolyServe and the baselines in the simulator, against the fluid optimal bound.

    python -m bench.goodput [--quick] [--fleet 64] [--fleet-sizes 8,16,32,64,128,256] [--seeds 2] [--processes 2]
                            [--latency-profile FILE] [--trace azure2023_conv] [--out bench/results]
    python -m bench.goodput --scan-only [--policies polyserve] [--scan-rel-tol 0.02]   (the fleet-size scan alone)

Latency model: Llama-3.1-8B bf16 on one H200 (scheduler/roofline.py; what the emulated engines sleep), or a profile
JSON. KV pool: what the weights leave of 90 % of 141 GB (scheduler/roofline.py). Lengths: the Azure conversation
trace; Poisson arrivals; the four default tiers (cluster/sim/workload.py), equal shares unless --mix.

Policies (router, engine batch policy):
  polyserve          polyserve router (tiers, load gradient, lazy promotion    PolyServePolicy
                     after scale-up)
  random             random instance, tiers ignored                             FCFS, 2048-token budget
  round-robin        next instance, tiers ignored                               FCFS, 2048-token budget
  least-loaded       minimum predicted iteration time, tiers ignored            FCFS, 2048-token budget
  co-chunk           least-loaded                                               FCFS, budget sized for the
                                                                                tightest TPOT (static)
  mixed-deadline     least-loaded                                               PolyServePolicy (deadline
                                                                                order, dynamic chunking)
  mixed-deadline-    least-loaded instance that passes PolyServe's             PolyServePolicy
  admission          attainability test, else PolyServe's bounded queue
  lmetric            LMetric (arXiv 2603.15202): least new prefill tokens x    PolyServePolicy
                     batch size
  polyserve-no-gradient / -no-promotion / -eager-promotion / -promotion-before-scale-up: the ablations (the
                     Router's gradient/promotion switches; the last is DESIGN.md §2's order)

Prints (and writes to <out>/goodput.json): the fluid bound per tier; goodput of each policy at --fleet instances
(bisection on the rate, pooled over --seeds, >= 90 % attaining in the measured window); per-instance goodput over
--fleet-sizes for PolyServe and the best baseline (a longer window, and seeds enough for --scan-instance-runs
instance-runs per probe: see `Plan`); the autoscaled fleet through a phase change (the tier mix
inverts mid-run), attaining requests per instance-second; per-tier TTFT/TPOT percentiles; the time to simulate
one hour of the trace at 64 instances; the engine-versus-simulator calibration, one engine in-process and a fleet of
engine processes through the live router. Plots (PNG) go to <out>.
Figures are virtual-time results of the simulator; wall times are this machine's CPU.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import multiprocessing
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from cluster.autoscaler import ScalingLimits
from cluster.sim.goodput import (EVERY_TIER, RULES, FluidBound, GoodputRule, TierCapacity, autoscaled_goodput,
                                 fluid_bound, search_goodput)
from cluster.sim.simulator import SimConfig, SimResult, Simulator
from cluster.sim.workload import DEFAULT_MIX, TierMix, WorkloadFactory, default_tiers, load_trace
from scheduler.prediction_error import PREDICTION_ERRORS, PredictionError, expected_latency_model, prediction_error
from scheduler.chunking import largest_chunk
from scheduler.latency_model import LatencyModel, scaled
from scheduler.profile_table import ProfileTable
from scheduler.roofline import emulated_latency_model
from scheduler.tiers import TierSet

RESULTS = Path(__file__).resolve().parent / "results"
BASELINES = ("random", "round-robin", "least-loaded", "co-chunk", "mixed-deadline", "mixed-deadline-admission",
             "lmetric")
ABLATIONS = ("polyserve-no-gradient", "polyserve-no-promotion", "polyserve-eager-promotion",
             "polyserve-promotion-before-scale-up")
POLICIES = ("polyserve",) + BASELINES + ABLATIONS


@dataclass(slots=True, frozen=True)
class Setup:
    """What every worker process rebuilds the same way (`build_setup`)."""
    trace: str
    latency_profile: str | None
    mix: tuple[float, ...]
    warmup_s: float
    window_s: float
    prediction_error: str = "gpu-typical"  # scheduler.prediction_error.PREDICTION_ERRORS: the fleet's true step time

    @property
    def error(self) -> PredictionError:
        return prediction_error(self.prediction_error)

    def bound(self, rule: GoodputRule | None = EVERY_TIER) -> FluidBound:
        """The fluid bound of `rule` (None: every request attaining) for this setup's tier mix and lengths (a long
        Poisson sample of them)."""
        built = build_setup(self)
        base = SimConfig()
        return fluid_bound(expected_latency_model(built.model, self.error),
                           built.workloads.poisson(200.0, 200.0, seed=0), base.kv_blocks * base.block_size,
                           base.max_num_seqs, rule)


@dataclass(slots=True, frozen=True)
class BuiltSetup:
    """A Setup made concrete: its latency model, the default tiers derived from it, and its workload factory."""
    model: LatencyModel
    tiers: TierSet
    workloads: WorkloadFactory


@functools.cache
def build_setup(setup: Setup) -> BuiltSetup:
    """`setup` built once per process: a forked worker keeps what its parent built and builds the rest itself."""
    model = ProfileTable.load(setup.latency_profile) if setup.latency_profile else emulated_latency_model()
    tiers, workloads = _workloads(setup, model, SimConfig())
    return BuiltSetup(model, tiers, workloads)


def _workloads(setup: Setup, model: LatencyModel, config: SimConfig) -> tuple[TierSet, WorkloadFactory]:
    """The default tiers of `model`, and workloads of `setup`'s trace and mix for a deployment as `config`."""
    tiers = default_tiers(model)
    return tiers, WorkloadFactory(load_trace(setup.trace), tiers, model, config.kv_blocks * config.block_size,
                                  config.max_prefill_chunk, TierMix(setup.mix))


def co_chunk_budget(model, tiers, bound: FluidBound) -> int:
    """The static token budget of co-chunk: the largest chunk with which the tightest tier's full batch (its fluid
    B, at its steady-state KV) still meets the tightest TPOT."""
    tight = bound.tiers[0]
    kv = round(tight.batch * (tight.mean_prompt + tight.mean_output / 2))
    return max(16, largest_chunk(model, tiers[0].tpot_ms / 1000.0, tight.batch, kv, 2048))


def make_simulator(policy: str, num_instances: int, model, tiers, co_budget: int, **config) -> Simulator:
    if policy == "polyserve":
        return Simulator(SimConfig(num_instances=num_instances, **config), tiers, model)
    if policy in ("random", "round-robin", "least-loaded"):
        return Simulator(SimConfig(num_instances=num_instances, router_policy=policy, engine_policy="fcfs",
                                   **config), tiers, model)
    if policy == "co-chunk":
        return Simulator(SimConfig(num_instances=num_instances, router_policy="least-loaded", engine_policy="fcfs",
                                   max_prefill_chunk=co_budget, **config), tiers, model)
    if policy in ("mixed-deadline", "mixed-deadline-admission", "lmetric"):
        router = {"mixed-deadline": "least-loaded", "mixed-deadline-admission": "least-loaded-admission",
                  "lmetric": "lmetric"}[policy]
        return Simulator(SimConfig(num_instances=num_instances, router_policy=router, engine_policy="polyserve",
                                   **config), tiers, model)
    ablation = {"polyserve-no-gradient": dict(gradient=False), "polyserve-no-promotion": dict(promotion="none"),
                "polyserve-eager-promotion": dict(promotion="eager"),
                "polyserve-promotion-before-scale-up": dict(promotion="before-scale-up")}.get(policy)
    if ablation is None:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    return Simulator(SimConfig(num_instances=num_instances, **config), tiers, model, router_kwargs=ablation)


# ---- jobs: each runs in a worker process ----------------------------------------------------------------------
def _score(setup: Setup, policy: str, num_instances: int, co_budget: int, rule: str, rate: float, seed: int) -> float:
    """The score of `rule` in the measured window; NaN for a run given up once its pooled attainment fell below the
    rule's target (then no rule can pass)."""
    built = build_setup(setup)
    duration = setup.warmup_s + setup.window_s
    window = (setup.warmup_s, duration)
    sim = make_simulator(policy, num_instances, built.model, built.tiers, co_budget, seed=seed,
                         prediction_error=setup.error)
    goodput_rule = RULES[rule]
    res = sim.run(built.workloads.poisson(rate, duration, seed), window=window, give_up_below=goodput_rule.target)
    return math.nan if res.aborted else goodput_rule.score(res.attainment(window), res.tier_attainment(window))


@dataclass(slots=True, frozen=True)
class SearchJob:
    """One goodput search of `policy` at `num_instances`, from the bracket [low, high] of rates."""
    setup: Setup
    policy: str
    num_instances: int
    co_budget: int
    seeds: tuple[int, ...]
    low: float
    high: float
    rel_tol: float
    rule: str = EVERY_TIER.name

    def run(self, map_fn=map, width: int = 1) -> dict:
        """Its simulations through `map_fn`, `width` rates per round (cluster.sim.goodput.search_goodput)."""
        t0 = time.perf_counter()
        score_at = functools.partial(_score, self.setup, self.policy, self.num_instances, self.co_budget, self.rule)
        found = search_goodput(score_at, self.seeds, self.low, self.high, RULES[self.rule], rel_tol=self.rel_tol,
                               width=width, map_fn=map_fn)
        return {"policy": self.policy, "num_instances": self.num_instances, "rule": self.rule,
                "goodput": found.goodput, "confirmed": found.confirmed, "next_failing": found.next_failing,
                "probes": [(p.rate, float(np.min(p.scores)), list(p.scores)) for p in found.probes],
                "wall_s": time.perf_counter() - t0}


@dataclass(slots=True, frozen=True)
class DetailJob:
    """One run kept whole: per-tier latency arrays of the measured window and the fleet samples. With `autoscale`,
    `num_instances` is the starting fleet."""
    setup: Setup
    policy: str
    num_instances: int
    co_budget: int
    rate: float
    duration: float
    seed: int = 1
    autoscale: ScalingLimits | None = None
    phase_change_at: float | None = None

    def run(self) -> dict:
        built = build_setup(self.setup)
        config = {} if self.autoscale is None else dict(autoscale=self.autoscale, cold_start_s=30.0)
        sim = make_simulator(self.policy, self.num_instances, built.model, built.tiers, self.co_budget,
                             seed=self.seed, prediction_error=self.setup.error, **config)
        res = sim.run(built.workloads.poisson(self.rate, self.duration, self.seed,
                                              phase_change_at=self.phase_change_at))
        window = (self.setup.warmup_s, self.duration)
        mask = (res.arrival >= window[0]) & (res.arrival < window[1])
        per_tier = {}
        for k, name in enumerate(res.tier_names):
            m = mask & (res.tier == k)
            served = m & res.served
            per_tier[name] = {"ttft": res.ttft[served].tolist(), "mean_tpot": res.mean_tpot[served].tolist(),
                              "max_gap": res.max_gap[served].tolist(),
                              "attained": float(res.attained[m].mean()) if m.any() else math.nan,
                              "attained_mean_tpot": float(res.attained_mean_tpot[m].mean()) if m.any() else math.nan,
                              "attained_max_gap": float(res.attained_max_gap[m].mean()) if m.any() else math.nan,
                              "tpot_ms": built.tiers[k].tpot_ms, "ttft_ms": built.tiers[k].ttft_ms}
        return {"policy": self.policy, "rate": self.rate, "num_instances": self.num_instances,
                "attainment": res.attainment(window), "attained_total": int(res.attained.sum()),
                "instance_seconds": res.instance_seconds, "end_time": res.end_time, "samples": res.samples,
                "per_tier": per_tier, "counts": res.counts, "wall_s": res.wall_s,
                "promoted": float(res.promoted[mask].mean())}


@dataclass(slots=True, frozen=True)
class SpeedJob:
    """The trace as recorded (no rescaling), its first `duration` seconds (None: all of it), at `num_instances`,
    PolyServe, on one core."""
    setup: Setup
    num_instances: int
    duration: float | None

    def run(self) -> dict:
        built = build_setup(self.setup)
        w = built.workloads.replay(seed=0, duration=self.duration)
        res = Simulator(SimConfig(num_instances=self.num_instances), built.tiers, built.model).run(w)
        return {"requests": len(w), "trace_s": w.duration, "wall_s": res.wall_s, "steps": res.num_steps,
                "policy_calls": res.num_policy_calls, "attainment": res.attainment()}


@dataclass(slots=True, frozen=True)
class CalibrationJob:
    """The same workload on one emulated engine in real time and in the simulator (the latency model times
    `time_scale`, `rate` requests per second of scaled time): the simulator as is, and with the engine's measured
    host time per step added to every step."""
    setup: Setup
    time_scale: float
    rate: float
    duration: float
    seed: int

    def run(self) -> dict:
        from cluster.sim.calibration import (attained, replay_on_engine, simulated_with_host_time,
                                             write_emulated_model_folder)

        model = scaled(build_setup(self.setup).model, self.time_scale)
        cfg = SimConfig(num_instances=1, router_policy="round-robin", reveal_output_len=True)
        tiers, workloads = _workloads(self.setup, model, cfg)
        w = workloads.poisson(self.rate, self.duration, self.seed)
        with tempfile.TemporaryDirectory() as folder:
            live = replay_on_engine(w, model, cfg.batch_policy(model), write_emulated_model_folder(folder),
                                    cfg.kv_blocks, clock="real")
        raw = Simulator(cfg, tiers, model).run(w)
        sim = simulated_with_host_time(cfg, tiers, model, w, live)
        live_attained = attained(w, live.token_times)
        out = {"time_scale": self.time_scale, "rate": self.rate, "requests": len(w),
               "step_overhead_s": live.step_overhead_s, "step_overhead_per_seq_s": live.step_overhead_per_seq_s,
               "live_attainment": float(live_attained.mean()), "sim_attainment": sim.attainment(),
               "raw_sim_attainment": raw.attainment(), "live_wall_s": live.wall_s, "live_stall_s": live.stall_s,
               "tiers": {}}
        for k, tier in enumerate(tiers):
            idx = np.flatnonzero(w.tier_index == k)
            out["tiers"][tier.name] = {
                **_live_latencies(w, live.token_times, idx), **_sim_latencies(sim, idx, "sim"),
                **_sim_latencies(raw, idx, "raw"),
                "live_attained": float(live_attained[idx].mean()), "sim_attained": float(sim.attained[idx].mean())}
        return out


def _live_latencies(w, token_times: list[list[float] | None], idx: np.ndarray) -> dict:
    """TTFT and mean TPOT (seconds) of the requests `idx` of a live run, every one of which finished."""
    times = [token_times[i] for i in idx]
    return {"live_ttft": [t[0] - w.arrivals[i] for i, t in zip(idx, times)],
            "live_tpot": [(t[-1] - t[0]) / (len(t) - 1) for t in times if len(t) > 1]}


def _sim_latencies(res: SimResult, idx: np.ndarray, prefix: str) -> dict:
    tpot = res.mean_tpot[idx]
    return {f"{prefix}_ttft": res.ttft[idx].tolist(), f"{prefix}_tpot": tpot[~np.isnan(tpot)].tolist()}


def run_fleet_calibration(setup: Setup, time_scale: float, num_instances: int, load: float, duration: float,
                          seed: int = 7) -> dict:
    """The same workload through a live fleet (`num_instances` emulated engine processes behind the router
    service, cluster.sim.calibration.replay_on_fleet) and in the simulator with as many instances, the engines'
    host time per step added. Run alone: the engines sleep in real time and share this machine's cores."""
    import asyncio

    from cluster.sim.calibration import (attained, replay_on_fleet, simulated_with_host_time,
                                         write_emulated_model_folder)

    model = emulated_latency_model(time_scale)
    cfg = SimConfig(num_instances=num_instances, reveal_output_len=True)
    tiers, workloads = _workloads(setup, model, cfg)
    rate = load * setup.bound().rate(num_instances) / time_scale
    w = workloads.poisson(rate, duration, seed)
    with tempfile.TemporaryDirectory() as folder:
        live = asyncio.run(replay_on_fleet(
            w, time_scale, num_instances, write_emulated_model_folder(folder), cfg.kv_blocks,
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_prefill_chunk=cfg.max_prefill_chunk, model=model))
    sim = simulated_with_host_time(cfg, tiers, model, w, live)
    live_attained = attained(w, live.token_times)
    out = {"time_scale": time_scale, "instances": num_instances, "load": load, "rate": rate, "requests": len(w),
           "failed": live.failed, "live_attainment": float(live_attained.mean()), "sim_attainment": sim.attainment(),
           "step_overhead_s": live.step_overhead_s, "step_overhead_per_seq_s": live.step_overhead_per_seq_s,
           "live_wall_s": live.wall_s, "live_stall_s": live.stall_s, "tiers": {}}
    for k, tier in enumerate(tiers):
        idx = np.flatnonzero((w.tier_index == k) & np.array([t is not None for t in live.token_times]))
        out["tiers"][tier.name] = {**_live_latencies(w, live.token_times, idx), **_sim_latencies(sim, idx, "sim")}
    return out


# ---- orchestration --------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Plan:
    fleet: int
    fleet_sizes: tuple[int, ...]
    seeds: tuple[int, ...]
    warmup_s: float
    window_s: float
    rel_tol: float
    # The fleet-size scan compares fleets with each other, so its window must reach the steady state of the
    # smallest: a short window hides some overload (the queue needs longer than that to push the loosest tier's
    # TTFT over), and on a small fleet the arrivals of a few seconds swing attainment. Each probe pools
    # max(1, scan_instance_runs / n) seeds, so every fleet size is measured with as many instance-runs.
    scan_warmup_s: float
    scan_window_s: float
    scan_instance_runs: int
    scan_rel_tol: float
    autoscale_max: int
    autoscale_duration: float
    speed_duration: float | None
    calibration: tuple[float, float, float]  # time scale, rate per second of scaled time, duration
    fleet_calibration: tuple[float, int, float, float] = (2.0, 4, 0.8, 8.0)  # time scale, instances, load, duration
    policies: tuple[str, ...] = POLICIES
    notes: list[str] = field(default_factory=list)


def make_plan(args) -> Plan:
    if args.quick:
        plan = Plan(fleet=8, fleet_sizes=(4, 8, 16), seeds=(1,), warmup_s=6.0, window_s=10.0, rel_tol=0.08,
                    scan_warmup_s=6.0, scan_window_s=20.0, scan_instance_runs=8, scan_rel_tol=0.1, autoscale_max=8,
                    autoscale_duration=90.0, speed_duration=600.0, calibration=(0.5, 28.0, 8.0))
    else:
        plan = Plan(fleet=64, fleet_sizes=(8, 16, 32, 64, 128, 256), seeds=(1, 2), warmup_s=8.0, window_s=12.0,
                    rel_tol=0.05, scan_warmup_s=12.0, scan_window_s=48.0, scan_instance_runs=64, scan_rel_tol=0.03,
                    autoscale_max=16, autoscale_duration=240.0, speed_duration=None, calibration=(1.0, 16.0, 20.0))
    if args.fleet:
        plan.fleet = args.fleet
    if args.fleet_sizes:
        plan.fleet_sizes = tuple(int(x) for x in args.fleet_sizes.split(","))
    if args.seeds:
        plan.seeds = tuple(range(1, args.seeds + 1))
    if args.scan_rel_tol:
        plan.scan_rel_tol = args.scan_rel_tol
    if args.policies:
        plan.policies = tuple(args.policies.split(","))
        unknown = set(plan.policies) - set(POLICIES)
        if unknown:
            raise SystemExit(f"unknown policies {sorted(unknown)}; known: {', '.join(POLICIES)}")
    return plan


def scan_seeds(plan: Plan, num_instances: int) -> tuple[int, ...]:
    return tuple(range(1, 1 + max(1, math.ceil(plan.scan_instance_runs / num_instances))))


def _map(pool, jobs, label: str) -> list:
    """Every job's `run()`, through the pool when there is one; results in job order, with a progress bar."""
    from tqdm import tqdm

    out = [None] * len(jobs)
    indexed = list(enumerate(jobs))
    it = pool.imap_unordered(_run_indexed, indexed) if pool else map(_run_indexed, indexed)
    for i, result in tqdm(it, total=len(jobs), desc=label, file=sys.stderr, leave=False):
        out[i] = result
    return out


def _run_indexed(indexed_job):
    i, job = indexed_job
    return i, job.run()


# ---- the experiments ------------------------------------------------------------------------------------------
def describe_setup(args, plan: Plan, setup: Setup, bound: FluidBound, co_budget: int) -> dict:
    """Prints the setup and the fluid bound per tier; returns the report's opening entries."""
    built = build_setup(setup)
    base = SimConfig()
    kv_tokens = base.kv_blocks * base.block_size
    print(f"latency model: {args.latency_profile or 'roofline Llama-3.1-8B bf16 on H200'}; KV pool "
          f"{kv_tokens:,} tokens per instance; trace {args.trace}; tier mix {setup.mix}")
    print("\nFluid bound per tier (one instance, that tier alone):")
    print(f"  {'tier':8} {'TPOT ms':>8} {'TTFT ms':>8} {'P':>6} {'D':>5} {'B_k':>5} {'T(B_k) ms':>9} {'req/s':>7}")
    for t, c in zip(built.tiers, bound.tiers):
        print(f"  {t.name:8} {t.tpot_ms:8.2f} {t.ttft_ms:8.1f} {c.mean_prompt:6.0f} {c.mean_output:5.0f} "
              f"{c.batch:5d} {c.iteration_s * 1000:9.2f} {c.requests_per_s:7.2f}")
    print(f"  mix {tuple(round(s, 3) for s in bound.shares)}: lambda* = {bound.rate(1):.2f} req/s per instance; "
          f"co-chunk static budget {co_budget} tokens")
    return {"plan": asdict(plan), "setup": asdict(setup), "kv_capacity_tokens": kv_tokens, "co_chunk_budget": co_budget,
            "tiers": [{"name": t.name, "tpot_ms": t.tpot_ms, "ttft_ms": t.ttft_ms} for t in built.tiers],
            "bound": [asdict(c) for c in bound.tiers], "bound_shares": bound.shares}


def compare_policies(pool, plan: Plan, setup: Setup, co_budget: int, bound: FluidBound) -> list[dict]:
    """Goodput of every policy at the main fleet, printed against the bound and the best baseline."""
    lam = bound.rate(plan.fleet)
    # the ablations on the first seed only: they are the costliest runs (the router's test on every placement)
    jobs = [SearchJob(setup, p, plan.fleet, co_budget, plan.seeds[:1] if p in ABLATIONS else plan.seeds,
                      0.75 * lam, lam, plan.rel_tol) for p in plan.policies]
    searches = _map(pool, jobs, f"goodput at {plan.fleet} instances")
    best = best_baseline(searches)
    print(f"\nGoodput at {plan.fleet} instances (every tier >= 90 % attaining on every seed; seeds {plan.seeds}, "
          f"ablations seed 1; "
          f"lambda* = {lam:.1f} req/s):")
    print(f"  {'policy':26} {'req/s':>8} {'per inst':>8} {'of bound':>8} {'vs best baseline':>16} {'wall s':>7}")
    for s in searches:
        ratio = s["goodput"] / best["goodput"] if best and best["goodput"] else math.nan
        print(f"  {s['policy']:26} {s['goodput']:8.1f} {s['goodput'] / plan.fleet:8.2f} "
              f"{s['goodput'] / lam:8.1%} {ratio:15.2f}x {s['wall_s']:7.0f}")
    return searches


def best_baseline(searches: list[dict]) -> dict | None:
    return max((s for s in searches if s["policy"] in BASELINES), key=lambda s: s["goodput"], default=None)


def run_scan(pool, plan: Plan, setup: Setup, policies: list[str], brackets: dict[str, tuple[float, float]],
             co_budget: int, bound: FluidBound, processes: int = 1) -> list[dict]:
    """Goodput of each policy at each fleet size (searched from `brackets`: per-instance rates), printed as a
    table."""
    jobs = [SearchJob(setup, p, n, co_budget, scan_seeds(plan, n), brackets[p][0] * n, brackets[p][1] * n,
                      plan.scan_rel_tol) for p in policies for n in plan.fleet_sizes]
    if len(jobs) == 1 and pool is not None:  # one search: the pool runs its probes, several rates per round
        job = jobs[0]
        scan = [job.run(pool.map, max(1, processes // len(job.seeds)))]
    else:
        # largest fleets first: they take longest, so the pool stays busy to the end
        order = sorted(range(len(jobs)), key=lambda i: -jobs[i].num_instances)
        scan = _map(pool, [jobs[i] for i in order], "fleet-size scan")
        scan = [scan[order.index(i)] for i in range(len(jobs))]
    print(f"\nGoodput per instance by fleet size (req/s per instance; window {setup.window_s:.0f} s after "
          f"{setup.warmup_s:.0f} s; seeds per probe: {plan.scan_instance_runs} instance-runs / instances; "
          f"searched to {plan.scan_rel_tol:.0%}):")
    print("  " + f"{'instances':>10}{'seeds':>6}" + "".join(f"{p:>18}" for p in policies) + f"{'bound':>10}")
    for n in plan.fleet_sizes:
        row = [next(s for s in scan if s["policy"] == p and s["num_instances"] == n) for p in policies]
        print("  " + f"{n:>10}{len(scan_seeds(plan, n)):>6}" + "".join(f"{r['goodput'] / n:18.2f}" for r in row)
              + f"{bound.rate(1):10.2f}")
    return scan


def autoscale_job(plan: Plan, skewed: Setup, skewed_bound: FluidBound, co_budget: int) -> DetailJob:
    """PolyServe autoscaled through a phase change: the skewed mix, inverted half way, at 0.6 x the bound of the
    largest fleet allowed, starting from the fleet that carries it at 0.8 x the bound per instance."""
    rate = 0.6 * skewed_bound.rate(plan.autoscale_max)
    start_fleet = max(2, math.ceil(rate / (0.8 * skewed_bound.rate(1))))
    limits = ScalingLimits(min_instances=2, max_instances=plan.autoscale_max, idle_pool=2, stop_after_idle_s=10.0)
    return DetailJob(skewed, "polyserve", start_fleet, co_budget, rate, plan.autoscale_duration, autoscale=limits,
                     phase_change_at=plan.autoscale_duration / 2)


def print_latency(details: list[dict], rate: float, fleet: int) -> None:
    print(f"\nPer-tier latency at {rate:.0f} req/s on {fleet} instances (measured window; "
          f"attainment: cumulative / mean-TPOT / max-gap views):")
    print(f"  {'policy':16} {'tier':8} {'TTFT p50/p99 ms':>18} {'TPOT p50/p99 ms':>18} {'attained':>22}")
    for d in details:
        for name, t in d["per_tier"].items():
            ttft = np.array(t["ttft"]) * 1000
            tpot = np.array(t["mean_tpot"]) * 1000
            tpot = tpot[~np.isnan(tpot)]
            print(f"  {d['policy']:16} {name:8} {_pct(ttft, 50):8.0f} / {_pct(ttft, 99):7.0f} "
                  f"{_pct(tpot, 50):8.1f} / {_pct(tpot, 99):7.1f} "
                  f"{t['attained']:6.1%} / {t['attained_mean_tpot']:6.1%} / {t['attained_max_gap']:6.1%}")


def print_autoscaled(auto: dict, job: DetailJob, plan: Plan, skewed_bound: FluidBound) -> None:
    per_inst_s = autoscaled_goodput(auto["attained_total"], auto["instance_seconds"])
    print(f"\nAutoscaled PolyServe, {job.rate:.0f} req/s for {job.duration:.0f} s, tier mix {DEFAULT_MIX} "
          f"inverted at {job.phase_change_at:.0f} s ({job.num_instances} instances at the start, "
          f"2..{plan.autoscale_max}, 2 warm idle, 30 s cold start): attainment {auto['attainment']:.1%} (after "
          f"{plan.warmup_s:.0f} s), {per_inst_s:.2f} attaining requests per instance-second held "
          f"({auto['instance_seconds']:.0f} instance-s; {auto['promoted']:.1%} promoted); fluid bound "
          f"{skewed_bound.rate(1):.2f} req/s per instance")


def print_speed(speed: dict, trace: str, num_instances: int) -> None:
    print(f"\nSpeed: {speed['trace_s']:.0f} s of {trace} as recorded ({speed['requests']} requests) at "
          f"{num_instances} instances, PolyServe: {speed['wall_s']:.1f} s wall on one core ({speed['steps']:,} steps, "
          f"{speed['policy_calls']:,} batch-policy calls; attainment {speed['attainment']:.1%})")


def print_calibration(calib: dict) -> None:
    print(f"\nCalibration, one instance, PolyServePolicy, latency model x{calib['time_scale']}, "
          f"{calib['rate']:g} req/s, {calib['requests']} requests: attaining live engine (real time) "
          f"{calib['live_attainment']:.1%}, simulator {calib['raw_sim_attainment']:.1%}, simulator with the engine's "
          f"measured host time per step ({calib['step_overhead_s'] * 1000:.2f} ms + "
          f"{calib['step_overhead_per_seq_s'] * 1e6:.1f} us per sequence) {calib['sim_attainment']:.1%}; "
          f"the engine stalled {calib['live_stall_s']:.2f} s of {calib['live_wall_s']:.1f} s (CPU taken by other jobs)")
    for name, t in calib["tiers"].items():
        print(f"  {name:8} TTFT p50 live {_pct(np.array(t['live_ttft']) * 1000, 50):7.1f} ms sim "
              f"{_pct(np.array(t['sim_ttft']) * 1000, 50):7.1f} ms; TPOT p50 live "
              f"{_pct(np.array(t['live_tpot']) * 1000, 50):6.2f} ms sim "
              f"{_pct(np.array(t['sim_tpot']) * 1000, 50):6.2f} ms; attained live {t['live_attained']:.0%} sim {t['sim_attained']:.0%}")


def print_fleet_calibration(fleet: dict) -> None:
    print(f"\nCalibration through the live router: {fleet['instances']} emulated engine processes behind the router "
          f"service, latency model x{fleet['time_scale']}, {fleet['rate']:.1f} req/s ({fleet['load']:g} x the fluid "
          f"bound), {fleet['requests']} requests ({fleet['failed']} failed): attaining live "
          f"{fleet['live_attainment']:.1%}, simulator with the engines' host time "
          f"({fleet['step_overhead_s'] * 1000:.2f} ms + {fleet['step_overhead_per_seq_s'] * 1e6:.1f} us per sequence) "
          f"{fleet['sim_attainment']:.1%}; stalls {fleet['live_stall_s']:.2f} s of {fleet['live_wall_s']:.1f} s")
    print(f"  {'tier':8} {'TTFT p50 ms live/sim':>22} {'TTFT p90':>16} {'TPOT p50 live/sim':>20} {'TPOT p90':>14}")
    for name, t in fleet["tiers"].items():
        lt, st = np.array(t["live_ttft"]) * 1000, np.array(t["sim_ttft"]) * 1000
        lp, sp = np.array(t["live_tpot"]) * 1000, np.array(t["sim_tpot"]) * 1000
        print(f"  {name:8} {_pct(lt, 50):10.1f} / {_pct(st, 50):7.1f} {_pct(lt, 90):7.1f} / {_pct(st, 90):6.1f} "
              f"{_pct(lp, 50):10.2f} / {_pct(sp, 50):6.2f} {_pct(lp, 90):6.2f} / {_pct(sp, 90):5.2f}")


# ---- the two modes --------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small fleets, short runs, one seed (a few minutes)")
    ap.add_argument("--fleet", type=int, default=None, help="fixed fleet of the policy comparison (full: 64)")
    ap.add_argument("--fleet-sizes", default=None, help="comma-separated fleet sizes of the scaling scan")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--scan-rel-tol", type=float, default=None,
                    help="relative tolerance of the fleet-size scan's search")
    ap.add_argument("--scan-only", action="store_true",
                    help="only the fleet-size scan, of --policies (default: polyserve), from the fluid bound")
    ap.add_argument("--scan-bracket", default=None, metavar="LOW,HIGH",
                    help="with --scan-only: per-instance rates the search starts from (default 0.85 and 1.15 x "
                         "the fluid bound)")
    ap.add_argument("--policies", default=None, help=f"comma-separated subset of {','.join(POLICIES)}")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--latency-profile", default=None, help="profile JSON (default: the H200 roofline model)")
    ap.add_argument("--trace", default="azure2023_conv")
    ap.add_argument("--mix", default="1,1,1,1", help="tier shares, tightest first (default: equal)")
    ap.add_argument("--prediction-error", default="gpu-typical", choices=list(PREDICTION_ERRORS),
                    help="the fleet's true step time against the model every predictor uses (default gpu-typical)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--replot", metavar="JSON", default=None, help="only redraw the plots of a goodput.json")
    return ap.parse_args(argv)


@contextlib.contextmanager
def _worker_pool(processes: int):
    """Forked worker processes (None for one process: the jobs run here), closed and joined on leaving."""
    pool = multiprocessing.get_context("fork").Pool(processes) if processes > 1 else None
    try:
        yield pool
    finally:
        if pool is not None:
            pool.close()
            pool.join()


def scan_only(args, plan: Plan, scan_setup: Setup, policies: list[str], bound: FluidBound,
              co_budget: int) -> list[dict]:
    """The fleet-size scan alone, every policy searched from one bracket of per-instance rates."""
    lam1 = bound.rate(1)
    bracket = tuple(float(x) for x in args.scan_bracket.split(",")) if args.scan_bracket \
        else (0.85 * lam1, 1.15 * lam1)
    if len(bracket) != 2 or not 0 < bracket[0] < bracket[1]:
        raise SystemExit(f"--scan-bracket wants LOW,HIGH with 0 < LOW < HIGH, got {args.scan_bracket!r}")
    with _worker_pool(args.processes) as pool:
        return run_scan(pool, plan, scan_setup, policies, {p: bracket for p in policies}, co_budget, bound,
                        args.processes)


def every_experiment(args, plan: Plan, setup: Setup, scan_setup: Setup, bound: FluidBound, co_budget: int,
                     report: dict) -> None:
    """The policy comparison, the fleet-size scan of PolyServe and the best baseline, per-tier latency at a common
    load, the autoscaled fleet through a phase change, the simulator's speed and both calibrations, each printed
    and added to `report`."""
    with _worker_pool(args.processes) as pool:
        searches = report["comparison"] = compare_policies(pool, plan, setup, co_budget, bound)
        best = best_baseline(searches)
        scan_policies = [p for p in ("polyserve", best["policy"] if best else None) if p]
        # the comparison's short window flatters every policy a little: start the search from its figures
        guesses = {s["policy"]: (s["goodput"] / plan.fleet) or 0.5 * bound.rate(1) for s in searches}
        report["scan"] = run_scan(pool, plan, scan_setup, scan_policies,
                                  {p: (0.85 * g, 1.15 * g) for p, g in guesses.items()}, co_budget, bound,
                                  args.processes)
        # the remaining runs together, so the pool stays busy
        compared = [s["goodput"] for s in searches if s["policy"] in scan_policies]
        common_rate = 0.8 * min(compared) if all(g > 0 for g in compared) else 0.5 * bound.rate(plan.fleet)
        latency_jobs = [DetailJob(setup, p, plan.fleet, co_budget, common_rate, plan.warmup_s + plan.window_s)
                        for p in scan_policies]
        skewed = Setup(args.trace, args.latency_profile, DEFAULT_MIX, plan.warmup_s, plan.window_s,
                       args.prediction_error)
        skewed_bound = skewed.bound()
        auto_job = autoscale_job(plan, skewed, skewed_bound, co_budget)
        speed_instances = 64
        results = _map(pool, [*latency_jobs, auto_job, SpeedJob(setup, speed_instances, plan.speed_duration),
                              CalibrationJob(setup, *plan.calibration, seed=1)], "detail runs")
    details, auto, speed, calib = results[:len(latency_jobs)], results[-3], results[-2], results[-1]
    report["latency"] = [{k: v for k, v in d.items() if k != "samples"} for d in details]
    print_latency(details, common_rate, plan.fleet)
    report["autoscaled"] = {k: v for k, v in auto.items() if k != "per_tier"}
    print_autoscaled(auto, auto_job, plan, skewed_bound)
    report["speed"] = speed
    print_speed(speed, args.trace, speed_instances)
    report["calibration"] = calib
    print_calibration(calib)
    report["fleet_calibration"] = run_fleet_calibration(setup, *plan.fleet_calibration)
    print_fleet_calibration(report["fleet_calibration"])


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.replot:
        write_plots(json.loads(Path(args.replot).read_text()), Path(args.out))
        return
    plan = make_plan(args)
    mix = tuple(float(x) for x in args.mix.split(","))
    setup = Setup(args.trace, args.latency_profile, mix, plan.warmup_s, plan.window_s, args.prediction_error)
    scan_setup = Setup(args.trace, args.latency_profile, mix, plan.scan_warmup_s, plan.scan_window_s,
                       args.prediction_error)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    bound = setup.bound()
    built = build_setup(setup)
    co_budget = co_chunk_budget(built.model, built.tiers, bound)
    report = describe_setup(args, plan, setup, bound, co_budget)
    if args.scan_only:
        policies = list(plan.policies) if args.policies else ["polyserve"]
        report["scan"] = scan_only(args, plan, scan_setup, policies, bound, co_budget)
        _write_report(report, out_dir / "goodput_scan.json", t_start)
        plot_scan(report["scan"], policies, plan.fleet_sizes, bound.rate(1), out_dir / "goodput_vs_fleet_size.png")
        print(f"\nwrote {out_dir}/goodput_scan.json and goodput_vs_fleet_size.png; total wall time "
              f"{report['wall_s']:.0f} s")
        return
    every_experiment(args, plan, setup, scan_setup, bound, co_budget, report)
    _write_report(report, out_dir / "goodput.json", t_start)
    write_plots(report, out_dir)
    print(f"\nwrote {out_dir}/goodput.json and plots; total wall time {report['wall_s']:.0f} s")


def _write_report(report: dict, path: Path, t_start: float) -> None:
    report["wall_s"] = time.perf_counter() - t_start
    path.write_text(json.dumps(_rounded(report), default=_json_default))


def _pct(a: np.ndarray, q: float) -> float:
    return float(np.percentile(a, q)) if len(a) else math.nan


def _rounded(o):
    """Floats to 5 significant digits (the latency arrays are most of the file)."""
    if isinstance(o, float):
        return float(f"{o:.5g}")
    if isinstance(o, dict):
        return {k: _rounded(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_rounded(v) for v in o]
    return o


def _json_default(o):
    if isinstance(o, (np.integer, np.floating)):
        return o.item()
    raise TypeError(type(o).__name__)


# ---- plots ----------------------------------------------------------------------------------------------------
def write_plots(report: dict, out_dir: Path) -> None:
    """Every figure, from the report alone (so --replot can redraw them)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = report["plan"]
    bound = FluidBound(tuple(TierCapacity(**c) for c in report["bound"]), tuple(report["bound_shares"]))
    plot_attainment_vs_rate(report["comparison"], bound.rate(plan["fleet"]), plan["fleet"],
                            out_dir / "attainment_vs_rate.png")
    scan_policies = list(dict.fromkeys(s["policy"] for s in report["scan"]))
    plot_scan(report["scan"], scan_policies, tuple(plan["fleet_sizes"]), bound.rate(1),
              out_dir / "goodput_vs_fleet_size.png")
    plot_latency(report["latency"], out_dir / "tier_latency.png")
    plot_phase_change(report["autoscaled"], [t["name"] for t in report["tiers"]],
                      plan["autoscale_duration"] / 2, out_dir / "phase_change.png")
    plot_calibration(report["calibration"], out_dir / "calibration.png")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_attainment_vs_rate(searches: list[dict], lam: float, fleet: int, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5))
    for s in searches:
        probes = sorted(p for p in s["probes"] if not math.isnan(p[1]))
        line, = ax.plot([p[0] for p in probes], [p[1] for p in probes], marker="o", ms=3,
                        ls="-" if not s["policy"].startswith("polyserve-") else ":", label=s["policy"])
        stopped = [p[0] for p in s["probes"] if math.isnan(p[1])]
        ax.plot(stopped, [0.0] * len(stopped), marker="x", ls="none", color=line.get_color())
    ax.axhline(EVERY_TIER.target, color="grey", lw=0.8)
    ax.axvline(lam, color="black", ls="--", lw=0.8, label="fluid bound")
    ax.set_xlabel("arrival rate (req/s)")
    ax.set_ylabel("SLO attainment (measured window)")
    ax.set_title(f"Attainment vs rate, {fleet} instances: the goodput search's probes (x at 0: a run stopped "
                 f"early, certain to be below 90 %)", fontsize=9)
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_scan(scan: list[dict], policies: list[str], sizes: tuple[int, ...], bound_per_instance: float,
              path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in policies:
        ax.plot(sizes, [next(s["goodput"] for s in scan if s["policy"] == p and s["num_instances"] == n) / n
                        for n in sizes], marker="o", label=p)
    ax.axhline(bound_per_instance, color="black", ls="--", lw=0.8, label="fluid bound")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.set_xlabel("instances")
    ax.set_ylabel("goodput per instance (req/s)")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_phase_change(auto: dict, tier_names: list[str], change_at: float, path: Path) -> None:
    plt = _plt()
    samples = auto["samples"]
    t = [s[0] for s in samples]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    counts = np.array([s[1] for s in samples])
    ax.stackplot(t, *counts.T, [s[2] for s in samples], labels=[*tier_names, "idle pool"], alpha=0.8)
    ax.plot(t, [s[3] for s in samples], color="black", lw=1, label="live (incl. starting)")
    ax.axvline(change_at, color="red", ls="--", lw=1, label="tier mix inverts")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("instances")
    ax.set_title("Autoscaled PolyServe: instances per tier through a phase change", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_latency(details: list[dict], path: Path) -> None:
    plt = _plt()
    names = list(details[0]["per_tier"])
    fig, axes = plt.subplots(2, len(names), figsize=(3.2 * len(names), 6), squeeze=False)
    for d in details:
        for j, name in enumerate(names):
            t = d["per_tier"][name]
            for row, key, slo in ((0, "ttft", t["ttft_ms"]), (1, "mean_tpot", t["tpot_ms"])):
                v = np.sort(np.array(t[key]) * 1000)
                v = v[~np.isnan(v)]
                ax = axes[row][j]
                if len(v):
                    ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=d["policy"])
                ax.axvline(slo, color="grey", ls="--", lw=0.8)
                ax.set_xlabel(f"{'TTFT' if row == 0 else 'mean TPOT'} (ms), {name}")
                ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("CDF")
    axes[1][0].set_ylabel("CDF")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Per-tier TTFT and TPOT (dashed: the tier's SLO)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_calibration(calib: dict, path: Path) -> None:
    plt = _plt()
    names = list(calib["tiers"])
    fig, axes = plt.subplots(2, len(names), figsize=(3.2 * len(names), 6), squeeze=False)
    for j, name in enumerate(names):
        t = calib["tiers"][name]
        for row, (a, b, what) in enumerate((("live_ttft", "sim_ttft", "TTFT"), ("live_tpot", "sim_tpot", "TPOT"))):
            ax = axes[row][j]
            raw = "raw_ttft" if row == 0 else "raw_tpot"
            for key, style, label in ((a, "-", "engine (real time)"), (b, "--", "simulator + host time"),
                                      (raw, ":", "simulator")):
                v = np.sort(np.array(t[key]) * 1000)
                if len(v):
                    ax.plot(v, np.arange(1, len(v) + 1) / len(v), ls=style, label=label)
            ax.set_xlabel(f"{what} (ms, scaled), {name}")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Engine vs simulator, one instance, latency model x{calib['time_scale']}: attainment "
                 f"{calib['live_attainment']:.1%} live, {calib['sim_attainment']:.1%} simulated with the measured "
                 f"host time, {calib['raw_sim_attainment']:.1%} without", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
