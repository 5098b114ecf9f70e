"""What the router knows about its servers and the inter-DC link, and the loops that keep it fresh.

All state is touched only from the router's event loop (no locks). Pollers use the shared HTTP session.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Sequence
from urllib.parse import urlparse

import aiohttp

from .config import InstanceSpec, RouterConfig
from .policy import InstanceView, LinkView, Pool, RouteInput
from .prefix_index import ApproxIndex, ExactIndex

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Instance:
    spec: InstanceSpec
    pool: Pool
    index: ApproxIndex | ExactIndex
    healthy: bool = True
    failed_probes: int = 0  # consecutive /health failures
    server_queued_tokens: int = 0  # /v1/loads: waiting uncached tokens (prefill) or used tokens (decode)
    server_reqs: int = 0  # /v1/loads: running + waiting requests
    inflight: int = 0  # requests this router has open there
    inflight_tokens: int = 0  # uncached tokens of those requests

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def host(self) -> str:
        host = urlparse(self.spec.url).hostname or "127.0.0.1"
        return f"[{host}]" if ":" in host else host

    def view(self, cached_prefix: int) -> InstanceView:
        # The server's count already includes what we sent once it arrived; max() avoids double counting
        # while still seeing load other routers put there.
        queued = max(self.server_queued_tokens, self.inflight_tokens)
        return InstanceView(self.name, self.pool, self.healthy, queued, max(self.inflight, self.server_reqs),
                            cached_prefix)


@dataclass(slots=True)
class LinkState:
    """The router's view of the inter-DC link.

    Each remote attempt registers its KV bytes with an estimated prefill start (now + the PrfaaS queue
    wait): before that time its bytes are *queued*, after it *in flight* (SGLang streams KV while the
    prefill runs), until decode's first bytes arrive and the attempt calls ``done``.
    """

    capacity_bps: float
    goodput_bps: float = 0.0  # from the transport stats URL, 0 if unknown
    queue_delay_s: float = 0.0
    stats_ok: bool = False
    transfers: dict[int, tuple[float, float]] = field(default_factory=dict)  # id -> (start s, KV bytes)
    next_id: int = 0

    def add(self, nbytes: float, start_at: float) -> int:
        """Register a remote attempt's KV; returns the id to pass to ``done``."""
        self.next_id += 1
        self.transfers[self.next_id] = (start_at, nbytes)
        return self.next_id

    def done(self, tid: int) -> None:
        self.transfers.pop(tid, None)

    def split(self, now: float) -> tuple[float, float]:
        """(bytes in flight, bytes queued) at monotonic time ``now``."""
        moving = queued = 0.0
        for start, nbytes in self.transfers.values():
            if start <= now:
                moving += nbytes
            else:
                queued += nbytes
        return moving, queued

    def view(self, now: float) -> LinkView:
        moving, queued = self.split(now)
        return LinkView(self.capacity_bps, self.goodput_bps, moving, self.queue_delay_s, queued)


