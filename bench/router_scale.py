"""Router scale: how many engine step reports one router process absorbs, and what its placement decisions and event
loop suffer meanwhile.

    python -m bench.router_scale [--instances 64 256] [--steps-per-s 50] [--requests-per-s 1 per instance]
                                 [--report-every-steps 8] [--seconds 10] [--json out.json]

Live (over real loopback sockets): a second process plays `--instances` engine workers. Each listens on its own
port, does the worker's side of the handshake (Hello with a challenge, the router's Auth checked), and then runs
what the router sends: every tick (`--steps-per-s`) every instance steps, and tells the router as a worker does
(cluster/step_reports.py: a StepReport at once when a resident joined, left or emitted its first token, else once
`--report-every-steps` steps are held; 1: a report every step), with a Tokens frame for the residents that produced
a token, and Finish at max_tokens. Every instance steps every tick, busy or not: the worst case of a fleet where
every engine runs. The router process runs RouterService (the real
one: framing, decoding, the router's view, placement, token streams) attached to all of them, with requests
arriving at `--requests-per-s` (Poisson; 64 prompt tokens, 50 output tokens, the default tiers but the tightest)
whose outputs a consumer reads.

Measured over `--seconds` after a warm-up: step reports (frames) and the steps they told of that the router handled
per second, against those the fake fleet sent (what the fleet process achieved, on this machine; a router that
cannot keep up leaves them in socket buffers),
the time of each placement decision (`Router.submit`, wall clock around the call), and the router's event-loop lag
(a task asks to sleep 5 ms; the lag is how much later it wakes).

In-process: the router service's cost of one step report alone (decode the frame, hand it to the service), for a
fleet of 256 instances holding 4 residents each, a report telling of one step and of `--report-every-steps`: the
bound on reports per second one core absorbs if it did nothing else.
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import multiprocessing as mp
import os
import random
import time

from cluster import protocol as p
from cluster.fleet import RoutedRequest
from cluster.router import Router
from cluster.service import RouterService
from cluster.step_reports import DEFAULT_REPORT_EVERY_STEPS, StepReportCoalescer
from engine.sampling_params import SamplingParams
from scheduler.roofline import emulated_latency_model
from scheduler.tiers import DEFAULT_TIERS, parse_tiers

TOKEN = "router-scale-bench-token-0123456789"
NUM_KV_BLOCKS = 4096
BLOCK_SIZE = 16
PROMPT_TOKENS = 64
OUTPUT_TOKENS = 50


# ---- the fake fleet (its own process) ----------------------------------------------------------------------------
class _FakeInstance:
    __slots__ = ("instance_id", "writer", "residents", "steps", "reports", "frames_sent")

    def __init__(self, instance_id: str, report_every_steps: int):
        self.instance_id, self.writer, self.steps, self.frames_sent = instance_id, None, 0, 0
        self.residents: dict[str, list[int]] = {}  # request id -> [prompt tokens, output tokens, max tokens]
        self.reports = StepReportCoalescer(report_every_steps, NUM_KV_BLOCKS)


async def _serve_instance(inst: _FakeInstance, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    challenge = os.urandom(32)
    writer.write(p.encode_frame(p.Hello(p.PROTOCOL_VERSION, inst.instance_id, os.getpid(), time.monotonic(),
                                        NUM_KV_BLOCKS, BLOCK_SIZE, 4096, 32000, False, "emulated", challenge)))
    auth = await p.read_message(reader)
    if not (isinstance(auth, p.Auth) and hmac.compare_digest(auth.proof, p.auth_proof(TOKEN, challenge))):
        writer.close()
        return
    inst.writer = writer
    while (msg := await p.read_message(reader)) is not None:
        if isinstance(msg, p.Submit):
            inst.residents[msg.request_id] = [len(msg.prompt_token_ids), 0, msg.sampling.max_tokens]
        elif isinstance(msg, p.Abort):
            inst.residents.pop(msg.request_id, None)


def _step(inst: _FakeInstance, now: float, period: float) -> None:
    """One engine step: every resident prefilled at once, then one token per step."""
    deltas, finished, residents = [], [], []
    for rid, r in inst.residents.items():
        r[1] += 1
        deltas.append(p.TokenDelta(rid, [100 + r[1] % 1000], "", [now]))
        if r[1] >= r[2]:
            finished.append(rid)
        else:
            residents.append(p.Resident(rid, r[0], r[0] + r[1] - 1, r[1]))
    n = len(inst.residents)
    blocks = sum((r[0] + r[1]) // BLOCK_SIZE + 1 for r in inst.residents.values())
    frames = [p.encode_frame(p.Tokens(deltas))] if deltas else []
    report = inst.reports.add(p.StepTiming(now - period, period, 0, n, blocks * BLOCK_SIZE, blocks, len(residents),
                                           0, n), residents)
    if report is not None:
        frames.append(p.encode_frame(report))
        inst.frames_sent += 1
    for rid in finished:
        del inst.residents[rid]
        frames.append(p.encode_frame(p.Finish(rid, "length", OUTPUT_TOKENS, 0)))
    inst.writer.write(b"".join(frames))
    inst.steps += 1


async def _fake_fleet_main(num_instances: int, steps_per_s: float, report_every_steps: int, conn) -> None:
    instances = [_FakeInstance(f"fake-{i}", report_every_steps) for i in range(num_instances)]
    servers = []
    for inst in instances:
        servers.append(await asyncio.start_server(lambda r, w, inst=inst: _serve_instance(inst, r, w),
                                                  "127.0.0.1", 0))
    conn.send([s.sockets[0].getsockname()[1] for s in servers])
    period = 1.0 / steps_per_s
    marks: list[tuple[float, int, int]] = []  # (time, steps, frames sent so far) at the router's "mark" and "stop"
    loop = asyncio.get_running_loop()
    loop.add_reader(conn.fileno(), lambda: conn.recv() and marks.append(
        (time.monotonic(), sum(i.steps for i in instances), sum(i.frames_sent for i in instances))))
    due = time.monotonic()
    while len(marks) < 2:
        due += period
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        now = time.monotonic()
        due = max(due, now - period)  # behind: do not try to catch up, the rate achieved is what counts
        for inst in instances:
            if inst.writer is not None:
                _step(inst, now, period)
    (t0, steps0, frames0), (t1, steps1, frames1) = marks
    conn.send(((steps1 - steps0) / (t1 - t0), (frames1 - frames0) / (t1 - t0)))


def _fake_fleet(num_instances: int, steps_per_s: float, report_every_steps: int, conn) -> None:
    asyncio.run(_fake_fleet_main(num_instances, steps_per_s, report_every_steps, conn))


# ---- the router side ---------------------------------------------------------------------------------------------
class _CountingService(RouterService):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reports = self.steps = 0

    def _on_message(self, link, msg) -> None:
        if type(msg) is p.StepReport:
            self.reports += 1
            self.steps += len(msg.steps)
        super()._on_message(link, msg)


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _live(num_instances: int, steps_per_s: float, requests_per_s: float, seconds: float,
                warmup_s: float, report_every_steps: int) -> dict:
    parent, child = mp.Pipe()
    fleet = mp.get_context("spawn").Process(target=_fake_fleet, daemon=True,
                                            args=(num_instances, steps_per_s, report_every_steps, child))
    fleet.start()
    ports = parent.recv()
    tiers = parse_tiers(DEFAULT_TIERS)
    router = Router(tiers, emulated_latency_model())
    decisions: list[float] = []
    submit = router.submit

    def timed_submit(*args, **kwargs):
        t = time.perf_counter()
        try:
            return submit(*args, **kwargs)
        finally:
            decisions.append(time.perf_counter() - t)

    router.submit = timed_submit
    service = _CountingService(router, token=TOKEN, heartbeat_timeout_s=30.0)
    await service.start()
    for port in ports:
        await service.attach("127.0.0.1", port)
    lags: list[float] = []
    outcomes: dict[str, int] = {}
    measuring = asyncio.Event()
    rng = random.Random(0)

    async def sample_lag():
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.005)
            if measuring.is_set():
                lags.append(time.monotonic() - t - 0.005)

    async def one_request(i: int):
        tier = tiers[1 + i % (len(tiers) - 1)]  # the tightest tier's TPOT is below the fake step time
        params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True)
        prompt = [1 + (i * 31 + j) % 30000 for j in range(PROMPT_TOKENS)]
        try:
            async for out in service.generate(f"r{i}", prompt, params, tier.name, tier.slo, service.clock()):
                if out.finished and measuring.is_set():
                    outcomes[out.finish_reason] = outcomes.get(out.finish_reason, 0) + 1
        except Exception as e:
            if measuring.is_set():
                    outcomes[type(e).__name__] = outcomes.get(type(e).__name__, 0) + 1

    async def arrivals():
        # due times on the clock, not sleeps end to end: a loop that wakes late lets the arrivals due meanwhile
        # catch up, as clients' requests would, instead of slowing the offered rate down by its lag
        i = 0
        tasks = set()
        due = time.monotonic()
        while True:
            due += rng.expovariate(requests_per_s)
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            task = asyncio.create_task(one_request(i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1

    lag_task = asyncio.create_task(sample_lag())
    arrival_task = asyncio.create_task(arrivals())
    await asyncio.sleep(warmup_s)
    decisions.clear()
    reports0, steps0, t0 = service.reports, service.steps, time.monotonic()
    parent.send("mark")
    measuring.set()
    await asyncio.sleep(seconds)
    measuring.clear()
    parent.send("stop")
    reports, steps, elapsed = service.reports - reports0, service.steps - steps0, time.monotonic() - t0
    decided = list(decisions)
    arrival_task.cancel()
    lag_task.cancel()
    sent_steps_per_s, sent_per_s = await asyncio.get_running_loop().run_in_executor(None, parent.recv)
    fleet.join(10)
    await service.stop()
    return {
        "instances": num_instances, "steps_per_s_per_instance": steps_per_s,
        "report_every_steps": report_every_steps,
        "offered_steps_per_s": num_instances * steps_per_s,
        "sent_steps_per_s": sent_steps_per_s, "sent_reports_per_s": sent_per_s,
        "absorbed_steps_per_s": steps / elapsed, "absorbed_reports_per_s": reports / elapsed,
        "requests_per_s": requests_per_s, "decisions": len(decided),
        "decision_ms_p50": 1e3 * _percentile(decided, 0.5), "decision_ms_p99": 1e3 * _percentile(decided, 0.99),
        "decision_ms_max": 1e3 * max(decided, default=float("nan")),
        "loop_lag_ms_p50": 1e3 * _percentile(lags, 0.5), "loop_lag_ms_p99": 1e3 * _percentile(lags, 0.99),
        "loop_lag_ms_max": 1e3 * max(lags, default=float("nan")),
        "outcomes_in_window": outcomes,
    }


class SameClockLink:
    """What the service reads of a link while it handles a frame, for a worker whose clock is the router's."""

    def __init__(self, instance_id: str):
        self.instance_id, self.clock_offset = instance_id, 0.0

    @staticmethod
    def to_router_clock(t: float) -> float:
        return t


