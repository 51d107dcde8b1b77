"""Goodput of PolyServe and the baselines in the simulator, against the fluid bound of each goodput rule.

    python -m bench.goodput [--quick] [--prediction-error gpu-typical] [--workloads conv-4tier,code-4tier,...]
                            [--policies polyserve,random,...] [--ablations] [--fleets 8,16,64] [--leader-fleets 256]
                            [--seeds 2] [--processes 2] [--latency-profile FILE] [--out bench/results] [--resume]
    python -m bench.goodput --experiments autoscaled,speed,calibration,scan,pd   (the other experiments; matrix too)
    python -m bench.goodput --experiments scan --scan-fleets 256 --scan-rel-tol 0.02 [--scan-bracket LOW,HIGH]
    python -m bench.goodput --replot bench/results/goodput.json   (only redraw the plots of a saved report)

The default run is the goodput matrix (DESIGN.md §6), the fleet stepping on the --prediction-error truth
(scheduler/prediction_error.py) that no predictor sees: every policy x every workload of
cluster.sim.workload.MATRIX_WORKLOADS x --fleets instances, and --leader-fleets for PolyServe and the best baseline
of each workload (the best at the largest of --fleets). Per cell: the headline goodput (every tier >= 90 %
attaining) and the strict one (>= 99 % of all requests), each on the fleet configured for it (RULE_HEADROOM_TARGETS:
the share of requests its margins let miss; RULE_COSTLY_SHARES: the share of a tier the router may refuse for cost
when it has no place) and each the highest rate passing on every seed below the lowest failing
one (cluster.sim.goodput.search_goodput; "?" marks one not confirmed by a failure within the tolerance above it),
its share of the fluid bound of the same rule, its ratio to the best baseline of the cell, and each tier's
attainment at the headline goodput under the three views of DESIGN.md §1 (cumulative deadlines, mean TPOT, max
inter-token gap). Beside it, the error sweep: PolyServe's and the best baseline's headline score
(the worst tier's attainment) over a few rates with each prediction-error preset, conv-4tier at 16 instances.

Written to <out>/goodput.json (a run without the matrix: goodput_<experiments>.json), plots (PNG) to <out>:
goodput_ratio_heatmap.png (PolyServe's headline goodput over the best baseline's, workload x fleet size),
tier_attainment_at_goodput.png (conv-4tier at the largest fleet every policy ran), attainment_vs_rate_by_error.png
(the error sweep); the other experiments draw phase_change.png, calibration.png, goodput_vs_fleet_size.png,
pd_goodput_by_split.png.

Each cell's window is the plan's, lengthened on small fleets to hold as many instance-seconds as the plan asks
(Plan.cell_window_s): 96 in the quick run (12 s at 8 instances, 6 s from 16 on), 384 in the full one (48 s at 8,
24 s at 16, 12 s from 32 on).

Cost on this machine (2 cores): --quick (fleets 8 and 16, a 6 s window after 8 s, seeds 1 and 2, searched to 10 %)
took 19 min (1,155 s) on 2 processes, before the small fleets' windows were lengthened. The full matrix (fleets 8,
16 and 64, and 256 for the leaders; a 12 s window after 8 s; searched to 3 %, the leaders to 5 %) is estimated at
about 7 h on 2 processes: a 64-instance cell took
about 11 min on one core (12 to 18 runs of 20 s simulated), so the forty of them take about 3 h and the ten
256-instance cells about 3 h more; --leader-fleets '' leaves those out, more --processes divide the rest. What
keeps it there: cell_jobs (brackets from the smaller fleet, weak baselines searched coarsely) and CellJob (the
strict search started just below the headline goodput). The cost estimates predate the strict search's own runs.
Each job's result is kept in <out>/goodput_progress.json (the PD experiment's in
goodput_pd_progress_<workload>.json) as it finishes: a run stopped part way (the full matrix takes longer than one
sitting) goes on with --resume where it stopped and gives what the whole run would have, a matrix cell cut short
from the runs its journal in <out>/goodput_progress_runs/ kept; only a run of the same options and the same code
(`code_fingerprint`) resumes from it. The PD experiment at 8, 16 and 64 instances took
about 3 to 4 h on 2 processes per workload (conv-4tier's searches; the 64-instance ones 1.6 h). Where some cells
were rerun after a change that left the others' code paths alone, --merge builds the matrix from the kept progress
files, a later file's cells replacing an earlier one's and the last file's error sweep the earlier ones' whole, each
result's source and code recorded (`merge_matrix`).

Other experiments (--experiments): autoscaled: PolyServe autoscaled through conv-phase's phase change, SLO-attaining
requests per instance-second held; speed: the time to simulate the whole conversation trace at 64 instances;
calibration: the engine against the simulator, one engine in-process and a fleet of engine processes through the
live router (a run at each of --calibration-loads; disaggregated with --calibration-prefill-instances); scan:
per-instance goodput of --policies (default polyserve) over --scan-fleets, in a longer window, each probe pooling
seeds enough for as many instance-runs at every size; pd: prefill/decode disaggregation at
--pd-fleets, each router of PD_POLICIES at its best static split of the fleet, beside co-located PolyServe and
mixed-deadline-admission, each against the bound of its mode (a PD fleet's: `fluid_bound`'s `prefill_chunk`) and with
each tier's attainment at its goodput under the three views, on each of --workloads (the PD column of the matrix:
`print_pd_matrix`); the other experiments run on the first of them.

Latency model: Llama-3.1-8B bf16 on one H200 (scheduler/roofline.py; what the emulated engines sleep), or a profile
JSON. KV pool: what the weights leave of 90 % of 141 GB (scheduler/roofline.py). Tiers: the four default tiers
(cluster/sim/workload.py); Poisson arrivals, lengths drawn from the workload's trace.

Policies (router, engine batch policy):
  polyserve          polyserve router (tiers, load gradient, lazy promotion    PolyServePolicy
                     after scale-up, demotion last)
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
  polyserve-no-gradient / -no-promotion / -eager-promotion / -promotion-before-scale-up / -no-demotion: the
                     ablations (the Router's gradient/promotion/demotion switches; -promotion-before-scale-up is
                     DESIGN.md §2's order), with --ablations

Figures are virtual-time results of the simulator; wall times are this machine's CPU.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import math
import multiprocessing
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from cluster.autoscaler import ScalingLimits
from cluster.sim.goodput import (EVERY_TIER, STRICT, FluidBound, GoodputRule, GoodputSearch,
                                 autoscaled_goodput, fluid_bound, search_goodput)
from cluster.sim.simulator import SimConfig, SimResult, Simulator
from cluster.sim.workload import (MATRIX_WORKLOADS, TierMix, Workload, WorkloadFactory, WorkloadSpec, default_tiers,
                                  load_trace, workload_spec)
from scheduler.chunking import largest_chunk
from scheduler.latency_model import LatencyModel, scaled
from scheduler.prediction_error import PREDICTION_ERRORS, PredictionError, expected_latency_model, prediction_error
from scheduler.profile_table import ProfileTable
from scheduler.roofline import emulated_latency_model
from scheduler.tiers import TierSet

RESULTS = Path(__file__).resolve().parent / "results"
BASELINES = ("random", "round-robin", "least-loaded", "co-chunk", "mixed-deadline", "mixed-deadline-admission",
             "lmetric")
ABLATIONS = ("polyserve-no-gradient", "polyserve-no-promotion", "polyserve-eager-promotion",
             "polyserve-promotion-before-scale-up", "polyserve-no-demotion")
POLICIES = ("polyserve",) + BASELINES + ABLATIONS
VIEWS = ("cumulative", "mean_tpot", "max_gap")  # SimResult.tier_attainment's views of attaining (DESIGN.md §1)
EXPERIMENTS = ("matrix", "autoscaled", "speed", "calibration", "scan", "pd")
PD_LINK = "nvlink"  # the PD experiment's KV link (scheduler/transfer.py)
# PD mode: the routers compared, each with its engine policy as in the matrix, and the prefill shares of the fleet
# each is searched at (a static split, the best per policy of these and of those between its best and each
# neighbour, as DistServe sizes its split offline; a step beyond the grid while the best is at its edge): a grid of
# PD_SHARE_STEP around the fluid bound's split (`pd_shares`), which lies near every router's best on the
# conversation trace and far above the middle on the prompt-heavy code trace
PD_POLICIES = ("polyserve", "mixed-deadline-admission", "mixed-deadline", "least-loaded", "random")
# the pairings PD stacks ship with (random, least-loaded, each with the FCFS engine); the deadline-aware PD baselines
# beside them run PolyServe's own engine policy, stronger than any pairing alone: the ratio is given to both
PD_PAIRINGS = ("least-loaded", "random")
PD_SHARE_STEP = 0.0625
PD_SHARE_OFFSETS = (-2, -1, 0, 1, 2)  # in steps, around the fluid split
# The headroom target (scheduler/headroom.py) of the fleet each rule is measured on, every policy's alike, as an
# operator sets it for the attainment its fleet is held to: each margin lets this share of requests miss. Measured at
# 64 and 8 instances against both rules (bench/RESULTS.md): where a tenth of a tier may miss, packing tighter pays
# until the margins' misses and the refused requests together pass the tenth; where 1 % of all may, a smaller share
# holds the margins' misses well under it, and a smaller one still refuses more than it saves.
RULE_HEADROOM_TARGETS = {EVERY_TIER.name: 0.02, STRICT.name: 0.005}
# The share of each tier the router may refuse for cost while the fleet is under pressure (scheduler/costly.py),
# every policy's alike: where a tenth of a tier may miss, what the margins' share leaves of that tenth goes to the
# costliest prompts (bench/RESULTS.md); where 1 % of all may, none.
RULE_COSTLY_SHARES = {EVERY_TIER.name: round(1.0 - EVERY_TIER.target - RULE_HEADROOM_TARGETS[EVERY_TIER.name], 6),
                      STRICT.name: 0.0}
# Whether PolyServe's engines keep its router's margins as a reserve before each token's deadline (Router's
# token_reserve). Measured against both rules (bench/RESULTS.md): where 1 % of all may miss the fleet runs at half its
# bound, misses are dear and the reserve wins; where a tenth of each tier may, capacity binds, and the prefill the
# reserve takes from each step costs more than the misses it saves. The baselines' engines keep their own margins.
RULE_TOKEN_RESERVES = {EVERY_TIER.name: False, STRICT.name: True}
REFERENCE_WORKLOAD = "conv-4tier"  # the default workload: the error sweep's and the tier-attainment plot's
SPEED_INSTANCES = 64


def rule_fleet(rule: GoodputRule) -> dict[str, float | bool]:
    """The settings of the fleet `rule` is measured on, as SimConfig and the router take them: the margins' headroom
    target, the router's costly share and whether PolyServe's engines keep its margins as a reserve."""
    return {"headroom_target": RULE_HEADROOM_TARGETS[rule.name], "costly_share": RULE_COSTLY_SHARES[rule.name],
            "token_reserve": RULE_TOKEN_RESERVES[rule.name]}


@dataclass(slots=True, frozen=True)
class Setup:
    """What every worker process rebuilds the same way (`build_setup`): a workload of the matrix, the latency
    model, the measured window (`window_s` after `warmup_s`; a run ends with it), the fleet's true step time, and
    the headroom target, costly share and token reserve of the fleet (those of the rule it is measured by:
    `for_rule`)."""
    workload: WorkloadSpec
    latency_profile: str | None
    warmup_s: float
    window_s: float
    prediction_error: str = "gpu-typical"  # scheduler.prediction_error.PREDICTION_ERRORS: the fleet's true step time
    headroom_target: float = RULE_HEADROOM_TARGETS[EVERY_TIER.name]
    costly_share: float = RULE_COSTLY_SHARES[EVERY_TIER.name]
    token_reserve: bool = RULE_TOKEN_RESERVES[EVERY_TIER.name]

    def for_rule(self, rule: GoodputRule) -> "Setup":
        """This setup on the fleet configured for `rule`."""
        return replace(self, **rule_fleet(rule))

    @property
    def error(self) -> PredictionError:
        return prediction_error(self.prediction_error)

    @property
    def window(self) -> tuple[float, float]:
        return self.warmup_s, self.warmup_s + self.window_s

    def poisson(self, rate: float, seed: int) -> Workload:
        """One run's requests: Poisson arrivals at `rate` up to the window's end, the mix inverting mid-window for
        a workload with a phase change."""
        end = self.window[1]
        return build_setup(self).workloads.poisson(rate, end, seed, self.workload.phase_change_at(self.window))

    def bound(self, rule: GoodputRule | None = EVERY_TIER, disaggregated: bool = False,
              pace_premium: Mapping[str, float] | None = None) -> FluidBound:
        """The fluid bound of `rule` (None: every request attaining) for this setup's tier mix and lengths
        (`bound_sample`), on the fleet's expected step time; of a PD fleet when `disaggregated`; with
        `pace_premium`, the shared-pace reference (`fluid_bound`)."""
        built = build_setup(self)
        base = SimConfig()
        return fluid_bound(expected_latency_model(built.model, self.error), self.bound_sample(),
                           base.kv_blocks * base.block_size, base.max_num_seqs, rule,
                           prefill_chunk=base.max_num_batched_tokens if disaggregated else None,
                           pace_premium=pace_premium)

    def bound_sample(self) -> Workload:
        """The requests a bound is computed on: a long Poisson sample of this setup's tier mix and lengths, its
        phase change half way through (drawn once per workload and latency profile: every bound of them reads it)."""
        return _bound_sample(self.workload, self.latency_profile)


@dataclass(slots=True, frozen=True)
class BuiltSetup:
    """A Setup made concrete: its latency model, the default tiers derived from it, and its workload factory."""
    model: LatencyModel
    tiers: TierSet
    workloads: WorkloadFactory


def build_setup(setup: Setup) -> BuiltSetup:
    """`setup` built: what depends on its workload and latency profile only (not on its window, error or headroom),
    so that the setups of one workload share it."""
    return _built(setup.workload, setup.latency_profile)


@functools.cache
def _built(workload: WorkloadSpec, latency_profile: str | None) -> BuiltSetup:
    """Built once per process: a forked worker keeps what its parent built and builds the rest itself."""
    model = ProfileTable.load(latency_profile) if latency_profile else emulated_latency_model()
    tiers, workloads = _workloads(workload, model, SimConfig())
    return BuiltSetup(model, tiers, workloads)


@functools.cache
def _bound_sample(workload: WorkloadSpec, latency_profile: str | None) -> Workload:
    return _built(workload, latency_profile).workloads.poisson(200.0, 200.0, seed=0,
                                                               phase_change_at=workload.phase_change_at((0.0, 200.0)))


def _workloads(workload: WorkloadSpec, model: LatencyModel, config: SimConfig) -> tuple[TierSet, WorkloadFactory]:
    """The default tiers of `model`, and workloads of `workload`'s trace and mix for a deployment as `config`."""
    tiers = default_tiers(model)
    return tiers, WorkloadFactory(load_trace(workload.trace), tiers, model, config.kv_blocks * config.block_size,
                                  config.max_prefill_chunk, TierMix(workload.mix))