@dataclass(slots=True)
class Cluster:
    cfg: RouterConfig
    instances: dict[str, Instance] = field(default_factory=dict)
    link: LinkState = field(init=False)

    def __post_init__(self) -> None:
        self.link = LinkState(self.cfg.link_gbps * 1e9)
        cap_blocks = max(1, self.cfg.prefix_capacity_tokens // self.cfg.block_size)
        for pool in ("prfaas", "local_prefill", "decode"):
            for spec in getattr(self.cfg, pool):
                index = ExactIndex(self.cfg.block_size) if spec.kv_events else ApproxIndex(cap_blocks)
                self.instances[spec.name] = Instance(spec, pool, index)

    def route_input(self, prompt_len: int, hashes: Sequence[int], now: float) -> RouteInput:
        b = self.cfg.block_size
        views = tuple(i.view(i.index.match(hashes) * b) for i in self.instances.values())
        return RouteInput(prompt_len, views, self.link.view(now), now, self.cfg.decode_affinity_slack)

    def pool(self, pool: Pool) -> list[Instance]:
        return [i for i in self.instances.values() if i.pool == pool]


# ---------------------------------------------------------------- pollers


async def _get_json(session: aiohttp.ClientSession, url: str, timeout_s: float) -> dict | None:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                return None
            return await r.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


def apply_loads(inst: Instance, payload: dict) -> None:
    """Fold a ``GET /v1/loads?include=core`` answer (one entry per DP rank) into ``inst``."""
    loads = payload.get("loads") or []
    reqs = sum(int(x.get("num_running_reqs", 0)) + int(x.get("num_waiting_reqs", 0)) for x in loads)
    key = "num_used_tokens" if inst.pool == "decode" else "num_waiting_uncached_tokens"
    inst.server_queued_tokens = sum(int(x.get(key, 0)) for x in loads)
    inst.server_reqs = reqs


def apply_link_stats(link: LinkState, payload: dict) -> None:
    """Transport stats JSON: ``goodput_bps`` (bits/s) and ``queue_delay_s``; other keys ignored.

    Either may be a number or, as prfaas_sgl.transfer's snapshot writes them, a dict: goodput per window
    (``{"1s": .., "10s": ..}``, the shortest window is used) and a queue-delay summary (its ``mean``).
    """
    link.goodput_bps = _stat(payload.get("goodput_bps", 0.0), "goodput")
    link.queue_delay_s = _stat(payload.get("queue_delay_s", 0.0), "delay")
    link.stats_ok = True


def _stat(value, kind: str) -> float:
    if not isinstance(value, dict):
        return float(value)
    if kind == "delay":
        return float(value.get("mean", 0.0))
    windows = {float(k.rstrip("s")): v for k, v in value.items()}
    return float(windows[min(windows)]) if windows else 0.0


async def poll_loads(cluster: Cluster, session: aiohttp.ClientSession) -> None:
    interval = cluster.cfg.loads_interval_s
    while True:
        insts = [i for i in cluster.instances.values() if i.healthy]
        urls = [f"{i.spec.url}/v1/loads?include=core" for i in insts]
        results = await asyncio.gather(*(_get_json(session, u, interval) for u in urls))
        for inst, res in zip(insts, results):
            if res is not None:
                apply_loads(inst, res)
        if cluster.cfg.transport_stats_url:
            res = await _get_json(session, cluster.cfg.transport_stats_url, interval)
            if res is not None:
                apply_link_stats(cluster.link, res)
            else:
                cluster.link.stats_ok = False
        await asyncio.sleep(interval)


async def check_health(cluster: Cluster, session: aiohttp.ClientSession) -> None:
    """One round of ``GET /health`` on every instance; flips ``healthy`` both ways and logs changes."""
    timeout = cluster.cfg.health_timeout_s
    insts = list(cluster.instances.values())

    async def probe(inst: Instance) -> bool:
        try:
            async with session.get(f"{inst.spec.url}/health", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    for inst, ok in zip(insts, await asyncio.gather(*(probe(i) for i in insts))):
        # A CPU/GPU-saturated SGLang server can miss one probe while it computes a long prefill; only a
        # run of failures takes it out of rotation. A request that fails takes it out at once (mark_unhealthy).
        inst.failed_probes = 0 if ok else inst.failed_probes + 1
        healthy = ok or (inst.healthy and inst.failed_probes < cluster.cfg.unhealthy_after)
        if healthy != inst.healthy:
            log.warning("instance %s (%s) is now %s", inst.name, inst.spec.url, "healthy" if healthy else "UNHEALTHY")
        inst.healthy = healthy


async def health_loop(cluster: Cluster, session: aiohttp.ClientSession) -> None:
    while True:
        await asyncio.sleep(cluster.cfg.health_interval_s)
        await check_health(cluster, session)


def mark_unhealthy(inst: Instance, why: str) -> None:
    if inst.healthy:
        log.warning("instance %s leaves rotation: %s (back after /health passes)", inst.name, why)
    inst.healthy = False

