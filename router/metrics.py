"""Prometheus metrics of one router, on its own CollectorRegistry (several routers can share a process)."""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .cluster import Cluster
from .policy import Decision

from .names import METRIC_PREFIX as P


class RouterMetrics:
    def __init__(self, window: int = 1000) -> None:
        r = self.registry = CollectorRegistry()
        self.decisions = Counter(P + "decisions", "routing decisions", ["route", "reason"], registry=r)
        self.fetches = Counter(P + "prefix_fetch_decisions", "decisions whose prefill held less of the prompt than "
                               "the shared store: fetch (credited, loads it) or recompute (loading did not pay, "
                               "or the rule is scarce)", ["route", "outcome"], registry=r)
        self.fetch_tokens = Counter(P + "prefix_fetch_tokens", "prompt tokens credited as loaded from the shared "
                                    "store instead of computed", registry=r)
        self.fetch_bytes = Counter(P + "prefix_fetch_predicted_bytes", "bytes those loads move, as the cost "
                                   "model predicts them", registry=r)
        self.retries = Counter(P + "retries", "local retries after a failed attempt", ["reason"], registry=r)
        self.errors = Counter(P + "errors", "requests answered with an error", ["code"], registry=r)
        self.offload = Gauge(P + "offload_fraction", f"fraction of the last {window} decisions sent to PrfaaS",
                             registry=r)
        self.queued = Gauge(P + "pool_queued_tokens", "queued uncached tokens per pool", ["pool"], registry=r)
        self.inflight = Gauge(P + "pool_inflight", "requests in flight from this router per pool", ["pool"],
                              registry=r)
        self.healthy = Gauge(P + "pool_healthy_instances", "healthy instances per pool", ["pool"], registry=r)
        self.link_bytes = Gauge(P + "link_bytes_in_flight", "estimated KV bytes being transferred", registry=r)
        self.link_queued = Gauge(P + "link_bytes_queued", "KV bytes of remote requests not yet in prefill",
                                 registry=r)
        self.link_util = Gauge(P + "link_utilization", "link pressure: max(backlog drain time, queue delay) / budget",
                               registry=r)
        self.link_goodput = Gauge(P + "link_goodput_bps", "measured transport goodput (bits/s)", registry=r)
        self.link_bytes_total = Counter(P + "link_bytes", "KV bytes the transports acknowledged, from their "
                                        "counters (rate() of it is the link's goodput between scrapes)", registry=r)
        self.link_capacity = Gauge(P + "link_capacity_bps", "configured inter-DC link capacity (bits/s)", registry=r)
        self._link_bytes_exported = 0
        self.link_delay = Gauge(P + "link_queue_delay_seconds", "measured transport queue delay", registry=r)
        self.link_stats_ok = Gauge(P + "link_stats_ok", "1 if the last transport stats poll gave usable numbers",
                                   registry=r)
        self.poll_errors = Gauge(P + "poll_errors", "failed load / link-stats polls since start", ["kind"],
                                 registry=r)
        self.threshold = Gauge(P + "threshold_tokens", "current incremental-length threshold t", registry=r)
        self.split = Gauge(P + "recommended_instances", "controller's recommended instance split", ["role"],
                           registry=r)
        self.controller_actions = Counter(P + "controller_actions", "prefill/decode split actions by actuator and "
                                          "outcome (a switch counts in_progress, then applied or failed)",
                                          ["actuator", "outcome", "reason"], registry=r)
        self.planner_offload = Gauge(P + "planner_offload_fraction", "offload fraction at the controller's optimal t "
                                     "(NaN until its first update)", registry=r)
        self.planner_offload.set(float("nan"))  # NaN, not 0: "offload far from the optimum" must not fire without one
        self.ttft = Histogram(P + "ttft_seconds", "arrival to decode's first bytes (whole answer if not streaming), "
                              "by the route that served", ["route"], registry=r,
                              buckets=(.05, .1, .25, .5, 1, 2, 5, 10, 20, 30, 60, 120))
        self.overhead = Histogram(P + "overhead_seconds", "request arrival to forward (parse, tokenize, route)",
                                  buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2), registry=r)
        self.breaker_opened = Counter(P + "breaker_opened", "times an instance's circuit breaker opened: attempts "
                                      "failed through it --breaker-failures times in a row", ["instance"], registry=r)
        self.breaker_open = Gauge(P + "breaker_open", "1 while an instance's breaker keeps it out of rotation "
                                  "(open, or half-open waiting for a trial's verdict)", ["instance"], registry=r)
        self.window: deque[bool] = deque(maxlen=window)
        self.remote_in_window = 0

    def record(self, d: Decision) -> None:
        self.decisions.labels(d.route, d.reason).inc()
        if d.fetch:
            self.fetches.labels(d.route, d.fetch).inc()
            self.fetch_tokens.inc(d.fetched_len)
            self.fetch_bytes.inc(d.fetch_bytes)
        remote = d.route == "prfaas"
        if len(self.window) == self.window.maxlen:
            self.remote_in_window -= self.window[0]
        self.window.append(remote)
        self.remote_in_window += remote
        self.offload.set(self.remote_in_window / len(self.window))

    def render(self, cluster: Cluster, threshold: int, budget_s: float) -> bytes:
        """Refresh the gauges that are cheaper to compute on scrape than on every request."""
        for pool in ("prfaas", "local_prefill", "decode"):
            insts = cluster.pool(pool)
            self.queued.labels(pool).set(sum(max(i.server_queued_tokens, i.inflight_tokens) for i in insts))
            self.inflight.labels(pool).set(sum(i.inflight for i in insts))
            self.healthy.labels(pool).set(sum(i.healthy for i in insts))
        now = time.monotonic()
        for inst in cluster.instances.values():
            self.breaker_open.labels(inst.name).set(inst.breaker.state(now) != "closed")
        link = cluster.link
        view = link.view(time.monotonic())
        self.link_bytes.set(view.bytes_in_flight)
        self.link_queued.set(view.bytes_queued)
        self.link_util.set(view.pressure(budget_s))
        self.link_goodput.set(link.goodput_bps)
        self.link_bytes_total.inc(link.rates.bytes_seen - self._link_bytes_exported)
        self._link_bytes_exported = link.rates.bytes_seen
        self.link_capacity.set(link.capacity_bps)
        self.link_delay.set(link.queue_delay_s)
        self.link_stats_ok.set(link.stats_ok)
        for kind, n in cluster.poll_errors.items():  # a counter kept by the poller; exported as its current value
            self.poll_errors.labels(kind).set(n)
        self.threshold.set(threshold)
        return generate_latest(self.registry)
