"""Failover under load: `kill -9` of engine processes behind the live router, with stream migration, and how long a
replacement takes to serve, from a cold start and from a warm spare.

    python -m bench.failover [--instances 4] [--requests 240] [--rate 8] [--kills 1] [--time-scale 4]
                             [--warm-spares 0,1] [--seed 0] [--router-policy polyserve]

Per --warm-spares value: --instances emulated `cluster.worker` processes (the default model's tokenizer, so texts
are real text; the Llama-3.1-8B/H200 roofline times --time-scale as their step time) behind the PolyServe router,
min = max = --instances and no idle pool, so that every engine lost must be replaced by a new process. --requests
greedy streams of both tiers arrive as a Poisson process at --rate per second (prompts of 20 to 400 tokens, 40 to 200
output tokens). While the load runs (kill k of n when arrival (k + 1) / (n + 2) of them is sent), the engine holding
the most streams under way is killed with SIGKILL. Then every stream is read to its end, and compared with an
undisturbed run of the same requests (the offline engine with the same emulated executor):

- requests, completed, errors (an error output or exception), refused (429), lost (no final answer), texts that
  differ from the undisturbed run;
- migrations, and the added delay: from the router finding the engine dead to the stream's next token (p50, max);
  the longest gap between two tokens of a migrated stream, against the median gap of every stream;
- replacement: from the kill to the replacement joining the router (ready) and to its first token, and whether it
  was a warm spare or a cold start (a spare used is started again; a kill before it is ready gets a cold start).

On this 2-core machine the engines and the router share the CPU with the client; --time-scale 4 leaves them room.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field

from cluster import protocol as p
from cluster.autoscaler import Autoscaler, ScalingLimits
from cluster.fleet import InstanceStatus
from cluster.launcher import LocalLauncher
from cluster.router import POLICIES, Router
from cluster.service import RouterService
from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.default_model import default_model_path
from engine.serving import QueueFullError
from scheduler.roofline import emulated_latency_model
from scheduler.tiers import Tier, TierSet

TIERS = TierSet([Tier("interactive", 60, 2000), Tier("batch", 200, 8000)])  # TPOT ms, TTFT ms, at time scale 1


class TimedService(RouterService):
    """Notes when each instance joined and streamed its first token, and which streams migrated."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ready_at: dict[str, float] = {}
        self.first_token_at: dict[str, float] = {}
        self.migrated: set[str] = set()
        self.from_spare: set[str] = set()

    async def _launch(self, instance_id, now, address=None) -> None:
        if address is not None:
            self.from_spare.add(instance_id)
        await super()._launch(instance_id, now, address)

    def _ready(self, link) -> None:
        self.ready_at[link.instance_id] = self.clock()
        super()._ready(link)

    def _on_message(self, link, msg) -> None:
        if isinstance(msg, p.Tokens) and link.instance_id not in self.first_token_at:
            self.first_token_at[link.instance_id] = self.clock()
        super()._on_message(link, msg)

    def _migrate(self, s, instance_id, reason, now) -> None:
        self.migrated.add(s.routed.request_id)
        super()._migrate(s, instance_id, reason, now)


@dataclass(slots=True)
class Stream:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    times: list[float] = field(default_factory=list)  # when each output with tokens reached the client
    finish_reason: str | None = None
    error: str | None = None


def workload(tokenizer, n: int, rate: float, seed: int) -> list[tuple[float, list[int], SamplingParams, int]]:
    """(send offset s, prompt ids, params, tier index) per request."""
    rng = random.Random(seed)
    words = tokenizer.encode("the router places every request on the busiest engine that can still meet its "
                             "latency target and moves a stream to another engine when its own one fails")
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        length = rng.randint(20, 400)
        prompt = [words[rng.randrange(len(words))] for _ in range(length)]
        out.append((t, prompt, SamplingParams(temperature=0, max_tokens=rng.randint(40, 200)), rng.randrange(2)))
    return out


