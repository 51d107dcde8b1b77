"""The live check: a fleet of engine processes behind the real router, under prediction error, at a share of the
simulator's headline goodput; every tier must attain, and the simulator must agree with the fleet.

    python -m bench.live_check [--duration 60] [--time-scale 2.0] [--presets cpu-measured,gpu-typical]
                               [--load 0.8] [--warmup 10] [--seed 3] [--search-seeds 1,2] [--out bench/results]

Per prediction-error preset (scheduler/prediction_error.py):
1. The simulator's headline goodput (every tier >= 90 % attaining on each of --search-seeds; cluster.sim.goodput)
   at 4 instances: the Llama-3.1-8B/H200 roofline times --time-scale (the default tiers derived from it, so they
   scale too), the conv-4tier workload, Poisson arrivals over --duration seconds, attainment of the requests
   arriving after --warmup, batch limits and KV pool as SimConfig's defaults, every request's output length known
   (the live replay sends max_tokens = its output length, ignore_eos), the fleet configured for the headline rule
   on both sides: the router's and the engines' margins at the rule's headroom target, and the router's costly
   share the rule's (bench.goodput.rule_fleet).
2. The live fleet: 4 `cluster.worker` processes whose emulated executors sleep the preset's truth (their draws
   seeded by --seed and their instance ids), behind the router service (cluster.sim.calibration.replay_on_fleet),
   the workload of --seed at --load x that goodput sent in real time, then drained. The simulator runs the same
   workload, preset and seed twice: as is, and with the engines' host time per step added (fitted to their step
   reports: what each step took beyond the truth it slept). The live engines spend that CPU time besides the truth,
   so agreement is judged against the second.
3. PASS/FAIL: every tier attains >= 90 % live; |live - simulated with host time| <= 5 points in every tier.

The preset's host time, stalls and noise are absolute or relative to the unscaled step and are not scaled with
--time-scale: the simulator and the engines both step on them as they are. Requests the router refuses (429: shed
once their first token can no longer be on time, a full queue, or among the costly share) or that end without their
whole output count as misses. Stalls are time that neither the truth nor the fitted host time explains (the CPU
taken by another process): no simulator can know of them, so a run with many says little about the simulator. On
this 2-core machine the time scale must leave the four engines and the router enough CPU to keep up: --time-scale 2
does with the machine quiet.

Written to <out>/live_check.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bench.goodput import rule_fleet
from cluster.sim.calibration import attained, replay_on_fleet, simulated_with_host_time, write_emulated_model_folder
from cluster.sim.goodput import EVERY_TIER, fluid_bound, search_goodput
from cluster.sim.simulator import SimConfig, Simulator
from cluster.sim.workload import TierMix, Workload, WorkloadFactory, default_tiers, load_trace, workload_spec
from scheduler.latency_model import LatencyModel
from scheduler.prediction_error import PREDICTION_ERRORS, expected_latency_model, prediction_error
from scheduler.roofline import emulated_latency_model
from scheduler.tiers import TierSet

RESULTS = Path(__file__).resolve().parent / "results"
NUM_INSTANCES = 4
WORKLOAD = workload_spec("conv-4tier")  # the matrix's reference workload: equal shares of the four default tiers
AGREEMENT_POINTS = 5.0  # the most |live - simulated| attainment may differ in any tier, percentage points
SEARCH_REL_TOL = 0.03
# The search starts between these shares of the every-tier fluid bound: a guess, as the headline goodput lies below
# its bound by a share the tiers and the prediction error decide; the search widens the bracket when it lies outside.
SEARCH_BRACKET = (0.7, 1.0)


@dataclass(slots=True, frozen=True)
class Deployment:
    """One preset's fleet as both the simulator and the live replay run it."""
    preset: str
    time_scale: float
    duration_s: float
    warmup_s: float
    model: LatencyModel
    tiers: TierSet
    workloads: WorkloadFactory

    @property
    def window(self) -> tuple[float, float]:
        return self.warmup_s, self.duration_s

    def config(self, seed: int) -> SimConfig:
        return SimConfig(num_instances=NUM_INSTANCES, reveal_output_len=True,
                         prediction_error=prediction_error(self.preset), seed=seed, **rule_fleet(EVERY_TIER))

    def poisson(self, rate: float, seed: int) -> Workload:
        return self.workloads.poisson(rate, self.duration_s, seed)


