"""Link telemetry per destination: goodput over sliding windows, bytes in flight, queue delay,
transfer latency, failures. Read as a JSON snapshot (`GET /stats`) or as Prometheus metrics.

Written by the transport's loop thread, read by HTTP / router threads: every access holds the lock.
A destination's entry (and its Prometheus series) is dropped when its link closes, or, for one that
never had a link (refused peers), once idle; what it counted stays in the totals ("retired"), so the
sums a reader rates (bytes, transfers, failures) never go down.
"""

from __future__ import annotations

import collections
import hmac
import ipaddress
import json
import threading
import time
from collections.abc import Callable

import prometheus_client as prom
from prometheus_client.core import Metric

from prfaas_sgl.transfer.stats_http import HttpServer, Request, Response

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
        self.last_event = time.monotonic()  # any send, ack, done or failure: idle entries are pruned
        self._m = metrics

    def on_send(self, nbytes: int, queued_s: float) -> None:
        with self._lock:
            self.last_event = time.monotonic()
            self.inflight += nbytes
            self.max_inflight = max(self.max_inflight, self.inflight)
            self._queue_delay.append(queued_s)
        self._m.inflight.labels(self.peer).set(self.inflight)
        self._m.queue_delay.labels(self.peer).observe(queued_s)

    def on_ack(self, nbytes: int, now: float) -> None:
        with self._lock:
            self.last_event = now
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
            self.last_event = time.monotonic()
            self.done += 1
            self._latency.append(latency_s)
        self._m.latency.labels(self.peer).observe(latency_s)

    def on_failure(self, kind: str) -> None:
        with self._lock:
            self.last_event = time.monotonic()
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
        # counter and histogram samples of dropped peers, by (sample name, labels but peer)
        self._retired: collections.Counter[tuple[str, tuple]] = collections.Counter()
        self._lock = threading.Lock()  # retire() vs aggregate_exposition(): no sample counted twice

    def exposition(self) -> bytes:
        return prom.generate_latest(self.registry)

    def aggregate_exposition(self) -> bytes:
        """The same metrics summed over peers (no peer label), dropped peers included."""
        with self._lock:
            return prom.generate_latest(_Collapsed(self.registry, dict(self._retired)))

    def retire(self, peer: str, kinds: list[str]) -> None:
        """Drop `peer`'s series; its counts stay in the aggregate."""
        with self._lock:
            for fam in self.registry.collect():
                if fam.type not in ("counter", "histogram"):
                    continue
                for smp in fam.samples:
                    if smp.labels.get("peer") == peer and not smp.name.endswith("_created"):
                        self._retired[(smp.name, _but_peer(smp.labels))] += smp.value
            for metric in (self.bytes, self.inflight, self.queue_delay, self.latency):
                _remove(metric, peer)
            for kind in kinds:
                _remove(self.failures, peer, kind)


def _but_peer(labels: dict[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in labels.items() if k != "peer"))