def co_chunk_budget(model, tiers, bound: FluidBound) -> int:
    """The static token budget of co-chunk: the largest chunk with which the tightest tier's full batch (its fluid
    B, at its steady-state KV) still meets the tightest TPOT."""
    tight = bound.tiers[0]
    kv = round(tight.batch * (tight.mean_prompt + tight.mean_output / 2))
    return max(16, largest_chunk(model, tiers[0].tpot_ms / 1000.0, tight.batch, kv, 2048))


def make_simulator(policy: str, num_instances: int, model, tiers, co_budget: int, prefill_instances: int = 0,
                   **config) -> Simulator:
    """`policy` on `num_instances`; with `prefill_instances`, that many of them prefill instances (PD mode, the KV
    over PD_LINK) and the rest decode instances, both placed by the policy's router."""
    if prefill_instances:
        config.update(prefill_instances=prefill_instances, transfer=PD_LINK)
    if policy in BASELINES:
        config["token_reserve"] = False  # PolyServe's router and engines keep it (RULE_TOKEN_RESERVES)
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
                "polyserve-promotion-before-scale-up": dict(promotion="before-scale-up"),
                "polyserve-no-demotion": dict(demotion=False)}.get(policy)
    if ablation is None:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    return Simulator(SimConfig(num_instances=num_instances, **config), tiers, model, router_kwargs=ablation)


# ---- jobs: each runs in a worker process ----------------------------------------------------------------------
def _simulate(setup: Setup, policy: str, num_instances: int, co_budget: int, rate: float, seed: int,
              give_up_below: float | None = None, prefill_instances: int = 0) -> SimResult:
    """One run of `policy` on `setup` at `rate`; with `give_up_below`, stopped once the window's pooled attainment
    can no longer reach it."""
    built = build_setup(setup)
    sim = make_simulator(policy, num_instances, built.model, built.tiers, co_budget, prefill_instances, seed=seed,
                         prediction_error=setup.error, headroom_target=setup.headroom_target,
                         costly_share=setup.costly_share, token_reserve=setup.token_reserve)
    return sim.run(setup.poisson(rate, seed), window=setup.window, give_up_below=give_up_below)


def _search_summary(found: GoodputSearch) -> dict:
    return {"goodput": found.goodput, "confirmed": found.confirmed, "next_failing": found.next_failing,
            "probes": [(p.rate, float(np.min(p.scores)), list(p.scores)) for p in found.probes]}


def _figures(res: SimResult, window: tuple[float, float]) -> dict:
    """A whole run's figures over the requests arriving in `window`: the pooled attainment, each tier's attainment
    under every view, and each tier's TTFT and mean TPOT percentiles (ms) over the requests served."""
    in_window = (res.arrival >= window[0]) & (res.arrival < window[1])
    latency = {}
    for k, name in enumerate(res.tier_names):
        served = in_window & (res.tier == k) & res.served
        if served.any():
            ttft, tpot = res.ttft[served] * 1000, res.mean_tpot[served] * 1000
            latency[name] = {"ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99),
                             "tpot_p50": _pct(tpot, 50), "tpot_p99": _pct(tpot, 99)}
    return {"pooled": res.attainment(window),
            "attainment": {view: res.tier_attainment(window, view) for view in VIEWS}, "latency_ms": latency}


@dataclass(slots=True)
class CellRuns:
    """The runs of one cell of the matrix on the fleet configured for one rule, by (rate, seed): a rate the search
    probes again, or whose figures are asked after the search, is not simulated twice; a run given up below a target
    is below every higher target. With a `journal`, each run is appended to it as it ends, with the seconds it took,
    and the runs it holds already (those of `fleet`, the rule the fleet is configured for) are not simulated again:
    a cell stopped part way goes on where it stopped, its searches taking the same path (a search is determined by
    its scores), and `journaled_s` is what those runs took when they ran. With `prefill_instances`, the runs of a PD
    fleet (make_simulator)."""
    setup: Setup
    policy: str
    num_instances: int
    co_budget: int
    journal: Path | None = None
    fleet: str = ""
    prefill_instances: int = 0
    kept: dict[tuple[float, int], dict | float] = field(default_factory=dict)  # figures, or the target given up below
    journaled_s: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if self.journal is None or not self.journal.exists():
            return
        text = self.journal.read_text()
        if not text.endswith("\n"):  # a line cut short where the run was stopped: dropped, so appends stay whole
            text = text[:text.rfind("\n") + 1]
            self.journal.write_text(text)
        for line in text.splitlines():
            entry = json.loads(line)
            if entry["fleet"] == self.fleet:
                self.kept[(entry["rate"], entry["seed"])] = entry["kept"]
                self.journaled_s += entry.get("wall_s", 0.0)  # journals written before runs were timed: none

    def score(self, rule: GoodputRule, rate: float, seed: int) -> float:
        """The score of `rule`; NaN for a run given up (certain to fail)."""
        figures = self.figures(rate, seed, rule.target)
        return math.nan if figures is None else rule.score(figures["pooled"], figures["attainment"]["cumulative"])

    def figures(self, rate: float, seed: int, give_up_below: float | None = None) -> dict | None:
        """The run's `_figures`, simulated unless kept; None when it was given up below `give_up_below` or less."""
        kept = self.kept.get((rate, seed))
        if kept is None or (isinstance(kept, float) and (give_up_below is None or give_up_below < kept)):
            t0 = time.perf_counter()
            res = _simulate(self.setup, self.policy, self.num_instances, self.co_budget, rate, seed, give_up_below,
                            self.prefill_instances)
            kept = self.kept[(rate, seed)] = give_up_below if res.aborted else _figures(res, self.setup.window)
            if self.journal is not None:
                with self.journal.open("a") as f:
                    f.write(json.dumps({"fleet": self.fleet, "rate": rate, "seed": seed, "kept": kept,
                                        "wall_s": time.perf_counter() - t0}, default=_json_default) + "\n")
        return None if isinstance(kept, float) else kept

    def at_rate(self, rate: float, seed: int) -> dict:
        """The run's figures with its rate and seed (a goodput point's record), simulated whole unless kept."""
        return {"rate": rate, "seed": seed, **self.figures(rate, seed)}


# The matrix's brackets are guesses from the bound or a smaller fleet, seldom far off: widened by small steps when
# the goodput lies outside, they need fewer probes to narrow again.
WIDEN = 1.25
# Where the strict search starts, as a share of the headline goodput: strict passes near it on the matrix's workloads.
STRICT_START = 0.8


@dataclass(slots=True, frozen=True)
class CellJob:
    """One cell of the matrix: `policy` on `setup` at `num_instances`.

    Each rule is searched on the fleet configured for it (`Setup.for_rule`). The headline goodput is searched from
    `bracket`; the strict one from STRICT_START x the headline goodput up to it (the search widens a bracket that
    misses): a fleet that attains 99 % of all requests attains 90 % of each tier of a matrix workload, every tier
    holding a quarter or more of the requests. Where the headline passed nowhere, strict is not searched. Each tier's
    attainment at the headline goodput is that of its first seed's run. Its runs go to `journal` as they end
    (`CellRuns`; `JobProgress` names it); a cell resumed from one counts in its wall time what the runs it kept took
    before."""
    setup: Setup
    policy: str
    num_instances: int
    co_budget: int
    seeds: tuple[int, ...]
    bracket: tuple[float, float]
    rel_tol: float
    journal: Path | None = None

    def run(self) -> dict:
        t0 = time.perf_counter()
        runs, strict_runs = (CellRuns(self.setup.for_rule(rule), self.policy, self.num_instances, self.co_budget,
                                      self.journal, rule.name) for rule in (EVERY_TIER, STRICT))
        headline = search_goodput(functools.partial(runs.score, EVERY_TIER), self.seeds, *self.bracket, EVERY_TIER,
                                  rel_tol=self.rel_tol, widen=WIDEN)
        if headline.goodput > 0:
            strict = search_goodput(functools.partial(strict_runs.score, STRICT), self.seeds,
                                    STRICT_START * headline.goodput, headline.goodput, STRICT, rel_tol=self.rel_tol,
                                    widen=WIDEN)
            at_headline = runs.at_rate(headline.goodput, self.seeds[0])
        else:
            strict, at_headline = GoodputSearch(0.0, (), False), None
        return {"workload": self.setup.workload.name, "policy": self.policy, "num_instances": self.num_instances,
                "window_s": self.setup.window_s, "rel_tol": self.rel_tol, "headline": _search_summary(headline),
                "strict": _search_summary(strict),
                "at_headline": at_headline, "simulations": len(runs.kept) + len(strict_runs.kept),
                "wall_s": time.perf_counter() - t0 + runs.journaled_s + strict_runs.journaled_s}


