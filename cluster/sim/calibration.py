"""The simulator checked against the engine: one workload replayed on a real engine (engine/engine.py, emulated
executor: no model runs, each step takes the latency model's predicted time) and in the simulator.

Two clocks for the engine:
- virtual: the executor advances a virtual clock by the predicted step time instead of sleeping, so the engine's
  step loop, block manager and policy run exactly as live while the times are the model's. The simulator must
  then give the same emit time for every token (tests/test_simulator.py checks it to the last bit).
- real: the executor sleeps the predicted time (scaled down so a run takes seconds) and the engine reads
  time.monotonic, host overhead and sleep jitter included: the comparison that judges the simulator (attainment
  within a few points, similar latency distributions).

`replay_on_fleet` does the same for a whole fleet: emulated engine processes (cluster.worker) behind the live
router service (cluster/service.py), the workload's requests sent through it in real time, against the simulator
with as many instances. Its engines may sleep a prediction-error truth (scheduler/prediction_error.py) rather than
the model itself; the host time is then what a step took beyond the truth it slept, which the replay rebuilds from
the engines' seeds and step reports. With `prefill_instances`, the fleet is disaggregated (DESIGN.md §7): the
launcher starts that many prefill engines and the rest decode engines, the router learns each one's role from its
Hello and counts the KV link's transfer time, and the simulator runs the same split over the same link. Emulated
engines have no KV, so a live hand-off moves no bytes: its transfer is the pull's round trip on loopback, against the
link's nominal time in the router and the simulator; both are small beside an emulated step.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from cluster import protocol
from cluster.launcher import LocalLauncher
from cluster.router import Router
from cluster.service import RouterService
from cluster.sim.simulator import SimConfig, SimResult, Simulator
from cluster.sim.workload import REFUSED, Workload
from engine.config import EngineConfig
from engine.llm import build_engine
from engine.sampling_params import SamplingParams
from engine.serving import QueueFullError, freeze_startup_heap
from scheduler.attainment import measure_request
from scheduler.headroom import DEFAULT_TARGET, Headroom
from scheduler.latency_model import LatencyModel
from scheduler.prediction_error import EXACT, StepTruth, prediction_error
from scheduler.roofline import LLAMA_3_1_8B, ModelShape
from scheduler.transfer import transfer_model
from scheduler.types import BatchPolicy

STALL_THRESHOLD_S = 1e-3  # host time a step may spend beyond the fit before it counts as a stall
EOS_TOKEN_ID = 128001  # Llama 3's <|end_of_text|>; the emulated executor never samples it


def write_emulated_model_folder(folder: str | Path, shape: ModelShape = LLAMA_3_1_8B,
                                max_position_embeddings: int = 131072) -> str:
    """A Hugging Face folder holding only config.json with `shape`'s sizes: all the emulated executor reads."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": shape.vocab_size,
              "hidden_size": shape.hidden_size, "intermediate_size": shape.intermediate_size,
              "num_hidden_layers": shape.num_layers, "num_attention_heads": shape.num_heads,
              "num_key_value_heads": shape.num_kv_heads, "head_dim": shape.head_dim, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "max_position_embeddings": max_position_embeddings,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": EOS_TOKEN_ID}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return str(folder)


class _VirtualClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(slots=True, frozen=True)
class EngineReplay:
    """Emit times (seconds from the workload's start) of every request's tokens, workload order; None: refused."""
    token_times: list[list[float] | None]
    num_steps: int
    wall_s: float
    # host time per step: measured step time and the engine's time until its next step (`busy_gaps`) - the time the
    # executor slept ~ step_overhead_s + per_seq * sequences, least squares (non-negative) over the last steps the
    # engine kept
    step_overhead_s: float
    step_overhead_per_seq_s: float
    # real clock: time that neither the model nor the fit explains (steps, with the time until the next, more than
    # STALL_THRESHOLD_S over the fit, wake-ups for an arrival later than that): the CPU held by
    # another process, or this one paused. No simulator can know of it, so a run with much of it says nothing about
    # the simulator. 0 on the virtual clock.
    stall_s: float = 0.0


