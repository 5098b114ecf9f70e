"""Link telemetry per destination: goodput over sliding windows, bytes in flight, queue delay,
transfer latency, failures. Read as a JSON snapshot (`GET /stats`) or as Prometheus metrics.

Written by the transport's loop thread, read by HTTP / router threads: every access holds the lock.
"""

from __future__ import annotations

import collections
import ipaddress
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import prometheus_client as prom

WINDOWS_S = (1.0, 10.0)
_KEEP_S = max(WINDOWS_S)
_MAX_EVENTS = 100_000  # bounds memory if acks are tiny and frequent
_LATENCY_SAMPLES = 256


class LinkStats:
    """Counters of one destination (`peer` = "host:port"). Times are time.monotonic() seconds."""

    def __init__(self, peer: str, metrics: "PromMetrics") -> None:
        self.peer = peer
        self._lock = threading.Lock()
        self._acks: collections.deque[tuple[float, int]] = collections.deque(maxlen=_MAX_EVENTS)
        self._latency: collections.deque[float] = collections.deque(maxlen=_LATENCY_SAMPLES)
        self._queue_delay: collections.deque[float] = collections.deque(maxlen=_LATENCY_SAMPLES)
        self.bytes_total = 0
        self.inflight = 0
        self.max_inflight = 0
        self.done = 0
        self.failures: dict[str, int] = {}
        self._m = metrics

    def on_send(self, nbytes: int, queued_s: float) -> None:
        with self._lock:
            self.inflight += nbytes
            self.max_inflight = max(self.max_inflight, self.inflight)
            self._queue_delay.append(queued_s)
        self._m.inflight.labels(self.peer).set(self.inflight)
        self._m.queue_delay.labels(self.peer).observe(queued_s)

    def on_ack(self, nbytes: int, now: float) -> None:
        with self._lock:
            self.inflight -= nbytes
            self.bytes_total += nbytes
            self._acks.append((now, nbytes))
        self._m.bytes.labels(self.peer).inc(nbytes)
        self._m.inflight.labels(self.peer).set(self.inflight)

    def forget_inflight(self, nbytes: int) -> None:
        """Chunks of a failed transfer will never be acknowledged: stop counting them in flight."""
        with self._lock:
            self.inflight -= nbytes
        self._m.inflight.labels(self.peer).set(self.inflight)

    def on_done(self, latency_s: float) -> None:
        with self._lock:
            self.done += 1
            self._latency.append(latency_s)
        self._m.latency.labels(self.peer).observe(latency_s)

    def on_failure(self, kind: str) -> None:
        with self._lock:
            self.failures[kind] = self.failures.get(kind, 0) + 1
        self._m.failures.labels(self.peer, kind).inc()

    def snapshot(self, now: float | None = None) -> dict:
        now = time.monotonic() if now is None else now
        with self._lock:
            while self._acks and self._acks[0][0] < now - _KEEP_S:
                self._acks.popleft()
            goodput = {f"{w:g}s": _rate_bits(self._acks, now, w) for w in WINDOWS_S}
            return {
                "peer": self.peer,
                "bytes_total": self.bytes_total,
                "goodput_bps": goodput,
                "bytes_in_flight": self.inflight,
                "max_bytes_in_flight": self.max_inflight,
                "queue_delay_s": _summary(self._queue_delay),
                "transfer_latency_s": _summary(self._latency),
                "transfers_done": self.done,
                "failures": dict(self.failures),
            }


def _rate_bits(acks: collections.deque[tuple[float, int]], now: float, window: float) -> float:
    return 8.0 * sum(n for t, n in acks if t >= now - window) / window


def _summary(xs: collections.deque[float]) -> dict:
    if not xs:
        return {"n": 0}
    s = sorted(xs)
    return {"n": len(s), "mean": sum(s) / len(s), "p50": s[len(s) // 2], "p90": s[int(0.9 * (len(s) - 1))]}


class PromMetrics:
    """Prometheus metrics on a private registry (several transports may live in one process)."""

    def __init__(self, prefix: str = "prfaas_transfer") -> None:
        self.registry = prom.CollectorRegistry()
        r = self.registry
        self.bytes = prom.Counter(f"{prefix}_acked_bytes", "payload bytes acknowledged", ["peer"], registry=r)
        self.inflight = prom.Gauge(f"{prefix}_bytes_in_flight", "unacknowledged bytes", ["peer"], registry=r)
        self.queue_delay = prom.Histogram(f"{prefix}_queue_delay_seconds", "chunk wait before send",
                                          ["peer"], registry=r)
        self.latency = prom.Histogram(f"{prefix}_transfer_seconds", "first send to Done", ["peer"],
                                      registry=r, buckets=(.01, .05, .1, .25, .5, 1, 2, 5, 10, 30, 60))
        self.failures = prom.Counter(f"{prefix}_failures", "failed transfers", ["peer", "kind"], registry=r)
        # Read on scrape (set_function by the loop's owner): a dead loop fails every transfer while the process
        # may still answer HTTP, so it must be visible apart from the server's /health.
        self.loop_alive = prom.Gauge(f"{prefix}_loop_alive", "1 while the transport's loop thread runs", registry=r)

    def exposition(self) -> bytes:
        return prom.generate_latest(self.registry)


class StatsBook:
    """All destinations' LinkStats of one transport."""

    def __init__(self) -> None:
        self.metrics = PromMetrics()
        self._links: dict[str, LinkStats] = {}
        self._lock = threading.Lock()

    def link(self, peer: str) -> LinkStats:
        with self._lock:
            if peer not in self._links:
                self._links[peer] = LinkStats(peer, self.metrics)
            return self._links[peer]

    def snapshot(self) -> dict:
        """``time_s`` (this process's monotonic clock) lets a reader turn ``bytes_total`` into a rate over the
        transport's own interval, not over its poll's arrival times, which a loaded link or host jitters."""
        with self._lock:
            links = list(self._links.values())
        now = time.monotonic()
        return {"time_s": now, "links": {s.peer: s.snapshot(now) for s in links}}


class StatsServer:
    """`GET /stats` (JSON) and `GET /metrics` (Prometheus text) on a daemon thread.

    `host` is the address to bind (flag `--prfaas-zmq-stats-host`): loopback by default; a router in the
    other datacenter needs the prefill's routable address, or "0.0.0.0" / "::". The endpoint is read-only
    and unauthenticated (it shows peer addresses and byte counts): expose it to the router's network only.
    """

    def __init__(self, book: StatsBook, host: str = "127.0.0.1", port: int = 0) -> None:
        handler = type("Handler", (_Handler,), {"book": book})
        self._httpd = (_ServerV6 if _is_v6(host) else ThreadingHTTPServer)((host, port), handler)
        self.host, self.port = host, self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="transfer-stats", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """What to give the router as `--transport-stats-url` (with the bound host; a wildcard needs the
        machine's routable address instead)."""
        host = f"[{self.host}]" if _is_v6(self.host) else self.host
        return f"http://{host}:{self.port}/stats"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


class _ServerV6(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def _is_v6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False  # a host name: resolved as IPv4


class _Handler(BaseHTTPRequestHandler):
    book: StatsBook

    def do_GET(self) -> None:  # noqa: N802 (http.server naming)
        if self.path == "/stats":
            self._reply(200, "application/json", json.dumps(self.book.snapshot()).encode())
        elif self.path == "/metrics":
            self._reply(200, prom.CONTENT_TYPE_LATEST, self.book.metrics.exposition())
        else:
            self._reply(404, "text/plain", b"try /stats or /metrics\n")

    def _reply(self, code: int, ctype: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass  # the router polls often; access logs would drown real messages