# The error sweep shows where attainment falls off; a run far past that stops here (overloaded runs are the slowest).
SWEEP_FLOOR = 0.5


@dataclass(slots=True, frozen=True)
class SweepJob:
    """One run of the error sweep: the headline score (the worst tier's attainment) and the pooled attainment, or
    NaN for both once the pooled attainment fell below SWEEP_FLOOR (the plot's floor)."""
    setup: Setup
    policy: str
    num_instances: int
    co_budget: int
    rate: float
    seed: int

    def run(self) -> dict:
        res = _simulate(self.setup, self.policy, self.num_instances, self.co_budget, self.rate, self.seed,
                        give_up_below=SWEEP_FLOOR)
        window = self.setup.window
        pooled = math.nan if res.aborted else res.attainment(window)
        score = math.nan if res.aborted else EVERY_TIER.score(pooled, res.tier_attainment(window))
        return {"policy": self.policy, "prediction_error": self.setup.prediction_error, "rate": self.rate,
                "seed": self.seed, "score": score, "pooled": pooled}


@dataclass(slots=True, frozen=True)
class SearchJob:
    """One goodput search of the headline rule of `policy` at `num_instances`, from the bracket [low, high], with each
    tier's attainment at the goodput found, as a matrix cell has it (its first seed's run)."""
    setup: Setup
    policy: str
    num_instances: int
    co_budget: int
    seeds: tuple[int, ...]
    low: float
    high: float
    rel_tol: float
    prefill_instances: int = 0  # PD mode: this many of the instances prefill (make_simulator)

    def run(self, map_fn=map, width: int = 1) -> dict:
        """Its simulations through `map_fn`, `width` rates per round (cluster.sim.goodput.search_goodput)."""
        t0 = time.perf_counter()
        runs = CellRuns(self.setup.for_rule(EVERY_TIER), self.policy, self.num_instances, self.co_budget,
                        prefill_instances=self.prefill_instances)
        found = search_goodput(functools.partial(runs.score, EVERY_TIER), self.seeds, self.low, self.high,
                               EVERY_TIER, rel_tol=self.rel_tol, width=width, map_fn=map_fn)
        # through a pool's map the runs' figures stay in the workers: the one asked for here is simulated again
        at_headline = runs.at_rate(found.goodput, self.seeds[0]) if found.goodput > 0 else None
        return {"policy": self.policy, "num_instances": self.num_instances,
                "prefill_instances": self.prefill_instances, **_search_summary(found), "at_headline": at_headline,
                "wall_s": time.perf_counter() - t0}


@dataclass(slots=True, frozen=True)
class AutoscaleJob:
    """PolyServe autoscaled within `limits` from `num_instances`, through `setup`'s phase change, at `rate`."""
    setup: Setup
    num_instances: int
    rate: float
    limits: ScalingLimits
    seed: int = 1

    def run(self) -> dict:
        built = build_setup(self.setup)
        sim = make_simulator("polyserve", self.num_instances, built.model, built.tiers, 0, seed=self.seed,
                             prediction_error=self.setup.error, autoscale=self.limits, cold_start_s=30.0)
        res = sim.run(self.setup.poisson(self.rate, self.seed))
        window = self.setup.window
        in_window = (res.arrival >= window[0]) & (res.arrival < window[1])
        return {"rate": self.rate, "num_instances": self.num_instances, "duration": window[1],
                "phase_change_at": self.setup.workload.phase_change_at(window), "attainment": res.attainment(window),
                "attained_total": int(res.attained.sum()), "instance_seconds": res.instance_seconds,
                "samples": res.samples, "counts": res.counts, "wall_s": res.wall_s,
                "promoted": float(res.promoted[in_window].mean())}


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
        tiers, workloads = _workloads(self.setup.workload, model, cfg)
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


def _map_largest_first(pool, jobs, progress) -> list:
    """`_map` of jobs with a fleet size, the largest fleets started first (they take longest, so the pool stays
    busy to the end); results in job order."""
    order = sorted(range(len(jobs)), key=lambda i: -jobs[i].num_instances)
    ran = _map(pool, [jobs[i] for i in order], progress)
    return [ran[order.index(i)] for i in range(len(jobs))]


def _live_latencies(w, token_times: list[list[float] | None], idx: np.ndarray) -> dict:
    """TTFT and mean TPOT (seconds) of the requests `idx` of a live run, every one of which finished."""
    from cluster.sim.calibration import live_latencies
    ttft, tpot = live_latencies(w.arrivals, token_times, idx)
    return {"live_ttft": ttft.tolist(), "live_tpot": tpot.tolist()}


def _sim_latencies(res: SimResult, idx: np.ndarray, prefix: str) -> dict:
    tpot = res.mean_tpot[idx]
    return {f"{prefix}_ttft": res.ttft[idx].tolist(), f"{prefix}_tpot": tpot[~np.isnan(tpot)].tolist()}


def run_fleet_calibration(setup: Setup, time_scale: float, num_instances: int, load: float, duration: float,
                          seed: int = 7, prefill_instances: int = 0) -> dict:
    """The same workload through a live fleet (`num_instances` emulated engine processes behind the router
    service, cluster.sim.calibration.replay_on_fleet) and in the simulator with as many instances, the engines'
    host time per step added. Run alone: the engines sleep in real time and share this machine's cores.

    `prefill_instances` > 0: prefill/decode disaggregation, that many prefill engines beside the `num_instances`,
    which then decode, the KV over PD_LINK (emulated engines move none: a live hand-off is a loopback round trip,
    the link's time in the router and the simulator, both small beside an emulated step); the simulator in the same
    split. The rate stays `load` x the fluid bound of `num_instances`: the co-located calibration's very workload."""
    import asyncio

    from cluster.sim.calibration import (attained, replay_on_fleet, simulated_with_host_time,
                                         write_emulated_model_folder)

    model = emulated_latency_model(time_scale)
    engines = num_instances + prefill_instances
    cfg = SimConfig(num_instances=engines, reveal_output_len=True)
    tiers, workloads = _workloads(setup.workload, model, cfg)
    rate = load * setup.bound().rate(num_instances) / time_scale
    w = workloads.poisson(rate, duration, seed)
    with tempfile.TemporaryDirectory() as folder:
        live = asyncio.run(replay_on_fleet(
            w, time_scale, engines, write_emulated_model_folder(folder), cfg.kv_blocks,
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_prefill_chunk=cfg.max_prefill_chunk, model=model, prefill_instances=prefill_instances,
            transfer=PD_LINK))
    sim = simulated_with_host_time(cfg, tiers, model, w, live)
    live_attained = attained(w, live.token_times)
    out = {"time_scale": time_scale, "instances": engines, "prefill_instances": prefill_instances, "link": PD_LINK,
           "load": load, "rate": rate, "requests": len(w), "failed": live.failed, "refused": live.refused,
           "handed_off": live.counts.get("handed_off", 0), "import_refused": live.counts.get("import_refused", 0),
           "sim_handed_off": sim.counts.get("handed_off", 0),
           "live_attainment": float(live_attained.mean()), "sim_attainment": sim.attainment(),
           "step_overhead_s": live.step_overhead_s, "step_overhead_per_seq_s": live.step_overhead_per_seq_s,
           "live_wall_s": live.wall_s, "live_stall_s": live.stall_s, "tiers": {}}
    for k, tier in enumerate(tiers):
        of_tier = w.tier_index == k
        idx = np.flatnonzero(of_tier & np.array([t is not None for t in live.token_times]))
        out["tiers"][tier.name] = {**_live_latencies(w, live.token_times, idx), **_sim_latencies(sim, idx, "sim"),
                                   "live_attained": float(live_attained[of_tier].mean()) if of_tier.any() else None,
                                   "sim_attained": float(sim.attained[of_tier].mean()) if of_tier.any() else None}
    return out


# ---- plan ------------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Plan:
    policies: tuple[str, ...]
    fleets: tuple[int, ...]  # every policy
    leader_fleets: tuple[int, ...]  # PolyServe and the best baseline at the largest of `fleets` only
    seeds: tuple[int, ...]
    warmup_s: float
    window_s: float
    # A matrix cell's window holds at least this many instance-seconds: on a small fleet a window of a few seconds
    # holds so few requests that the strict rule's 1 % is a handful of misses, and which policy passes at a rate
    # turns on where the arrivals of those seconds fell (cell_window_s).
    window_instance_s: float
    rel_tol: float
    # the leader fleets' runs are the costliest of all, and their ratio needs no finer grain than that
    leader_rel_tol: float
    # weak baselines from `coarse_from` instances on (cell_jobs)
    coarse_rel_tol: float
    coarse_from: int
    sweep_fleet: int
    sweep_loads: tuple[float, ...]  # the error sweep's rates, as shares of the exact truth's headline bound
    # The fleet-size scan compares fleets with each other, so its window must reach the steady state of the
    # smallest: a short window hides some overload (the queue needs longer than that to push the loosest tier's
    # TTFT over), and on a small fleet the arrivals of a few seconds swing attainment. Each probe pools
    # max(1, scan_instance_runs / n) seeds, so every fleet size is measured with as many instance-runs.
    scan_fleets: tuple[int, ...]
    scan_warmup_s: float
    scan_window_s: float
    scan_instance_runs: int
    scan_rel_tol: float
    autoscale_max: int
    autoscale_duration: float
    speed_duration: float | None
    calibration: tuple[float, float, float]  # time scale, rate per second of scaled time, duration
    pd_fleets: tuple[int, ...]
    # time scale, instances, loads (each a run of its own), duration
    fleet_calibration: tuple[float, int, tuple[float, ...], float] = (2.0, 4, (0.8,), 8.0)

    def cell_window_s(self, num_instances: int) -> float:
        return max(self.window_s, self.window_instance_s / num_instances)