def replay_on_engine(workload: Workload, model: LatencyModel, policy: BatchPolicy, model_folder: str,
                     num_kv_blocks: int, block_size: int = 16, clock: str = "virtual",
                     max_steps: int = 10_000_000) -> EngineReplay:
    """Runs `workload` on one emulated engine. Each request's prompt is distinct token ids (no prefix-cache hits,
    which the simulator does not model, and prefix caching is off anyway) and its max_tokens is its output length,
    so it ends exactly there, as in the simulator with reveal_output_len."""
    if clock not in ("virtual", "real"):
        raise ValueError(f"clock must be 'virtual' or 'real', got {clock!r}")
    virtual = _VirtualClock()
    if clock == "virtual":
        def step_time(p: int, d: int, k: int, num_seqs: int) -> float:
            virtual.now += model.predict(p, d, k)
            return 0.0  # no sleep: the clock moved
    else:
        step_time = StepTruth(model, EXACT).duration
    config = EngineConfig(model=model_folder, executor="emulated", block_size=block_size, num_kv_blocks=num_kv_blocks,
                          enable_prefix_caching=False, max_num_seqs=1 << 20, max_num_batched_tokens=1 << 20)
    engine = build_engine(config, policy, step_time=step_time)
    tiers = workload.tiers
    n = len(workload)
    arrivals = workload.arrivals.tolist()
    # the heap frozen as a serving engine's (engine.serve freezes it once serving), before the clock starts: the
    # full collection that freezing takes would otherwise delay the first arrivals
    with _heap_frozen() if clock == "real" else contextlib.nullcontext():
        t0 = time.monotonic()
        if clock == "virtual":
            engine.clock = virtual
            now = virtual
        else:
            engine.clock = lambda: time.monotonic() - t0

            def now() -> float:
                return time.monotonic() - t0
        token_times: list[list[float] | None] = [None] * n
        ids: dict[str, int] = {}
        i = steps = 0
        gaps: list[float] = []  # wake-ups for an arrival later than it
        while i < n or engine.has_unfinished():
            t = now()
            while i < n and arrivals[i] <= t:
                k = int(workload.tier_index[i])
                if k != REFUSED:
                    prompt = _distinct_prompt(i, int(workload.prompt_lens[i]))
                    params = SamplingParams(max_tokens=int(workload.output_lens[i]), ignore_eos=True)
                    engine.add_request(f"r{i}", prompt, params, tiers[k].slo, arrivals[i], tiers[k].name)
                    ids[f"r{i}"] = i
                i += 1
            if engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        token_times[ids[out.request_id]] = list(out.token_times)
                steps += 1
                if steps > max_steps:
                    raise RuntimeError(f"the engine did not finish the workload within {max_steps} steps")
            elif i < n:
                if clock == "virtual":
                    virtual.now = arrivals[i]
                else:
                    time.sleep(max(0.0, arrivals[i] - now()))
                    gaps.append(now() - arrivals[i])  # a late wake-up delays the arrival like a gap between steps
    slept = [model.predict(s.num_prefill_tokens, s.num_decode_seqs, s.num_kv_tokens) for s in engine.step_stats]
    return EngineReplay(token_times, steps, time.monotonic() - t0,
                        *host_time(engine.step_stats, slept, gaps, busy_gaps(engine.step_stats)))


@contextlib.contextmanager
def _heap_frozen():
    """The heap as it is now out of the garbage collector's walks while the block runs, as in a serving process
    (then given back: the caller may be a test's process)."""
    freeze_startup_heap()
    try:
        yield
    finally:
        gc.unfreeze()


def _distinct_prompt(i: int, length: int) -> list[int]:
    """Request i's prompt: token ids no other request's prompt starts with (no prefix-cache hits, which the
    simulator does not model)."""
    return [(i * 7919 + j) % 1000 for j in range(length)]


