"""What the router knows about its servers and the inter-DC link, and the loops that keep it fresh.

All state is touched only from the router's event loop (no locks). Pollers use the shared HTTP session.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence
from urllib.parse import urlparse

import aiohttp

from .breaker import Breaker
from .config import InstanceSpec, RouterConfig
from .crossfetch import SharedStore, parse_members
from .link_stats import CounterRates, Sample, combine_samples, count, link_sample, short
from .policy import InstanceView, LinkView, Pool, RouteInput
from .prefix_index import ApproxIndex, ExactIndex

log = logging.getLogger(__name__)

# failed polls, by what failed: an instance's /v1/loads, the transport stats, a whole round (a bug)
POLL_ERROR_KINDS = ("loads", "link_stats", "round")


@dataclass(slots=True)
class Instance:
    spec: InstanceSpec
    pool: Pool
    index: ApproxIndex | ExactIndex
    healthy: bool = False  # True only after a /health probe passed: a server never reached gets no traffic
    draining: bool = False  # leaving its pool (role switch): no new work, in-flight requests finish
    failed_probes: int = 0  # consecutive /health failures
    server_queued_tokens: int = 0  # /v1/loads: waiting uncached tokens (prefill) or used tokens (decode)
    server_reqs: int = 0  # /v1/loads: running + waiting requests
    inflight: int = 0  # requests this router has open there
    inflight_tokens: int = 0  # uncached tokens of those requests
    breaker: Breaker = field(default_factory=Breaker)  # transfers failing through this prefill (router/breaker.py)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def host(self) -> str:
        host = urlparse(self.spec.url).hostname or "127.0.0.1"
        return f"[{host}]" if ":" in host else host

    def view(self, cached_prefix: int, now: float | None = None) -> InstanceView:
        # The server's count already includes what we sent once it arrived; max() avoids double counting
        # while still seeing load other routers put there.
        queued = max(self.server_queued_tokens, self.inflight_tokens)
        now = time.monotonic() if now is None else now
        serves = self.healthy and not self.draining and self.breaker.allows(now)
        return InstanceView(self.name, self.pool, serves, queued, max(self.inflight, self.server_reqs), cached_prefix)


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
    stale_after_s: float = 1.0  # how long a reading outlives polls that got no answer (see ``missed``)
    good_at: float = float("-inf")  # monotonic time of the last usable reading
    transfers: dict[int, tuple[float, float]] = field(default_factory=dict)  # id -> (start s, KV bytes)
    next_id: int = 0
    rates: CounterRates = field(default_factory=CounterRates)  # goodput from the transports' byte counters
    # How busy the link was between two readings (see LinkView.drain_bps): seconds the book had bytes in flight,
    # integrated up to ``seen_at``, and (time, busy_s) at the last reading.
    busy_s: float = 0.0
    seen_at: float = float("-inf")
    busy_mark: tuple[float, float] | None = None
    busy: float = 0.0  # share of the last reading's interval with bytes in flight; 0 until two readings

    def add(self, nbytes: float, start_at: float, now: float | None = None) -> int:
        """Register a remote attempt's KV; returns the id to pass to ``done``."""
        self._advance(now)
        self.next_id += 1
        self.transfers[self.next_id] = (start_at, nbytes)
        return self.next_id

    def done(self, tid: int, now: float | None = None) -> None:
        self._advance(now)
        self.transfers.pop(tid, None)

    def _advance(self, now: float | None) -> None:
        """Integrate busy time up to ``now``. Between two calls the book is fixed, so the link has bytes in
        flight from the earliest start on (starts lie in the future while prefills queue)."""
        now = time.monotonic() if now is None else now
        if self.transfers:
            first = min(start for start, _ in self.transfers.values())
            self.busy_s += max(0.0, now - max(self.seen_at, first))
        self.seen_at = max(self.seen_at, now)

    def measured(self, sample: Sample | None, now: float | None = None) -> None:
        """A transport stats sample (see ``link_sample``), or None: no usable stats, goodput unknown (0)."""
        now = time.monotonic() if now is None else now
        self.goodput_bps, self.queue_delay_s = (sample[0], sample[1]) if sample else (0.0, 0.0)
        self.stats_ok = sample is not None
        if sample is not None:
            self.good_at = now
        self._advance(now)
        if self.busy_mark is not None and now > self.busy_mark[0]:
            self.busy = min(1.0, (self.busy_s - self.busy_mark[1]) / (now - self.busy_mark[0]))
        self.busy_mark = (now, self.busy_s)

    def missed(self, now: float) -> None:
        """A poll that got no answer (timeout, refused). The poll crosses the link it measures, so a busy link
        delays it exactly when its numbers matter: the last reading stays trusted for ``stale_after_s``.
        A malformed answer is different: ``measured(None)`` at once."""
        if now - self.good_at > self.stale_after_s:
            self.measured(None)

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
        return LinkView(self.capacity_bps, self.goodput_bps, moving, self.queue_delay_s, queued, self.busy)