def make_plan(args) -> Plan:
    policies = ("polyserve",) + BASELINES + (ABLATIONS if args.ablations else ())
    # A fleet starting empty meets deadlines above its steady-state goodput until its batches fill (tests/
    # test_goodput_bound.py), so the quick run shortens the window, never the warm-up.
    if args.quick:
        plan = Plan(policies, fleets=(8, 16), leader_fleets=(), seeds=(1, 2), warmup_s=8.0, window_s=6.0,
                    window_instance_s=96.0,
                    rel_tol=0.1, leader_rel_tol=0.1, coarse_rel_tol=0.15, coarse_from=64, sweep_fleet=16,
                    sweep_loads=(0.4, 0.55, 0.7, 0.85, 1.0), scan_fleets=(4, 8, 16), scan_warmup_s=6.0,
                    scan_window_s=20.0, scan_instance_runs=8, scan_rel_tol=0.1, autoscale_max=8,
                    autoscale_duration=90.0, speed_duration=600.0, calibration=(0.5, 28.0, 8.0),
                    pd_fleets=(16,))
    else:
        plan = Plan(policies, fleets=(8, 16, 64), leader_fleets=(256,), seeds=(1, 2), warmup_s=8.0, window_s=12.0,
                    window_instance_s=384.0,
                    rel_tol=0.03, leader_rel_tol=0.05, coarse_rel_tol=0.1, coarse_from=64, sweep_fleet=16,
                    sweep_loads=(0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0), scan_fleets=(8, 16, 32, 64, 128, 256),
                    scan_warmup_s=12.0, scan_window_s=48.0, scan_instance_runs=64, scan_rel_tol=0.03,
                    autoscale_max=16, autoscale_duration=240.0, speed_duration=None, calibration=(1.0, 16.0, 20.0),
                    pd_fleets=(8, 16, 64))
    if args.policies:
        plan.policies = tuple(args.policies.split(","))
        unknown = set(plan.policies) - set(POLICIES)
        if unknown:
            raise SystemExit(f"unknown policies {sorted(unknown)}; known: {', '.join(POLICIES)}")
    if args.fleets:
        plan.fleets = _ints(args.fleets)
    if args.leader_fleets is not None:
        plan.leader_fleets = _ints(args.leader_fleets)
    if args.seeds:
        plan.seeds = tuple(range(1, args.seeds + 1))
    if args.rel_tol:
        plan.rel_tol = plan.leader_rel_tol = args.rel_tol
    if args.scan_fleets:
        plan.scan_fleets = _ints(args.scan_fleets)
    if args.scan_rel_tol:
        plan.scan_rel_tol = args.scan_rel_tol
    if args.pd_fleets:
        plan.pd_fleets = _ints(args.pd_fleets)
    if args.calibration_loads:
        scale, instances, _, duration = plan.fleet_calibration
        try:
            loads = tuple(float(x) for x in args.calibration_loads.split(","))
        except ValueError:
            loads = ()
        if not loads or not all(0 < x < math.inf for x in loads):
            raise SystemExit(f"--calibration-loads wants finite positive comma-separated numbers, "
                             f"got {args.calibration_loads!r}")
        plan.fleet_calibration = (scale, instances, loads, duration)
    return plan


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


# ---- processes -------------------------------------------------------------------------------------------------
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


def _progress(total: int, label: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=label, file=sys.stderr, smoothing=0.05)


def _map(pool, jobs, progress, on_result: Callable[[object, dict], None] | None = None) -> list:
    """Every job's `run()`, through the pool when there is one; results in job order; the `progress` bar advances
    and `on_result(job, result)` is called as each job finishes."""
    out = [None] * len(jobs)
    indexed = list(enumerate(jobs))
    for i, result in (pool.imap_unordered(_run_indexed, indexed) if pool else map(_run_indexed, indexed)):
        out[i] = result
        progress.update()
        if on_result is not None:
            on_result(jobs[i], result)
    return out


def _run_indexed(indexed_job):
    i, job = indexed_job
    return i, job.run()


# ---- the matrix -------------------------------------------------------------------------------------------------
# A baseline whose goodput per instance at the next smaller fleet is under this share of the best baseline's is
# searched to the plan's coarse tolerance from `coarse_from` instances on (see cell_jobs).
WEAK_SHARE = 0.85


@dataclass(slots=True, frozen=True)
class MatrixWorkload:
    """A workload of the matrix as set up for one prediction error: its bounds and co-chunk's budget."""
    setup: Setup
    bounds: dict[str, FluidBound]  # per rule name
    co_budget: int


def matrix_workloads(specs: list[WorkloadSpec], plan: Plan, latency_profile: str | None,
                     error: str) -> list[MatrixWorkload]:
    out = []
    for spec in specs:
        setup = Setup(spec, latency_profile, plan.warmup_s, plan.window_s, error)
        bounds = {rule.name: setup.bound(rule) for rule in (EVERY_TIER, STRICT)}
        built = build_setup(setup)
        out.append(MatrixWorkload(setup, bounds, co_chunk_budget(built.model, built.tiers, bounds[EVERY_TIER.name])))
    return out


def best_baseline(cells: list[dict], workload: str, num_instances: int, rule: str = "headline") -> dict | None:
    """The baseline with the highest goodput of `rule` (headline or strict) in a cell of the matrix."""
    return max((c for c in cells if c["workload"] == workload and c["num_instances"] == num_instances
                and c["policy"] in BASELINES), key=lambda c: c[rule]["goodput"], default=None)


def cell_jobs(plan: Plan, workload: MatrixWorkload, cells: list[dict], num_instances: int, policies: list[str],
              rel_tol: float) -> list[CellJob]:
    """The cells of `workload` and `policies` at `num_instances`, searched to `rel_tol`, after those of the smaller
    fleets (`cells`).

    A headline search starts from the goodput per instance the policy reached on the next smaller fleet, 0.92 to
    1.1 x (it changes little with the fleet's size), or on the first fleet (and after a goodput of 0) from 0.5 to
    1 x the headline bound (PolyServe lands near the top of that, the weakest baselines near the bottom). From
    `coarse_from` instances on, a baseline under WEAK_SHARE of the best baseline's goodput per instance at the next
    smaller fleet is searched to the coarse tolerance: it is far from being the best baseline, whose goodput alone
    the ratios are taken against, and its runs at those fleets are the costliest of the matrix."""
    name = workload.setup.workload.name
    headline_bound = workload.bounds[EVERY_TIER.name].rate(num_instances)
    setup = replace(workload.setup, window_s=plan.cell_window_s(num_instances))
    jobs = []
    for policy in policies:
        smaller = [c for c in cells if c["workload"] == name and c["policy"] == policy
                   and c["num_instances"] < num_instances]
        previous = max(smaller, key=lambda c: c["num_instances"], default=None)
        guess = previous["headline"]["goodput"] / previous["num_instances"] * num_instances if previous else 0.0
        bracket = (0.92 * guess, 1.1 * guess) if guess > 0 else (0.5 * headline_bound, headline_bound)
        tolerance = rel_tol
        if previous and policy in BASELINES and num_instances >= plan.coarse_from:
            best = best_baseline(cells, name, previous["num_instances"])
            if previous["headline"]["goodput"] < WEAK_SHARE * best["headline"]["goodput"]:
                tolerance = max(rel_tol, plan.coarse_rel_tol)
        jobs.append(CellJob(setup, policy, num_instances, workload.co_budget, plan.seeds, bracket, tolerance))
    return jobs


def _leaders(cells: list[dict], workload: str, largest: int, policies: tuple[str, ...]) -> list[str]:
    best = best_baseline(cells, workload, largest)
    return [p for p in ("polyserve", best["policy"] if best else None) if p in policies]


def sweep_jobs(plan: Plan, sweep_setups: dict[str, MatrixWorkload], policies: list[str]) -> list[SweepJob]:
    """The error sweep: each of `policies` at each rate of the plan on every prediction-error preset, one run a
    seed; the rates are shares of the exact truth's headline bound, the highest of the presets'."""
    top = sweep_setups["exact"].bounds[EVERY_TIER.name].rate(plan.sweep_fleet)
    return [SweepJob(w.setup, policy, plan.sweep_fleet, w.co_budget, load * top, seed)
            for w in sweep_setups.values() for policy in policies for load in plan.sweep_loads for seed in plan.seeds]


def job_key(job: CellJob | SweepJob | SearchJob) -> str:
    """What names a job's result among those of one plan on one code (`JobProgress`)."""
    if isinstance(job, CellJob):
        return f"cell|{job.setup.workload.name}|{job.policy}|{job.num_instances}"
    if isinstance(job, SearchJob):
        return f"search|{job.setup.workload.name}|{job.policy}|{job.num_instances}|{job.prefill_instances}"
    return f"sweep|{job.setup.prediction_error}|{job.policy}|{job.num_instances}|{job.rate!r}|{job.seed}"


def code_fingerprint() -> str:
    """The source of every module of this project loaded here (the simulator, the policies, this file), hashed:
    what a matrix's figures depend on besides its plan."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for name, module in sorted(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not path or not path.endswith(".py"):
            continue
        path = Path(path).resolve()
        if path.is_relative_to(root) and path.relative_to(root).parts[0] in PROJECT_PACKAGES:
            digest.update(name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


PROJECT_PACKAGES = ("bench", "cluster", "engine", "kernels", "scheduler")


def progress_key(opening: dict) -> dict:
    """What a run's kept progress is valid for: the code, and the options its report opens with (`describe_setup`)."""
    return {"code": code_fingerprint(), **opening}


@dataclass(slots=True)
class JobProgress:
    """The jobs of an experiment (the matrix, PD) finished so far, kept in a file after each one, so that a run
    stopped part way is resumed where it stopped (`--resume`) and gives what the whole run would have: only a run of
    the same code and the same options (`key`) resumes from it, and every round is built from the same results in
    the same order as it would be. A matrix cell unfinished goes on from the runs its journal holds (in the folder
    `runs_dir`; a cell at 256 instances takes hours on one core)."""
    path: Path
    key: dict
    results: dict[str, dict] = field(default_factory=dict)  # by job_key

    @classmethod
    def open(cls, path: Path, key: dict, resume: bool) -> "JobProgress":
        """The progress kept at `path` by a run of `key` (`resume`, when there is one), or none (a fresh start: the
        file is written at once with no result, so that the journals of cells stopped before any job ended are
        resumed too, and journals of another run are removed)."""
        key = json.loads(json.dumps(key, default=_json_default))  # as the file holds it
        if not resume or not path.exists():
            fresh = cls(path, key)
            shutil.rmtree(fresh.runs_dir, ignore_errors=True)
            fresh._save()
            return fresh
        saved = json.loads(path.read_text())
        if saved.get("key") != key:
            differs = sorted(k for k in key.keys() | saved.get("key", {}).keys()
                             if key.get(k) != saved.get("key", {}).get(k))
            raise SystemExit(f"{path}: made by another run ({', '.join(differs)} differ); run without --resume "
                             f"to start the matrix afresh")
        return cls(path, key, saved["results"])

    @property
    def runs_dir(self) -> Path:
        return self.path.with_name(self.path.stem + "_runs")

    def add(self, job: CellJob | SweepJob | SearchJob, result: dict) -> None:
        self.results[job_key(job)] = result
        self._save()
        if isinstance(job, CellJob) and job.journal is not None:
            job.journal.unlink(missing_ok=True)

    def _save(self) -> None:
        scratch = self.path.with_suffix(".tmp")
        scratch.write_text(json.dumps({"key": self.key, "results": self.results}, default=_json_default))
        scratch.replace(self.path)

    def _journaled(self, job):
        """A matrix cell with its journal in `runs_dir`; any other job as it is."""
        if not isinstance(job, CellJob):
            return job
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        return replace(job, journal=self.runs_dir / (job_key(job).replace("|", "_") + ".jsonl"))

    def run(self, pool, jobs: list, progress) -> list[dict]:
        """Every job's result in job order, those not finished before run now."""
        todo = [self._journaled(job) for job in jobs if job_key(job) not in self.results]
        progress.update(len(jobs) - len(todo))
        _map(pool, todo, progress, self.add)
        return [self.results[job_key(job)] for job in jobs]