@dataclass(slots=True, frozen=True)
class FleetReplay:
    """Emit times (seconds from the workload's start, on the router's clock) of every request's tokens, workload
    order; None: refused by the router (counted in `refused`), or ended without its whole output (in `failed`)."""
    token_times: list[list[float] | None]
    failed: int
    refused: int  # answered 429: a full queue, the costly share, or shed once it could no longer be on time
    wall_s: float
    steps: dict[str, int]  # steps each engine reported
    # as EngineReplay's, fitted to the step reports of every engine
    step_overhead_s: float
    step_overhead_per_seq_s: float
    # the engines' steps (with the time until each one's next) and the router's event loop late by over
    # STALL_THRESHOLD_S
    stall_s: float
    # with token_times: the instance that emitted each token (None where token_times is)
    token_instances: list[list[str] | None]
    roles: dict[str, str]  # instance id -> its engine role as its Hello said ("both": co-located)
    counts: dict[str, int]  # the service's tallies: hand-offs, refused imports, failed transfers, migrations
    prefill_instances: int = 0  # prefill/decode disaggregation: the engines of role prefill, the rest decode
    transfer: str = "nvlink"  # with prefill_instances: the KV link the router was told (scheduler.transfer.LINKS)


class _ReportKeepingService(RouterService):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # every step each instance reported, in order (a report tells of the steps since the previous one)
        self.step_reports: defaultdict[str, list[protocol.StepTiming]] = defaultdict(list)
        # request id -> the instance each token the service took for its stream came from
        self.token_instances: defaultdict[str, list[str]] = defaultdict(list)

    def _on_message(self, link, msg) -> None:
        if isinstance(msg, protocol.StepReport):
            self.step_reports[link.instance_id].extend(msg.steps)
        if not isinstance(msg, protocol.Tokens):
            super()._on_message(link, msg)
            return
        # the tokens the service takes into each stream (it drops those of an instance the stream has left)
        streams = {d.request_id: s for d in msg.deltas if (s := self.streams.get(d.request_id)) is not None}
        before = {request_id: len(s.token_ids) for request_id, s in streams.items()}
        super()._on_message(link, msg)
        for request_id, s in streams.items():
            self.token_instances[request_id] += [link.instance_id] * (len(s.token_ids) - before[request_id])


async def replay_on_fleet(workload: Workload, time_scale: float, num_instances: int, model_folder: str,
                          num_kv_blocks: int, *, max_num_seqs: int, max_num_batched_tokens: int,
                          max_prefill_chunk: int, model: LatencyModel, prediction_error: str = "exact",
                          step_seed: int = 0, shed_late: bool = True, prefill_instances: int = 0,
                          transfer: str = "nvlink", headroom_target: float = DEFAULT_TARGET,
                          costly_share: float = 0.0) -> FleetReplay:
    """Runs `workload` through a live fleet: `num_instances` emulated engine processes (each sleeping, per step,
    the truth of `model`, the emulated latency model at `time_scale`, under the `prediction_error` preset, its draws
    seeded by `step_seed` and its instance id; batch policy PolyServe), attached to a RouterService whose Router
    (policy polyserve, no autoscaler: the fleet is fixed, as in the simulator) places every request. Each request
    is sent at its arrival with max_tokens = its output length (ignore_eos), so it ends exactly there. `shed_late`:
    the Router's (False: every request served, however late). `headroom_target`: the router's and the engines'.
    `costly_share`: the Router's (`scheduler.costly`), as SimConfig's for the simulator.

    `prefill_instances` > 0: that many of the engines are started with role prefill and the rest with role decode
    (the launcher's rule), and the router counts a hand-off's KV as crossing the `transfer` link (a preset of
    scheduler.transfer.LINKS, for the emulated model's KV size)."""
    if not 0 <= prefill_instances < num_instances:
        raise ValueError(f"prefill_instances must be non-negative and leave a decode instance among {num_instances}, "
                         f"got {prefill_instances}")
    router = Router(workload.tiers, model, max_prefill_chunk=max_prefill_chunk, shed_late=shed_late,
                    expected_output_tokens=float(workload.output_lens.mean()) if len(workload) else 128.0,
                    transfer=transfer_model(transfer) if prefill_instances else None, headroom_target=headroom_target,
                    costly_share=costly_share)
    launcher = LocalLauncher(EngineConfig(model=model_folder, executor="emulated", num_kv_blocks=num_kv_blocks,
                                          time_scale=time_scale, max_num_seqs=max_num_seqs,
                                          max_num_batched_tokens=max_num_batched_tokens,
                                          max_prefill_chunk=max_prefill_chunk, prediction_error=prediction_error,
                                          step_seed=step_seed, headroom_target=headroom_target),
                             prefill_instances=prefill_instances)
    service = _ReportKeepingService(router, launcher=launcher, heartbeat_timeout_s=10.0)
    await service.start()
    try:
        for k in range(num_instances):
            await service.attach(*await launcher.start(f"engine-{k}"))
        roles = {instance_id: router.roles.get(instance_id, "both") for instance_id in service.links}
        with _heap_frozen():
            token_times, failed, refused, wall, lags = await _send_all(service, workload)
    finally:
        await service.stop()
    reports = [r for steps in service.step_reports.values() for r in steps]
    between = [g for steps in service.step_reports.values() for g in busy_gaps(steps)]
    slept = _slept(service.step_reports, model, prediction_error, step_seed)
    token_instances = [None if times is None else service.token_instances[f"r{i}"]
                       for i, times in enumerate(token_times)]
    return FleetReplay(token_times, failed, refused, wall,
                       {instance_id: len(steps) for instance_id, steps in service.step_reports.items()},
                       *host_time(reports, slept, lags, between), token_instances, roles, dict(service.counts),
                       prefill_instances, transfer)


