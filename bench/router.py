"""The router's cost: one placement decision on a large fleet, and requests through the router service versus
straight to one engine.

    python -m bench.router [--instances 64] [--tiers 4] [--decisions 2000] [--requests 400] [--concurrency 32]

Placement: a fleet of `--instances` H200s (emulated Llama-3.1-8B, roofline latency model) split over the default
tiers, filled by the router itself with a mixed-tier load in virtual time until requests start to queue; then
`submit` of a fresh request (timed; its `on_finished` undoes it), a random tier each time. "warm": no instance
reported since the previous decision (only the one that took its request changed, by that one resident); "live":
the instances report in turn at the fleet's own pace, each once per predicted iteration (its load) while requests
arrive at the fill rate (640/s); "after reports": every instance reported a step since (the bound where steps far
outpace arrivals; the reports touch every resident of the fleet, so the decision then runs on a cold CPU cache). A
report counts the instance's resident summary again and takes there the snapshot and prefill chunk the next scan
reads. The reports are not in the decision's time; their median is printed beside it. In that synthetic fleet no
request ever leaves, so while the reports go on, residents grow past their max_tokens and instances past their KV
pool: it bounds the scan from above.
"simulated": the decision timed inside the fleet simulator (cluster/sim/simulator.py; bench/goodput.py's setup:
default tiers, Azure conversation lengths, Poisson arrivals at --sim-loads x the fluid bound), the same Router
object under the traffic it is built for: requests finish, every instance reports each step it took before the
next decision, the engines' KV pools hold what they hold.

Throughput: one emulated engine process (`--time-scale`), `--requests` requests of 16 prompt tokens and
`--max-tokens` outputs at `--concurrency`, first through a bare protocol client, then through RouterService on the
same engine (its cold start is printed too). Per-token delivery latency: time the consumer holds a token minus the
engine's emit time (one monotonic clock on one machine). Figures are medians unless marked, measured on this
machine's CPU.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from cluster import protocol as p
from cluster.autoscaler import Autoscaler, ScalingLimits
from cluster.fleet import RoutedRequest
from cluster.launcher import LocalLauncher
from cluster.router import InstanceReport, Outcome, Router
from cluster.service import RouterService
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from scheduler.roofline import emulated_latency_model, kv_blocks_for_gpu
from scheduler.tiers import DEFAULT_TIERS, Tier, parse_tiers


# ---- placement --------------------------------------------------------------------------------------------------
FILL_BURST, FILL_INTERVAL_S = 32, 0.05  # arrivals while the fleet fills: 640 requests/s of virtual time


class _CountingChecker:
    """The router's checker, counting calls (how many instances a decision examined)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def check(self, instance, request, now):
        self.calls += 1
        return self.inner.check(instance, request, now)

    def fits(self, summary, kv_capacity_tokens, iteration_end, tpot_ms, request, now):
        self.calls += 1
        return self.inner.fits(summary, kv_capacity_tokens, iteration_end, tpot_ms, request, now)

    def check_idle(self, request, kv_capacity_tokens):
        return self.inner.check_idle(request, kv_capacity_tokens)


class _Progress:
    __slots__ = ("request_id", "num_computed_tokens", "num_output_tokens")

    def __init__(self, request_id, computed, out):
        self.request_id, self.num_computed_tokens, self.num_output_tokens = request_id, computed, out


def _report_all(router: Router, now: float, rng: random.Random, times: list[float] | None = None,
                views=None) -> None:
    """Every instance (or each of `views`) reports a step: each resident decoding, some tokens further along.
    `times` collects the microseconds each `on_report` took."""
    for view in router.fleet.instances.values() if views is None else views:
        progress = []
        for r in view.residents.values():
            out = min(r.max_tokens - 1, r.num_output_tokens + rng.randrange(1, 4))
            progress.append(_Progress(r.request_id, r.num_prompt_tokens + out - 1, out))
        start = time.perf_counter_ns()
        router.on_report(view.instance_id, InstanceReport(now, 0, progress), now)
        if times is not None:
            times.append((time.perf_counter_ns() - start) / 1000)