def run_matrix(pool, plan: Plan, workloads: list[MatrixWorkload], sweep_setups: dict[str, MatrixWorkload] | None,
               checkpoint: Callable[[list[dict], list[dict]], None],
               progress_file: JobProgress) -> tuple[list[dict], list[dict]]:
    """Every cell, a round per fleet size from the smallest (each starts its searches from the smaller fleets'
    results), the leader fleets last; the error sweep (with `sweep_setups`) in the round after its fleet's, to keep
    the pool busy. `checkpoint(cells, sweep runs)` after every round; `progress_file` keeps each job's result as
    it finishes and gives those it held already. Returns the cells and the sweep's runs."""
    leader_count = ("polyserve" in plan.policies) + any(p in BASELINES for p in plan.policies)
    total = (len(plan.policies) * len(plan.fleets) + leader_count * len(plan.leader_fleets)) * len(workloads)
    if sweep_setups:
        total += leader_count * len(sweep_setups) * len(plan.sweep_loads) * len(plan.seeds)
    cells: list[dict] = []
    sweep: list[dict] = []
    sweep_pending = sweep_setups is not None

    def sweep_ready() -> bool:
        return sweep_pending and any(c["num_instances"] == plan.sweep_fleet for c in cells)

    def sweep_round() -> list[SweepJob]:
        return sweep_jobs(plan, sweep_setups, _leaders(cells, REFERENCE_WORKLOAD, plan.sweep_fleet, plan.policies))

    rounds = [(n, False) for n in plan.fleets] + [(n, True) for n in plan.leader_fleets]
    with _progress(total, "goodput matrix") as progress:
        for num_instances, leaders_only in rounds:
            jobs = []
            for w in workloads:
                policies = _leaders(cells, w.setup.workload.name, max(plan.fleets), plan.policies) if leaders_only \
                    else list(plan.policies)
                jobs += cell_jobs(plan, w, cells, num_instances, policies,
                                  plan.leader_rel_tol if leaders_only else plan.rel_tol)
            extra = sweep_round() if sweep_ready() else []
            sweep_pending = sweep_pending and not extra
            results = progress_file.run(pool, jobs + extra, progress)
            cells += results[:len(jobs)]
            sweep += results[len(jobs):]
            checkpoint(cells, sweep)
        if sweep_ready():  # its fleet's round was the last
            sweep = progress_file.run(pool, sweep_round(), progress)
            checkpoint(cells, sweep)
    return cells, sweep


def matrix_report(workloads: list[MatrixWorkload], cells: list[dict], sweep: list[dict], plan: Plan, error: str,
                  sweep_setups: dict[str, MatrixWorkload] | None) -> dict:
    """The matrix as goodput.json holds it: each cell with, per rule, its share of that rule's bound and its ratio to
    the best baseline of its cell by that rule (at a leader fleet, the baselines run there). At a leader fleet, a
    PolyServe cell whose rule's best baseline at the largest other fleet was not run there names that baseline in
    the rule's `leader_not_run` (else None): its ratio is against a weaker baseline. A full run's leaders are the
    headline's (`_leaders`), so the strict rule's may be missing; so may either in a matrix merged from runs whose
    leaders differ."""
    bounds = {w.setup.workload.name: w.bounds for w in workloads}
    largest = max((c["num_instances"] for c in cells if c["num_instances"] in plan.fleets), default=None)
    for c in cells:
        leader_fleet = c["policy"] == "polyserve" and c["num_instances"] in plan.leader_fleets and largest is not None
        run_here = {o["policy"] for o in cells if o["workload"] == c["workload"]
                    and o["num_instances"] == c["num_instances"]} if leader_fleet else set()
        for key, rule in (("headline", EVERY_TIER), ("strict", STRICT)):
            best = best_baseline(cells, c["workload"], c["num_instances"], key)
            goodput = c[key]["goodput"]
            c[key]["of_bound"] = goodput / bounds[c["workload"]][rule.name].rate(c["num_instances"])
            c[key]["best_baseline"] = best["policy"] if best else None
            c[key]["vs_best"] = goodput / best[key]["goodput"] if best and best[key]["goodput"] > 0 else math.nan
            if leader_fleet:
                leader = best_baseline(cells, c["workload"], largest, key)
                c[key]["leader_not_run"] = leader["policy"] if leader and leader["policy"] not in run_here else None
    out = {"prediction_error": error, "fleets": list(plan.fleets), "leader_fleets": list(plan.leader_fleets),
           "policies": list(plan.policies),
           "workloads": [{**asdict(w.setup.workload), "co_chunk_budget": w.co_budget,
                          "bounds": {rule: _bound_entry(b) for rule, b in w.bounds.items()}} for w in workloads],
           "cells": cells}
    if sweep_setups:
        out["sweep"] = {"workload": REFERENCE_WORKLOAD, "num_instances": plan.sweep_fleet,
                        "bounds": {e: {rule: b.rate(plan.sweep_fleet) for rule, b in w.bounds.items()}
                                   for e, w in sweep_setups.items()}, "runs": sweep}
    return out


def _bound_entry(bound: FluidBound) -> dict:
    return {"per_instance": bound.rate(1), "shares": bound.shares, "tiers": [asdict(t) for t in bound.tiers]}


def print_matrix(matrix: dict) -> None:
    policy_order = {p: i for i, p in enumerate(POLICIES)}
    error = matrix["prediction_error"]
    for w in matrix["workloads"]:
        cells = sorted((c for c in matrix["cells"] if c["workload"] == w["name"]),
                       key=lambda c: (c["num_instances"], policy_order[c["policy"]]))
        bounds = w["bounds"]
        shares = ":".join(f"{s:g}" for s in w["mix"])
        print(f"\n{w['name']}: {w['trace']}, tier shares {shares} (tightest first)"
              f"{', inverted mid-window' if w['phase_change'] else ''}; prediction error {error}; bounds per "
              f"instance: headline {bounds['every-tier']['per_instance']:.2f}, strict "
              f"{bounds['strict']['per_instance']:.2f} req/s")
        print(f"  {'inst':>4} {'policy':26} {'headline':>9} {'/inst':>6} {'bound':>6} {'vs best':>7} | "
              f"{'strict':>8} {'bound':>6} {'vs best':>7} | per tier at headline, % cumulative / mean TPOT / "
              f"max gap | {'wall s':>6}")
        for c in cells:
            h, s = c["headline"], c["strict"]
            print(f"  {c['num_instances']:4d} {c['policy']:26} {_goodput(h):>9} "
                  f"{h['goodput'] / c['num_instances']:6.2f} {h['of_bound']:6.1%} {_ratio(h['vs_best']):>7} | "
                  f"{_goodput(s):>8} {s['of_bound']:6.1%} {_ratio(s['vs_best']):>7} | "
                  f"{_tier_columns(c['at_headline'])} | {c['wall_s']:6.0f}")
    print_ratio_summary(matrix)


def _goodput(search: dict) -> str:
    """'?': not confirmed, no failure within the tolerance above it, or a single seed."""
    return f"{search['goodput']:.1f}{'' if search['confirmed'] else '?'}"


def _ratio(x: float) -> str:
    """Rounded down to the hundredth: a printed ratio never claims more than was measured (1.2454 is not 1.25x)."""
    if math.isnan(x):
        return "-"
    return "infx" if math.isinf(x) else f"{math.floor(x * 100 + 1e-9) / 100:.2f}x"


def _tier_columns(at: dict | None) -> str:
    if at is None:
        return "-"
    return " / ".join(" ".join(f"{100 * v:3.0f}" for v in at["attainment"][view].values()) for view in VIEWS)


def print_ratio_summary(matrix: dict) -> None:
    fleets = sorted({c["num_instances"] for c in matrix["cells"]})
    print(f"\nPolyServe's goodput / the best baseline's, headline [strict] (prediction error "
          f"{matrix['prediction_error']}; below, the best baseline [by strict, where another]):")
    print(f"  {'workload':12}" + "".join(f" {n:>33}" for n in fleets))
    unfair = []
    for w in matrix["workloads"]:
        row, names = [], []
        for n in fleets:
            cell = next((c for c in matrix["cells"] if c["workload"] == w["name"] and c["num_instances"] == n
                         and c["policy"] == "polyserve"), None)
            if not cell:
                row.append("-")
                names.append("-")
                continue
            marks = {key: "*" if cell[key].get("leader_not_run") else "" for key in ("headline", "strict")}
            row.append(f"{_ratio(cell['headline']['vs_best'])}{marks['headline']} "
                       f"[{_ratio(cell['strict']['vs_best'])}{marks['strict']}]")
            names.append(_best_names(cell))
            unfair += [f"{w['name']} at {n}, {key}: {cell[key]['leader_not_run']}" for key in marks if marks[key]]
        print(f"  {w['name']:12}" + "".join(f" {r:>33}" for r in row))
        print(f"  {'':12}" + "".join(f" {b:>33}" for b in names))
    if unfair:
        print("  * the best baseline of the largest other fleet was not run there, so the ratio is against a weaker "
              "one: " + "; ".join(unfair))
    if "sweep" in matrix:
        print_sweep(matrix["sweep"])


def _best_names(cell: dict) -> str:
    headline, strict = cell["headline"]["best_baseline"], cell["strict"]["best_baseline"]
    return f"{headline or '-'}" + (f" [{strict}]" if strict != headline else "")


def print_sweep(sweep: dict) -> None:
    print(f"\nError sweep, {sweep['workload']} at {sweep['num_instances']} instances: the headline score (the worst "
          f"tier's attainment, the lowest of the seeds; '<' under {SWEEP_FLOOR:.0%}) by rate")
    rates = sorted({r["rate"] for r in sweep["runs"]})
    print(f"  {'prediction error':18} {'policy':26}" + "".join(f"{r:8.0f}" for r in rates) + "   headline bound")
    for error, bounds in sweep["bounds"].items():
        for policy in dict.fromkeys(r["policy"] for r in sweep["runs"]):
            scores = [_lowest_score(sweep["runs"], error, policy, rate) for rate in rates]
            print(f"  {error:18} {policy:26}" + "".join(f"{'<':>8}" if math.isnan(s) else f"{s:8.1%}" for s in scores)
                  + f"{bounds['every-tier']:12.0f}")


def _lowest_score(runs: list[dict], error: str, policy: str, rate: float) -> float:
    scores = [r["score"] for r in runs if r["prediction_error"] == error and r["policy"] == policy
              and r["rate"] == rate]
    return math.nan if any(math.isnan(s) for s in scores) else min(scores)


# ---- the other experiments -------------------------------------------------------------------------------------
def scan_seeds(plan: Plan, num_instances: int) -> tuple[int, ...]:
    return tuple(range(1, 1 + max(1, math.ceil(plan.scan_instance_runs / num_instances))))


