"""`python -m cluster.serve`: the router, autoscaled engine processes and the OpenAI-compatible HTTP API.

    python -m cluster.serve --executor emulated --min-instances 2 --max-instances 8 --idle-pool 1 --warm-spares 1
    python -m cluster.serve --gpus 0,1,2,3 --device cuda --tiers tight:20:250,batch:250:5000
    python -m cluster.serve --host 0.0.0.0 --api-key secret --executor emulated  # clients: Bearer secret
    python -m cluster.serve --launcher ray --ray-address auto --device cuda --max-instances 64  # on a Ray cluster
    python -m cluster.serve --executor emulated --prefill-instances 1 --min-instances 2 --max-instances 4  # PD
    python -m cluster.serve --executor emulated --prefill-instances 1 --max-prefill-instances 3 --min-instances 2 \
        --max-instances 6  # PD, the prefill pool sized from its token rate

Engines are `python -m cluster.worker` processes started by the launcher, each built from the same engine flags
(`EngineConfig`, forwarded whole). The local launcher starts them on this machine: one per GPU with --gpus, else
(emulated engines, or CPU model engines) as many as the limits allow. The Ray launcher starts each as a Ray actor
holding one GPU (a CPU share for emulated and CPU engines) on any machine of the Ray cluster at --ray-address (none:
a local one is started), which Ray picks. The router proves a shared secret to every worker it connects to: the
content of --cluster-token-file, else $POLYSERVE_CLUSTER_TOKEN, else a random one made for this fleet. The router
predicts iteration times with the engines' latency model: --latency-profile, else the roofline of Llama-3.1-8B on an
H200 (what an emulated engine sleeps), times --time-scale. Baseline router policies serve a fixed fleet of
--min-instances. The HTTP flags (--host, --api-key, ...) are engine.serve's; the router talks to its engines over the
cluster protocol, which the API key does not cover and which is not encrypted: bind workers (--worker-host) to a
trusted network.

Prefill/decode disaggregation: with --prefill-instances N, both launchers start N engines with role prefill and the
rest with role decode (the engines' --role is theirs to set, so it is not a flag here). --min-instances and
--max-instances count all engines. The prefill pool holds N engines at least and --max-prefill-instances at most
(default N: a fixed pool): the autoscaler sizes it from the prompt tokens placed on it, ceil(rate x a prompt token's
predicted time / --prefill-utilisation), and stops a surplus prefill engine once it has been idle for
--stop-after-idle-s. The decode pool is sized from the tokens its engines decode, at the batch a decode engine's
TPOT allows (--decode-utilisation), its minimum being what --min-instances leaves beside N; both pools hold enough
engines that their KV links (one an engine, at --kv-link's rate) carry the hand-offs' bytes within
--transfer-utilisation; a tier's waiting request still starts a decode engine. A dead prefill engine is replaced by a
prefill engine. Warm spares are decode engines.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from cluster.autoscaler import Autoscaler, ScalingLimits
from cluster.backend import RouterBackend
from cluster.launcher import Launcher, LocalLauncher
from cluster.protocol import load_cluster_token
from cluster.router import POLICIES, Router
from cluster.service import RouterService
from engine.api_server import serve_forever
from engine.config import EngineConfig, add_engine_args
from engine.default_model import NAME as DEFAULT_MODEL_NAME
from engine.default_model import default_model_path
from engine.model_config import DTYPES, ModelConfig
from engine.serve import add_http_args, build_http_app
from engine.tokenizer import Tokenizer
from scheduler.roofline import emulated_latency_model
from scheduler.transfer import LINKS, TransferModel


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_http_args(ap)
    ap.add_argument("--router-policy", choices=POLICIES, default="polyserve")
    ap.add_argument("--min-instances", type=int, default=1)
    ap.add_argument("--max-instances", type=int, default=4)
    ap.add_argument("--idle-pool", type=int, default=1, help="warm idle instances to keep ready")
    ap.add_argument("--prefill-instances", type=int, default=0,
                    help="prefill/decode disaggregation: this many engines run prompts only and hand each request "
                         "off at its first token to the others, decode engines (default 0: every engine does "
                         "both); the prefill pool's minimum and starting size, counted in --min-instances, which "
                         "must leave a decode engine")
    ap.add_argument("--max-prefill-instances", type=int, default=None,
                    help="with --prefill-instances: the most prefill engines the autoscaler sizes the pool to from "
                         "its prompt token rate, below --max-instances (default: --prefill-instances, a fixed pool)")
    ap.add_argument("--prefill-utilisation", type=float, default=0.7,
                    help="with --prefill-instances: the share of its time a prefill engine is planned busy when the "
                         "pool is sized from its token rate")
    ap.add_argument("--decode-utilisation", type=float, default=0.8,
                    help="with --prefill-instances: the share of its TPOT-bound batch a decode engine is planned to "
                         "carry when the decode pool is sized from its decode token rate")
    ap.add_argument("--transfer-utilisation", type=float, default=0.5,
                    help="with --prefill-instances: the share of its bandwidth an engine's KV link is planned to "
                         "carry when the pools are sized from the hand-offs' byte rate")
    ap.add_argument("--prefill-rate-window-s", type=float, default=10.0,
                    help="with --prefill-instances: every stage's rate (prompt tokens placed, tokens decoded, KV "
                         "bytes handed off) is over this many seconds")
    ap.add_argument("--kv-link", choices=LINKS, default="net-400g",
                    help="with --prefill-instances: the link a hand-off's KV crosses, whose nominal rate the router "
                         "counts in a prompt's first-token deadline (scheduler/transfer.py)")
    ap.add_argument("--min-per-tier", type=int, default=0)
    ap.add_argument("--max-per-tier", type=int, default=None)
    ap.add_argument("--stop-after-idle-s", type=float, default=5.0,
                    help="an idle instance beyond the pool is stopped after this long")
    ap.add_argument("--queue-limit", type=int, default=256, help="requests waiting per tier before 429")
    ap.add_argument("--serve-late", action="store_true",
                    help="serve a queued request whose first token can no longer be on time (default: answer it "
                         "429 at once, keeping the capacity for requests still on time)")
    ap.add_argument("--costly-share", type=float, default=0.0,
                    help="share of each tier's requests that may be refused (429) for their cost while the fleet is "
                         "under pressure (a request waited in its queues within the longest expected stay) or when it "
                         "would queue: a prompt among its tier's costliest this share (scheduler/costly.py). Set it "
                         "to what a tier may miss beyond the latency margins' share, e.g. 0.08 where every tier is "
                         "held to 90 %% with margins at 0.02; while a tighter tier sheds, up to what the tier has "
                         "left of this share and the headroom target together; 0 refuses none for cost")
    ap.add_argument("--token-reserve", action="store_true",
                    help="have each engine keep, before each of a request's token deadlines, the share of its TPOT "
                         "that is the router's margin of the tier its instance is held to: for a fleet held to a "
                         "high attainment (e.g. 99 %% of all requests), where misses are dear; it takes prefill from "
                         "every step, so a fleet whose capacity binds serves less with it")
    ap.add_argument("--heartbeat-timeout-s", type=float, default=3.0)
    ap.add_argument("--warm-spares", type=int, default=None,
                    help="engine processes kept started but unattached, so that a replacement or a new instance "
                         "joins in about a connection's time instead of a cold start (default: 1 where a device is "
                         "left beyond --max-instances, or with no --gpus; with --gpus, spares and instances "
                         "together stay within the GPUs)")
    ap.add_argument("--max-migrations", type=int, default=2,
                    help="times a stream continues on another engine after its engine failed mid-stream; one more "
                         "failure ends it with an error")
    ap.add_argument("--gpus", default="", help="local launcher: comma-separated device ids, one engine each "
                                               "(default: none)")
    ap.add_argument("--launcher", choices=("local", "ray"), default="local",
                    help="local: engine processes on this machine; ray: Ray actors on the machines of a Ray cluster")
    ap.add_argument("--ray-address", default=None,
                    help="the Ray cluster to join: auto (the one this machine belongs to) or HOST:PORT (default: "
                         "start a local one)")
    ap.add_argument("--ray-worker-cpus", type=float, default=None,
                    help="CPU share each Ray actor asks for (default: 1 with a GPU or a CPU model, 0.25 emulated)")
    ap.add_argument("--ray-placement-timeout-s", type=float, default=30.0,
                    help="how long Ray may take to find room for a worker before the router stops asking for a "
                         "while; with a Ray autoscaler, longer than a machine takes to join")
    ap.add_argument("--worker-host", default=None,
                    help="the interface engine workers listen on (default: 127.0.0.1 locally; with Ray, each "
                         "machine's address as Ray knows it)")
    ap.add_argument("--cluster-token-file", default=None,
                    help="file holding the secret the router proves to its workers (default: "
                         "$POLYSERVE_CLUSTER_TOKEN, else a random one for this fleet)")
    add_engine_args(ap)
    return ap.parse_args(argv)


def build_backend(args: argparse.Namespace) -> RouterBackend:
    """Everything but the HTTP app: engine config, latency model, router, autoscaler, launcher, service, backend."""
    config = EngineConfig.from_args(args)
    check_prefill_instances(args, config)
    latency_model = config.known_latency_model() or emulated_latency_model(config.time_scale)
    baseline = args.router_policy != "polyserve"
    limits = ScalingLimits(
        min_instances=args.min_instances,
        max_instances=args.min_instances if baseline else args.max_instances,  # baselines: a fixed fleet
        idle_pool=0 if baseline else args.idle_pool, min_per_tier=0 if baseline else args.min_per_tier,
        max_per_tier=None if baseline else args.max_per_tier, stop_after_idle_s=args.stop_after_idle_s,
        min_prefill_instances=args.prefill_instances,
        max_prefill_instances=args.prefill_instances if baseline else args.max_prefill_instances,
        prefill_utilisation=args.prefill_utilisation, prefill_rate_window_s=args.prefill_rate_window_s,
        decode_utilisation=args.decode_utilisation, transfer_utilisation=args.transfer_utilisation)
    model = config.model or default_model_path()
    model_config = ModelConfig.from_folder(model)
    # the KV crosses in the serving dtype: a GPU's bf16 unless given (a CPU engine's float32 moves on loopback)
    kv_bytes = model_config.kv_bytes_per_token(DTYPES[config.dtype or "bfloat16"])
    transfer = TransferModel(LINKS[args.kv_link], kv_bytes) if args.prefill_instances else None
    router = Router(config.tier_set, latency_model, policy=args.router_policy, autoscaler=Autoscaler(limits),
                    queue_limit=args.queue_limit, shed_late=not args.serve_late, max_prefill_chunk=config.prefill_chunk,
                    transfer=transfer, headroom_target=config.headroom_target, costly_share=args.costly_share,
                    token_reserve=args.token_reserve)
    service = RouterService(router, launcher=build_launcher(args, config, limits.max_instances),
                            heartbeat_timeout_s=args.heartbeat_timeout_s, max_migrations=args.max_migrations)
    name = args.served_model_name or (Path(config.model).name if config.model else DEFAULT_MODEL_NAME)
    return RouterBackend(service, name, model_config.context_length(config.max_model_len), Tokenizer.of_folder(model))


def build_launcher(args: argparse.Namespace, config: EngineConfig, max_instances: int) -> Launcher:
    token = load_cluster_token(args.cluster_token_file)
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    if args.launcher == "ray":
        if gpus:
            raise ValueError("--gpus is for the local launcher: Ray gives each worker a GPU of its own")
        import ray

        from cluster.ray_launcher import RayLauncher, connect_ray

        if not ray.is_initialized():
            connect_ray(args.ray_address)
        return RayLauncher(config, token=token, host=args.worker_host, num_cpus=args.ray_worker_cpus,
                           placement_timeout_s=args.ray_placement_timeout_s, prefill_instances=args.prefill_instances,
                           warm_spares=warm_spares(args.warm_spares, max_instances, 0))
    if args.ray_address is not None or args.ray_worker_cpus is not None:
        raise ValueError("--ray-address and --ray-worker-cpus need --launcher ray")
    if gpus and max_instances > len(gpus):
        raise ValueError(f"--max-instances {max_instances} exceeds the {len(gpus)} GPUs of --gpus")
    return LocalLauncher(config, gpus=gpus, host=args.worker_host or "127.0.0.1", token=token,
                         prefill_instances=args.prefill_instances,
                         warm_spares=warm_spares(args.warm_spares, max_instances, len(gpus)))


def check_prefill_instances(args: argparse.Namespace, config: EngineConfig) -> None:
    """The launcher gives each engine its role: one role for all would leave requests no engine can finish."""
    if config.role != "both":
        raise ValueError(f"--role {config.role} would give every engine one role; use --prefill-instances N for N "
                         "prefill engines and decode engines for the rest")
    n = args.prefill_instances
    if n < 0 or (n and n >= args.min_instances):
        raise ValueError(f"--prefill-instances {n} must be non-negative and, when set, below --min-instances "
                         f"{args.min_instances}, which counts the prefill engines and at least one decode engine")
    most = args.max_prefill_instances
    if most is not None and (not n or not n <= most < args.max_instances):
        raise ValueError(f"--max-prefill-instances {most} needs --prefill-instances, at most it, and must be below "
                         f"--max-instances {args.max_instances}, which counts at least one decode engine")


def warm_spares(asked: int | None, max_instances: int, num_gpus: int) -> int:
    """The spares to keep: as asked (None: one), within the GPUs the instances leave (asked: an error past them)."""
    room = num_gpus - max_instances if num_gpus else None
    if asked is None:
        return 1 if room is None else min(1, room)
    if asked < 0 or (room is not None and asked > room):
        raise ValueError(f"--warm-spares {asked} must be non-negative and, with --gpus, leave a GPU for each of the "
                         f"--max-instances {max_instances}: {num_gpus} GPUs")
    return asked


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    backend = build_backend(args)
    app = build_http_app(backend, args)
    limits = backend.service.router.autoscaler.limits
    logging.getLogger(__name__).info("router policy %s, tiers %s, instances %d..%d (%d..%d prefill), idle pool %d, "
                                     "warm spares %d, executor %s, %s launcher", args.router_policy, args.tiers,
                                     limits.min_instances, limits.max_instances, limits.min_prefill_instances,
                                     limits.prefill_cap, args.idle_pool, backend.service.launcher.warm_spares,
                                     args.executor, args.launcher)
    asyncio.run(serve_forever(app, args.host, args.port))


if __name__ == "__main__":
    main()