@dataclass(slots=True)
class Cluster:
    cfg: RouterConfig
    instances: dict[str, Instance] = field(default_factory=dict)
    link: LinkState = field(init=False)
    poll_errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(POLL_ERROR_KINDS, 0))
    poll_failing: dict[str, str] = field(default_factory=dict)  # "kind who" -> why its last poll failed
    store: SharedStore = field(init=False)  # what the shared store tier was sent (router/crossfetch.py)

    def __post_init__(self) -> None:
        self.link = LinkState(self.cfg.link_gbps * 1e9, stale_after_s=3 * poll_timeout_s(self.cfg))
        self.store = SharedStore(parse_members(self.cfg.store_instances),
                                 self.cfg.store_capacity_tokens // self.cfg.block_size)
        cap_blocks = max(1, self.cfg.prefix_capacity_tokens // self.cfg.block_size)
        for pool in ("prfaas", "local_prefill", "decode"):
            for spec in getattr(self.cfg, pool):
                index = ExactIndex(self.cfg.block_size) if spec.kv_events else ApproxIndex(cap_blocks)
                self.instances[spec.name] = Instance(spec, pool, index, breaker=self.new_breaker())

    def new_breaker(self) -> Breaker:
        return Breaker(self.cfg.breaker_failures, self.cfg.breaker_cooldown_s)

    def route_input(self, prompt_len: int, hashes: Sequence[int], now: float) -> RouteInput:
        b = self.cfg.block_size
        views = tuple(i.view(i.index.match(hashes) * b, now) for i in self.instances.values())
        return RouteInput(prompt_len, views, self.link.view(now), now, self.cfg.decode_affinity_slack,
                          store_prefix=self.store.prefix_blocks(hashes) * b, store_readers=self.store.members)

    def pool(self, pool: Pool) -> list[Instance]:
        return [i for i in self.instances.values() if i.pool == pool]

    def probed(self, name: str, ok: bool) -> None:
        """Fold one /health probe of ``name`` (passed or not) into its ``healthy``; logs changes."""
        inst = self.instances[name]
        # A CPU/GPU-saturated SGLang server can miss one probe while it computes a long prefill; only a
        # run of failures takes it out of rotation. A request that fails takes it out at once (mark_unhealthy).
        inst.failed_probes = 0 if ok else inst.failed_probes + 1
        healthy = ok or (inst.healthy and inst.failed_probes < self.cfg.unhealthy_after)
        if healthy != inst.healthy:
            log.warning("instance %s (%s) is now %s", name, inst.spec.url, "healthy" if healthy else "UNHEALTHY")
        elif not ok and not healthy and inst.failed_probes == 1:
            log.warning("instance %s (%s) does not answer /health: no traffic until it does", name, inst.spec.url)
        inst.healthy = healthy

    def drain(self, name: str) -> None:
        """Route no new work to ``name``; requests already sent there run to their end (``inflight``)."""
        self.instances[name].draining = True
        log.warning("instance %s drains: no new requests, %d in flight finish", name, self.instances[name].inflight)

    def undrain(self, name: str) -> None:
        """Take ``name`` back into rotation in its pool (a drain called off; the server never stopped)."""
        if self.instances[name].draining:
            self.instances[name].draining = False
            log.warning("instance %s serves again", name)

    def readmit(self, name: str, pool: Pool, spec: InstanceSpec) -> None:
        """``name`` serves again, in ``pool`` at ``spec`` (a restarted server: empty cache, fresh load counts).

        Call once the server answers /health; a server with KV events keeps its index object (its subscriber
        holds it) and has it cleared, as SGLang's own cache is."""
        inst = self.instances[name]
        if isinstance(inst.index, ExactIndex):
            inst.index.cleared()
        else:
            inst.index = ApproxIndex(max(1, self.cfg.prefix_capacity_tokens // self.cfg.block_size))
        inst.spec, inst.pool = dataclasses.replace(spec, name=name), pool
        inst.server_queued_tokens = inst.server_reqs = inst.failed_probes = 0
        inst.healthy, inst.draining = True, False
        inst.breaker.reset()
        log.warning("instance %s (%s) admitted into %s", name, spec.url, pool)


# ---------------------------------------------------------------- pollers


def poll_timeout_s(cfg: RouterConfig) -> float:
    """A loaded SGLang server answers /v1/loads in 0.3-2 s (seen on CPU), and the stats poll crosses a busy
    inter-DC link: a timeout of one short poll interval made every reading flap to 'unknown'."""
    return max(cfg.loads_interval_s, 1.0)


class PollError(Exception):
    """A poll got no usable answer (connection, status, body); the poller counts it and goes on."""


class NoAnswer(ValueError):
    """A stats poll that timed out or could not connect (as opposed to a malformed answer)."""


class Unreachable(PollError):
    """No answer at all: timeout or connection error (a congested or down link), not a bad answer."""


async def _get_json(session: aiohttp.ClientSession, url: str, timeout_s: float) -> Any:
    """Parsed JSON body of ``GET url``; raises PollError. A JSON ``null`` is returned as None, not an error."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                raise PollError(f"HTTP {r.status}")
            return await r.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise Unreachable(f"{type(e).__name__}: {e}") from e
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
        raise PollError(f"not JSON: {e}") from e


def apply_loads(inst: Instance, payload: Any) -> None:
    """Fold a ``GET /v1/loads?include=core`` answer (one entry per DP rank) into ``inst``.

    Raises ValueError (and changes nothing) unless the answer is ``{"loads": [{...}, ...]}`` with counts.
    """
    loads = payload.get("loads") if isinstance(payload, dict) else None
    if not isinstance(loads, list) or not all(isinstance(x, dict) for x in loads):
        raise ValueError(f"expected {{'loads': [objects]}}, got {short(payload)}")
    key = "num_used_tokens" if inst.pool == "decode" else "num_waiting_uncached_tokens"
    reqs = sum(count(x.get("num_running_reqs", 0), "num_running_reqs")
               + count(x.get("num_waiting_reqs", 0), "num_waiting_reqs") for x in loads)
    inst.server_queued_tokens = sum(count(x.get(key, 0), key) for x in loads)
    inst.server_reqs = reqs


def apply_link_stats(link: LinkState, payload: Any) -> None:
    """Fold one transport stats answer into ``link``.

    A malformed or empty answer raises ValueError and leaves ``stats_ok=False`` with goodput and delay 0
    ("unknown": the policy then drains at capacity instead of trusting a stale number). See ``link_sample``.
    """
    try:
        sample = link_sample(payload)
    except ValueError:
        link.measured(None)
        raise
    link.measured(sample)


# ---------------------------------------------------------------- polling rounds


async def _answer(session: aiohttp.ClientSession, url: str, timeout_s: float) -> tuple[Any, str | NoAnswer]:
    """(body, "") or (None, why it failed: a NoAnswer when nothing answered)."""
    try:
        return await _get_json(session, url, timeout_s), ""
    except Unreachable as e:
        return None, NoAnswer(f"{url}: {e}")
    except PollError as e:
        return None, f"{url}: {e}"


def stats_urls(text: str) -> list[str]:
    """``transport_stats_url`` may list several endpoints (one per PrfaaS prefill / TP rank), comma-separated."""
    return [u.strip() for u in text.split(",") if u.strip()]


async def poll_link(cluster: Cluster, session: aiohttp.ClientSession, timeout_s: float) -> None:
    """One read of every transport stats URL into ``cluster.link``; all must answer for stats to count."""
    urls = stats_urls(cluster.cfg.transport_stats_url)
    if not urls:
        return
    answers = await asyncio.gather(*(_answer(session, u, timeout_s) for u in urls))
    now, rates = time.monotonic(), cluster.link.rates
    try:
        sample = combine_samples([_sample_of(url, body, why, rates, now) for url, (body, why) in zip(urls, answers)])
    except ValueError as e:
        if isinstance(e, NoAnswer):
            cluster.link.missed(time.monotonic())
        else:
            cluster.link.measured(None)
        report_poll_error(cluster, "link_stats", "transport", str(e))
        return
    cluster.link.measured(sample)
    poll_recovered(cluster, "link_stats", "transport")


def _sample_of(url: str, body: Any, why: str, rates: CounterRates, now: float) -> Sample:
    if isinstance(why, NoAnswer):
        raise why
    if why:
        raise ValueError(why)
    try:
        return link_sample(body, rates, url, now)
    except ValueError as e:
        raise ValueError(f"{url}: {e}") from e


async def poll_loads_once(cluster: Cluster, session: aiohttp.ClientSession) -> None:
    """``GET /v1/loads`` of every healthy instance, then the transport stats; bad answers are counted."""
    timeout = poll_timeout_s(cluster.cfg)
    insts = [i for i in cluster.instances.values() if i.healthy]
    urls = [f"{i.spec.url}/v1/loads?include=core" for i in insts]
    answers = await asyncio.gather(*(_answer(session, u, timeout) for u in urls))
    for inst, (body, why) in zip(insts, answers):
        try:
            if why:
                raise ValueError(why)
            apply_loads(inst, body)
        except ValueError as e:
            report_poll_error(cluster, "loads", inst.name, str(e))
            continue
        poll_recovered(cluster, "loads", inst.name)
    await poll_link(cluster, session, timeout)


async def poll_loads(cluster: Cluster, session: aiohttp.ClientSession) -> None:
    """Runs for the router's lifetime: nothing an instance answers, and no bug in one round, ends it."""
    while True:
        try:
            await poll_loads_once(cluster, session)
        except Exception as e:  # noqa: BLE001 - without this loop every instance's load goes stale
            report_poll_error(cluster, "round", "poller", f"{type(e).__name__}: {e}", exc_info=True)
        await asyncio.sleep(cluster.cfg.loads_interval_s)


def report_poll_error(cluster: Cluster, kind: str, who: str, why: str, exc_info: bool = False) -> None:
    """Count one failed poll (``cluster.poll_errors[kind]``); log only when ``who``'s reason changes, since a
    broken endpoint fails every interval."""
    cluster.poll_errors[kind] = cluster.poll_errors.get(kind, 0) + 1
    if cluster.poll_failing.get(f"{kind} {who}") != why:
        log.warning("%s poll of %s failed: %s", kind, who, why, exc_info=exc_info)
    cluster.poll_failing[f"{kind} {who}"] = why


def poll_recovered(cluster: Cluster, kind: str, who: str) -> None:
    if cluster.poll_failing.pop(f"{kind} {who}", None) is not None:
        log.warning("%s poll of %s answers again", kind, who)


async def check_health(cluster: Cluster, session: aiohttp.ClientSession) -> None:
    """One round of ``GET /health`` on every instance; flips ``healthy`` both ways and logs changes.

    An instance starts out of rotation (unknown) and enters it at its first passing probe: the router runs one
    round before it listens (``Router.start``), so servers that are up serve the first request."""
    timeout = cluster.cfg.health_timeout_s
    insts = list(cluster.instances.values())

    async def probe(inst: Instance) -> bool:
        try:
            async with session.get(f"{inst.spec.url}/health", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    for inst, ok in zip(insts, await asyncio.gather(*(probe(i) for i in insts))):
        cluster.probed(inst.name, ok)


async def health_loop(cluster: Cluster, session: aiohttp.ClientSession) -> None:
    while True:
        await asyncio.sleep(cluster.cfg.health_interval_s)
        await check_health(cluster, session)


def mark_unhealthy(inst: Instance, why: str) -> None:
    if inst.healthy:
        log.warning("instance %s leaves rotation: %s (back after /health passes)", inst.name, why)
    inst.healthy = False