def deployment(preset: str, time_scale: float, duration_s: float, warmup_s: float) -> Deployment:
    model = emulated_latency_model(time_scale)  # what every emulated engine sleeps the truth of
    base = SimConfig()
    tiers = default_tiers(model, base.max_prefill_chunk)
    workloads = WorkloadFactory(load_trace(WORKLOAD.trace), tiers, model, base.kv_blocks * base.block_size,
                                base.max_prefill_chunk, TierMix(WORKLOAD.mix))
    return Deployment(preset, time_scale, duration_s, warmup_s, model, tiers, workloads)


def simulator_goodput(dep: Deployment, seeds: tuple[int, ...]) -> dict:
    """The simulator's headline goodput of `dep`, with the bound of its rule that the search starts from."""
    cfg = dep.config(seeds[0])
    sample = dep.workloads.poisson(200.0, 200.0, seed=0)  # a long sample of the mix's lengths
    bound = fluid_bound(expected_latency_model(dep.model, cfg.prediction_error), sample,
                        cfg.kv_blocks * cfg.block_size, cfg.max_num_seqs, EVERY_TIER).rate(NUM_INSTANCES)
    progress = tqdm(desc=f"{dep.preset}: simulator goodput search", unit="run", file=sys.stderr)

    def score_at(rate: float, seed: int) -> float:
        res = Simulator(dep.config(seed), dep.tiers, dep.model).run(dep.poisson(rate, seed), window=dep.window,
                                                                    give_up_below=EVERY_TIER.target)
        progress.update()
        if res.aborted:
            return float("nan")
        return EVERY_TIER.score(res.attainment(dep.window), res.tier_attainment(dep.window))

    found = search_goodput(score_at, seeds, SEARCH_BRACKET[0] * bound, SEARCH_BRACKET[1] * bound, EVERY_TIER,
                           rel_tol=SEARCH_REL_TOL)
    progress.close()
    return {"goodput": found.goodput, "confirmed": found.confirmed, "next_failing": found.next_failing,
            "bound": bound, "seeds": list(seeds),
            "probes": [{"rate": p.rate, "scores": list(p.scores), "passed": p.passed} for p in found.probes]}


async def _with_progress(replay, duration_s: float, label: str):
    """`replay` awaited while a bar counts its wall seconds (the engines' start-up, then the arrivals) up to the
    arrivals' duration, and marks the drain past it."""
    bar = tqdm(total=round(duration_s), desc=label, unit="s", file=sys.stderr)

    async def tick() -> None:
        while True:
            await asyncio.sleep(1.0)
            if bar.n < bar.total:
                bar.update()
            else:
                bar.set_postfix_str("draining")

    ticker = asyncio.get_running_loop().create_task(tick())
    try:
        return await replay
    finally:
        ticker.cancel()
        bar.close()


