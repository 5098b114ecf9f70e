"""Discrete-event simulator of the PrfaaS cluster, the local PD cluster and the link between them.

Every routing decision is made by the router's own policy object (``router.policy``) from the same
``RouteInput`` the router process builds; the long-term controller runs on simulated time.

Request timeline (seconds):
  arrival ─ queue ─ prefill_start ─────────── prefill_end ─┬─ kv_ready ─ queue ─ decode_start ─ decode_end
                    └ remote: KV streams over the link from prefill_start (pipelined) ┘
  kv_ready = max(link transfer done, prefill_end + the tail's transfer) (cost.kv_ready_s; the tail is the
  last chunk's or, layer-wise, its last group's pages: cost.Streaming); local prefill: kv_ready =
  prefill_end (intra-cluster RDMA never binds, as in the paper). TTFT = decode_start − arrival (SGLang's
  first token comes with the prefill, the user sees it once decode admits the request).
Every prefill writes what it computes through to one shared store (``self.store``, as large as all their
caches): under the abundant and auto cache rules a prefill credited a prefix from it (router/crossfetch.py)
first loads it for the decision's predicted ``fetch_s``, then computes the increment. Those bytes are not
put on the PrfaaS -> decode link model.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections import Counter
from dataclasses import dataclass

from ..controller import LongTermController
from ..cost import ModelCost, Streaming, kv_ready_s
from ..planner.curves import ProfileError
from ..planner.model import System
from ..policy import InstanceView, LinkView, RouteInput, make_policy
from ..prefix_index import ApproxIndex
from .config import SimConfig
from .resources import DecodeServer, PrefillServer, PSLink
from .switching import SplitMover, Switch
from .workload import SimRequest

ARRIVE, PREFILL_DONE, LINK, KV_READY, DECODE, BANDWIDTH, TICK, SWITCH = range(8)


def model_cost(sys: System, streaming: Streaming = Streaming()) -> ModelCost:
    """The policy's cost model: linear KV bytes and quadratic prefill fits of the scenario's profiles, and
    the servers' streaming settings (the tail)."""
    lo, hi = max(sys.dist.lo, 1.0), sys.dist.hi
    c0, c1 = sys.kv_bytes.fit_poly(1, lo, hi)
    remote = sys.remote.prefill_s if sys.remote is not None else sys.local.prefill_s
    return ModelCost(kv_bytes_per_token=max(c1, 1e-9), state_bytes=max(c0, 0.0),
                     local_coef=sys.local.prefill_s.fit_poly(2, lo, hi), remote_coef=remote.fit_poly(2, lo, hi),
                     streaming=streaming)


@dataclass(frozen=True, slots=True)
class Sample:
    """Resource state over one sampling interval ending at ``t``."""

    t: float
    link_frac: float  # available bandwidth / configured
    link_util: float  # delivered bytes / configured capacity
    prfaas_util: float  # busy fraction, mean over PrfaaS instances
    local_prefill_util: float
    decode_util: float  # mean batch / max batch
    threshold: float
    n_prefill: int = 0  # local prefill servers serving at ``t`` (not draining, not restarting)
    n_decode: int = 0