def _remove(metric: prom.metrics.MetricWrapperBase, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass  # never observed for this peer


class _Collapsed:
    """A registry view with every family's samples summed over the peer label (and `retired` added)."""

    _SUFFIXES = ("", "_total", "_bucket", "_count", "_sum")

    def __init__(self, registry: prom.CollectorRegistry, retired: dict[tuple[str, tuple], float]) -> None:
        self._registry, self._retired = registry, retired

    def collect(self):
        for fam in self._registry.collect():
            sums: dict[tuple[str, tuple], float] = {}
            for smp in fam.samples:
                if not smp.name.endswith("_created"):  # a creation time cannot be summed
                    key = (smp.name, _but_peer(smp.labels))
                    sums[key] = sums.get(key, 0.0) + smp.value
            names = {fam.name + x for x in self._SUFFIXES}
            for key, value in self._retired.items():
                if key[0] in names:
                    sums[key] = sums.get(key, 0.0) + value
            out = Metric(fam.name, fam.documentation, fam.type)
            for (name, labels), value in sums.items():
                out.add_sample(name, dict(labels), value)
            yield out


class StatsBook:
    """All destinations' LinkStats of one transport."""

    def __init__(self) -> None:
        self.metrics = PromMetrics()
        self._links: dict[str, LinkStats] = {}
        self._lock = threading.Lock()
        self._retired = {"bytes_total": 0, "transfers_done": 0}
        self._retired_failures: collections.Counter[str] = collections.Counter()
        self._layerwise: collections.Counter[str] = collections.Counter()  # layer-group streaming events
        self._sections: dict[str, Callable[[], dict]] = {}  # more top-level keys of both snapshots, read then

    def count(self, name: str, n: int = 1) -> None:
        """Layer-group streaming counters (`layerwise` in both snapshots), e.g. gates opened in a forward."""
        with self._lock:
            self._layerwise[name] += n

    def layerwise(self) -> dict[str, int]:
        with self._lock:
            return dict(self._layerwise)

    def add_section(self, name: str, read: Callable[[], dict]) -> None:
        """Serve ``read()`` (called on the stats thread at each request; thread-safe) as key ``name``."""
        with self._lock:
            self._sections[name] = read

    def _extra(self) -> dict:
        with self._lock:
            sections = dict(self._sections)
        return {"layerwise": self.layerwise(), **{name: read() for name, read in sections.items()}}

    def link(self, peer: str) -> LinkStats:
        with self._lock:
            if peer not in self._links:
                self._links[peer] = LinkStats(peer, self.metrics)
            return self._links[peer]

    def drop(self, peer: str) -> None:
        """Forget `peer` (its link closed): its entry and Prometheus series go, its counts stay in the sums."""
        with self._lock:
            s = self._links.pop(peer, None)
            if s is None:
                return
            with s._lock:
                self._retired["bytes_total"] += s.bytes_total
                self._retired["transfers_done"] += s.done
                self._retired_failures.update(s.failures)
                kinds = list(s.failures)
            self.metrics.retire(peer, kinds)

    def prune(self, live: set[str], now: float, idle_s: float) -> None:
        """Drop entries with no link in `live` and no event for `idle_s` (refused peers never get a link)."""
        with self._lock:
            stale = [p for p, s in self._links.items() if p not in live and now - s.last_event >= idle_s]
        for peer in stale:
            self.drop(peer)

    def snapshot(self) -> dict:
        """``time_s`` (this process's monotonic clock) lets a reader turn ``bytes_total`` into a rate over the
        transport's own interval, not over its poll's arrival times, which a loaded link or host jitters."""
        with self._lock:
            links = list(self._links.values())
        now = time.monotonic()
        return {"time_s": now, "links": {s.peer: s.snapshot(now) for s in links}, **self._extra()}

    def aggregate_snapshot(self) -> dict:
        """`snapshot()` with every destination summed into one link named "*" (no peer addresses); what
        a router reads from it (goodput, queue delay, bytes_total) is the same sum."""
        with self._lock:
            links = list(self._links.values())
            retired, failures = dict(self._retired), collections.Counter(self._retired_failures)
        now = time.monotonic()
        snaps = [s.snapshot(now) for s in links]
        for snap in snaps:
            failures.update(snap["failures"])
        windows = {f"{w:g}s": sum(x["goodput_bps"][f"{w:g}s"] for x in snaps) for w in WINDOWS_S}
        return {"time_s": now, "links": {"*": {
            "peer": "*",
            "bytes_total": retired["bytes_total"] + sum(x["bytes_total"] for x in snaps),
            "goodput_bps": windows,
            "bytes_in_flight": sum(x["bytes_in_flight"] for x in snaps),
            "max_bytes_in_flight": max((x["max_bytes_in_flight"] for x in snaps), default=0),
            "queue_delay_s": _merged([x["queue_delay_s"] for x in snaps]),
            "transfer_latency_s": _merged([x["transfer_latency_s"] for x in snaps]),
            "transfers_done": retired["transfers_done"] + sum(x["transfers_done"] for x in snaps),
            "failures": dict(failures),
        }}, **self._extra()}


def _merged(summaries: list[dict]) -> dict:
    n = sum(x["n"] for x in summaries)
    return {"n": n, "mean": sum(x["n"] * x["mean"] for x in summaries if x["n"]) / n} if n else {"n": 0}


class StatsServer:
    """`GET /stats` (JSON) and `GET /metrics` (Prometheus text), bounded (see `stats_http.HttpServer`).

    `host` is the address to bind (flag `--prfaas-zmq-stats-host`): loopback by default; a router in the
    other datacenter needs the prefill's routable address, or "0.0.0.0" / "::".
    Who sees what: with a `token`, every request needs `Authorization: Bearer <token>` (else 401) and
    gets everything. Without one, clients on this machine (loopback) get everything, others get the
    sums over destinations (`aggregate_snapshot`, metrics without the peer label): what the router and
    the dashboards read, and never the decodes' data endpoints (whom this prefill feeds, where to aim).
    """

    def __init__(self, book: StatsBook, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 timeout_s: float = 5.0, max_conns: int = 64) -> None:
        self._book, self._token = book, token
        self._http = HttpServer(host, port, self.respond, "transfer-stats", timeout_s, max_conns)
        self.host, self.port = host, self._http.port

    @property
    def url(self) -> str:
        """What to give the router as `--transport-stats-url` (with the bound host; a wildcard needs the
        machine's routable address instead)."""
        host = f"[{self.host}]" if _is_v6(self.host) else self.host
        return f"http://{host}:{self.port}/stats"

    @property
    def fatal(self) -> str | None:
        return self._http.fatal

    @property
    def open_connections(self) -> int:
        return self._http.open_connections

    def close(self) -> None:
        self._http.close()

    def respond(self, req: Request) -> Response:
        """The answer to one request (called on the server thread; `req.local`: the client is on this machine)."""
        if self._token is not None and not _bearer_ok(req.headers.get("authorization", ""), self._token):
            return Response(401, "text/plain", b"stats token required\n", (("WWW-Authenticate", "Bearer"),))
        full = self._token is not None or req.local
        if req.path == "/stats":
            snap = self._book.snapshot() if full else self._book.aggregate_snapshot()
            return Response(200, "application/json", json.dumps(snap).encode())
        if req.path == "/metrics":
            m = self._book.metrics
            return Response(200, prom.CONTENT_TYPE_LATEST, m.exposition() if full else m.aggregate_exposition())
        return Response(404, "text/plain", b"try /stats or /metrics\n")


def _bearer_ok(header: str, token: str) -> bool:
    return hmac.compare_digest(header.encode("utf-8", "replace"), f"Bearer {token}".encode())


def _is_v6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False  # a host name: resolved as IPv4