async def run(args, model: str, spares: int, requests) -> dict:
    tiers = TierSet([Tier(t.name, t.tpot_ms * args.time_scale, t.ttft_ms * args.time_scale) for t in TIERS])
    limits = ScalingLimits(min_instances=args.instances, max_instances=args.instances, idle_pool=0)
    router = Router(tiers, emulated_latency_model(args.time_scale), policy=args.router_policy,
                    autoscaler=Autoscaler(limits))
    launcher = LocalLauncher(EngineConfig(model=model, executor="emulated", time_scale=args.time_scale),
                             warm_spares=spares)
    service = TimedService(router, launcher=launcher, heartbeat_timeout_s=3.0)
    fleet = router.fleet
    await service.start()
    try:
        while fleet.count(InstanceStatus.READY) < args.instances or len(launcher.spares) < spares \
                or not all(launcher.spares.values()):
            await asyncio.sleep(0.05)
        streams = [Stream() for _ in requests]
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def client(i: int) -> None:
            offset, prompt, params, tier = requests[i]
            await asyncio.sleep(max(0.0, start + offset - loop.time()))
            s = streams[i]
            try:
                async for out in service.generate(f"r{i}", prompt, params, tiers[tier].name, tiers[tier].slo,
                                                  loop.time()):
                    if out.new_token_ids:
                        s.times.append(loop.time())
                    s.token_ids += out.new_token_ids
                    s.text += out.new_text
                    if out.finished:
                        s.finish_reason, s.error = out.finish_reason, out.error
            except QueueFullError as e:
                s.finish_reason, s.error = "refused", str(e)
            except Exception as e:  # any other exception is an error the client sees
                s.finish_reason, s.error = "error", f"{type(e).__name__}: {e}"

        tasks = [asyncio.create_task(client(i)) for i in range(len(requests))]
        kills = []  # (victim, its streams under way, when, the instances that had joined before)
        for k in range(args.kills):
            await asyncio.sleep(max(0.0, start + requests[len(requests) * (k + 1) // (args.kills + 2)][0]
                                    - loop.time()))
            under_way = {v: sum(1 for s in service.streams.values() if s.routed.instance_id == v and s.started)
                         for v in fleet.instances if v in service.links}
            victim = max(under_way, key=under_way.get)
            kills.append((victim, under_way[victim], service.clock(), set(service.ready_at)))
            launcher.kill(victim)
        await asyncio.wait(tasks)
    finally:
        await service.stop()
    replacements, taken = [], set()
    for victim, under_way, killed_at, before in kills:  # its replacement: the first instance to join after it
        new = next((v for v in service.ready_at if v not in before and v not in taken), None)
        taken.add(new)
        first_token = service.first_token_at.get(new)
        replacements.append(Replacement(
            victim, under_way, new, new in service.from_spare,
            None if new is None else service.ready_at[new] - killed_at,
            None if first_token is None else first_token - killed_at))
    return streams, replacements, service


@dataclass(slots=True)
class Replacement:
    victim: str
    under_way: int  # its streams that had produced tokens when it was killed
    instance_id: str | None  # None: none joined before the load was over
    warm: bool  # it was a warm spare (else a cold start)
    ready_s: float | None  # kill -> the replacement joined the router
    first_token_s: float | None  # kill -> its first token; None: no request was placed on it


def report(spares: int, streams: list[Stream], replacements: list[Replacement], service: TimedService,
           want) -> None:
    n = len(streams)
    errors = sum(1 for s in streams if s.finish_reason == "error")
    refused = sum(1 for s in streams if s.finish_reason == "refused")
    lost = sum(1 for s in streams if s.finish_reason is None)
    completed = [i for i, s in enumerate(streams) if s.finish_reason in ("stop", "length")]
    differ = sum(1 for i in completed if (streams[i].token_ids, streams[i].text) != want[i])
    gaps = [b - a for s in streams for a, b in zip(s.times, s.times[1:])]
    migrated_gaps = [max(b - a for a, b in zip(s.times, s.times[1:])) for i, s in enumerate(streams)
                     if f"r{i}" in service.migrated and len(s.times) > 1]
    delays = sorted(service.migration_delays)
    print(f"\nwarm spares {spares}: {n} requests, {len(completed)} completed, {errors} errors, {refused} refused "
          f"(429), {lost} lost, {differ} texts differing from the undisturbed run")
    print(f"  migrations {service.counts['migrated']} (exhausted {service.counts['migrations_exhausted']}); "
          f"added delay (engine found dead -> next token) p50 {1000 * statistics.median(delays) if delays else 0:.0f} ms, "
          f"max {1000 * delays[-1] if delays else 0:.0f} ms; median token gap of all streams "
          f"{1000 * statistics.median(gaps):.1f} ms; longest gap of a migrated stream p50 "
          f"{1000 * statistics.median(migrated_gaps) if migrated_gaps else 0:.0f} ms, "
          f"max {1000 * max(migrated_gaps, default=0):.0f} ms")
    for r in replacements:
        ready = "none joined" if r.ready_s is None else f"joined {r.ready_s:.2f} s after the kill"
        first = "no request placed on it" if r.first_token_s is None else \
            f"first token {r.first_token_s:.2f} s after the kill"
        print(f"  killed {r.victim} ({r.under_way} streams under way): replacement {r.instance_id} "
              f"({'warm spare' if r.warm else 'cold start'}) {ready}, {first}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--rate", type=float, default=8.0, help="arrivals per second")
    ap.add_argument("--kills", type=int, default=1)
    ap.add_argument("--time-scale", type=float, default=4.0)
    ap.add_argument("--warm-spares", default="0,1", help="comma-separated: one run per value")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--router-policy", choices=POLICIES, default="polyserve",
                    help="polyserve packs the survivors first, so a replacement may get no request while they have "
                         "room; least-loaded places the next arrival on it at once, which times its first token")
    args = ap.parse_args(argv)
    model = default_model_path()
    offline = LLM(model, executor="emulated", step_time=lambda *_: 0.0)
    requests = workload(offline.tokenizer, args.requests, args.rate, args.seed)
    t0 = time.monotonic()
    want = [(o.token_ids, o.text) for o in offline.generate([r[1] for r in requests], [r[2] for r in requests])]
    print(f"undisturbed run of {len(requests)} requests (offline, emulated, no step time): "
          f"{time.monotonic() - t0:.1f} s")
    for spares in (int(x) for x in args.warm_spares.split(",")):
        report(spares, *asyncio.run(run(args, model, spares, requests)), want)


if __name__ == "__main__":
    main()