def run_scan(pool, plan: Plan, setup: Setup, policies: list[str], bracket: tuple[float, float], processes: int) -> dict:
    """Goodput per instance of each policy at each of the scan's fleet sizes, searched from `bracket` (per-instance
    rates), printed as a table, with each tier's attainment at each goodput."""
    bound = setup.bound()
    built = build_setup(setup)
    co_budget = co_chunk_budget(built.model, built.tiers, bound)
    jobs = [SearchJob(setup, p, n, co_budget, scan_seeds(plan, n), bracket[0] * n, bracket[1] * n, plan.scan_rel_tol)
            for p in policies for n in plan.scan_fleets]
    with _progress(len(jobs), "fleet-size scan") as progress:
        if len(jobs) == 1 and pool is not None:  # one search: the pool runs its probes, several rates per round
            job = jobs[0]
            searches = [job.run(pool.map, max(1, processes // len(job.seeds)))]
            progress.update()
        else:
            searches = _map_largest_first(pool, jobs, progress)
    print(f"\nGoodput per instance by fleet size, {setup.workload.name} (req/s per instance; window "
          f"{setup.window_s:.0f} s after {setup.warmup_s:.0f} s; seeds per probe: {plan.scan_instance_runs} "
          f"instance-runs / instances; searched to {plan.scan_rel_tol:.0%}):")
    print("  " + f"{'instances':>10}{'seeds':>6}" + "".join(f"{p:>18}" for p in policies) + f"{'bound':>10}")
    for n in plan.scan_fleets:
        row = [next(s for s in searches if s["policy"] == p and s["num_instances"] == n) for p in policies]
        print("  " + f"{n:>10}{len(scan_seeds(plan, n)):>6}" + "".join(f"{r['goodput'] / n:18.2f}" for r in row)
              + f"{bound.rate(1):10.2f}")
    print("  each tier's attainment at each goodput, % cumulative / mean TPOT / max gap (its first seed's run):")
    for s in searches:
        print(f"  {s['num_instances']:>10} {s['policy']:26} {_tier_columns(s['at_headline'])}")
    return {"workload": setup.workload.name, "fleets": list(plan.scan_fleets), "bound_per_instance": bound.rate(1),
            "searches": searches}


def pd_shares(fluid_share: float) -> list[float]:
    """The grid of prefill shares around `fluid_share` (the PD bound's split), rounded to the grid's step."""
    center = round(fluid_share / PD_SHARE_STEP)
    return [(center + k) * PD_SHARE_STEP for k in PD_SHARE_OFFSETS]


def pd_splits(num_instances: int, shares: Sequence[float]) -> list[int]:
    """The prefill instances of `num_instances` at each of `shares`, at least one instance of each kind."""
    return sorted({min(num_instances - 1, max(1, round(share * num_instances))) for share in shares})


def _best_split(goodput_by_split: dict[int, float]) -> int:
    """The split of the highest goodput, the fewest prefill instances on a tie."""
    return max(goodput_by_split, key=lambda split: (goodput_by_split[split], -split))


def pd_refined_splits(goodput_by_split: dict[int, float]) -> list[int]:
    """The splits halfway between the best of a router's searched splits and each of its neighbours (the one
    neighbour at an edge of the grid), where the two are more than one instance apart. Both sides: goodput against
    the split need not fall evenly about its peak, which can lie toward the worse neighbour (bench/RESULTS.md)."""
    splits = sorted(goodput_by_split)
    k = splits.index(_best_split(goodput_by_split))
    neighbours = [splits[i] for i in (k - 1, k + 1) if 0 <= i < len(splits)]
    return [(splits[k] + other) // 2 for other in neighbours if abs(other - splits[k]) > 1]


def pd_extended_splits(goodput_by_split: dict[int, float], num_instances: int) -> list[int]:
    """The next split beyond the grid's edge, one grid step on, where a router's best searched split is at that edge
    and the fleet leaves room (at least one instance of each kind); else none. A prompt-heavy workload's best split
    can lie outside any fixed grid of shares."""
    splits = sorted(goodput_by_split)
    best = _best_split(goodput_by_split)
    step = max(1, round(PD_SHARE_STEP * num_instances))
    if len(splits) > 1 and best == splits[-1] and best < num_instances - 1:
        return [min(num_instances - 1, best + step)]
    if len(splits) > 1 and best == splits[0] and best > 1:
        return [max(1, best - step)]
    return []


def run_pd(pool, plan: Plan, setup: Setup, progress_file: JobProgress) -> dict:
    """Goodput (headline rule) in PD mode of each of PD_POLICIES at its best split, beside co-located PolyServe
    and mixed-deadline-admission on as many instances, at each of `plan.pd_fleets` (each in the matrix's window for
    its size), printed. A router's splits: `pd_shares` of the fleet, then a step further each time its best is
    at the edge of those searched (`pd_extended_splits`), then those `pd_refined_splits` finds between the best of
    these and each of its neighbours."""
    bound = setup.bound()
    pd_bound = setup.bound(disaggregated=True)
    shares = pd_shares(pd_bound.prefill_share)
    built = build_setup(setup)
    co_budget = co_chunk_budget(built.model, built.tiers, bound)

    def search(n: int, policy: str, prefill: int) -> SearchJob:
        return SearchJob(replace(setup, window_s=plan.cell_window_s(n)), policy, n, co_budget, plan.seeds,
                         0.7 * bound.rate(n), 1.1 * bound.rate(n), plan.rel_tol, prefill)

    jobs = [search(n, policy, prefill) for n in plan.pd_fleets
            for policy, splits in [*((p, pd_splits(n, shares)) for p in PD_POLICIES),
                                   ("polyserve", [0]), ("mixed-deadline-admission", [0])]
            for prefill in splits]
    with _progress(len(jobs), "PD goodput") as progress:
        searches = progress_file.run(pool, jobs, progress)  # the smaller fleets first: done first if stopped

        def goodput_by_split(n: int, policy: str) -> dict[int, float]:
            return {s["prefill_instances"]: s["goodput"] for s in searches
                    if s["num_instances"] == n and s["policy"] == policy and s["prefill_instances"]}

        def more(choose: Callable[[int, str], list[int]]) -> list[dict]:
            added = [search(n, policy, split) for n in plan.pd_fleets for policy in PD_POLICIES
                     for split in choose(n, policy)]
            progress.total += len(added)
            progress.refresh()
            return progress_file.run(pool, added, progress)

        while extended := more(lambda n, policy: pd_extended_splits(goodput_by_split(n, policy), n)):
            searches += extended
        searches += more(lambda n, policy: pd_refined_splits(goodput_by_split(n, policy)))
    print(f"\nPD disaggregation, {setup.workload.name}, KV over {PD_LINK} (headline goodput, req/s: every tier >= 90 % "
          f"attaining; window {', '.join(f'{plan.cell_window_s(n):g} s at {n}' for n in plan.pd_fleets)} after "
          f"{setup.warmup_s:.0f} s; the best static split of "
          f"{', '.join(f'{x:g}' for x in shares)} of the fleet prefilling (around the PD bound's "
          f"{pd_bound.prefill_share:.3f}), of those a step on while a router's best is at the edge, and of the one "
          f"halfway from its best to each neighbour; after each, its tiers' attainment at its goodput, % cumulative / "
          f"mean TPOT / max gap):")
    rows = []
    for n in plan.pd_fleets:
        cell = [s for s in searches if s["num_instances"] == n]
        best = {}
        for s in cell:
            key = (s["policy"], "co-located" if s["prefill_instances"] == 0 else "PD")
            if key not in best or s["goodput"] > best[key]["goodput"]:
                best[key] = s
        pd_baselines = [s for (policy, mode), s in best.items() if mode == "PD" and policy != "polyserve"]
        strongest = max(pd_baselines, key=lambda s: s["goodput"])
        ours = best[("polyserve", "PD")]
        for (policy, mode), s in sorted(best.items(), key=lambda kv: -kv[1]["goodput"]):
            split = f"{s['prefill_instances']}p+{n - s['prefill_instances']}d" if s["prefill_instances"] else f"{n}"
            of = (pd_bound if mode == "PD" else bound).rate(n)
            print(f"  {n:>4} instances  {mode:10} {policy:26} {split:>9} {_goodput(s):>10} {s['goodput'] / of:7.1%} "
                  f"of its mode's bound | {_tier_columns(s.get('at_headline'))}")
        pairing = max((s for s in pd_baselines if s["policy"] in PD_PAIRINGS), key=lambda s: s["goodput"])
        ratio, to_pairing = (ours["goodput"] / s["goodput"] if s["goodput"] else math.inf for s in (strongest, pairing))
        print(f"  {n:>4} instances: PolyServe-PD / best PD baseline ({strongest['policy']}) {_ratio(ratio)}, / best "
              f"pairing ({pairing['policy']}) {_ratio(to_pairing)}; PolyServe-PD / co-located PolyServe "
              f"{_ratio(ours['goodput'] / best[('polyserve', 'co-located')]['goodput'])}; bounds "
              f"{pd_bound.rate(n):.1f} PD, {bound.rate(n):.1f} co-located")
        rows.append({"num_instances": n, "polyserve_pd": ours["goodput"],
                     "polyserve_pd_prefill": ours["prefill_instances"],
                     "best_pd_baseline_goodput": strongest["goodput"],
                     "best_pd_baseline_prefill": strongest["prefill_instances"],
                     "co_located_polyserve": best[("polyserve", "co-located")]["goodput"],
                     "ratio_to_best_pd_baseline": ratio, "best_pd_baseline": strongest["policy"],
                     "ratio_to_best_pairing": to_pairing, "best_pairing": pairing["policy"],
                     "pd_bound": pd_bound.rate(n), "co_located_bound": bound.rate(n)})
    return {"workload": setup.workload.name, "link": PD_LINK, "shares": shares, "searches": searches,
            "summary": rows}


def print_pd_matrix(runs: list[dict]) -> None:
    """The PD column of the matrix: per workload and fleet, PolyServe-PD at its best split against the best PD
    baseline at its own and against co-located PolyServe on as many instances (headline goodput, req/s)."""
    print("\nPD disaggregation by workload (headline goodput, req/s; each router at its best split):")
    print(f"  {'workload':12} {'fleet':>5} | {'PolyServe-PD':>17} | {'best PD baseline':>36} | {'ratio':>6} | "
          f"{'co-located PolyServe':>20} | {'PD / co-located':>15}")
    for run in runs:
        for row in run["summary"]:
            n = row["num_instances"]
            ours = f"{row['polyserve_pd']:.1f} {row['polyserve_pd_prefill']}p+{n - row['polyserve_pd_prefill']}d"
            theirs = (f"{row['best_pd_baseline']} {row['best_pd_baseline_goodput']:.1f} "
                      f"{row['best_pd_baseline_prefill']}p+{n - row['best_pd_baseline_prefill']}d")
            print(f"  {run['workload']:12} {n:>5} | {ours:>17} | {theirs:>36} | "
                  f"{_ratio(row['ratio_to_best_pd_baseline']):>6} | {row['co_located_polyserve']:>20.1f} | "
                  f"{_ratio(row['polyserve_pd'] / row['co_located_polyserve']):>15}")


def autoscale_job(plan: Plan, latency_profile: str | None, error: str) -> AutoscaleJob:
    """PolyServe autoscaled through conv-phase's phase change, at 0.6 x the headline bound of the largest fleet
    allowed, starting from the fleet that carries it at 0.8 x the bound per instance."""
    setup = Setup(workload_spec("conv-phase"), latency_profile, plan.warmup_s, plan.autoscale_duration - plan.warmup_s,
                  error)
    bound = setup.bound()
    rate = 0.6 * bound.rate(plan.autoscale_max)
    start_fleet = max(2, math.ceil(rate / (0.8 * bound.rate(1))))
    limits = ScalingLimits(min_instances=2, max_instances=plan.autoscale_max, idle_pool=2, stop_after_idle_s=10.0)
    return AutoscaleJob(setup, start_fleet, rate, limits)


def run_experiments(pool, plan: Plan, args, names: list[str], workloads: list[WorkloadSpec], report: dict,
                    key: dict) -> None:
    """The experiments besides the matrix that `names` holds, each printed and added to `report`: PD on each of
    `workloads`, the others on the first; `key`: what the progress kept for a resumed one must have been made by
    (`progress_key`)."""
    workload = workloads[0]
    setup = Setup(workload, args.latency_profile, plan.warmup_s, plan.window_s, args.prediction_error)
    jobs = {}
    if "autoscaled" in names:
        jobs["autoscaled"] = autoscale_job(plan, args.latency_profile, args.prediction_error)
    if "speed" in names:
        jobs["speed"] = SpeedJob(setup, SPEED_INSTANCES, plan.speed_duration)
    if "calibration" in names:
        jobs["calibration"] = CalibrationJob(setup, *plan.calibration, seed=1)
    if jobs:
        with _progress(len(jobs), "experiments") as progress:
            report.update(zip(jobs, _map(pool, list(jobs.values()), progress)))
    if "autoscaled" in names:
        auto = report["autoscaled"]
        bound = jobs["autoscaled"].setup.bound()
        print(f"\nAutoscaled PolyServe, conv-phase at {auto['rate']:.0f} req/s for {auto['duration']:.0f} s, the tier "
              f"mix inverted at {auto['phase_change_at']:.0f} s ({auto['num_instances']} instances at the start, "
              f"2..{plan.autoscale_max}, 2 warm idle, 30 s cold start): attainment {auto['attainment']:.1%} (after "
              f"{plan.warmup_s:.0f} s), {autoscaled_goodput(auto['attained_total'], auto['instance_seconds']):.2f} "
              f"attaining requests per instance-second held ({auto['instance_seconds']:.0f} instance-s; "
              f"{auto['promoted']:.1%} promoted); headline bound {bound.rate(1):.2f} req/s per instance")
    if "speed" in names:
        speed = report["speed"]
        print(f"\nSpeed: {speed['trace_s']:.0f} s of {workload.trace} as recorded ({speed['requests']} requests) at "
              f"{SPEED_INSTANCES} instances, PolyServe: {speed['wall_s']:.1f} s wall on one core ({speed['steps']:,} "
              f"steps, {speed['policy_calls']:,} batch-policy calls; attainment {speed['attainment']:.1%})")
    if "calibration" in names:
        print_calibration(report["calibration"])
        scale, instances, loads, duration = plan.fleet_calibration
        report["fleet_calibration"] = []
        for load in loads:  # alone: real time
            report["fleet_calibration"].append(run_fleet_calibration(
                setup, scale, instances, load, duration, prefill_instances=args.calibration_prefill_instances))
            print_fleet_calibration(report["fleet_calibration"][-1])
    if "scan" in names:
        scan_setup = Setup(workload, args.latency_profile, plan.scan_warmup_s, plan.scan_window_s,
                           args.prediction_error)
        per_instance = scan_setup.bound().rate(1)
        bracket = _bracket_arg(args.scan_bracket) if args.scan_bracket else (0.85 * per_instance, 1.15 * per_instance)
        policies = list(plan.policies) if args.policies else ["polyserve"]
        report["scan"] = run_scan(pool, plan, scan_setup, policies, bracket, args.processes)
    if "pd" in names:
        report["pd"] = [run_pd(pool, plan, replace(setup, workload=spec), JobProgress.open(
            Path(args.out) / f"goodput_pd_progress_{spec.name}.json", {**key, "workload": spec.name}, args.resume))
            for spec in workloads]
        print_pd_matrix(report["pd"])


def _bracket_arg(text: str) -> tuple[float, float]:
    bracket = tuple(float(x) for x in text.split(","))
    if len(bracket) != 2 or not 0 < bracket[0] < bracket[1]:
        raise SystemExit(f"--scan-bracket wants LOW,HIGH with 0 < LOW < HIGH, got {text!r}")
    return bracket


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
    pd = fleet.get("prefill_instances", 0)
    engines = (f"{pd} prefill + {fleet['instances'] - pd} decode emulated engine processes (KV over {fleet['link']}: "
               f"{fleet['handed_off']} hand-offs live, {fleet['sim_handed_off']} simulated; {fleet['import_refused']} "
               f"imports refused live)" if pd else f"{fleet['instances']} emulated engine processes")
    print(f"\nCalibration through the live router: {engines} behind the router service, latency model "
          f"x{fleet['time_scale']}, {fleet['rate']:.1f} req/s ({fleet['load']:g} x the fluid bound of "
          f"{fleet['instances'] - pd}), {fleet['requests']} requests ({fleet['failed']} failed, "
          f"{fleet.get('refused', 0)} refused): attaining live {fleet['live_attainment']:.1%}, simulator with the "
          f"engines' host time ({fleet['step_overhead_s'] * 1000:.2f} ms + {fleet['step_overhead_per_seq_s'] * 1e6:.1f} "
          f"us per sequence) {fleet['sim_attainment']:.1%}, live - sim "
          f"{(fleet['live_attainment'] - fleet['sim_attainment']) * 100:+.1f} points; stalls "
          f"{fleet['live_stall_s']:.2f} s of {fleet['live_wall_s']:.1f} s (CPU taken by other jobs)")
    print(f"  {'tier':8} {'attained live/sim':>18} {'points':>7} {'TTFT p50 ms live/sim':>22} {'TTFT p90':>16} "
          f"{'TPOT p50 live/sim':>20} {'TPOT p90':>14}")
    for name, t in fleet["tiers"].items():
        lt, st = np.array(t["live_ttft"]) * 1000, np.array(t["sim_ttft"]) * 1000
        lp, sp = np.array(t["live_tpot"]) * 1000, np.array(t["sim_tpot"]) * 1000
        live_at, sim_at = t.get("live_attained"), t.get("sim_attained")
        attained_cols = (f"{live_at:9.1%} / {sim_at:6.1%} {(live_at - sim_at) * 100:+7.1f}" if live_at is not None
                         else f"{'-':>18} {'-':>7}")
        print(f"  {name:8} {attained_cols} {_pct(lt, 50):10.1f} / {_pct(st, 50):7.1f} {_pct(lt, 90):7.1f} / "
              f"{_pct(st, 90):6.1f} {_pct(lp, 50):10.2f} / {_pct(sp, 50):6.2f} {_pct(lp, 90):6.2f} / {_pct(sp, 90):5.2f}")


# ---- main ------------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fleets 8 and 16, short windows, coarse searches")
    ap.add_argument("--experiments", default="matrix",
                    help=f"comma-separated subset of {','.join(EXPERIMENTS)} (default: matrix)")
    ap.add_argument("--workloads", default=",".join(s.name for s in MATRIX_WORKLOADS),
                    help="comma-separated workloads of cluster.sim.workload.MATRIX_WORKLOADS (default: all)")
    ap.add_argument("--policies", default=None, help=f"comma-separated subset of {','.join(POLICIES)} (default: "
                                                     f"polyserve and the baselines)")
    ap.add_argument("--ablations", action="store_true", help="PolyServe's ablations in the matrix too")
    ap.add_argument("--fleets", default=None, help="comma-separated fleet sizes every policy runs (full: 8,16,64)")
    ap.add_argument("--leader-fleets", default=None,
                    help="fleet sizes only PolyServe and the best baseline run (full: 256; '' for none)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per probe (default 2: a confirmation needs two)")
    ap.add_argument("--rel-tol", type=float, default=None, help="relative tolerance of every search of the matrix")
    ap.add_argument("--prediction-error", default="gpu-typical", choices=list(PREDICTION_ERRORS),
                    help="the fleet's true step time against the model every predictor uses (default gpu-typical)")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--latency-profile", default=None, help="profile JSON (default: the H200 roofline model)")
    ap.add_argument("--scan-fleets", default=None, help="comma-separated fleet sizes of the fleet-size scan")
    ap.add_argument("--scan-rel-tol", type=float, default=None,
                    help="relative tolerance of the fleet-size scan's search")
    ap.add_argument("--scan-bracket", default=None, metavar="LOW,HIGH",
                    help="per-instance rates the scan's searches start from (default 0.85 and 1.15 x the bound)")
    ap.add_argument("--calibration-prefill-instances", type=int, default=0, metavar="N",
                    help="calibration: the fleet calibration disaggregated, N prefill engines beside its engines, "
                         "which then decode, on the same workload (default 0: co-located)")
    ap.add_argument("--calibration-loads", default=None, metavar="LOAD,...",
                    help="calibration: the fleet calibration's loads, each x the fluid bound of its engines (its "
                         "decode engines with --calibration-prefill-instances), a run each (default 0.8)")
    ap.add_argument("--pd-fleets", default=None, help="comma-separated fleet sizes of the PD experiment "
                                                      "(full: 8,16,64)")
    ap.add_argument("--resume", action="store_true",
                    help="matrix and pd: go on from the jobs <out>/goodput_progress.json (goodput_pd_progress.json) "
                         "holds, of a run of the same code and options stopped part way")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--replot", metavar="JSON", default=None, help="only redraw the plots of a saved report")
    ap.add_argument("--merge", metavar="PROGRESS,...", default=None,
                    help="run nothing: the matrix of the cells (and sweep runs) kept in these goodput_progress.json "
                         "files, each file's replacing the earlier ones' of the same name (a rerun of some cells at a "
                         "later commit after the whole matrix; a file's error sweep replaces the earlier ones' whole), "
                         "written, printed and plotted in --out")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    out_dir = Path(args.out)
    if args.replot:
        write_plots(json.loads(Path(args.replot).read_text()), out_dir)
        return
    names = args.experiments.split(",")
    unknown = set(names) - set(EXPERIMENTS)
    if unknown:
        raise SystemExit(f"unknown experiments {sorted(unknown)}; known: {', '.join(EXPERIMENTS)}")
    if args.merge and names != ["matrix"]:
        raise SystemExit("--merge makes the matrix only: leave --experiments at matrix")
    specs = [workload_spec(name) for name in args.workloads.split(",")]
    plan = make_plan(args)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / ("goodput.json" if "matrix" in names else f"goodput_{'_'.join(names)}.json")
    t_start = time.perf_counter()
    report = describe_setup(args, plan, specs[0])
    key = progress_key(report)
    # setups built before the workers fork, so that they inherit them
    workloads = matrix_workloads(specs, plan, args.latency_profile, args.prediction_error) \
        if "matrix" in names else []
    sweep_wanted = workloads and REFERENCE_WORKLOAD in (s.name for s in specs) and plan.sweep_fleet in plan.fleets
    sweep_setups = {e: matrix_workloads([workload_spec(REFERENCE_WORKLOAD)], plan, args.latency_profile, e)[0]
                    for e in PREDICTION_ERRORS} if sweep_wanted else None
    if args.merge:
        report["matrix"], report["merged_from"] = merge_matrix(args.merge.split(","), workloads, plan,
                                                               args.prediction_error, sweep_setups)
        print_matrix(report["matrix"])
    else:
        with _worker_pool(args.processes) as pool:
            if workloads:
                def checkpoint(cells, sweep):
                    report["matrix"] = matrix_report(workloads, cells, sweep, plan, args.prediction_error,
                                                     sweep_setups)
                    _write_report(report, path, t_start)

                progress_file = JobProgress.open(out_dir / "goodput_progress.json", {
                    **key, "workloads": [s.name for s in specs], "sweep": bool(sweep_setups)}, args.resume)
                run_matrix(pool, plan, workloads, sweep_setups, checkpoint, progress_file)
                print_matrix(report["matrix"])
            run_experiments(pool, plan, args, names, specs, report, key)
    _write_report(report, path, t_start)
    write_plots(report, out_dir)
    print(f"\nwrote {path} and plots; total wall time {report['wall_s']:.0f} s")


def describe_setup(args, plan: Plan, workload: WorkloadSpec) -> dict:
    """Prints the deployment and the tiers; returns the report's opening entries."""
    built = build_setup(Setup(workload, args.latency_profile, plan.warmup_s, plan.window_s, args.prediction_error))
    base = SimConfig()
    kv_tokens = base.kv_blocks * base.block_size
    print(f"latency model: {args.latency_profile or 'roofline Llama-3.1-8B bf16 on H200'}; KV pool {kv_tokens:,} "
          f"tokens per instance; prediction error {args.prediction_error}; tiers (TPOT / TTFT ms): "
          + ", ".join(f"{t.name} {t.tpot_ms:g} / {t.ttft_ms:g}" for t in built.tiers))
    return {"plan": asdict(plan), "prediction_error": args.prediction_error, "latency_profile": args.latency_profile,
            "kv_capacity_tokens": kv_tokens,
            "tiers": [{"name": t.name, "tpot_ms": t.tpot_ms, "ttft_ms": t.ttft_ms} for t in built.tiers]}


def merge_matrix(paths: list[str], workloads: list[MatrixWorkload], plan: Plan, error: str,
                 sweep_setups: dict[str, MatrixWorkload] | None) -> tuple[dict, dict[str, dict]]:
    """The matrix of the jobs kept in the progress files at `paths`, in order, a later file's result replacing an
    earlier one's of the same job; and by job, the file and code fingerprint its result came from. The error sweep
    is the last file's that holds one, whole: its rates are shares of a bound of its own code, so two sweeps' runs
    merged would interleave two grids."""
    results, sources = {}, {}
    for path in paths:
        saved = json.loads(Path(path).read_text())
        source = {"file": path, "code": saved["key"]["code"]}
        if any(key.startswith("sweep|") for key in saved["results"]):
            for key in [key for key in results if key.startswith("sweep|")]:
                del results[key], sources[key]
        for key, result in saved["results"].items():
            results[key], sources[key] = result, source
    cells = [r for k, r in results.items() if k.startswith("cell|")]
    sweep = [r for k, r in results.items() if k.startswith("sweep|")]
    return matrix_report(workloads, cells, sweep, plan, error, sweep_setups), sources


def _write_report(report: dict, path: Path, t_start: float) -> None:
    report["wall_s"] = time.perf_counter() - t_start
    path.write_text(json.dumps(_rounded(report), default=_json_default))


def _pct(a: np.ndarray, q: float) -> float:
    a = a[~np.isnan(a)]
    return float(np.percentile(a, q)) if len(a) else math.nan


def _rounded(o):
    """Floats to 5 significant digits (the calibration's latency arrays are most of the file)."""
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
    """Every figure of what the report holds, from the report alone (so --replot can redraw them)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if "matrix" in report:
        matrix = report["matrix"]
        plot_ratio_heatmap(matrix, out_dir / "goodput_ratio_heatmap.png")
        plot_tier_attainment(matrix, out_dir / "tier_attainment_at_goodput.png")
        if matrix.get("sweep", {}).get("runs"):
            plot_error_sweep(matrix["sweep"], out_dir / "attainment_vs_rate_by_error.png")
    if "scan" in report:
        plot_scan(report["scan"], out_dir / "goodput_vs_fleet_size.png")
    if "autoscaled" in report:
        plot_phase_change(report["autoscaled"], [t["name"] for t in report["tiers"]], out_dir / "phase_change.png")
    if "calibration" in report:
        plot_calibration(report["calibration"], out_dir / "calibration.png")
    if "pd" in report:
        plot_pd(report["pd"], out_dir / "pd_goodput_by_split.png")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _plt().close(fig)


def plot_ratio_heatmap(matrix: dict, path: Path) -> None:
    """PolyServe's headline goodput over the best baseline's, workload x fleet size, the best baseline named (and
    the larger fleet's leader where it was not run: `matrix_report`)."""
    plt = _plt()
    from matplotlib.colors import TwoSlopeNorm

    workloads = [w["name"] for w in matrix["workloads"]]
    fleets = sorted({c["num_instances"] for c in matrix["cells"]})
    ratio = np.full((len(workloads), len(fleets)), np.nan)
    labels = [[""] * len(fleets) for _ in workloads]
    for c in matrix["cells"]:
        if c["policy"] == "polyserve":
            i, j = workloads.index(c["workload"]), fleets.index(c["num_instances"])
            ratio[i, j] = c["headline"]["vs_best"]
            labels[i][j] = f"{_ratio(ratio[i, j])}\n{c['headline']['best_baseline'] or ''}"
            if c["headline"].get("leader_not_run"):
                labels[i][j] += f"\n({c['headline']['leader_not_run']} not run)"
    fig, ax = plt.subplots(figsize=(2.2 * len(fleets) + 2, 0.8 * len(workloads) + 1.6))
    finite = ratio[np.isfinite(ratio)]
    spread = max(0.05, float(np.max(np.abs(finite - 1.0)))) if len(finite) else 0.5
    image = ax.imshow(ratio, cmap="RdBu", norm=TwoSlopeNorm(1.0, 1.0 - spread, 1.0 + spread), aspect="auto")
    for i in range(len(workloads)):
        for j in range(len(fleets)):
            dark = abs(ratio[i, j] - 1.0) > 0.6 * spread  # NaN compares False
            ax.text(j, i, labels[i][j], ha="center", va="center", fontsize=8, color="white" if dark else "black")
    ax.set_xticks(range(len(fleets)), [str(n) for n in fleets])
    ax.set_yticks(range(len(workloads)), workloads)
    ax.set_xlabel("instances")
    fig.colorbar(image, ax=ax, label="PolyServe / best baseline")
    ax.set_title(f"Headline goodput (every tier >= 90 %), PolyServe over the best baseline of the cell "
                 f"({matrix['prediction_error']})", fontsize=9)
    _save(fig, path)


def plot_tier_attainment(matrix: dict, path: Path) -> None:
    """Each tier's attainment at each policy's headline goodput, under the three views: conv-4tier (else the first
    workload) at the largest fleet every policy ran (of those done so far, in a report checkpointed part way)."""
    plt = _plt()
    names = [w["name"] for w in matrix["workloads"]]
    workload = REFERENCE_WORKLOAD if REFERENCE_WORKLOAD in names else names[0]
    fleet = max(c["num_instances"] for c in matrix["cells"]
                if c["workload"] == workload and c["num_instances"] in matrix["fleets"])
    cells = [c for c in matrix["cells"] if c["workload"] == workload and c["num_instances"] == fleet]
    tiers = list(dict.fromkeys(t for c in cells if c["at_headline"] for t in c["at_headline"]["attainment"]["cumulative"]))
    fig, axes = plt.subplots(len(VIEWS), 1, figsize=(max(8.0, 1.3 * len(cells)), 2.8 * len(VIEWS)), sharex=True)
    width = 0.8 / max(1, len(tiers))
    x = np.arange(len(cells))
    for ax, view in zip(axes, VIEWS):
        for k, tier in enumerate(tiers):
            values = [c["at_headline"]["attainment"][view].get(tier, np.nan) if c["at_headline"] else np.nan
                      for c in cells]
            ax.bar(x + (k - (len(tiers) - 1) / 2) * width, values, width, label=tier)
        ax.axhline(EVERY_TIER.target, color="grey", lw=0.8)
        ax.set_ylim(0, 1.02)
        ax.set_ylabel(f"attaining ({view.replace('_', ' ')})", fontsize=8)
    axes[0].legend(fontsize=7, ncol=len(tiers), loc="lower left", bbox_to_anchor=(0.0, 1.1), frameon=False)
    axes[-1].set_xticks(x, [f"{c['policy']}\n{c['headline']['goodput']:.0f} req/s" for c in cells], fontsize=7,
                        rotation=20)
    axes[0].set_title(f"{workload}, {fleet} instances: per-tier attainment at each policy's headline goodput "
                      f"({matrix['prediction_error']})", fontsize=9)
    _save(fig, path)


def plot_error_sweep(sweep: dict, path: Path) -> None:
    """The headline score against the rate, one panel per prediction-error preset."""
    plt = _plt()
    errors = list(sweep["bounds"])
    policies = list(dict.fromkeys(r["policy"] for r in sweep["runs"]))
    rates = sorted({r["rate"] for r in sweep["runs"]})
    fig, axes = plt.subplots(1, len(errors), figsize=(4.2 * len(errors), 4), sharey=True, squeeze=False)
    for ax, error in zip(axes[0], errors):
        for policy in policies:
            scores = [_lowest_score(sweep["runs"], error, policy, rate) for rate in rates]
            line, = ax.plot(rates, scores, marker="o", ms=3, label=policy)
            given_up = [r for r, s in zip(rates, scores) if math.isnan(s)]
            ax.plot(given_up, [0.0] * len(given_up), marker="x", ls="none", color=line.get_color())
        ax.axhline(EVERY_TIER.target, color="grey", lw=0.8)
        ax.axvline(sweep["bounds"][error]["every-tier"], color="black", ls="--", lw=0.8, label="headline bound")
        ax.set_title(error, fontsize=9)
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylim(-0.03, 1.02)
    axes[0][0].set_ylabel("worst tier's attainment (lowest seed)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{sweep['workload']}, {sweep['num_instances']} instances (x at 0: given up, under "
                 f"{SWEEP_FLOOR:.0%} pooled)", fontsize=10)
    _save(fig, path)


def plot_scan(scan: dict, path: Path) -> None:
    plt = _plt()
    sizes = scan["fleets"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in dict.fromkeys(s["policy"] for s in scan["searches"]):
        ax.plot(sizes, [next(s["goodput"] for s in scan["searches"] if s["policy"] == p and s["num_instances"] == n)
                        / n for n in sizes], marker="o", label=p)
    ax.axhline(scan["bound_per_instance"], color="black", ls="--", lw=0.8, label="headline bound")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.set_xlabel("instances")
    ax.set_ylabel("goodput per instance (req/s)")
    ax.set_ylim(bottom=0)
    ax.legend()
    _save(fig, path)


def plot_pd(runs: list[dict], path: Path) -> None:
    """Headline goodput of each router in PD mode against its prefill instances, a row of panels per workload and
    a panel per fleet size, the co-located runs as horizontal lines."""
    from matplotlib.ticker import MaxNLocator

    plt = _plt()
    fleets = sorted({s["num_instances"] for pd in runs for s in pd["searches"]})
    fig, axes = plt.subplots(len(runs), len(fleets), figsize=(6 * len(fleets), 4.5 * len(runs)), squeeze=False)
    for ax, (pd, n) in zip(axes.flat, ((pd, n) for pd in runs for n in fleets)):
        cell = [s for s in pd["searches"] if s["num_instances"] == n]
        for policy in dict.fromkeys(s["policy"] for s in cell):
            points = sorted((s["prefill_instances"], s["goodput"]) for s in cell
                            if s["policy"] == policy and s["prefill_instances"])
            line = ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{policy} (PD)")[0]
            for s in cell:
                if s["policy"] == policy and not s["prefill_instances"]:
                    ax.axhline(s["goodput"], color=line.get_color(), ls="--", lw=1, label=f"{policy} (co-located)")
        ax.set_title(f"{pd['workload']}, {n} instances, KV over {pd['link']}", fontsize=10)
        ax.set_xlabel("prefill instances")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("headline goodput (req/s)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    _save(fig, path)


def plot_phase_change(auto: dict, tier_names: list[str], path: Path) -> None:
    plt = _plt()
    samples = auto["samples"]
    t = [s[0] for s in samples]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    counts = np.array([s[1] for s in samples])
    ax.stackplot(t, *counts.T, [s[2] for s in samples], labels=[*tier_names, "idle pool"], alpha=0.8)
    ax.plot(t, [s[3] for s in samples], color="black", lw=1, label="live (incl. starting)")
    ax.axvline(auto["phase_change_at"], color="red", ls="--", lw=1, label="tier mix inverts")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("instances")
    ax.set_title("Autoscaled PolyServe: instances per tier through a phase change", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    _save(fig, path)


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
    _save(fig, path)


if __name__ == "__main__":
    main()