def live_check(dep: Deployment, rate: float, seed: int) -> dict:
    """The live fleet and the simulator on one workload at `rate`: per-tier attainment over the window and the
    criteria."""
    cfg = dep.config(seed)
    w = dep.poisson(rate, seed)
    with tempfile.TemporaryDirectory() as folder:
        replay = replay_on_fleet(w, dep.time_scale, NUM_INSTANCES, write_emulated_model_folder(folder),
                                 cfg.kv_blocks, max_num_seqs=cfg.max_num_seqs,
                                 max_num_batched_tokens=cfg.max_num_batched_tokens,
                                 max_prefill_chunk=cfg.max_prefill_chunk, model=dep.model,
                                 prediction_error=dep.preset, step_seed=seed, headroom_target=cfg.headroom_target,
                                 costly_share=cfg.costly_share)
        live = asyncio.run(_with_progress(replay, dep.duration_s, f"{dep.preset}: live fleet"))
    plain = Simulator(cfg, dep.tiers, dep.model).run(w)
    with_host = simulated_with_host_time(cfg, dep.tiers, dep.model, w, live)
    live_attained = attained(w, live.token_times)
    in_window = (w.arrivals >= dep.window[0]) & (w.arrivals < dep.window[1])
    tiers = {}
    for k, tier in enumerate(dep.tiers):
        mask = in_window & (w.tier_index == k)
        live_share = float(live_attained[mask].mean()) if mask.any() else float("nan")
        sim_share = with_host.tier_attainment(dep.window).get(tier.name, float("nan"))
        tiers[tier.name] = {"tpot_ms": tier.tpot_ms, "ttft_ms": tier.ttft_ms, "requests": int(mask.sum()),
                            "live": live_share, "sim_with_host_time": sim_share,
                            "sim_preset_only": plain.tier_attainment(dep.window).get(tier.name, float("nan")),
                            "difference_points": 100.0 * (live_share - sim_share)}
    live_pooled = float(live_attained[in_window].mean())
    every_tier_attains = all(t["live"] >= EVERY_TIER.target for t in tiers.values())
    simulator_agrees = all(abs(t["difference_points"]) <= AGREEMENT_POINTS for t in tiers.values())
    return {"rate": rate, "seed": seed, "requests": len(w), "requests_in_window": int(in_window.sum()),
            "refused_at_admission": w.num_refused, "tiers": tiers,
            "pooled": {"live": live_pooled, "sim_with_host_time": with_host.attainment(dep.window),
                       "sim_preset_only": plain.attainment(dep.window),
                       "difference_points": 100.0 * (live_pooled - with_host.attainment(dep.window))},
            "live_refused_429": live.refused, "live_failed": live.failed,
            "sim_shed": with_host.counts.get("shed", 0), "sim_rejected": with_host.counts.get("rejected", 0),
            "host_time_s": live.step_overhead_s, "host_time_per_seq_s": live.step_overhead_per_seq_s,
            "steps": live.steps, "live_wall_s": live.wall_s, "live_stall_s": live.stall_s,
            "every_tier_attains": every_tier_attains, "simulator_agrees": simulator_agrees}