def _slept(step_reports: dict[str, list[protocol.StepTiming]], model: LatencyModel, error: str,
           step_seed: int) -> list[float]:
    """What each engine's executor slept for each of its reported steps, in `step_reports`' order: its StepTruth
    rebuilt as build_engine builds it (same model, preset and seed), asked for every step in turn, so that each
    step gets the same draw the engine's did (an engine reports every step it runs)."""
    slept = []
    for instance_id, steps in step_reports.items():
        truth = StepTruth(model, prediction_error(error), f"{step_seed}/{instance_id}")
        slept += [truth.duration(r.num_prefill_tokens, r.num_decode_seqs, r.num_kv_tokens, r.num_seqs) for r in steps]
    return slept


async def _send_all(service: RouterService, workload: Workload) -> tuple[list[list[float] | None], int, int, float,
                                                                          list[float]]:
    """Every request through `service` at its arrival; the token times, the failures, the requests the router
    refused (429), the wall time, and how late the event loop woke up every 10 ms (the router's own process held
    up)."""
    n = len(workload)
    token_times: list[list[float] | None] = [None] * n
    failed = refused = 0
    t0 = time.monotonic()  # the service's clock

    async def send(i: int) -> None:
        nonlocal failed, refused
        tier = workload.tiers[int(workload.tier_index[i])]
        out = int(workload.output_lens[i])
        await asyncio.sleep(max(0.0, t0 + float(workload.arrivals[i]) - time.monotonic()))
        last = None
        try:
            async for last in service.generate(f"r{i}", _distinct_prompt(i, int(workload.prompt_lens[i])),
                                               SamplingParams(max_tokens=out, ignore_eos=True), tier.name, tier.slo,
                                               t0 + float(workload.arrivals[i])):
                pass
        except QueueFullError:
            refused += 1
            return
        except Exception:
            failed += 1
            return
        if last is None or last.finish_reason != "length" or len(last.token_times) != out:
            failed += 1
            return
        token_times[i] = [t - t0 for t in last.token_times]

    async def watch(period: float = 0.01) -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(period)
            lags.append(time.monotonic() - t - period)

    lags: list[float] = []
    watcher = asyncio.get_running_loop().create_task(watch())
    await asyncio.gather(*(send(i) for i in range(n) if workload.tier_index[i] != REFUSED))
    wall = time.monotonic() - t0
    watcher.cancel()
    return token_times, failed, refused, wall, lags


def busy_gaps(stats: Sequence) -> list[float]:
    """For each of one engine's consecutive steps, the time from its end (as measured) to the next step's start
    while requests were left to run (0 where none was, or for the last): the engine's own work between steps
    (its bookkeeping after a step is measured, the loop around it), which the next step waits for as it waits for
    the step's own host time."""
    stats = list(stats)
    return [nxt.start - cur.start - cur.duration if cur.num_running + cur.num_waiting else 0.0
            for cur, nxt in zip(stats, stats[1:])] + [0.0] * bool(stats)