def bench_placement(num_instances: int, tiers_spec: str, decisions: int, seed: int = 0) -> dict:
    tiers = parse_tiers(tiers_spec)
    router = Router(tiers, emulated_latency_model(),
                    autoscaler=Autoscaler(ScalingLimits(min_instances=0, max_instances=num_instances, idle_pool=0)),
                    queue_limit=1 << 30)
    capacity = kv_blocks_for_gpu() * 16
    for i in range(num_instances):
        router.add_instance(f"i{i}", 0.0)
        router.on_ready(f"i{i}", capacity, 0.0)
    rng = random.Random(seed)
    serial = iter(range(1 << 40))

    def make(now: float) -> RoutedRequest:
        k = rng.randrange(len(tiers))
        t = tiers[k]
        return RoutedRequest(f"r{next(serial)}", k, t.name, t.slo, now, rng.randint(256, 2048), rng.randint(64, 512))

    # saturate in virtual time: bursts of arrivals, each followed by a step report from every instance, until
    # requests start to queue
    now = 0.0
    while not router.waiting_tiers() and now < 60:
        for _ in range(FILL_BURST):
            router.submit(make(now), now)
        now += FILL_INTERVAL_S
        _report_all(router, now, rng)
    for q in router.queues:
        for req in list(q):
            router.withdraw(req.request_id)
    counter = _CountingChecker(router.checker)
    router.checker = counter
    figures = {"instances": num_instances, "tiers": len(tiers)}
    for load, keep in (("saturated", 1), ("half", 2), ("eighth", 4)):
        for view in list(router.fleet.instances.values()):  # all but one in `keep` residents finish
            for i, rid in enumerate(list(view.residents)):
                if i % keep:
                    router.on_finished(rid, 0, now, completed=False)
        views = list(router.fleet.instances.values())
        figures[load] = {"residents_per_instance": statistics.mean(len(v.residents) for v in views),
                         "tier_sizes": [len(m) for m in router.fleet.members], "idle": len(router.fleet.idle)}
        # live: each instance reports once per predicted iteration (its load) while requests arrive at the fill
        # rate, so about this many reports come between two decisions
        reports_per_decision = sum(1.0 / v.load for v in views if v.load > 0) * FILL_INTERVAL_S / FILL_BURST
        figures[load]["live_reports_per_decision"] = reports_per_decision
        next_reporter, owed = 0, 0.0
        for mode in ("warm", "live", "after_reports"):
            times, checks, outcomes, report_times = [], [], {o: 0 for o in Outcome}, []
            for _ in range(decisions):
                if mode == "after_reports":
                    _report_all(router, now, rng, report_times)
                elif mode == "live":
                    owed += reports_per_decision
                    reporters = [views[(next_reporter + i) % len(views)] for i in range(int(owed))]  # round robin
                    next_reporter, owed = next_reporter + len(reporters), owed - len(reporters)
                    _report_all(router, now, rng, report_times, reporters)
                req = make(now)
                counter.calls = 0
                start = time.perf_counter_ns()
                decision = router.submit(req, now)
                times.append((time.perf_counter_ns() - start) / 1000)
                checks.append(counter.calls)
                outcomes[decision.outcome] += 1
                if decision.outcome is Outcome.QUEUED:
                    router.withdraw(req.request_id)
                else:
                    router.on_finished(req.request_id, 0, now, completed=False)
            times.sort()
            figures[load][mode] = {"median_us": statistics.median(times), "p90_us": times[int(0.9 * len(times))],
                                   "p99_us": times[int(0.99 * len(times))], "mean_checks": statistics.mean(checks),
                                   "placed": outcomes[Outcome.PLACED], "queued": outcomes[Outcome.QUEUED],
                                   "report_median_us": statistics.median(report_times) if report_times else None}
    return figures