def in_process_cost(num_instances: int = 256, residents: int = 4, reports: int = 50_000,
                    steps_per_report: int = 1) -> dict:
    """Seconds of router CPU per step report (decode + service) telling of `steps_per_report` steps, on a fleet the
    router itself filled."""
    tiers = parse_tiers(DEFAULT_TIERS)
    router = Router(tiers, emulated_latency_model())
    service = RouterService(router)
    frames = {}
    now = time.monotonic()
    for i in range(num_instances):
        iid = f"i{i}"
        router.add_instance(iid, now)
        router.on_ready(iid, NUM_KV_BLOCKS * BLOCK_SIZE, now)
    for k in range(num_instances * residents):
        tier = tiers[1 + k % (len(tiers) - 1)]
        req = RoutedRequest(f"r{k}", 1 + k % (len(tiers) - 1), tier.name, tier.slo, now, PROMPT_TOKENS,
                            OUTPUT_TOKENS)
        router.submit(req, now)
    for view in router.fleet.instances.values():
        rs = [p.Resident(rid, PROMPT_TOKENS, PROMPT_TOKENS + 1, 2) for rid in view.residents]
        steps = [p.StepTiming(now + 0.02 * k, 0.02, 0, len(rs), 0, 8, len(rs), 0, len(rs))
                 for k in range(steps_per_report)]
        frames[view.instance_id] = p.encode_frame(p.StepReport(steps, NUM_KV_BLOCKS, rs))[p.HEADER.size:]
    links = {iid: SameClockLink(iid) for iid in frames}
    order = list(frames)
    t = time.perf_counter()
    for k in range(reports):
        iid = order[k % len(order)]
        service._on_message(links[iid], p.decode_payload(frames[iid]))
    per_report = (time.perf_counter() - t) / reports
    placed = sum(len(v.residents) for v in router.fleet.instances.values())
    return {"instances": num_instances, "residents_placed": placed, "steps_per_report": steps_per_report,
            "us_per_report": 1e6 * per_report, "reports_per_s_one_core": 1.0 / per_report,
            "steps_per_s_one_core": steps_per_report / per_report}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--steps-per-s", type=float, default=50.0, help="steps each fake instance reports per second")
    ap.add_argument("--requests-per-instance-s", type=float, default=1.0,
                    help="request arrivals per second, per instance")
    ap.add_argument("--report-every-steps", type=int, default=DEFAULT_REPORT_EVERY_STEPS,
                    help="the fake workers' coalescing, as cluster.worker's flag (1: a report every step)")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    logging.getLogger("cluster").setLevel(logging.ERROR)  # the fake fleet's exit at the end reads as deaths
    every = args.report_every_steps
    if every < 1:
        raise SystemExit(f"--report-every-steps must be positive, got {every}")
    results = {"in_process": [in_process_cost(steps_per_report=k) for k in sorted({1, every})], "live": []}
    for c in results["in_process"]:
        print(f"in-process: {c['us_per_report']:.1f} us per step report of {c['steps_per_report']} steps "
              f"({c['instances']} instances, {c['residents_placed']} residents): {c['reports_per_s_one_core']:,.0f} "
              f"reports/s, {c['steps_per_s_one_core']:,.0f} steps/s on one core")
    for n in args.instances:
        r = asyncio.run(_live(n, args.steps_per_s, args.requests_per_instance_s * n, args.seconds, args.warmup_s,
                              every))
        results["live"].append(r)
        print(f"live {n} instances, a report at most every {every} steps: offered {r['offered_steps_per_s']:,.0f} "
              f"steps/s; absorbed {r['absorbed_steps_per_s']:,.0f} steps/s in {r['absorbed_reports_per_s']:,.0f} "
              f"reports/s (the fake fleet sent {r['sent_steps_per_s']:,.0f} steps/s in "
              f"{r['sent_reports_per_s']:,.0f} reports/s); "
              f"{r['requests_per_s']:.0f} req/s, decision p50/p99/max "
              f"{r['decision_ms_p50']:.3f}/{r['decision_ms_p99']:.3f}/{r['decision_ms_max']:.2f} ms; loop lag "
              f"p50/p99/max {r['loop_lag_ms_p50']:.2f}/{r['loop_lag_ms_p99']:.2f}/{r['loop_lag_ms_max']:.1f} ms; "
              f"requests finished in the window {r['outcomes_in_window']}")
    print(f"load average while running: {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