def host_time(stats, slept: Sequence[float], gaps: Sequence[float] = (),
              between: Sequence[float] = ()) -> tuple[float, float, float]:
    """What steps took beyond what the executor slept in each (`slept`, one entry per step of `stats`), with the
    time after each step until the next one (`between`, one entry per step: `busy_gaps`; none: 0): a (constant,
    per sequence) fit, and the stall, the time the fit does not explain (steps more than STALL_THRESHOLD_S over it,
    and `gaps` longer than that)."""
    if len(stats) < 2:
        return 0.0, 0.0, 0.0
    extra = np.array([s.duration for s in stats]) - np.asarray(slept, dtype=float)
    if len(between):
        extra += np.asarray(between, dtype=float)
    seqs = np.array([s.num_seqs for s in stats], dtype=float)
    a = np.vstack([np.ones_like(seqs), seqs]).T
    const, per_seq = np.linalg.lstsq(a, extra, rcond=None)[0]
    if per_seq < 0:
        const, per_seq = max(float(extra.mean()), 0.0), 0.0
    elif const < 0:
        const, per_seq = 0.0, float(max(np.dot(seqs, extra) / np.dot(seqs, seqs), 0.0))
    unexplained = np.concatenate([extra - const - per_seq * seqs, np.asarray(gaps, dtype=float)])
    stall = float((unexplained[unexplained > STALL_THRESHOLD_S] - STALL_THRESHOLD_S).sum())
    return float(const), float(per_seq), stall


def simulated_with_host_time(config: SimConfig, tiers, model: LatencyModel, workload: Workload,
                             replay: EngineReplay | FleetReplay,
                             policy_factory: Callable[[LatencyModel, Headroom], BatchPolicy] | None = None
                             ) -> SimResult:
    """The simulator on `workload` with `replay`'s fitted host time added to every step, on top of the host time
    of the config's prediction error; `policy_factory` as the Simulator takes it (the live engine's policy). A fleet
    replay's prefill/decode split and KV link are the simulator's too: a config naming another split is refused."""
    error = config.prediction_error
    with_host_time = dataclasses.replace(error, host_s=error.host_s + replay.step_overhead_s,
                                         host_per_seq_s=error.host_per_seq_s + replay.step_overhead_per_seq_s)
    config = dataclasses.replace(config, prediction_error=with_host_time)
    if isinstance(replay, FleetReplay):
        if config.prefill_instances and (config.prefill_instances, config.transfer) != (replay.prefill_instances,
                                                                                        replay.transfer):
            raise ValueError(f"the config's {config.prefill_instances} prefill instances over {config.transfer} are "
                             f"not the replayed fleet's {replay.prefill_instances} over {replay.transfer}")
        if replay.prefill_instances:
            config = dataclasses.replace(config, prefill_instances=replay.prefill_instances, transfer=replay.transfer)
    return Simulator(config, tiers, model, policy_factory=policy_factory).run(workload)


def attained(workload: Workload, token_times: list[list[float] | None]) -> np.ndarray:
    """Per request, whether every token met its cumulative deadline (a refused or unfinished one did not)."""
    out = np.zeros(len(workload), dtype=bool)
    for i, times in enumerate(token_times):
        k = int(workload.tier_index[i])
        if times and k != REFUSED:
            out[i] = measure_request(workload.tiers[k].slo, float(workload.arrivals[i]), times).attained
    return out


def live_latencies(arrivals: np.ndarray, token_times: list[list[float] | None],
                   idx: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """TTFT and mean TPOT (seconds) of a live run's requests `idx` (None: all) that emitted a token; the TPOT of those
    with two tokens or more."""
    idx = np.arange(len(token_times)) if idx is None else idx
    served = [(int(i), token_times[i]) for i in idx if token_times[i]]
    ttft = np.array([t[0] - arrivals[i] for i, t in served])
    tpot = np.array([(t[-1] - t[0]) / (len(t) - 1) for _, t in served if len(t) > 1])
    return ttft, tpot