def bench_placement_simulated(num_instances: int, loads: tuple[float, ...], duration_s: float, warmup_s: float,
                              seed: int = 1) -> dict:
    """Decisions after `warmup_s` of virtual time (the fleet fills from empty first)."""
    from bench.goodput import Setup, build_setup, make_simulator
    from cluster.sim.workload import workload_spec

    setup = Setup(workload_spec("conv-4tier"), None, 0.0, duration_s)
    built = build_setup(setup)
    bound = setup.bound()
    figures = {}
    for load in loads:
        sim = make_simulator("polyserve", num_instances, built.model, built.tiers, co_budget=0)
        times, checks = [], []

        def timed_router(expected_output: float, build=sim._build_router) -> Router:
            router = build(expected_output)
            counter = router.checker = _CountingChecker(router.checker)
            submit = router.submit

            def timed_submit(req, now, readmit=False):
                if now < warmup_s:
                    return submit(req, now, readmit)
                counter.calls = 0
                start = time.perf_counter_ns()
                decision = submit(req, now, readmit)
                times.append((time.perf_counter_ns() - start) / 1000)
                checks.append(counter.calls)
                return decision

            router.submit = timed_submit
            return router

        sim._build_router = timed_router
        rate = load * bound.rate(num_instances)
        res = sim.run(built.workloads.poisson(rate, duration_s, seed))
        times.sort()
        figures[load] = {"rate": rate, "decisions": len(times), "median_us": statistics.median(times),
                         "p90_us": times[int(0.9 * len(times))], "p99_us": times[int(0.99 * len(times))],
                         "mean_checks": statistics.mean(checks), "attainment": res.attainment(),
                         "tier_sizes": [s for s in res.samples if s[0] <= duration_s][-1][1]}
    return figures


# ---- throughput -------------------------------------------------------------------------------------------------
def _prompt(i: int) -> list[int]:
    return [3 + (i * 31 + j * 7) % 900 for j in range(16)]


async def _direct(host: str, port: int, token: str, tier: Tier, n: int, concurrency: int,
                  max_tokens: int) -> tuple[float, list[float]]:
    """A bare protocol client: keeps `concurrency` requests in flight on one connection."""
    reader, writer = await asyncio.open_connection(host, port)
    hello = await p.read_message(reader)
    assert isinstance(hello, p.Hello)
    writer.write(p.encode_frame(p.Auth(p.auth_proof(token, hello.challenge))))
    lags: list[float] = []
    sent = done = 0

    def submit():
        nonlocal sent
        writer.write(p.encode_frame(p.Submit(f"d{sent}", _prompt(sent), p.SamplingSpec(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True), tier.name, tier.slo, 0.0)))
        sent += 1

    start = time.monotonic()
    for _ in range(min(concurrency, n)):
        submit()
    while done < n:
        msg = await p.read_message(reader)
        now = time.monotonic()
        if isinstance(msg, p.Tokens):
            lags.extend(now - t for d in msg.deltas for t in d.emit_times)
        elif isinstance(msg, p.Finish):
            done += 1
            if sent < n:
                submit()
    elapsed = time.monotonic() - start
    writer.close()
    return n / elapsed, lags


async def _routed(service: RouterService, tier: Tier, n: int, concurrency: int,
                  max_tokens: int) -> tuple[float, list[float]]:
    lags: list[float] = []
    offsets = {iid: link.clock_offset for iid, link in service.links.items()}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    queue = iter(range(n))

    async def worker():
        for i in queue:
            async for out in service.generate(f"q{i}", _prompt(i), params, tier.name, tier.slo,
                                              time.monotonic()):
                now = time.monotonic()
                k = len(out.new_token_ids)
                if k:  # back on the engine's clock: the mapped times carry the Hello's transit
                    offset = offsets[service.streams[f"q{i}"].routed.instance_id]
                    lags.extend(now - (t - offset) for t in out.token_times[-k:])

    start = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return n / (time.monotonic() - start), lags


