"""Prometheus metrics of one HTTP server. Each app owns its registry, so several apps live in one process (tests).

The HTTP layer records what a client sees (TTFT, inter-token latency, per-request TPOT, SLO attainment per tier,
measured on the server's receive clock of each output); the backend records what only it knows (queue time,
iteration time, batch size, KV use, running and waiting requests, instances per tier) through the same object.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from scheduler.attainment import RequestLatency

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5,
                   10.0, 20.0, 30.0, 60.0)
STEP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
ATTAINMENT_VIEWS = ("cumulative", "mean_tpot", "max_gap")  # scheduler.attainment's three views (DESIGN.md §1)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = r = CollectorRegistry()
        # ---- per request, by tier: recorded by the HTTP layer --------------------------------------------------
        self.ttft = Histogram("polyserve_time_to_first_token_seconds", "Arrival to first output token",
                              ["tier"], buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("polyserve_inter_token_latency_seconds", "Gap between consecutive output "
                                     "tokens of a request", ["tier"], buckets=STEP_BUCKETS, registry=r)
        self.tpot = Histogram("polyserve_request_tpot_seconds", "Mean time per output token after the first, per "
                              "request", ["tier"], buckets=STEP_BUCKETS, registry=r)
        self.slo_requests = Counter("polyserve_slo_requests", "Finished requests measured against their SLO",
                                    ["tier"], registry=r)
        self.slo_attained = Counter("polyserve_slo_attained", "Finished requests that attained their SLO, "
                                    "under each view", ["tier", "view"], registry=r)
        self.prompt_tokens = Counter("polyserve_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("polyserve_generation_tokens", "Output tokens sent", registry=r)
        self.finished = Counter("polyserve_requests_finished", "Requests that ended, by reason", ["reason"],
                                registry=r)
        self.http_requests = Counter("polyserve_http_requests", "HTTP requests answered", ["endpoint", "status"],
                                     registry=r)
        # ---- set by the backend ------------------------------------------------------------------------------
        self.queue_time = Histogram("polyserve_request_queue_time_seconds", "Arrival to first scheduled step",
                                    ["tier"], buckets=LATENCY_BUCKETS, registry=r)
        self.iteration_time = Histogram("polyserve_iteration_time_seconds", "Measured time of one engine step",
                                        ["instance"], buckets=STEP_BUCKETS, registry=r)
        self.batch_size = Histogram("polyserve_batch_size", "Sequences in one engine step", ["instance"],
                                    buckets=BATCH_BUCKETS, registry=r)
        self.kv_usage = Gauge("polyserve_kv_cache_usage_ratio", "Fraction of KV blocks in use", ["instance"],
                              registry=r)
        self.running = Gauge("polyserve_requests_running", "Requests in the running batch", ["instance"], registry=r)
        self.waiting = Gauge("polyserve_requests_waiting", "Requests waiting for admission", ["instance"],
                             registry=r)
        self.instances = Gauge("polyserve_instances", "Instances serving each tier", ["tier"], registry=r)

    # ---- HTTP layer -----------------------------------------------------------------------------------------
    def observe_finished(self, tier: str, latency: RequestLatency | None, token_gaps: list[float],
                         reason: str) -> None:
        """One request's end; `latency` is None when it produced no token (nothing to measure)."""
        self.finished.labels(reason).inc()
        if latency is None:
            return
        self.ttft.labels(tier).observe(latency.ttft)
        itl = self.inter_token.labels(tier)
        for gap in token_gaps:
            itl.observe(gap)
        if latency.mean_tpot is not None:
            self.tpot.labels(tier).observe(latency.mean_tpot)
        self.slo_requests.labels(tier).inc()
        for view, hit in zip(ATTAINMENT_VIEWS, (latency.attained, latency.attained_mean_tpot,
                                                latency.attained_max_gap)):
            self.slo_attained.labels(tier, view).inc(hit)

    # ---- backend hooks --------------------------------------------------------------------------------------
    def observe_queue_time(self, tier: str, seconds: float) -> None:
        self.queue_time.labels(tier).observe(seconds)

    def observe_batch(self, instance: str, num_seqs: int) -> None:
        self.batch_size.labels(instance).observe(num_seqs)

    def observe_step(self, instance: str, duration_s: float, kv_usage: float, num_running: int,
                     num_waiting: int) -> None:
        self.iteration_time.labels(instance).observe(duration_s)
        self.observe_load(instance, kv_usage, num_running, num_waiting)

    def observe_load(self, instance: str, kv_usage: float, num_running: int, num_waiting: int) -> None:
        """What an instance holds now: after each step, and after what changed it with no step to follow (an
        abort, the last finish), so that an idle instance does not show its last busy step."""
        self.kv_usage.labels(instance).set(kv_usage)
        self.running.labels(instance).set(num_running)
        self.waiting.labels(instance).set(num_waiting)

    def set_instances(self, tier: str, count: int) -> None:
        self.instances.labels(tier).set(count)

    def forget_instance(self, instance: str) -> None:
        """Drops a released instance's gauges and histograms so /metrics stops showing stale values."""
        for metric in (self.iteration_time, self.batch_size, self.kv_usage, self.running, self.waiting):
            try:
                metric.remove(instance)
            except KeyError:
                pass

    def render(self) -> bytes:
        return generate_latest(self.registry)
