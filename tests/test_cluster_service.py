"""The router service with in-process engine workers behind the HTTP app: what the router knows of an instance once
its clients left and it went idle, and the parallel samples of one request on one instance."""
from __future__ import annotations

import json
import socket
import time
import urllib.request

from cluster.backend import RouterBackend
from cluster.fleet import InstanceStatus
from cluster.router import How, Router
from cluster.service import RouterService
from cluster.worker import Worker
from engine.api_server import ServerThread, build_app
from engine.config import EngineConfig
from engine.llm import build_engine
from scheduler.roofline import emulated_latency_model

WAIT_S = 30.0
GAUGES = ("polyserve_requests_running", "polyserve_requests_waiting", "polyserve_kv_cache_usage_ratio")


def emulated_engine(folder: str, step_s: float, **config):
    return build_engine(EngineConfig(model=folder, executor="emulated", num_kv_blocks=64, **config),
                        step_time=lambda *_: step_s)


def gauge(url: str, name: str, instance: str) -> float | None:
    text = urllib.request.urlopen(url + "/metrics", timeout=WAIT_S).read().decode()
    for line in text.splitlines():
        if line.startswith(f'{name}{{instance="{instance}"}} '):
            return float(line.split()[-1])
    return None


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class Fleet:
    """Workers in this process, attached to a router service served over HTTP."""

    def __init__(self, engines, heartbeat_s: float, heartbeat_timeout_s: float = 3.0, **router_options):
        self.service = RouterService(Router(engines[0].tiers, emulated_latency_model(), **router_options),
                                     heartbeat_timeout_s=heartbeat_timeout_s)
        self.workers = [Worker(e, instance_id=f"w{i}", token=self.service.token, heartbeat_s=heartbeat_s)
                        for i, e in enumerate(engines)]
        self.server = ServerThread(build_app(RouterBackend(self.service, "m", 1024, None)))
        for worker in self.workers:
            self.server.call(self.service.attach("127.0.0.1", self.server.call(worker.start())))

    def close(self) -> None:
        for worker in self.workers:
            self.server.call(worker.stop())
        self.server.close()


def test_an_instance_left_idle_by_aborts_shows_idle_in_the_router_and_on_metrics(llama_tiny):
    """One engine taking one request at a time; two streaming clients, one running and one waiting, leave. With no
    step to follow, the worker's word right after the aborts (its periodic one is a minute off) brings the router's
    view of the instance and the instance's /metrics gauges to idle, with no new request."""
    engine = emulated_engine(llama_tiny[0], 0.01, max_num_seqs=1)
    fleet = Fleet([engine], heartbeat_s=60.0, heartbeat_timeout_s=120.0)
    try:
        url, view = fleet.server.url, fleet.service.router.fleet["w0"]

        def gauges():
            return [gauge(url, g, "w0") for g in GAUGES]

        body = json.dumps({"prompt": list(range(1, 40)), "max_tokens": 500, "stream": True}).encode()
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        clients = [socket.create_connection(("127.0.0.1", fleet.server.port), timeout=WAIT_S) for _ in range(2)]
        for c in clients:
            c.sendall(request)
        wait_until(lambda: gauges()[:2] == [1, 1], "one running, one waiting")
        assert gauges()[2] > 0 and view.num_blocks_used > 0 and len(view.residents) == 2
        for c in clients:
            c.close()
        wait_until(lambda: gauges() == [0, 0, 0], "the gauges of an idle engine")
        wait_until(lambda: view.num_blocks_used == 0, "the router's view of its KV")
        assert (view.status, len(view.residents), view.kv_tokens, view.load) == (InstanceStatus.READY, 0, 0, 0.0)
        assert not engine.has_unfinished() and not fleet.service.streams
    finally:
        fleet.close()


def test_the_samples_of_one_request_run_on_one_instance_sharing_its_prompt_blocks(llama_tiny):
    """n = 3 through the router: three choices, all three samples placed together on one of two instances, where
    they run side by side on the prompt's blocks held once; the other instance runs nothing."""
    engines = [emulated_engine(llama_tiny[0], 0.02) for _ in range(2)]
    used_with_three = []  # KV blocks in use at every step that ran all three samples, on either engine
    for engine in engines:
        engine.step_hooks.append(lambda stats: stats.num_running == 3 and used_with_three.append(stats.num_blocks_used))
    fleet = Fleet(engines, heartbeat_s=0.2)
    try:
        prompt = list(range(100, 166))  # 4 full blocks of 16 and 2 tokens
        body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 40, "temperature": 1.0, "seed": 5, "n": 3,
                           "ignore_eos": True}).encode()
        reply = json.loads(urllib.request.urlopen(urllib.request.Request(
            fleet.server.url + "/v1/completions", body, {"Content-Type": "application/json"}), timeout=WAIT_S).read())
        assert sorted(c["index"] for c in reply["choices"]) == [0, 1, 2]
        assert all(c["finish_reason"] == "length" for c in reply["choices"])
        assert reply["usage"]["completion_tokens"] == 3 * 40
        placed = [e for e in fleet.service.router.events if e.kind in {h.value for h in How}]
        assert sorted(e.request_id for e in placed) == [f"{reply['id']}-{i}" for i in range(3)]
        (instance,) = {e.instance_id for e in placed}
        other = engines[1 - int(instance[1:])]
        assert other.num_steps == 0
        # each sample's own blocks are at most 3 (2 + 40 tokens), the prompt's 4 held once: three copies of the
        # prompt would take 15 blocks at least
        assert used_with_three and max(used_with_three) <= 4 + 3 * 3
    finally:
        fleet.close()


def test_the_reserve_a_router_places_a_request_with_reaches_its_engine(llama_tiny):
    """A router with token_reserve: the margin of the tier it holds the instance to rides the Submit, and the
    engine's batch policy reads it off the request."""
    engine = emulated_engine(llama_tiny[0], 0.01)
    reserves = set()
    engine.step_hooks.append(lambda stats: reserves.update(r.tpot_reserve for r in engine.running))
    fleet = Fleet([engine], heartbeat_s=0.2, token_reserve=True)
    try:
        for headroom in fleet.service.router.headroom:
            headroom.margin = 0.3
        body = json.dumps({"model": "m", "prompt": list(range(1, 30)), "max_tokens": 8, "ignore_eos": True}).encode()
        reply = json.loads(urllib.request.urlopen(urllib.request.Request(
            fleet.server.url + "/v1/completions", body, {"Content-Type": "application/json"}), timeout=WAIT_S).read())
        assert reply["usage"]["completion_tokens"] == 8
        assert reserves == {0.3}
    finally:
        fleet.close()
