"""Read the router's Prometheus ``/metrics`` during a run: offload fraction and link utilization.

Metric names are configurable (:class:`RouterMetricNames`); the defaults are what ``router/metrics.py``
exports (the byte counter and capacity since the router reads the transports' counters; a missing one
falls back as below):

| default name | type | used for |
|---|---|---|
| ``prfaas_router_decisions_total{route="prfaas" or "local", reason}`` | counter | offload fraction = Δprfaas / Δall |
| ``prfaas_router_link_utilization`` | gauge | link utilization as the router defines it |
| ``prfaas_router_link_goodput_bps`` | gauge | link bits/s (when no byte counter) |
| ``prfaas_router_link_bytes_total`` | counter | link bits/s between scrapes, exact |
| ``prfaas_router_link_capacity_bps`` | gauge | utilization = bits/s / capacity, if no utilization gauge |

A missing metric yields ``None`` for what depends on it, never an error: the load generator also runs
against plain SGLang servers.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from prfaas_sgl.router import names


@dataclass(frozen=True, slots=True)
class RouterMetricNames:
    requests_total: str = names.DECISIONS
    route_label: str = "route"
    remote_route: str = names.REMOTE_ROUTE
    link_utilization: str = names.LINK_UTILIZATION
    link_bps: str = names.LINK_GOODPUT_BPS
    link_bytes_total: str = names.LINK_BYTES_TOTAL
    link_capacity_bps: str = names.LINK_CAPACITY_BPS


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_metrics(text: str) -> Samples:
    """Flatten exposition text to {(sample name, sorted labels): value}."""
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def total(samples: Samples, name: str, **labels: str) -> float | None:
    """Sum of ``name`` over samples whose labels include ``labels``; None when no sample matches."""
    want = set(labels.items())
    vals = [v for (n, lab), v in samples.items() if n == name and want <= set(lab)]
    return sum(vals) if vals else None


@dataclass(slots=True)
class Scrape:
    t_s: float  # seconds from the run's t0
    samples: Samples


@dataclass(slots=True)
class MetricsSampler:
    """Scrapes ``url`` every ``interval_s`` until stopped; failed scrapes are counted, not raised."""

    url: str
    names: RouterMetricNames = field(default_factory=RouterMetricNames)
    interval_s: float = 1.0
    scrapes: list[Scrape] = field(default_factory=list)
    failures: int = 0

    async def scrape_once(self, http: aiohttp.ClientSession, t0: float) -> None:
        try:
            async with http.get(self.url) as resp:
                text = await resp.text()
            self.scrapes.append(Scrape(time.perf_counter() - t0, parse_metrics(text)))
        except (aiohttp.ClientError, TimeoutError, ValueError):
            self.failures += 1

    async def run(self, http: aiohttp.ClientSession, t0: float, stop: asyncio.Event) -> None:
        """Scrape until ``stop`` is set, then once more. The caller takes the opening scrape itself,
        before sending anything, so the first-to-last deltas cover exactly the measured requests."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
            except TimeoutError:
                await self.scrape_once(http, t0)
        await self.scrape_once(http, t0)

    def offload_fraction(self) -> float | None:
        if len(self.scrapes) < 2:
            return None
        n = self.names
        first, last = self.scrapes[0].samples, self.scrapes[-1].samples
        all_d = _delta(first, last, n.requests_total)
        remote_d = _delta(first, last, n.requests_total, **{n.route_label: n.remote_route})
        if all_d is None or remote_d is None or all_d <= 0:
            return None
        return remote_d / all_d

    def link_bytes(self) -> float | None:
        """Bytes the link carried between the opening and the closing scrape."""
        if len(self.scrapes) < 2:
            return None
        return _delta(self.scrapes[0].samples, self.scrapes[-1].samples, self.names.link_bytes_total)

    def link_series(self) -> dict[str, list[float]]:
        """Per scrape interval: time (end of interval), link bits/s and utilization (None if unknown)."""
        n = self.names
        out: dict[str, list] = {"t_s": [], "link_bps": [], "link_utilization": []}
        for a, b in zip(self.scrapes, self.scrapes[1:]):
            dt = b.t_s - a.t_s
            d = _delta(a.samples, b.samples, n.link_bytes_total)
            bps = d * 8 / dt if d is not None and dt > 0 else total(b.samples, n.link_bps)
            util = total(b.samples, n.link_utilization)
            cap = total(b.samples, n.link_capacity_bps)
            if util is None and bps is not None and cap:
                util = bps / cap
            out["t_s"].append(b.t_s)
            out["link_bps"].append(bps)
            out["link_utilization"].append(util)
        return out

    def summary(self) -> dict:
        series = self.link_series()
        utils = [u for u in series["link_utilization"] if u is not None]
        return {
            "url": self.url,
            "scrapes": len(self.scrapes),
            "failed_scrapes": self.failures,
            "offload_fraction": self.offload_fraction(),
            "link_bytes": self.link_bytes(),
            "link_utilization_mean": sum(utils) / len(utils) if utils else None,
            "link_utilization_max": max(utils) if utils else None,
        }


def _delta(a: Samples, b: Samples, name: str, **labels: str) -> float | None:
    va, vb = total(a, name, **labels), total(b, name, **labels)
    if vb is None:
        return None
    return vb - (va or 0.0)