class Simulator:
    def __init__(self, sys: System, cfg: SimConfig, split: tuple[int, int], threshold: float,
                 requests: list[SimRequest]) -> None:
        n_p, n_d = split
        if n_p < 0 or n_d < 1 or n_p + n_d != sys.n_local:
            raise ProfileError(f"sim.prefill: expected 0 <= prefill < local.instances = {sys.n_local}, got {n_p}")
        self.sys, self.cfg, self.reqs = sys, cfg, requests
        cap = cfg.cache_blocks
        remote = [PrefillServer(f"prfaas-{i}", "prfaas", sys.remote.prefill_s, ApproxIndex(cap))
                  for i in range(sys.n_remote if sys.remote is not None else 0)]
        local = [PrefillServer(f"pd-p-{i}", "local_prefill", sys.local.prefill_s, ApproxIndex(cap))
                 for i in range(n_p)]
        self.prefill = {s.name: s for s in remote + local}
        self.store = ApproxIndex(cap * len(self.prefill))
        self.decode = {f"pd-d-{i}": DecodeServer(f"pd-d-{i}", sys.local.decode_max_batch, sys.local.decode_step_s,
                                                 ApproxIndex(cap)) for i in range(n_d)}
        params = dataclasses.replace(cfg.policy_params, threshold=int(threshold))
        self.cost = model_cost(sys, cfg.kv_stream)
        self.policy = make_policy(cfg.policy, params, self.cost)
        self.link = PSLink(sys.link_Bps * self._bw_at(0.0))
        self.committed = 0.0  # KV bytes routed remote whose transfer has not started
        self.ctl = LongTermController(cfg.controller_params, sys, split, threshold) if cfg.controller else None
        self.draining: set[str] = set()  # servers the policy must not pick (a move drains them)
        self.assigned: Counter[str] = Counter()  # requests routed to each decode and not finished there
        self.retired = {"prfaas": 0.0, "local_prefill": 0.0, "decode": 0.0}  # busy / batch-s of moved servers
        self.mover = SplitMover(self, cfg.switch_params, cfg.switch_s) if cfg.actuate and cfg.controller else None
        self.heap: list = []
        self.seq = 0
        self.samples: list[Sample] = []
        self.end_arrivals = max((r.arrival for r in requests), default=0.0)
        self._last = (0.0, 0.0, 0.0, 0.0, 0.0)  # t, delivered bytes, prfaas busy, local busy, decode batch-s

    def _bw_at(self, t: float) -> float:
        frac = 1.0
        for start, f in self.cfg.bandwidth_trace:
            if start <= t:
                frac = f
        return frac

    def push(self, t: float, kind: int, obj=None, version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, obj, version))

    def run(self) -> float:
        """Simulate until all work is done or duration + drain passes; returns wall seconds taken."""
        wall = time.perf_counter()
        for r in self.reqs:
            self.push(r.arrival, ARRIVE, r)
        for t, f in self.cfg.bandwidth_trace:
            self.push(t, BANDWIDTH, f)
        self.push(self.cfg.sample_s, TICK)
        stop = self.end_arrivals + self.cfg.drain_s
        handlers = (self.on_arrive, self.on_prefill_done, self.on_link, self.on_kv_ready, self.on_decode,
                    self.on_bandwidth, self.on_tick, self.on_switch)
        while self.heap:
            now, _, kind, obj, version = heapq.heappop(self.heap)
            if now > stop:
                break
            handlers[kind](now, obj, version)
        return time.perf_counter() - wall

    # ------------------------------------------------------------ routing
    def _cached(self, cache: ApproxIndex, req: SimRequest) -> int:
        if cache.capacity <= 0 or not req.hashes:
            return 0
        # at least one token is always computed (SGLang re-runs the last token to get logits)
        return min(cache.match(req.hashes) * self.cfg.block_tokens, req.input_len - 1)

    def route_input(self, req: SimRequest, now: float) -> RouteInput:
        out = self.draining
        views = [InstanceView(s.name, s.pool, s.name not in out, s.queued_tokens,
                              len(s.queue) + (s.current is not None), self._cached(s.cache, req))
                 for s in self.prefill.values()]
        # A decode's load is what the router counts: every request routed there and not finished (forward.py holds
        # dec.inflight from routing to the end of the response), not only those whose KV already arrived: counting
        # arrivals alone sent a burst's requests, still in prefill or on the link, to the same decode.
        views += [InstanceView(d.name, "decode", d.name not in out, 0, self.assigned[d.name],
                               self._cached(d.cache, req)) for d in self.decode.values()]
        rate_bps = self.link.rate * 8
        link = LinkView(self.sys.link_Bps * 8, rate_bps, self.link.in_flight(now), 0.0, self.committed)
        return RouteInput(req.input_len, tuple(views), link, now, waited_s=now - req.arrival,
                          store_prefix=self._cached(self.store, req), store_readers=frozenset(self.prefill))

    def on_arrive(self, now: float, req: SimRequest, _v: int) -> None:
        inp = self.route_input(req, now)
        dec = self.policy.decide(inp)
        if dec.pace_s > 0:  # paced: the router holds it, then decides again
            req.held_s = now + dec.pace_s - req.arrival
            self.push(now + dec.pace_s, ARRIVE, req)
            return
        req.route, req.reason, req.prefill, req.decode = dec.route, dec.reason, dec.prefill, dec.decode
        req.incremental, req.fetch_s = max(dec.incremental_len, 1), dec.fetch_s
        self.assigned[dec.decode] += 1
        if self.ctl is not None:
            self.ctl.observe(req.incremental, now)
        if dec.route == "prfaas":
            dview = next(v for v in inp.instances if v.name == dec.decode)
            req.kv_bytes = self.sys.kv_bytes.at(req.input_len - dview.cached_prefix)
            self.committed += req.kv_bytes
        srv = self.prefill[dec.prefill]
        srv.queue.append(req)
        srv.queued_tokens += req.incremental
        self._start(srv, now)

    # ------------------------------------------------------------ prefill and link
    def _start(self, srv: PrefillServer, now: float) -> None:
        fin = srv.start_next(now)
        if fin is None:
            return
        self.push(fin, PREFILL_DONE, srv)
        req = srv.current
        if srv.pool == "prfaas":
            self.committed -= req.kv_bytes
            self.link.add(req, req.kv_bytes, now)
            self._link_wakeup()

    def _link_wakeup(self) -> None:
        t = self.link.next_done()
        if t is not None:
            self.push(t, LINK, None, self.link.version)

    def _tail_s(self, req: SimRequest) -> float:
        return min(req.kv_bytes, self.cost.tail_bytes(req.incremental)) / self.link.rate

    def on_prefill_done(self, now: float, srv: PrefillServer, _v: int) -> None:
        req = srv.finish(now)
        srv.cache.insert(req.hashes) if srv.cache.capacity > 0 else None
        self.store.insert(req.hashes)
        if srv.pool != "prfaas":
            self.push(now, KV_READY, req)
        elif not math.isnan(req.link_done):
            self.push(kv_ready_s(now, req.link_done, self._tail_s(req)), KV_READY, req)
        self._start(srv, now)

    def on_link(self, now: float, _obj, version: int) -> None:
        if version != self.link.version:
            return
        for req in self.link.pop_done(now):
            req.link_done = now
            if not math.isnan(req.prefill_end):
                self.push(kv_ready_s(req.prefill_end, now, self._tail_s(req)), KV_READY, req)
        self._link_wakeup()

    def on_bandwidth(self, now: float, frac: float, _v: int) -> None:
        self.link.set_rate(self.sys.link_Bps * frac, now)
        self._link_wakeup()

    # ------------------------------------------------------------ decode
    def on_kv_ready(self, now: float, req: SimRequest, _v: int) -> None:
        req.kv_ready = now
        d = self.decode[req.decode]
        d.arrive(req, now)
        if d.cache.capacity > 0:
            d.cache.insert(req.hashes)
        self._decode_wakeup(d)

    def _decode_wakeup(self, d: DecodeServer) -> None:
        t = d.next_done()
        if t is not None:
            self.push(t, DECODE, d, d.version)

    def on_decode(self, now: float, d: DecodeServer, version: int) -> None:
        if version != d.version:
            return
        for req in d.pop_done(now):
            self.assigned[req.decode] -= 1
        self._decode_wakeup(d)

    # ------------------------------------------------------------ sampling and the controller
    def on_tick(self, now: float, _obj, _v: int) -> None:
        for d in self.decode.values():
            d._advance(now)
        delivered = self.link.added_bytes - self.link.in_flight(now)
        busy = [self.retired[p] + sum(s.busy_until(now) for s in self.prefill.values() if s.pool == p)
                for p in ("prfaas", "local_prefill")]
        batch = self.retired["decode"] + sum(d.batch_s for d in self.decode.values())
        t0, b0, r0, l0, d0 = self._last
        dt = now - t0
        n_r = sum(s.pool == "prfaas" for s in self.prefill.values())
        n_l = len(self.prefill) - n_r
        self.samples.append(Sample(
            now, self.link.rate / self.sys.link_Bps, (delivered - b0) / (self.sys.link_Bps * dt),
            (busy[0] - r0) / (dt * n_r) if n_r else 0.0, (busy[1] - l0) / (dt * n_l) if n_l else 0.0,
            (batch - d0) / (dt * self.sys.local.decode_max_batch * len(self.decode)), float(self.policy.threshold),
            sum(s.name not in self.draining for s in self.prefill.values() if s.pool == "local_prefill"),
            sum(d.name not in self.draining for d in self.decode.values())))
        self._last = (now, delivered, busy[0], busy[1], batch)
        if self.ctl is not None:
            self.ctl.observe_link(self.link.rate * 8, now)
            upd = self.ctl.maybe_update(now)
            if upd is not None:
                self.policy.threshold = upd.threshold
                if self.mover is not None:
                    self.mover.offer(upd.recommended_split, now)
        if self.mover is not None:
            self.mover.check(now)
        if now < self.end_arrivals or any(s.current for s in self.prefill.values()):
            self.push(now + self.cfg.sample_s, TICK)

    # ------------------------------------------------------------ moving servers between roles (switching.py)
    def load_of(self, name: str) -> float:
        """What a move would have to drain: queued tokens of a prefill, requests routed to a decode."""
        return self.prefill[name].queued_tokens if name in self.prefill else self.assigned[name]

    def idle(self, name: str) -> bool:
        if name in self.prefill:
            s = self.prefill[name]
            return s.current is None and not s.queue
        return self.assigned[name] == 0

    def retire(self, name: str) -> None:
        if name in self.prefill:
            s = self.prefill.pop(name)
            self.retired[s.pool] += s.busy_s
        else:
            self.retired["decode"] += self.decode.pop(name).batch_s  # idle: its batch_s is up to date
        self.draining.discard(name)

    def push_switch(self, t: float, sw: Switch) -> None:
        self.push(t, SWITCH, sw)

    def on_switch(self, now: float, sw: Switch, _v: int) -> None:
        self.mover.ready(sw, now)

    def add_server(self, name: str, pool: str) -> None:
        cap, loc = self.cfg.cache_blocks, self.sys.local
        if pool == "local_prefill":
            self.prefill[name] = PrefillServer(name, pool, loc.prefill_s, ApproxIndex(cap))
        else:
            self.decode[name] = DecodeServer(name, loc.decode_max_batch, loc.decode_step_s, ApproxIndex(cap))