def print_check(dep: Deployment, search: dict, check: dict, load: float, wall_s: float) -> None:
    print(f"\n== {dep.preset}: {NUM_INSTANCES} engine processes behind the router, latency model x{dep.time_scale:g}, "
          f"{WORKLOAD.name}, {dep.duration_s:g} s of arrivals, window [{dep.window[0]:g}, {dep.window[1]:g}) s")
    confirmed = "" if search["confirmed"] else " (not confirmed by a failure within the tolerance above it)"
    print(f"simulator headline goodput {search['goodput']:.2f} req/s{confirmed}, next failing "
          f"{search['next_failing']:.2f}, every-tier fluid bound {search['bound']:.2f}; seeds "
          f"{','.join(map(str, search['seeds']))}")
    print(f"live at {load:g} x goodput = {check['rate']:.2f} req/s, seed {check['seed']}: {check['requests']} requests "
          f"({check['requests_in_window']} in the window, {check['refused_at_admission']} refused at admission); "
          f"live refused 429 (shed late, queue full or costly) {check['live_refused_429']}, "
          f"failed {check['live_failed']}; "
          f"simulator refused {check['sim_rejected']} ({check['sim_shed']} shed late)")
    print(f"engines' host time beyond the truth they slept: {check['host_time_s'] * 1000:.2f} ms + "
          f"{check['host_time_per_seq_s'] * 1e6:.1f} us per sequence per step (added to the simulator's steps); "
          f"stalls {check['live_stall_s']:.2f} s over {check['live_wall_s']:.1f} s of replay; steps "
          + ", ".join(f"{k} {n}" for k, n in sorted(check["steps"].items())))
    print(f"  {'tier':8} {'TPOT/TTFT ms':>15} {'requests':>8} {'live':>7} {'sim+host':>9} {'diff pts':>9} "
          f"{'sim (preset only)':>18}")
    for name, t in check["tiers"].items():
        print(f"  {name:8} {t['tpot_ms']:7.2f}/{t['ttft_ms']:<7.1f} {t['requests']:8d} {t['live']:7.1%} "
              f"{t['sim_with_host_time']:9.1%} {t['difference_points']:+9.1f} {t['sim_preset_only']:18.1%}")
    p = check["pooled"]
    print(f"  {'pooled':8} {'':15} {check['requests_in_window']:8d} {p['live']:7.1%} {p['sim_with_host_time']:9.1%} "
          f"{p['difference_points']:+9.1f} {p['sim_preset_only']:18.1%}")
    print(f"every tier >= {EVERY_TIER.target:.0%} live: {'PASS' if check['every_tier_attains'] else 'FAIL'}; "
          f"|live - simulated with host time| <= {AGREEMENT_POINTS:g} points per tier: "
          f"{'PASS' if check['simulator_agrees'] else 'FAIL'}; wall time {wall_s:.0f} s")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals (default 60; then the drain)")
    ap.add_argument("--warmup", type=float, default=10.0,
                    help="seconds of arrivals left out of attainment while the fleet fills (default 10)")
    ap.add_argument("--time-scale", type=float, default=2.0,
                    help="every step time times this, so the CPUs keep up (default 2)")
    ap.add_argument("--presets", default="cpu-measured,gpu-typical",
                    help=f"comma-separated prediction-error presets of {','.join(PREDICTION_ERRORS)}")
    ap.add_argument("--load", type=float, default=0.8, help="the live rate as a share of the goodput (default 0.8)")
    ap.add_argument("--seed", type=int, default=3, help="the live workload's and step times' seed (default 3)")
    ap.add_argument("--search-seeds", default="1,2", help="seeds every probe of the goodput search passes on")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    presets = args.presets.split(",")
    unknown = set(presets) - set(PREDICTION_ERRORS)
    if unknown:
        ap.error(f"unknown presets {sorted(unknown)}; known: {', '.join(PREDICTION_ERRORS)}")
    if not (args.duration > 0 and 0 <= args.warmup < args.duration):
        ap.error("need --duration > 0 and 0 <= --warmup < --duration")
    if not (args.time_scale > 0 and args.load > 0):
        ap.error("--time-scale and --load must be positive")
    args.presets = presets
    args.search_seeds = tuple(int(s) for s in args.search_seeds.split(","))
    if len(args.search_seeds) < 2:
        ap.error("the headline goodput needs at least two --search-seeds")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "live_check.json"
    report = {"instances": NUM_INSTANCES, "workload": WORKLOAD.name, "time_scale": args.time_scale,
              "duration_s": args.duration, "warmup_s": args.warmup, "load": args.load,
              "tier_target": EVERY_TIER.target, "agreement_points": AGREEMENT_POINTS, "presets": {}}
    for preset in args.presets:
        t0 = time.perf_counter()
        dep = deployment(preset, args.time_scale, args.duration, args.warmup)
        search = simulator_goodput(dep, args.search_seeds)
        check = live_check(dep, args.load * search["goodput"], args.seed)
        wall_s = time.perf_counter() - t0
        report["presets"][preset] = {"search": search, "check": check, "wall_s": wall_s}
        print_check(dep, search, check, args.load, wall_s)
        path.write_text(json.dumps(report, indent=1, default=_json_default))
    passed = all(r["check"]["every_tier_attains"] and r["check"]["simulator_agrees"]
                 for r in report["presets"].values())
    print(f"\nlive check {'PASS' if passed else 'FAIL'}; wrote {path}")


def _json_default(o):
    if isinstance(o, (np.integer, np.floating)):
        return o.item()
    raise TypeError(type(o).__name__)


if __name__ == "__main__":
    main()
