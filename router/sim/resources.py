"""Simulated servers: FIFO prefill instance, processor-sharing link, batched decode; each instance's
prefix cache is the router's own model of it (``router.prefix_index.ApproxIndex``, leaves evicted first).

The link and decode use a virtual-time trick: every active flow (batch member) advances by the same
amount V per second (link: bytes, decode: tokens), so a member finishes when V reaches its start V plus
its size; a change of rate or membership only re-scales dV/dt. Each event is O(log n).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from ..planner.curves import Curve
from ..prefix_index import ApproxIndex
from .workload import SimRequest


@dataclass(slots=True)
class PrefillServer:
    """One prefill instance: FIFO queue, one request computed at a time (service = prefill_s(uncached))."""

    name: str
    pool: str  # "prfaas" | "local_prefill"
    prefill_s: Curve
    cache: ApproxIndex
    queue: deque = field(default_factory=deque)
    current: SimRequest | None = None
    queued_tokens: int = 0
    busy_s: float = 0.0  # service time of finished requests
    cur_start: float = 0.0

    def busy_until(self, now: float) -> float:
        """Cumulative busy seconds up to ``now``."""
        return self.busy_s + (now - self.cur_start if self.current is not None else 0.0)

    def start_next(self, now: float) -> float | None:
        """Start the queue head if idle; returns its finish time."""
        if self.current is not None or not self.queue:
            return None
        req = self.current = self.queue.popleft()
        req.prefill_start, self.cur_start = now, now
        return now + req.fetch_s + self.prefill_s.at(req.incremental)

    def finish(self, now: float) -> SimRequest:
        req, self.current = self.current, None
        req.prefill_end = now
        self.busy_s += now - self.cur_start
        self.queued_tokens -= req.incremental
        return req


class PSLink:
    """Inter-DC link shared equally by active transfers (multi-connection TCP), bandwidth may vary."""

    def __init__(self, rate_Bps: float) -> None:
        self.rate = rate_Bps
        self.v = 0.0  # bytes each active flow has received so far (virtual)
        self.last = 0.0
        self.heap: list[tuple[float, int, SimRequest]] = []
        self.sum_finish_v = 0.0
        self.added_bytes = 0.0
        self.version = 0  # bumped on every change; stale completion events carry an old one

    def _advance(self, now: float) -> None:
        if self.heap:
            self.v += (now - self.last) * self.rate / len(self.heap)
        self.last = now

    def add(self, req: SimRequest, nbytes: float, now: float) -> None:
        self._advance(now)
        fv = self.v + nbytes
        heapq.heappush(self.heap, (fv, req.rid, req))
        self.sum_finish_v += fv
        self.added_bytes += nbytes
        self.version += 1

    def set_rate(self, rate_Bps: float, now: float) -> None:
        self._advance(now)
        self.rate = rate_Bps
        self.version += 1

    def next_done(self) -> float | None:
        if not self.heap:
            return None
        return self.last + max(self.heap[0][0] - self.v, 0.0) * len(self.heap) / self.rate

    def pop_done(self, now: float) -> list[SimRequest]:
        self._advance(now)
        done = []
        eps = 1e-9 * (abs(self.v) + self.rate)  # float slack: a bump of V by one ulp must end a flow
        while self.heap and self.heap[0][0] <= self.v + eps:
            fv, _, req = heapq.heappop(self.heap)
            self.sum_finish_v -= fv
            done.append(req)
        if done:
            self.version += 1
        return done

    def in_flight(self, now: float) -> float:
        """Bytes of started transfers not yet delivered."""
        n = len(self.heap)
        v = self.v + ((now - self.last) * self.rate / n if n else 0.0)
        return max(self.sum_finish_v - n * v, 0.0)


class DecodeServer:
    """Continuous batching up to ``max_batch``; every member advances one token per step(batch) seconds."""

    def __init__(self, name: str, max_batch: int, step_s: Curve, cache: ApproxIndex) -> None:
        self.name, self.max_batch, self.step_s, self.cache = name, max_batch, step_s, cache
        self.v = 0.0  # tokens decoded by every active member so far (virtual)
        self.last = 0.0
        self.heap: list[tuple[float, int, SimRequest]] = []
        self.waiting: deque[SimRequest] = deque()
        self.version = 0
        self.batch_s = 0.0  # integral of batch size over time (for utilisation)

    def _advance(self, now: float) -> None:
        n = len(self.heap)
        if n:
            self.v += (now - self.last) / self.step_s.at(n)
            self.batch_s += (now - self.last) * n
        self.last = now

    def inflight(self) -> int:
        return len(self.heap) + len(self.waiting)

    def arrive(self, req: SimRequest, now: float) -> None:
        self._advance(now)
        self.waiting.append(req)
        self._admit(now)

    def _admit(self, now: float) -> None:
        while self.waiting and len(self.heap) < self.max_batch:
            req = self.waiting.popleft()
            req.decode_start = now
            heapq.heappush(self.heap, (self.v + req.output_len, req.rid, req))
            self.version += 1

    def next_done(self) -> float | None:
        if not self.heap:
            return None
        return self.last + max(self.heap[0][0] - self.v, 0.0) * self.step_s.at(len(self.heap))

    def pop_done(self, now: float) -> list[SimRequest]:
        self._advance(now)
        done = []
        eps = 1e-9 * (abs(self.v) + 1.0)
        while self.heap and self.heap[0][0] <= self.v + eps:
            req = heapq.heappop(self.heap)[2]
            req.decode_end = now
            done.append(req)
        if done:
            self.version += 1
            self._admit(now)
        return done