async def bench_throughput(requests: int, concurrency: int, max_tokens: int, time_scale: float) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 4096, "eos_token_id": 2}))
        launcher = LocalLauncher(EngineConfig(model=folder, executor="emulated", time_scale=time_scale,
                                              batch_policy="fcfs"))
        host, port = await launcher.start("bench-engine")
        tiers = parse_tiers(DEFAULT_TIERS)
        loosest = tiers[len(tiers) - 1]
        try:
            await _direct(host, port, launcher.token, loosest, concurrency, concurrency, 4)  # warm-up
            direct_rps, direct_lags = await _direct(host, port, launcher.token, loosest, requests, concurrency,
                                                    max_tokens)
            service = RouterService(Router(tiers, emulated_latency_model(time_scale)), token=launcher.token)
            await service.start()
            await service.attach(host, port)
            await _routed(service, loosest, concurrency, concurrency, 4)  # warm-up
            routed_rps, routed_lags = await _routed(service, loosest, requests, concurrency, max_tokens)
            await service.stop()
        finally:
            await launcher.close()
    figures = {"requests": requests, "concurrency": concurrency, "max_tokens": max_tokens, "time_scale": time_scale,
               "cold_start_s": launcher.cold_starts[0]}
    for name, rps, lags in (("direct", direct_rps, direct_lags), ("router", routed_rps, routed_lags)):
        lags.sort()
        figures[name] = {"requests_per_s": rps, "tokens_per_s": rps * max_tokens,
                         "token_lag_median_ms": 1000 * statistics.median(lags),
                         "token_lag_p99_ms": 1000 * lags[int(0.99 * len(lags))]}
    figures["added_token_lag_median_ms"] = figures["router"]["token_lag_median_ms"] - \
        figures["direct"]["token_lag_median_ms"]
    return figures


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", type=int, default=64)
    ap.add_argument("--tiers", default=DEFAULT_TIERS)
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--time-scale", type=float, default=1.0, help="emulated engine iteration = this x roofline")
    ap.add_argument("--sim-loads", default="0.95,0.5", help="simulated mode: arrival rates, x the fluid bound")
    ap.add_argument("--sim-duration", type=float, default=20.0, help="simulated mode: seconds of arrivals")
    ap.add_argument("--sim-warmup", type=float, default=8.0, help="simulated mode: seconds before the timing")
    ap.add_argument("--skip-throughput", action="store_true")
    args = ap.parse_args(argv)

    place = bench_placement(args.instances, args.tiers, args.decisions)
    print(f"placement decision (Router.submit), {place['instances']} instances in {place['tiers']} tiers (CPU):")
    for load in ("saturated", "half", "eighth"):
        f = place[load]
        print(f"  {load}: tiers {f['tier_sizes']} + {f['idle']} idle, {f['residents_per_instance']:.0f} residents "
              f"per instance; live: {f['live_reports_per_decision']:.1f} reports per decision")
        for mode in ("warm", "live", "after_reports"):
            m = f[mode]
            reports = "" if m["report_median_us"] is None else \
                f"  (on_report, untimed above: median {m['report_median_us']:.1f} us)"
            print(f"    {mode:14s} median {m['median_us']:8.1f} us  p90 {m['p90_us']:8.1f}  p99 {m['p99_us']:8.1f}  "
                  f"checks/decision {m['mean_checks']:5.2f}  placed {m['placed']} queued {m['queued']}{reports}")
    sim = bench_placement_simulated(args.instances, tuple(float(x) for x in args.sim_loads.split(",")),
                                    args.sim_duration, args.sim_warmup)
    print(f"  simulated (fleet simulator, {args.instances} instances, default tiers, Poisson arrivals for "
          f"{args.sim_duration:g} s, decisions after {args.sim_warmup:g} s timed):")
    for load, m in sim.items():
        print(f"    {load:.2f} x bound ({m['rate']:.0f} req/s, attainment {m['attainment']:.1%}, tiers "
              f"{list(m['tier_sizes'])} as arrivals end): median {m['median_us']:6.1f} us  p90 {m['p90_us']:6.1f}  "
              f"p99 {m['p99_us']:6.1f}  checks/decision {m['mean_checks']:5.2f}  over {m['decisions']} decisions")
    if args.skip_throughput:
        return
    thr = asyncio.run(bench_throughput(args.requests, args.concurrency, args.max_tokens, args.time_scale))
    print(f"throughput, one emulated engine (time scale {thr['time_scale']:g}), {thr['requests']} requests x "
          f"{thr['max_tokens']} tokens at concurrency {thr['concurrency']} (CPU):")
    for name in ("direct", "router"):
        f = thr[name]
        print(f"  {name:7s} {f['requests_per_s']:7.1f} req/s  {f['tokens_per_s']:8.0f} tok/s  token lag median "
              f"{f['token_lag_median_ms']:.2f} ms  p99 {f['token_lag_p99_ms']:.2f} ms")
    print(f"  added by the router: {thr['added_token_lag_median_ms']:.2f} ms per token (median); engine cold start "
          f"(spawn to READY, config-only model folder) {thr['cold_start_s']:.2f} s")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
